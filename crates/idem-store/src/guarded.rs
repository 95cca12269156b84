//! A [`Backend`] that owns something to drop after itself: a test's scratch
//! database or temporary directory, removed once the last clone of the
//! [`crate::Store`] over it is dropped.

use crate::{Backend, BoxFuture, Clock, Op, Result};

/// `backend`, answering every call, with `guard` dropped right after it
/// (fields drop in order).
pub struct Guarded<B, G> {
    backend: B,
    _guard: G,
}

impl<B: Backend, G: Send + Sync + 'static> Guarded<B, G> {
    /// `backend` holding `guard` until it is dropped.
    pub fn new(backend: B, guard: G) -> Guarded<B, G> {
        Guarded {
            backend,
            _guard: guard,
        }
    }
}

impl<B: Backend, G: Send + Sync + 'static> Backend for Guarded<B, G> {
    fn execute(&self, op: Op) -> BoxFuture<'_, ()> {
        self.backend.execute(op)
    }

    fn runs_detached(&self, op: &Op) -> bool {
        self.backend.runs_detached(op)
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        self.backend.ping()
    }

    fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn clock(&self) -> &Clock {
        self.backend.clock()
    }

    fn changes(&self) -> &crate::Changes {
        self.backend.changes()
    }

    fn announced(&self) -> BoxFuture<'_, ()> {
        self.backend.announced()
    }
}
