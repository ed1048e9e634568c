//! Test helper for the crash test: records write actions in a loop from several threads and
//! prints each action's id on its own line once `mark_attempt_sent` returned (that is, once the
//! `action_sent` event is committed and fsync'd). The test kills it with SIGKILL at an arbitrary
//! point. Usage: `store-crash-writer DB THREADS ROUND`.

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use backstop_store::{
    Admission, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate, SqliteStore, Store,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(db), Some(threads), Some(round)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: store-crash-writer DB THREADS ROUND");
        return ExitCode::from(2);
    };
    let (Ok(threads), Ok(round)) = (threads.parse::<u32>(), round.parse::<u32>()) else {
        eprintln!("store-crash-writer: THREADS and ROUND must be numbers");
        return ExitCode::from(2);
    };
    match run(db, threads, round) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("store-crash-writer: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(db: &str, threads: u32, round: u32) -> Result<(), backstop_store::StoreError> {
    // A fixed base instant; the helper never reads the clock.
    let at = |ms: u64| {
        jiff::Timestamp::from_millisecond(1_750_000_000_000 + ms as i64).unwrap_or_default()
    };
    let store = Arc::new(SqliteStore::open(db)?);
    let task = format!("crash-{round}");
    store.open_task(
        NewTask {
            id: task.clone(),
            agent: "crash-agent".into(),
            priority: Priority::Normal,
            deadline: None,
        },
        at(0),
    )?;
    let route = RouteTemplate::try_new("/v1/transfers")?;
    let workers: Vec<_> = (0..threads)
        .map(|w| {
            let (store, task, route) = (Arc::clone(&store), task.clone(), route.clone());
            std::thread::spawn(move || -> Result<(), backstop_store::StoreError> {
                for i in 0u64.. {
                    let key = format!("r{round}-w{w}-{i}");
                    let action = NewAction {
                        task_id: task.clone(),
                        agent: "crash-agent".into(),
                        provider: "billing-api".into(),
                        method: "POST".into(),
                        route: route.clone(),
                        request_class: "idempotent_write".into(),
                        payload_digest: PayloadDigest::of(key.as_bytes()),
                        target_digest: None,
                        idempotency_key: key,
                        external_reference: None,
                        desired_outcome: None,
                        fingerprint: None,
                        request: None,
                    };
                    let Admission::New(id) = store.record_action(action, at(i))? else {
                        continue;
                    };
                    store.mark_attempt_sent(id, at(i))?;
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{}", id.0);
                    let _ = out.flush();
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        match w.join() {
            Ok(r) => r?,
            Err(_) => return Err(backstop_store::StoreError::WriterGone),
        }
    }
    Ok(())
}
