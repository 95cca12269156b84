//! Group commit: the batcher both backends put in front of their writes.
//!
//! Callers queue work ([`queue`]); a lane (SQLite's writer thread,
//! PostgreSQL's submit, retry and authentication lanes) takes whatever is
//! queued as one batch ([`Queue::next_batch`]), runs it as one transaction
//! with one commit, and only then answers every caller. When a batch fails
//! as a whole in a way one of its items may have caused, it is run again one
//! item at a time ([`or_one_by_one`]), so one bad item fails alone.

use std::sync::Arc;

use tokio::sync::{Mutex, mpsc};

use crate::{Result, StoreError};

/// The receiving end of a work queue, shared by the lanes that take from it.
#[derive(Debug)]
pub struct Queue<T> {
    rx: Mutex<mpsc::UnboundedReceiver<T>>,
}

/// A new work queue: the sender callers queue to, and the [`Queue`] lanes
/// take batches from.
pub fn queue<T>() -> (mpsc::UnboundedSender<T>, Arc<Queue<T>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (tx, Arc::new(Queue { rx: Mutex::new(rx) }))
}

impl<T> Queue<T> {
    /// Waits for the first queued item, then takes whatever else is queued,
    /// up to `max`; `None` once every sender is gone. With `linger` > 0 it
    /// then lets the runtime run up to `linger` times (requests being parsed
    /// may be about to queue) and keeps taking while that brought more.
    /// `before_wait` runs when the lane has to wait, for the queue or for its
    /// first item (a lane gives back its connection then). The lock lets
    /// several lanes share one queue without splitting a burst item by item.
    pub async fn next_batch(
        &self,
        max: usize,
        linger: usize,
        before_wait: impl FnOnce(),
    ) -> Option<Vec<T>> {
        let mut rx = match self.rx.try_lock() {
            Ok(rx) if !rx.is_empty() => rx,
            other => {
                drop(other);
                before_wait();
                self.rx.lock().await
            }
        };
        let first = rx.recv().await?;
        let mut batch = vec![first];
        if linger == 0 {
            drain(&mut rx, &mut batch, max);
            return Some(batch);
        }
        for _ in 0..linger {
            let before = batch.len();
            drain(&mut rx, &mut batch, max);
            if batch.len() >= max {
                break;
            }
            tokio::task::yield_now().await;
            if batch.len() == before && rx.is_empty() {
                break;
            }
        }
        Some(batch)
    }
}

/// Moves what is queued into `batch` until it holds `max`.
fn drain<T>(rx: &mut mpsc::UnboundedReceiver<T>, batch: &mut Vec<T>, max: usize) {
    while batch.len() < max {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}

/// Runs a batch of items as one transaction.
pub trait RunBatch<I: Sync>: Send {
    /// The answer of one item.
    type Out: Send;
    /// Runs `items` as one transaction; one answer per item, in order.
    ///
    /// # Errors
    /// Storage failures; nothing of the batch was written.
    fn run(&mut self, items: &[I]) -> impl Future<Output = Result<Vec<Self::Out>>> + Send;
}

/// Runs `items` as one batch with `runner`; one result per item, in order.
/// When the batch fails with an error `split` accepts (one item may have
/// caused it, and nothing was written), each item runs alone with `runner`,
/// so only the items that fail on their own fail; any other error answers
/// every item.
pub async fn or_one_by_one<I: Sync, B: RunBatch<I>>(
    items: &[I],
    runner: &mut B,
    split: impl Fn(&StoreError) -> bool,
) -> Vec<Result<B::Out>> {
    let e = match runner.run(items).await {
        Ok(answers) if answers.len() == items.len() => {
            return answers.into_iter().map(Ok).collect();
        }
        Ok(_) => StoreError::Corrupt("a batch answered the wrong number of items".into()),
        Err(e) => e,
    };
    if items.len() > 1 && split(&e) {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let one = runner
                .run(std::slice::from_ref(item))
                .await
                .and_then(|mut a| {
                    a.pop()
                        .ok_or_else(|| StoreError::Corrupt("an item answered nothing".into()))
                });
            out.push(one);
        }
        return out;
    }
    items.iter().map(|_| Err(e.clone())).collect()
}
