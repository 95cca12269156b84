//! `idem task show --summary` and `idem task list --table`: a task as lines
//! and a page of tasks as columns, for people. Every amount is written by
//! [`idem_core::money`] (`EUR 1.00`, `100 minor units`) in the currency
//! frozen into the task's contract; the display fields are the class's
//! `[display]` JSON Pointers into `params` (SPEC §5).

use idem_core::config::Config;
use idem_core::model::{CancelStatus, Task};
use idem_core::money::{self, Money};
use serde_json::Value;

/// The delivery's charge in the task's currency, `None` before delivery.
fn delivery_charge(task: &Task) -> Option<Money> {
    task.delivery
        .as_ref()
        .map(|d| task.contract.money(d.charge))
}

/// A cancellation that lost to delivery: `too_late` with the delivery's
/// charge as its fee (SPEC §2.7). Its fee is that one charge, never a second.
fn lost_to_delivery(task: &Task) -> bool {
    matches!(
        (&task.cancellation, &task.delivery),
        (Some(c), Some(d)) if c.status == CancelStatus::TooLate && c.fee == Some(d.charge)
    )
}

/// A display field's text in a line or a cell, as JSON (quoted and escaped)
/// when it holds control characters, which a terminal would act on.
fn terminal_text(text: &str) -> String {
    if text.chars().any(char::is_control) {
        Value::String(text.to_owned()).to_string()
    } else {
        text.to_owned()
    }
}

/// The cancellation line of a task: its status and fee in words; for one
/// that lost to delivery, the one charge and that the fee is that charge.
fn cancellation_text(task: &Task) -> Option<String> {
    let c = task.cancellation.as_ref()?;
    if lost_to_delivery(task)
        && let Some(charge) = delivery_charge(task)
    {
        return Some(format!("`too_late`: {}", money::too_late_words(&charge)));
    }
    let fee = c.fee.map(|f| task.contract.money(f));
    Some(format!(
        "`{}` with {}",
        c.status,
        money::fee_words(fee.as_ref())
    ))
}

/// `task` as lines: id, class, state, key, the class's display fields, the
/// delivery's charge and the cancellation's fee in words.
pub(crate) fn summary(task: &Task, config: &Config) -> String {
    let mut lines = vec![
        format!("task {}", task.id),
        format!("operation: {}", task.operation),
        format!("state: {}", task.state),
        format!("idempotency key: {}", task.idempotency_key),
    ];
    if let Some(class) = config.operations.get(&task.operation) {
        for (name, value) in class.display.shown(&task.params) {
            lines.push(format!(
                "{name}: {}",
                value.as_deref().map_or("-".to_owned(), terminal_text)
            ));
        }
    }
    if let Some(d) = &task.delivery {
        let charge = task.contract.money(d.charge);
        let txn = d.external_txn_id.as_deref().unwrap_or("none");
        lines.push(format!(
            "delivery: {}, transaction {txn}",
            money::charge_words(Some(&charge))
        ));
    }
    if let Some(c) = cancellation_text(task) {
        lines.push(format!("cancellation: {c}"));
    }
    if let Some(f) = &task.failure {
        lines.push(format!("failure: {} ({})", f.class, f.message));
    }
    for e in &task.second_effects {
        let txn = e
            .external_txn_id
            .as_deref()
            .unwrap_or("(no transaction id)");
        let status = match &e.acknowledgment {
            Some(a) => format!(
                "acknowledged: {} ({})",
                a.resolution.as_str().replace('_', " "),
                a.reason
            ),
            None => "not acknowledged".to_owned(),
        };
        lines.push(format!(
            "SECOND EFFECT SUSPECTED: transaction {txn}, from {} of generation {}; {status}",
            e.evidence.as_str().replace('_', " "),
            e.generation
        ));
    }
    lines.join("\n")
}

/// The page as aligned columns: ID, OPERATION, STATE, the display fields of
/// the classes on the page (in configuration order, `-` where a task's class
/// has no such field or its params none), CHARGE and FEE (a cancellation that
/// lost to delivery: `= charge`, the one charge).
pub(crate) fn table(tasks: &[Task], config: &Config) -> String {
    let mut names: Vec<&str> = Vec::new();
    for task in tasks {
        if let Some(class) = config.operations.get(&task.operation) {
            for name in class.display.columns() {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
    }
    let mut header: Vec<String> = ["ID", "OPERATION", "STATE"].map(String::from).to_vec();
    header.extend(names.iter().map(|n| n.to_uppercase()));
    header.extend(["CHARGE", "FEE"].map(String::from));
    let mut rows = vec![header];
    for task in tasks {
        let display = config.operations.get(&task.operation).map(|c| &c.display);
        let mut row = vec![
            task.id.to_string(),
            task.operation.clone(),
            task.state.to_string(),
        ];
        let shown = display.map(|d| d.shown(&task.params)).unwrap_or_default();
        for name in &names {
            let value = shown
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.as_deref());
            row.push(value.map_or("-".to_owned(), terminal_text));
        }
        row.push(delivery_charge(task).map_or("-".to_owned(), |m| m.to_string()));
        let fee = match &task.cancellation {
            _ if lost_to_delivery(task) => "= charge".to_owned(),
            Some(c) => c
                .fee
                .map_or("-".to_owned(), |f| task.contract.money(f).to_string()),
            None => "-".to_owned(),
        };
        row.push(fee);
        rows.push(row);
    }
    columns(&rows)
}

/// A tenant's queues as columns: class, depth, and the longest, median and
/// 99th-percentile waits in seconds (`idem task list --queues --table`).
pub(crate) fn queue_table(queues: &[idem_store::ops::QueueStat]) -> String {
    let seconds = |ms: i64| format!("{}.{:03}s", ms / 1000, ms % 1000);
    let mut rows = vec![
        ["OPERATION", "DEPTH", "OLDEST", "P50", "P99"]
            .map(String::from)
            .to_vec(),
    ];
    for q in queues {
        rows.push(vec![
            q.operation.clone(),
            q.depth.to_string(),
            seconds(q.oldest_wait_ms),
            seconds(q.wait_p50_ms),
            seconds(q.wait_p99_ms),
        ]);
    }
    columns(&rows)
}

/// `rows` (the first is the header) as left-aligned columns two spaces apart.
fn columns(rows: &[Vec<String>]) -> String {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|row| {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(cell, w)| format!("{cell:<w$}"))
                .collect();
            cells.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use idem_core::contract::FrozenContract;
    use idem_core::model::{Cancellation, Delivery, TaskState, Timestamp};
    use idem_core::money::{Currency, testing};
    use serde_json::json;

    use super::*;

    /// A delivered `payment.release` task whose contract is the bundled one
    /// with `currency` frozen in, charged `charge`, with a cancellation of
    /// `status` and `fee`.
    fn task(currency: Option<&Currency>, charge: i64, cancel: Option<(CancelStatus, i64)>) -> Task {
        let mut contract = Config::bundled()
            .unwrap()
            .contract("payment.release")
            .unwrap();
        contract.price = charge;
        contract.fees.currency = currency.map(|c| c.code.clone());
        contract.fees.exponent = currency.map(|c| c.exponent);
        let code = contract.fees.currency.clone();
        Task {
            id: uuid::Uuid::now_v7(),
            operation: "payment.release".into(),
            idempotency_key: "invoice-A".into(),
            fingerprint: "sha256:00".into(),
            params: json!({"payee": "acct-alice", "amount": 1250, "currency": "EUR"}),
            state: TaskState::Succeeded,
            generation: 1,
            attempt_count: 1,
            usage: 0,
            contract: FrozenContract::new(contract).unwrap(),
            cancellation: cancel.map(|(status, fee)| Cancellation {
                status,
                requested_at: Timestamp(0),
                confirmed_at: Some(Timestamp(1)),
                fee: Some(fee),
                currency: code.clone(),
            }),
            delivery: Some(Delivery {
                result: json!({}),
                external_txn_id: Some("txn-1".into()),
                delivered_at: Timestamp(1),
                acknowledged_at: None,
                charge,
                currency: code,
            }),
            failure: None,
            created_at: Timestamp(0),
            updated_at: Timestamp(1),
            traceparent: None,
            priority: 3,
            second_effects: Vec::new(),
            control: Default::default(),
        }
    }

    proptest::proptest! {
        /// The summary and the table write the charge and a cancellation's
        /// fee with the contract's currency code and exactly its decimals (or
        /// `minor units`), and the amounts read back; a cancellation that lost
        /// to delivery shows the one charge and says the fee is that charge.
        #[test]
        fn amounts_carry_their_currency(
            charge in 0i64..=idem_core::json::MAX_SAFE_INTEGER as i64,
            fee in 0i64..1_000_000,
            which in 0usize..4,
        ) {
            let currency = testing::currencies().swap_remove(which);
            let config = Config::bundled().unwrap();
            let paid = Money::new(charge, currency.clone());
            let lost = task(currency.as_ref(), charge, Some((CancelStatus::TooLate, charge)));
            let text = summary(&lost, &config);
            let delivery = text.lines().find(|l| l.starts_with("delivery: ")).unwrap();
            proptest::prop_assert_eq!(testing::check_rendering(delivery, &paid), Ok(()));
            let cancel = text.lines().find(|l| l.starts_with("cancellation: ")).unwrap();
            proptest::prop_assert_eq!(testing::check_rendering(cancel, &paid), Ok(()));
            proptest::prop_assert!(cancel.contains("the cancellation fee is the delivery's charge"));
            proptest::prop_assert_eq!(cancel.matches(&paid.to_string()).count(), 1);
            let row = table(std::slice::from_ref(&lost), &config);
            let row = row.lines().nth(1).unwrap();
            proptest::prop_assert_eq!(testing::check_rendering(row, &paid), Ok(()));
            proptest::prop_assert!(row.ends_with("= charge"));

            let mut cancelled = task(currency.as_ref(), charge, Some((CancelStatus::Confirmed, fee)));
            cancelled.delivery = None;
            let owed = Money::new(fee, currency);
            let text = summary(&cancelled, &config);
            let cancel = text.lines().find(|l| l.starts_with("cancellation: ")).unwrap();
            proptest::prop_assert_eq!(testing::check_rendering(cancel, &owed), Ok(()));
            let row = table(std::slice::from_ref(&cancelled), &config);
            proptest::prop_assert_eq!(testing::check_rendering(row.lines().nth(1).unwrap(), &owed), Ok(()));
        }
    }

    #[test]
    fn the_summary_names_each_suspected_second_effect_and_its_acknowledgment() {
        let config = Config::bundled().unwrap();
        let eur = Currency::from_code("EUR").unwrap();
        let mut t = task(Some(&eur), 100, None);
        assert!(!summary(&t, &config).contains("SECOND EFFECT"));
        t.second_effects.push(idem_core::model::SecondEffect {
            external_txn_id: Some("po_A".into()),
            attempt_id: None,
            generation: 1,
            evidence: idem_core::model::EffectEvidence::StaleReport,
            suspected_at: Timestamp(2),
            acknowledgment: None,
        });
        let text = summary(&t, &config);
        assert!(
            text.contains("SECOND EFFECT SUSPECTED: transaction po_A, from stale report of generation 1; not acknowledged"),
            "{text}"
        );
        assert!(text.contains("transaction txn-1"), "{text}");
    }

    #[test]
    fn the_table_shows_the_display_fields_as_columns() {
        let config = Config::bundled().unwrap();
        let eur = Currency::from_code("EUR").unwrap();
        let t = task(Some(&eur), 100, None);
        let text = table(std::slice::from_ref(&t), &config);
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            header,
            [
                "ID",
                "OPERATION",
                "STATE",
                "PAYEE",
                "AMOUNT",
                "CHARGE",
                "FEE"
            ]
        );
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            row[1..],
            [
                "payment.release",
                "succeeded",
                "acct-alice",
                "EUR",
                "12.50",
                "EUR",
                "1.00",
                "-"
            ]
        );
        let s = summary(&t, &config);
        assert!(
            s.contains("\npayee: acct-alice\namount: EUR 12.50\ndelivery"),
            "{s}"
        );
        assert!(
            s.contains("delivery: a charge of EUR 1.00, transaction txn-1"),
            "{s}"
        );
        let none = task(None, 100, None);
        assert!(summary(&none, &config).contains("a charge of 100 minor units"));
    }
}
