//! One writer per database file: a second `SqliteStore` on a file another open store holds is
//! refused when it opens, naming the database and the holder, whatever path leads to the file
//! (a symbolic or hard link, `..`) and whatever lies beside it; read-only access still works
//! beside the writer.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use backstop_store::audit::Verdict;
use backstop_store::snapshots::RunRecordsReader;
use backstop_store::{AuditReader, LockHolder, SqliteStore, Store, StoreError};

#[test]
fn a_second_open_of_the_same_file_is_refused_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let first = SqliteStore::open(&db).expect("first open");

    let err = SqliteStore::open(&db).expect_err("a second writer must be refused");
    assert_eq!(
        err,
        StoreError::Locked {
            database: db.clone(),
            holder: LockHolder::ThisProcess { path: db.clone() },
        }
    );
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{}: another store in this process (opened as {}) holds this database's write lock",
            db.display(),
            db.display()
        )),
        "{text}"
    );
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
    assert!(!dir.path().join("absent.db").exists());
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

    // A symbolic link to the database, and a path through `..`, lead to the same file.
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(&db, &link).expect("symlink");
    std::fs::create_dir(dir.path().join("sub")).expect("sub dir");
    let dotdot = dir.path().join("sub").join("..").join("backstop.db");
    for other in [&link, &dotdot] {
        let err = SqliteStore::open(other).expect_err("the same file under another name");
        assert!(
            matches!(&err, StoreError::Locked { holder: LockHolder::ThisProcess { path }, .. } if path == &db),
            "{}: {err}",
            other.display()
        );
    }
    assert!(!dir.path().join("link.db.lock").exists());
    drop(first);
}

#[cfg(target_os = "linux")]
#[test]
fn a_hard_link_to_the_same_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let first = SqliteStore::open(&db).expect("first open");
    let link = dir.path().join("other-name.db");
    std::fs::hard_link(&db, &link).expect("hard link");

    let err = SqliteStore::open(&link).expect_err("the same file through a hard link");
    assert_eq!(
        err,
        StoreError::Locked {
            database: link.clone(),
            holder: LockHolder::ThisProcess { path: db.clone() },
        }
    );
    drop(first);
    let again = SqliteStore::open(&link).expect("free once the first store is dropped");
    again.audit_head().expect("reads through the link");
}

#[cfg(target_os = "linux")]
#[test]
fn nothing_deleted_beside_the_database_frees_its_lock() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let first = SqliteStore::open(&db).expect("first open");
    // The lock file earlier versions kept beside the database, if any, deleted.
    remove_if_present(&dir.path().join("backstop.db.lock"));

    let err = SqliteStore::open(&db).expect_err("a second writer after the .lock was deleted");
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    first.audit_head().expect("the first store still reads");
}

/// A `store-crash-writer` writing `db` in a loop from another process, returned once it
/// committed its first action (so it holds the store open).
fn writer_process(db: &Path) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_store-crash-writer"))
        .arg(db)
        .arg("1")
        .arg("0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the writer process");
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut first)
        .expect("read the writer's first id");
    assert!(!first.trim().is_empty(), "the writer process ended early");
    child
}

fn remove_if_present(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_store_held_by_another_process_is_refused_through_a_hard_link_and_a_deleted_lock_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("backstop.db");
    let mut writer = writer_process(&db);
    let link = dir.path().join("hard-link.db");
    std::fs::hard_link(&db, &link).expect("hard link");
    remove_if_present(&dir.path().join("backstop.db.lock"));

    for path in [&db, &link] {
        let err = SqliteStore::open(path).expect_err("the other process holds the file");
        let StoreError::Locked { database, holder } = &err else {
            panic!("{}: {err}", path.display());
        };
        assert_eq!(database, path);
        // The holder's pid, from /proc/locks (not shown on every file system).
        assert!(
            matches!(holder, LockHolder::OtherProcess { pid } if pid.is_none() || *pid == Some(writer.id())),
            "{err}"
        );
    }
    // SQLite's own locks are undisturbed by the write lock: this process reads and verifies
    // the chain while the other one keeps committing. (By the name the writer uses: SQLite
    // names the `-wal` file after the path, so a hard link does not see uncheckpointed
    // commits.)
    let reader = AuditReader::open(&db).expect("audit reader beside the other process");
    let verdict = reader
        .verify(None)
        .expect("verify beside the other process");
    assert!(matches!(verdict, Verdict::Intact { .. }), "{verdict:?}");

    writer.kill().expect("SIGKILL");
    writer.wait().expect("reap");
    let store = SqliteStore::open(&db).expect("free once the holder died");
    assert!(store.audit_head().expect("head").is_some());
}
