//! One writer per database file: a second `SqliteStore` on a file another open store holds is
//! refused when it opens, naming the lock file; read-only access still works beside the writer.

use backstop_store::snapshots::RunRecordsReader;
use backstop_store::{AuditReader, SqliteStore, Store, StoreError};

#[test]
fn a_second_open_of_the_same_file_is_refused_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let first = SqliteStore::open(&db).expect("first open");

    let err = SqliteStore::open(&db).expect_err("a second writer must be refused");
    let lock = dir.path().join("backstop.db.lock");
    assert_eq!(
        err,
        StoreError::Locked {
            lock: lock.clone(),
            database: db.clone(),
        }
    );
    let text = err.to_string();
    assert!(text.contains(&lock.display().to_string()), "{text}");
    assert!(text.contains("another process holds this lock"), "{text}");
    // `open_existing` is refused the same way.
    assert!(matches!(
        SqliteStore::open_existing(&db),
        Err(StoreError::Locked { .. })
    ));

    // Read-only access takes no lock.
    let reader = AuditReader::open(&db).expect("audit reader beside the writer");
    reader.verify(None).expect("verify beside the writer");
    RunRecordsReader::open(&db).expect("run records reader beside the writer");

    // The first store still writes: the refused opens left it alone.
    first.audit_head().expect("first store reads");
    drop(first);
    let again = SqliteStore::open(&db).expect("the lock is released when the store is dropped");
    again.audit_head().expect("reopened store reads");
}

#[test]
fn a_missing_file_opened_without_create_leaves_no_lock_file_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("absent.db");
    assert!(matches!(
        SqliteStore::open_existing(&db),
        Err(StoreError::Missing { .. })
    ));
    assert!(!dir.path().join("absent.db.lock").exists());
}

#[test]
fn stores_on_different_files_do_not_share_a_lock() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = SqliteStore::open(dir.path().join("a.db")).expect("a");
    let b = SqliteStore::open(dir.path().join("b.db")).expect("b");
    a.audit_head().expect("a reads");
    b.audit_head().expect("b reads");
}

#[cfg(unix)]
#[test]
fn another_spelling_of_the_same_file_is_refused_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let first = SqliteStore::open(&db).expect("first open");

    // A symbolic link to the database, and a path through `..`, name the same lock file.
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(&db, &link).expect("symlink");
    std::fs::create_dir(dir.path().join("sub")).expect("sub dir");
    let dotdot = dir.path().join("sub").join("..").join("backstop.db");
    for other in [&link, &dotdot] {
        let err = SqliteStore::open(other).expect_err("the same file under another name");
        assert!(
            matches!(&err, StoreError::Locked { lock, .. } if lock.ends_with("backstop.db.lock")),
            "{}: {err}",
            other.display()
        );
    }
    assert!(!dir.path().join("link.db.lock").exists());
    drop(first);
}
