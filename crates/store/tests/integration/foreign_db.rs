//! Files that are not (usable) backstop databases give clear errors, never a panic, and are
//! left untouched.

use backstop_store::{AuditReader, SqliteStore, StoreError};

use crate::common::populated;

fn random_bytes(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn random_bytes_are_not_sqlite_and_stay_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("random.db");
    let bytes = random_bytes(16_384);
    std::fs::write(&path, &bytes).expect("write");
    let err = SqliteStore::open(&path).expect_err("random bytes");
    assert!(matches!(err, StoreError::NotSqlite { .. }), "{err}");
    assert!(
        err.to_string().contains("random.db: not a SQLite database"),
        "{err}"
    );
    let err = AuditReader::open(&path).expect_err("random bytes");
    assert!(matches!(err, StoreError::NotSqlite { .. }), "{err}");
    assert_eq!(std::fs::read(&path).expect("read"), bytes);
}

#[test]
fn another_applications_database_is_foreign_and_not_migrated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("other.db");
    let conn = rusqlite::Connection::open(&path).expect("create");
    conn.execute_batch("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT); INSERT INTO notes (text) VALUES ('hi');")
        .expect("schema");
    drop(conn);
    let err = SqliteStore::open(&path).expect_err("foreign");
    assert!(
        err.to_string()
            .contains("other.db: not a backstop database"),
        "{err}"
    );
    let err = AuditReader::open(&path).expect_err("foreign");
    assert!(matches!(err, StoreError::Foreign { .. }), "{err}");
    let conn = rusqlite::Connection::open(&path).expect("reopen");
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(tables, 1, "the foreign file was changed");
}

#[test]
fn a_newer_schema_version_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("new.db");
    drop(SqliteStore::open(&path).expect("create"));
    let conn = rusqlite::Connection::open(&path).expect("open");
    conn.pragma_update(None, "user_version", 42).expect("bump");
    drop(conn);
    let err = SqliteStore::open(&path).expect_err("newer");
    assert_eq!(
        err,
        StoreError::TooNew {
            path: path.clone(),
            found: 42,
            supported: backstop_store::sqlite::SCHEMA_VERSION
        }
    );
    assert!(AuditReader::open(&path).is_err());
}

#[test]
fn audit_reader_never_creates_a_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("absent.db");
    let err = AuditReader::open(&path).expect_err("missing");
    assert!(matches!(err, StoreError::Missing { .. }), "{err}");
    let err = SqliteStore::open_existing(&path).expect_err("missing");
    assert!(matches!(err, StoreError::Missing { .. }), "{err}");
    assert!(!path.exists());
    // An empty file is a SQLite database with nothing in it: not a backstop database.
    std::fs::write(&path, b"").expect("touch");
    let err = AuditReader::open(&path).expect_err("empty");
    assert!(matches!(err, StoreError::Foreign { .. }), "{err}");
    // The store itself may initialise an empty file.
    drop(SqliteStore::open_existing(&path).expect("initialise empty file"));
    let reader = AuditReader::open(&path).expect("now a backstop db");
    assert_eq!(reader.head().expect("head"), None);
}

#[test]
fn a_damaged_database_is_refused_when_the_store_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 300);
    drop(store);
    // Closing the last connection checkpointed the WAL into the main file: damage a b-tree
    // page in its middle (never the header page), as a torn write or bad sector would.
    let mut bytes = std::fs::read(&path).expect("read");
    let page_size = 4096;
    let pages = bytes.len() / page_size;
    assert!(
        pages > 4,
        "the fixture is too small to damage a middle page"
    );
    let page = pages / 2;
    for b in &mut bytes[page * page_size..(page + 1) * page_size] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).expect("write");
    let err = SqliteStore::open(&path).expect_err("a damaged file must not open");
    assert!(matches!(err, StoreError::Damaged { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("backstop.db: the database is damaged"),
        "{text}"
    );
}

#[test]
fn a_truncated_database_is_damaged_or_truncated_not_foreign_to_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 50);
    drop(store);
    let bytes = std::fs::read(&path).expect("read");
    let page_size = 4096;
    let pages = bytes.len() / page_size;
    assert!(pages > 2, "the fixture has several pages");
    for len in [1000, 2 * page_size + 100, 20] {
        std::fs::write(&path, &bytes[..len]).expect("write");
        let writer = SqliteStore::open(&path).expect_err("a truncated file must not open");
        let reader = AuditReader::open(&path).expect_err("a truncated file must not be read");
        for err in [writer, reader] {
            assert!(
                matches!(err, StoreError::DamagedFile { .. }),
                "{len}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains("backstop.db: the file is damaged or truncated: "),
                "{text}"
            );
            let said = if len < 100 {
                format!("it has {len} bytes, fewer than the 100 of a SQLite database header")
            } else {
                format!("it has {len} bytes, but its header gives {pages} pages of 4096 bytes")
            };
            assert!(text.contains(&said), "{text}");
        }
        assert_eq!(
            std::fs::read(&path).expect("read"),
            &bytes[..len],
            "untouched"
        );
    }
}
