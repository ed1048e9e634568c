//! Crash safety: a writer killed with SIGKILL mid-stream loses nothing it reported as
//! committed, and the audit chain still verifies after recovery.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use backstop_store::audit::Verdict;
use backstop_store::{ActionId, AttemptState, AuditReader, SqliteStore, Store};

/// Runs one child until it reported `at_least` committed actions, SIGKILLs it, and returns
/// every id it reported (complete lines only).
fn run_and_kill(db: &std::path::Path, round: u32, at_least: usize) -> Vec<i64> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_store-crash-writer"))
        .arg(db)
        .arg("8")
        .arg(round.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn crash writer");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut ids = Vec::new();
    let mut line = String::new();
    while ids.len() < at_least {
        line.clear();
        let n = stdout.read_line(&mut line).expect("read child");
        if n == 0 {
            let mut err = String::new();
            let _ = child
                .stderr
                .take()
                .expect("stderr")
                .read_to_string(&mut err);
            panic!("writer ended early after {} ids: {err}", ids.len());
        }
        ids.push(line.trim().parse::<i64>().expect("an id per line"));
    }
    // Child::kill sends SIGKILL on Unix: no destructor, no final checkpoint.
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("drain");
    for l in rest.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        ids.push(l.trim().parse::<i64>().expect("an id per line"));
    }
    ids
}

#[test]
fn sigkilled_writer_loses_no_reported_action_and_the_chain_verifies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("crash.db");
    let mut reported = Vec::new();
    for round in 0..3 {
        let ids = run_and_kill(&db, round, 150);
        assert!(ids.len() >= 150);
        reported.extend(ids);

        // The killed writer left a WAL behind; a read-only audit check still works …
        let reader = AuditReader::open(&db).expect("audit reader after crash");
        assert!(matches!(
            reader.verify(None).expect("verify"),
            Verdict::Intact { .. }
        ));
        drop(reader);
        // … and the store reopens, recovers, and has every reported action as sent.
        let store = SqliteStore::open(&db).expect("reopen after SIGKILL");
        let verdict = store.verify_audit(None).expect("verify");
        let Verdict::Intact { count, .. } = verdict else {
            panic!("chain broken after crash: {verdict:?}");
        };
        assert!(
            count as usize >= 2 * reported.len(),
            "{count} events for {} actions",
            reported.len()
        );
        for id in &reported {
            let attempts = store.attempts(ActionId(*id)).expect("attempts");
            assert_eq!(
                attempts.len(),
                1,
                "action {id} reported committed but has {attempts:?}"
            );
            assert_eq!(attempts[0].state, AttemptState::Sent);
        }
        // Every sent write without a result is there to be reconciled after the restart.
        let unfinished = store.unfinished_attempts().expect("unfinished");
        assert!(unfinished.len() >= reported.len());
    }
}
