//! backoff
