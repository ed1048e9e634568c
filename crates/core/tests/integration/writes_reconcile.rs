//! Reconciliation of uncertain writes (SPEC §6): keys, external references, lookup URLs,
//! lookup verdicts and the next step for every branch.

use backstop_core::policy::{Reconcile, ReconcileBy};
use backstop_core::reconcile::{
    ensure_external_reference, interpret_lookup, lookup_request, mint_idempotency_key,
    next_step_after_uncertain, operation_id_from_response, validate_idempotency_key, LookupVerdict,
    ReconcileError, UncertainNextStep,
};
use serde_json::json;

fn by_reference() -> Reconcile {
    Reconcile {
        by: ReconcileBy::ExternalReference,
        lookup_method: "GET".into(),
        lookup_path: "/v1/transfers?reference={ref}".into(),
        external_reference_pointer: Some("/metadata/reference".into()),
        found_pointer: Some("/data/0".into()),
        operation_id_pointer: Some("/data/0/id".into()),
    }
}

fn by_key_without_pointers() -> Reconcile {
    Reconcile {
        by: ReconcileBy::IdempotencyKey,
        lookup_method: "GET".into(),
        lookup_path: "/v1/operations/by-key/{key}".into(),
        external_reference_pointer: None,
        found_pointer: None,
        operation_id_pointer: Some("/id".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Idempotency keys

#[test]
fn minted_key_is_a_v4_uuid_from_the_given_randomness() {
    let key = mint_idempotency_key([0xff; 16]);
    assert_eq!(key, "ffffffff-ffff-4fff-bfff-ffffffffffff");
    let key = mint_idempotency_key([0; 16]);
    assert_eq!(key, "00000000-0000-4000-8000-000000000000");
    assert_ne!(mint_idempotency_key([1; 16]), mint_idempotency_key([2; 16]));
    assert!(validate_idempotency_key(&key).is_ok());
}

#[test]
fn agent_keys_are_printable_ascii_up_to_255_bytes() {
    assert_eq!(
        validate_idempotency_key("order-7:attempt"),
        Ok("order-7:attempt")
    );
    assert_eq!(validate_idempotency_key("\"abc\""), Ok("abc"));
    assert_eq!(
        validate_idempotency_key(&"k".repeat(255)).map(str::len),
        Ok(255)
    );
    for (bad, needle) in [
        ("", "empty"),
        ("\"\"", "empty"),
        ("caf\u{e9}", "byte 4 is not printable ASCII"),
        ("a\tb", "byte 2 is not printable ASCII"),
        (" padded", "start or end with a space"),
    ] {
        let err = validate_idempotency_key(bad).unwrap_err();
        assert!(err.to_string().contains(needle), "{bad:?}: {err}");
        assert!(err.to_string().starts_with("Idempotency-Key: "), "{err}");
    }
    let long = "k".repeat(256);
    let err = validate_idempotency_key(&long).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Idempotency-Key: 256 bytes, at most 255 allowed"
    );
}

// ---------------------------------------------------------------------------------------------
// External reference

#[test]
fn an_existing_reference_is_read_and_the_payload_is_untouched() {
    let payload = br#"{"amount": 7, "metadata": {"reference": "inv-7"}}"#;
    let (sent, reference) =
        ensure_external_reference(payload, "/metadata/reference", "minted-1").unwrap();
    assert_eq!(reference, "inv-7");
    assert_eq!(sent, payload.to_vec());

    let numeric = br#"{"ref": 42}"#;
    let (sent, reference) = ensure_external_reference(numeric, "/ref", "minted-1").unwrap();
    assert_eq!(reference, "42");
    assert_eq!(sent, numeric.to_vec());
}

#[test]
fn a_missing_reference_is_written_at_the_pointer() {
    let payload = br#"{"amount": 7}"#;
    let (sent, reference) =
        ensure_external_reference(payload, "/metadata/reference", "minted-1").unwrap();
    assert_eq!(reference, "minted-1");
    let doc: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(
        doc,
        json!({"amount": 7, "metadata": {"reference": "minted-1"}})
    );

    let null = br#"{"a~b": {"x/y": null}}"#;
    let (sent, _) = ensure_external_reference(null, "/a~0b/x~1y", "m").unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(doc, json!({"a~b": {"x/y": "m"}}));
}

#[test]
fn an_empty_or_blank_reference_is_replaced_as_a_missing_one() {
    for payload in [
        &br#"{"amount": 2, "reference": ""}"#[..],
        &br#"{"amount": 2, "reference": " \t "}"#[..],
    ] {
        let (sent, reference) = ensure_external_reference(payload, "/reference", "minted-1")
            .expect("an empty reference is replaced");
        assert_eq!(reference, "minted-1");
        let doc: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(doc, json!({"amount": 2, "reference": "minted-1"}));
    }
}

#[test]
fn unwritable_pointers_and_non_json_payloads_are_errors() {
    let err = ensure_external_reference(b"amount=7", "/ref", "m").unwrap_err();
    assert!(
        matches!(err, ReconcileError::PayloadNotJson { .. }),
        "{err}"
    );
    assert!(err.to_string().starts_with("payload: not JSON"), "{err}");

    let err = ensure_external_reference(b"", "/ref", "m").unwrap_err();
    assert!(
        matches!(err, ReconcileError::PayloadNotJson { .. }),
        "{err}"
    );

    let err = ensure_external_reference(br#"{"items": [1]}"#, "/items/ref", "m").unwrap_err();
    assert_eq!(
        err.to_string(),
        "external_reference_pointer `/items/ref`: the parent of `ref` is not a JSON object"
    );

    let err = ensure_external_reference(br#"[1, 2]"#, "/ref", "m").unwrap_err();
    assert!(
        matches!(err, ReconcileError::PointerNotWritable { .. }),
        "{err}"
    );

    let err = ensure_external_reference(br#"{"ref": {"a": 1}}"#, "/ref", "m").unwrap_err();
    assert!(err.to_string().contains("object"), "{err}");

    let err = ensure_external_reference(br#"{}"#, "ref", "m").unwrap_err();
    assert!(err.to_string().contains("starts with `/`"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Lookup URL

#[test]
fn lookup_values_are_percent_encoded() {
    let request = lookup_request(&by_reference(), None, Some("a b&c=d/é?#"), None).unwrap();
    assert_eq!(request.method, "GET");
    assert_eq!(
        request.path_and_query,
        "/v1/transfers?reference=a%20b%26c%3Dd%2F%C3%A9%3F%23"
    );

    let request = lookup_request(&by_key_without_pointers(), Some("k-1.x_~"), None, None).unwrap();
    assert_eq!(request.path_and_query, "/v1/operations/by-key/k-1.x_~");

    let by_op = Reconcile {
        by: ReconcileBy::OperationId,
        lookup_method: "HEAD".into(),
        lookup_path: "/v1/ops/{operation_id}?key={key}".into(),
        external_reference_pointer: None,
        found_pointer: None,
        operation_id_pointer: Some("/id".into()),
    };
    let request = lookup_request(&by_op, Some("k/1"), None, Some("op 9")).unwrap();
    assert_eq!(request.method, "HEAD");
    assert_eq!(request.path_and_query, "/v1/ops/op%209?key=k%2F1");
}

#[test]
fn a_missing_lookup_value_or_unknown_placeholder_is_an_error() {
    let err = lookup_request(&by_reference(), Some("key"), None, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "reconcile lookup `GET /v1/transfers?reference={ref}`: no value for `{ref}`"
    );
    let odd = Reconcile {
        lookup_path: "/v1/{account}/transfers?reference={ref}".into(),
        ..by_reference()
    };
    let err = lookup_request(&odd, None, Some("r"), None).unwrap_err();
    assert!(
        matches!(&err, ReconcileError::UnknownPlaceholder { placeholder, .. } if placeholder == "{account}"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Verdicts

#[test]
fn found_pointer_decides_found_and_not_found() {
    let r = by_reference();
    assert_eq!(
        interpret_lookup(&r, 200, br#"{"data":[{"id":"tr_1"}]}"#),
        LookupVerdict::Found {
            operation_id: Some("tr_1".into())
        }
    );
    assert_eq!(
        interpret_lookup(&r, 200, br#"{"data":[]}"#),
        LookupVerdict::NotFound
    );
    let flag = Reconcile {
        found_pointer: Some("/exists".into()),
        operation_id_pointer: Some("/operation/id".into()),
        ..by_reference()
    };
    assert_eq!(
        interpret_lookup(&flag, 200, br#"{"exists": false}"#),
        LookupVerdict::NotFound
    );
    assert_eq!(
        interpret_lookup(&flag, 200, br#"{"exists": true, "operation": {"id": 77}}"#),
        LookupVerdict::Found {
            operation_id: Some("77".into())
        }
    );
}

#[test]
fn a_404_is_not_found_and_throttling_errors_or_garbage_are_inconclusive() {
    let r = by_reference();
    assert_eq!(interpret_lookup(&r, 404, b"nope"), LookupVerdict::NotFound);
    for status in [429, 500, 502, 503, 504, 401, 403, 301] {
        assert!(
            matches!(
                interpret_lookup(&r, status, b"{}"),
                LookupVerdict::Inconclusive { .. }
            ),
            "{status}"
        );
    }
    assert!(matches!(
        interpret_lookup(&r, 200, b"<html>ok</html>"),
        LookupVerdict::Inconclusive { .. }
    ));
}

#[test]
fn without_found_pointer_the_body_shape_decides() {
    let r = by_key_without_pointers();
    assert_eq!(interpret_lookup(&r, 200, b"[]"), LookupVerdict::NotFound);
    assert_eq!(
        interpret_lookup(&r, 200, br#"[{"id": "a"}]"#),
        LookupVerdict::Found { operation_id: None }
    );
    assert_eq!(
        interpret_lookup(&r, 200, br#"{"id": "op_1", "status": "done"}"#),
        LookupVerdict::Found {
            operation_id: Some("op_1".into())
        }
    );
    assert!(matches!(
        interpret_lookup(&r, 200, br#"{"data": [], "has_more": false}"#),
        LookupVerdict::Inconclusive { .. }
    ));
    assert!(matches!(
        interpret_lookup(&r, 200, b""),
        LookupVerdict::Inconclusive { .. }
    ));
    let head = Reconcile {
        lookup_method: "HEAD".into(),
        ..by_key_without_pointers()
    };
    assert_eq!(
        interpret_lookup(&head, 200, b""),
        LookupVerdict::Found { operation_id: None }
    );
}

#[test]
fn operation_id_is_read_from_a_write_response() {
    let r = by_key_without_pointers();
    assert_eq!(
        operation_id_from_response(&r, br#"{"id": "tr_9"}"#),
        Some("tr_9".into())
    );
    assert_eq!(operation_id_from_response(&r, br#"{"id": ""}"#), None);
    assert_eq!(operation_id_from_response(&r, b"not json"), None);
    let none = Reconcile {
        operation_id_pointer: None,
        ..r
    };
    assert_eq!(
        operation_id_from_response(&none, br#"{"id": "tr_9"}"#),
        None
    );
}

// ---------------------------------------------------------------------------------------------
// Next step: every SPEC §6 branch

#[test]
fn with_a_lookup_the_first_step_is_always_the_lookup() {
    for honours_key in [true, false] {
        assert_eq!(
            next_step_after_uncertain(honours_key, true, None),
            UncertainNextStep::Lookup
        );
    }
}

#[test]
fn found_means_succeeded_with_the_provider_id() {
    let found = LookupVerdict::Found {
        operation_id: Some("tr_1".into()),
    };
    for honours_key in [true, false] {
        assert_eq!(
            next_step_after_uncertain(honours_key, true, Some(&found)),
            UncertainNextStep::Succeeded {
                operation_id: Some("tr_1".into())
            }
        );
    }
}

#[test]
fn not_found_retries_with_the_same_key_only_when_keys_are_honoured() {
    assert_eq!(
        next_step_after_uncertain(true, true, Some(&LookupVerdict::NotFound)),
        UncertainNextStep::RetrySameKey
    );
    assert!(matches!(
        next_step_after_uncertain(false, true, Some(&LookupVerdict::NotFound)),
        UncertainNextStep::Escalate { reason } if reason.contains("does not honour idempotency keys")
    ));
}

#[test]
fn an_inconclusive_lookup_escalates() {
    let verdict = LookupVerdict::Inconclusive {
        reason: "the lookup failed with HTTP 503".into(),
    };
    for honours_key in [true, false] {
        assert!(matches!(
            next_step_after_uncertain(honours_key, true, Some(&verdict)),
            UncertainNextStep::Escalate { reason } if reason.contains("HTTP 503")
        ));
    }
}

#[test]
fn without_key_support_and_without_lookup_a_write_is_never_resent() {
    let step = next_step_after_uncertain(false, false, None);
    assert!(
        matches!(&step, UncertainNextStep::Escalate { reason } if reason.contains("never resent automatically")),
        "{step:?}"
    );
}

#[test]
fn without_lookup_a_key_honouring_route_is_resent_with_the_same_key() {
    assert_eq!(
        next_step_after_uncertain(true, false, None),
        UncertainNextStep::RetrySameKey
    );
}
