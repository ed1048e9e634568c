//! Sanitized escalation case files and decision options (SPEC §8).
