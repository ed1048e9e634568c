//! The one error type of the store.
//!
//! Every variant names the place (file, table, record id, NDJSON line) and the reason, so a
//! caller can print it as one line. The type is `Clone` because one failed group commit is
//! reported to every caller whose operation was in that transaction.

use std::path::PathBuf;

/// Everything that can go wrong in `backstop-store`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The database file does not exist (audit commands never create one).
    #[error("{path}: no such database file")]
    Missing {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// The file exists but is not a SQLite database at all: it does not start with the SQLite
    /// header (random bytes, a text file, fewer than 16 bytes, …).
    #[error("{path}: not a SQLite database ({reason})")]
    NotSqlite {
        /// The offending file.
        path: PathBuf,
        /// SQLite's own explanation.
        reason: String,
    },
    /// The file starts with the SQLite header, but SQLite cannot read it: it was cut short (a
    /// copy or download that stopped early, a full disk) or its first pages are damaged.
    #[error("{path}: the file is damaged or truncated: {reason}; restore it from a backup or move it aside")]
    DamagedFile {
        /// The offending file.
        path: PathBuf,
        /// What the header says against the file's length (e.g. `it has 1000 bytes, but its
        /// header gives 22 pages of 4096 bytes (90112 bytes)`), when it does, and SQLite's own
        /// explanation.
        reason: String,
    },
    /// The file is a SQLite database written by another application.
    #[error("{path}: not a backstop database (application_id {application_id:#010x}, expected {expected:#010x})")]
    Foreign {
        /// The offending file.
        path: PathBuf,
        /// The `PRAGMA application_id` found in the file.
        application_id: i64,
        /// The id backstop writes.
        expected: i64,
    },
    /// The schema version (`PRAGMA user_version`) is newer than this build understands.
    #[error("{path}: schema version {found} is newer than this build supports ({supported}); upgrade backstop")]
    TooNew {
        /// The offending file.
        path: PathBuf,
        /// The version found in the file.
        found: i64,
        /// The newest version this build can migrate to.
        supported: i64,
    },
    /// The schema version is older than [`crate::sqlite::OLDEST_READABLE_VERSION`], the oldest
    /// that read-only access (`backstop audit …`, `backstop snapshots export`) reads as it is:
    /// a later migration changed what those commands read, and they never migrate a file. The
    /// gateway upgrades it when it opens it.
    #[error("{path}: schema version {found} is older than version {oldest}, the oldest the read-only commands read; upgrade the file (or a copy of it, to keep the original as it is) by starting the gateway on it once: `backstop serve --config POLICY --store {path}`, then stop it (Ctrl-C) and run this command on the upgraded file")]
    TooOld {
        /// The offending file.
        path: PathBuf,
        /// The version found in the file.
        found: i64,
        /// The oldest version read without migrating.
        oldest: i64,
    },
    /// `PRAGMA quick_check` found the file damaged when the store opened (e.g. "database disk
    /// image is malformed", a page referenced twice): the gateway must not serve on it.
    #[error(
        "{path}: the database is damaged ({reason}); restore it from a backup or move it aside"
    )]
    Damaged {
        /// The offending file.
        path: PathBuf,
        /// SQLite's findings.
        reason: String,
    },
    /// Another open store (a running `backstop serve`, in this process or another) holds the
    /// database file's exclusive write lock (on Linux an advisory `flock` on the file itself, so
    /// every path to it, hard links included, meets it): a second writer would break the audit
    /// chain and the action ids, so it is refused when it opens. Read-only access takes no lock.
    #[error("{database}: {holder} holds this database's write lock, so it is already open for writing (is a `backstop serve` running on it?); stop that process or use another store")]
    Locked {
        /// The database that was asked for.
        database: PathBuf,
        /// Who holds the lock, as far as the operating system tells.
        holder: LockHolder,
    },
    /// The audit log's last event does not match its hash, does not link to the event before
    /// it, lies outside the chain (`seq` 0 or below), or cannot be decoded, its own hash
    /// included (e.g. stored as text: the file was edited or damaged). The store does not open
    /// for writing: every new event would be sealed onto that head and extend a broken chain.
    #[error(
        "{path}: the audit log's last event, seq {seq}, {reason}; the store does not add events to a broken chain: run `backstop audit verify --db {path}` to find the first broken event"
    )]
    BrokenHead {
        /// The database file.
        path: PathBuf,
        /// The last event's `seq` (negative only in a file edited by hand).
        seq: i64,
        /// What is wrong with it.
        reason: String,
    },
    /// A database in WAL mode that cannot be read where it is: SQLite cannot open or create its
    /// `-shm` file (a read-only directory or file system), and its `-wal` file holds changes
    /// that may not be in the database file yet, so reading the database file alone
    /// (`immutable=1`) could miss committed events.
    #[error(
        "{path}: cannot be read in place: SQLite cannot create or open its -shm file ({reason}), which reading a database in WAL mode needs, and its -wal file holds {wal_bytes} bytes of changes that may not be in the database file yet; copy the database together with its -wal file into a writable directory and run the command on the copy"
    )]
    ReadOnlyWal {
        /// The database file.
        path: PathBuf,
        /// Size of the `-wal` file beside it.
        wal_bytes: u64,
        /// SQLite's error on the plain read-only open.
        reason: String,
    },
    /// The store cannot make writes durable where it is (a read-only file, a read-only file
    /// system, a directory that takes no new file, a test commit that failed), found when it
    /// opens for writing: SQLite would open such a file for reading only, and every write
    /// would then fail.
    #[error("{path}: writes cannot be made durable here: {reason}; make the file and its directory writable for this user (on a writable file system), or use another store")]
    NotDurable {
        /// The database file.
        path: PathBuf,
        /// What stops writes, e.g. `the file cannot be opened for writing (permission denied)`.
        reason: String,
    },
    /// A SQLite error while reading or writing.
    #[error("sqlite: {0}")]
    Sqlite(String),
    /// A record the operation needs does not exist.
    #[error("{what} not found")]
    NotFound {
        /// Which record, e.g. `action 17`.
        what: String,
    },
    /// The same idempotency key was reused for a different request: another provider, method,
    /// route template, concrete target (path and query) or payload than the one it is bound to (IETF Idempotency-Key draft and
    /// SPEC §6: a key binds one request; answer 422 to the agent).
    #[error("idempotency key {key:?} of agent {agent:?} is already bound to action {existing} ({} {} at provider {:?}) with a different {}", bound.method, bound.route, bound.provider, differs.join(", "))]
    KeyReuse {
        /// The agent that sent the key.
        agent: String,
        /// The reused key.
        key: String,
        /// The action the key already belongs to.
        existing: i64,
        /// What differs from the bound request, in this order when several do: `provider`,
        /// `method`, `route`, `target`, `payload`; `target` (another path or query) is named
        /// only when the route template is the same. Never empty.
        differs: Vec<&'static str>,
        /// The request the key is bound to (no payload: only its identity).
        bound: Box<BoundRequest>,
    },
    /// The operation is not allowed in the record's current state (e.g. sending a finished or
    /// cancelled action, deciding an escalation twice).
    #[error("{what}: {reason}")]
    InvalidTransition {
        /// Which record, e.g. `action 17`.
        what: String,
        /// Why the transition is refused.
        reason: String,
    },
    /// An argument failed validation before touching the database.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The argument's name.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A stored value could not be decoded (the database was edited by hand or is corrupt).
    #[error("corrupt record in {table}: {reason}")]
    Corrupt {
        /// The table the record came from.
        table: &'static str,
        /// What could not be decoded.
        reason: String,
    },
    /// An audit event row whose columns cannot be decoded (a value of the wrong type or out of
    /// range, e.g. edited by hand): verification reports it as an altered event.
    #[error("audit_events seq {seq} cannot be decoded: {reason}; the row was changed or damaged after it was written (`backstop audit verify` names the first broken event)")]
    UndecodableEvent {
        /// The row's `seq`.
        seq: u64,
        /// Which column holds what instead of what it should hold, e.g. `column status holds
        /// the text "oops", expected an integer from 0 to 65535, or NULL`.
        reason: String,
    },
    /// The writer thread is gone (the store is shutting down or crashed).
    #[error("the store's writer thread is not running")]
    WriterGone,
    /// Reading an NDJSON audit export failed.
    #[error("{place}: line {line}: {reason}")]
    BadExportLine {
        /// The file (or `-` for stdin).
        place: String,
        /// 1-based line number.
        line: usize,
        /// Why the line could not be read as an audit event.
        reason: String,
    },
    /// An I/O error outside SQLite (reading an export file).
    #[error("{place}: {reason}")]
    Io {
        /// The file involved.
        place: String,
        /// The operating system's explanation.
        reason: String,
    },
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Sqlite(e.to_string())
    }
}

/// The identity of the request an idempotency key is bound to, named by
/// [`StoreError::KeyReuse`]: provider, method and route template (never the payload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundRequest {
    /// Provider name from the policy.
    pub provider: String,
    /// HTTP method, upper case.
    pub method: String,
    /// Route template.
    pub route: String,
}

/// Who holds a database's write lock ([`StoreError::Locked`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockHolder {
    /// Another open store in this process, opened under `path` (the same file, perhaps under
    /// another name: a hard or symbolic link).
    ThisProcess {
        /// The path that store was opened with.
        path: PathBuf,
    },
    /// Another process: its id when the operating system shows it (Linux's `/proc/locks`),
    /// else `None`. On systems other than Linux, a store in this process is reported so too.
    OtherProcess {
        /// The holder's process id, if known.
        pid: Option<u32>,
    },
}

impl std::fmt::Display for LockHolder {
    /// `another store in this process (opened as PATH)`, `another process (pid N)` or
    /// `another process`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockHolder::ThisProcess { path } => write!(
                f,
                "another store in this process (opened as {})",
                path.display()
            ),
            LockHolder::OtherProcess { pid: Some(pid) } => {
                write!(f, "another process (pid {pid})")
            }
            LockHolder::OtherProcess { pid: None } => f.write_str("another process"),
        }
    }
}
