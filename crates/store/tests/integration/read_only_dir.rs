//! The audit reader on a database it cannot write beside: a read-only directory (or file
//! system) where SQLite cannot create the `-shm` file that reading a WAL database needs.
//!
//! A directory made read-only with `chmod 0555` stops everyone but root. Running as root
//! (as CI does), the same failure is forced another way: a `-shm` that is a dangling symbolic
//! link, which SQLite refuses to open or create (`O_NOFOLLOW`) whoever runs it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use backstop_store::audit::Verdict;
use backstop_store::{AuditReader, Store};
use rusqlite::{Connection, OpenFlags};

use crate::common::populated;

/// Gives the directory its write bit back when the test ends, so that it can be removed.
struct Writable(PathBuf);

impl Drop for Writable {
    fn drop(&mut self) {
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o755));
    }
}

fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Makes the `-shm` file of `path` impossible to create: the directory read-only, or, where
/// that does not stop this process (root), a dangling symbolic link in its place.
fn deny_shm(dir: &Path, path: &Path) -> Writable {
    let guard = Writable(dir.to_owned());
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).expect("chmod 0555");
    let probe = dir.join("probe");
    if std::fs::write(&probe, b"").is_ok() {
        // The permission bits do not stop this process.
        let _ = std::fs::remove_file(&probe);
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::os::unix::fs::symlink(dir.join("no-such-dir/shm"), beside(path, "-shm"))
            .expect("symlink");
    }
    guard
}

/// What a plain read-only open of `path` says on its first read.
fn plain_read_only(path: &Path) -> Result<i64, rusqlite::Error> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    conn.query_row("SELECT count(*) FROM audit_events", [], |r| r.get(0))
}

#[test]
fn a_database_whose_shm_file_cannot_be_created_is_read_as_immutable() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("evidence");
    std::fs::create_dir(&dir).expect("mkdir");
    let (store, path) = populated(&dir, 3);
    let head = store.audit_head().expect("head").expect("events");
    drop(store);
    // Closing the last connection checkpointed the WAL and removed `-wal` and `-shm`.
    assert!(!beside(&path, "-shm").exists());
    let _ = std::fs::remove_file(beside(&path, ".lock"));
    let _writable = deny_shm(&dir, &path);
    // The condition is real: SQLite's own read-only open fails here.
    let plain = plain_read_only(&path).expect_err("the plain read-only open fails");
    assert!(
        matches!(
            plain.sqlite_error_code(),
            Some(rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::ReadOnly)
        ),
        "{plain}"
    );

    let reader = AuditReader::open(&path).expect("opened read-only without the -shm file");
    assert_eq!(reader.head().expect("head"), Some(head.clone()));
    assert_eq!(
        reader.verify(Some(&head.hash)).expect("verify"),
        Verdict::Intact {
            count: 7,
            head: Some(head)
        }
    );
    let mut out = Vec::new();
    assert_eq!(reader.export(0, &mut out).expect("export"), 7);
}

#[test]
fn a_wal_file_with_changes_and_no_shm_file_is_refused_with_what_to_do() {
    let root = tempfile::tempdir().expect("tempdir");
    let live = root.path().join("live");
    std::fs::create_dir(&live).expect("mkdir");
    let (store, path) = populated(&live, 3);
    // A copy taken while the store is open: the last events are still only in the -wal file.
    let dir = root.path().join("copy");
    std::fs::create_dir(&dir).expect("mkdir");
    let copy = dir.join("backstop.db");
    std::fs::copy(&path, &copy).expect("copy db");
    std::fs::copy(beside(&path, "-wal"), beside(&copy, "-wal")).expect("copy wal");
    drop(store);
    let wal_bytes = std::fs::metadata(beside(&copy, "-wal")).expect("wal").len();
    assert!(wal_bytes > 0, "the copy's -wal file holds the last commits");
    let _writable = deny_shm(&dir, &copy);

    let err = AuditReader::open(&copy).expect_err("reading the database file alone is unsafe");
    let text = err.to_string();
    assert!(text.starts_with(&format!("{}: ", copy.display())), "{text}");
    assert!(text.contains(&format!("{wal_bytes} bytes")), "{text}");
    assert!(
        text.contains("copy the database together with its -wal file into a writable directory"),
        "{text}"
    );
}
