//! backstop's durable state on embedded SQLite and the hash-chained audit log.
#![deny(missing_docs)]
