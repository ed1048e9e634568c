//! Reconciliation of uncertain writes through configured lookups (SPEC §6).
