//! Live events (SPEC §4, "Live events"): a task's events and the tenant feed, as JSON or
//! as Server-Sent Events streams, parsed with `eventsource-stream`.

use std::pin::Pin;

use eventsource_stream::Eventsource;
use futures::{Stream, StreamExt};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::{Client, ClientError, Event, Result, api_error, header_str};

/// One event of the tenant feed: the event, its task and class, and its
/// `cursor` (resume after it).
pub type FeedEvent = idem_api::FeedEvent<Event>;

/// A page of the tenant feed: `events` and the `next_cursor` to read after.
pub type FeedPage = idem_api::FeedPage<FeedEvent>;

/// A stream of decoded SSE events; it ends when the server ends it (a task
/// stream after the task's terminal event, any stream when the server shuts
/// down). An item is an error when the connection broke or an event did not
/// decode; resume from the last item received.
pub type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T>> + Send>>;

impl Client {
    /// `GET /v1/events?after=&limit=`: one page of the tenant's feed after
    /// `after` (a cursor from an earlier page; `None`: from the first event
    /// kept), at most `limit` (1–1000; `None`: the server's default, 100).
    ///
    /// # Errors
    /// 400 `INVALID_REQUEST` for a cursor the server did not give out or a
    /// limit out of range.
    pub async fn feed_page(&self, after: Option<&str>, limit: Option<u32>) -> Result<FeedPage> {
        let mut url = self.url("v1/events")?;
        {
            let mut q = url.query_pairs_mut();
            if let Some(after) = after {
                q.append_pair("after", after);
            }
            if let Some(limit) = limit {
                q.append_pair("limit", &limit.to_string());
            }
        }
        Ok(self.send(self.request(Method::GET, url)).await?.body)
    }

    /// `GET /v1/events` with `Accept: text/event-stream`: the tenant's feed
    /// after `after` (`None`: from the first event kept), then each new event
    /// as it commits. Resume with the last item's `cursor`.
    ///
    /// # Errors
    /// As [`Client::feed_page`], for the answer's head.
    pub async fn feed_stream(&self, after: Option<&str>) -> Result<EventStream<FeedEvent>> {
        let url = self.url("v1/events")?;
        self.stream(url, after.map(str::to_owned)).await
    }

    /// `GET /v1/tasks/{id}/events` with `Accept: text/event-stream`: the
    /// task's events after `after_seq` (`None`: all), then each new one as it
    /// commits, ending after the event that made the task terminal. A
    /// terminal task with nothing after `after_seq` gives an empty stream.
    ///
    /// # Errors
    /// 404 `NOT_FOUND` for no such task.
    pub async fn task_event_stream(
        &self,
        task_id: Uuid,
        after_seq: Option<i64>,
    ) -> Result<EventStream<Event>> {
        let url = self.url(&format!("v1/tasks/{task_id}/events"))?;
        self.stream(url, after_seq.map(|s| s.to_string())).await
    }

    /// Opens an SSE stream at `url` after `last_event_id`. Without the
    /// client's time limit: a stream lasts as long as the server keeps it
    /// open (it sends a keep-alive comment every 15 s).
    async fn stream<T: DeserializeOwned + Send + 'static>(
        &self,
        url: reqwest::Url,
        last_event_id: Option<String>,
    ) -> Result<EventStream<T>> {
        let mut rb = self
            .http
            .request(Method::GET, url)
            .bearer_auth(&self.api_key)
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = last_event_id {
            rb = rb.header("last-event-id", id);
        }
        let res = rb.send().await.map_err(ClientError::from_reqwest)?;
        let status = res.status();
        if status == StatusCode::NO_CONTENT {
            return Ok(Box::pin(futures::stream::empty()));
        }
        if !status.is_success() {
            let headers = res.headers().clone();
            let request_id = header_str(&headers, "x-request-id");
            let bytes = res.bytes().await.map_err(ClientError::from_reqwest)?;
            return Err(api_error(status, &headers, &bytes, request_id));
        }
        let code = status.as_u16();
        let events = res
            .bytes_stream()
            .eventsource()
            .map(move |item| match item {
                Ok(ev) => serde_json::from_str::<T>(&ev.data).map_err(|e| ClientError::Decode {
                    status: code,
                    message: format!("event `{}`: {e}", ev.id),
                }),
                Err(eventsource_stream::EventStreamError::Transport(e)) => {
                    Err(ClientError::from_reqwest(e))
                }
                Err(e) => Err(ClientError::Decode {
                    status: code,
                    message: e.to_string(),
                }),
            });
        Ok(Box::pin(events))
    }
}
