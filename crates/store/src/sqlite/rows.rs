//! Reading records from a connection (shared by the writer, the read pool and the audit reader).

use jiff::Timestamp;
use rusqlite::{params, Connection, OptionalExtension, Row, Statement};

use crate::audit::{push_lower_hex, AuditEvent, ChainHead, SealedDigests, DIGEST_BYTES};
use crate::error::StoreError;
use crate::model::{
    ActionId, ActionRecord, ActionState, AttemptRecord, AttemptState, Boundary, Disposition,
    DueRetry, EscalationId, EscalationRecord, EscalationState, JobId, KeptRequest, Outcome,
    Priority, ScopeRecord, StoredResponse, TaskRecord, UnfinishedAttempt,
};

/// Milliseconds since the Unix epoch, as stored.
pub(crate) fn ms(at: Timestamp) -> i64 {
    at.as_millisecond()
}

/// Decodes stored milliseconds.
pub(crate) fn from_ms(table: &'static str, v: i64) -> Result<Timestamp, StoreError> {
    Timestamp::from_millisecond(v).map_err(|e| StoreError::Corrupt {
        table,
        reason: format!("time {v} ms: {e}"),
    })
}

fn opt_ms(table: &'static str, v: Option<i64>) -> Result<Option<Timestamp>, StoreError> {
    v.map(|v| from_ms(table, v)).transpose()
}

fn corrupt(table: &'static str) -> impl Fn(StoreError) -> StoreError {
    move |e| StoreError::Corrupt {
        table,
        reason: e.to_string(),
    }
}

fn u64_of(table: &'static str, v: Option<i64>) -> Result<Option<u64>, StoreError> {
    v.map(|v| {
        u64::try_from(v).map_err(|_| StoreError::Corrupt {
            table,
            reason: format!("negative count {v}"),
        })
    })
    .transpose()
}

/// The query of [`task`].
pub(crate) const TASK: &str = "SELECT id, agent, priority, deadline_ms, cancelled_at_ms \
     FROM tasks WHERE agent = ?1 AND id = ?2";

/// The task `id` of `agent` (tasks are namespaced per agent).
pub(crate) fn task(
    conn: &Connection,
    agent: &str,
    id: &str,
) -> Result<Option<TaskRecord>, StoreError> {
    task_with(&mut *conn.prepare_cached(TASK)?, agent, id)
}

/// [`task`] with its statement ([`TASK`]) already prepared.
pub(crate) fn task_with(
    stmt: &mut Statement<'_>,
    agent: &str,
    id: &str,
) -> Result<Option<TaskRecord>, StoreError> {
    let row = stmt.query_row(params![agent, id], task_row).optional()?;
    row.map(task_record).transpose()
}

/// Every cancelled task, as `(agent, id)` pairs (one scan of the tasks, at start).
pub(crate) fn cancelled_tasks(conn: &Connection) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = conn.prepare("SELECT agent, id FROM tasks WHERE cancelled_at_ms IS NOT NULL")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Every agent's task with this id, ordered by agent (an operator's view).
pub(crate) fn tasks_with_id(conn: &Connection, id: &str) -> Result<Vec<TaskRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, agent, priority, deadline_ms, cancelled_at_ms FROM tasks \
         WHERE id = ?1 ORDER BY agent",
    )?;
    let rows = stmt.query_map(params![id], task_row)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(task_record(row?)?);
    }
    Ok(out)
}

type TaskRow = (String, String, String, Option<i64>, Option<i64>);

fn task_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<TaskRow> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

fn task_record(
    (id, agent, priority, deadline, cancelled): TaskRow,
) -> Result<TaskRecord, StoreError> {
    Ok(TaskRecord {
        id,
        agent,
        priority: Priority::parse(&priority).map_err(corrupt("tasks"))?,
        deadline: opt_ms("tasks", deadline)?,
        cancelled_at: opt_ms("tasks", cancelled)?,
    })
}

const ACTION_COLUMNS: &str = "id, task_id, agent, provider, method, route, request_class, \
     payload_digest, idempotency_key, external_reference, provider_operation_id, state, outcome, \
     outcome_context, response_status, response_headers, response_body, desired_outcome, \
     fingerprint";

struct RawAction {
    id: i64,
    task_id: String,
    agent: String,
    provider: String,
    method: String,
    route: String,
    request_class: String,
    payload_digest: String,
    idempotency_key: Option<String>,
    external_reference: Option<String>,
    provider_operation_id: Option<String>,
    state: String,
    outcome: Option<String>,
    outcome_context: Option<String>,
    response_status: Option<i64>,
    response_headers: Option<String>,
    response_body: Option<Vec<u8>>,
    desired_outcome: Option<String>,
    fingerprint: Option<String>,
}

fn raw_action(r: &Row<'_>) -> rusqlite::Result<RawAction> {
    Ok(RawAction {
        id: r.get(0)?,
        task_id: r.get(1)?,
        agent: r.get(2)?,
        provider: r.get(3)?,
        method: r.get(4)?,
        route: r.get(5)?,
        request_class: r.get(6)?,
        payload_digest: r.get(7)?,
        idempotency_key: r.get(8)?,
        external_reference: r.get(9)?,
        provider_operation_id: r.get(10)?,
        state: r.get(11)?,
        outcome: r.get(12)?,
        outcome_context: r.get(13)?,
        response_status: r.get(14)?,
        response_headers: r.get(15)?,
        response_body: r.get(16)?,
        desired_outcome: r.get(17)?,
        fingerprint: r.get(18)?,
    })
}

fn decode_action(raw: RawAction) -> Result<ActionRecord, StoreError> {
    let bad = |reason: String| StoreError::Corrupt {
        table: "actions",
        reason: format!("action {}: {reason}", raw.id),
    };
    let outcome_context = raw
        .outcome_context
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| bad(format!("outcome_context: {e}")))?;
    let response = match raw.response_status {
        None => None,
        Some(status) => Some(StoredResponse {
            status: u16::try_from(status).map_err(|_| bad(format!("status {status}")))?,
            headers: raw
                .response_headers
                .as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(|e| bad(format!("response_headers: {e}")))?
                .unwrap_or_default(),
            body: raw.response_body.clone().unwrap_or_default(),
        }),
    };
    Ok(ActionRecord {
        id: ActionId(raw.id),
        state: ActionState::parse(&raw.state).map_err(corrupt("actions"))?,
        outcome: raw
            .outcome
            .as_deref()
            .map(Outcome::parse)
            .transpose()
            .map_err(corrupt("actions"))?,
        outcome_context,
        response,
        task_id: raw.task_id,
        agent: raw.agent,
        provider: raw.provider,
        method: raw.method,
        route: raw.route,
        request_class: raw.request_class,
        payload_digest: raw.payload_digest,
        idempotency_key: raw.idempotency_key.unwrap_or_default(),
        external_reference: raw.external_reference,
        provider_operation_id: raw.provider_operation_id,
        desired_outcome: raw.desired_outcome,
        fingerprint: raw.fingerprint,
    })
}

/// The action lookup by id, built once from [`ACTION_COLUMNS`].
static SELECT_ACTION: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("SELECT {ACTION_COLUMNS} FROM actions WHERE id = ?1"));

pub(crate) fn action(conn: &Connection, id: ActionId) -> Result<Option<ActionRecord>, StoreError> {
    let raw = conn
        .prepare_cached(&SELECT_ACTION)?
        .query_row(params![id.0], raw_action)
        .optional()?;
    raw.map(decode_action).transpose()
}

/// The write action `agent` recorded under `idempotency_key`, if any.
pub(crate) fn action_by_key(
    conn: &Connection,
    agent: &str,
    idempotency_key: &str,
) -> Result<Option<ActionRecord>, StoreError> {
    let raw = conn
        .prepare_cached(&SELECT_ACTION_BY_KEY)?
        .query_row(params![agent, idempotency_key], raw_action)
        .optional()?;
    raw.map(decode_action).transpose()
}

/// The action lookup by agent and idempotency key (the `actions_by_agent_key` index), built
/// once from [`ACTION_COLUMNS`].
static SELECT_ACTION_BY_KEY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("SELECT {ACTION_COLUMNS} FROM actions WHERE agent = ?1 AND idempotency_key = ?2")
});

/// The actions of `provider` other than `except` whose external reference is `reference`, in
/// id order (see [`crate::Store::actions_sharing_reference`]).
pub(crate) fn actions_sharing_reference(
    conn: &Connection,
    provider: &str,
    reference: &str,
    except: ActionId,
) -> Result<Vec<ActionId>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id FROM actions WHERE provider = ?1 AND external_reference = ?2 AND id != ?3 \
         ORDER BY id",
    )?;
    let ids = stmt.query_map(params![provider, reference, except.0], |r| {
        r.get::<_, i64>(0)
    })?;
    let mut out = Vec::new();
    for id in ids {
        out.push(ActionId(id?));
    }
    Ok(out)
}

pub(crate) fn attempts(
    conn: &Connection,
    action: ActionId,
) -> Result<Vec<AttemptRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT n, state, status, disposition, started_at_ms, finished_at_ms, boundary, \
         signal_headers FROM attempts WHERE action_id = ?1 ORDER BY n",
    )?;
    let rows = stmt.query_map(params![action.0], |r| {
        Ok((
            (
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<i64>>(2)?,
                r.get::<_, Option<String>>(3)?,
            ),
            (
                r.get::<_, i64>(4)?,
                r.get::<_, Option<i64>>(5)?,
                r.get::<_, Option<String>>(6)?,
                r.get::<_, Option<String>>(7)?,
            ),
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let ((n, state, status, disposition), (started, finished, boundary, headers)) = row?;
        let bad = |reason: String| StoreError::Corrupt {
            table: "attempts",
            reason,
        };
        let boundary = match boundary.as_deref() {
            None => None,
            Some("unknown") => Some(Boundary::Unknown),
            Some(text) => Some(Boundary::At(text.parse().map_err(|e| {
                bad(format!(
                    "attempt {n} of action {action}: boundary {text:?}: {e}"
                ))
            })?)),
        };
        let signal_headers = headers
            .as_deref()
            .map(serde_json::from_str::<Vec<(String, String)>>)
            .transpose()
            .map_err(|e| {
                bad(format!(
                    "attempt {n} of action {action}: signal_headers: {e}"
                ))
            })?
            .unwrap_or_default();
        out.push(AttemptRecord {
            action,
            n: u32::try_from(n).map_err(|_| bad(format!("attempt number {n}")))?,
            state: AttemptState::parse(&state).map_err(corrupt("attempts"))?,
            status: status
                .map(|s| u16::try_from(s).map_err(|_| bad(format!("status {s}"))))
                .transpose()?,
            disposition: disposition
                .as_deref()
                .map(Disposition::parse)
                .transpose()
                .map_err(corrupt("attempts"))?,
            started_at: from_ms("attempts", started)?,
            finished_at: opt_ms("attempts", finished)?,
            boundary,
            signal_headers,
        });
    }
    Ok(out)
}

pub(crate) fn unfinished_attempts(conn: &Connection) -> Result<Vec<UnfinishedAttempt>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT t.action_id, t.n, a.request_class, a.idempotency_key \
         FROM attempts t JOIN actions a ON a.id = t.action_id \
         WHERE t.state = 'sent' ORDER BY t.action_id, t.n",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, Option<String>>(3)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (action, n, request_class, idempotency_key) = row?;
        let idempotency_key = idempotency_key.unwrap_or_default();
        out.push(UnfinishedAttempt {
            action: ActionId(action),
            attempt: u32::try_from(n).map_err(|_| StoreError::Corrupt {
                table: "attempts",
                reason: format!("attempt number {n}"),
            })?,
            request_class,
            idempotency_key,
        });
    }
    Ok(out)
}

/// Writes recorded but never sent and with no retry scheduled: the start-up scan that hands
/// them back to the gateway. Reads the `actions_open` index (schema 9): the redundant
/// `state != 'finished'` is the index's own condition, which SQLite must find in the query to
/// use a partial index.
pub(crate) const UNSENT_WRITES_SQL: &str = "SELECT a.id FROM actions a \
     WHERE a.state != 'finished' AND a.state = 'requested' \
     AND a.idempotency_key IS NOT NULL \
     AND NOT EXISTS (SELECT 1 FROM attempts t WHERE t.action_id = a.id) \
     AND NOT EXISTS (SELECT 1 FROM scheduled_retries r WHERE r.action_id = a.id) \
     ORDER BY a.id";

/// Reads recorded but never sent and with no retry scheduled (the start-up scan); reads the
/// `actions_open` index as [`UNSENT_WRITES_SQL`] does.
pub(crate) const UNSENT_READS_SQL: &str = "SELECT a.id FROM actions a \
     WHERE a.state != 'finished' AND a.state = 'requested' \
     AND a.idempotency_key IS NULL \
     AND NOT EXISTS (SELECT 1 FROM attempts t WHERE t.action_id = a.id) \
     AND NOT EXISTS (SELECT 1 FROM scheduled_retries r WHERE r.action_id = a.id) \
     ORDER BY a.id";

/// Actions between two attempts with no retry waiting to be claimed (the start-up scan): an
/// attempt's result recorded and nothing scheduled after it, or a retry whose job an earlier
/// run claimed (restart recovery reconciling it) and that no record followed — the process
/// that claimed it is gone, so the job is this start's to finish; and writes reopened for a
/// send under their key (by an operator, an agent's resend or restart recovery) that no send
/// followed — the caller decides with what it keeps of them. Reads the `actions_open`
/// index as [`UNSENT_WRITES_SQL`] does.
pub(crate) const ACTIONS_BETWEEN_ATTEMPTS_SQL: &str = "SELECT a.id FROM actions a \
     WHERE a.state != 'finished' AND a.state IN ('attempted', 'waiting', 'reopened') \
     AND NOT EXISTS (SELECT 1 FROM scheduled_retries r \
                     WHERE r.action_id = a.id AND r.claimed_at_ms IS NULL) \
     ORDER BY a.id";

pub(crate) fn unsent_writes(conn: &Connection) -> Result<Vec<ActionId>, StoreError> {
    action_ids(conn, UNSENT_WRITES_SQL)
}

pub(crate) fn unsent_reads(conn: &Connection) -> Result<Vec<ActionId>, StoreError> {
    action_ids(conn, UNSENT_READS_SQL)
}

pub(crate) fn actions_between_attempts(conn: &Connection) -> Result<Vec<ActionId>, StoreError> {
    action_ids(conn, ACTIONS_BETWEEN_ATTEMPTS_SQL)
}

/// The action ids `sql` (one `id` column, no parameters) lists, in its order.
fn action_ids(conn: &Connection, sql: &str) -> Result<Vec<ActionId>, StoreError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let ids = stmt.query_map([], |r| r.get::<_, i64>(0).map(ActionId))?;
    Ok(ids.collect::<Result<_, _>>()?)
}

pub(crate) fn scheduled_retries(conn: &Connection) -> Result<Vec<DueRetry>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT r.job_id, r.action_id, r.due_at_ms FROM scheduled_retries r \
         JOIN actions a ON a.id = r.action_id JOIN tasks t ON t.agent = a.agent AND t.id = a.task_id \
         WHERE r.claimed_at_ms IS NULL AND t.cancelled_at_ms IS NULL AND a.state != 'finished' \
         ORDER BY r.due_at_ms, r.job_id",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (job, action, due_at_ms) = row?;
        out.push(DueRetry {
            job: JobId(job),
            action: ActionId(action),
            due_at: from_ms("scheduled_retries", due_at_ms)?,
        });
    }
    Ok(out)
}

pub(crate) fn scope(
    conn: &Connection,
    provider: &str,
    scope: &str,
) -> Result<Option<ScopeRecord>, StoreError> {
    let row = conn
        .prepare_cached(
            "SELECT next_allowed_at_ms, remaining, limit_, reset_at_ms, source \
             FROM scope_records WHERE provider = ?1 AND scope = ?2",
        )?
        .query_row(params![provider, scope], |r| {
            Ok((
                r.get::<_, Option<i64>>(0)?,
                r.get::<_, Option<i64>>(1)?,
                r.get::<_, Option<i64>>(2)?,
                r.get::<_, Option<i64>>(3)?,
                r.get::<_, String>(4)?,
            ))
        })
        .optional()?;
    row.map(|(next, remaining, limit, reset, source)| {
        Ok(ScopeRecord {
            provider: provider.to_owned(),
            scope: scope.to_owned(),
            next_allowed_at: opt_ms("scope_records", next)?,
            remaining: u64_of("scope_records", remaining)?,
            limit: u64_of("scope_records", limit)?,
            reset_at: opt_ms("scope_records", reset)?,
            source,
        })
    })
    .transpose()
}

type RawEscalation = (
    i64,
    i64,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
);

const ESCALATION_COLUMNS: &str =
    "id, action_id, case_file, state, decision, decided_by, decided_at_ms, note";

fn decode_escalation(raw: RawEscalation) -> Result<EscalationRecord, StoreError> {
    let (id, action, case_file, state, decision, decided_by, decided_at, note) = raw;
    Ok(EscalationRecord {
        id: EscalationId(id),
        action: ActionId(action),
        case_file: serde_json::from_str(&case_file).map_err(|e| StoreError::Corrupt {
            table: "escalations",
            reason: format!("escalation {id}: case_file: {e}"),
        })?,
        state: EscalationState::parse(&state).map_err(corrupt("escalations"))?,
        decision,
        decided_by,
        decided_at: opt_ms("escalations", decided_at)?,
        note,
    })
}

fn raw_escalation(r: &Row<'_>) -> rusqlite::Result<RawEscalation> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

pub(crate) fn escalation(
    conn: &Connection,
    id: EscalationId,
) -> Result<Option<EscalationRecord>, StoreError> {
    conn.prepare_cached(&format!(
        "SELECT {ESCALATION_COLUMNS} FROM escalations WHERE id = ?1"
    ))?
    .query_row(params![id.0], raw_escalation)
    .optional()?
    .map(decode_escalation)
    .transpose()
}

pub(crate) fn escalations_of_action(
    conn: &Connection,
    action: ActionId,
) -> Result<Vec<EscalationRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {ESCALATION_COLUMNS} FROM escalations WHERE action_id = ?1 ORDER BY id"
    ))?;
    let rows = stmt.query_map(params![action.0], raw_escalation)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(decode_escalation(row?)?);
    }
    Ok(out)
}

pub(crate) fn escalations_decided_since(
    conn: &Connection,
    since: Timestamp,
) -> Result<Vec<EscalationRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {ESCALATION_COLUMNS} FROM escalations WHERE decided_at_ms >= ?1 ORDER BY decided_at_ms, id"
    ))?;
    let rows = stmt.query_map(params![ms(since)], raw_escalation)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(decode_escalation(row?)?);
    }
    Ok(out)
}

pub(crate) fn count_open_escalations(conn: &Connection) -> Result<u64, StoreError> {
    let count: i64 = conn
        .prepare_cached("SELECT count(*) FROM escalations WHERE state = 'open'")?
        .query_row([], |r| r.get(0))?;
    Ok(u64::try_from(count).unwrap_or(0))
}

pub(crate) fn open_escalations(conn: &Connection) -> Result<Vec<EscalationRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {ESCALATION_COLUMNS} FROM escalations WHERE state = 'open' ORDER BY id"
    ))?;
    let rows = stmt.query_map([], raw_escalation)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(decode_escalation(row?)?);
    }
    Ok(out)
}

const EVENT_COLUMNS: &str = "seq, at, kind, task, action, attempt, escalation, provider, scope, \
     route, method, request_class, idempotency_key, payload_digest, status, disposition, boundary, \
     source, outcome, job, due_at, remaining, limit_, decision, decided_by, prev, hash, \
     signal_headers, agent";

/// The stored digest in column `i` (`name`) as the lower-case hex the chain uses.
///
/// # Errors
/// A one-line reason when the column is not a BLOB of [`DIGEST_BYTES`] bytes (a value the
/// store never writes: the file was edited or damaged).
fn digest_hex(r: &Row<'_>, i: usize, name: &str) -> Result<String, String> {
    match r.get_ref(i) {
        Ok(rusqlite::types::ValueRef::Blob(bytes)) if bytes.len() == DIGEST_BYTES => {
            let mut hex = String::with_capacity(2 * DIGEST_BYTES);
            push_lower_hex(&mut hex, bytes);
            Ok(hex)
        }
        Ok(rusqlite::types::ValueRef::Blob(bytes)) => Err(format!(
            "{name} is {} bytes, not the {DIGEST_BYTES} of a SHA-256 digest",
            bytes.len()
        )),
        Ok(other) => Err(format!(
            "{name} is stored as {}, not as a {DIGEST_BYTES}-byte BLOB",
            other.data_type().to_string().to_ascii_lowercase()
        )),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

/// The columns of [`EVENT_COLUMNS`] in its order, each with what it must hold: the words a
/// message uses when a stored row holds something else (see [`event_column`]).
const EVENT_COLUMN_SPECS: [(&str, &str); 29] = [
    ("seq", "an integer"),
    ("at", "text"),
    ("kind", "text"),
    ("task", "text or NULL"),
    ("action", "an integer or NULL"),
    ("attempt", "an integer from 0 to 4294967295, or NULL"),
    ("escalation", "an integer or NULL"),
    ("provider", "text or NULL"),
    ("scope", "text or NULL"),
    ("route", "text or NULL"),
    ("method", "text or NULL"),
    ("request_class", "text or NULL"),
    ("idempotency_key", "text or NULL"),
    ("payload_digest", "text or NULL"),
    ("status", "an integer from 0 to 65535, or NULL"),
    ("disposition", "text or NULL"),
    ("boundary", "text or NULL"),
    ("source", "text or NULL"),
    ("outcome", "text or NULL"),
    ("job", "an integer or NULL"),
    ("due_at", "text or NULL"),
    ("remaining", "an integer or NULL"),
    ("limit_", "an integer or NULL"),
    ("decision", "text or NULL"),
    ("decided_by", "text or NULL"),
    ("prev", "a 32-byte BLOB (a SHA-256 digest)"),
    ("hash", "a 32-byte BLOB (a SHA-256 digest)"),
    (
        "signal_headers",
        "NULL or JSON text: an array of [name, value] string pairs",
    ),
    ("agent", "text or NULL"),
];

/// What a stored value is, for a message: its SQLite storage class and, for a scalar, the
/// value itself (text cut at 40 characters; audit events hold no secrets, SPEC §9).
fn stored_value(value: rusqlite::types::ValueRef<'_>) -> String {
    use rusqlite::types::ValueRef;
    match value {
        ValueRef::Null => "NULL".to_owned(),
        ValueRef::Integer(n) => format!("the integer {n}"),
        ValueRef::Real(x) => format!("the real number {x}"),
        ValueRef::Text(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) if text.chars().count() > 40 => {
                let cut: String = text.chars().take(40).collect();
                format!("the text {cut:?}… ({} bytes)", bytes.len())
            }
            Ok(text) => format!("the text {text:?}"),
            Err(_) => format!("{} bytes of text that is not UTF-8", bytes.len()),
        },
        ValueRef::Blob(bytes) => format!("a {}-byte BLOB", bytes.len()),
    }
}

/// Why column `i` of an event row cannot be read as what [`EVENT_COLUMN_SPECS`] says it
/// holds: `column NAME holds FOUND, expected EXPECTED`, with `detail` (e.g. a JSON parser's
/// finding) appended when there is one.
fn wrong_column(r: &Row<'_>, i: usize, detail: Option<&str>) -> String {
    let (name, expected) = EVENT_COLUMN_SPECS[i];
    let found = r.get_ref(i).map_or_else(
        |e| format!("a value SQLite cannot give ({e})"),
        stored_value,
    );
    match detail {
        Some(detail) => format!("column {name} holds {found}, expected {expected} ({detail})"),
        None => format!("column {name} holds {found}, expected {expected}"),
    }
}

/// Column `i` of an event row as `T`; a value of another type or out of `T`'s range is the
/// one-line reason of [`wrong_column`] (read only on that path: a sound row costs nothing more).
fn event_column<T: rusqlite::types::FromSql>(r: &Row<'_>, i: usize) -> Result<T, String> {
    r.get(i).map_err(|_| wrong_column(r, i, None))
}

/// Decodes one row of [`EVENT_COLUMNS`]; a row that cannot be decoded is
/// [`StoreError::UndecodableEvent`] naming its `seq` and the first column that holds what the
/// store never writes there, with what it holds and what was expected (or
/// [`StoreError::Corrupt`] when even the `seq` cannot be read).
fn decode_event(r: &Row<'_>) -> Result<AuditEvent, StoreError> {
    let undecodable = |reason: String| match r.get::<_, i64>(0) {
        // The row exists but a column has a wrong type or size: an altered event, named by seq.
        Ok(seq) => StoreError::UndecodableEvent {
            seq: u64::try_from(seq).unwrap_or(u64::MAX),
            reason,
        },
        Err(_) => StoreError::Corrupt {
            table: "audit_events",
            reason,
        },
    };
    let mut event = event_row(r).map_err(undecodable)?;
    event.prev = digest_hex(r, 25, "prev").map_err(undecodable)?;
    event.hash = digest_hex(r, 26, "hash").map_err(undecodable)?;
    Ok(event)
}

/// The columns of one event row but its digests (`prev` and `hash` are left empty, see
/// [`decode_event`]).
///
/// # Errors
/// The reason of [`wrong_column`] for the first column that cannot be decoded.
fn event_row(r: &Row<'_>) -> Result<AuditEvent, String> {
    let seq: i64 = event_column(r, 0)?;
    let remaining: Option<i64> = event_column(r, 21)?;
    let limit: Option<i64> = event_column(r, 22)?;
    Ok(AuditEvent {
        // A negative seq or count can only come from a hand-edited file; it then fails the
        // chain check as `altered` (u64::MAX never matches).
        seq: u64::try_from(seq).unwrap_or(u64::MAX),
        at: event_column(r, 1)?,
        kind: event_column(r, 2)?,
        task: event_column(r, 3)?,
        action: event_column(r, 4)?,
        attempt: event_column(r, 5)?,
        escalation: event_column(r, 6)?,
        provider: event_column(r, 7)?,
        scope: event_column(r, 8)?,
        route: event_column(r, 9)?,
        method: event_column(r, 10)?,
        request_class: event_column(r, 11)?,
        idempotency_key: event_column(r, 12)?,
        payload_digest: event_column(r, 13)?,
        status: event_column(r, 14)?,
        disposition: event_column(r, 15)?,
        boundary: event_column(r, 16)?,
        source: event_column(r, 17)?,
        outcome: event_column(r, 18)?,
        job: event_column(r, 19)?,
        due_at: event_column(r, 20)?,
        remaining: remaining.map(|v| u64::try_from(v).unwrap_or(u64::MAX)),
        limit: limit.map(|v| u64::try_from(v).unwrap_or(u64::MAX)),
        decision: event_column(r, 23)?,
        decided_by: event_column(r, 24)?,
        agent: event_column(r, 28)?,
        prev: String::new(),
        hash: String::new(),
        signal_headers: match event_column::<Option<String>>(r, 27)? {
            None => None,
            Some(text) => Some(
                serde_json::from_str(&text)
                    .map_err(|e| wrong_column(r, 27, Some(&e.to_string())))?,
            ),
        },
    })
}

/// Calls `f` for every event with `seq > since`, in `seq` order, up to `limit` events.
pub(crate) fn for_each_event(
    conn: &Connection,
    since: u64,
    limit: Option<usize>,
    mut f: impl FnMut(Result<AuditEvent, StoreError>) -> bool,
) -> Result<(), StoreError> {
    let since = i64::try_from(since).unwrap_or(i64::MAX);
    let limit = limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {EVENT_COLUMNS} FROM audit_events WHERE seq > ?1 ORDER BY seq LIMIT ?2"
    ))?;
    let mut rows = stmt.query(params![since, limit])?;
    while let Some(row) = rows.next()? {
        if !f(decode_event(row)) {
            break;
        }
    }
    Ok(())
}

pub(crate) fn audit_events(
    conn: &Connection,
    since: u64,
    limit: usize,
) -> Result<Vec<AuditEvent>, StoreError> {
    let mut out = Vec::new();
    let mut err = None;
    for_each_event(conn, since, Some(limit), |e| match e {
        Ok(e) => {
            out.push(e);
            true
        }
        Err(e) => {
            err = Some(e);
            false
        }
    })?;
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// See [`crate::Store::watch_events`]: the page's last `seq` is read first and bounds the
/// events, so an event committed between the two statements is not returned twice.
pub(crate) fn watch_events(
    conn: &Connection,
    since: u64,
    limit: usize,
) -> Result<(Vec<AuditEvent>, Option<u64>), StoreError> {
    let since = i64::try_from(since).unwrap_or(i64::MAX);
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let last: Option<i64> = conn
        .prepare_cached(
            "SELECT MAX(seq) FROM (SELECT seq FROM audit_events WHERE seq > ?1 ORDER BY seq LIMIT ?2)",
        )?
        .query_row(params![since, limit], |r| r.get(0))?;
    let Some(last) = last else {
        return Ok((Vec::new(), None));
    };
    // The same dispositions the in-memory feed counts as throttling (plain words, no quotes).
    let throttling = super::feed::THROTTLING.join("', '");
    let mut stmt = conn.prepare_cached(&format!(
        "WITH page AS MATERIALIZED (
             SELECT seq, kind, action, disposition, outcome FROM audit_events
             WHERE seq > ?1 AND seq <= ?2
         ),
         plain AS (
             SELECT action FROM page WHERE action IS NOT NULL AND kind <> 'task_opened'
             GROUP BY action
             HAVING SUM(kind = 'action_requested') = 1
                AND SUM(kind = 'action_sent') = 1
                AND SUM(kind = 'action_result'
                        AND COALESCE(disposition, '') NOT IN ('{throttling}')) = 1
                AND SUM(kind = 'action_finished' AND outcome = 'succeeded') = 1
                AND COUNT(*) = 4
         )
         SELECT {EVENT_COLUMNS} FROM audit_events WHERE seq IN (
             SELECT seq FROM page
             WHERE kind <> 'task_opened'
               AND (action IS NULL OR kind = 'action_sent' OR action NOT IN (SELECT action FROM plain))
         )
         ORDER BY seq"
    ))?;
    let mut rows = stmt.query(params![since, last])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        match decode_event(row) {
            Ok(event) => out.push(event),
            // An altered row is passed over, not retried: the page still ends at `last`, so a
            // watcher moves past it instead of failing on it at every check. `audit verify`
            // names it as the chain's first break.
            Err(e @ StoreError::UndecodableEvent { .. }) => {
                tracing::warn!(error = %e, "audit event skipped by the watcher: it cannot be decoded (run `backstop audit verify`)");
            }
            Err(e) => return Err(e),
        }
    }
    Ok((out, Some(u64::try_from(last).unwrap_or(u64::MAX))))
}

pub(crate) fn audit_seqs(conn: &Connection) -> Result<Vec<u64>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT seq FROM audit_events ORDER BY seq")?;
    let rows = stmt.query_map([], |r| r.get::<_, i64>(0))?;
    let mut out = Vec::new();
    for row in rows {
        out.push(u64::try_from(row?).unwrap_or(u64::MAX));
    }
    Ok(out)
}

/// How many rows lie outside the chain (`seq` 0 or below: the store never writes them), and
/// the lowest `seq`s of them, up to `show`.
pub(crate) fn seqs_outside_chain(
    conn: &Connection,
    show: usize,
) -> Result<(u64, Vec<i64>), StoreError> {
    let count: i64 = conn
        .prepare_cached("SELECT count(*) FROM audit_events WHERE seq <= 0")?
        .query_row([], |r| r.get(0))?;
    if count == 0 {
        return Ok((0, Vec::new()));
    }
    let mut stmt =
        conn.prepare_cached("SELECT seq FROM audit_events WHERE seq <= 0 ORDER BY seq LIMIT ?1")?;
    let rows = stmt.query_map([i64::try_from(show).unwrap_or(i64::MAX)], |r| r.get(0))?;
    let seqs = rows.collect::<Result<Vec<i64>, _>>()?;
    Ok((u64::try_from(count).unwrap_or(0), seqs))
}

/// The stored `hash` (hex) of the event at `seq`: `None` when there is no such row, `Some(Err)`
/// with a reason when its digest cannot be decoded.
pub(crate) fn event_hash(
    conn: &Connection,
    seq: u64,
) -> Result<Option<Result<String, String>>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT hash FROM audit_events WHERE seq = ?1")?
        .query_row([i64::try_from(seq).unwrap_or(i64::MAX)], |r| {
            Ok(digest_hex(r, 0, "hash"))
        })
        .optional()?)
}

/// The last row of the audit log as stored: its `seq`, and its `hash` as hex or the reason the
/// stored hash cannot be read (see [`digest_hex`]).
pub(crate) type HeadRow = (i64, Result<String, String>);

/// The [`HeadRow`] of the last event; `None` for an empty log.
pub(crate) fn head_row(conn: &Connection) -> Result<Option<HeadRow>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT seq, hash FROM audit_events ORDER BY seq DESC LIMIT 1")?
        .query_row([], |r| Ok((r.get::<_, i64>(0)?, digest_hex(r, 1, "hash"))))
        .optional()?)
}

/// The last event's `seq` and `hash` (hex), or `None` for an empty log.
///
/// # Errors
/// [`StoreError::Corrupt`] naming the `seq` when it is negative or its stored hash is not a
/// 32-byte digest: the writer cannot continue a chain from it.
pub(crate) fn audit_head(conn: &Connection) -> Result<Option<ChainHead>, StoreError> {
    head_row(conn)?
        .map(|(seq, hash)| {
            let corrupt = |reason: String| StoreError::Corrupt {
                table: "audit_events",
                reason: format!("seq {seq}: {reason}"),
            };
            Ok(ChainHead {
                seq: u64::try_from(seq).map_err(|_| corrupt("negative seq".to_owned()))?,
                hash: hash.map_err(corrupt)?,
            })
        })
        .transpose()
}

/// The event insert, built once (not per event) from [`EVENT_COLUMNS`].
pub(crate) static INSERT_EVENT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "INSERT INTO audit_events ({EVENT_COLUMNS}) VALUES \
         (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, \
          ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29)"
    )
});

/// Binds parameter `i` (1-based) to `value` when it is set; leaves it as it is (NULL after
/// `clear_bindings`) when it is not.
fn bind_set<T: rusqlite::ToSql>(
    stmt: &mut rusqlite::Statement<'_>,
    i: usize,
    value: Option<T>,
) -> rusqlite::Result<()> {
    match value {
        Some(v) => stmt.raw_bind_parameter(i, v),
        None => Ok(()),
    }
}

/// Appends one sealed event with `stmt`, a statement of [`INSERT_EVENT`]; `digests` are the
/// bytes of its `prev` and `hash` as the seal returned them.
///
/// # Errors
/// [`StoreError::Invalid`] when `prev` has no bytes from the seal and is not 64 hex digits;
/// SQLite's errors.
pub(crate) fn insert_event(
    stmt: &mut Statement<'_>,
    e: &AuditEvent,
    digests: &SealedDigests,
) -> Result<(), StoreError> {
    let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let headers = match e.signal_headers.as_deref() {
        None | Some([]) => None,
        Some(pairs) => Some(
            serde_json::to_string(pairs).map_err(|err| StoreError::Invalid {
                field: "signal_headers",
                reason: err.to_string(),
            })?,
        ),
    };
    // Every parameter starts NULL and only the members that are set are bound: most of an
    // event's members are not.
    stmt.clear_bindings();
    stmt.raw_bind_parameter(1, to_i64(e.seq))?;
    stmt.raw_bind_parameter(2, &e.at)?;
    stmt.raw_bind_parameter(3, &e.kind)?;
    bind_set(stmt, 4, e.task.as_deref())?;
    bind_set(stmt, 5, e.action)?;
    bind_set(stmt, 6, e.attempt)?;
    bind_set(stmt, 7, e.escalation)?;
    bind_set(stmt, 8, e.provider.as_deref())?;
    bind_set(stmt, 9, e.scope.as_deref())?;
    bind_set(stmt, 10, e.route.as_deref())?;
    bind_set(stmt, 11, e.method.as_deref())?;
    bind_set(stmt, 12, e.request_class.as_deref())?;
    bind_set(stmt, 13, e.idempotency_key.as_deref())?;
    bind_set(stmt, 14, e.payload_digest.as_deref())?;
    bind_set(stmt, 15, e.status)?;
    bind_set(stmt, 16, e.disposition.as_deref())?;
    bind_set(stmt, 17, e.boundary.as_deref())?;
    bind_set(stmt, 18, e.source.as_deref())?;
    bind_set(stmt, 19, e.outcome.as_deref())?;
    bind_set(stmt, 20, e.job)?;
    bind_set(stmt, 21, e.due_at.as_deref())?;
    bind_set(stmt, 22, e.remaining.map(to_i64))?;
    bind_set(stmt, 23, e.limit.map(to_i64))?;
    bind_set(stmt, 24, e.decision.as_deref())?;
    bind_set(stmt, 25, e.decided_by.as_deref())?;
    // No bytes from the seal: the chain continued from a head whose hash is not 64 lower-case
    // hex digits (see `Chain::after`), which schema 8 cannot keep.
    let Some(prev) = digests.prev else {
        return Err(StoreError::Invalid {
            field: "prev",
            reason: format!("{:?} is not 64 lower-case hex digits", e.prev),
        });
    };
    stmt.raw_bind_parameter(26, &prev[..])?;
    stmt.raw_bind_parameter(27, &digests.hash[..])?;
    bind_set(stmt, 28, headers)?;
    bind_set(stmt, 29, e.agent.as_deref())?;
    stmt.raw_execute()?;
    Ok(())
}

/// The request kept for `action` (table `kept_requests`), if any.
pub(crate) fn kept_request(
    conn: &Connection,
    action: ActionId,
) -> Result<Option<KeptRequest>, StoreError> {
    let row = conn
        .prepare_cached(
            "SELECT method, url, headers, body FROM kept_requests WHERE action_id = ?1",
        )?
        .query_row([action.0], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Vec<u8>>(3)?,
            ))
        })
        .optional()?;
    let Some((method, url, headers, body)) = row else {
        return Ok(None);
    };
    let headers = serde_json::from_str(&headers).map_err(|e| StoreError::Corrupt {
        table: "kept_requests",
        reason: format!("action {}: headers: {e}", action.0),
    })?;
    Ok(Some(KeptRequest {
        method,
        url,
        headers,
        body,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_specs_name_the_event_columns_in_their_order() {
        let names: Vec<&str> = EVENT_COLUMN_SPECS.iter().map(|(name, _)| *name).collect();
        let listed: Vec<&str> = EVENT_COLUMNS.split(',').map(str::trim).collect();
        assert_eq!(names, listed);
    }
}
