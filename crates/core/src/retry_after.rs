//! retry_after
