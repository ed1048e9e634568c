//! `backstop snapshots export --db FILE [--task ID] [--now RFC3339] [--policy FILE]`
//!
//! Writes one SPEC §10 snapshot per throttled action, derived from the gateway's own receipts in
//! its database (the audit log and task deadlines; see `backstop_gateway::health` for where each
//! field comes from), as NDJSON on stdout — the input `backstop diagnose` reads:
//!
//! ```text
//! backstop snapshots export --db backstop.db | backstop diagnose --format table
//! ```
//!
//! The database is opened read-only and never created (a running gateway may keep writing it).
//! `--task` limits the export to one run. `--now` fixes the instant a pending wait is measured
//! to (`wait_used_ms`; default: the current time). `--policy` supplies the request classes'
//! attempt and wait ceilings and the route scopes; without it the SPEC §3 defaults are used
//! (`read` 4 / 90 s, `idempotent_write` 3 / 120 s, `uncertain_write` 1 / 0 s).
//!
//! Without `--policy`, a snapshot whose scope the gateway did not record beside the throttling
//! result is named by its provider only (`quota_scope` = `billing-api` instead of the route's
//! scope); one note on stderr says how many were, and that `--policy` names them.
//!
//! With a `--policy` that does not match the database, a warning on stderr names what the
//! exported snapshots use and the policy lacks: providers (their scopes fall back to the
//! provider's name), scopes the gateway recorded, routes the policy gives no scope, and request
//! classes (their ceilings fall back to 1 attempt, no wait). The output is still written.
//!
//! Exit status: 0 on success (also when nothing was throttled; with `--task`, a line on stderr
//! says that the task's actions were not throttled), 1 when `--task` names a task of which no
//! action is in the database (said on stderr: usually a mistyped id), 2 when the database or the
//! policy cannot be read or stdout fails. A closed stdout (`| head`) ends quietly.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use backstop_core::policy::Policy;
use backstop_gateway::health::{
    derive_snapshot, ActionTrail, Evidence, HealthPolicy, SnapshotContext,
};
use backstop_store::snapshots::RunRecordsReader;
use jiff::Timestamp;

use crate::cmd::clock::{current_time, parse_now};
use crate::cmd::output::{self, errln};

/// Arguments of `backstop snapshots`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: SnapshotsCommand,
}

#[derive(Debug, clap::Subcommand)]
enum SnapshotsCommand {
    /// Export one NDJSON snapshot per throttled action (input of `backstop diagnose`).
    ///
    /// Exit status: 0 on success, also when nothing was throttled; 1 when --task names a task
    /// with no action in the database (said on stderr); 2 when the database or the policy
    /// cannot be read, or stdout fails.
    Export(ExportArgs),
}

#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// The gateway's SQLite database (opened read-only, never created).
    #[arg(long)]
    db: PathBuf,
    /// Export only this run (task id). No action of it in the database: a line on stderr and
    /// exit 1.
    #[arg(long)]
    task: Option<String>,
    /// The instant pending waits are measured to (RFC 3339). Default: the current time.
    #[arg(long, value_parser = parse_now)]
    now: Option<Timestamp>,
    /// The gateway's policy file, for class ceilings and route scopes (default: the built-in
    /// request classes `read`, `idempotent_write` and `uncertain_write`, and a scope the gateway
    /// did not record is named by its provider only).
    #[arg(long)]
    policy: Option<PathBuf>,
}

/// Runs `backstop snapshots …`.
pub fn run(args: Args) -> ExitCode {
    match args.command {
        SnapshotsCommand::Export(args) => export(args),
    }
}

fn export(args: ExportArgs) -> ExitCode {
    let loaded = match load_policy(args.policy.as_ref()) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    let policy = loaded
        .as_ref()
        .map_or_else(HealthPolicy::spec_defaults, HealthPolicy::from_policy);
    let place = args.db.display().to_string();
    let (reader, evidence) = match read_evidence(&args, &place) {
        Ok(read) => read,
        Err(code) => return code,
    };
    let export = Export {
        reader: &reader,
        evidence: &evidence,
        policy: &policy,
        loaded: loaded.as_ref(),
        task: args.task.as_deref(),
        now: args.now.unwrap_or_else(current_time),
        place: &place,
    };
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let (counts, mismatch, written) = match export.write(&mut out) {
        Ok(done) => done,
        Err(code) => return code,
    };
    let written = written.and_then(|()| out.flush());
    let code = counts.report(&args, &place);
    if let Some(loaded) = &loaded {
        for warning in mismatch.warnings(&loaded.file) {
            errln!("backstop snapshots export: warning: {warning}");
        }
    }
    match written {
        Ok(()) => code,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => code,
        Err(e) => {
            errln!("backstop snapshots export: cannot write output: {e}");
            ExitCode::from(2)
        }
    }
}

/// The `--policy` file, when given; its problems are printed and exit 2.
fn load_policy(path: Option<&PathBuf>) -> Result<Option<Policy>, ExitCode> {
    let Some(path) = path else {
        return Ok(None);
    };
    match Policy::load(path) {
        Ok(policy) => Ok(Some(policy)),
        Err(errors) => {
            for error in &errors.0 {
                errln!(
                    "backstop snapshots export: {}",
                    output::terminal_safe(&error.to_string())
                );
            }
            Err(ExitCode::from(2))
        }
    }
}

/// Opens the database read-only and ingests its audit log (an event that cannot be ingested is
/// skipped, said on stderr); a database that cannot be read exits 2.
fn read_evidence(args: &ExportArgs, place: &str) -> Result<(RunRecordsReader, Evidence), ExitCode> {
    let failed = |e: &dyn std::fmt::Display| {
        errln!("backstop snapshots export: {}", at_place(place, e));
        ExitCode::from(2)
    };
    let reader = RunRecordsReader::open(&args.db).map_err(|e| failed(&e))?;
    let events = reader.audit_events().map_err(|e| failed(&e))?;
    let mut evidence = Evidence::new();
    for event in &events {
        if let Err(e) = evidence.ingest(event) {
            errln!("backstop snapshots export: {place}: skipped: {e}");
        }
    }
    Ok((reader, evidence))
}

/// One export's inputs.
struct Export<'a> {
    reader: &'a RunRecordsReader,
    evidence: &'a Evidence,
    policy: &'a HealthPolicy,
    loaded: Option<&'a Policy>,
    task: Option<&'a str>,
    now: Timestamp,
    place: &'a str,
}

/// How many actions an export looked at and wrote.
#[derive(Debug, Default)]
struct Counts {
    /// Actions of the task asked for.
    of_task: usize,
    /// Snapshots written.
    exported: usize,
    /// Snapshots named by provider only.
    by_provider: usize,
    /// Actions of the task asked for that were throttled and then cancelled (no snapshot).
    cancelled_throttled: usize,
}

impl Export<'_> {
    /// Writes one NDJSON snapshot per throttled action (of the task asked for) to `out`, up to
    /// the first write error; returns the counts, what the policy lacks and the write result.
    /// A task record that cannot be read exits 2.
    fn write(&self, out: &mut impl Write) -> Result<(Counts, Mismatch, io::Result<()>), ExitCode> {
        let mut counts = Counts::default();
        let mut mismatch = Mismatch::default();
        let mut deadlines: HashMap<String, Option<Timestamp>> = HashMap::new();
        let mut written = Ok(());
        for trail in self.evidence.trails() {
            if self.task.is_some_and(|t| t != trail.task) {
                continue;
            }
            counts.of_task += 1;
            if trail.throttled_then_cancelled() {
                counts.cancelled_throttled += 1;
            }
            let ctx = SnapshotContext {
                deadline: self.deadline(&mut deadlines, &trail.task)?,
                policy: self.policy,
                heartbeat_at: self.evidence.heartbeat_at(),
                now: self.now,
            };
            let Some(snapshot) = derive_snapshot(trail, &ctx) else {
                continue;
            };
            counts.exported += 1;
            if snapshot.quota_scope == trail.provider {
                counts.by_provider += 1;
            }
            if let Some(loaded) = self.loaded {
                mismatch.note(loaded, trail, &snapshot.quota_scope);
            }
            written = serde_json::to_writer(&mut *out, &snapshot)
                .map_err(io::Error::from)
                .and_then(|()| out.write_all(b"\n"));
            if written.is_err() {
                break;
            }
        }
        Ok((counts, mismatch, written))
    }

    /// The deadline of `task`, read once per task into `deadlines`.
    fn deadline(
        &self,
        deadlines: &mut HashMap<String, Option<Timestamp>>,
        task: &str,
    ) -> Result<Option<Timestamp>, ExitCode> {
        if let Some(deadline) = deadlines.get(task) {
            return Ok(*deadline);
        }
        // The audit trail names the task id only; this offline operator view considers every
        // agent's task with the id, and the earliest deadline wins (warn soonest).
        match self.reader.tasks_of_every_agent(task) {
            Ok(tasks) => {
                let deadline = tasks.into_iter().filter_map(|t| t.deadline).min();
                deadlines.insert(task.to_owned(), deadline);
                Ok(deadline)
            }
            Err(e) => {
                errln!("backstop snapshots export: {}", at_place(self.place, &e));
                Err(ExitCode::from(2))
            }
        }
    }
}

impl Counts {
    /// Says on stderr what a `--task` export found nothing to export for, and what a
    /// policy-less export named by provider only; exit 1 when `--task` names no action.
    fn report(&self, args: &ExportArgs, place: &str) -> ExitCode {
        let Counts {
            of_task,
            exported,
            by_provider,
            cancelled_throttled,
        } = *self;
        let mut code = ExitCode::SUCCESS;
        if let Some(task) = &args.task {
            if of_task == 0 {
                errln!("backstop snapshots export: {place}: no action of task `{task}` was found");
                code = ExitCode::from(1);
            } else if exported == 0 && cancelled_throttled > 0 {
                errln!(
                    "backstop snapshots export: {place}: task `{task}` has {of_task} action{}; {cancelled_throttled} of them {} throttled and then cancelled, and a cancelled action waits for nothing, so it has no snapshot: nothing to export",
                    if of_task == 1 { "" } else { "s" },
                    if cancelled_throttled == 1 { "was" } else { "were" }
                );
            } else if exported == 0 {
                errln!(
                    "backstop snapshots export: {place}: task `{task}` has {of_task} action{}, none throttled: nothing to export",
                    if of_task == 1 { "" } else { "s" }
                );
            }
        }
        if args.policy.is_none() && by_provider > 0 {
            errln!(
                "backstop snapshots export: note: without --policy, {by_provider} snapshot{} whose scope the gateway did not record {} named by the provider only (quota_scope without `/scope`); pass the gateway's policy with --policy to name the route's scope",
                if by_provider == 1 { "" } else { "s" },
                if by_provider == 1 { "is" } else { "are" }
            );
        }
        code
    }
}

/// What the exported snapshots use and the `--policy` file lacks, each with how many snapshots
/// it touches.
#[derive(Debug, Default)]
struct Mismatch {
    /// Providers absent from the policy.
    providers: BTreeMap<String, usize>,
    /// Scopes the gateway recorded (`provider/scope`) that the policy's provider does not declare.
    scopes: BTreeMap<String, usize>,
    /// Routes (`provider METHOD template`) of a provider in the policy for which the policy names
    /// no scope (no route scope, no default scope): their snapshots are named by provider only.
    unscoped: BTreeMap<String, usize>,
    /// Request classes absent from the policy.
    classes: BTreeMap<String, usize>,
}

impl Mismatch {
    /// Notes what one exported snapshot (of `trail`, named `quota_scope`) finds missing.
    fn note(&mut self, policy: &Policy, trail: &ActionTrail, quota_scope: &str) {
        match policy.providers.get(&trail.provider) {
            None => *self.providers.entry(trail.provider.clone()).or_default() += 1,
            Some(provider) => {
                if quota_scope == trail.provider {
                    let route = format!("{} {} {}", trail.provider, trail.method, trail.route);
                    *self.unscoped.entry(route).or_default() += 1;
                } else {
                    let short = quota_scope
                        .strip_prefix(trail.provider.as_str())
                        .and_then(|rest| rest.strip_prefix('/'));
                    if short.is_none_or(|s| !provider.scopes.contains_key(s)) {
                        *self.scopes.entry(quota_scope.to_owned()).or_default() += 1;
                    }
                }
            }
        }
        if !policy.request_classes.contains_key(&trail.request_class) {
            *self.classes.entry(trail.request_class.clone()).or_default() += 1;
        }
    }

    /// One warning line per kind of mismatch (none when the policy covers every snapshot).
    fn warnings(&self, file: &str) -> Vec<String> {
        fn listed(map: &BTreeMap<String, usize>) -> (String, usize) {
            let names: Vec<String> = map.keys().map(|k| format!("`{k}`")).collect();
            (names.join(", "), map.values().sum())
        }
        fn snapshots(n: usize) -> String {
            format!("{n} snapshot{}", if n == 1 { "" } else { "s" })
        }
        let mut out = Vec::new();
        if !self.providers.is_empty() {
            let (names, n) = listed(&self.providers);
            out.push(format!(
                "{file}: the database's provider {names} ({}) is not in this policy: a scope the gateway did not record is named by the provider only (quota_scope without `/scope`); pass the policy the gateway ran with",
                snapshots(n)
            ));
        }
        if !self.scopes.is_empty() {
            let (names, n) = listed(&self.scopes);
            out.push(format!(
                "{file}: the scope {names} the gateway recorded ({}) is not declared in this policy; pass the policy the gateway ran with",
                snapshots(n)
            ));
        }
        if !self.unscoped.is_empty() {
            let (names, n) = listed(&self.unscoped);
            out.push(format!(
                "{file}: this policy names no scope (no route scope, no default scope) for {names}, so {} named by the provider only (quota_scope without `/scope`)",
                if n == 1 { "1 snapshot is".to_owned() } else { format!("{n} snapshots are") }
            ));
        }
        if !self.classes.is_empty() {
            let (names, n) = listed(&self.classes);
            out.push(format!(
                "{file}: the request class {names} ({}) is not in this policy: its ceilings are taken as 1 attempt and no wait",
                snapshots(n)
            ));
        }
        out
    }
}

/// A store error as one message naming the database once: the store's own message when it
/// already names the path (`nope.db: no such database file`), else `PATH: message`.
fn at_place(place: &str, error: &(impl std::fmt::Display + ?Sized)) -> String {
    let message = error.to_string();
    if message.contains(place) {
        message
    } else {
        format!("{place}: {message}")
    }
}
