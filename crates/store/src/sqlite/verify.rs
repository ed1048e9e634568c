//! Checking the audit log in the database: its head before the writer extends it, and the
//! whole chain, with the rows written beside its events, for `backstop audit verify`.

use std::path::Path;

use rusqlite::Connection;

use super::rows;
use crate::audit::{verify_chain, AuditEvent, ChainHead, Verdict};
use crate::error::StoreError;

/// The audit log's last event, read to continue the chain from it; refuses a last event that
/// was changed after it was written: the writer seals each new event onto the head's hash, so
/// a head that does not match its own content, does not link to the event before it, or whose
/// stored hash cannot be read (e.g. kept as text instead of its 32 bytes), would be extended
/// into a broken chain. Only the head is checked (two rows, whatever the log's length);
/// `backstop audit verify` checks the rest.
///
/// # Errors
/// [`StoreError::BrokenHead`] naming the head's `seq` and what is wrong with it; storage errors.
pub(super) fn checked_head(
    conn: &Connection,
    path: &Path,
) -> Result<Option<ChainHead>, StoreError> {
    let Some((seq, hash)) = rows::head_row(conn)? else {
        return Ok(None);
    };
    let broken = |reason: String| StoreError::BrokenHead {
        path: path.to_owned(),
        seq,
        reason,
    };
    let seq = match u64::try_from(seq) {
        Ok(seq) if seq > 0 => seq,
        _ => {
            return Err(broken(
                "lies outside the chain, which starts at seq 1".to_owned(),
            ))
        }
    };
    let hash = hash.map_err(|reason| broken(format!("cannot be decoded ({reason})")))?;
    let head = ChainHead { seq, hash };
    check_head(conn, &head, broken)?;
    Ok(Some(head))
}

/// The checks of [`checked_head`] that read the head's whole row and the hash before it;
/// `broken` makes the error naming the head.
fn check_head(
    conn: &Connection,
    head: &ChainHead,
    broken: impl Fn(String) -> StoreError,
) -> Result<(), StoreError> {
    let event = match rows::audit_events(conn, head.seq - 1, 1) {
        Ok(mut events) => events.pop(),
        Err(StoreError::UndecodableEvent { reason, .. }) => {
            return Err(broken(format!("cannot be decoded ({reason})")))
        }
        Err(e) => return Err(e),
    };
    let Some(event) = event else {
        return Ok(());
    };
    let computed = event.compute_hash();
    if computed != event.hash {
        let (recorded, computed) = crate::audit::distinct(&event.hash, &computed);
        return Err(broken(format!(
            "does not match its hash ({recorded} recorded, {computed} computed)"
        )));
    }
    let linked = if head.seq == 1 {
        Some(Ok(crate::audit::GENESIS_PREV.to_owned()))
    } else {
        rows::event_hash(conn, head.seq - 1)?
    };
    // Without a sound event before it, the head's link cannot be checked: the chain is broken
    // just before its end (a deleted or altered row), and would be extended past the break.
    match linked {
        None => Err(broken(format!(
            "follows a missing event (seq {} is not in the log)",
            head.seq - 1
        ))),
        Some(Err(reason)) => Err(broken(format!(
            "follows an event that cannot be decoded (seq {}: {reason})",
            head.seq - 1
        ))),
        Some(Ok(linked)) if event.prev != linked => {
            let (recorded, linked) = crate::audit::distinct(&event.prev, &linked);
            Err(broken(format!(
                "does not link to the event before it (prev {recorded}, the hash of seq {} is {linked})",
                head.seq - 1
            )))
        }
        Some(Ok(_)) => Ok(()),
    }
}

/// How many rows outside the chain a break names by their `seq`.
pub(super) const OUTSIDE_SHOWN: usize = 5;

/// Verifies the whole log in `conn` (see [`verify_chain`]), with the rows outside the chain and
/// the rows that must have their events.
pub(super) fn verify_connection(
    conn: &Connection,
    expect_head: Option<&str>,
) -> Result<Verdict, StoreError> {
    // Rows with a seq of 0 or below come before the chain's first event, and the chain's
    // reading (from seq 1) would never meet them.
    let (outside, lowest) = rows::seqs_outside_chain(conn, OUTSIDE_SHOWN)?;
    if let Some(&first) = lowest.first() {
        let detail = if outside == 1 {
            format!(
                "a row with seq {first} lies outside the chain, which starts at seq 1 (the store \
                 never writes one: it was added to the file)"
            )
        } else {
            let listed: Vec<String> = lowest.iter().map(ToString::to_string).collect();
            let more = if outside > lowest.len() as u64 {
                ", …"
            } else {
                ""
            };
            format!(
                "{outside} rows lie outside the chain, which starts at seq 1 (seq {}{more}; the \
                 store never writes one: they were added to the file)",
                listed.join(", ")
            )
        };
        return Ok(Verdict::Broken(crate::audit::ChainBreak {
            seq: first,
            kind: crate::audit::BreakKind::Inserted,
            detail,
        }));
    }
    let seqs = rows::audit_seqs(conn)?;
    let events = EventChunks {
        conn,
        since: 0,
        buf: std::collections::VecDeque::new(),
        done: false,
    };
    match verify_chain(&seqs, events, expect_head)? {
        Verdict::Intact { count, head } => Ok(match unaudited_action(conn)? {
            Some(cut) => Verdict::Broken(crate::audit::ChainBreak {
                seq: i64::try_from(count + 1).unwrap_or(i64::MAX),
                kind: crate::audit::BreakKind::Truncated,
                detail: cut,
            }),
            None => Verdict::Intact { count, head },
        }),
        broken => Ok(broken),
    }
}

/// Why the log must have been cut at its end although its chain is whole, or `None`: the store
/// records every action in the same transaction as its `action_requested` event, so an action
/// row newer than every audited action means events were removed from the end of the log (a
/// log wiped whole verifies as an empty chain otherwise; without `--expect-head` a cut tail is
/// a shorter, intact chain). With no action, or every action audited, the other rows written
/// with their events are checked ([`unaudited_rows`]).
fn unaudited_action(conn: &Connection) -> Result<Option<String>, StoreError> {
    let newest: Option<i64> = conn.query_row("SELECT MAX(id) FROM actions", [], |r| r.get(0))?;
    let Some(newest) = newest else {
        return unaudited_rows(conn);
    };
    let audited: Option<i64> = conn.query_row(
        "SELECT MAX(action) FROM audit_events WHERE kind = 'action_requested'",
        [],
        |r| r.get(0),
    )?;
    Ok(match audited {
        Some(audited) if audited >= newest => unaudited_rows(conn)?,
        Some(audited) => Some(format!(
            "the store records action {newest}, but the log's newest `action_requested` is \
             for action {audited}: events were cut from the end of the log (every action is \
             recorded in the same transaction as its event)"
        )),
        None => Some(format!(
            "the store records actions up to action {newest}, but the log has no \
             `action_requested` event: the log was emptied or cut (every action is recorded in \
             the same transaction as its event)"
        )),
    })
}

/// Why the log must have been cut although every action has its `action_requested` event, or
/// `None`: the store writes each attempt row with its `action_sent` event, each escalation row
/// with its `escalated` event, each decision with its `decision` event and each task row with
/// its `task_opened` event, all in one transaction, and never deletes those rows; so more
/// attempt rows than `action_sent` events, an escalation newer than every `escalated` event,
/// more decided escalations than escalations with a `decision` event, or more task rows than
/// `task_opened` events mean events were removed from the end of the log (e.g. cut just after
/// an action's `action_requested`, or just before a task opened with no action yet). One scan of
/// the log's kinds; a cut that removed events of none of these kinds (a `scope_updated`, an
/// outcome alone) is found only by `--expect-head`.
fn unaudited_rows(conn: &Connection) -> Result<Option<String>, StoreError> {
    let count =
        |sql: &str| -> Result<i64, StoreError> { Ok(conn.query_row(sql, [], |r| r.get(0))?) };
    // What the log holds of each kind, in one pass over it.
    let (sent, escalated, decisions, opened): (i64, i64, i64, i64) = conn.query_row(
        "SELECT COALESCE(SUM(kind = 'action_sent'), 0), \
                COALESCE(MAX(CASE WHEN kind = 'escalated' THEN escalation END), 0), \
                COUNT(DISTINCT CASE WHEN kind = 'decision' THEN escalation END), \
                COALESCE(SUM(kind = 'task_opened'), 0) \
         FROM audit_events",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )?;
    let attempts = count("SELECT COUNT(*) FROM attempts")?;
    if attempts > sent {
        return Ok(Some(format!(
            "the store records {attempts} attempts, but the log has {sent} `action_sent` \
             events: events were cut from the end of the log (every attempt is recorded in the \
             same transaction as its event)"
        )));
    }
    let escalation = count("SELECT COALESCE(MAX(id), 0) FROM escalations")?;
    if escalation > escalated {
        return Ok(Some(format!(
            "the store records escalation {escalation}, but the log's newest `escalated` event \
             is for escalation {escalated}: events were cut from the end of the log (every \
             escalation is recorded in the same transaction as its event)"
        )));
    }
    let decided = count("SELECT COUNT(*) FROM escalations WHERE decided_at_ms IS NOT NULL")?;
    if decided > decisions {
        return Ok(Some(format!(
            "the store records {decided} decided escalations, but the log has a `decision` \
             event for {decisions}: events were cut from the end of the log (every decision is \
             recorded in the same transaction as its event)"
        )));
    }
    let tasks = count("SELECT COUNT(*) FROM tasks")?;
    if tasks > opened {
        return Ok(Some(format!(
            "the store records {tasks} tasks, but the log has {opened} `task_opened` events: \
             events were cut from the end of the log (every task is recorded in the same \
             transaction as its event)"
        )));
    }
    Ok(None)
}

/// Streams the audit log in `seq` order, [`CHUNK`] events per query, so verifying a large log
/// needs memory for one chunk only.
struct EventChunks<'a> {
    conn: &'a Connection,
    since: u64,
    buf: std::collections::VecDeque<Result<AuditEvent, StoreError>>,
    done: bool,
}

const CHUNK: usize = 4096;

impl Iterator for EventChunks<'_> {
    type Item = Result<AuditEvent, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() && !self.done {
            let buf = &mut self.buf;
            let mut last = None;
            let read = rows::for_each_event(self.conn, self.since, Some(CHUNK), |e| {
                if let Ok(e) = &e {
                    last = Some(e.seq);
                }
                buf.push_back(e);
                true
            });
            if let Err(e) = read {
                self.buf.push_back(Err(e));
            }
            match last {
                Some(seq) if self.buf.len() == CHUNK => self.since = seq,
                _ => self.done = true,
            }
        }
        self.buf.pop_front()
    }
}
