//! A provider scope's record: what its responses said about when it takes requests again.

use jiff::Timestamp;
use rusqlite::params;

use super::WriteTx;
use crate::audit::{format_instant, AuditEvent, EventKind};
use crate::error::StoreError;
use crate::model::{ScopeRecord, ScopeUpdate};
use crate::sqlite::rows::{self, ms};

impl WriteTx<'_> {
    pub(crate) fn update_scope(
        &mut self,
        update: ScopeUpdate,
        at: Timestamp,
    ) -> Result<ScopeRecord, StoreError> {
        let old = rows::scope(self.conn, &update.provider, &update.scope)?;
        let next_allowed_at = match (
            old.as_ref().and_then(|o| o.next_allowed_at),
            update.next_allowed_at,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.conn
            .prepare_cached(
                "INSERT INTO scope_records (provider, scope, next_allowed_at_ms, remaining, limit_, \
                 reset_at_ms, source, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
                 ON CONFLICT (provider, scope) DO UPDATE SET \
                 next_allowed_at_ms = excluded.next_allowed_at_ms, remaining = excluded.remaining, \
                 limit_ = excluded.limit_, reset_at_ms = excluded.reset_at_ms, \
                 source = excluded.source, updated_at_ms = excluded.updated_at_ms",
            )?
            .execute(params![
                update.provider,
                update.scope,
                next_allowed_at.map(ms),
                update.remaining.map(to_i64),
                update.limit.map(to_i64),
                update.reset_at.map(ms),
                update.source,
                ms(at)
            ])?;
        let record = ScopeRecord {
            provider: update.provider,
            scope: update.scope,
            next_allowed_at,
            remaining: update.remaining,
            limit: update.limit,
            reset_at: update.reset_at,
            source: update.source,
        };
        let mut e = AuditEvent::new(EventKind::ScopeUpdated.as_str(), &format_instant(at));
        e.provider = Some(record.provider.clone());
        e.scope = Some(record.scope.clone());
        e.boundary = record.next_allowed_at.map(format_instant);
        e.remaining = record.remaining;
        e.limit = record.limit;
        e.source = Some(record.source.clone());
        self.append(e)?;
        Ok(record)
    }
}
