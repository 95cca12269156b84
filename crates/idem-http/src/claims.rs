//! Waiting executors (SPEC §4, "Waiting executors at fleet scale"): the
//! long-poll claims of one instance, grouped by tenant and operation classes,
//! woken by committed changes ([`idem_store::changes`]).
//!
//! - A waiting claim costs no database work: it runs a claim query only when
//!   it is woken, never on a timer of its own.
//! - A committed event that may make a task claimable
//!   ([`EventKind::may_make_claimable`]) wakes one waiter of a group whose
//!   tenant and classes match: one task, one claim query; when the event set
//!   a backoff ([`idem_store::Change::due_in_ms`]), the waiter is woken when
//!   the backoff has passed instead.
//! - Across instances, one task wakes one claim query: the instance that
//!   committed the event wakes one of its waiters at once; an instance that
//!   heard it from another ([`idem_store::Change::remote`]) waits
//!   [`REMOTE_DEFER`] longer and wakes nobody if by then it heard that the
//!   task was leased or ended (another instance's waiter took it).
//! - Waiters of a group share what their claims learnt. A claim that found
//!   less than it asked for took all the group's claimable work but what
//!   was announced after it began; when each of those announcements woke a
//!   waiter of the group, every task the group may claim has a woken waiter
//!   on its way, and the group's work is *accounted for*. While it is, only
//!   woken waiters query: a claim that joins the group, or that got all it
//!   asked for, waits without a query (a steady stream of tasks costs one
//!   claim query per task however often the executors come back). A
//!   re-check, or a change that found no waiter of the group free, ends the
//!   accounting until a claim finds less than it asked for again; till then
//!   a joining claim queries at once, and one that got as many attempts as
//!   it asked for wakes the next waiter (there may be more work).
//! - Against lost notifications, each group's oldest waiter is woken every
//!   [`CLAIM_RECHECK`] (one query per group, whatever its size), and every
//!   group on [`Notice::Resync`].
//!
//! The groups are an in-process registry of who waits; what is claimed is
//! decided by the claim transaction in the database (`FOR UPDATE SKIP
//! LOCKED`), so a wake-up that finds nothing costs one query and nothing else.
//! A claim that finds less than it asked for accounts for its group's work
//! because a claim locks only the tasks it leases (`idem_store::ops::Claim`):
//! a claimable task it skipped is being leased by another claim. A task
//! another transaction locks for a moment without leasing it (a stale report
//! recording its evidence) can be skipped all the same; the re-check finds
//! it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_core::model::{EventKind, Serves};
use idem_store::{Notice, Store};
use tokio::sync::Notify;

/// How often the oldest waiter of every group runs a claim query with no
/// change heard: what a lost notification costs at most.
pub const CLAIM_RECHECK: Duration = Duration::from_secs(5);

/// How long after a backoff's end a waiter is woken for its task: the
/// backoff is measured on this instance's clock from the moment the change
/// is heard, later than the database's, so a small margin suffices.
pub const DUE_MARGIN: Duration = Duration::from_millis(5);

/// How much later than the instance that committed a change an instance that
/// heard it from another wakes a waiter for it, unless it hears meanwhile
/// that the task was leased or ended. The committing instance's waiter
/// claims at once (one claim transaction, a few ms), and that instance's
/// announcer holds the change until the lease can go out with it, up to
/// `TAKEN_WITHIN` (30 ms, idem-store-postgres) after it: the others hear
/// both at once and wake nobody. A change announced without its lease was
/// not taken there within 30 ms; 50 ms more covers a claim slower still. It
/// is also what a task waits longer when only other instances have waiters
/// for it: with the announcement's own delay (30 ms after a lone change,
/// `ANNOUNCE_WITHIN`, 50 ms, at most under a stream), 80–100 ms plus the
/// claim. A late leased event costs one claim query that finds nothing.
pub const REMOTE_DEFER: Duration = Duration::from_millis(50);

/// A group: the claims of one tenant, or of one pool's tenants (SPEC
/// §2.13), for one set of classes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    tenant: String,
    /// The tenants a pool key serves; `None`: `tenant` only.
    serves: Option<Serves>,
    /// Sorted, without duplicates.
    operations: Vec<String>,
}

impl GroupKey {
    /// Whether work of `operation` of `tenant` is this group's.
    fn matches(&self, tenant: &str, operation: &str) -> bool {
        let served = match &self.serves {
            None => self.tenant == tenant,
            Some(s) => s.serves(tenant),
        };
        served
            && self
                .operations
                .binary_search_by(|o| o.as_str().cmp(operation))
                .is_ok()
    }
}

#[derive(Debug, Default)]
struct Group {
    /// Oldest first.
    waiters: VecDeque<Waiter>,
    /// Bumped by every change that may make work of this group claimable,
    /// and by every re-check.
    epoch: u64,
    /// Every task the group may claim has a woken waiter on its way: a claim
    /// found less than it asked for, and since it began every matching
    /// change woke a waiter of this group and no re-check came.
    accounted: bool,
    /// `epoch` at the latest re-check or matching change that woke no waiter
    /// of this group: a claim begun before it cannot account for the work.
    unaccounted_at: u64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
    /// Woken and not yet claiming.
    woken: bool,
}

impl Group {
    /// Wakes the oldest waiter not woken yet; `false` when every one is.
    fn wake_one(&mut self) -> bool {
        self.wake_one_but(0)
    }

    /// Wakes the oldest waiter not woken yet other than `id` (ids start at 1).
    fn wake_one_but(&mut self, id: u64) -> bool {
        match self.waiters.iter_mut().find(|w| !w.woken && w.id != id) {
            Some(w) => {
                w.woken = true;
                w.wake.notify_one();
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, Default)]
struct Groups {
    next_id: u64,
    by_key: HashMap<GroupKey, Group>,
    /// Wake-ups deferred for changes heard from other instances, by task:
    /// the token of the latest ([`ClaimHub::defer`]).
    deferred: HashMap<uuid::Uuid, u64>,
}

/// The waiting claims of one instance ([`crate::AppState::claims`]).
#[derive(Debug, Default)]
pub struct ClaimHub {
    groups: Mutex<Groups>,
    /// Whether the task that listens for changes runs.
    listening: AtomicBool,
}

impl ClaimHub {
    /// Joins the group of `tenant` and `operations` as its newest waiter;
    /// leaving happens when the seat is dropped. Starts the hub's listener
    /// on `store`'s changes on first use.
    pub(crate) fn join(
        self: &Arc<Self>,
        store: &Store,
        tenant: &str,
        serves: Option<&Serves>,
        operations: &[String],
    ) -> Seat {
        self.start(store);
        self.seat_for(tenant, serves, operations)
    }

    /// Starts listening on `store`'s changes, if not yet (a server does at
    /// start-up, [`crate::AppState::start`], so a backoff that began before
    /// the first claim waited still wakes it when it ends). Needs a tokio
    /// runtime.
    pub fn start(self: &Arc<Self>, store: &Store) {
        if !self.listening.swap(true, Ordering::SeqCst) {
            tokio::spawn(listen(Arc::downgrade(self), store.changes().subscribe()));
        }
    }

    /// A seat in the group of `tenant` and `operations` (see [`ClaimHub::join`]).
    #[cfg(test)]
    fn seat(self: &Arc<Self>, tenant: &str, operations: &[String]) -> Seat {
        self.seat_for(tenant, None, operations)
    }

    /// A seat in the group of `tenant` (or the pool serving `serves`) and
    /// `operations` (see [`ClaimHub::join`]).
    fn seat_for(
        self: &Arc<Self>,
        tenant: &str,
        serves: Option<&Serves>,
        operations: &[String],
    ) -> Seat {
        let mut operations = operations.to_vec();
        operations.sort_unstable();
        operations.dedup();
        let key = GroupKey {
            tenant: tenant.to_owned(),
            serves: serves.cloned(),
            operations,
        };
        let wake = Arc::new(Notify::new());
        let mut groups = lock(&self.groups);
        groups.next_id += 1;
        let id = groups.next_id;
        groups
            .by_key
            .entry(key.clone())
            .or_default()
            .waiters
            .push_back(Waiter {
                id,
                wake: Arc::clone(&wake),
                woken: false,
            });
        Seat {
            hub: Arc::clone(self),
            key,
            id,
            wake,
        }
    }

    /// Applies `change` to the groups of its tenant whose classes include
    /// its class: one waiter among them wakes; the other groups' work is no
    /// longer accounted for.
    fn changed(&self, tenant: &str, operation: &str) {
        let mut groups = lock(&self.groups);
        let mut woke = false;
        for (key, group) in groups.by_key.iter_mut() {
            if !key.matches(tenant, operation) {
                continue;
            }
            group.epoch += 1;
            let this_woke = !woke && group.wake_one();
            woke |= this_woke;
            if !this_woke {
                group.accounted = false;
                group.unaccounted_at = group.epoch;
            }
        }
    }

    /// Whether some group waits for work of `operation` of `tenant`.
    fn awaits(&self, tenant: &str, operation: &str) -> bool {
        lock(&self.groups)
            .by_key
            .keys()
            .any(|k| k.matches(tenant, operation))
    }

    /// Defers the wake-up for a change of `task_id` heard from another
    /// instance; answers the token to hand to [`ClaimHub::deferred_due`].
    fn defer(&self, task_id: uuid::Uuid) -> u64 {
        let mut groups = lock(&self.groups);
        groups.next_id += 1;
        let token = groups.next_id;
        groups.deferred.insert(task_id, token);
        token
    }

    /// `task_id` was leased or ended: a wake-up deferred for it is dropped.
    fn taken(&self, task_id: uuid::Uuid) {
        lock(&self.groups).deferred.remove(&task_id);
    }

    /// Whether the wake-up deferred as `token` for `task_id` is still to
    /// happen (nothing took the task, no later change replaced it); it is
    /// forgotten either way.
    fn deferred_due(&self, task_id: uuid::Uuid, token: u64) -> bool {
        let mut groups = lock(&self.groups);
        if groups.deferred.get(&task_id) == Some(&token) {
            groups.deferred.remove(&task_id);
            true
        } else {
            false
        }
    }

    /// Every group: its work no longer accounted for, its oldest waiter woken.
    fn recheck_all(&self) {
        let mut groups = lock(&self.groups);
        for group in groups.by_key.values_mut() {
            group.epoch += 1;
            group.accounted = false;
            group.unaccounted_at = group.epoch;
            group.wake_one();
        }
    }

    /// How many claims wait, over how many groups (for metrics and tests).
    pub fn waiting(&self) -> (usize, usize) {
        let groups = lock(&self.groups);
        let waiters = groups.by_key.values().map(|g| g.waiters.len()).sum();
        (waiters, groups.by_key.len())
    }
}

/// The registry's lock: held for a few map operations, never across an
/// await; a panic while holding it cannot leave a half-made change that
/// matters (a waiter missed is found by the next re-check).
fn lock(m: &Mutex<Groups>) -> std::sync::MutexGuard<'_, Groups> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Listens for changes until the hub is dropped; wakes every group's oldest
/// waiter every [`CLAIM_RECHECK`].
async fn listen(hub: Weak<ClaimHub>, mut watch: idem_store::Watch) {
    let mut recheck = tokio::time::interval(CLAIM_RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    recheck.tick().await;
    loop {
        tokio::select! {
            notice = watch.next() => {
                let Some(hub) = hub.upgrade() else { return };
                match notice {
                    Notice::Change(c) if c.kind.may_make_claimable() => {
                        let due = c.due_in_ms.map(|ms| Duration::from_millis(ms) + DUE_MARGIN);
                        if c.remote {
                            // Only where a waiter may want it: one timer per
                            // change heard, none without waiters.
                            if hub.awaits(&c.tenant, &c.operation) {
                                let token = hub.defer(c.task_id);
                                let after = due.unwrap_or_default() + REMOTE_DEFER;
                                let hub = Arc::downgrade(&hub);
                                tokio::spawn(async move {
                                    tokio::time::sleep(after).await;
                                    if let Some(hub) = hub.upgrade()
                                        && hub.deferred_due(c.task_id, token)
                                    {
                                        hub.changed(&c.tenant, &c.operation);
                                    }
                                });
                            }
                        } else if let Some(after) = due {
                            let hub = Arc::downgrade(&hub);
                            tokio::spawn(async move {
                                tokio::time::sleep(after).await;
                                if let Some(hub) = hub.upgrade() {
                                    hub.changed(&c.tenant, &c.operation);
                                }
                            });
                        } else {
                            hub.changed(&c.tenant, &c.operation);
                        }
                    }
                    Notice::Change(c) => {
                        if c.kind == EventKind::AttemptLeased || c.kind.ends_task() {
                            hub.taken(c.task_id);
                        }
                    }
                    Notice::Resync => hub.recheck_all(),
                }
            }
            _ = recheck.tick() => {
                let Some(hub) = hub.upgrade() else { return };
                hub.recheck_all();
            }
        }
    }
}

/// One waiting claim's place in its group.
#[derive(Debug)]
pub(crate) struct Seat {
    hub: Arc<ClaimHub>,
    key: GroupKey,
    id: u64,
    wake: Arc<Notify>,
}

/// What [`Seat::begin`] decided.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Turn {
    /// Whether to run a claim query now.
    pub(crate) claim: bool,
    epoch: u64,
}

impl Seat {
    /// Whether to run a claim query now: yes when this waiter was woken or
    /// the group's work is not accounted for.
    pub(crate) fn begin(&self) -> Turn {
        let mut groups = lock(&self.hub.groups);
        let Some(group) = groups.by_key.get_mut(&self.key) else {
            return Turn {
                claim: true,
                epoch: 0,
            };
        };
        let woken = group
            .waiters
            .iter_mut()
            .find(|w| w.id == self.id)
            .is_some_and(|w| std::mem::replace(&mut w.woken, false));
        Turn {
            claim: woken || !group.accounted,
            epoch: group.epoch,
        }
    }

    /// Records what a claim begun at `turn` got: `got` attempts of `asked`.
    /// Fewer, with no re-check and no change that woke nobody of the group
    /// since it began, accounts for the group's work; all it asked for,
    /// while the work is not accounted for, wakes the next waiter.
    pub(crate) fn end(&self, turn: Turn, got: usize, asked: usize) {
        let mut groups = lock(&self.hub.groups);
        let Some(group) = groups.by_key.get_mut(&self.key) else {
            return;
        };
        if got < asked {
            if group.unaccounted_at <= turn.epoch {
                group.accounted = true;
            }
        } else if !group.accounted {
            group.wake_one_but(self.id);
        }
    }

    /// Until this waiter is woken.
    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }
}

impl Drop for Seat {
    /// Leaves the group; a wake-up this waiter had not used goes to the next.
    fn drop(&mut self) {
        let mut groups = lock(&self.hub.groups);
        let Some(group) = groups.by_key.get_mut(&self.key) else {
            return;
        };
        let mut unused = false;
        group.waiters.retain(|w| {
            if w.id == self.id {
                unused = w.woken;
                false
            } else {
                true
            }
        });
        if group.waiters.is_empty() {
            groups.by_key.remove(&self.key);
        } else if unused {
            group.wake_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    /// Whether `seat` was woken (a permit is waiting), without waiting.
    fn was_woken(seat: &Seat) -> bool {
        futures::FutureExt::now_or_never(seat.woken()).is_some()
    }

    #[test]
    fn a_group_found_empty_is_not_queried_again_until_a_change_of_its_class() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay", "gen"]));
        let b = hub.seat("t", &ops(&["gen", "pay", "gen"]));
        assert_eq!(hub.waiting(), (2, 1), "one group for one set of classes");
        let turn = a.begin();
        assert!(turn.claim, "a new group is not known empty");
        a.end(turn, 0, 1);
        assert!(!b.begin().claim, "found empty, and nothing changed since");
        // Another tenant's or another class's change wakes nobody here.
        hub.changed("u", "pay");
        hub.changed("t", "mail");
        assert!(!b.begin().claim);
        assert!(!was_woken(&a) && !was_woken(&b));
        // One change of a class of the group: one waiter, the oldest.
        hub.changed("t", "gen");
        assert!(was_woken(&a) && !was_woken(&b));
        assert!(a.begin().claim);
    }

    #[test]
    fn a_change_during_a_claim_wakes_a_waiter_for_its_task() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay"]));
        let b = hub.seat("t", &ops(&["pay"]));
        let turn = a.begin();
        hub.changed("t", "pay");
        a.end(turn, 0, 1);
        assert!(
            was_woken(&a) && a.begin().claim,
            "the change may have come after the claim's snapshot: the oldest waiter, \
             the claim that found nothing, claims again"
        );
        assert!(!b.begin().claim, "one claim query for one task");
    }

    #[test]
    fn one_change_wakes_one_waiter_and_a_full_claim_wakes_the_next() {
        let hub = Arc::new(ClaimHub::default());
        let seats: Vec<Seat> = (0..3).map(|_| hub.seat("t", &ops(&["pay"]))).collect();
        hub.changed("t", "pay");
        let woken: Vec<bool> = seats.iter().map(was_woken).collect();
        assert_eq!(woken, [true, false, false]);
        let turn = seats[0].begin();
        seats[0].end(turn, 1, 1);
        let woken: Vec<bool> = seats.iter().map(was_woken).collect();
        assert_eq!(woken, [false, true, false], "there may be more work");
    }

    #[test]
    fn a_wake_up_not_used_goes_to_the_next_waiter() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay"]));
        let b = hub.seat("t", &ops(&["pay"]));
        hub.changed("t", "pay");
        drop(a);
        assert!(was_woken(&b));
        drop(b);
        assert_eq!(hub.waiting(), (0, 0), "an empty group is removed");
    }

    #[test]
    fn once_found_empty_a_task_announced_costs_one_claim_query() {
        let hub = Arc::new(ClaimHub::default());
        let seats: Vec<Seat> = (0..3).map(|_| hub.seat("t", &ops(&["pay"]))).collect();
        let turn = seats[0].begin();
        seats[0].end(turn, 0, 1);
        hub.changed("t", "pay");
        let woken: Vec<bool> = seats.iter().map(was_woken).collect();
        assert_eq!(woken, [true, false, false]);
        let turn = seats[0].begin();
        assert!(turn.claim);
        seats[0].end(turn, 1, 1);
        let woken: Vec<bool> = seats.iter().map(was_woken).collect();
        assert_eq!(
            woken,
            [false, false, false],
            "the one task announced was taken"
        );
        assert!(
            !seats[0].begin().claim,
            "the group is known empty again: a claim sent again waits without a query"
        );
        // Two tasks: two waiters, and nobody else.
        hub.changed("t", "pay");
        hub.changed("t", "pay");
        let woken: Vec<bool> = seats.iter().map(was_woken).collect();
        assert_eq!(woken, [true, true, false]);
        let (t0, t1) = (seats[0].begin(), seats[1].begin());
        seats[0].end(t0, 1, 1);
        assert!(
            !was_woken(&seats[2]) && !seats[2].begin().claim,
            "the task left has the waiter it woke on its way"
        );
        seats[1].end(t1, 1, 1);
        assert!(!seats[2].begin().claim);
    }

    #[test]
    fn after_a_recheck_a_claim_that_finds_nothing_accounts_for_the_work_again() {
        let hub = Arc::new(ClaimHub::default());
        let seats: Vec<Seat> = (0..3).map(|_| hub.seat("t", &ops(&["pay"]))).collect();
        let turn = seats[0].begin();
        seats[0].end(turn, 0, 1);
        hub.recheck_all();
        // The re-check's claim finds work; a task is announced meanwhile (its
        // change wakes the oldest waiter, the one claiming).
        let t0 = seats[0].begin();
        assert!(t0.claim);
        hub.changed("t", "pay");
        seats[0].end(t0, 1, 1);
        let t0 = seats[0].begin();
        assert!(t0.claim, "woken by the change");
        let t1 = seats[1].begin();
        assert!(t1.claim, "not accounted for: the full claim woke the next");
        // Another task is announced while both claim: the group's work
        // changes during every claim from now on.
        hub.changed("t", "pay");
        seats[1].end(t1, 0, 1);
        seats[0].end(t0, 1, 1);
        let joiner = hub.seat("t", &ops(&["pay"]));
        assert!(
            !joiner.begin().claim,
            "a claim found nothing after the re-check, and every change since woke a waiter: \
             a claim sent again waits without a query"
        );
        assert!(
            !seats[2].begin().claim,
            "a full claim of accounted-for work wakes nobody"
        );
        let t0 = seats[0].begin();
        assert!(t0.claim, "woken by the second change");
        seats[0].end(t0, 1, 1);
        assert!(!seats[1].begin().claim && !seats[2].begin().claim);
    }

    #[test]
    fn after_a_recheck_or_a_change_with_no_waiter_free_a_full_claim_wakes_the_next() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay"]));
        let b = hub.seat("t", &ops(&["pay"]));
        let turn = a.begin();
        a.end(turn, 0, 1);
        // A lost notification: the re-check's claim finds work, and there
        // may be more.
        hub.recheck_all();
        let turn = a.begin();
        a.end(turn, 1, 1);
        assert!(was_woken(&b));
        let turn = b.begin();
        b.end(turn, 0, 1);
        // Changes while every waiter is busy: more work than waiters woken.
        let (ta, tb) = (a.begin(), b.begin());
        hub.changed("t", "pay");
        hub.changed("t", "pay");
        hub.changed("t", "pay");
        a.end(ta, 1, 1);
        b.end(tb, 1, 1);
        let c = hub.seat("t", &ops(&["pay"]));
        assert!(
            c.begin().claim,
            "three tasks, two waiters woken: the group's work is not accounted for"
        );
    }

    /// A random interleaving of submits and of waiters claiming, answering
    /// and coming back (each claim query takes the oldest task left at its
    /// snapshot), from `seed`. Once the submits stop and every woken waiter
    /// has claimed, no task may be left: a wake-up lost is a task that waits
    /// for the next re-check.
    fn interleaving_leaves_no_task_behind(seed: u64) {
        enum State {
            Waiting,
            Claiming {
                turn: Turn,
                deadline: bool,
            },
            Queried {
                turn: Turn,
                got: usize,
                deadline: bool,
            },
        }
        let mut rng = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let hub = Arc::new(ClaimHub::default());
        let pay = ops(&["pay"]);
        // A waiter that (re)joins: its claim sent, it queries at once or waits.
        let join = |hub: &Arc<ClaimHub>| {
            let seat = hub.seat("t", &pay);
            let turn = seat.begin();
            let state = if turn.claim {
                State::Claiming {
                    turn,
                    deadline: false,
                }
            } else {
                State::Waiting
            };
            (seat, state)
        };
        let mut waiters: Vec<(Seat, State)> = (0..(2 + seed % 12)).map(|_| join(&hub)).collect();
        let mut tasks = std::collections::BTreeSet::new();
        let mut submitted = 0u64;
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 100_000, "seed {seed}: no quiescence");
            let submitting = submitted < 40;
            let busy = waiters.iter().any(|(s, st)| {
                !matches!(st, State::Waiting)
                    || futures::FutureExt::now_or_never(s.wake.notified()).is_some() && {
                        // A permit taken to look is given back.
                        s.wake.notify_one();
                        true
                    }
            });
            if !submitting && !busy {
                break;
            }
            if submitting && next(2 + seed % 7) == 0 {
                submitted += 1;
                tasks.insert(submitted);
                hub.changed("t", "pay");
                continue;
            }
            let i = next(waiters.len() as u64) as usize;
            let (seat, state) = &mut waiters[i];
            match std::mem::replace(state, State::Waiting) {
                State::Waiting => {
                    let woken = was_woken(seat);
                    // Without a wake-up, now and then the claim's deadline.
                    let deadline = !woken && submitting && next(8) == 0;
                    if woken || deadline {
                        let turn = seat.begin();
                        if turn.claim {
                            *state = State::Claiming { turn, deadline };
                        } else if deadline {
                            waiters[i] = join(&hub);
                        }
                    }
                }
                State::Claiming { turn, deadline } => {
                    let got = tasks.pop_first().map_or(0, |_| 1);
                    *state = State::Queried {
                        turn,
                        got,
                        deadline,
                    };
                }
                State::Queried {
                    turn,
                    got,
                    deadline,
                } => {
                    seat.end(turn, got, 1);
                    if got > 0 || deadline {
                        // Answered: the executor reports and claims again.
                        waiters[i] = join(&hub);
                    }
                }
            }
        }
        assert!(
            tasks.is_empty(),
            "seed {seed}: tasks {tasks:?} left with every waiter waiting"
        );
    }

    #[test]
    fn no_interleaving_leaves_a_task_without_a_woken_waiter() {
        for seed in 1..2_000 {
            interleaving_leaves_no_task_behind(seed);
        }
    }

    #[test]
    fn a_change_heard_from_another_instance_wakes_nobody_once_its_task_was_taken() {
        let hub = Arc::new(ClaimHub::default());
        let _a = hub.seat("t", &ops(&["pay"]));
        assert!(hub.awaits("t", "pay") && !hub.awaits("t", "gen") && !hub.awaits("u", "pay"));
        let (x, y) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let tx = hub.defer(x);
        let ty = hub.defer(y);
        hub.taken(x);
        assert!(
            !hub.deferred_due(x, tx),
            "leased elsewhere: no claim query here"
        );
        assert!(
            hub.deferred_due(y, ty),
            "nobody took it: wake a waiter here"
        );
        assert!(!hub.deferred_due(y, ty), "once");
        let old = hub.defer(y);
        let new = hub.defer(y);
        assert!(!hub.deferred_due(y, old) && hub.deferred_due(y, new));
    }

    #[test]
    fn a_recheck_wakes_the_oldest_waiter_of_every_group() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay"]));
        let a2 = hub.seat("t", &ops(&["pay"]));
        let b = hub.seat("u", &ops(&["gen"]));
        for s in [&a, &b] {
            let turn = s.begin();
            s.end(turn, 0, 1);
        }
        hub.recheck_all();
        assert!(was_woken(&a) && !was_woken(&a2) && was_woken(&b));
    }
}
