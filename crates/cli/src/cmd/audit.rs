//! `backstop audit verify|export|head`: check, export and anchor the hash-chained audit log
//! (SPEC §9) offline, without any secret.
//!
//! Exit codes: 0 success (verify: the chain is intact); 1 `verify` found a break (the first bad
//! `seq` and why is printed); 2 the input could not be read (missing file, not a SQLite file,
//! a SQLite file damaged or cut short, not a backstop database, a schema version older than
//! the oldest read as it is (the message names the command that upgrades it; version 8 and
//! later are read without migrating), bad NDJSON line (an export cut mid-line, its last line
//! unterminated and ending early, is instead a `truncated` break, exit 1), a database
//! given as an export file instead of with `--db`, a database in a read-only directory whose
//! `-wal` file holds changes), or `export` met a row it cannot decode (after the events before
//! it, naming the row's column and what it holds, with the `--since` that exports past it).
//! Audit commands open databases read-only and never create one; where SQLite cannot create
//! the `-shm` file beside a database, they read it as immutable (see `AuditReader::open`).
//! Each reads one snapshot of the database (one read transaction), so a gateway writing
//! meanwhile is seen as of one commit, never half before and half after one.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use backstop_store::audit::{
    parse_expected_head, read_export, verify_export, CutLine, Verdict, GENESIS_PREV,
};
use backstop_store::{AuditReader, StoreError};

use crate::cmd::output::{self, errln, PipeWatch};

/// Arguments of `backstop audit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// What to do with the log.
    #[command(subcommand)]
    pub command: AuditCommand,
}

/// The `backstop audit` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum AuditCommand {
    /// Check the chain; exit 1 naming the first bad seq (altered, missing, reordered,
    /// inserted, broken link, truncated).
    Verify(VerifyArgs),
    /// Print events as NDJSON (one JSON object per line) to stdout. Exit 2 at a row that cannot
    /// be decoded (the events before it are printed); exit 1 when the database also holds rows
    /// outside the chain (seq 0 or below), which are not printed.
    Export {
        /// The backstop database file.
        #[arg(long)]
        db: PathBuf,
        /// Only events with a seq greater than this.
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
    /// Print the chain head as `SEQ HASH` (an empty log prints `0` and 64 zeros); that line can
    /// be given to `audit verify --expect-head` as is.
    Head {
        /// The backstop database file.
        #[arg(long)]
        db: PathBuf,
        /// `text`: `SEQ HASH`; `json`: `{"seq":N,"hash":"…"}`.
        #[arg(long, value_enum, default_value_t = HeadFormat::Text)]
        format: HeadFormat,
    },
}

/// Output format of `backstop audit head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HeadFormat {
    /// `SEQ HASH` on one line.
    Text,
    /// One JSON object `{"seq":N,"hash":"…"}`.
    Json,
}

/// Arguments of `backstop audit verify`.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["db", "export"]))]
pub struct VerifyArgs {
    /// Verify the log inside this backstop database.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Verify an NDJSON export file (from `backstop audit export`).
    pub export: Option<PathBuf>,
    /// A head exported earlier: the `SEQ HASH` line printed by `audit head` (quote it), the
    /// object printed by `audit head --format json`, or the 64-hex-digit hash alone (either
    /// letter case): the log must still contain that hash — at that seq, when given — which
    /// detects a cut tail (`truncated`) and events removed or added before it.
    #[arg(long, value_name = "'SEQ HASH' | JSON | HASH")]
    pub expect_head: Option<String>,
}

/// The first 16 bytes of every SQLite database file (the SQLite file format, §1.3 "The
/// Database Header"): an export argument starting with them is a database given without `--db`.
const SQLITE_HEADER: &[u8] = b"SQLite format 3\0";

/// Runs `backstop audit`.
pub fn run(args: Args) -> ExitCode {
    let (name, result) = match args.command {
        AuditCommand::Verify(v) => ("verify", verify(v)),
        AuditCommand::Export { db, since } => ("export", export(db, since)),
        AuditCommand::Head { db, format } => ("head", head(db, format)),
    };
    match result {
        Ok(Printed::Text(text, code)) => output::print(&format!("audit {name}"), &text, code),
        Ok(Printed::Done(code)) => code,
        Err(e) => {
            errln!("backstop audit {name}: {e}");
            ExitCode::from(2)
        }
    }
}

/// What a subcommand produced: text still to print with the exit status, or output already
/// written (the streamed export).
enum Printed {
    Text(String, ExitCode),
    Done(ExitCode),
}

fn verify(args: VerifyArgs) -> Result<Printed, StoreError> {
    let expect_head = match args.expect_head.as_deref() {
        Some(h) => {
            let (seq, hash) = parse_expected_head(h).map_err(|reason| StoreError::Invalid {
                field: "--expect-head",
                reason,
            })?;
            Some(match seq {
                Some(seq) => format!("{seq} {hash}"),
                None => hash,
            })
        }
        None => None,
    };
    let verdict = match (&args.db, &args.export) {
        (Some(db), _) => AuditReader::open(db)?.verify(expect_head.as_deref())?,
        (None, Some(file)) => {
            let place = file.display().to_string();
            let bytes = std::fs::read(file).map_err(|e| StoreError::Io {
                place: place.clone(),
                reason: e.to_string(),
            })?;
            if bytes.starts_with(SQLITE_HEADER) {
                return Err(StoreError::Io {
                    place,
                    reason: "a SQLite database, not an NDJSON export: give a database as --db FILE"
                        .into(),
                });
            }
            let (text, cut_in_char) = match String::from_utf8(bytes) {
                Ok(text) => (text, false),
                // Cut inside a character: the text before it ends in the cut line.
                Err(e) if e.utf8_error().error_len().is_none() => {
                    let valid = e.utf8_error().valid_up_to();
                    let mut bytes = e.into_bytes();
                    bytes.truncate(valid);
                    (String::from_utf8(bytes).unwrap_or_default(), true)
                }
                Err(e) => {
                    return Err(StoreError::Io {
                        place,
                        reason: format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
                    })
                }
            };
            let mut export = read_export(&place, &text)?;
            if cut_in_char && export.cut.is_none() {
                export.cut = Some(CutLine {
                    line: text.lines().count() + 1,
                    reason: "the file ends inside a UTF-8 character".into(),
                });
            }
            verify_export(&export, expect_head.as_deref())
        }
        (None, None) => {
            return Err(StoreError::Invalid {
                field: "source",
                reason: "give --db FILE or an export file".into(),
            })
        }
    };
    match verdict {
        Verdict::Intact { count, head } => {
            let text = match head {
                Some(h) => format!("ok: {count} events, head seq {} hash {}\n", h.seq, h.hash),
                None => "ok: 0 events, empty log\n".to_owned(),
            };
            Ok(Printed::Text(text, ExitCode::SUCCESS))
        }
        Verdict::Broken(b) => Ok(Printed::Text(format!("broken: {b}\n"), ExitCode::from(1))),
    }
}

fn export(db: PathBuf, since: u64) -> Result<Printed, StoreError> {
    let reader = AuditReader::open(&db)?;
    // The events and the rows outside the chain, from one snapshot while a gateway writes.
    reader.in_snapshot(|reader| export_from(reader, &db, since))?
}

fn export_from(reader: &AuditReader, db: &Path, since: u64) -> Result<Printed, StoreError> {
    let stdout = std::io::stdout();
    let mut out = PipeWatch::new(std::io::BufWriter::new(stdout.lock()));
    let written = reader.export(since, &mut out).and_then(|_| {
        out.flush().map_err(|e| StoreError::Io {
            place: "stdout".into(),
            reason: e.to_string(),
        })
    });
    match written {
        // The reader closed the pipe (`| head`): stop quietly.
        Err(_) if out.broken_pipe => Ok(Printed::Done(ExitCode::SUCCESS)),
        // A damaged row ends the export; say how to go on past it.
        Err(StoreError::UndecodableEvent { seq, reason }) => {
            let _ = out.flush();
            errln!(
                "backstop audit export: audit_events seq {seq} cannot be decoded: {reason}; the \
                 row was changed or damaged after it was written (`backstop audit verify --db {db}` \
                 names the first broken event); the events before it were exported; to export \
                 the events after it, run `backstop audit export --db {db} --since {seq}`",
                db = db.display()
            );
            Ok(Printed::Done(ExitCode::from(2)))
        }
        Err(e) => Err(e),
        Ok(()) => {
            // Rows before the chain's first event are not events of the log, so they are not
            // exported; an export that verifies must not hide that the database holds them.
            let (outside, lowest) = reader.outside_chain()?;
            if outside == 0 {
                return Ok(Printed::Done(ExitCode::SUCCESS));
            }
            let shown: Vec<String> = lowest.iter().map(i64::to_string).collect();
            errln!(
                "backstop audit export: {outside} row{} of audit_events lie outside the chain \
                 (seq {}{}), which starts at seq 1; they are not in this export; \
                 `backstop audit verify --db {}` reports them",
                if outside == 1 { "" } else { "s" },
                shown.join(", "),
                if outside > lowest.len() as u64 {
                    ", …"
                } else {
                    ""
                },
                db.display()
            );
            Ok(Printed::Done(ExitCode::from(1)))
        }
    }
}

fn head(db: PathBuf, format: HeadFormat) -> Result<Printed, StoreError> {
    let (seq, hash) = match AuditReader::open(&db)?.head()? {
        Some(h) => (h.seq, h.hash),
        None => (0, GENESIS_PREV.to_owned()),
    };
    let text = match format {
        HeadFormat::Text => format!("{seq} {hash}\n"),
        HeadFormat::Json => format!("{}\n", serde_json::json!({ "seq": seq, "hash": hash })),
    };
    Ok(Printed::Text(text, ExitCode::SUCCESS))
}
