//! Opening, identifying and migrating a backstop SQLite file.
//!
//! A backstop database is recognised by `PRAGMA application_id` = [`APPLICATION_ID`] ("BSTP")
//! and its schema version by `PRAGMA user_version`. Migrations are a list of SQL scripts; script
//! *i* takes the schema from version *i* to *i + 1* and runs in its own transaction together
//! with the version bump. A file with another application id, or with tables but no id, is
//! refused as foreign; a newer version is refused rather than guessed at.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::error::StoreError;

/// `PRAGMA application_id` of every backstop database: the ASCII bytes `BSTP`.
pub const APPLICATION_ID: i64 = 0x4253_5450;

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The oldest schema version the read-only openers (`open_reader`: `backstop audit
/// verify|export|head`, `backstop snapshots export`) read as it is, without migrating it. Every
/// migration after it left the tables and columns they read unchanged or only added to them:
/// 8 -> 9 only adds the index `actions_open`, which nothing but the gateway's start-up scans
/// uses; 9 -> 10 adds the audit events' `agent` column, which an older file is read without
/// (`AGENT_SHIM`); 10 -> 11 adds the table `kept_requests` (and its trigger), which no reader
/// reads. A migration that changes anything else a reader reads (a table, a column,
/// how a value is stored) must raise this to its own version; the test
/// `migrations_after_the_oldest_readable_version_only_add_indexes` fails until it does.
pub const OLDEST_READABLE_VERSION: i64 = 8;
const _: () = assert!(OLDEST_READABLE_VERSION <= SCHEMA_VERSION);

const MIGRATIONS: &[&str] = &[
    // 0 -> 1: the first schema.
    r#"
    CREATE TABLE tasks (
        id              TEXT PRIMARY KEY,
        agent           TEXT NOT NULL,
        priority        TEXT NOT NULL,
        deadline_ms     INTEGER,
        cancelled_at_ms INTEGER,
        created_at_ms   INTEGER NOT NULL
    );
    CREATE TABLE actions (
        id                    INTEGER PRIMARY KEY,
        task_id               TEXT NOT NULL REFERENCES tasks(id),
        agent                 TEXT NOT NULL,
        provider              TEXT NOT NULL,
        method                TEXT NOT NULL,
        route                 TEXT NOT NULL,
        request_class         TEXT NOT NULL,
        payload_digest        TEXT NOT NULL,
        idempotency_key       TEXT NOT NULL,
        external_reference    TEXT,
        provider_operation_id TEXT,
        state                 TEXT NOT NULL,
        outcome               TEXT,
        outcome_context       TEXT,
        response_status       INTEGER,
        response_headers      TEXT,
        response_body         BLOB,
        created_at_ms         INTEGER NOT NULL,
        updated_at_ms         INTEGER NOT NULL,
        UNIQUE (agent, idempotency_key)
    );
    CREATE INDEX actions_by_task ON actions(task_id);
    CREATE TABLE attempts (
        action_id      INTEGER NOT NULL REFERENCES actions(id),
        n              INTEGER NOT NULL,
        state          TEXT NOT NULL,
        status         INTEGER,
        disposition    TEXT,
        started_at_ms  INTEGER NOT NULL,
        finished_at_ms INTEGER,
        PRIMARY KEY (action_id, n)
    );
    CREATE INDEX attempts_unfinished ON attempts(state) WHERE state = 'sent';
    CREATE TABLE scheduled_retries (
        job_id        INTEGER PRIMARY KEY,
        action_id     INTEGER NOT NULL REFERENCES actions(id),
        due_at_ms     INTEGER NOT NULL,
        claimed_at_ms INTEGER,
        claimed_by    TEXT
    );
    CREATE INDEX retries_due ON scheduled_retries(due_at_ms) WHERE claimed_at_ms IS NULL;
    CREATE INDEX retries_by_action ON scheduled_retries(action_id);
    CREATE TABLE scope_records (
        provider           TEXT NOT NULL,
        scope              TEXT NOT NULL,
        next_allowed_at_ms INTEGER,
        remaining          INTEGER,
        limit_             INTEGER,
        reset_at_ms        INTEGER,
        source             TEXT NOT NULL,
        updated_at_ms      INTEGER NOT NULL,
        PRIMARY KEY (provider, scope)
    );
    CREATE TABLE escalations (
        id             INTEGER PRIMARY KEY,
        action_id      INTEGER NOT NULL REFERENCES actions(id),
        case_file      TEXT NOT NULL,
        state          TEXT NOT NULL,
        decision       TEXT,
        decided_by     TEXT,
        opened_at_ms   INTEGER NOT NULL,
        decided_at_ms  INTEGER
    );
    CREATE TABLE audit_events (
        seq             INTEGER PRIMARY KEY,
        at              TEXT NOT NULL,
        kind            TEXT NOT NULL,
        task            TEXT,
        action          INTEGER,
        attempt         INTEGER,
        escalation      INTEGER,
        provider        TEXT,
        scope           TEXT,
        route           TEXT,
        method          TEXT,
        request_class   TEXT,
        idempotency_key TEXT,
        payload_digest  TEXT,
        status          INTEGER,
        disposition     TEXT,
        boundary        TEXT,
        source          TEXT,
        outcome         TEXT,
        job             INTEGER,
        due_at          TEXT,
        remaining       INTEGER,
        limit_          INTEGER,
        decision        TEXT,
        decided_by      TEXT,
        prev            TEXT NOT NULL,
        hash            TEXT NOT NULL
    );
    "#,
    // 1 -> 2: reads carry no idempotency key (the column becomes nullable, unique per agent
    // where set), escalation decisions keep the operator's note. SQLite cannot drop a NOT NULL
    // constraint in place, so `actions` is rebuilt (foreign keys are off while migrating and
    // checked before the commit, see `migrate`).
    r#"
    ALTER TABLE escalations ADD COLUMN note TEXT;
    CREATE TABLE actions_v2 (
        id                    INTEGER PRIMARY KEY,
        task_id               TEXT NOT NULL REFERENCES tasks(id),
        agent                 TEXT NOT NULL,
        provider              TEXT NOT NULL,
        method                TEXT NOT NULL,
        route                 TEXT NOT NULL,
        request_class         TEXT NOT NULL,
        payload_digest        TEXT NOT NULL,
        idempotency_key       TEXT,
        external_reference    TEXT,
        provider_operation_id TEXT,
        state                 TEXT NOT NULL,
        outcome               TEXT,
        outcome_context       TEXT,
        response_status       INTEGER,
        response_headers      TEXT,
        response_body         BLOB,
        created_at_ms         INTEGER NOT NULL,
        updated_at_ms         INTEGER NOT NULL
    );
    INSERT INTO actions_v2 (id, task_id, agent, provider, method, route, request_class,
        payload_digest, idempotency_key, external_reference, provider_operation_id, state,
        outcome, outcome_context, response_status, response_headers, response_body,
        created_at_ms, updated_at_ms)
    SELECT id, task_id, agent, provider, method, route, request_class, payload_digest,
        idempotency_key, external_reference, provider_operation_id, state, outcome,
        outcome_context, response_status, response_headers, response_body, created_at_ms,
        updated_at_ms FROM actions;
    DROP TABLE actions;
    ALTER TABLE actions_v2 RENAME TO actions;
    CREATE INDEX actions_by_task ON actions(task_id);
    CREATE UNIQUE INDEX actions_by_agent_key ON actions(agent, idempotency_key)
        WHERE idempotency_key IS NOT NULL;
    "#,
    // 2 -> 3: at most one scheduled retry per action is waiting. Earlier versions left the
    // job of a retry that was sent unclaimed, so an action could show two; every waiting job
    // but the newest of each action is marked taken (`superseded`, at its due instant) before
    // the constraint is added.
    r#"
    UPDATE scheduled_retries SET claimed_at_ms = due_at_ms, claimed_by = 'superseded'
     WHERE claimed_at_ms IS NULL
       AND job_id NOT IN (SELECT MAX(job_id) FROM scheduled_retries
                           WHERE claimed_at_ms IS NULL GROUP BY action_id);
    CREATE UNIQUE INDEX one_waiting_retry_per_action ON scheduled_retries(action_id)
        WHERE claimed_at_ms IS NULL;
    "#,
    // 3 -> 4: task ids are namespaced per agent. A task is keyed by (agent, id), so two agents
    // may use the same id independently; an action refers to its task by (agent, task_id).
    // Both tables are rebuilt (SQLite cannot change a primary key in place); every existing
    // task keeps its one agent, and every action already carries its task's agent.
    r#"
    CREATE TABLE tasks_v4 (
        agent           TEXT NOT NULL,
        id              TEXT NOT NULL,
        priority        TEXT NOT NULL,
        deadline_ms     INTEGER,
        cancelled_at_ms INTEGER,
        created_at_ms   INTEGER NOT NULL,
        PRIMARY KEY (agent, id)
    );
    INSERT INTO tasks_v4 (agent, id, priority, deadline_ms, cancelled_at_ms, created_at_ms)
    SELECT agent, id, priority, deadline_ms, cancelled_at_ms, created_at_ms FROM tasks;
    CREATE TABLE actions_v4 (
        id                    INTEGER PRIMARY KEY,
        task_id               TEXT NOT NULL,
        agent                 TEXT NOT NULL,
        provider              TEXT NOT NULL,
        method                TEXT NOT NULL,
        route                 TEXT NOT NULL,
        request_class         TEXT NOT NULL,
        payload_digest        TEXT NOT NULL,
        idempotency_key       TEXT,
        external_reference    TEXT,
        provider_operation_id TEXT,
        state                 TEXT NOT NULL,
        outcome               TEXT,
        outcome_context       TEXT,
        response_status       INTEGER,
        response_headers      TEXT,
        response_body         BLOB,
        created_at_ms         INTEGER NOT NULL,
        updated_at_ms         INTEGER NOT NULL,
        FOREIGN KEY (agent, task_id) REFERENCES tasks(agent, id)
    );
    INSERT INTO actions_v4 (id, task_id, agent, provider, method, route, request_class,
        payload_digest, idempotency_key, external_reference, provider_operation_id, state,
        outcome, outcome_context, response_status, response_headers, response_body,
        created_at_ms, updated_at_ms)
    SELECT id, task_id, agent, provider, method, route, request_class, payload_digest,
        idempotency_key, external_reference, provider_operation_id, state, outcome,
        outcome_context, response_status, response_headers, response_body, created_at_ms,
        updated_at_ms FROM actions;
    DROP TABLE actions;
    DROP TABLE tasks;
    ALTER TABLE tasks_v4 RENAME TO tasks;
    ALTER TABLE actions_v4 RENAME TO actions;
    CREATE INDEX actions_by_task ON actions(agent, task_id);
    CREATE UNIQUE INDEX actions_by_agent_key ON actions(agent, idempotency_key)
        WHERE idempotency_key IS NOT NULL;
    "#,
    // 4 -> 5: an attempt keeps what its response said, not only what it meant: the boundary it
    // normalized to (`unknown` or an RFC 3339 instant, as audited) and its signal headers
    // (Retry-After, Date, quota headers) as a JSON array of `[name, value]` pairs, NULL when
    // none were kept. The `action_result` event carries the same pairs. Older attempts and
    // events keep NULL: nothing is invented for them.
    r#"
    ALTER TABLE attempts ADD COLUMN boundary TEXT;
    ALTER TABLE attempts ADD COLUMN signal_headers TEXT;
    ALTER TABLE audit_events ADD COLUMN signal_headers TEXT;
    "#,
    // 5 -> 6: an action keeps what a case file built later needs and cannot recompute: the
    // agent's desired outcome (sanitized text) and the request's fingerprint (SPEC §7, with the
    // route's configured payload fields). Neither is audited. Older actions keep NULL.
    r#"
    ALTER TABLE actions ADD COLUMN desired_outcome TEXT;
    ALTER TABLE actions ADD COLUMN fingerprint TEXT;
    "#,
    // 6 -> 7: an action keeps the SHA-256 (hex) of the concrete target it was sent to (the
    // normalized path and query), so an idempotency key binds that target and not only its
    // route template. Older actions keep NULL and their keys compare as before.
    r#"
    ALTER TABLE actions ADD COLUMN target_digest TEXT;
    "#,
    // 7 -> 8: smaller audit rows and one b-tree fewer per attempt, for the same log. An event's
    // `prev` and `hash` are kept as the 32 bytes of the SHA-256 digest (BLOB) instead of 64
    // lower-case hex characters; the chain is unchanged, since the canonical encoding and every
    // printed form still use the hex (see `rows::event_row`). Only exactly 64 lower-case hex
    // digits are converted: anything else was never written by the store and is kept as its
    // raw bytes, whose length is not 32, so `audit verify` still reports that event rather than
    // a conversion quietly repairing it. `attempts` becomes WITHOUT ROWID: its rows live in the
    // (action_id, n) primary key's b-tree, not in a rowid table plus an index of that key.
    r#"
    CREATE TABLE audit_events_v8 (
        seq             INTEGER PRIMARY KEY,
        at              TEXT NOT NULL,
        kind            TEXT NOT NULL,
        task            TEXT,
        action          INTEGER,
        attempt         INTEGER,
        escalation      INTEGER,
        provider        TEXT,
        scope           TEXT,
        route           TEXT,
        method          TEXT,
        request_class   TEXT,
        idempotency_key TEXT,
        payload_digest  TEXT,
        status          INTEGER,
        disposition     TEXT,
        boundary        TEXT,
        source          TEXT,
        outcome         TEXT,
        job             INTEGER,
        due_at          TEXT,
        remaining       INTEGER,
        limit_          INTEGER,
        decision        TEXT,
        decided_by      TEXT,
        signal_headers  TEXT,
        prev            BLOB NOT NULL,
        hash            BLOB NOT NULL
    );
    INSERT INTO audit_events_v8 (seq, at, kind, task, action, attempt, escalation, provider,
        scope, route, method, request_class, idempotency_key, payload_digest, status,
        disposition, boundary, source, outcome, job, due_at, remaining, limit_, decision,
        decided_by, signal_headers, prev, hash)
    SELECT seq, at, kind, task, action, attempt, escalation, provider, scope, route, method,
        request_class, idempotency_key, payload_digest, status, disposition, boundary, source,
        outcome, job, due_at, remaining, limit_, decision, decided_by, signal_headers,
        CASE WHEN typeof(prev) = 'text' AND length(prev) = 64 AND prev = lower(prev)
                  AND unhex(prev) IS NOT NULL
             THEN unhex(prev) ELSE CAST(prev AS BLOB) END,
        CASE WHEN typeof(hash) = 'text' AND length(hash) = 64 AND hash = lower(hash)
                  AND unhex(hash) IS NOT NULL
             THEN unhex(hash) ELSE CAST(hash AS BLOB) END
    FROM audit_events;
    DROP TABLE audit_events;
    ALTER TABLE audit_events_v8 RENAME TO audit_events;
    CREATE TABLE attempts_v8 (
        action_id      INTEGER NOT NULL REFERENCES actions(id),
        n              INTEGER NOT NULL,
        state          TEXT NOT NULL,
        status         INTEGER,
        disposition    TEXT,
        started_at_ms  INTEGER NOT NULL,
        finished_at_ms INTEGER,
        boundary       TEXT,
        signal_headers TEXT,
        PRIMARY KEY (action_id, n)
    ) WITHOUT ROWID;
    INSERT INTO attempts_v8 (action_id, n, state, status, disposition, started_at_ms,
        finished_at_ms, boundary, signal_headers)
    SELECT action_id, n, state, status, disposition, started_at_ms, finished_at_ms, boundary,
        signal_headers FROM attempts;
    DROP TABLE attempts;
    ALTER TABLE attempts_v8 RENAME TO attempts;
    CREATE INDEX attempts_unfinished ON attempts(state) WHERE state = 'sent';
    "#,
    // 8 -> 9: the start-up scans for open actions (writes recorded but never sent, actions
    // between two attempts) read an index of the actions that are not finished instead of the
    // whole table, which holds every action ever answered. Finished actions (every answered
    // read is written finished) have no entry, so the index stays as small as the open work.
    r#"
    CREATE INDEX actions_open ON actions(state, id) WHERE state != 'finished';
    "#,
    // 9 -> 10: audit events name the agent whose task or action they are about (task ids are
    // the agent's own, so the task alone did not say whose). Events written before keep no
    // agent; the canonical encoding omits an absent member, so they verify unchanged. The
    // read-only openers read older files through `AGENT_SHIM` (no agent).
    r#"
    ALTER TABLE audit_events ADD COLUMN agent TEXT;
    "#,
    // 10 -> 11: a write keeps its request (method, URL, end-to-end headers without credentials,
    // body) from before its first send until it ends, so that restart recovery finishes it
    // itself (SPEC §6, §12). The row goes with the action's end (the trigger), never into the
    // audit chain. Readers do not read it.
    r#"
    CREATE TABLE kept_requests (
        action_id INTEGER PRIMARY KEY REFERENCES actions(id),
        method    TEXT NOT NULL,
        url       TEXT NOT NULL,
        headers   TEXT NOT NULL,
        body      BLOB NOT NULL
    );
    CREATE TRIGGER kept_request_ends_with_its_action AFTER UPDATE OF state ON actions
        WHEN NEW.state = 'finished'
    BEGIN
        DELETE FROM kept_requests WHERE action_id = NEW.id;
    END;
    "#,
];

/// The first schema version whose `audit_events` has the `agent` column.
const AGENT_VERSION: i64 = 10;

/// The first schema version with the table `kept_requests` (a write's request at rest).
#[cfg(test)]
const KEPT_REQUESTS_VERSION: i64 = 11;

/// For a file older than [`AGENT_VERSION`], opened by `open_reader`: a temporary view named
/// like the table (unqualified names find the `temp` schema first, SQLite's name resolution),
/// so the readers' one column list reads such a file too, with no agent. A temporary view lives
/// in the connection's own memory: the file is not written.
const AGENT_SHIM: &str =
    "CREATE TEMP VIEW audit_events AS SELECT *, NULL AS agent FROM main.audit_events";

/// Maps an error of the first query on a file to "not SQLite" or "damaged or truncated" when
/// SQLite says it cannot read the file: a file that starts with the SQLite header is a
/// database that was cut short or damaged ([`StoreError::DamagedFile`], with what its header
/// says about its length), any other file is not a SQLite database at all
/// ([`StoreError::NotSqlite`]).
fn first_query_error(path: &Path, e: rusqlite::Error) -> StoreError {
    let reason = e.to_string();
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) | Some(rusqlite::ErrorCode::DatabaseCorrupt) => {
            match header_findings(path) {
                Some(findings) => StoreError::DamagedFile {
                    path: path.to_owned(),
                    reason: if findings.is_empty() {
                        format!("SQLite says: {reason}")
                    } else {
                        format!("{findings} (SQLite says: {reason})")
                    },
                },
                None => StoreError::NotSqlite {
                    path: path.to_owned(),
                    reason,
                },
            }
        }
        _ => StoreError::Sqlite(format!("{}: {reason}", path.display())),
    }
}

/// The first 16 bytes of every SQLite database file (the SQLite file format, §1.3 "The
/// Database Header").
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// The length of the SQLite database header (the file format, §1.3).
const SQLITE_HEADER_BYTES: usize = 100;

/// What the database header at the start of `path` says against the file's length: `None` when
/// the file does not start with [`SQLITE_MAGIC`] (it is no SQLite database; a shorter file
/// that is the start of it counts as a cut header), else one line that is empty when the
/// header and the length agree (the damage is elsewhere). Reads the file format's §1.3
/// fields: the page size (offset 16, 2 bytes, `1` meaning 65,536), and the database size in
/// pages (offset 28, 4 bytes), which counts only while the version-valid-for number (offset 92)
/// equals the change counter (offset 24).
fn header_findings(path: &Path) -> Option<String> {
    use std::io::Read as _;
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut header = Vec::with_capacity(SQLITE_HEADER_BYTES);
    file.by_ref()
        .take(SQLITE_HEADER_BYTES as u64)
        .read_to_end(&mut header)
        .ok()?;
    if !header.is_empty() && header.len() < SQLITE_MAGIC.len() && SQLITE_MAGIC.starts_with(&header)
    {
        return Some(format!(
            "it has {len} bytes, only the start of the SQLite header"
        ));
    }
    if !header.starts_with(SQLITE_MAGIC) {
        return None;
    }
    if header.len() < SQLITE_HEADER_BYTES {
        return Some(format!(
            "it has {len} bytes, fewer than the {SQLITE_HEADER_BYTES} of a SQLite database header"
        ));
    }
    let be32 = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let page_size = match u16::from_be_bytes([header[16], header[17]]) {
        1 => 65_536u64,
        n if n >= 512 && n.is_power_of_two() => u64::from(n),
        n => {
            return Some(format!(
                "its header gives {n} as the page size, which SQLite never writes"
            ))
        }
    };
    let pages = u64::from(be32(28));
    if pages > 0 && be32(24) == be32(92) && pages * page_size > len {
        return Some(format!(
            "it has {len} bytes, but its header gives {pages} pages of {page_size} bytes ({} bytes)",
            pages * page_size
        ));
    }
    if len % page_size != 0 {
        return Some(format!(
            "it has {len} bytes, not a whole number of {page_size}-byte pages"
        ));
    }
    Some(String::new())
}

/// What [`identify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Identity {
    /// An empty SQLite file (no tables, no application id): may be initialised.
    Empty,
    /// A backstop database at this schema version.
    Backstop(i64),
}

/// Checks that `conn` is an empty file or a backstop database this build can read.
pub(crate) fn identify(conn: &Connection, path: &Path) -> Result<Identity, StoreError> {
    let application_id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| first_query_error(path, e))?;
    let user_version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| first_query_error(path, e))?;
    if application_id == 0 && user_version == 0 {
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .map_err(|e| first_query_error(path, e))?;
        if tables == 0 {
            return Ok(Identity::Empty);
        }
    }
    if application_id != APPLICATION_ID {
        return Err(StoreError::Foreign {
            path: path.to_owned(),
            application_id,
            expected: APPLICATION_ID,
        });
    }
    if user_version > SCHEMA_VERSION {
        return Err(StoreError::TooNew {
            path: path.to_owned(),
            found: user_version,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(Identity::Backstop(user_version))
}

/// Brings a writable connection to [`SCHEMA_VERSION`], one transaction per migration.
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let from = match identify(conn, path)? {
        Identity::Empty => 0,
        Identity::Backstop(v) => v,
    };
    if from as usize >= MIGRATIONS.len() {
        return Ok(());
    }
    // A migration may rebuild a referenced table; foreign keys cannot be switched inside a
    // transaction, so they are off while migrating and every migration checks them itself.
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    let result = run_migrations(conn, from as usize);
    conn.pragma_update(None, "foreign_keys", "ON")?;
    result.map_err(|e| match e {
        StoreError::Sqlite(reason) => StoreError::Sqlite(format!(
            "{}: migrating the schema: {reason}",
            path.display()
        )),
        other => other,
    })
}

fn run_migrations(conn: &mut Connection, from: usize) -> Result<(), StoreError> {
    for (version, script) in MIGRATIONS.iter().enumerate().skip(from) {
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        tx.execute_batch(script)?;
        let broken: i64 =
            tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
                r.get(0)
            })?;
        if broken > 0 {
            return Err(StoreError::Sqlite(format!(
                "migration to version {}: {broken} rows would break a foreign key",
                version + 1
            )));
        }
        tx.pragma_update(None, "application_id", APPLICATION_ID)?;
        tx.pragma_update(None, "user_version", version as i64 + 1)?;
        tx.commit()?;
    }
    Ok(())
}

/// A directory is not a database file: say so instead of SQLite's "unable to open".
fn refuse_directory(path: &Path) -> Result<(), StoreError> {
    if path.is_dir() {
        return Err(StoreError::Io {
            place: path.display().to_string(),
            reason: "is a directory, not a database file".to_owned(),
        });
    }
    Ok(())
}

/// Opens the writer connection: creates the file when `create`, then WAL with
/// `synchronous=FULL` (every commit is fsync'd), foreign keys on, migrated.
pub(crate) fn open_writer(path: &Path, create: bool) -> Result<Connection, StoreError> {
    if !create && !path.exists() {
        return Err(StoreError::Missing {
            path: path.to_owned(),
        });
    }
    refuse_directory(path)?;
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let mut conn = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::Sqlite(format!("{}: {e}", path.display())))?;
    // Identify before changing anything, so a foreign file is left untouched.
    identify(&conn, path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    quick_check(&conn, path)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(|e| first_query_error(path, e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Sqlite(format!(
            "{}: could not switch to WAL (journal_mode is {mode})",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    writer_tuning(&conn)?;
    stable_plans(&conn)?;
    migrate(&mut conn, path)?;
    Ok(conn)
}

/// The writer's page cache: 64 MiB (`PRAGMA cache_size` in KiB when negative). A group commit of
/// [`super::MAX_BATCH`] operations dirties a few thousand pages; with SQLite's default 2 MiB
/// cache they spilled into the WAL in the middle of the transaction (`pagerStress`) and were
/// read back with `pread`. Pages are allocated as they are used, so an idle store holds little.
pub(crate) const WRITER_CACHE_KIB: i64 = 64 * 1024;

/// Pages of WAL after which a commit checkpoints (`PRAGMA wal_autocheckpoint`): 16,384 pages,
/// 64 MiB with 4 KiB pages, instead of SQLite's 1,000. The same leaf pages (the log's right
/// edge, the indexes' hot pages) are rewritten by every group commit; a checkpoint copies each
/// page once however many frames it has, so fewer checkpoints copy far fewer pages. The WAL
/// file keeps its largest size between checkpoints (it is reused from its start, not
/// truncated): up to ≈ 64 MiB beside the database.
pub(crate) const WRITER_AUTOCHECKPOINT_PAGES: i64 = 16_384;

/// Settings of the writer connection that only change how fast it writes, never what:
/// statement journals and savepoint sub-journals in memory (`temp_store = MEMORY`; every
/// operation of a group runs in its own savepoint, and a file sub-journal cost a `pwrite` for
/// each page an operation touched first), [`WRITER_CACHE_KIB`] and
/// [`WRITER_AUTOCHECKPOINT_PAGES`]. Durability is unchanged: WAL, `synchronous = FULL`.
fn writer_tuning(conn: &Connection) -> Result<(), StoreError> {
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
    conn.pragma_update(None, "wal_autocheckpoint", WRITER_AUTOCHECKPOINT_PAGES)?;
    Ok(())
}

/// Turns on SQLite's query planner stability guarantee (`SQLITE_DBCONFIG_ENABLE_QPSG`): a
/// statement keeps the plan it was prepared with whatever values are bound. Without it, SQLite
/// (3.54) marks a statement whose plan looked at a bound value (e.g. `a.id = ?1` in a join) to
/// be re-prepared when that value is rebound, and the statement cache's `clear_bindings` on
/// every return then re-parses such a statement on every use.
fn stable_plans(conn: &Connection) -> Result<(), StoreError> {
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    Ok(())
}

/// Runs `PRAGMA quick_check` (SQLite's O(N) structural check: pages, records, index
/// entries; not UNIQUE constraints nor index contents) so that a damaged
/// file is refused when the store opens, not found out by the first request that touches the
/// damaged page.
///
/// # Errors
/// [`StoreError::Damaged`] with SQLite's first findings (at most 5 lines) when the check
/// reports anything but `ok`, or when the check itself cannot run.
pub(crate) fn quick_check(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let damaged = |reason: String| StoreError::Damaged {
        path: path.to_owned(),
        reason,
    };
    let mut stmt = conn
        .prepare("PRAGMA quick_check(5)")
        .map_err(|e| damaged(e.to_string()))?;
    let findings: Vec<String> = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .and_then(|rows| rows.collect::<Result<_, _>>())
        .map_err(|e| damaged(e.to_string()))?;
    if findings.len() == 1 && findings[0] == "ok" {
        return Ok(());
    }
    Err(damaged(findings.join("; ")))
}

/// Opens a read connection on an existing backstop database (never creates a file): one at
/// [`SCHEMA_VERSION`], or at an older version from [`OLDEST_READABLE_VERSION`] on, which reads
/// the same (it is left at its version: a reader never migrates).
///
/// With `read_only`, SQLite is asked for a read-only handle (the audit commands use this so
/// that checking evidence does not write to it). Reading a database in WAL mode needs its
/// `-shm` file, which SQLite creates beside it; where it cannot (a read-only directory or file
/// system) and no `-wal` file holds changes (none, or an empty one: everything committed is
/// in the database file), the file is opened again as `immutable=1` (SQLite URI parameter: no
/// locks, no `-shm`, no `-wal`). Nothing can be writing it meanwhile: a writer needs the same
/// files.
///
/// # Errors
/// [`StoreError::Missing`], [`StoreError::NotSqlite`], [`StoreError::DamagedFile`],
/// [`StoreError::Foreign`], [`StoreError::TooNew`], [`StoreError::TooOld`] (older than
/// [`OLDEST_READABLE_VERSION`]); [`StoreError::ReadOnlyWal`] when the `-shm` file cannot be had and the `-wal` file is not
/// empty (the database file alone could lack committed events).
pub(crate) fn open_reader(path: &Path, read_only: bool) -> Result<Connection, StoreError> {
    if !path.exists() {
        return Err(StoreError::Missing {
            path: path.to_owned(),
        });
    }
    refuse_directory(path)?;
    let flags = if read_only {
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX
    } else {
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX
    };
    let conn = match connect(path.as_os_str(), flags) {
        Ok(conn) => conn,
        Err(e) if read_only && wal_index_unavailable(path, &e) => open_immutable(path, e)?,
        Err(Failed::Open(e)) => return Err(StoreError::Sqlite(format!("{}: {e}", path.display()))),
        Err(Failed::Query(e)) => return Err(first_query_error(path, e)),
    };
    stable_plans(&conn)?;
    match identify(&conn, path)? {
        Identity::Backstop(v) if v >= AGENT_VERSION => Ok(conn),
        Identity::Backstop(v) if v >= OLDEST_READABLE_VERSION => {
            conn.execute_batch(AGENT_SHIM)
                .map_err(|e| StoreError::Sqlite(format!("{}: {e}", path.display())))?;
            Ok(conn)
        }
        Identity::Backstop(v) => Err(StoreError::TooOld {
            path: path.to_owned(),
            found: v,
            oldest: OLDEST_READABLE_VERSION,
        }),
        Identity::Empty => Err(StoreError::Foreign {
            path: path.to_owned(),
            application_id: 0,
            expected: APPLICATION_ID,
        }),
    }
}

/// Where [`connect`] failed.
enum Failed {
    /// Opening the handle.
    Open(rusqlite::Error),
    /// The first query (where SQLite reads the file, and its `-wal` and `-shm`).
    Query(rusqlite::Error),
}

/// Opens `name` (a path, or a `file:` URI with [`OpenFlags::SQLITE_OPEN_URI`]) and reads the
/// header once, so that a file SQLite cannot read fails here.
fn connect(name: &std::ffi::OsStr, flags: OpenFlags) -> Result<Connection, Failed> {
    let conn = Connection::open_with_flags(name, flags).map_err(Failed::Open)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(Failed::Open)?;
    conn.query_row("PRAGMA application_id", [], |r| r.get::<_, i64>(0))
        .map_err(Failed::Query)?;
    Ok(conn)
}

/// Whether a read-only open failed because SQLite could not open or create the `-shm` (or
/// `-wal`) file of a database in WAL mode: SQLite says "unable to open database file"
/// (`SQLITE_CANTOPEN`) or "attempt to write a readonly database" (`SQLITE_READONLY`, e.g.
/// `SQLITE_READONLY_CANTINIT`) while the file's header says WAL (bytes 18 and 19 are 2, the
/// SQLite file format §1.3).
fn wal_index_unavailable(path: &Path, failed: &Failed) -> bool {
    let (Failed::Open(e) | Failed::Query(e)) = failed;
    let beside = matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::ReadOnly)
    );
    let mut header = [0u8; 20];
    let wal_mode = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut header))
        .is_ok()
        && header[18] == 2
        && header[19] == 2;
    beside && wal_mode
}

/// The `-wal` file beside `path`.
fn wal_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-wal");
    std::path::PathBuf::from(name)
}

/// `path` as a SQLite `file:` URI opening it read-only and `immutable=1`: every byte outside
/// the URI's unreserved characters and `/` is percent-encoded, so `?`, `#` and `%` in a name
/// stay part of it.
fn immutable_uri(path: &Path) -> std::ffi::OsString {
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_encoded_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'.' | b'_' | b'~') {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri.push_str("?mode=ro&immutable=1");
    uri.into()
}

/// Opens `path` as immutable after the plain read-only open failed with `first` (see
/// `open_reader`), when its `-wal` file is absent or empty; otherwise refuses with
/// [`StoreError::ReadOnlyWal`].
fn open_immutable(path: &Path, first: Failed) -> Result<Connection, StoreError> {
    let (Failed::Open(first) | Failed::Query(first)) = first;
    match std::fs::metadata(wal_path(path)) {
        Ok(meta) if meta.len() > 0 => {
            return Err(StoreError::ReadOnlyWal {
                path: path.to_owned(),
                wal_bytes: meta.len(),
                reason: first.to_string(),
            })
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // Whether it holds changes cannot be told: the first error stands.
        Err(_) => return Err(StoreError::Sqlite(format!("{}: {first}", path.display()))),
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    connect(&immutable_uri(path), flags).map_err(|failed| match failed {
        Failed::Open(e) => StoreError::Sqlite(format!("{}: {e}", path.display())),
        Failed::Query(e) => first_query_error(path, e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::OptionalExtension;

    /// A version-1 database with one task, one write action (with key), one attempt and one
    /// escalation, as an older build left it.
    fn version_1(path: &Path) {
        let conn = Connection::open(path).expect("create");
        conn.execute_batch(MIGRATIONS[0]).expect("version 1 schema");
        conn.pragma_update(None, "application_id", APPLICATION_ID)
            .expect("id");
        conn.pragma_update(None, "user_version", 1)
            .expect("version");
        conn.execute_batch(
            "INSERT INTO tasks (id, agent, priority, created_at_ms) VALUES ('t1', 'a', 'normal', 1);
             INSERT INTO actions (id, task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, outcome, created_at_ms, updated_at_ms)
             VALUES (7, 't1', 'a', 'p', 'POST', '/v1/x', 'idempotent_write', 'd', 'key-7',
                 'finished', 'escalated', 1, 2);
             INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (7, 1, 'finished', 1);
             INSERT INTO escalations (id, action_id, case_file, state, opened_at_ms)
             VALUES (3, 7, '{}', 'open', 2);",
        )
        .expect("rows");
    }

    #[test]
    fn the_writer_keeps_sub_journals_in_memory_a_large_cache_and_rare_checkpoints() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = open_writer(&dir.path().join("w.db"), true).expect("writer");
        let pragma = |name: &str| -> i64 {
            conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))
                .expect(name)
        };
        // 2 = MEMORY (0 = default, 1 = FILE).
        assert_eq!(pragma("temp_store"), 2);
        assert_eq!(pragma("cache_size"), -WRITER_CACHE_KIB);
        assert_eq!(pragma("wal_autocheckpoint"), WRITER_AUTOCHECKPOINT_PAGES);
        // Durability is not traded for it: 2 = FULL.
        assert_eq!(pragma("synchronous"), 2);
        // A reader keeps SQLite's defaults (its cache is per connection, and readers are pooled).
        let reader = open_reader(&dir.path().join("w.db"), true).expect("reader");
        let cache: i64 = reader
            .query_row("PRAGMA cache_size", [], |r| r.get(0))
            .expect("reader cache");
        assert_ne!(cache, -WRITER_CACHE_KIB);
    }

    #[test]
    fn version_1_database_is_upgraded_in_place_keeping_its_rows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("old.db");
        version_1(&path);
        let conn = open_writer(&path, false).expect("migrated");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        let key: Option<String> = conn
            .query_row(
                "SELECT idempotency_key FROM actions WHERE id = 7",
                [],
                |r| r.get(0),
            )
            .expect("action kept");
        assert_eq!(key.as_deref(), Some("key-7"));
        let note: Option<String> = conn
            .query_row("SELECT note FROM escalations WHERE id = 3", [], |r| {
                r.get(0)
            })
            .expect("escalation kept with a note column");
        assert_eq!(note, None);
        // Keys are optional now (reads), still unique per agent where set.
        conn.execute_batch(
            "INSERT INTO actions (task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
             VALUES ('t1', 'a', 'p', 'GET', '/v1/x', 'read', 'd', NULL, 'requested', 3, 3),
                    ('t1', 'a', 'p', 'GET', '/v1/x', 'read', 'd', NULL, 'requested', 3, 3);",
        )
        .expect("two reads without a key");
        let duplicate = conn.execute_batch(
            "INSERT INTO actions (task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
             VALUES ('t1', 'a', 'p', 'POST', '/v1/x', 'idempotent_write', 'e', 'key-7',
                 'requested', 3, 3);",
        );
        assert!(duplicate.is_err(), "a write key stays unique per agent");
        // Foreign keys still hold after the rebuild.
        let dangling = conn.execute_batch(
            "INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (999, 1, 'sent', 1);",
        );
        assert!(dangling.is_err(), "attempts still reference actions");
        let fk: i64 = conn
            .query_row("PRAGMA foreign_keys", [], |r| r.get(0))
            .expect("pragma");
        assert_eq!(fk, 1);
    }

    /// A version-3 database (tasks keyed by id alone) with one task of agent `alice`, one
    /// action and one waiting retry, as the previous build left it.
    fn version_3(path: &Path) {
        let mut conn = Connection::open(path).expect("create");
        conn.pragma_update(None, "foreign_keys", "OFF")
            .expect("fk off");
        run_migrations_to(&mut conn, 3);
        conn.execute_batch(
            "INSERT INTO tasks (id, agent, priority, deadline_ms, created_at_ms)
                 VALUES ('shared-1', 'alice', 'interactive', 99, 1);
             INSERT INTO actions (id, task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
             VALUES (5, 'shared-1', 'alice', 'p', 'POST', '/v1/x', 'idempotent_write', 'd',
                 'key-5', 'waiting', 1, 2);
             INSERT INTO scheduled_retries (job_id, action_id, due_at_ms) VALUES (1, 5, 10);",
        )
        .expect("rows");
    }

    fn run_migrations_to(conn: &mut Connection, version: usize) {
        for (i, script) in MIGRATIONS.iter().enumerate().take(version) {
            conn.execute_batch(script).expect("older schema");
            conn.pragma_update(None, "user_version", i as i64 + 1)
                .expect("version");
        }
        conn.pragma_update(None, "application_id", APPLICATION_ID)
            .expect("id");
    }

    #[test]
    fn version_3_database_is_upgraded_in_place_to_tasks_keyed_by_agent_and_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v3.db");
        version_3(&path);
        let conn = open_writer(&path, false).expect("migrated");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        let task = crate::sqlite::rows::task(&conn, "alice", "shared-1")
            .expect("read")
            .expect("alice's task kept");
        assert_eq!(task.agent, "alice");
        assert_eq!(task.priority, crate::model::Priority::Interactive);
        assert_eq!(task.deadline.map(|d| d.as_millisecond()), Some(99));
        let action: (String, String) = conn
            .query_row("SELECT task_id, agent FROM actions WHERE id = 5", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("action kept");
        assert_eq!(action, ("shared-1".to_owned(), "alice".to_owned()));
        let retries: i64 = conn
            .query_row("SELECT count(*) FROM scheduled_retries", [], |r| r.get(0))
            .expect("retries");
        assert_eq!(retries, 1);
        // Another agent may now open the same task id ...
        conn.execute_batch(
            "INSERT INTO tasks (id, agent, priority, created_at_ms)
                 VALUES ('shared-1', 'bob', 'normal', 3);",
        )
        .expect("bob's task with the same id");
        // ... but an action must name a task of its own agent.
        let orphan = conn.execute_batch(
            "INSERT INTO actions (task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
             VALUES ('shared-1', 'carol', 'p', 'GET', '/v1/x', 'read', 'd', NULL,
                 'requested', 3, 3);",
        );
        assert!(orphan.is_err(), "actions reference tasks by (agent, id)");
        let dangling = conn.execute_batch(
            "INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (999, 1, 'sent', 1);",
        );
        assert!(dangling.is_err(), "attempts still reference actions");
    }

    /// A version-4 database with one finished attempt (no boundary or headers columns) and one
    /// sealed `action_result` event, as the previous build left it.
    fn version_4(path: &Path) -> crate::audit::AuditEvent {
        let mut conn = Connection::open(path).expect("create");
        conn.pragma_update(None, "foreign_keys", "OFF")
            .expect("fk off");
        run_migrations_to(&mut conn, 4);
        let mut event = crate::audit::AuditEvent::new("action_result", "2026-01-01T00:00:01.000Z");
        event.action = Some(5);
        event.attempt = Some(1);
        event.status = Some(429);
        event.boundary = Some("2026-01-01T00:00:08.000Z".to_owned());
        crate::audit::Chain::genesis().seal(&mut event);
        conn.execute_batch(
            "INSERT INTO tasks (agent, id, priority, created_at_ms) VALUES ('alice', 't', 'normal', 1);
             INSERT INTO actions (id, task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
             VALUES (5, 't', 'alice', 'p', 'POST', '/v1/x', 'idempotent_write', 'd', 'key-5',
                 'attempted', 1, 2);
             INSERT INTO attempts (action_id, n, state, status, disposition, started_at_ms,
                 finished_at_ms) VALUES (5, 1, 'finished', 429, 'rate_limited', 1, 1000);",
        )
        .expect("rows");
        conn.execute(
            "INSERT INTO audit_events (seq, at, kind, action, attempt, status, boundary, prev, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            rusqlite::params![
                1,
                event.at,
                event.kind,
                event.action,
                event.attempt,
                event.status,
                event.boundary,
                event.prev,
                event.hash
            ],
        )
        .expect("event");
        event
    }

    #[test]
    fn version_4_database_is_upgraded_keeping_attempts_and_a_verifiable_chain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v4.db");
        let old_event = version_4(&path);
        let conn = open_writer(&path, false).expect("migrated");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        let attempts =
            crate::sqlite::rows::attempts(&conn, crate::model::ActionId(5)).expect("attempts read");
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].status, Some(429));
        assert_eq!(
            attempts[0].boundary, None,
            "nothing is invented for an old attempt"
        );
        assert!(attempts[0].signal_headers.is_empty());
        let events = crate::sqlite::rows::audit_events(&conn, 0, 10).expect("events read");
        assert_eq!(events, vec![old_event]);
        assert_eq!(events[0].signal_headers, None);
        assert!(matches!(
            crate::audit::verify_events(&events, None),
            crate::audit::Verdict::Intact { count: 1, .. }
        ));
        // The new columns take values.
        conn.execute_batch(
            "UPDATE attempts SET boundary = 'unknown', signal_headers = '[[\"retry-after\",\"x\"]]';",
        )
        .expect("new columns");
        let attempts =
            crate::sqlite::rows::attempts(&conn, crate::model::ActionId(5)).expect("attempts read");
        assert_eq!(attempts[0].boundary, Some(crate::model::Boundary::Unknown));
        assert_eq!(
            attempts[0].signal_headers,
            vec![("retry-after".to_owned(), "x".to_owned())]
        );
    }

    /// A database left at schema `version` holding one task and one action `action` (key
    /// `key-<action>`), opened by the current writer: migrated to [`SCHEMA_VERSION`] (checked).
    fn upgraded_with_one_action(dir: &Path, version: usize, action: i64) -> Connection {
        let path = dir.join(format!("v{version}.db"));
        {
            let mut conn = Connection::open(&path).expect("create");
            conn.pragma_update(None, "foreign_keys", "OFF")
                .expect("fk off");
            run_migrations_to(&mut conn, version);
            conn.execute(
                "INSERT INTO tasks (agent, id, priority, created_at_ms) VALUES ('alice', 't', 'normal', 1)",
                [],
            )
            .expect("task");
            conn.execute(
                "INSERT INTO actions (id, task_id, agent, provider, method, route, request_class,
                     payload_digest, idempotency_key, state, created_at_ms, updated_at_ms)
                 VALUES (?1, 't', 'alice', 'p', 'POST', '/v1/x', 'idempotent_write', 'd', ?2,
                     'attempted', 1, 2)",
                rusqlite::params![action, format!("key-{action}")],
            )
            .expect("action");
        }
        let conn = open_writer(&path, false).expect("migrated");
        let current: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(current, SCHEMA_VERSION);
        conn
    }

    #[test]
    fn version_5_database_is_upgraded_keeping_actions_without_inventing_their_new_facts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = upgraded_with_one_action(dir.path(), 5, 5);
        let action = crate::sqlite::rows::action(&conn, crate::model::ActionId(5))
            .expect("action read")
            .expect("action kept");
        assert_eq!(action.idempotency_key, "key-5");
        assert_eq!(action.desired_outcome, None, "nothing is invented");
        assert_eq!(action.fingerprint, None, "nothing is invented");
        // The new columns take values.
        conn.execute_batch(
            "UPDATE actions SET desired_outcome = 'pay invoice 7', fingerprint = 'abc' WHERE id = 5;",
        )
        .expect("new columns");
        let action = crate::sqlite::rows::action(&conn, crate::model::ActionId(5))
            .expect("action read")
            .expect("action kept");
        assert_eq!(action.desired_outcome.as_deref(), Some("pay invoice 7"));
        assert_eq!(action.fingerprint.as_deref(), Some("abc"));
    }

    #[test]
    fn version_6_database_is_upgraded_keeping_actions_without_a_target_and_their_keys() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = upgraded_with_one_action(dir.path(), 6, 6);
        let action = crate::sqlite::rows::action(&conn, crate::model::ActionId(6))
            .expect("action read")
            .expect("action kept");
        assert_eq!(action.idempotency_key, "key-6");
        let target: Option<String> = conn
            .query_row("SELECT target_digest FROM actions WHERE id = 6", [], |r| {
                r.get(0)
            })
            .expect("target column");
        assert_eq!(target, None, "nothing is invented");
        conn.execute_batch("UPDATE actions SET target_digest = 'abc' WHERE id = 6;")
            .expect("new column");
    }

    /// A version-7 database made by the real scripts, holding a task, an action with a sent
    /// and a finished attempt, and a chain of five sealed events whose `prev` and `hash` are
    /// hex text, as the previous build wrote them. Returns the events.
    fn version_7(path: &Path) -> Vec<crate::audit::AuditEvent> {
        use crate::audit::{AuditEvent, Chain};
        let mut conn = Connection::open(path).expect("create");
        conn.pragma_update(None, "foreign_keys", "OFF")
            .expect("fk off");
        run_migrations_to(&mut conn, 7);
        conn.execute_batch(
            "INSERT INTO tasks (agent, id, priority, created_at_ms) VALUES ('alice', 't', 'normal', 1);
             INSERT INTO actions (id, task_id, agent, provider, method, route, request_class,
                 payload_digest, idempotency_key, state, created_at_ms, updated_at_ms,
                 target_digest)
             VALUES (5, 't', 'alice', 'p', 'POST', '/v1/x', 'idempotent_write', 'd', 'key-5',
                 'attempted', 1, 2, 'abc');
             INSERT INTO attempts (action_id, n, state, status, disposition, started_at_ms,
                 finished_at_ms, boundary, signal_headers)
             VALUES (5, 1, 'finished', 429, 'rate_limited', 1, 1000, 'unknown',
                 '[[\"retry-after\",\"7\"]]');
             INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (5, 2, 'sent', 8000);",
        )
        .expect("rows");
        let mut chain = Chain::genesis();
        let mut events = Vec::new();
        for (i, kind) in [
            "task_opened",
            "action_requested",
            "action_sent",
            "action_result",
            "action_sent",
        ]
        .into_iter()
        .enumerate()
        {
            let mut event = AuditEvent::new(kind, &format!("2026-01-01T00:00:0{i}.000Z"));
            event.task = Some("t".to_owned());
            if i > 0 {
                event.action = Some(5);
            }
            if kind == "action_requested" {
                event.idempotency_key = Some("key-5".to_owned());
                event.payload_digest = Some("d".to_owned());
            }
            if kind == "action_result" {
                event.attempt = Some(1);
                event.status = Some(429);
                event.boundary = Some("unknown".to_owned());
                event.signal_headers = Some(vec![("retry-after".to_owned(), "7".to_owned())]);
            }
            chain.seal(&mut event);
            conn.execute(
                "INSERT INTO audit_events (seq, at, kind, task, action, attempt, status,
                     boundary, idempotency_key, payload_digest, signal_headers, prev, hash)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
                rusqlite::params![
                    event.seq as i64,
                    event.at,
                    event.kind,
                    event.task,
                    event.action,
                    event.attempt,
                    event.status,
                    event.boundary,
                    event.idempotency_key,
                    event.payload_digest,
                    event
                        .signal_headers
                        .as_ref()
                        .map(|h| serde_json::to_string(h).expect("json")),
                    event.prev,
                    event.hash
                ],
            )
            .expect("event");
            events.push(event);
        }
        let stored: String = conn
            .query_row(
                "SELECT typeof(hash) FROM audit_events WHERE seq = 5",
                [],
                |r| r.get(0),
            )
            .expect("type");
        assert_eq!(stored, "text", "version 7 keeps the digests as hex text");
        events
    }

    #[test]
    fn version_7_database_is_upgraded_keeping_a_verifiable_chain_and_its_head() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v7.db");
        let old_events = version_7(&path);
        let old_head = crate::audit::ChainHead {
            seq: 5,
            hash: old_events[4].hash.clone(),
        };
        {
            let conn = open_writer(&path, false).expect("migrated");
            let version: i64 = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .expect("version");
            assert_eq!(version, SCHEMA_VERSION);
            // The digests are stored as their 32 bytes now.
            let digests: Vec<(String, i64, String, i64)> = conn
                .prepare(
                    "SELECT typeof(prev), length(prev), typeof(hash), length(hash) \
                     FROM audit_events ORDER BY seq",
                )
                .expect("prepare")
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .expect("query")
                .collect::<Result<_, _>>()
                .expect("rows");
            assert_eq!(digests.len(), 5);
            for digest in digests {
                assert_eq!(digest, ("blob".to_owned(), 32, "blob".to_owned(), 32));
            }
            // Every member reads back as before, so every hash recomputes and links.
            let events = crate::sqlite::rows::audit_events(&conn, 0, 10).expect("events read");
            assert_eq!(events, old_events);
            assert_eq!(
                super::super::verify_connection(&conn, Some(&old_head.hash)).expect("verify"),
                crate::audit::Verdict::Intact {
                    count: 5,
                    head: Some(old_head.clone()),
                }
            );
            assert_eq!(
                crate::sqlite::rows::audit_head(&conn).expect("head"),
                Some(old_head.clone())
            );
            // attempts lives in its primary key's b-tree, with its partial index, rows kept.
            let attempts_sql: String = conn
                .query_row(
                    "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'attempts'",
                    [],
                    |r| r.get(0),
                )
                .expect("attempts table");
            assert!(attempts_sql.ends_with("WITHOUT ROWID"), "{attempts_sql}");
            let indexes: Vec<String> = conn
                .prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'index' \
                     AND tbl_name = 'attempts' ORDER BY name",
                )
                .expect("prepare")
                .query_map([], |r| r.get(0))
                .expect("query")
                .collect::<Result<_, _>>()
                .expect("rows");
            assert_eq!(indexes, vec!["attempts_unfinished".to_owned()]);
            let attempts = crate::sqlite::rows::attempts(&conn, crate::model::ActionId(5))
                .expect("attempts read");
            assert_eq!(attempts.len(), 2);
            assert_eq!(attempts[0].boundary, Some(crate::model::Boundary::Unknown));
            assert_eq!(
                attempts[0].signal_headers,
                vec![("retry-after".to_owned(), "7".to_owned())]
            );
            let unfinished =
                crate::sqlite::rows::unfinished_attempts(&conn).expect("unfinished attempts");
            assert_eq!(unfinished.len(), 1);
            assert_eq!(unfinished[0].attempt, 2);
            let dangling = conn.execute_batch(
                "INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (999, 1, 'sent', 1);",
            );
            assert!(dangling.is_err(), "attempts still reference actions");
            let duplicate = conn.execute_batch(
                "INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (5, 2, 'sent', 1);",
            );
            assert!(duplicate.is_err(), "(action_id, n) is still the key");
        }
        // The store continues the migrated chain from its head.
        let store = crate::SqliteStore::open_existing(&path).expect("store on the migrated file");
        crate::Store::open_task(
            &store,
            crate::model::NewTask {
                id: "after".to_owned(),
                agent: "alice".to_owned(),
                priority: crate::model::Priority::Normal,
                deadline: None,
            },
            jiff::Timestamp::from_millisecond(1_767_225_610_000).expect("instant"),
        )
        .expect("open a task");
        match store.verify_audit(Some(&old_head.hash)).expect("verify") {
            crate::audit::Verdict::Intact {
                count: 6,
                head: Some(head),
            } => {
                assert_eq!(head.seq, 6);
                let events = crate::Store::audit_events(&store, 5, 1).expect("event 6");
                assert_eq!(events[0].prev, old_head.hash);
                assert_eq!(head.hash, events[0].hash);
            }
            other => panic!("expected six intact events, got {other:?}"),
        }
    }

    /// A version-8 database made by the real scripts: [`version_7`]'s rows and chain, taken to
    /// version 8 by its migration alone, as the previous build left it (no `actions_open`
    /// index). Returns the events.
    fn version_8(path: &Path) -> Vec<crate::audit::AuditEvent> {
        let events = version_7(path);
        let mut conn = Connection::open(path).expect("open");
        conn.pragma_update(None, "foreign_keys", "OFF")
            .expect("fk off");
        let tx = conn.transaction().expect("transaction");
        tx.execute_batch(MIGRATIONS[7]).expect("7 -> 8");
        tx.pragma_update(None, "user_version", 8).expect("version");
        tx.commit().expect("commit");
        events
    }

    /// The schema version and whether the `actions_open` index exists, read without migrating.
    fn version_and_open_index(path: &Path) -> (i64, bool) {
        let conn =
            Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open raw");
        let version = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        let index: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = 'actions_open'",
                [],
                |r| r.get(0),
            )
            .expect("index");
        (version, index == 1)
    }

    #[test]
    fn a_version_8_file_is_read_by_the_read_only_commands_as_it_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v8.db");
        let events = version_8(&path);
        assert_eq!(version_and_open_index(&path), (8, false));
        let head = crate::audit::ChainHead {
            seq: 5,
            hash: events[4].hash.clone(),
        };
        let reader = crate::AuditReader::open(&path).expect("a version 8 file is read");
        assert_eq!(
            reader.verify(Some(&head.hash)).expect("verify"),
            crate::audit::Verdict::Intact {
                count: 5,
                head: Some(head.clone()),
            }
        );
        assert_eq!(reader.head().expect("head"), Some(head));
        let mut export = Vec::new();
        assert_eq!(reader.export(0, &mut export).expect("export"), 5);
        let exported =
            crate::audit::parse_export("v8.db", std::str::from_utf8(&export).expect("utf-8"))
                .expect("parse");
        assert_eq!(exported, events);
        drop(reader);
        let records =
            crate::snapshots::RunRecordsReader::open(&path).expect("snapshot reader on version 8");
        assert_eq!(records.audit_events().expect("events"), events);
        assert!(records.task("alice", "t").expect("task").is_some());
        drop(records);
        // Reading neither migrated nor wrote the file.
        assert_eq!(version_and_open_index(&path), (8, false));
    }

    #[test]
    fn a_file_older_than_the_oldest_readable_version_is_refused_saying_how_to_upgrade_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v7.db");
        version_7(&path);
        let err = crate::AuditReader::open(&path).expect_err("version 7 is refused");
        assert_eq!(
            err,
            StoreError::TooOld {
                path: path.clone(),
                found: 7,
                oldest: OLDEST_READABLE_VERSION,
            }
        );
        let message = err.to_string();
        assert!(
            message.contains(&format!(
                "`backstop serve --config POLICY --store {}`",
                path.display()
            )),
            "{message}"
        );
        assert_eq!(version_and_open_index(&path).0, 7, "left as it was");
    }

    #[test]
    fn migrations_after_the_oldest_readable_version_only_add_indexes() {
        for (i, script) in MIGRATIONS
            .iter()
            .enumerate()
            .skip(OLDEST_READABLE_VERSION as usize)
        {
            for statement in script.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                assert!(
                    statement.starts_with("CREATE INDEX")
                        || statement.starts_with("CREATE UNIQUE INDEX")
                        || (i + 1 == AGENT_VERSION as usize
                            && statement == "ALTER TABLE audit_events ADD COLUMN agent TEXT")
                        || (i + 1 == KEPT_REQUESTS_VERSION as usize
                            && (statement.contains("kept_request") || statement == "END")),
                    "migration {i} -> {} changes what the read-only commands read \
                     (raise OLDEST_READABLE_VERSION to {}): {statement}",
                    i + 1,
                    i + 1
                );
            }
        }
    }

    #[test]
    fn version_7_digest_that_is_not_lower_case_hex_is_not_repaired_by_the_upgrade() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v7.db");
        version_7(&path);
        {
            // An edit the previous build's verify reported: seq 3's hash in capitals, and
            // seq 4's prev cut short.
            let conn = Connection::open(&path).expect("open raw");
            conn.execute_batch(
                "UPDATE audit_events SET hash = upper(hash) WHERE seq = 3;
                 UPDATE audit_events SET prev = substr(prev, 1, 60) WHERE seq = 4;",
            )
            .expect("tamper");
        }
        let conn = open_writer(&path, false).expect("migrated");
        let lengths: Vec<(String, i64)> = conn
            .prepare(
                "SELECT typeof(hash), length(hash) FROM audit_events WHERE seq = 3 \
                      UNION ALL SELECT typeof(prev), length(prev) FROM audit_events WHERE seq = 4",
            )
            .expect("prepare")
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            lengths,
            vec![("blob".to_owned(), 64), ("blob".to_owned(), 60)],
            "kept as their raw bytes"
        );
        match super::super::verify_connection(&conn, None).expect("verify") {
            crate::audit::Verdict::Broken(b) => {
                assert_eq!((b.seq, b.kind), (3, crate::audit::BreakKind::Altered));
                assert!(b.detail.contains("hash is 64 bytes"), "{}", b.detail);
            }
            other => panic!("the edit went unreported: {other:?}"),
        }
    }

    #[test]
    fn start_up_scans_read_the_open_actions_index_not_the_whole_table() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = open_writer(&dir.path().join("b.db"), true).expect("open");
        for sql in [
            crate::sqlite::rows::UNSENT_WRITES_SQL,
            crate::sqlite::rows::UNSENT_READS_SQL,
            crate::sqlite::rows::ACTIONS_BETWEEN_ATTEMPTS_SQL,
        ] {
            let mut stmt = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("plan");
            let plan: Vec<String> = stmt
                .query_map([], |r| r.get::<_, String>(3))
                .expect("query")
                .collect::<Result<_, _>>()
                .expect("rows");
            let actions = plan
                .iter()
                .find(|step| step.starts_with("SEARCH a ") || step.starts_with("SCAN a"))
                .unwrap_or_else(|| panic!("no step reads actions in {plan:?}"));
            assert!(
                actions.starts_with("SEARCH a USING") && actions.contains("INDEX actions_open"),
                "{sql}\nplan: {plan:?}"
            );
        }
    }

    #[test]
    fn a_cached_statement_is_not_reprepared_when_its_parameter_is_rebound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = open_writer(&dir.path().join("b.db"), true).expect("open");
        // The shape of the writer's per-action lookup: a join whose plan weighs `?1`.
        let sql = "SELECT a.id FROM actions a JOIN tasks t ON t.agent = a.agent \
                   AND t.id = a.task_id WHERE a.id = ?1";
        for id in 1..=3 {
            let mut stmt = conn.prepare_cached(sql).expect("prepare");
            let found: Option<i64> = stmt
                .query_row([id], |r| r.get(0))
                .optional()
                .expect("query");
            assert_eq!(found, None);
            assert_eq!(
                stmt.get_status(rusqlite::StatementStatus::RePrepare),
                0,
                "use {id} re-prepared the statement"
            );
        }
    }
}
