//! One writer per database file: an exclusive advisory lock on a lock file beside it.
//!
//! Why: the store assumes it is the only process adding actions and audit events to its file
//! (the action id counter and the audit chain head live in the writing process). A second
//! gateway on the same file used to start normally and then fail every write (`UNIQUE
//! constraint failed: audit_events.seq`). [`StoreLock::acquire`] refuses that second writer when
//! it opens instead, naming the lock file.
//!
//! The lock is `<database>.lock` (e.g. `backstop.db.lock`) beside the database's resolved path
//! (a symbolic link or a `..` spelling names the same lock), created if missing and never
//! removed: removing it on close would let a third opener lock a fresh file while a second
//! still holds the old one. It is taken with [`std::fs::File::try_lock`] (an exclusive,
//! non-blocking advisory lock: `flock(2)` on Unix, `LockFileEx` on Windows), which the
//! operating system releases when the holder closes it or dies, so a crashed gateway never
//! leaves a stale lock. The lock belongs to the open file, not the process: a second
//! [`crate::SqliteStore`] on the same file in the same process is refused too.
//!
//! Read-only access ([`crate::AuditReader`], [`crate::RunRecordsReader`]) takes no lock: it
//! never writes, and SQLite's WAL lets it read while a gateway writes.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::StoreError;

/// The exclusive lock of one database file, held while this value lives.
#[derive(Debug)]
pub(crate) struct StoreLock {
    /// Kept open: closing the file releases the lock. `None` when the database path cannot be
    /// opened anyway (see [`StoreLock::acquire`]).
    _file: Option<File>,
}

/// The lock file of `database`: its resolved path (symbolic links and `..` followed, see
/// [`resolved`]) with `.lock` appended to the file name, so every spelling of one database
/// names one lock file.
pub(crate) fn lock_path(database: &Path) -> PathBuf {
    let mut name = resolved(database).into_os_string();
    name.push(".lock");
    PathBuf::from(name)
}

/// `database` with symbolic links, `.` and `..` resolved: the file itself when it exists, else
/// its resolved directory joined with its file name; as given when neither resolves (the open
/// that follows then names the real problem). Hard links to one file are not recognized.
fn resolved(database: &Path) -> PathBuf {
    if let Ok(path) = database.canonicalize() {
        return path;
    }
    let parent = match database.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (parent.canonicalize(), database.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => database.to_owned(),
    }
}

impl StoreLock {
    /// Takes the exclusive lock beside `database`, creating the lock file if needed. Nothing is
    /// created for a path the store refuses to open anyway (a directory, or a missing file when
    /// `create` is false): the caller's open then names the real problem.
    ///
    /// # Errors
    /// [`StoreError::Locked`] naming the lock file when another open store (in this process or
    /// another) holds it; [`StoreError::Io`] naming the lock file when it cannot be created,
    /// opened or locked (e.g. a missing directory, no permission).
    pub(crate) fn acquire(database: &Path, create: bool) -> Result<Self, StoreError> {
        if database.is_dir() || (!create && !database.exists()) {
            return Ok(StoreLock { _file: None });
        }
        let lock = lock_path(database);
        let io = |e: std::io::Error| StoreError::Io {
            place: lock.display().to_string(),
            reason: format!("cannot take the store's write lock: {e}"),
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => Ok(StoreLock { _file: Some(file) }),
            Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
                lock,
                database: database.to_owned(),
            }),
            Err(TryLockError::Error(e)) => Err(io(e)),
        }
    }
}
