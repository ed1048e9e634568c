//! backstop's durable state on embedded SQLite and the hash-chained audit log.
//!
//! - [`Store`] is the narrow storage trait: a few atomic operations (record an action with its
//!   idempotency key, mark an attempt sent, record a result, schedule and claim retries, update
//!   a scope record, open and decide escalations, cancel a task), each one transaction that also
//!   appends its audit event(s). Callers never hold a connection.
//! - [`SqliteStore`] implements it on one SQLite file (WAL, `synchronous=FULL`, group commit
//!   through one writer thread, versioned migrations). A PostgreSQL implementation for several
//!   gateway instances can follow behind the same trait (SPEC §12).
//! - [`audit`] defines the events, their canonical encoding and hash chain, and the offline
//!   verifier behind `backstop audit verify`; [`AuditReader`] opens a database read-only for it.
//!
//! The store never reads the clock: every operation takes the instant from the caller.
#![deny(missing_docs)]

pub mod audit;
pub mod error;
pub mod model;
pub mod snapshots;
pub mod sqlite;
pub mod store;

pub use error::{BoundRequest, LockHolder, StoreError};
pub use model::*;
pub use sqlite::{AuditReader, SqliteStore, WriterStats};
pub use store::{
    Completion, Store, ACCESS_DECISION, ACTION_REOPENED, REOPENED_BY_RESEND, RESUMED_AFTER_RESTART,
    STATUS_QUERY,
};
