//! `backstop diagnose` end to end: the seed's six-case audit in every format, bad lines, stdin,
//! grace and clock options.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const NOW: &str = "2026-07-26T18:42:00Z";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures/six_case_audit.ndjson")
}

fn backstop(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .arg("diagnose")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    let input = stdin.map(<[u8]>::to_vec).unwrap_or_default();
    // Fed from another thread while the output is read: a command that writes before it has
    // read all its input must not block on a full pipe.
    let feeder = std::thread::spawn(move || {
        let _ = pipe.write_all(&input);
    });
    let output = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    output
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

const SIX: [&str; 6] = [
    "waiting_backpressure",
    "early_retry_loop",
    "stuck_missed_wake",
    "deadline_exhausted",
    "retry_budget_exhausted",
    "recovered",
];

#[test]
fn six_case_audit_as_json() {
    let f = fixture();
    let o = backstop(
        &[
            f.to_str().unwrap(),
            "--now",
            NOW,
            "--grace",
            "30s",
            "--format",
            "json",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let snapshots = doc["snapshots"].as_array().unwrap();
    let diagnoses: Vec<&str> = snapshots
        .iter()
        .map(|s| s["diagnosis"].as_str().unwrap())
        .collect();
    assert_eq!(diagnoses, SIX);
    assert_eq!(doc["totals"]["retry_after_debt_ms"], 1_230_000);
    assert_eq!(
        doc["totals"]["by_scope"]["billing-api/account:ops-team"]["retry_after_debt_ms"],
        1_020_000
    );
    assert_eq!(
        doc["totals"]["by_diagnosis"]["deadline_exhausted"]["retry_after_debt_ms"],
        900_000
    );
    assert_eq!(
        doc["totals"]["by_run"]["run-waiting"]["retry_after_debt_ms"],
        60_000
    );
    let waiting = &snapshots[0];
    assert_eq!(waiting["run_id"], "run-waiting");
    assert_eq!(waiting["quota_scope"], "llm-api/project:research");
    assert_eq!(waiting["action"], "leave_alone_check_wake");
    assert_eq!(waiting["headroom_ms"], 540_000);
    assert_eq!(waiting["retry_after_debt_ms"], 60_000);
    assert_eq!(waiting["line"], 1);
    for proof in ["limit", "wake", "authority", "outcome"] {
        assert_eq!(waiting["proofs"][proof], true, "{proof}");
    }
    assert_eq!(snapshots[3]["headroom_ms"], -300_000);
    assert_eq!(snapshots[3]["proofs"]["outcome"], false);
}

#[test]
fn six_case_audit_as_ndjson_ends_with_a_totals_line() {
    let f = fixture();
    let o = backstop(
        &[f.to_str().unwrap(), "--now", NOW, "--format", "ndjson"],
        None,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 7);
    let diagnoses: Vec<&str> = lines[..6]
        .iter()
        .map(|s| s["diagnosis"].as_str().unwrap())
        .collect();
    assert_eq!(diagnoses, SIX);
    assert_eq!(lines[6]["totals"]["retry_after_debt_ms"], 1_230_000);
    assert_eq!(lines[6]["totals"]["snapshots"], 6);
    assert_eq!(
        lines[6]["totals"]["by_diagnosis"]
            .as_object()
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn six_case_audit_as_table_from_stdin() {
    let input = std::fs::read(fixture()).unwrap();
    let o = backstop(&["-", "--now", NOW], Some(&input));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for (i, diagnosis) in SIX.iter().enumerate() {
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{} ", i + 1)))
            .unwrap_or_else(|| panic!("row {}: {out}", i + 1));
        assert!(row.contains(diagnosis), "{row}");
    }
    assert!(out.contains("TOTALS BY SCOPE"), "{out}");
    assert!(out.contains("TOTALS BY DIAGNOSIS"), "{out}");
    assert!(out.contains("retry_after_debt_ms=1230000"), "{out}");
    let billing = out
        .lines()
        .find(|l| l.trim_start().starts_with("billing-api/account:ops-team"))
        .unwrap();
    assert!(billing.contains("1020000"), "{billing}");
    // Nothing on stderr for a clean run that is not on a terminal.
    assert_eq!(stderr(&o), "");
}

#[test]
fn bad_lines_are_all_reported_with_numbers_and_nothing_is_printed() {
    let good: Vec<String> = std::fs::read_to_string(fixture())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let input = [
        good[0].as_str(),                                      // 1
        "this is not json",                                    // 2
        "",                                                    // 3 (blank, skipped)
        r#"{"run_id":"r","quota_scope":"s","status":429}"#,    // 4 missing throttled_at
        &good[1].replace("2026-07-26T18:38:05Z", "yesterday"), // 5 bad timestamp
        "   ",                                                 // 6 (blank, skipped)
        good[5].as_str(),                                      // 7
    ]
    .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("snapshots.ndjson");
    std::fs::write(&path, input).unwrap();
    for format in ["table", "json", "ndjson"] {
        let o = backstop(
            &[path.to_str().unwrap(), "--now", NOW, "--format", format],
            None,
        );
        assert_eq!(o.status.code(), Some(1), "{format}");
        assert_eq!(stdout(&o), "", "{format}: nothing partial is printed");
        let err = stderr(&o);
        let name = path.display().to_string();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 4, "{format}: {err}");
        assert!(
            lines[0].starts_with(&format!("{name}: LINE 2: not valid JSON: ")),
            "{err}"
        );
        assert!(
            lines[1].starts_with(&format!("{name}: LINE 4: ")) && lines[1].contains("throttled_at"),
            "{err}"
        );
        assert!(
            lines[2].starts_with(&format!("{name}: LINE 5: throttled_at")),
            "{err}"
        );
        assert_eq!(
            lines[3],
            format!(
                "{name}: 3 bad lines; nothing was printed: diagnose prints its results only when \
                 every line is a valid snapshot"
            )
        );
    }
}

#[test]
fn one_bad_line_prints_no_header_no_rows_and_no_totals() {
    // Only bad lines: before, the table's header and empty totals were printed.
    let o = backstop(&["--now", NOW], Some(b"not a snapshot\n"));
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "", "no empty table");
    let err = stderr(&o);
    assert!(err.starts_with("<stdin>: LINE 1: "), "{err}");
    assert!(err.ends_with("<stdin>: 1 bad line; nothing was printed: diagnose prints its results only when every line is a valid snapshot\n"), "{err}");

    // A bad last line after valid ones: none of the valid ones is printed either.
    let mut input = std::fs::read(fixture()).unwrap();
    input.extend_from_slice(b"{\"run_id\": \"r\"}\n");
    for format in ["table", "json", "ndjson"] {
        let o = backstop(&["--now", NOW, "--format", format], Some(&input));
        assert_eq!(o.status.code(), Some(1), "{format}");
        assert_eq!(stdout(&o), "", "{format}");
        assert!(
            stderr(&o).starts_with("<stdin>: LINE 7: missing field `quota_scope`"),
            "{format}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn an_output_larger_than_the_memory_spool_is_printed_whole_or_not_at_all() {
    // 20,000 results of about 500 bytes in JSON: more than the 8 MiB held in memory.
    let first = std::fs::read_to_string(fixture())
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let mut input = String::with_capacity(20_000 * (first.len() + 1) + 64);
    for _ in 0..20_000 {
        input.push_str(&first);
        input.push('\n');
    }
    let o = backstop(&["--now", NOW, "--format", "json"], Some(input.as_bytes()));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(o.stdout.len() > 8 << 20, "{} bytes", o.stdout.len());
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["snapshots"].as_array().unwrap().len(), 20_000);
    assert_eq!(doc["snapshots"][19_999]["line"], 20_000);
    assert_eq!(doc["totals"]["snapshots"], 20_000);

    input.push_str("{}\n");
    let o = backstop(&["--now", NOW, "--format", "json"], Some(input.as_bytes()));
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty(), "{} bytes printed", o.stdout.len());
    assert!(
        stderr(&o).starts_with("<stdin>: LINE 20001: "),
        "{}",
        stderr(&o)
    );
}

#[test]
fn an_overlong_line_is_bad_and_nothing_is_printed() {
    let good = std::fs::read_to_string(fixture()).unwrap();
    let first = good.lines().next().unwrap();
    let input = format!("{}\n{first}\n", "x".repeat(1 << 21));
    let o = backstop(
        &["--now", NOW, "--format", "ndjson"],
        Some(input.as_bytes()),
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("<stdin>: LINE 1: longer than"),
        "{}",
        stderr(&o)
    );
    assert_eq!(stdout(&o), "", "the valid line 2 is not printed either");
}

#[test]
fn grace_edge_through_the_cli() {
    // The waiting snapshot's wake is at 18:42:30.
    let good = std::fs::read_to_string(fixture()).unwrap();
    let first = format!("{}\n", good.lines().next().unwrap());
    let diagnosis_at = |now: &str, grace: &str| {
        let o = backstop(
            &["--now", now, "--grace", grace, "--format", "ndjson"],
            Some(first.as_bytes()),
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: Value = serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
        v["diagnosis"].as_str().unwrap().to_string()
    };
    assert_eq!(
        diagnosis_at("2026-07-26T18:43:00Z", "30s"),
        "waiting_backpressure"
    );
    assert_eq!(
        diagnosis_at("2026-07-26T18:43:00.001Z", "30s"),
        "stuck_missed_wake"
    );
    assert_eq!(
        diagnosis_at("2026-07-26T18:43:00Z", "1m"),
        "waiting_backpressure"
    );
    assert_eq!(
        diagnosis_at("2026-07-26T18:42:31Z", "500ms"),
        "stuck_missed_wake"
    );
}

#[test]
fn bad_options_and_missing_files_exit_2() {
    let f = fixture();
    let f = f.to_str().unwrap();
    for args in [
        vec![f, "--now", "yesterday"],
        vec![f, "--grace", "soon"],
        vec![f, "--grace", "-5s"],
        vec![f, "--format", "xml"],
    ] {
        let o = backstop(&args, None);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    let o = backstop(&["/nonexistent/snapshots.ndjson", "--now", NOW], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("/nonexistent/snapshots.ndjson"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn empty_input_gives_zero_totals() {
    let o = backstop(&["--now", NOW, "--format", "json"], Some(b""));
    assert_eq!(o.status.code(), Some(0));
    let doc: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(doc["snapshots"].as_array().unwrap().len(), 0);
    assert_eq!(doc["totals"]["retry_after_debt_ms"], 0);
    // Said on stderr, so an empty table is not read as "all healthy".
    assert!(
        stderr(&o).contains("no snapshots") && stderr(&o).contains("nothing was diagnosed"),
        "{}",
        stderr(&o)
    );
    let o = backstop(&["--now", NOW], Some(b"\n  \n"));
    assert_eq!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("no snapshots"), "{}", stderr(&o));
}

#[test]
fn snapshot_throttled_after_now_is_a_bad_line() {
    let good: Vec<String> = std::fs::read_to_string(fixture())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    // Diagnosed before the first snapshot was throttled (throttled_at 2026-07-26T18:41:30Z).
    let early_now = "2026-07-26T18:37:05Z";
    let input = format!("{}\n", good[0]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("snapshots.ndjson");
    std::fs::write(&path, input).unwrap();
    let o = backstop(
        &[
            path.to_str().unwrap(),
            "--now",
            early_now,
            "--format",
            "ndjson",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("{}: LINE 1: throttled_at: ", path.display()))
            && err.contains("is after now"),
        "{err}"
    );
    assert_eq!(stdout(&o), "", "not even a totals line");
}

#[test]
fn directory_input_fails_before_any_table_header() {
    let dir = tempfile::tempdir().unwrap();
    let o = backstop(&[dir.path().to_str().unwrap(), "--now", NOW], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty(), "printed {}", stdout(&o));
    assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
}

#[test]
fn a_device_that_never_ends_is_refused_before_it_is_read() {
    let o = backstop(&["/dev/zero", "--now", NOW], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty(), "printed {}", stdout(&o));
    assert!(
        stderr(&o).contains("/dev/zero: cannot open: is a character device"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bad_line_errors_name_no_root_path_and_no_json_line_number() {
    let input = "{\"run_id\":\"r\",\"quota_scope\":\"s\",\"throttled_at\":\"2026-07-26T18:41:00Z\",\"status\":429}\n{\"run_id\": \"r\",}\n";
    let o = backstop(&["--now", NOW], Some(input.as_bytes()));
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("<stdin>: LINE 1: missing field `attempts_used`\n"),
        "{err}"
    );
    assert!(err.contains("<stdin>: LINE 2: "), "{err}");
    assert!(!err.contains(".:"), "{err}");
    assert!(!err.contains("at line"), "{err}");
}

#[test]
fn a_longer_grace_never_turns_healthy_runs_into_budget_exhausted() {
    let f = fixture();
    for (grace, stuck) in [
        ("30s", "stuck_missed_wake"),
        ("20m", "waiting_backpressure"),
        ("1h30m", "waiting_backpressure"),
        ("48h", "waiting_backpressure"),
    ] {
        let o = backstop(
            &[
                f.to_str().unwrap(),
                "--now",
                NOW,
                "--grace",
                grace,
                "--format",
                "ndjson",
            ],
            None,
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let got: Vec<String> = stdout(&o)
            .lines()
            .take(6)
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                v["diagnosis"].as_str().unwrap().to_string()
            })
            .collect();
        let mut want = SIX.map(str::to_string).to_vec();
        want[2] = stuck.to_string();
        assert_eq!(got, want, "--grace {grace}");
    }
}

#[test]
fn table_lists_diagnoses_in_check_order_with_per_run_totals() {
    let f = fixture();
    let o = backstop(&[f.to_str().unwrap(), "--now", NOW], None);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let section = out
        .split("TOTALS BY DIAGNOSIS")
        .nth(1)
        .expect("a diagnosis section");
    let names: Vec<&str> = section
        .lines()
        .skip(2)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![
            "recovered",
            "retry_succeeded_unverified",
            "retry_budget_exhausted",
            "deadline_exhausted",
            "early_retry_loop",
            "stuck_missed_wake",
            "no_durable_wake",
            "uncertain_boundary",
            "waiting_backpressure",
        ]
    );
    // The longest diagnosis still leaves a gap before the next column.
    let unverified = section
        .lines()
        .find(|l| l.contains("retry_succeeded_unverified"))
        .unwrap();
    assert!(
        unverified.contains("retry_succeeded_unverified  "),
        "{unverified}"
    );
    let runs = out.split("TOTALS BY RUN").nth(1).expect("a run section");
    assert!(runs.contains("run-stuck"), "{runs}");
    let stuck = runs.lines().find(|l| l.contains("run-stuck")).unwrap();
    assert!(stuck.ends_with("stuck_missed_wake=1"), "{stuck}");
    assert!(stuck.contains(" 90000 "), "{stuck}");
}

#[test]
fn long_help_lists_the_snapshot_fields_and_which_are_required() {
    let o = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["diagnose", "--help"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let help = stdout(&o);
    let required = help
        .split("required:")
        .nth(1)
        .and_then(|s| s.split("optional").next())
        .expect("a required section");
    for field in [
        "run_id",
        "quota_scope",
        "throttled_at",
        "status",
        "attempts_used",
        "max_attempts",
        "wait_budget_ms",
        "wait_used_ms",
    ] {
        assert!(required.contains(field), "{field} in {required}");
    }
    for field in [
        "retry_after_raw",
        "retry_not_before",
        "scheduled_retry_at",
        "outcome_deadline",
        "completion_estimate_ms",
        "outcome_receipt",
    ] {
        assert!(!required.contains(field), "{field}");
        assert!(help.contains(field), "{field}");
    }
}

#[test]
fn grace_takes_bare_seconds_like_the_wait_parameter() {
    // The waiting snapshot's wake is at 18:42:30: 30 s of grace keeps it waiting at 18:43:00,
    // 5 s does not.
    let good = std::fs::read_to_string(fixture()).unwrap();
    let first = format!("{}\n", good.lines().next().unwrap());
    let diagnosis = |grace: &str| {
        let o = backstop(
            &[
                "--now",
                "2026-07-26T18:43:00Z",
                "--grace",
                grace,
                "--format",
                "ndjson",
            ],
            Some(first.as_bytes()),
        );
        assert_eq!(o.status.code(), Some(0), "--grace {grace}: {}", stderr(&o));
        let v: Value = serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
        v["diagnosis"].as_str().unwrap().to_string()
    };
    assert_eq!(diagnosis("30"), "waiting_backpressure");
    assert_eq!(diagnosis("30.0"), "waiting_backpressure");
    assert_eq!(diagnosis("5"), "stuck_missed_wake");
    assert_eq!(diagnosis("29.999"), "stuck_missed_wake");
}

#[test]
fn a_bad_grace_is_named_with_the_accepted_forms_in_our_words() {
    let f = fixture();
    for value in ["1d", "soon", "5x", "1.2.3"] {
        let o = backstop(&[f.to_str().unwrap(), "--grace", value], None);
        assert_eq!(o.status.code(), Some(2), "--grace {value}");
        let err = stderr(&o);
        assert!(err.contains(&format!("'{value}'")), "{err}");
        assert!(err.contains("--grace"), "{err}");
        assert!(
            err.contains("give seconds (30 or 2.5), a number with a unit ms, s, m or h"),
            "{err}"
        );
        assert!(!err.contains("jiff"), "{err}");
        assert!(!err.contains("friendly"), "{err}");
    }
}

#[test]
fn a_leading_byte_order_mark_is_skipped() {
    let mut input = b"\xEF\xBB\xBF".to_vec();
    input.extend(std::fs::read(fixture()).unwrap());
    let o = backstop(&["-", "--now", NOW, "--format", "json"], Some(&input));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 6);
    assert_eq!(v["snapshots"][0]["line"], 1);
}

#[test]
fn a_sqlite_database_is_named_as_one_before_anything_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
        .unwrap();
    let o = backstop(&[db.to_str().unwrap(), "--now", NOW], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(stdout(&o), "", "no table header for a database");
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("this is a SQLite database, not NDJSON snapshots"),
        "{err}"
    );
    assert!(
        err.contains(&format!("backstop snapshots export --db {}", db.display())),
        "{err}"
    );
}

#[test]
fn an_audit_export_is_named_once_not_line_by_line() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    let store = backstop_store::SqliteStore::open(&db).unwrap();
    for run in ["run-a", "run-b", "run-c", "run-d"] {
        crate::common::sent_action(&store, run, None, "POST", "/v1/x", "idempotent_write");
    }
    drop(store);
    let export = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["audit", "export", "--db", db.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(export.status.code(), Some(0));
    assert_eq!(export.stdout.split(|&b| b == b'\n').count(), 13);
    let o = backstop(&["-", "--now", NOW], Some(&export.stdout));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(
        lines[0].starts_with("<stdin>: LINE 1: this line is an audit event"),
        "{err}"
    );
    assert!(lines[0].contains("backstop snapshots export"), "{err}");
    assert_eq!(
        lines[1],
        "<stdin>: 12 lines are audit events, not snapshots"
    );
    assert!(
        lines[2].starts_with("<stdin>: 12 bad lines; nothing was printed"),
        "{err}"
    );
    assert_eq!(stdout(&o), "");
    // Real snapshots beside them are not diagnosed either: nothing partial is printed.
    let mut mixed = std::fs::read(fixture()).unwrap();
    mixed.extend(&export.stdout);
    let o = backstop(&["-", "--now", NOW, "--format", "json"], Some(&mixed));
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "");
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 3, "{err}");
    assert!(
        err.starts_with("<stdin>: LINE 7: this line is an audit event"),
        "{err}"
    );
}

#[test]
fn table_escapes_control_and_bidi_characters_of_a_run_id() {
    let first = std::fs::read_to_string(fixture()).unwrap();
    let line = first.lines().next().unwrap();
    // ESC [2J (clear screen), BEL, U+202E (right-to-left override) and a backslash.
    let hostile = line.replace(
        "\"run_id\":\"run-waiting\"",
        "\"run_id\":\"run\\u001b[2J\\u0007\\u202ex\\\\y\"",
    );
    assert_ne!(hostile, line);
    let o = backstop(
        &["--now", NOW, "--format", "table"],
        Some(hostile.as_bytes()),
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for raw in ['\u{1b}', '\u{7}', '\u{202e}'] {
        assert!(!out.contains(raw), "{raw:?} printed raw: {out:?}");
    }
    assert!(out.contains(r"run\u{1b}[2J\u{7}\u{202e}x\\y"), "{out}");
}
