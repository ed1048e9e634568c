//! `backstop classify` end to end: the built binary, its JSON, and exit 2 on bad arguments.

use std::process::{Command, Output};

use serde_json::Value;

const NOW: &str = "2025-03-01T12:00:00Z";

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
        .arg("classify")
        .args(args)
        .output()
        .expect("the backstop binary runs")
}

fn json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "exit {:?}, stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "one JSON object: {text}");
    serde_json::from_str(&text).unwrap()
}

fn fails_with_2(args: &[&str], names: &str) {
    let out = run(args);
    assert_eq!(out.status.code(), Some(2), "args {args:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(names), "stderr {err:?} should name {names}");
    assert!(out.stdout.is_empty());
}

#[test]
fn rate_limited_429_prints_the_boundary_and_quota() {
    let v = json(&[
        "--status",
        "429",
        "-H",
        "Retry-After: 10",
        "-H",
        "x-ratelimit-remaining-tokens: 0",
        "-H",
        "x-ratelimit-reset-tokens: 6m0s",
        "--now",
        NOW,
    ]);
    assert_eq!(v["disposition"], "rate_limited");
    assert_eq!(v["retryable"], true);
    let b = &v["boundary"];
    // The exhausted tokens quota resets after the Retry-After boundary: the later one wins.
    assert_eq!(b["state"], "known");
    assert_eq!(b["retry_not_before"], "2025-03-01T12:06:01Z");
    assert_eq!(b["delay_ms"], 361_000);
    assert_eq!(b["source"], "openai quota (tokens) reset");
    assert!(b["reason"].as_str().unwrap().contains("Retry-After \"10\""));
    assert!(b["clock"].is_null());
    let q = &v["quota"][0];
    assert_eq!(q["dialect"], "openai");
    assert_eq!(q["policy"], "tokens");
    assert_eq!(q["remaining"], 0);
    assert_eq!(q["reset_at"], "2025-03-01T12:06:00Z");
    assert!(q["window_seconds"].is_null());
    assert!(v["hint"].is_null());
}

#[test]
fn http_date_with_date_header_reports_the_server_clock() {
    let v = json(&[
        "--status",
        "503",
        "-H",
        "Date: Sat, 01 Mar 2025 09:00:00 GMT",
        "-H",
        "Retry-After: Sat, 01 Mar 2025 09:00:30 GMT",
        "--now",
        NOW,
    ]);
    assert_eq!(v["disposition"], "unavailable");
    assert_eq!(v["boundary"]["clock"], "server_date");
    assert_eq!(v["boundary"]["delay_ms"], 30_000);
    assert_eq!(v["boundary"]["retry_not_before"], "2025-03-01T12:00:30Z");
}

#[test]
fn invalid_retry_after_gives_an_unknown_boundary_with_every_key() {
    let v = json(&["--status", "429", "-H", "Retry-After: 0x10", "--now", NOW]);
    let b = &v["boundary"];
    assert_eq!(b["state"], "unknown");
    assert!(b["retry_not_before"].is_null());
    assert!(b["delay_ms"].is_null());
    assert!(b["clock"].is_null());
    assert_eq!(b["raw"], "0x10");
    assert_eq!(b["source"], "Retry-After");
    assert!(b["reason"].as_str().unwrap().contains("prefixed"));
}

#[test]
fn class_decides_retryable() {
    let read = json(&["--status", "500", "--now", NOW]);
    assert_eq!(read["disposition"], "transient");
    assert_eq!(read["retryable"], true);
    let write = json(&[
        "--status",
        "500",
        "--class",
        "idempotent_write",
        "--now",
        NOW,
    ]);
    assert_eq!(write["retryable"], false);
}

#[test]
fn class_retry_statuses_are_cores_builtin_classes() {
    for class in backstop_core::policy::BUILTIN_CLASSES {
        let statuses = backstop_core::policy::builtin_class(class)
            .expect("a built-in class")
            .retry_statuses;
        for status in [400, 408, 418, 500, 501, 502, 503, 504] {
            let text = status.to_string();
            let v = json(&["--status", &text, "--class", class, "--now", NOW]);
            assert_eq!(
                v["retryable"],
                statuses.contains(&status),
                "class {class}, status {status}: {v}"
            );
        }
    }
}

#[test]
fn transport_errors_split_not_sent_from_uncertain() {
    let v = json(&[
        "--transport-error",
        "connect",
        "--class",
        "idempotent_write",
    ]);
    assert_eq!(v["disposition"], "not_sent");
    assert_eq!(v["retryable"], true);
    let v = json(&["--transport-error", "connect", "--class", "uncertain_write"]);
    assert_eq!(v["retryable"], false);
}

/// `backstop classify` says what the gateway does, from the same rule: a read (or an LLM
/// completion) timed out after its send changed nothing to protect and is retried; a write in
/// that state is reconciled first, never retried blindly.
#[test]
fn a_timeout_after_send_is_retried_for_a_read_and_reconciled_for_a_write_as_the_gateway_does() {
    for class in ["read", "llm_call"] {
        let v = json(&["--transport-error", "timeout-after-send", "--class", class]);
        assert_eq!(v["disposition"], "uncertain", "{class}");
        assert_eq!(v["retryable"], true, "{class}: the gateway retries it");
    }
    for class in ["idempotent_write", "uncertain_write"] {
        let v = json(&["--transport-error", "timeout-after-send", "--class", class]);
        assert_eq!(v["disposition"], "uncertain", "{class}");
        assert_eq!(v["retryable"], false, "{class}: reconciled first");
    }
}

#[test]
fn error_code_is_read_from_the_body_through_the_pointer() {
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("body.json");
    std::fs::write(
        &body,
        r#"{"error":{"code":"insufficient_quota","message":"secret-ish text"}}"#,
    )
    .unwrap();
    let out = run(&[
        "--status",
        "429",
        "--body-file",
        body.to_str().unwrap(),
        "--error-pointer",
        "/error/code",
        "--now",
        NOW,
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains("secret-ish"), "the body is never printed");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["disposition"], "quota_exhausted");
    assert_eq!(v["error_code"], "insufficient_quota");
}

#[test]
fn github_dialect_and_hint_are_reported() {
    let v = json(&[
        "--status",
        "403",
        "--dialect",
        "github",
        "-H",
        "x-ratelimit-remaining: 0",
        "-H",
        "x-ratelimit-limit: 60",
        "-H",
        "x-ratelimit-reset: 1740830700",
        "-H",
        "x-should-retry: false",
        "--now",
        NOW,
    ]);
    assert_eq!(v["disposition"], "rate_limited");
    assert_eq!(v["retryable"], false);
    assert_eq!(v["hint"]["should_retry"], false);
    assert_eq!(v["hint"]["applied"], true);
    assert_eq!(v["boundary"]["retry_not_before"], "2025-03-01T12:05:01Z");
    assert_eq!(v["quota"][0]["dialect"], "github");
}

#[test]
fn bad_arguments_exit_2_naming_the_argument() {
    fails_with_2(&["--status", "429", "-H", "no colon here"], "--header");
    fails_with_2(&["--status", "429", "-H", "bad name: 1"], "--header");
    fails_with_2(&["--status", "429", "--now", "yesterday"], "--now");
    fails_with_2(&[], "--status");
    for status in ["999", "600", "99", "0"] {
        fails_with_2(
            &["--status", status, "--now", NOW],
            &format!("--status {status}: not an HTTP status (100..=599"),
        );
    }
    for status in ["100", "599"] {
        json(&["--status", status, "--now", NOW]);
    }
    fails_with_2(
        &["--status", "429", "--transport-error", "connect"],
        "--transport-error",
    );
    fails_with_2(&["--transport-error", "timeout"], "--transport-error");
    fails_with_2(&["--status", "429", "--dialect", "modrinth"], "--dialect");
    fails_with_2(
        &["--status", "429", "--body-file", "/nonexistent/body.json"],
        "--body-file",
    );
}

#[test]
fn invalid_error_pointer_exits_2_naming_the_flag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = dir.path().join("body.json");
    std::fs::write(&body, r#"{"error":{"code":"x"}}"#).expect("write body");
    let body = body.to_str().expect("utf-8 path");
    for pointer in ["error/code", "/error/~2"] {
        fails_with_2(
            &[
                "--status",
                "400",
                "--body-file",
                body,
                "--error-pointer",
                pointer,
            ],
            "--error-pointer",
        );
    }
}

#[test]
fn error_pointer_without_body_file_exits_2() {
    fails_with_2(
        &["--status", "400", "--error-pointer", "/error/code"],
        "--body-file",
    );
}

#[test]
fn body_that_is_not_json_says_why_no_code_was_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, &[u8], &str); 4] = [
        ("text.txt", b"upstream connect error", "body is not JSON"),
        ("bin.dat", &[0xff, 0x00, 0x9c, 0x42], "body is not JSON"),
        (
            "other.json",
            br#"{"message":"x"}"#,
            "nothing at the pointer",
        ),
        (
            "obj.json",
            br#"{"error":{"code":{"a":1}}}"#,
            "not a string, number or boolean at the pointer",
        ),
    ];
    for (name, bytes, reason) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).expect("write body");
        let v = json(&[
            "--status",
            "400",
            "--now",
            NOW,
            "--body-file",
            path.to_str().expect("utf-8 path"),
            "--error-pointer",
            "/error/code",
        ]);
        assert!(v["error_code"].is_null(), "{name}: {v}");
        assert_eq!(v["error_code_reason"], reason, "{name}: {v}");
    }
}

#[test]
fn error_code_longer_than_256_chars_is_ignored_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run_with = |code: &str| {
        let path = dir.path().join("body.json");
        std::fs::write(&path, format!(r#"{{"error":{{"code":"{code}"}}}}"#)).expect("write");
        json(&[
            "--status",
            "400",
            "--now",
            NOW,
            "--body-file",
            path.to_str().expect("utf-8 path"),
            "--error-pointer",
            "/error/code",
        ])
    };
    let v = run_with(&"x".repeat(257));
    assert!(v["error_code"].is_null(), "{v}");
    assert_eq!(v["error_code_reason"], "longer than 256 characters");
    let v = run_with(&"x".repeat(256));
    assert_eq!(v["error_code"], "x".repeat(256));
    assert!(v["error_code_reason"].is_null(), "{v}");
}

#[test]
fn anthropic_reset_later_than_retry_after_sets_the_boundary() {
    let v = json(&[
        "--status",
        "429",
        "--dialect",
        "anthropic",
        "-H",
        "retry-after: 7",
        "-H",
        "anthropic-ratelimit-requests-remaining: 0",
        "-H",
        "anthropic-ratelimit-requests-reset: 2026-01-01T00:00:20Z",
        "--now",
        "2026-01-01T00:00:00Z",
    ]);
    let b = &v["boundary"];
    assert_eq!(b["retry_not_before"], "2026-01-01T00:00:21Z");
    assert_eq!(b["delay_ms"], 21_000);
    assert_eq!(b["source"], "anthropic quota (requests) reset");
    let reason = b["reason"].as_str().unwrap();
    assert!(reason.contains("7000 ms"), "{reason}");
}

#[test]
fn generic_small_reset_is_labelled_generic_not_github() {
    let v = json(&[
        "--status",
        "429",
        "-H",
        "X-RateLimit-Remaining: 0",
        "-H",
        "X-RateLimit-Reset: 12",
        "--now",
        NOW,
    ]);
    assert_eq!(v["quota"][0]["dialect"], "generic");
    assert_eq!(
        v["quota"][0]["interpretation"],
        "x-ratelimit-reset 12 read as a delay in seconds (generic: ≤ 10^9)"
    );
    assert_eq!(v["boundary"]["source"], "generic quota reset");
    assert_eq!(v["boundary"]["delay_ms"], 13_000);
    let reason = v["boundary"]["reason"].as_str().unwrap();
    assert!(reason.contains("read as a delay in seconds"), "{reason}");
}

#[test]
fn pretty_prints_the_same_signal_indented() {
    let args = ["--status", "429", "-H", "Retry-After: 10", "--now", NOW];
    let one_line = json(&args);
    let mut pretty_args = args.to_vec();
    pretty_args.push("--pretty");
    let out = run(&pretty_args);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.lines().count() > 5, "indented over many lines: {text}");
    assert!(text.contains("\n  \"boundary\": {"), "{text}");
    let parsed: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(parsed, one_line);
}

#[test]
fn a_status_outside_u16_gets_the_same_refusal_as_one_outside_100_to_599() {
    for status in ["-5", "65536", "70000", "4.29", "abc"] {
        let out = run(&["--status", status, "--now", NOW]);
        assert_eq!(out.status.code(), Some(2), "{status}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("backstop classify: --status {status}: not an HTTP status (100..=599, RFC 9110 §15)\n")
        );
        assert!(out.stdout.is_empty());
    }
    let out = run(&["--status=-5", "--now", NOW]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "backstop classify: --status -5: not an HTTP status (100..=599, RFC 9110 §15)\n"
    );
}

#[test]
fn the_openai_dialect_reads_the_error_code_where_openai_documents_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = dir.path().join("body.json");
    std::fs::write(&body, r#"{"error":{"code":"insufficient_quota"}}"#).expect("write body");
    let body = body.to_str().expect("utf-8 path");
    let v = json(&[
        "--status",
        "429",
        "--dialect",
        "openai",
        "--body-file",
        body,
        "--now",
        NOW,
    ]);
    assert_eq!(v["error_code"], "insufficient_quota", "{v}");
    assert_eq!(v["disposition"], "quota_exhausted", "{v}");
    // Another dialect has no documented place: the body would be read for nothing.
    fails_with_2(
        &["--status", "429", "--body-file", body, "--now", NOW],
        "--body-file needs --error-pointer",
    );
}

#[test]
fn a_body_without_pointer_is_refused_in_one_evenly_spaced_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = dir.path().join("body.json");
    std::fs::write(&body, r#"{"error":{"code":"x"}}"#).expect("write body");
    let out = run(&[
        "--status",
        "429",
        "--body-file",
        body.to_str().expect("utf-8 path"),
        "--now",
        NOW,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(
        !err.contains("  "),
        "no run of spaces inside the message: {err:?}"
    );
    assert!(
        err.contains(
            "only the error code is read from the body, and the generic dialect has no documented place for it (e.g. --error-pointer /error/code; --dialect openai reads /error/code)"
        ),
        "{err:?}"
    );
}
