//! `GET /v1/tasks` without `idempotency_key`: a page of the tenant's tasks
//! ([`Client::list_tasks`]) and every page in turn ([`Client::task_pages`]).

use reqwest::Method;

use crate::{Client, Result, Task, TaskState};

/// The filters of a task search (SPEC §4 "Task search"); every one given
/// must hold. `Default` is every task, 50 a page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Any of these states (empty: any).
    pub states: Vec<TaskState>,
    /// Only this operation class.
    pub operation: Option<String>,
    /// Only tasks accepted strictly after this instant (RFC 3339).
    pub created_after: Option<String>,
    /// Only tasks accepted strictly before this instant (RFC 3339).
    pub created_before: Option<String>,
    /// Only idempotency keys starting with this text (no wildcards).
    pub idempotency_key_prefix: Option<String>,
    /// Only tasks any of whose attempts reported this provider transaction
    /// id (applied, stale, late or duplicate evidence, or an operator's resolve).
    pub external_txn_id: Option<String>,
    /// Only tasks with a suspected second effect: `suspected` (any) or
    /// `unacknowledged` (none acknowledged yet).
    pub second_effect: Option<String>,
    /// Page size, 1–200 (`None`: the server's 50).
    pub limit: Option<u32>,
}

/// One page of a task search.
pub type TaskPage = idem_api::TasksPage<Task>;

/// The pages of one search, fetched one at a time
/// ([`TaskPages::next_page`]), each after the previous one's cursor.
#[derive(Debug, Clone)]
pub struct TaskPages {
    client: Client,
    filter: TaskFilter,
    cursor: Option<String>,
    done: bool,
}

impl TaskPages {
    /// The next page's tasks; `None` once the last page was returned.
    ///
    /// # Errors
    /// As [`Client::list_tasks`]; the same call may be made again (the
    /// cursor only moves on a page that arrived).
    pub async fn next_page(&mut self) -> Result<Option<Vec<Task>>> {
        if self.done {
            return Ok(None);
        }
        let page = self
            .client
            .list_tasks(&self.filter, self.cursor.as_deref())
            .await?;
        self.cursor = page.next_cursor;
        self.done = self.cursor.is_none();
        Ok(Some(page.tasks))
    }

    /// Every remaining task, page by page.
    ///
    /// # Errors
    /// As [`TaskPages::next_page`].
    pub async fn collect_all(mut self) -> Result<Vec<Task>> {
        let mut all = Vec::new();
        while let Some(tasks) = self.next_page().await? {
            all.extend(tasks);
        }
        Ok(all)
    }
}

impl Client {
    /// `GET /v1/tasks?state=…&…&cursor=`: one page of the tenant's tasks
    /// matching `filter`, newest first, after `cursor` (a previous page's
    /// `next_cursor`; `None` for the first page).
    ///
    /// # Errors
    /// 400 `INVALID_REQUEST` for a bad filter or cursor; 403 for a class the
    /// key is not granted; timeouts and transport failures.
    pub async fn list_tasks(&self, filter: &TaskFilter, cursor: Option<&str>) -> Result<TaskPage> {
        let mut url = self.url("v1/tasks")?;
        {
            let mut q = url.query_pairs_mut();
            for s in &filter.states {
                q.append_pair("state", s.as_str());
            }
            for (name, value) in [
                ("operation", &filter.operation),
                ("created_after", &filter.created_after),
                ("created_before", &filter.created_before),
                ("idempotency_key_prefix", &filter.idempotency_key_prefix),
                ("external_txn_id", &filter.external_txn_id),
                ("second_effect", &filter.second_effect),
            ] {
                if let Some(v) = value {
                    q.append_pair(name, v);
                }
            }
            if let Some(n) = filter.limit {
                q.append_pair("limit", &n.to_string());
            }
            if let Some(c) = cursor {
                q.append_pair("cursor", c);
            }
        }
        Ok(self.send(self.request(Method::GET, url)).await?.body)
    }

    /// The pages of the search `filter`, from the newest task on.
    pub fn task_pages(&self, filter: TaskFilter) -> TaskPages {
        TaskPages {
            client: self.clone(),
            filter,
            cursor: None,
            done: false,
        }
    }
}
