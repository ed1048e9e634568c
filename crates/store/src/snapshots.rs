//! Read-only access to what `backstop snapshots export` needs: the audit log and task records.
//!
//! Why a separate reader: exporting health snapshots is an offline, operator-side read of a
//! database that a running gateway may be writing. [`RunRecordsReader::open`] never creates,
//! migrates or writes a file: it first checks the file through [`AuditReader::open`] (a backstop
//! database this build reads, opened read-only), then keeps one more read-only connection
//! for task records. Both are plain SQLite readers, so a concurrent writer (WAL) is not blocked.

use std::path::Path;

use jiff::Timestamp;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use crate::audit::{parse_export, AuditEvent};
use crate::error::StoreError;
use crate::model::{Priority, TaskRecord};
use crate::sqlite::AuditReader;

/// A read-only view of one backstop database: audit events and tasks.
#[derive(Debug)]
pub struct RunRecordsReader {
    audit: AuditReader,
    conn: Connection,
    place: String,
}

impl RunRecordsReader {
    /// Opens `path` read-only (never creating it).
    ///
    /// # Errors
    /// As [`AuditReader::open`]: [`StoreError::Missing`], [`StoreError::NotSqlite`],
    /// [`StoreError::DamagedFile`], [`StoreError::Foreign`], [`StoreError::TooNew`],
    /// [`StoreError::TooOld`], or [`StoreError::Sqlite`] naming the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let audit = AuditReader::open(path)?;
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::Sqlite(format!("{}: {e}", path.display())))?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Ok(RunRecordsReader {
            audit,
            conn,
            place: path.display().to_string(),
        })
    }

    /// Every audit event, in `seq` order (held in memory: one export of the log).
    ///
    /// # Errors
    /// Storage errors, or [`StoreError::BadExportLine`] for an event that does not parse.
    pub fn audit_events(&self) -> Result<Vec<AuditEvent>, StoreError> {
        let mut buffer = Vec::new();
        self.audit.export(0, &mut buffer)?;
        let text = String::from_utf8(buffer).map_err(|e| StoreError::Corrupt {
            table: "audit_events",
            reason: format!("export is not UTF-8: {e}"),
        })?;
        parse_export(&self.place, &text)
    }

    /// Reads the task `id` of `agent` (task ids are namespaced per agent).
    ///
    /// # Errors
    /// Storage errors; [`StoreError::Corrupt`] for a stored priority or instant that cannot be
    /// read back.
    pub fn task(&self, agent: &str, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        let row = self
            .conn
            .prepare_cached(
                "SELECT id, agent, priority, deadline_ms, cancelled_at_ms FROM tasks \
                 WHERE agent = ?1 AND id = ?2",
            )?
            .query_row(params![agent, id], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                    r.get::<_, Option<i64>>(4)?,
                ))
            })
            .optional()?;
        row.map(|row| self.record(row)).transpose()
    }

    /// Reads every agent's task with this id, ordered by agent: the operator's view this
    /// offline reader serves (task ids are namespaced per agent, so there may be several).
    ///
    /// # Errors
    /// As [`RunRecordsReader::task`].
    pub fn tasks_of_every_agent(&self, id: &str) -> Result<Vec<TaskRecord>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT id, agent, priority, deadline_ms, cancelled_at_ms FROM tasks \
             WHERE id = ?1 ORDER BY agent",
        )?;
        let rows = stmt.query_map(params![id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Option<i64>>(3)?,
                r.get::<_, Option<i64>>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            out.push(self.record(row?)?);
        }
        Ok(out)
    }

    #[allow(clippy::type_complexity)]
    fn record(
        &self,
        (id, agent, priority, deadline, cancelled): (
            String,
            String,
            String,
            Option<i64>,
            Option<i64>,
        ),
    ) -> Result<TaskRecord, StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt {
            table: "tasks",
            reason,
        };
        let instant = |ms: Option<i64>| -> Result<Option<Timestamp>, StoreError> {
            ms.map(|ms| {
                Timestamp::from_millisecond(ms)
                    .map_err(|e| corrupt(format!("task {id:?}: instant {ms} ms: {e}")))
            })
            .transpose()
        };
        Ok(TaskRecord {
            priority: Priority::parse(&priority)
                .map_err(|e| corrupt(format!("task {id:?}: {e}")))?,
            deadline: instant(deadline)?,
            cancelled_at: instant(cancelled)?,
            id,
            agent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NewTask, SqliteStore, Store};

    #[test]
    fn reads_tasks_and_events_without_creating_or_writing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.db");
        assert!(matches!(
            RunRecordsReader::open(&path),
            Err(StoreError::Missing { .. })
        ));
        assert!(!path.exists(), "opening never creates the file");
        let deadline = Timestamp::from_millisecond(1_750_000_600_000).expect("t");
        {
            let store = SqliteStore::open(&path).expect("store");
            store
                .open_task(
                    NewTask {
                        id: "run-1".into(),
                        agent: "agent-a".into(),
                        priority: Priority::Interactive,
                        deadline: Some(deadline),
                    },
                    Timestamp::from_millisecond(1_750_000_000_000).expect("t"),
                )
                .expect("task");
        }
        let reader = RunRecordsReader::open(&path).expect("reader");
        let task = reader
            .task("agent-a", "run-1")
            .expect("read")
            .expect("task");
        assert_eq!(task.deadline, Some(deadline));
        assert_eq!(task.priority, Priority::Interactive);
        assert_eq!(reader.task("agent-b", "run-1").expect("read"), None);
        assert_eq!(reader.task("agent-a", "nope").expect("read"), None);
        assert_eq!(
            reader.tasks_of_every_agent("run-1").expect("read"),
            vec![task]
        );
        let events = reader.audit_events().expect("events");
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, "task_opened");
    }
}
