//! `backstop diagnose [FILE|-] [--now RFC3339] [--grace 30s|30] [--format table|json|ndjson]`
//!
//! Reads throttled-action snapshots (one JSON object per line, SPEC §10) and prints one diagnosis
//! per snapshot with its bounded action, headroom and retry-after debt, then totals by scope, by
//! diagnosis, by run and overall.
//!
//! Nothing partial is printed: the whole input is checked before anything reaches stdout. Each
//! result is formatted as soon as it is computed into a [`Spool`] — memory up to
//! [`SPOOL_MEMORY_BYTES`], then an unnamed temporary file (`TMPDIR`) — which is copied to stdout
//! only once the last line turned out valid. At the first bad line the spool is dropped and
//! the rest of the input is only checked, so that every bad line is named.
//!
//! Memory: the input is read line by line into one reused buffer (lines longer than
//! [`MAX_LINE_BYTES`] are rejected without being held), and the output is held in memory only
//! up to [`SPOOL_MEMORY_BYTES`]; no format holds the snapshots or the results (`json` streams
//! its `snapshots` array element by element into the spool). Only the [`Totals`] grow, with the
//! number of distinct runs and scopes.
//!
//! Output shapes (each result is [`DiagnosisReport`] plus the input `line` number; the four proofs
//! are nested as `"proofs": {"limit", "wake", "authority", "outcome"}`, each `true`, `false` or
//! `null`):
//! - `table`: one row per snapshot (line, run, scope, diagnosis, action, headroom_ms, debt_ms),
//!   then totals by scope, by run, by diagnosis (every diagnosis, in the SPEC §10 check order)
//!   and overall;
//! - `json`: `{"snapshots":[…], "totals":{…}}`;
//! - `ndjson`: one result per input snapshot, then one final `{"totals":{…}}` line.
//!
//! A bad line (not JSON, a missing required field, a bad timestamp, an inconsistent snapshot, a
//! `throttled_at` after `--now`, longer than [`MAX_LINE_BYTES`]) is reported on stderr as
//! `FILE: LINE N: reason`; the rest of the input is still checked, every bad line is reported,
//! a last line says that nothing was printed, stdout stays empty and the exit status is 1.
//! Blank lines and a leading UTF-8 byte-order mark are skipped silently. Lines that are audit
//! events (`backstop audit export`) are bad lines too, but only the first is reported, saying
//! what the input is and where snapshots come from (`backstop snapshots export`), and the
//! others are counted once at the end. An input that cannot be opened or read (a directory
//! included), a SQLite database (said as such), or output that cannot be written (or held until
//! the input is checked), exits with 2, with nothing printed. A closed stdout (e.g. `| head`)
//! ends quietly.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use backstop_core::diagnose::{
    diagnose_owned, parse_snapshot, DiagnoseOptions, Diagnosis, DiagnosisReport, GroupTotals,
    Totals, WakeGrace,
};
use jiff::{SignedDuration, Timestamp};
use serde::Serialize;

use crate::cmd::clock::{current_time, parse_now};
use crate::cmd::output::{self, errln};

/// Lines longer than this (1 MiB) are bad lines, dropped without being held, so memory stays bounded.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Output held in memory until the input is checked; beyond it, the rest goes to a temporary
/// file (8 MiB: about 60,000 table rows or 15,000 JSON results).
pub const SPOOL_MEMORY_BYTES: usize = 8 << 20;

/// The first 16 bytes of every SQLite database file (the SQLite file format, §1.3).
const SQLITE_HEADER: &[u8] = b"SQLite format 3\0";

/// The UTF-8 byte-order mark some editors put at the start of a file.
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Where snapshots come from, said when the input is something else.
const SNAPSHOTS_HINT: &str = "diagnose reads health snapshots; derive them from a gateway's \
     store with `backstop snapshots export --db FILE --policy FILE`";

/// How often (in lines) the progress counter is refreshed, when stderr is a terminal.
const PROGRESS_EVERY_LINES: u64 = 100_000;

/// Output format of `backstop diagnose`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned text: one row per snapshot, then totals.
    Table,
    /// One JSON document `{"snapshots":[…], "totals":{…}}` (streamed).
    Json,
    /// One JSON result per line, then a final `{"totals":…}` line.
    Ndjson,
}

/// The snapshot fields, shown by `backstop diagnose --help` (SPEC §10).
const SNAPSHOT_FIELDS_HELP: &str = "\
SNAPSHOT FIELDS (one JSON object per line; times RFC 3339 UTC; unknown fields are ignored):
  required:
    run_id                  string, non-empty: the task (run)
    quota_scope             string, non-empty: e.g. billing-api/account:ops-team
    throttled_at            time the throttling response was received (not after --now)
    status                  HTTP status of that response (100-599, usually 429)
    attempts_used           attempts started so far, the throttled one included
    max_attempts            attempts the budget authorizes
    wait_budget_ms          wait budget of the action, milliseconds
    wait_used_ms            time already waited, milliseconds
  optional (absent or null):
    retry_after_raw         the raw Retry-After value (string)
    date_header             the raw Date header of the same response
    retry_not_before        the normalized boundary; wins over retry_after_raw
    scheduled_retry_at      when the durable retry is scheduled (none: no_durable_wake)
    scheduler_job_id        job id of the durable retry (evidence only)
    scheduler_heartbeat_at  last scheduler heartbeat (evidence only)
    retry_started_at        when the retry started
    retry_finished_at       when its response arrived (needs retry_started_at)
    retry_status            HTTP status of the retry (needs retry_finished_at)
    outcome_deadline        when the outcome must be delivered and verified
    completion_estimate_ms  time needed after the boundary to finish, milliseconds (default 0)
    outcome_receipt         {\"matches\": true|false}, or null when none exists

DIAGNOSES, in check order (first match wins): recovered, retry_succeeded_unverified,
retry_budget_exhausted, deadline_exhausted, early_retry_loop, stuck_missed_wake,
no_durable_wake, uncertain_boundary, waiting_backpressure.";

/// Arguments of `backstop diagnose`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = SNAPSHOT_FIELDS_HELP)]
pub struct Args {
    /// NDJSON snapshot file; `-` or nothing reads standard input.
    pub input: Option<PathBuf>,
    /// The instant to diagnose at (RFC 3339, e.g. 2026-07-26T18:42:00Z). Default: the current time.
    #[arg(long, value_parser = parse_now)]
    pub now: Option<Timestamp>,
    /// How long past scheduled_retry_at a retry may take to start before the wake counts as
    /// missed: seconds (e.g. 30) or a duration (e.g. 30s, 1m, 500ms, 1h30m, PT30S). Affects
    /// only the missed-wake check.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_grace)]
    pub grace: Duration,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// The accepted forms of `--grace`, as said in its error.
const GRACE_FORMS: &str = "give seconds (30 or 2.5), a number with a unit ms, s, m or h (500ms, \
     1m30s, 1h) or ISO 8601 (PT30S); days are not accepted";

/// Parses a `--grace` value: bare seconds (`30`, `2.5`, as the action API's `?wait=` takes
/// them), or a duration through jiff's parser (`30s`, `1m`, `500ms`, `1m30s`, ISO 8601
/// `PT30S`).
///
/// # Errors
/// A sentence for clap's error line (which names the flag and the value): the accepted forms,
/// or that the grace must not be negative.
fn parse_grace(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let bare_seconds = !s.is_empty()
        && s.chars().all(|c| c.is_ascii_digit() || c == '.')
        && s.chars().filter(|c| *c == '.').count() <= 1
        && s.chars().any(|c| c.is_ascii_digit());
    if bare_seconds {
        return s
            .parse::<f64>()
            .ok()
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
            .ok_or_else(|| format!("too large a number of seconds; {GRACE_FORMS}"));
    }
    let signed: SignedDuration = s
        .parse()
        .map_err(|_| format!("not a duration: {GRACE_FORMS}"))?;
    Duration::try_from(signed).map_err(|_| "the wake grace must not be negative".to_string())
}

/// One result as printed: the input line number beside the report.
#[derive(Serialize)]
struct Row<'a> {
    line: u64,
    #[serde(flatten)]
    report: &'a DiagnosisReport,
}

#[derive(Serialize)]
struct TotalsLine<'a> {
    totals: &'a Totals,
}

/// Why the run stopped early.
enum Failure {
    /// stdout was closed by the reader: stop quietly.
    BrokenPipe,
    /// Anything else: message for stderr, exit 2.
    Fatal(String),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::BrokenPipe {
            Failure::BrokenPipe
        } else {
            Failure::Fatal(format!("cannot write output: {e}"))
        }
    }
}

/// Runs `backstop diagnose`: exit 0 when every line was a valid snapshot, 1 when some lines were
/// bad (reported on stderr, nothing printed on stdout), 2 when the input or output failed.
pub fn run(args: Args) -> ExitCode {
    let now = args.now.unwrap_or_else(current_time);
    let opts = DiagnoseOptions {
        wake_grace: WakeGrace(args.grace),
        ..DiagnoseOptions::default()
    };
    let (name, reader): (String, Box<dyn BufRead>) = match &args.input {
        None => ("<stdin>".to_string(), Box::new(io::stdin().lock())),
        Some(path) if path.as_os_str() == "-" => {
            ("<stdin>".to_string(), Box::new(io::stdin().lock()))
        }
        Some(path) => match File::open(path).and_then(|file| {
            use std::os::unix::fs::FileTypeExt;
            let meta = file.metadata()?;
            if meta.is_dir() {
                Err(io::Error::new(
                    io::ErrorKind::IsADirectory,
                    "is a directory",
                ))
            } else if !meta.is_file() && !meta.file_type().is_fifo() {
                // A device (`/dev/zero`) may never end a line, nor the input.
                Err(io::Error::other(format!(
                    "is {}; snapshots are read from a file, a pipe, or stdin (`-`)",
                    backstop_core::policy::file_kind(&meta)
                )))
            } else {
                Ok(file)
            }
        }) {
            Ok(file) => (
                path.display().to_string(),
                Box::new(BufReader::with_capacity(64 * 1024, file)),
            ),
            Err(e) => {
                errln!("backstop diagnose: {}: cannot open: {e}", path.display());
                return ExitCode::from(2);
            }
        },
    };
    let stdout = io::stdout();
    let mut out = BufWriter::with_capacity(64 * 1024, stdout.lock());
    let result = process(reader, &name, now, &opts, args.format, &mut out)
        .and_then(|bad| out.flush().map(|()| bad).map_err(Failure::from));
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(Failure::BrokenPipe) => ExitCode::SUCCESS,
        Err(Failure::Fatal(message)) => {
            errln!("backstop diagnose: {name}: {message}");
            ExitCode::from(2)
        }
    }
}

/// The output of a run held until the whole input is checked: in memory up to
/// [`SPOOL_MEMORY_BYTES`], then in an unnamed temporary file, which the operating system
/// removes when it is closed.
enum Spool {
    /// Held in memory while it fits in `limit` bytes.
    Memory {
        bytes: Vec<u8>,
        limit: usize,
    },
    File(BufWriter<File>),
}

impl Spool {
    /// A spool that holds up to `limit` bytes in memory.
    fn new(limit: usize) -> Self {
        Spool::Memory {
            bytes: Vec::with_capacity(limit.min(64 * 1024)),
            limit,
        }
    }

    /// Copies everything held to `out`.
    fn copy_to(self, out: &mut impl Write) -> Result<(), Failure> {
        match self {
            Spool::Memory { bytes, .. } => out.write_all(&bytes)?,
            Spool::File(writer) => {
                let mut file = writer
                    .into_inner()
                    .map_err(|e| spool_failure(e.into_error()))?;
                io::Seek::rewind(&mut file).map_err(spool_failure)?;
                let mut held = BufReader::with_capacity(64 * 1024, file);
                loop {
                    let chunk = held.fill_buf().map_err(spool_failure)?;
                    if chunk.is_empty() {
                        break;
                    }
                    let len = chunk.len();
                    out.write_all(chunk)?;
                    held.consume(len);
                }
            }
        }
        Ok(())
    }
}

/// A failure of the temporary file that holds the output: exit 2.
fn spool_failure(e: io::Error) -> Failure {
    Failure::Fatal(format!(
        "cannot hold the output in a temporary file until every line is checked: {e}"
    ))
}

impl Write for Spool {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Spool::Memory { bytes, limit } = self {
            if bytes.len() + buf.len() <= *limit {
                bytes.extend_from_slice(buf);
                return Ok(buf.len());
            }
            let mut file = BufWriter::with_capacity(64 * 1024, tempfile::tempfile()?);
            file.write_all(bytes)?;
            *self = Spool::File(file);
        }
        match self {
            Spool::File(file) => file.write(buf),
            Spool::Memory { .. } => unreachable!("moved to a file above"),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Spool::Memory { .. } => Ok(()),
            Spool::File(file) => file.flush(),
        }
    }
}

/// Streams the input through the diagnosis into a [`Spool`], and copies it to `out` only when
/// every line was a valid snapshot; returns the number of bad lines (nothing was written to
/// `out` when it is not 0, and a last stderr line says so).
fn process(
    reader: Box<dyn BufRead>,
    name: &str,
    now: Timestamp,
    opts: &DiagnoseOptions,
    format: Format,
    out: &mut impl Write,
) -> Result<u64, Failure> {
    let mut spool = Some(Spool::new(SPOOL_MEMORY_BYTES));
    let bad = check_and_diagnose(reader, name, now, opts, format, &mut spool)?;
    match spool {
        Some(spool) if bad == 0 => spool.copy_to(out)?,
        _ => errln!(
            "{name}: {bad} bad line{}; nothing was printed: diagnose prints its results only \
             when every line is a valid snapshot",
            if bad == 1 { "" } else { "s" }
        ),
    }
    Ok(bad)
}

/// Checks every line of the input and, while all of them are valid, diagnoses each and writes
/// the results (and at the end the totals) to `spool`; at the first bad line `spool` is dropped
/// (set to `None`) and the rest is only checked, each bad line reported on stderr. Returns the
/// number of bad lines.
fn check_and_diagnose(
    mut reader: Box<dyn BufRead>,
    name: &str,
    now: Timestamp,
    opts: &DiagnoseOptions,
    format: Format,
    spool: &mut Option<Spool>,
) -> Result<u64, Failure> {
    refuse_database(&mut reader, name)?;
    if let Some(out) = spool.as_mut() {
        write_header(out, format).map_err(spool_failure)?;
    }
    let mut check = Check {
        name,
        now,
        opts,
        format,
        progress: io::stderr().is_terminal(),
        totals: Totals::default(),
        line_no: 0,
        bad: 0,
        first: true,
        audit_lines: 0,
    };
    let mut buf = Vec::with_capacity(1024);
    while let Some(line) = check.read(&mut reader, &mut buf)? {
        check.line(line, &buf, spool)?;
    }
    check.finish(spool)
}

/// A database is not read line by line: says what it is, once, as a fatal failure.
fn refuse_database(reader: &mut Box<dyn BufRead>, name: &str) -> Result<(), Failure> {
    let start = reader
        .fill_buf()
        .map_err(|e| Failure::Fatal(format!("cannot read: {e}")))?;
    if !start.starts_with(SQLITE_HEADER) {
        return Ok(());
    }
    let db = if name == "<stdin>" { "FILE" } else { name };
    Err(Failure::Fatal(format!(
        "this is a SQLite database, not NDJSON snapshots; diagnose reads health snapshots: \
         when it is a gateway's store, derive them with `backstop snapshots export --db {db} \
         --policy POLICY | backstop diagnose -`, or check its audit log with `backstop audit \
         verify --db {db}`"
    )))
}

/// The state of one pass over the input in [`check_and_diagnose`].
struct Check<'a> {
    name: &'a str,
    now: Timestamp,
    opts: &'a DiagnoseOptions,
    format: Format,
    /// Whether a progress counter is shown (stderr is a terminal).
    progress: bool,
    totals: Totals,
    line_no: u64,
    bad: u64,
    /// No result was written yet.
    first: bool,
    /// Bad lines that are audit events: reported once, then counted.
    audit_lines: u64,
}

impl Check<'_> {
    /// Reads the next line into `buf` (`None` at the end), counting it and showing progress.
    fn read(
        &mut self,
        reader: &mut Box<dyn BufRead>,
        buf: &mut Vec<u8>,
    ) -> Result<Option<Line>, Failure> {
        let line = match read_line_capped(reader, buf, MAX_LINE_BYTES) {
            Ok(Some(line)) => line,
            Ok(None) => return Ok(None),
            Err(e) => {
                if self.progress {
                    output::stderr_raw(format_args!("\r\x1b[K"));
                }
                return Err(Failure::Fatal(format!(
                    "cannot read after line {}: {e}",
                    self.line_no
                )));
            }
        };
        self.line_no += 1;
        if self.progress && self.line_no.is_multiple_of(PROGRESS_EVERY_LINES) {
            output::stderr_raw(format_args!("\r{}: {} lines", self.name, self.line_no));
        }
        Ok(Some(line))
    }

    /// Checks one line (held in `buf`) and, while `spool` is kept, diagnoses it into `spool`.
    fn line(&mut self, line: Line, buf: &[u8], spool: &mut Option<Spool>) -> Result<(), Failure> {
        let (name, line_no) = (self.name, self.line_no);
        let bytes = match line {
            Line::TooLong => {
                self.bad += 1;
                *spool = None;
                errln!("{name}: LINE {line_no}: longer than {MAX_LINE_BYTES} bytes");
                return Ok(());
            }
            Line::Complete if line_no == 1 => {
                buf.strip_prefix(UTF8_BOM).unwrap_or(buf).trim_ascii()
            }
            Line::Complete => buf.trim_ascii(),
        };
        if bytes.is_empty() {
            return Ok(());
        }
        let snapshot = match parse_snapshot(bytes).and_then(|s| s.check_at(self.now).map(|()| s)) {
            Ok(snapshot) => snapshot,
            Err(e) => {
                self.bad += 1;
                *spool = None;
                self.bad_snapshot(bytes, &e);
                return Ok(());
            }
        };
        // After a bad line nothing will be printed: the rest is only checked.
        let Some(out) = spool.as_mut() else {
            return Ok(());
        };
        let report = diagnose_owned(snapshot, self.now, self.opts);
        self.totals.add(&report);
        let row = Row {
            line: line_no,
            report: &report,
        };
        write_row(out, self.format, &row, self.first).map_err(spool_failure)?;
        self.first = false;
        Ok(())
    }

    /// Reports a line that is not a valid snapshot: an audit event only the first time.
    fn bad_snapshot(&mut self, bytes: &[u8], error: &dyn std::fmt::Display) {
        let (name, line_no) = (self.name, self.line_no);
        if !is_audit_event(bytes) {
            errln!("{name}: LINE {line_no}: {error}");
            return;
        }
        self.audit_lines += 1;
        if self.audit_lines == 1 {
            errln!(
                "{name}: LINE {line_no}: this line is an audit event (as `backstop \
                 audit export` writes), not a health snapshot; {SNAPSHOTS_HINT}; \
                 further audit event lines are counted at the end, not listed"
            );
        }
    }

    /// After the last line: clears the progress counter, says what was counted, writes the
    /// totals to `spool` when kept, and returns the number of bad lines.
    fn finish(self, spool: &mut Option<Spool>) -> Result<u64, Failure> {
        let name = self.name;
        if self.progress && self.line_no >= PROGRESS_EVERY_LINES {
            output::stderr_raw(format_args!("\r\x1b[K"));
        }
        if self.audit_lines > 1 {
            errln!(
                "{name}: {} lines are audit events, not snapshots",
                self.audit_lines
            );
        }
        if self.first && self.bad == 0 {
            // Not an error (an export of a run that was never throttled is empty), but said, so
            // an empty table is not mistaken for "all healthy".
            errln!(
                "{name}: no snapshots (the input is empty or only blank lines): nothing was diagnosed"
            );
        }
        if let Some(out) = spool.as_mut() {
            write_totals(out, self.format, &self.totals).map_err(spool_failure)?;
        }
        Ok(self.bad)
    }
}

/// What comes before the first result: the table's header, the JSON document's opening.
fn write_header(out: &mut impl Write, format: Format) -> io::Result<()> {
    match format {
        Format::Table => writeln!(
            out,
            "{:>6}  {:<24} {:<36} {:<DIAGNOSIS_WIDTH$} {:<ACTION_WIDTH$} {:>12} {:>12}",
            "LINE", "RUN", "SCOPE", "DIAGNOSIS", "ACTION", "HEADROOM_MS", "DEBT_MS"
        ),
        Format::Json => out.write_all(b"{\"snapshots\":["),
        Format::Ndjson => Ok(()),
    }
}

/// One result; `first` says whether it is the first (JSON separates the others by a comma).
fn write_row(out: &mut impl Write, format: Format, row: &Row<'_>, first: bool) -> io::Result<()> {
    match format {
        Format::Table => write_table_row(out, row),
        Format::Json => {
            if !first {
                out.write_all(b",")?;
            }
            serde_json::to_writer(&mut *out, row).map_err(io::Error::from)
        }
        Format::Ndjson => {
            serde_json::to_writer(&mut *out, row).map_err(io::Error::from)?;
            out.write_all(b"\n")
        }
    }
}

/// The totals after the last result, closing the JSON document.
fn write_totals(out: &mut impl Write, format: Format, totals: &Totals) -> io::Result<()> {
    match format {
        Format::Table => write_table_totals(out, totals),
        Format::Json => {
            out.write_all(b"],\"totals\":")?;
            serde_json::to_writer(&mut *out, totals).map_err(io::Error::from)?;
            out.write_all(b"}\n")
        }
        Format::Ndjson => {
            serde_json::to_writer(&mut *out, &TotalsLine { totals }).map_err(io::Error::from)?;
            out.write_all(b"\n")
        }
    }
}

/// Whether a line that is not a snapshot is an audit event as `backstop audit export` writes
/// it: a JSON object with `seq`, `at`, `kind`, `prev` and `hash` and no `run_id`.
fn is_audit_event(line: &[u8]) -> bool {
    let Ok(serde_json::Value::Object(members)) = serde_json::from_slice(line) else {
        return false;
    };
    ["seq", "at", "kind", "prev", "hash"]
        .iter()
        .all(|name| members.contains_key(*name))
        && !members.contains_key("run_id")
}

/// What [`read_line_capped`] put in the buffer.
enum Line {
    /// The whole line (terminator included, if any).
    Complete,
    /// The line exceeded the cap; it was consumed and dropped.
    TooLong,
}

/// Reads one line into `buf` (cleared first), never holding more than `max + 1` bytes of it.
/// `Ok(None)` at end of input.
fn read_line_capped(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<Option<Line>> {
    buf.clear();
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let n = Read::take(&mut *reader, limit).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.len() <= max || buf.ends_with(b"\n") {
        return Ok(Some(Line::Complete));
    }
    // Too long: drop the rest of the line without keeping it.
    buf.clear();
    loop {
        let available = reader.fill_buf()?;
        if available.is_empty() {
            break;
        }
        match available.iter().position(|&b| b == b'\n') {
            Some(pos) => {
                reader.consume(pos + 1);
                break;
            }
            None => {
                let len = available.len();
                reader.consume(len);
            }
        }
    }
    Ok(Some(Line::TooLong))
}

fn opt_i64(v: Option<i64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// Width of the diagnosis column: the longest name (`retry_succeeded_unverified`) plus a space.
const DIAGNOSIS_WIDTH: usize = 27;

/// Width of the action column: the longest id (`stop_and_hand_over_evidence`) plus a space.
const ACTION_WIDTH: usize = 28;

fn write_table_row(out: &mut impl Write, row: &Row<'_>) -> io::Result<()> {
    let r = row.report;
    writeln!(
        out,
        "{:>6}  {:<24} {:<36} {:<DIAGNOSIS_WIDTH$} {:<ACTION_WIDTH$} {:>12} {:>12}",
        row.line,
        output::terminal_safe(&r.run_id),
        output::terminal_safe(&r.quota_scope),
        r.diagnosis.as_str(),
        r.action.id(),
        opt_i64(r.headroom_ms),
        r.retry_after_debt_ms
            .map_or_else(|| "-".to_string(), |d| d.to_string()),
    )
}

/// One `TOTALS BY SCOPE` / `TOTALS BY RUN` section.
fn write_group_totals<'a>(
    out: &mut impl Write,
    title: &str,
    key: &str,
    groups: impl Iterator<Item = (&'a str, &'a GroupTotals)>,
) -> io::Result<()> {
    writeln!(out)?;
    writeln!(out, "{title}")?;
    writeln!(
        out,
        "  {:<40} {:>9} {:>7} {:>14}  DIAGNOSES",
        key, "SNAPSHOTS", "KNOWN", "DEBT_MS"
    )?;
    for (name, group) in groups {
        let diagnoses: Vec<String> = group
            .by_diagnosis
            .iter()
            .map(|(d, n)| format!("{d}={n}"))
            .collect();
        writeln!(
            out,
            "  {:<40} {:>9} {:>7} {:>14}  {}",
            output::terminal_safe(name),
            group.snapshots,
            group.known_boundaries,
            group.retry_after_debt_ms,
            diagnoses.join(" ")
        )?;
    }
    Ok(())
}

fn write_table_totals(out: &mut impl Write, totals: &Totals) -> io::Result<()> {
    write_group_totals(out, "TOTALS BY SCOPE", "SCOPE", totals.by_scope.iter())?;
    write_group_totals(out, "TOTALS BY RUN", "RUN", totals.by_run.iter())?;
    writeln!(out)?;
    writeln!(out, "TOTALS BY DIAGNOSIS (in check order)")?;
    writeln!(
        out,
        "  {:<DIAGNOSIS_WIDTH$} {:>9} {:>14}  ACTION",
        "DIAGNOSIS", "SNAPSHOTS", "DEBT_MS"
    )?;
    for diagnosis in Diagnosis::ALL {
        let (snapshots, debt_ms) = totals
            .by_diagnosis
            .get(&diagnosis)
            .map_or((0, 0), |g| (g.snapshots, g.retry_after_debt_ms));
        writeln!(
            out,
            "  {:<DIAGNOSIS_WIDTH$} {:>9} {:>14}  {}",
            diagnosis.as_str(),
            snapshots,
            debt_ms,
            diagnosis.action().id()
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "TOTAL  snapshots={} known_boundaries={} runs={} scopes={} retry_after_debt_ms={}",
        totals.snapshots,
        totals.known_boundaries,
        totals.by_run.len(),
        totals.by_scope.len(),
        totals.retry_after_debt_ms
    )?;
    writeln!(
        out,
        "(debt is time deliberately yielded to provider backpressure, read beside the diagnosis, not a score)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spool_moves_to_a_file_past_its_limit_and_gives_everything_back_in_order() {
        let mut spool = Spool::new(10);
        spool.write_all(b"0123456").unwrap();
        assert!(matches!(spool, Spool::Memory { .. }));
        spool.write_all(b"789abc").unwrap();
        assert!(matches!(spool, Spool::File(_)), "past 10 bytes");
        spool.write_all(b"def").unwrap();
        let mut out = Vec::new();
        assert!(spool.copy_to(&mut out).is_ok());
        assert_eq!(out, b"0123456789abcdef");

        let mut small = Spool::new(10);
        small.write_all(b"0123456789").unwrap();
        assert!(matches!(small, Spool::Memory { .. }), "exactly the limit");
        let mut out = Vec::new();
        assert!(small.copy_to(&mut out).is_ok());
        assert_eq!(out, b"0123456789");
    }
}
