//! One writer per database file: an exclusive advisory lock on the database file itself.
//!
//! Why: the store assumes it is the only process adding actions and audit events to its file
//! (the action id counter and the audit chain head live in the writing process). A second
//! gateway on the same file used to start normally and then fail every write (`UNIQUE
//! constraint failed: audit_events.seq`). [`StoreLock::acquire`] refuses that second writer when
//! it opens instead, naming the database and who holds it ([`LockHolder`]).
//!
//! # On Linux: `flock(2)` on the database file
//!
//! The lock follows the file, not a name: it is taken with [`std::fs::File::try_lock`]
//! (`flock(2)`, exclusive, non-blocking) on a descriptor of the database file itself, so every
//! path to that file (a hard link, a symbolic link, a `..` spelling) meets the same lock, and
//! there is no lock file anyone could delete. The operating system releases it when the holder
//! closes it or dies, so a crashed gateway never leaves a stale lock.
//!
//! SQLite locks the same file with POSIX record locks (`fcntl(2)` `F_SETLK` on bytes from
//! 0x40000000). On Linux the two kinds are independent on local file systems (`flock(2)`: "there
//! is no interaction between the types of lock placed by flock() and fcntl(2)"), so this lock
//! neither blocks nor is blocked by SQLite's. (Over NFS, Linux emulates `flock` with a
//! whole-file `fcntl` lock; the store's WAL mode needs a local file system anyway: its readers
//! and writer share the `-shm` file through memory mapping.)
//!
//! One hazard of POSIX locks remains: closing *any* descriptor of a file drops every POSIX lock
//! the process holds on it, SQLite's included (SQLite's "How To Corrupt An SQLite Database
//! File", §2.2). So the descriptor opened here is never closed: it is kept for the life of the
//! process in a table keyed by the file's device and inode numbers, unlocked (`LOCK_UN`) when
//! its store is dropped and locked again by the next store on that file. A store in this process
//! is refused by that table without opening the file again; the cost is one descriptor per
//! database file the process ever opened for writing (one for a gateway). Holding the
//! descriptor also keeps the inode from being reused, so its numbers keep naming one file.
//!
//! # Elsewhere: a lock file
//!
//! On other systems `flock` and `fcntl` locks can conflict (BSD and macOS implement both on one
//! lock list), and Windows' `LockFileEx` is mandatory, so there the lock is taken on a lock file
//! beside the database's resolved path, `<database>.lock` (created if missing, never removed).
//! Hard links and a deleted lock file escape it there.
//!
//! Read-only access ([`crate::AuditReader`], [`crate::RunRecordsReader`]) takes no lock: it
//! never writes, and SQLite's WAL lets it read while a gateway writes.

use std::path::{Path, PathBuf};

use crate::error::{LockHolder, StoreError};

#[cfg(target_os = "linux")]
pub(crate) use on_file::StoreLock;

#[cfg(not(target_os = "linux"))]
pub(crate) use lock_file::StoreLock;

/// `database` is not locked at all: a directory, or a missing file when `create` is false. The
/// caller's open then names the real problem, and nothing is created.
fn nothing_to_lock(database: &Path, create: bool) -> bool {
    database.is_dir() || (!create && !database.exists())
}

/// The [`StoreError::Io`] of a lock that could not be taken on `place`.
fn io_error(place: &Path, e: &std::io::Error) -> StoreError {
    StoreError::Io {
        place: place.display().to_string(),
        reason: format!("cannot take the store's write lock: {e}"),
    }
}

#[cfg(target_os = "linux")]
mod on_file {
    use std::collections::btree_map::Entry;
    use std::collections::BTreeMap;
    use std::fs::{File, OpenOptions, TryLockError};
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    use std::sync::{Mutex, PoisonError};

    use super::{io_error, nothing_to_lock, LockHolder, Path, PathBuf, StoreError};

    /// A file's identity: device and inode numbers (`st_dev`, `st_ino`).
    type FileId = (u64, u64);

    /// A descriptor of one database file, kept open for the life of the process (see the
    /// module docs).
    struct Opened {
        file: File,
        /// The path the store holding the lock in this process was opened with; `None` while
        /// no store here holds it.
        holder: Option<PathBuf>,
    }

    /// Every database file this process opened for writing.
    static FILES: Mutex<BTreeMap<FileId, Opened>> = Mutex::new(BTreeMap::new());

    /// The exclusive lock of one database file, held while this value lives.
    #[derive(Debug)]
    pub(crate) struct StoreLock {
        /// The locked file; `None` when the database path cannot be opened anyway (see
        /// [`StoreLock::acquire`]).
        id: Option<FileId>,
    }

    impl StoreLock {
        /// Takes the exclusive lock of the file at `database` (creating an empty file, mode
        /// 0644 before the umask as SQLite would, when it is missing and `create` is true).
        /// Nothing is created or locked for a path the store refuses to open anyway (a
        /// directory, or a missing file when `create` is false).
        ///
        /// # Errors
        /// [`StoreError::Locked`] naming `database` and its [`LockHolder`] when another open
        /// store (in this process or another) holds the file; [`StoreError::Io`] naming
        /// `database` when it cannot be created, opened or locked (e.g. a missing directory, no
        /// permission).
        pub(crate) fn acquire(database: &Path, create: bool) -> Result<Self, StoreError> {
            if nothing_to_lock(database, create) {
                return Ok(StoreLock { id: None });
            }
            let mut files = FILES.lock().unwrap_or_else(PoisonError::into_inner);
            let known = std::fs::metadata(database)
                .ok()
                .map(|m| (m.dev(), m.ino()))
                .filter(|id| files.contains_key(id));
            let mut fresh = None;
            let id = match known {
                Some(id) => id,
                None => {
                    let file = open(database).map_err(|e| io_error(database, &e))?;
                    let meta = file.metadata().map_err(|e| io_error(database, &e))?;
                    fresh = Some(file);
                    (meta.dev(), meta.ino())
                }
            };
            let opened = match files.entry(id) {
                Entry::Occupied(slot) => {
                    if let Some(file) = fresh {
                        // The path was replaced by a file this process already holds open
                        // between the two looks: keep this descriptor open too (closing it
                        // would drop SQLite's POSIX locks on that file).
                        std::mem::forget(file);
                    }
                    slot.into_mut()
                }
                Entry::Vacant(slot) => {
                    let file = match fresh {
                        Some(file) => file,
                        None => open(database).map_err(|e| io_error(database, &e))?,
                    };
                    slot.insert(Opened { file, holder: None })
                }
            };
            if let Some(path) = &opened.holder {
                return Err(StoreError::Locked {
                    database: database.to_owned(),
                    holder: LockHolder::ThisProcess { path: path.clone() },
                });
            }
            match opened.file.try_lock() {
                Ok(()) => {
                    opened.holder = Some(database.to_owned());
                    Ok(StoreLock { id: Some(id) })
                }
                Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
                    database: database.to_owned(),
                    holder: LockHolder::OtherProcess {
                        pid: flock_holder(id),
                    },
                }),
                Err(TryLockError::Error(e)) => Err(io_error(database, &e)),
            }
        }
    }

    /// Opens `database` for locking only: read-only when it exists, else created empty (SQLite
    /// takes an empty file for a new database).
    fn open(database: &Path) -> std::io::Result<File> {
        match File::open(database) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(database),
            other => other,
        }
    }

    impl Drop for StoreLock {
        /// Unlocks the file (the descriptor stays open, see the module docs).
        fn drop(&mut self) {
            let Some(id) = self.id else { return };
            let mut files = FILES.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(opened) = files.get_mut(&id) {
                // An unlock that fails leaves the lock to the process's exit; the next store
                // here is then refused by the operating system, naming this process.
                let _ = opened.file.unlock();
                opened.holder = None;
            }
        }
    }

    /// The process holding an exclusive `flock` on the file `id`, as `/proc/locks` shows it
    /// (lines such as `1: FLOCK  ADVISORY  WRITE 2377 fd:00:1234 0 EOF`: pid, then the device as
    /// hexadecimal major:minor and the decimal inode). `None` when it cannot be read, lists no
    /// such lock (e.g. on overlay file systems, whose locks name the underlying inode) or shows
    /// pid 0 (a process outside this pid namespace).
    fn flock_holder((dev, ino): FileId) -> Option<u32> {
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        // glibc's `gnu_dev_major` and `gnu_dev_minor`.
        let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
        let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
        locks.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [_, "FLOCK", _, "WRITE", pid, file, ..] = fields.as_slice() else {
                return None;
            };
            let mut parts = file.split(':');
            let (Some(maj), Some(min), Some(inode)) = (parts.next(), parts.next(), parts.next())
            else {
                return None;
            };
            let same = u64::from_str_radix(maj, 16).ok()? == major
                && u64::from_str_radix(min, 16).ok()? == minor
                && inode.parse::<u64>().ok()? == ino;
            let pid = pid.parse::<u32>().ok()?;
            (same && pid != 0).then_some(pid)
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod lock_file {
    use std::fs::{File, OpenOptions, TryLockError};

    use super::{io_error, nothing_to_lock, LockHolder, Path, PathBuf, StoreError};

    /// The exclusive lock of one database file, held while this value lives.
    #[derive(Debug)]
    pub(crate) struct StoreLock {
        /// Kept open: closing the file releases the lock. `None` when the database path cannot
        /// be opened anyway (see [`StoreLock::acquire`]).
        _file: Option<File>,
    }

    /// The lock file of `database`: its resolved path (symbolic links and `..` followed, see
    /// [`resolved`]) with `.lock` appended to the file name.
    fn lock_path(database: &Path) -> PathBuf {
        let mut name = resolved(database).into_os_string();
        name.push(".lock");
        PathBuf::from(name)
    }

    /// `database` with symbolic links, `.` and `..` resolved: the file itself when it exists,
    /// else its resolved directory joined with its file name; as given when neither resolves.
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
        /// Takes the exclusive lock on `<database>.lock`, creating the lock file if needed.
        ///
        /// # Errors
        /// [`StoreError::Locked`] when another open store holds it; [`StoreError::Io`] naming
        /// the lock file when it cannot be created, opened or locked.
        pub(crate) fn acquire(database: &Path, create: bool) -> Result<Self, StoreError> {
            if nothing_to_lock(database, create) {
                return Ok(StoreLock { _file: None });
            }
            let lock = lock_path(database);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&lock)
                .map_err(|e| io_error(&lock, &e))?;
            match file.try_lock() {
                Ok(()) => Ok(StoreLock { _file: Some(file) }),
                Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
                    database: database.to_owned(),
                    holder: LockHolder::OtherProcess { pid: None },
                }),
                Err(TryLockError::Error(e)) => Err(io_error(&lock, &e)),
            }
        }
    }
}
