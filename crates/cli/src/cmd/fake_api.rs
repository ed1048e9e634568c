//! `backstop fake-api`: run the controllable fake provider (SPEC §13) from a YAML config.
//!
//! Logs one line per attempt to stderr (never the credential, only whether it was present) and
//! stops on Ctrl-C or SIGTERM: no new connection is accepted, idle kept-alive connections are
//! closed at once, and responses in progress may finish for up to `--shutdown-grace-seconds`
//! (a second Ctrl-C or SIGTERM ends the grace); then one line says it stopped. The attempt
//! record is also served at `GET /__fake/attempts`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use backstop_fake_api::{AttemptOutcome, AttemptRecord, FakeConfig, Stopped};

use crate::cmd::output::errln;

/// Arguments of `backstop fake-api`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// YAML config of the fake provider (see examples/fake-api.yaml).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: PathBuf,
    /// Address to listen on (port 0 picks a free port, printed at start).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// Seed of the fake's pseudo-random generator; overrides the config's `seed`.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// On Ctrl-C or SIGTERM, most seconds that responses in progress (a held request, a
    /// stream) may take to finish; idle connections are closed at once, and a second Ctrl-C or
    /// SIGTERM stops at once.
    #[arg(long, value_name = "SECONDS", default_value_t = 5)]
    pub shutdown_grace_seconds: u64,
}

/// The one line printed when the fake has stopped.
fn stopped_line(stopped: Stopped, grace: Duration) -> String {
    match stopped.cut {
        0 => "backstop fake-api: stopped".to_owned(),
        cut => format!(
            "backstop fake-api: stopped; closed {cut} connection{} whose response had not ended \
             within the {} s grace",
            if cut == 1 { "" } else { "s" },
            grace.as_secs(),
        ),
    }
}

/// One stderr line for one attempt, e.g.
/// `fake-api #3 2025-01-01T00:00:00.123Z POST /v1/transfers -> 201 route="POST /v1/transfers" call=3 key=k1`.
fn log_line(record: &AttemptRecord) -> String {
    let target = match &record.query {
        Some(query) => format!("{}?{query}", record.path),
        None => record.path.clone(),
    };
    let result = match (record.outcome, record.status) {
        (AttemptOutcome::Dropped, _) => "dropped".to_owned(),
        (AttemptOutcome::Timeout, _) => "timeout".to_owned(),
        (_, Some(status)) => status.to_string(),
        (_, None) => "pending".to_owned(),
    };
    let mut line = format!(
        "fake-api #{} {} {} {target} -> {result}",
        record.seq, record.at, record.method
    );
    if let Some(route) = &record.route {
        line.push_str(&format!(" route={route:?}"));
    }
    if let Some(call) = record.call {
        line.push_str(&format!(" call={call}"));
    }
    if let Some(key) = &record.idempotency_key {
        line.push_str(&format!(" key={key:?}"));
    }
    if let Some(fault) = &record.fault {
        line.push_str(&format!(" fault={fault}"));
    }
    if record.replayed {
        line.push_str(" replayed");
    }
    if record.auth_present {
        line.push_str(" auth=present");
    }
    line
}

/// Runs `backstop fake-api`: exit 0 after a clean shutdown, 2 for a bad config, 1 when the
/// address cannot be bound or the runtime fails.
pub fn run(args: Args) -> ExitCode {
    let mut config = match FakeConfig::from_yaml_file(&args.config) {
        Ok(config) => config,
        Err(e) => {
            errln!("backstop fake-api: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(seed) = args.seed {
        config.seed = seed;
    }
    let observer = Arc::new(|record: &AttemptRecord| errln!("{}", log_line(record)));
    let grace = Duration::from_secs(args.shutdown_grace_seconds);
    let result =
        backstop_fake_api::run_until_signal(config, args.listen, observer, grace, |addr| {
            errln!("backstop fake-api: listening on http://{addr} (attempts at /__fake/attempts)");
        });
    match result {
        Ok(stopped) => {
            errln!("{}", stopped_line(stopped, grace));
            ExitCode::SUCCESS
        }
        Err(e) => {
            errln!("backstop fake-api: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_line_shows_the_attempt_without_the_credential() {
        let record = AttemptRecord {
            seq: 3,
            at: "2025-01-01T00:00:00.123Z".into(),
            method: "POST".into(),
            path: "/v1/transfers".into(),
            query: None,
            route: Some("POST /v1/transfers".into()),
            call: Some(3),
            idempotency_key: Some("k1".into()),
            body_sha256: None,
            body_bytes: 0,
            auth_present: true,
            auth_sha256: Some("0123456789abcdef".into()),
            status: None,
            outcome: AttemptOutcome::Dropped,
            fault: Some("store_then_drop".into()),
            replayed: false,
        };
        assert_eq!(
            log_line(&record),
            "fake-api #3 2025-01-01T00:00:00.123Z POST /v1/transfers -> dropped \
             route=\"POST /v1/transfers\" call=3 key=\"k1\" fault=store_then_drop auth=present"
        );
    }
}
