//! Whether the store can make writes durable where it is, checked when it opens for writing.
//!
//! Why: SQLite opens a file it cannot write (a read-only file, a read-only file system) for
//! reading instead, without an error, and reads succeed; a gateway started on it then answered
//! every write `503 store_unavailable` while its liveness probe said serving. So the store
//! refuses to open ([`StoreError::NotDurable`]) unless:
//! - the database file and the `-wal` and `-shm` files beside it, where they exist, open for
//!   writing (nothing is written to them here);
//! - the directory takes a new file (SQLite creates the `-wal` and `-shm` files beside the
//!   database whenever it is opened after a clean stop): a probe file is created and removed;
//! - SQLite opened the database file for writing;
//! - one real commit succeeds: `PRAGMA application_id` is written with the value it already
//!   holds, a write transaction that changes no content but writes page 1 to the `-wal` file
//!   and syncs it (`synchronous = FULL`), as every later commit must. Beginning a write
//!   transaction and rolling it back would prove neither.

use std::io::ErrorKind;
use std::path::Path;

use rusqlite::{Connection, MAIN_DB};

use super::schema::APPLICATION_ID;
use crate::error::StoreError;

/// Checks, before SQLite opens `database`, that the database, `-wal` and `-shm` files that
/// exist open for writing and that its directory takes new files. A missing directory and a
/// path that is a directory are left to the open, which names them.
///
/// # Errors
/// [`StoreError::NotDurable`] naming `database` and what cannot be written.
pub(crate) fn check_place(database: &Path) -> Result<(), StoreError> {
    // The files first: on a read-only file system they name it, whatever the directory says.
    for suffix in ["", "-wal", "-shm"] {
        let mut name = database.as_os_str().to_owned();
        name.push(suffix);
        let file = std::path::PathBuf::from(name);
        if !file.is_file() {
            continue;
        }
        if let Err(e) = std::fs::OpenOptions::new().write(true).open(&file) {
            let which = if suffix.is_empty() {
                "the file".to_owned()
            } else {
                format!("its {suffix} file {}", file.display())
            };
            return Err(StoreError::NotDurable {
                path: database.to_owned(),
                reason: format!("{which} cannot be opened for writing ({})", describe(&e)),
            });
        }
    }
    check_directory(database)
}

/// Checks that the directory of `database` takes new files, when that directory exists.
fn check_directory(database: &Path) -> Result<(), StoreError> {
    let dir = match database.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Ok(());
    }
    let name = database
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let probe = dir.join(format!(".{name}.probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(file) => {
            drop(file);
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        // Left by an earlier start of this same process id that was killed at this point.
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(StoreError::NotDurable {
            path: database.to_owned(),
            reason: format!(
                "its directory {} does not take new files ({}), and SQLite creates the store's \
                 -wal and -shm files there",
                dir.display(),
                describe(&e)
            ),
        }),
    }
}

/// Checks that `conn`, the writer connection of `database`, can commit: the file is open for
/// writing and one commit (see the module docs) succeeds.
///
/// # Errors
/// [`StoreError::NotDurable`] naming `database` and why a write cannot be made durable there.
pub(crate) fn check_commit(conn: &Connection, database: &Path) -> Result<(), StoreError> {
    let not_durable = |reason: String| StoreError::NotDurable {
        path: database.to_owned(),
        reason,
    };
    if conn.is_readonly(MAIN_DB).unwrap_or(false) {
        return Err(not_durable(read_only_file(database)));
    }
    conn.pragma_update(None, "application_id", APPLICATION_ID)
        .map_err(|e| not_durable(format!("a test commit failed: {e}")))
}

/// Why SQLite opened `database` read-only, as far as opening it for writing here tells.
fn read_only_file(database: &Path) -> String {
    match std::fs::OpenOptions::new().write(true).open(database) {
        Err(e) => format!("the file cannot be opened for writing ({})", describe(&e)),
        Ok(_) => "SQLite opened the file read-only".to_owned(),
    }
}

/// An I/O error as said to an operator: a read-only file system and a missing permission by
/// name, the operating system's text otherwise.
fn describe(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ReadOnlyFilesystem => "a read-only file system".to_owned(),
        ErrorKind::PermissionDenied => "permission denied".to_owned(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frames the `-wal` file of `conn` holds (`PRAGMA wal_checkpoint`'s second column).
    fn wal_frames(conn: &Connection) -> i64 {
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
            .expect("checkpoint")
    }

    #[test]
    fn the_test_commit_writes_a_frame_to_the_wal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("b.db");
        let conn = super::super::schema::open_writer(&path, true).expect("open");
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .expect("truncate");
        assert_eq!(wal_frames(&conn), 0);
        check_commit(&conn, &path).expect("a writable store");
        assert!(wal_frames(&conn) > 0, "the check committed nothing");
        let id: i64 = conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .expect("id");
        assert_eq!(id, APPLICATION_ID);
    }

    #[test]
    fn a_connection_opened_read_only_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("b.db");
        drop(super::super::schema::open_writer(&path, true).expect("create"));
        let conn = Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open read-only");
        let err = check_commit(&conn, &path).expect_err("read-only");
        let text = err.to_string();
        assert!(matches!(err, StoreError::NotDurable { .. }), "{err:?}");
        assert!(text.starts_with(&format!("{}: ", path.display())), "{text}");
        assert!(text.contains("read-only"), "{text}");
    }

    #[test]
    fn a_writable_place_passes_and_keeps_no_probe_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        check_place(&dir.path().join("b.db")).expect("writable");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 0);
        // A missing directory and a directory in the file's place are left to the open.
        check_place(&dir.path().join("no-such-dir/b.db")).expect("left to the open");
        check_place(dir.path()).expect("left to the open");
    }
}
