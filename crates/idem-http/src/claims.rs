//! Waiting executors (SPEC §4, "Waiting executors at fleet scale"): the
//! long-poll claims of one instance, grouped by tenant and operation classes,
//! woken by committed changes ([`idem_store::changes`]).
//!
//! - A waiting claim costs no database work: it runs a claim query only when
//!   it is woken, never on a timer of its own.
//! - A committed event that may make a task claimable
//!   ([`EventKind::may_make_claimable`]) wakes one waiter of a group whose
//!   tenant and classes match: one task, one claim query. A claim that got
//!   as many attempts as it asked for wakes the next waiter (there may be
//!   more work).
//! - Waiters of a group share what their claims learnt: a claim that found
//!   less than it asked for, with no matching change since it began, marks
//!   the group empty, and a claim that joins an empty group waits without
//!   querying.
//! - Against lost notifications, each group's oldest waiter is woken every
//!   [`CLAIM_RECHECK`] (one query per group, whatever its size), and every
//!   group on [`Notice::Resync`].
//!
//! The groups are an in-process registry of who waits; what is claimed is
//! decided by the claim transaction in the database (`FOR UPDATE SKIP
//! LOCKED`), so a wake-up that finds nothing costs one query and nothing else.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_store::{Notice, Store};
use tokio::sync::Notify;

/// How often the oldest waiter of every group runs a claim query with no
/// change heard: what a lost notification costs at most.
pub const CLAIM_RECHECK: Duration = Duration::from_secs(5);

/// A group: the claims of one tenant for one set of classes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    tenant: String,
    /// Sorted, without duplicates.
    operations: Vec<String>,
}

#[derive(Debug, Default)]
struct Group {
    /// Oldest first.
    waiters: VecDeque<Waiter>,
    /// Bumped by every change that may make work of this group claimable.
    epoch: u64,
    /// A claim found no more work and no matching change came since.
    empty: bool,
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
        operations: &[String],
    ) -> Seat {
        if !self.listening.swap(true, Ordering::SeqCst) {
            tokio::spawn(listen(Arc::downgrade(self), store.changes().subscribe()));
        }
        self.seat(tenant, operations)
    }

    /// A seat in the group of `tenant` and `operations` (see [`ClaimHub::join`]).
    fn seat(self: &Arc<Self>, tenant: &str, operations: &[String]) -> Seat {
        let mut operations = operations.to_vec();
        operations.sort_unstable();
        operations.dedup();
        let key = GroupKey {
            tenant: tenant.to_owned(),
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

    /// Applies `change` to the groups of its tenant: each group whose classes
    /// include its class is no longer empty, and one waiter among them wakes.
    fn changed(&self, tenant: &str, operation: &str) {
        let mut groups = lock(&self.groups);
        let mut woke = false;
        for (key, group) in groups.by_key.iter_mut() {
            if key.tenant != tenant
                || key
                    .operations
                    .binary_search_by(|o| o.as_str().cmp(operation))
                    .is_err()
            {
                continue;
            }
            group.epoch += 1;
            group.empty = false;
            if !woke {
                woke = group.wake_one();
            }
        }
    }

    /// Every group: not known empty, its oldest waiter woken.
    fn recheck_all(&self) {
        let mut groups = lock(&self.groups);
        for group in groups.by_key.values_mut() {
            group.epoch += 1;
            group.empty = false;
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
                    Notice::Change(c) if c.kind.may_make_claimable() => hub.changed(&c.tenant, &c.operation),
                    Notice::Change(_) => {}
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
    /// Whether to run a claim query now: yes unless the group is known empty
    /// and this waiter was not woken.
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
            claim: woken || !group.empty,
            epoch: group.epoch,
        }
    }

    /// Records what a claim begun at `turn` got: `got` attempts of `asked`.
    /// Fewer with no change since marks the group empty; all it asked for
    /// wakes the next waiter.
    pub(crate) fn end(&self, turn: Turn, got: usize, asked: usize) {
        let mut groups = lock(&self.hub.groups);
        let Some(group) = groups.by_key.get_mut(&self.key) else {
            return;
        };
        if got < asked {
            if group.epoch == turn.epoch {
                group.empty = true;
            }
        } else {
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
    fn a_change_during_a_claim_keeps_the_group_open() {
        let hub = Arc::new(ClaimHub::default());
        let a = hub.seat("t", &ops(&["pay"]));
        let b = hub.seat("t", &ops(&["pay"]));
        let turn = a.begin();
        hub.changed("t", "pay");
        a.end(turn, 0, 1);
        assert!(
            b.begin().claim,
            "the change came after the claim's snapshot"
        );
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
