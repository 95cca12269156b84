//! The JSON form of event data: what the stores hold reads back typed and
//! serializes to the same text; what does not fit is kept as it was.

use super::*;

/// Reads `text` as the data of `kind` and checks it serializes to `text`.
fn round_trip(kind: EventKind, text: &str) -> EventData {
    let data = EventData::from_json(kind, text).unwrap();
    assert_eq!(data.kind(), kind, "{text}");
    assert_eq!(serde_json::to_string(&data).unwrap(), text);
    let value: Value = serde_json::from_str(text).unwrap();
    assert_eq!(EventData::from_value(kind, value), data, "{text}");
    data
}

#[test]
fn absent_null_and_present_members_keep_their_form() {
    let id = "01a24ab5-ee50-74ee-8e31-478895e0a1c6";
    let absent = round_trip(EventKind::CancelRequested, "{}");
    let null = round_trip(EventKind::CancelRequested, r#"{"active_attempt_id":null}"#);
    let present = round_trip(
        EventKind::CancelRequested,
        &format!(r#"{{"active_attempt_id":"{id}"}}"#),
    );
    let cases = [
        (absent, None),
        (null, Some(None)),
        (present, Some(Some(id))),
    ];
    for (data, expected) in cases {
        let EventData::CancelRequested(d) = data else {
            panic!("not typed: {data:?}");
        };
        let expected = expected.map(|o| o.map(|s: &str| s.parse::<Uuid>().unwrap()));
        assert_eq!(d.active_attempt_id, expected);
    }
    round_trip(
        EventKind::CancelTooLate,
        r#"{"fee":100,"state":"succeeded","status":"too_late"}"#,
    );
    round_trip(
        EventKind::CancelTooLate,
        r#"{"fee":50,"status":"too_late"}"#,
    );
    round_trip(
        EventKind::Delivered,
        r#"{"charge":100,"external_txn_id":null}"#,
    );
    // The amount's currency: absent in events recorded before idem carried
    // it, `null` when the contract names none, else the ISO 4217 code.
    for (text, expected) in [
        (r#"{"charge":100,"external_txn_id":null}"#, None),
        (
            r#"{"charge":100,"currency":null,"external_txn_id":null}"#,
            Some(None),
        ),
        (
            r#"{"charge":100,"currency":"EUR","external_txn_id":null}"#,
            Some(Some("EUR")),
        ),
    ] {
        let EventData::Delivered(d) = round_trip(EventKind::Delivered, text) else {
            panic!("not typed: {text}");
        };
        assert_eq!(d.currency, expected.map(|c| c.map(str::to_owned)));
    }
    round_trip(
        EventKind::CancelTooLate,
        r#"{"currency":"JPY","fee":100,"status":"too_late"}"#,
    );
    round_trip(
        EventKind::CancelConfirmed,
        r#"{"currency":null,"fee":14,"generation":2,"usage":4}"#,
    );
}

#[test]
fn data_that_does_not_fit_its_kind_is_kept_as_stored() {
    // A member this release does not know (a newer release's), a required
    // member missing (an older release's), another kind's data: never cut
    // down to the struct, served as stored.
    for (kind, text) in [
        (
            EventKind::Delivered,
            r#"{"charge":100,"external_txn_id":null,"refund":0}"#,
        ),
        (
            EventKind::ReconciliationRequired,
            r#"{"ready_at":"2026-12-06T09:36:09.807Z","reason":"lease expired"}"#,
        ),
        (EventKind::TaskWoken, r#"{"charge":100}"#),
        (EventKind::KeyReleased, "[1,2]"),
    ] {
        let data = round_trip(kind, text);
        assert!(matches!(data, EventData::Other(_)), "{kind}: {data:?}");
        assert_eq!(data.attempt_id(), None);
    }
    assert!(EventData::from_json(EventKind::TaskWoken, "{").is_err());
}

#[test]
fn accessors_name_attempt_generation_reason_and_rewind() {
    let id = "01a24ab5-f96a-7751-82a1-16308ee71fcc";
    let data = round_trip(
        EventKind::RetryScheduled,
        &format!(
            r#"{{"backoff_ms":0,"ended_attempt_id":"{id}","generation":2,"reason":"store_rewound","store":{{"restored_backup":true}}}}"#
        ),
    );
    assert_eq!(data.ended_attempt_id(), Some(id.parse().unwrap()));
    assert_eq!(data.generation(), Some(2));
    assert_eq!(data.reason(), Some("store_rewound"));
    assert_eq!(data.backoff_ms(), Some(0));
    let data = round_trip(
        EventKind::LeaseExpired,
        &format!(
            r#"{{"attempt_id":"{id}","generation":3,"lease_expires_at":"2026-12-06T09:36:09.807Z"}}"#
        ),
    );
    assert_eq!(data.attempt_id(), Some(id.parse().unwrap()));
    assert_eq!(data.generation(), Some(3));
    assert_eq!(data.ended_attempt_id(), None);
}
