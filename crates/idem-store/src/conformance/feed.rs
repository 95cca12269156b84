//! The tenant event feed (SPEC §4, "Live events", [`crate::feed`]): a reader that pages
//! from its last cursor while many transactions commit at once ends with
//! exactly the stored events, each once, each task's in `seq` order; the feed
//! holds only the caller's tenant and the classes of its key's grant.
//!
//! Out-of-order commits are what makes a plain sequence skip (PostgreSQL
//! takes sequence values at insert and shows them at commit): the writers
//! here submit, claim and report concurrently, so their transactions
//! overlap, and the readers page (7 events at a time) all along.

use super::*;
use crate::feed::{FeedCursor, FeedEvent};

/// Writers submitting, claiming and reporting concurrently.
const WRITERS: usize = 6;
/// Tasks each writer drives to delivery.
const TASKS_PER_WRITER: usize = 12;
/// Readers paging the feed while the writers work.
const READERS: usize = 2;
/// The readers' page size (small: many pages, many chances to skip).
const PAGE: i64 = 7;

/// Reads `store`'s feed of `tenant` after `after` until it holds `want`
/// events or [`PATIENCE`] ran out. On PostgreSQL an event is served once
/// every older transaction of the server has ended (other cases run in
/// other databases of the same server at once): the feed may lag, never skip.
async fn read_until(
    store: &Store,
    tenant: &str,
    mut after: FeedCursor,
    want: usize,
) -> Vec<FeedEvent> {
    let until = Instant::now() + PATIENCE;
    let mut all = Vec::new();
    while all.len() < want && Instant::now() < until {
        let page = must(store.feed(tenant, after, PAGE).await, "feed");
        match page.last() {
            Some(last) => after = last.cursor,
            None => sleep(Duration::from_millis(5)).await,
        }
        all.extend(page);
    }
    all
}

/// Every event of `tasks` as stored, by task then `seq`.
async fn stored(c: &Ctx, tasks: &BTreeSet<Uuid>) -> BTreeSet<(Uuid, i64, String)> {
    let mut all = BTreeSet::new();
    for id in tasks {
        for e in c.events(*id).await {
            all.insert((*id, e.seq, e.kind.as_str().to_owned()));
        }
    }
    all
}

/// Checks one reader's feed against the stored events: each once, cursors
/// strictly increasing, each task's events in `seq` order.
fn check_reader(r: usize, got: &[FeedEvent], expected: &BTreeSet<(Uuid, i64, String)>) {
    let mut seen = BTreeSet::new();
    let mut last_seq: BTreeMap<Uuid, i64> = BTreeMap::new();
    for pair in got.windows(2) {
        assert!(
            pair[0].cursor < pair[1].cursor,
            "reader {r}: cursors must increase: {:?} then {:?}",
            pair[0].cursor,
            pair[1].cursor
        );
    }
    for e in got {
        let key = (e.task_id, e.event.seq, e.event.kind.as_str().to_owned());
        assert!(seen.insert(key.clone()), "reader {r}: {key:?} twice");
        let prev = last_seq.insert(e.task_id, e.event.seq).unwrap_or(0);
        assert_eq!(
            e.event.seq,
            prev + 1,
            "reader {r}: task {} out of seq order in the feed",
            e.task_id
        );
    }
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    let extra: Vec<_> = seen.difference(expected).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "reader {r}: {} of {} stored events missing (e.g. {missing:?}), {} not stored (e.g. {extra:?})",
        expected.difference(&seen).count(),
        expected.len(),
        seen.difference(expected).count()
    );
}

/// While [`WRITERS`] writers each drive [`TASKS_PER_WRITER`] tasks through
/// submit, claim and report concurrently (and another tenant writes too),
/// [`READERS`] readers page tenant `acme`'s feed from their last cursor; at
/// the end each has read exactly the stored events of `acme`'s tasks, each
/// once, in strictly increasing cursor order, each task's in `seq` order.
pub async fn feed_readers_never_skip_while_writers_commit_concurrently(store: Store) {
    let c = Ctx::new(&store, "acme").await;
    let other = Ctx::new(&store, "globex").await;
    let contract = contract(SAFE);
    let done = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(WRITERS + READERS + 1));
    let mut writers = Vec::new();
    for w in 0..=WRITERS {
        // The last writer is the other tenant's.
        let (c, contract, barrier, done) = (
            if w == WRITERS {
                other.clone()
            } else {
                c.clone()
            },
            contract.clone(),
            barrier.clone(),
            done.clone(),
        );
        writers.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut ids = BTreeSet::new();
            for _ in 0..TASKS_PER_WRITER {
                ids.insert(c.create(SAFE, &contract).await.id);
                // Claims whichever task is ready (maybe another writer's).
                for cl in c.claim(&[SAFE], Some(LONG_LEASE), 1).await {
                    c.report_ok(&cl.attempt, succeeded(cl.attempt.generation))
                        .await;
                }
            }
            done.fetch_add(1, Ordering::SeqCst);
            ids
        }));
    }
    let mut readers = Vec::new();
    for _ in 0..READERS {
        let (store, barrier, done) = (store.clone(), barrier.clone(), done.clone());
        readers.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut got: Vec<FeedEvent> = Vec::new();
            while done.load(Ordering::SeqCst) <= WRITERS {
                let after = got.last().map_or(FeedCursor::START, |e| e.cursor);
                let page = must(store.feed("acme", after, PAGE).await, "feed");
                if page.is_empty() {
                    tokio::task::yield_now().await;
                }
                got.extend(page);
            }
            got
        }));
    }
    let mut tasks = BTreeSet::new();
    for (w, h) in writers.into_iter().enumerate() {
        let ids = must(h.await, "writer");
        if w < WRITERS {
            tasks.extend(ids);
        }
    }
    // Tasks claimed but not reported by their last writer stay leased: the
    // feed must hold their events all the same.
    let expected = stored(&c, &tasks).await;
    assert!(
        expected.len() >= WRITERS * TASKS_PER_WRITER * 2,
        "every task has at least its submit and lease events: {}",
        expected.len()
    );
    for (r, h) in readers.into_iter().enumerate() {
        let mut got = must(h.await, "reader");
        let after = got.last().map_or(FeedCursor::START, |e| e.cursor);
        let want = expected.len().saturating_sub(got.len());
        got.extend(read_until(&store, "acme", after, want).await);
        check_reader(r, &got, &expected);
    }
    // A reader that starts after the writers sees the same.
    check_reader(
        READERS,
        &read_until(&store, "acme", FeedCursor::START, expected.len()).await,
        &expected,
    );
}

/// The feed holds only the caller's tenant's events, and of a key limited to
/// some classes only those classes' events; another tenant's cursor shows
/// nothing of the first tenant's; every event names its task and class; a
/// page ends at its limit and the next page starts after its last cursor.
pub async fn feed_is_scoped_to_tenant_and_grant(store: Store) {
    let a = Ctx::new(&store, "acme").await;
    let b = Ctx::new(&store, "globex").await;
    let safe = a.create(SAFE, &contract(SAFE)).await;
    let non_safe = a.create(NON_SAFE, &contract(NON_SAFE)).await;
    let theirs = b.create(SAFE, &contract(SAFE)).await;

    // Once served, an event stays before the horizon: the reads below are exact.
    let all = read_until(&store, "acme", FeedCursor::START, 2).await;
    let tasks: Vec<(Uuid, &str)> = all
        .iter()
        .map(|e| (e.task_id, e.operation.as_str()))
        .collect();
    assert_eq!(
        tasks,
        vec![(safe.id, SAFE), (non_safe.id, NON_SAFE)],
        "acme's two submit events, in commit order: {all:?}"
    );
    assert!(
        all.iter()
            .all(|e| e.event.kind == EventKind::TaskSubmitted && e.event.seq == 1)
    );

    let one = must(store.feed("acme", FeedCursor::START, 1).await, "feed");
    assert_eq!(one.len(), 1, "a page ends at its limit");
    let rest = must(store.feed("acme", one[0].cursor, 10).await, "feed");
    assert_eq!(
        rest.iter().map(|e| e.task_id).collect::<Vec<_>>(),
        vec![non_safe.id],
        "the next page starts after the last cursor"
    );

    let limited = store.granted(Some(vec![SAFE.to_owned()]));
    let granted = must(limited.feed("acme", FeedCursor::START, 10).await, "feed");
    assert_eq!(
        granted.iter().map(|e| e.task_id).collect::<Vec<_>>(),
        vec![safe.id],
        "a key limited to {SAFE} sees only its events"
    );

    let globex = read_until(&store, "globex", FeedCursor::START, 1).await;
    assert_eq!(
        globex.iter().map(|e| e.task_id).collect::<Vec<_>>(),
        vec![theirs.id],
        "globex sees only its task"
    );
    let crossed = must(store.feed("globex", one[0].cursor, 10).await, "feed");
    assert!(
        crossed.iter().all(|e| e.task_id == theirs.id),
        "acme's cursor used by globex shows nothing of acme's: {crossed:?}"
    );
    assert!(
        must(store.feed("nobody", FeedCursor::START, 10).await, "feed").is_empty(),
        "a tenant without events has an empty feed"
    );

    // The task's history and state are read together.
    let (task, events) = ok2(store.task_history(Some("acme"), safe.id).await, "history");
    assert_eq!(task.id, safe.id);
    assert_eq!(events, a.events(safe.id).await);
    assert_not_found(store.task_history(Some("globex"), safe.id).await, "history");
}

/// A cursor ahead of the feed's head is refused ([`crate::feed::CursorAhead`]):
/// a position past the last one given out, or a transaction id not yet
/// served; every cursor the feed gave out, the head's included, is read, also
/// by another tenant (a cursor names no tenant) and by a key limited to other
/// classes.
pub async fn feed_refuses_a_cursor_ahead_of_its_head(store: Store) {
    let a = Ctx::new(&store, "acme").await;
    a.create(SAFE, &contract(SAFE)).await;
    let page = read_until(&store, "acme", FeedCursor::START, 1).await;
    let head = must(
        page.last().map(|e| e.cursor).ok_or(()),
        "acme's submit event",
    );
    let limited = store.granted(Some(vec![NON_SAFE.to_owned()]));
    for (who, reader, tenant) in [
        ("acme", &store, "acme"),
        ("globex", &store, "globex"),
        ("a key of another class", &limited, "acme"),
    ] {
        for given in [FeedCursor::START, head] {
            let read = must(reader.read_feed(tenant, given, 10).await, "feed");
            assert!(read.is_ok(), "{who}: {given} was given out: {read:?}");
        }
    }
    let ahead = [
        FeedCursor {
            txid: head.txid,
            position: head.position + 1,
        },
        FeedCursor {
            txid: 0,
            position: 99_999_999,
        },
        FeedCursor {
            txid: i64::MAX / 2,
            position: head.position,
        },
    ];
    for c in ahead {
        let read = must(store.read_feed("acme", c, 10).await, "feed");
        assert_eq!(read, Err(crate::feed::CursorAhead(c)), "{c} is ahead");
        assert!(
            matches!(
                store.feed("acme", c, 10).await,
                Err(crate::StoreError::Corrupt(_))
            ),
            "{c}: a reader's own cursor ahead of the head is a lost history"
        );
    }
}
