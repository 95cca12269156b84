//! Counters of the service's Prometheus metrics whose label values are all
//! registered up front (docs/operations.md).

/// One counter's handle for each value of one label, registered with the
/// recorder once instead of on every increment, so every value is listed, at
/// 0, from the start. The handles are taken when [`crate::metrics_handle`]
/// installs the recorder (`idem serve` calls it before anything counts); a
/// static first used before any recorder is installed would hold no-op
/// handles for the life of the process.
pub(crate) struct LabelledCounter<const N: usize> {
    handles: [(&'static str, metrics::Counter); N],
}

impl<const N: usize> LabelledCounter<N> {
    /// `name{label="v"}` for each `v` of `values`.
    fn register(name: &'static str, label: &'static str, values: [&'static str; N]) -> Self {
        LabelledCounter {
            handles: values.map(|v| (v, metrics::counter!(name, label => v))),
        }
    }

    /// Adds one to the series whose label is `value`. A value not registered
    /// is not counted (every caller passes one of the registered values; a
    /// debug build asserts it).
    pub(crate) fn increment(&self, value: &str) {
        let found = self.handles.iter().find(|(v, _)| *v == value);
        debug_assert!(found.is_some(), "unregistered label value {value}");
        if let Some((_, counter)) = found {
            counter.increment(1);
        }
    }
}

/// `idem_submits_total` by `outcome` (docs/operations.md).
pub(crate) static SUBMITS: std::sync::LazyLock<LabelledCounter<7>> =
    std::sync::LazyLock::new(|| {
        LabelledCounter::register(
            "idem_submits_total",
            "outcome",
            [
                "replayed",
                "created",
                "conflict",
                "unauthenticated",
                "forbidden",
                "error",
                "invalid",
            ],
        )
    });

/// `idem_reports_total` by `result` (docs/operations.md).
pub(crate) static REPORTS: std::sync::LazyLock<LabelledCounter<3>> =
    std::sync::LazyLock::new(|| {
        LabelledCounter::register(
            "idem_reports_total",
            "result",
            ["applied", "stale", "refused"],
        )
    });
