//! diagnose
