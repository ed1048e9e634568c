//! The policy file: one YAML document, validated with positions (SPEC §3).
//!
//! Why policy as data: retries are a contract with providers, not a habit of whichever agent
//! sends the call. The file states per request class how many attempts and how much waiting are
//! allowed and which statuses may be retried; per provider its credential source, quota dialect,
//! idempotency header, scopes with their published limits, and routes. The agent cannot override
//! it at run time. It is validated once, at start, and every problem is reported as
//! `FILE:LINE:COL: message`, all of them at once where possible, so that `backstop policy check`
//! is useful in CI.
//!
//! ## YAML crate
//! `serde_yaml` is archived. Of its successors, `serde_norway` is a maintained fork with the same
//! design: errors carry a position only while deserializing, and there is no span-carrying value
//! type, so a *semantic* error ("unknown scope `x`", "headroom must be in (0, 1]") cannot point
//! at its line. `serde-saphyr` (pure Rust, actively maintained, panic-free parser) offers
//! [`serde_saphyr::Spanned`], which records the line and column of any value, map keys
//! included. That is what makes positioned semantic errors possible, so backstop uses
//! `serde-saphyr` (default features off, `deserialize` only). Duplicate keys are errors.
//!
//! ## Reading is two passes
//! 1. Deserialization into span-carrying raw types: YAML syntax errors, unknown keys, wrong
//!    types and numbers that are not finite (`.nan`, `.inf`). The deserializer stops at the
//!    first of these, so at most one is reported; it names the key path of the value it
//!    concerns (`providers.fake.routes."GET /v1/x".coalesce: …`) beside the line and column.
//! 2. Validation of the raw document: ranges, references (class, scope), route templates,
//!    secrets written in clear, JSON pointers. Every problem found is collected.
//!
//! Secrets are referenced only (`secret_env`, `secret_file`, `token_env`, `token_file`, or a
//! `token_sha256` digest); a literal `secret`, `token`, `api_key`, `password` or `value` field,
//! userinfo, a query string or a fragment in `base_url`, an `*_env` that is not a variable name
//! (`[A-Za-z_][A-Za-z0-9_]*`), an empty `*_file`, or a credential `header` that is not a bare
//! field name is an error that never echoes the value.
//!
//! The `uncertain_write` class may not retry (`max_attempts` 1, no `retry_statuses`): an
//! uncertain write is never resent blindly (SPEC §6). Numbers are read permissively and checked
//! here, so a wrong sign, size or type is reported with its key path.
//!
//! ## Where each part lives
//! - `parse`: the pre-scan (blank file, YAML tags) and deserialization into `raw`, the
//!   span-carrying document; `diagnostics`: [`PolicyError`] and the context that collects them
//!   while `document` validates each section into a [`Policy`].
//! - `classes`: request classes; `backoff`, `breaker`, `retry_quota`: retry limits;
//!   `scopes`: quota scopes and their pacing; `secrets`: credentials and caller tokens.
//! - `providers`: a provider's settings; `routes`, `templates`: its routes and their
//!   `METHOD /path/{param}` keys; `reconcile`: reconciliation lookups; `headers`, `checks`:
//!   header names and JSON pointers.
//! - `lookup`: what a loaded policy answers at run time ([`Policy::route`],
//!   [`Policy::classify_rules`]).
//!
//! ```
//! use backstop_core::policy::Policy;
//!
//! let policy = Policy::from_yaml_str(
//!     "request_classes:\n  read: { max_attempts: 4, max_wait_seconds: 90, retry_statuses: [429] }\n",
//!     "backstop.yaml",
//! )
//! .unwrap();
//! assert_eq!(policy.request_classes["read"].max_attempts, 4);
//!
//! let errors = Policy::from_yaml_str("breaker:\n  threshold: 0\n", "backstop.yaml").unwrap_err();
//! assert_eq!(
//!     errors.to_string(),
//!     "backstop.yaml:2:14: breaker.threshold: must be at least 1"
//! );
//! ```

mod backoff;
mod breaker;
mod checks;
mod classes;
mod diagnostics;
mod document;
mod headers;
mod lookup;
mod parse;
mod providers;
mod raw;
mod reconcile;
mod retry_quota;
mod routes;
mod scopes;
mod secrets;
mod templates;

pub use backoff::{
    BackoffPolicy, MIN_BACKOFF_BASE, MIN_RETRY_AFTER_CEILING, MIN_RETRY_DELAY_FLOOR,
};
pub use breaker::{BreakerPolicy, MIN_FORGET_AFTER};
pub use checks::is_json_pointer;
pub use classes::{builtin_class, RequestClass, BUILTIN_CLASSES};
pub use diagnostics::{PolicyError, PolicyErrors};
pub use document::{file_kind, Policy, MAX_POLICY_BYTES};
pub use lookup::{RouteMatch, UnknownProvider};
pub use providers::{
    check_provider_name, Provider, DIALECTS, DISPOSITIONS, RESERVED_PROVIDER_NAMES,
};
pub use reconcile::{Reconcile, ReconcileBy};
pub use routes::Route;
pub use scopes::{Scope, SharedScope};
pub use secrets::{Credential, SecretRef, TokenRef};
pub use templates::{template_for_path, Segment, ROUTE_METHODS};

#[cfg(test)]
mod tests;
