//! breaker
