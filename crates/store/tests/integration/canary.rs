//! Secrets never reach the database or the audit export: a canary credential and a canary
//! request body go through a gateway-shaped flow, then the raw bytes of the database file and
//! its WAL, and the NDJSON export, are searched for them.

use backstop_store::audit::write_export;
use backstop_store::{
    Admission, AttemptResult, Disposition, Finish, NewAction, Outcome, PayloadDigest,
    RouteTemplate, SqliteStore, Store, StoredResponse,
};

use crate::common::{open_task, t};

const CANARY_CREDENTIAL: &str = "sk-live-CANARY-CREDENTIAL-7f3a9e11";
const CANARY_BODY: &str = "CANARY-REQUEST-BODY-41c2d0aa";
const CANARY_PATH_ID: &str = "tr_CANARYPATHID93";
const RESPONSE_MARKER: &str = "RESPONSE-BODY-MARKER-9d1b";

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

fn file_bytes(dir: &std::path::Path) -> Vec<u8> {
    let mut all = Vec::new();
    for suffix in ["", "-wal", "-shm"] {
        if let Ok(b) = std::fs::read(dir.join(format!("s.db{suffix}"))) {
            all.extend(b);
        }
    }
    all
}

#[test]
fn no_credential_or_request_body_in_db_bytes_or_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");

    // What an agent's request looks like at the gateway.
    let authorization = format!("Bearer {CANARY_CREDENTIAL}");
    let concrete_path = format!("/v1/transfers/{CANARY_PATH_ID}/reverse");
    let body = format!("{{\"amount\":10,\"note\":\"{CANARY_BODY}\",\"auth\":\"{authorization}\"}}");
    assert!(concrete_path.starts_with("/v1/transfers/"));

    // What reaches the store: the template, the digest, the key — nothing else.
    let mut ids = Vec::new();
    for i in 0..20 {
        let action = NewAction {
            task_id: "task-1".into(),
            agent: "agent-a".into(),
            provider: "billing-api".into(),
            method: "POST".into(),
            route: RouteTemplate::try_new("/v1/transfers/{id}/reverse").expect("template"),
            request_class: "idempotent_write".into(),
            payload_digest: PayloadDigest::of(format!("{body}{i}").as_bytes()),
            target_digest: None,
            idempotency_key: format!("key-{i}"),
            external_reference: Some(format!("ext-{i}")),
            desired_outcome: None,
            fingerprint: None,
            request: None,
        };
        let Admission::New(id) = store.record_action(action, t(i)).expect("record") else {
            panic!("fresh key existed");
        };
        let n = store.mark_attempt_sent(id, t(i + 1)).expect("sent");
        store
            .record_result(
                AttemptResult {
                    action: id,
                    attempt: n,
                    status: Some(201),
                    disposition: Disposition::Success,
                    boundary: None,
                    source: None,
                    provider_operation_id: Some(format!("op-{i}")),
                    signal_headers: Vec::new(),
                    finish: Some(Finish {
                        outcome: Outcome::Succeeded,
                        context: serde_json::json!({"attempts": 1, "sent": true}),
                        response: Some(StoredResponse {
                            status: 201,
                            headers: vec![("content-type".into(), "application/json".into())],
                            body: format!("{{\"id\":\"{RESPONSE_MARKER}\"}}").into_bytes(),
                        }),
                    }),
                },
                t(i + 2),
            )
            .expect("result");
        ids.push(id);
    }
    store
        .open_escalation(
            ids[0],
            serde_json::json!({"endpoint": "/v1/transfers/{id}/reverse"}),
            t(99),
        )
        .expect("escalate");

    let mut export = Vec::new();
    write_export(
        &mut export,
        &store.audit_events(0, usize::MAX).expect("events"),
    )
    .expect("export");

    // While open (recent data in the WAL) and after close (checkpointed into the main file).
    let check = |phase: &str| {
        let bytes = file_bytes(dir.path());
        // Positive control: the scan does find what is stored (the replay body).
        assert!(
            contains(&bytes, RESPONSE_MARKER),
            "{phase}: scan cannot see stored data"
        );
        for canary in [CANARY_CREDENTIAL, CANARY_BODY, CANARY_PATH_ID] {
            assert!(
                !contains(&bytes, canary),
                "{phase}: {canary} found in the database files"
            );
        }
    };
    check("open");
    drop(store);
    check("closed");

    assert!(contains(&export, "action_sent"), "export is empty");
    for needle in [
        CANARY_CREDENTIAL,
        CANARY_BODY,
        CANARY_PATH_ID,
        RESPONSE_MARKER,
    ] {
        assert!(
            !contains(&export, needle),
            "{needle} found in the audit export"
        );
    }
}
