//! Live events (SPEC §4, "Live events"): a task's events as a Server-Sent Events stream
//! (`GET /v1/tasks/{id}/events` with `Accept: text/event-stream`), and the
//! tenant feed (`GET /v1/events`) as JSON pages or as a stream.
//!
//! A stream sends what is stored after the client's place (`Last-Event-ID`),
//! then waits in [`may_have_new_events`] (a committed change of its task or
//! tenant heard on the store's [`idem_store::changes`], from any instance)
//! and reads again. Every read is an
//! ordinary store read, so a stream sees only committed events, and resuming
//! from the last `id:` it received neither skips nor repeats one (task
//! streams: `id:` is the event's `seq`; the feed: the event's cursor,
//! [`idem_store::feed`]). A stream ends when the server drains; a task's
//! stream also ends after the event that made the task terminal.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use headers_accept::Accept;
use idem_core::model::{Event, Role, Task};
use idem_store::feed::{FeedCursor, FeedEvent};
use idem_store::{Notice, Store, Watch};
use mediatype::{MediaType, names};
use utoipa::IntoParams;
use uuid::Uuid;

use super::no_task;
use super::wire::{self, FeedPage};
use crate::auth::Caller;
use crate::problem::{Problem, shorten};
use crate::{AppResult, AppState, St};

/// How long a feed stream waits before it reads again while an event of its
/// tenant it heard of has not appeared in the feed yet. On PostgreSQL an
/// event joins the feed only once every older transaction has ended
/// ([`idem_store::feed`]), which no notification announces: such an event
/// reaches the stream within this bound after that transaction ends.
pub const EVENTS_RECHECK: Duration = Duration::from_millis(250);

/// How many [`EVENTS_RECHECK`] reads a feed stream makes after a change it
/// heard before it waits for the next change again (10 s in all).
pub const FEED_FAST_RECHECKS: u32 = 40;

/// How long a stream waits at most before it reads again when it heard
/// nothing (a lost notification costs at most this).
pub const STREAM_RECHECK: Duration = crate::wait::TASK_RECHECK;

/// How often a stream asks the database whether its key is still valid; a
/// revoked key's stream ends at its next check.
pub const KEY_RECHECK: Duration = Duration::from_secs(10);

/// When a stream's key was last checked.
struct KeyCheck {
    headers: HeaderMap,
    at: tokio::time::Instant,
}

impl KeyCheck {
    fn new(headers: &HeaderMap) -> KeyCheck {
        KeyCheck {
            headers: headers.clone(),
            at: tokio::time::Instant::now(),
        }
    }

    /// Whether the key is still valid (asked of the database every
    /// [`KEY_RECHECK`]; a store failure ends the stream too).
    async fn still_valid(&mut self, st: &AppState) -> bool {
        if self.at.elapsed() < KEY_RECHECK {
            return true;
        }
        self.at = tokio::time::Instant::now();
        crate::auth::recheck(st, &self.headers).await.is_ok()
    }
}

/// Default feed page size.
pub const DEFAULT_FEED_LIMIT: i64 = 100;

/// Waits until `tenant` (and, for a task stream, `task`) may have new
/// events: a committed event of that task (or of that tenant, for the feed)
/// heard on `watch`, a [`Notice::Resync`], [`AppState::drain`], or `recheck`
/// at most. A wake-up without new events costs one read. This is the one
/// place a stream waits. Answers whether a change (or a resync) woke it.
pub(crate) async fn may_have_new_events(
    st: &AppState,
    watch: &mut Watch,
    tenant: &str,
    task: Option<Uuid>,
    recheck: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + recheck;
    let drained = st.drained();
    tokio::pin!(drained);
    loop {
        tokio::select! {
            () = &mut drained => return false,
            () = tokio::time::sleep_until(deadline) => return false,
            notice = watch.next() => match notice {
                Notice::Resync => return true,
                Notice::Change(c) => {
                    if c.tenant == tenant && task.is_none_or(|id| id == c.task_id) {
                        return true;
                    }
                }
            },
        }
    }
}

/// `application/json`, the answer unless the stream is preferred.
const JSON: MediaType<'static> = MediaType::new(names::APPLICATION, names::JSON);

/// `text/event-stream`.
const EVENT_STREAM: MediaType<'static> = MediaType::new(names::TEXT, names::EVENT_STREAM);

/// Whether the request's `Accept` (all its lines) prefers the event stream
/// to JSON, negotiated as RFC 9110 §12.5.1 says (`headers-accept`): each
/// type takes the q-value of the most specific range that matches it, and
/// `q=0` means not acceptable. The stream needs `text/event-stream` named
/// (a wildcard alone never opens one) and acceptable, and must win: a higher
/// q than JSON, or on a tie a more specific range (`text/event-stream, */*`)
/// or one listed before JSON's. Anything else (no `Accept`, one that does
/// not parse, `*/*`, a tie) answers JSON.
pub(crate) fn wants_stream(headers: &HeaderMap) -> bool {
    let mut lines = headers.get_all(header::ACCEPT).iter();
    let Ok(accept) = <Accept as headers_core::Header>::decode(&mut lines) else {
        return false;
    };
    let named = accept
        .media_types()
        .any(|m| m.ty() == names::TEXT && m.subty() == names::EVENT_STREAM);
    named
        && accept
            .negotiate(&[JSON, EVENT_STREAM])
            .is_some_and(|best| *best == EVENT_STREAM)
}

/// The `Last-Event-ID` header, when present.
fn last_event_id(headers: &HeaderMap) -> AppResult<Option<&str>> {
    headers
        .get("last-event-id")
        .map(|v| {
            v.to_str()
                .map(str::trim)
                .map_err(|_| Problem::invalid("`Last-Event-ID` must be visible ASCII"))
        })
        .transpose()
}

fn sse<S>(stream: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// An SSE event with `id:` and the JSON of `data`.
fn sse_event(id: String, data: &impl serde::Serialize) -> SseEvent {
    match serde_json::to_string(data) {
        Ok(json) => SseEvent::default().id(id).data(json),
        // Records of the store always serialize; keep the id in any case.
        Err(_) => SseEvent::default().id(id).data("{}"),
    }
}

/// Of a task read with its whole history, the events to send after `last`
/// (`seq`) and whether the stream ends after them. It ends when the task is
/// terminal: after the last event that made it terminal
/// ([`idem_core::model::EventKind::ends_task`]), or, when the client already
/// has that one, after the events stored since.
fn next_events(task: &Task, history: Vec<Event>, last: i64) -> (Vec<Event>, bool) {
    let after = |upto: i64| -> Vec<Event> {
        history
            .iter()
            .filter(|e| e.seq > last && e.seq <= upto)
            .cloned()
            .collect()
    };
    if !task.state.is_terminal() {
        return (after(i64::MAX), false);
    }
    let end = history
        .iter()
        .rev()
        .find(|e| e.kind.ends_task())
        .map(|e| e.seq)
        .filter(|seq| *seq > last)
        .unwrap_or(i64::MAX);
    (after(end), true)
}

/// The live stream of task `id` after `last`, answered once the first read
/// succeeded (404 and 503 as for the JSON list): 204 No Content for a
/// terminal task with nothing after `last` (an EventSource does not
/// reconnect after a 204).
pub(crate) async fn task_stream(
    st: AppState,
    caller: &Caller,
    id: Uuid,
    headers: &HeaderMap,
) -> AppResult<Response> {
    let last = match last_event_id(headers)? {
        None => 0,
        Some(v) => v.parse::<i64>().ok().filter(|s| *s >= 0).ok_or_else(|| {
            Problem::invalid("`Last-Event-ID` of a task stream must be an event's `seq`")
        })?,
    };
    let store = caller.store(&st);
    let tenant = caller.0.tenant.clone();
    // Before the first read: an event committed after it is heard.
    let watch = store.changes().subscribe();
    let (task, history) = store
        .task_history(Some(&tenant), id)
        .await?
        .map_err(|r| Problem::refused(r, no_task(id)))?;
    // A place past the task's last event is none this stream gave out:
    // resuming there would silently skip every event up to it as it is
    // written, so it is refused as the feed refuses a cursor ahead of it.
    let newest = history.last().map_or(0, |e| e.seq);
    if last > newest {
        return Err(Problem::invalid(format!(
            "`Last-Event-ID` {last} is past the task's last event ({newest}): resume from an event's `seq` this stream sent"
        )));
    }
    let (first, ending) = next_events(&task, history, last);
    if ending && first.is_empty() {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let state = TaskStream {
        key: KeyCheck::new(headers),
        st,
        watch,
        store,
        tenant,
        id,
        last,
        pending: first.into(),
        ending,
    };
    Ok(sse(futures::stream::unfold(state, TaskStream::next)))
}

/// A task stream between two events.
struct TaskStream {
    st: AppState,
    key: KeyCheck,
    watch: Watch,
    store: Store,
    tenant: String,
    id: Uuid,
    /// The `seq` of the last event sent.
    last: i64,
    /// Read, not sent yet.
    pending: VecDeque<Event>,
    /// Whether the stream ends once `pending` is sent.
    ending: bool,
}

impl TaskStream {
    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, TaskStream)> {
        loop {
            if self.st.is_draining() {
                return None;
            }
            if let Some(e) = self.pending.pop_front() {
                self.last = e.seq;
                return Some((Ok(sse_event(e.seq.to_string(), &e)), self));
            }
            if self.ending {
                return None;
            }
            may_have_new_events(
                &self.st,
                &mut self.watch,
                &self.tenant,
                Some(self.id),
                crate::wait::task_recheck(self.id),
            )
            .await;
            if self.st.is_draining() || !self.key.still_valid(&self.st).await {
                return None;
            }
            match self.store.task_history(Some(&self.tenant), self.id).await {
                Ok(Ok((task, history))) => {
                    let (events, ending) = next_events(&task, history, self.last);
                    self.pending.extend(events);
                    self.ending = ending;
                }
                // The client resumes with `Last-Event-ID`.
                Ok(Err(_)) => return None,
                Err(e) => {
                    tracing::warn!(task_id = %self.id, error = %e, "task event stream ended: store failure");
                    return None;
                }
            }
        }
    }
}

/// `GET /v1/events` query (for the OpenAPI document; read by
/// [`read_feed_query`]). Each parameter at most once; any other is 400.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct FeedQuery {
    /// Read the events after this cursor (an event's `cursor` or a page's
    /// `next_cursor`; absent: from the first event kept; a cursor ahead of
    /// the feed, one no page gave out, is 400). With
    /// `Accept: text/event-stream`, a `Last-Event-ID` header takes its place.
    after: Option<String>,
    /// Most events per page, 1–1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// The feed's parameters of `pairs` (a query string's decoded pairs):
/// `after` (not parsed yet) and `limit`.
///
/// # Errors
/// 400 `INVALID_REQUEST` for an unknown parameter or a repeated one (as a
/// search answers them, [`super::search::read_query`]) and a `limit` that
/// is not an integer from 1 to [`idem_store::ops::feed::MAX_FEED_PAGE`].
pub fn read_feed_query(pairs: &[(String, String)]) -> Result<(Option<&str>, i64), Problem> {
    let max = idem_store::ops::feed::MAX_FEED_PAGE;
    let (mut after, mut limit) = (None, None);
    for (k, v) in pairs {
        let slot = match k.as_str() {
            "after" => &mut after,
            "limit" => &mut limit,
            other => {
                return Err(Problem::invalid(format!(
                    "unknown parameter `{}`; the feed takes after and limit",
                    shorten(other)
                )));
            }
        };
        if slot.replace(v.as_str()).is_some() {
            return Err(Problem::invalid(format!("`{k}` is given more than once")));
        }
    }
    let limit = match limit {
        None => DEFAULT_FEED_LIMIT,
        Some(v) => v
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                Problem::invalid(format!(
                    "`limit` must be an integer from 1 to {max} (default {DEFAULT_FEED_LIMIT}), not `{}`",
                    shorten(v)
                ))
            })?,
    };
    Ok((after, limit))
}

/// The tenant's event feed: every event of the caller's tenant (of the
/// classes its key is granted) in commit order, each with its task, class and
/// cursor. JSON pages; with `Accept: text/event-stream` a stream whose `id:`
/// is each event's cursor (resumable with `Last-Event-ID`).
#[utoipa::path(get, path = "/v1/events", tag = "tasks", params(FeedQuery),
    responses((status = 200, description = "A page of the feed, or with `Accept: text/event-stream` a stream of `FeedEvent` documents (`id:` = cursor)", content((FeedPage = "application/json"), (String = "text/event-stream"))), (status = 400, body = Problem, content_type = "application/problem+json"), (status = 401, body = Problem, content_type = "application/problem+json"), (status = 403, body = Problem, content_type = "application/problem+json"), (status = 503, body = Problem, content_type = "application/problem+json")))]
pub async fn tenant_feed(
    State(st): St,
    caller: Caller,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> AppResult<Response> {
    caller.require(Role::Client)?;
    let pairs: Vec<(String, String)> =
        form_urlencoded::parse(raw.as_deref().unwrap_or_default().as_bytes())
            .into_owned()
            .collect();
    let (after, limit) = read_feed_query(&pairs)?;
    let stream = wants_stream(&headers);
    let from = match (stream, last_event_id(&headers)?) {
        (true, Some(id)) => Some(id),
        _ => after,
    };
    let after = match from {
        None => FeedCursor::START,
        Some(c) => c
            .parse::<FeedCursor>()
            .map_err(|e| Problem::invalid(e.to_string()))?,
    };
    let store = caller.store(&st);
    let tenant = caller.0.tenant.clone();
    let watch = stream.then(|| store.changes().subscribe());
    let page = store
        .read_feed(&tenant, after, limit)
        .await?
        .map_err(|e| Problem::invalid(e.to_string()))?;
    if !stream {
        let next_cursor = page.last().map_or(after, |e| e.cursor).to_string();
        let events = page.into_iter().map(wire_event).collect();
        return Ok(Json(FeedPage {
            events,
            next_cursor,
        })
        .into_response());
    }
    let state = FeedStream {
        key: KeyCheck::new(&headers),
        fast: 0,
        watch: watch.unwrap_or_else(|| store.changes().subscribe()),
        st,
        store,
        tenant,
        after,
        limit,
        full: page.len() as i64 == limit,
        pending: page.into(),
    };
    Ok(sse(futures::stream::unfold(state, FeedStream::next)))
}

fn wire_event(e: FeedEvent) -> wire::FeedEvent {
    wire::FeedEvent {
        cursor: e.cursor.to_string(),
        task_id: e.task_id,
        operation: e.operation,
        event: e.event,
    }
}

/// A feed stream between two events.
struct FeedStream {
    st: AppState,
    key: KeyCheck,
    /// Fast re-reads left after a change heard ([`FEED_FAST_RECHECKS`]).
    fast: u32,
    watch: Watch,
    store: Store,
    tenant: String,
    /// The cursor of the last event sent (or the start).
    after: FeedCursor,
    limit: i64,
    /// Whether the last page was full (read the next one at once).
    full: bool,
    /// Read, not sent yet.
    pending: VecDeque<FeedEvent>,
}

impl FeedStream {
    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, FeedStream)> {
        loop {
            if self.st.is_draining() {
                return None;
            }
            if let Some(e) = self.pending.pop_front() {
                self.after = e.cursor;
                let e = wire_event(e);
                return Some((Ok(sse_event(e.cursor.clone(), &e)), self));
            }
            if !self.full {
                let recheck = if self.fast > 0 {
                    self.fast -= 1;
                    EVENTS_RECHECK
                } else {
                    STREAM_RECHECK
                };
                let heard =
                    may_have_new_events(&self.st, &mut self.watch, &self.tenant, None, recheck)
                        .await;
                if heard {
                    self.fast = FEED_FAST_RECHECKS;
                }
                if self.st.is_draining() || !self.key.still_valid(&self.st).await {
                    return None;
                }
            }
            match self.store.feed(&self.tenant, self.after, self.limit).await {
                Ok(page) => {
                    self.full = page.len() as i64 == self.limit;
                    self.pending.extend(page);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event feed stream ended: store failure");
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_query(s: &str) -> Result<(Option<String>, i64), Problem> {
        let pairs: Vec<(String, String)> =
            form_urlencoded::parse(s.as_bytes()).into_owned().collect();
        read_feed_query(&pairs).map(|(a, l)| (a.map(str::to_owned), l))
    }

    #[test]
    fn the_feed_query_takes_after_and_limit_once_each() {
        assert_eq!(feed_query("").unwrap(), (None, DEFAULT_FEED_LIMIT));
        assert_eq!(
            feed_query("after=3-4&limit=1000").unwrap(),
            (Some("3-4".to_owned()), 1000)
        );
        for (bad, says) in [
            ("foo=1", "unknown parameter `foo`"),
            ("after=1-1&after=1-1", "`after` is given more than once"),
            ("limit=5&limit=6", "`limit` is given more than once"),
            ("limit=0", "`limit` must be an integer from 1 to 1000"),
            ("limit=1001", "`limit` must be an integer from 1 to 1000"),
            ("limit=x", "`limit` must be an integer from 1 to 1000"),
        ] {
            let p = feed_query(bad).unwrap_err();
            assert_eq!(p.status, 400, "{bad}");
            assert!(p.detail.contains(says), "{bad}: {}", p.detail);
        }
    }

    #[test]
    fn accept_is_negotiated_by_q_value() {
        assert!(!wants_stream(&HeaderMap::new()));
        for (accept, streams) in [
            ("text/event-stream", true),
            ("Text/Event-Stream", true),
            ("text/event-stream;q=0", false),
            ("text/event-stream;q=0.000, */*;q=0.1", false),
            ("application/json;q=0.5, Text/Event-Stream;q=1", true),
            ("application/json, text/event-stream;q=0.9", false),
            ("application/json, text/event-stream", false),
            ("text/event-stream, application/json", true),
            ("text/event-stream, */*", true),
            ("text/event-stream;q=0.5, */*", false),
            ("text/*, text/event-stream;q=0", false),
            ("*/*", false),
            ("text/*", false),
            ("application/json", false),
            ("text/event-stream, this is not a media type", false),
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, accept.parse().unwrap());
            assert_eq!(wants_stream(&h), streams, "Accept: {accept}");
        }
        // Several lines are one list.
        let mut h = HeaderMap::new();
        h.append(header::ACCEPT, "application/json;q=0.2".parse().unwrap());
        h.append(header::ACCEPT, "text/event-stream".parse().unwrap());
        assert!(wants_stream(&h));
    }
}
