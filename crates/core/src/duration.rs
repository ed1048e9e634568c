//! duration
