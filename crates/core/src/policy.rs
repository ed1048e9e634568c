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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_saphyr::{Location, Spanned};

use crate::backoff::BackoffConfig;
use crate::budget::{ClassBudget, RetryQuotaConfig};
use crate::classify::{default_error_codes, ClassifyRules, Disposition};
use crate::pacing::{PacerConfig, ScopeRecord, MIN_WINDOW};
use crate::quota::Dialect;
use crate::retry_after::RetryAfterOptions;
use crate::side_effect::{completion_route, SideEffect, COMPLETION_CLASS};

// ---------------------------------------------------------------------------------------------
// Errors

/// One problem in a policy file, with its position (1-based line and column; 0 when unknown).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyError {
    /// The file name as given to the loader.
    pub file: String,
    /// 1-based line, 0 when the problem has no position (e.g. the file cannot be read).
    pub line: u64,
    /// 1-based column (characters), 0 when unknown.
    pub column: u64,
    /// What is wrong, naming the key path (`providers.billing.scopes.account.headroom: …`).
    pub message: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file, self.line, self.column, self.message
            )
        }
    }
}

/// Every problem found in a policy file, in file order. Display: one `FILE:LINE:COL: message`
/// per line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The validated policy

/// The largest policy file [`Policy::load`] reads, in bytes (4 MiB): far above any real policy,
/// small enough that a wrong path (a log, an image) is refused at once.
pub const MAX_POLICY_BYTES: u64 = 4 * 1024 * 1024;

/// What kind of file system entry `meta` is, in words, for a refusal.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// The names of the three built-in request classes (SPEC §1).
pub const BUILTIN_CLASSES: [&str; 4] = ["read", "idempotent_write", "uncertain_write", "llm_call"];

/// Quota header dialects a provider may name (SPEC §2.3).
pub const DIALECTS: [&str; 5] = ["generic", "ietf", "openai", "anthropic", "github"];

/// Dispositions an `error_codes` entry may map to (SPEC §2.1).
pub const DISPOSITIONS: [&str; 9] = [
    "success",
    "rate_limited",
    "quota_exhausted",
    "unavailable",
    "transient",
    "not_sent",
    "uncertain",
    "conflict",
    "rejected",
];

/// A validated policy (SPEC §3). Construct with [`Policy::from_yaml_str`] or [`Policy::load`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// The file it was read from (as given).
    pub file: String,
    /// SQLite store path (`store`), if set.
    pub store: Option<PathBuf>,
    /// Listen address (`listen`), if set, e.g. `127.0.0.1:8080`.
    pub listen: Option<String>,
    /// Request classes by name; the three built-in ones always exist.
    pub request_classes: BTreeMap<String, RequestClass>,
    /// Scope limits that apply where a scope does not set its own (`shared_scope`).
    pub shared_scope: SharedScope,
    /// Backoff parameters (`backoff`).
    pub backoff: BackoffPolicy,
    /// Circuit breaker (`breaker`).
    pub breaker: BreakerPolicy,
    /// Scope retry quota (`retry_quota`).
    pub retry_quota: RetryQuotaConfig,
    /// Agents and how their tokens are found (`agents`).
    pub agents: BTreeMap<String, TokenRef>,
    /// Operators and how their tokens are found (`operators`).
    pub operators: BTreeMap<String, TokenRef>,
    /// Providers by name (`providers`).
    pub providers: BTreeMap<String, Provider>,
    /// Settings that are valid but probably unintended, in file order (`message` without a
    /// `warning:` prefix): a policy without agents (no one can call the gateway), a provider
    /// without scopes, a PUT/DELETE route of class `idempotent_write` on a provider that
    /// declares `idempotent_put_delete` but has no `idempotency_header`. A policy without an
    /// `agents` section is reported at line 1, column 1.
    pub warnings: Vec<PolicyError>,
}

/// A request class: budgets and retryable statuses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestClass {
    /// The class name (`read`, `idempotent_write`, `uncertain_write`, or a configured one).
    pub name: String,
    /// Attempts in total, the first included (≥ 1).
    pub max_attempts: u32,
    /// Total wait between attempts (`max_wait_seconds`).
    pub max_wait: Duration,
    /// Statuses that may be retried, sorted and deduplicated.
    pub retry_statuses: Vec<u16>,
    /// What a request of this class changes at the provider (`side_effect`: `none` for `read`
    /// and `llm_call`, `write` for every other class unless the policy says otherwise).
    pub side_effect: SideEffect,
}

impl RequestClass {
    /// The class budget for [`crate::budget::ActionBudget`].
    pub fn budget(&self) -> ClassBudget {
        ClassBudget {
            max_attempts: self.max_attempts,
            max_wait: self.max_wait,
        }
    }
}

/// Scope limits shared by all scopes unless a scope sets its own (`shared_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SharedScope {
    /// Delayed-queue limit per scope (default 25).
    pub max_delayed_requests: u32,
    /// Concurrency limit per scope (default 2).
    pub max_concurrent_requests: u32,
}

/// Backoff and Retry-After parameters (`backoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BackoffPolicy {
    /// `base_seconds` (default 1).
    pub base: Duration,
    /// `max_seconds` (default 60).
    pub max: Duration,
    /// `min_delay_seconds`: the floor of every known boundary delay (past, zero or smaller values
    /// are raised to it; default 1).
    pub min_delay: Duration,
    /// `retry_after_ceiling_seconds`: larger Retry-After values are absurd (default 86,400; at
    /// least [`MIN_RETRY_AFTER_CEILING`]).
    pub retry_after_ceiling: Duration,
    /// `boundary_spread_seconds`: jitter after a provider boundary (default 5). 0 turns the
    /// jitter off: every retry released by one boundary then leaves at the same instant, as
    /// one burst (SPEC §4.2 wants them spread), so 0 loads with a warning.
    pub boundary_spread: Duration,
}

impl BackoffPolicy {
    /// The parameters of [`crate::backoff::plan_retry`].
    pub fn config(&self) -> BackoffConfig {
        BackoffConfig {
            base: self.base,
            max: self.max,
            boundary_spread: self.boundary_spread,
        }
    }
}

/// The shortest `backoff.base_seconds` a policy may set (0.1 s). The first retry's delay is drawn
/// from `[0, 2 · base]` and each later cap doubles from there, so a smaller base (`1e-9`, `0.001`)
/// sends the retries of a failing request within microseconds or milliseconds of each other: a
/// tight retry loop against a provider that is already failing, which backoff exists to prevent.
pub const MIN_BACKOFF_BASE: Duration = Duration::from_millis(100);

/// The shortest `backoff.min_delay_seconds` a policy may set (0.1 s). It is the floor of every
/// provider boundary: a `Retry-After: 0`, a date or quota reset already past, or a shorter delay is
/// raised to it. A smaller floor (`1e-9`, `0.001`) lets a provider that keeps answering "retry
/// now" be called again within microseconds or milliseconds: a tight retry loop against a limit
/// that is already hit.
pub const MIN_RETRY_DELAY_FLOOR: Duration = Duration::from_millis(100);

/// The smallest `backoff.retry_after_ceiling_seconds` a policy may set (1 s). A `Retry-After`
/// above the ceiling is absurd and its boundary unknown (SPEC §2.2); providers give it in whole
/// seconds, so a ceiling under one second (`0.5`, `1e-9`) discards every delay a provider
/// actually sends: each throttled request is retried on local backoff alone, possibly before
/// the provider allows it.
pub const MIN_RETRY_AFTER_CEILING: Duration = Duration::from_secs(1);

/// The shortest `breaker.forget_after_seconds` a policy may set (1 s). A task's breaker is
/// forgotten that long after its last failure; the same request fails again no sooner than a
/// retry's delay (`backoff.min_delay_seconds`, 1 s by default) or the agent's next try, so a
/// shorter window (`1e-9`, `0.5`) forgets every failure before the next one and the circuit
/// never opens: the breaker would be off while the policy says it is on.
pub const MIN_FORGET_AFTER: Duration = Duration::from_secs(1);

/// Circuit breaker parameters (`breaker`, SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BreakerPolicy {
    /// Identical failures that open the path for a task (default 3).
    pub threshold: u32,
    /// `forget_after_seconds`: a task's breaker without a failure for this long is forgotten,
    /// open paths included, so the same failure then needs `threshold` tries again to open
    /// (default 86,400 s, 24 h; at least [`MIN_FORGET_AFTER`]). See
    /// [`crate::breaker::TaskBreakers`].
    pub forget_after: Duration,
}

impl Default for BreakerPolicy {
    /// Threshold 3, forget after 24 h.
    fn default() -> Self {
        BreakerPolicy {
            threshold: 3,
            forget_after: Duration::from_secs(86_400),
        }
    }
}

/// Where an agent's or operator's token is found. Never the token itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenRef {
    /// `token_env`: the environment variable holding the token.
    Env(String),
    /// `token_file`: the file holding the token.
    File(PathBuf),
    /// `token_sha256`: the lowercase hex SHA-256 of the token.
    Sha256(String),
}

/// Where a provider secret is found. Never the secret itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretRef {
    /// `secret_env`: the environment variable holding the secret.
    Env(String),
    /// `secret_file`: the file holding the secret.
    File(PathBuf),
}

/// How the gateway authenticates to a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Credential {
    /// Where the secret is.
    pub secret: SecretRef,
    /// Header carrying it (default `Authorization`).
    pub header: String,
    /// Scheme before the secret (default `Bearer`; empty for a bare value like `x-api-key`).
    pub scheme: String,
}

/// A provider (`providers.NAME`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Provider {
    /// The provider's name.
    pub name: String,
    /// Base URL, `http://` or `https://`, without a trailing slash.
    pub base_url: String,
    /// Credential, if the provider needs one.
    pub credential: Option<Credential>,
    /// Quota header dialect (`dialect`, one of [`DIALECTS`], default `generic`).
    pub dialect: Dialect,
    /// Idempotency header name (e.g. `Idempotency-Key`); its presence means the provider
    /// honours keys, so POST/PATCH default to `idempotent_write`.
    pub idempotency_header: Option<String>,
    /// Whether PUT/DELETE are idempotent by the provider's contract.
    pub idempotent_put_delete: bool,
    /// JSON pointer (RFC 6901) to the error code in an error body (`error_code_pointer`);
    /// absent, the dialect's documented place ([`Dialect::error_code_pointer`]: `/error/code`
    /// for `openai`), else none.
    pub error_code_pointer: Option<String>,
    /// Provider error code → disposition (`error_codes`); these override
    /// [`crate::classify::default_error_codes`].
    pub error_codes: BTreeMap<String, Disposition>,
    /// JSON pointers to a Google-style `retryDelay` in error bodies (`retry_delay_pointers`).
    pub retry_delay_pointers: Vec<String>,
    /// JSON pointers to the violated quota's name (`quota_id_pointers`; `…PerDay` → quota exhausted).
    pub quota_id_pointers: Vec<String>,
    /// JSON pointers to a `resets_in_seconds` number (`resets_in_seconds_pointers`).
    pub resets_in_seconds_pointers: Vec<String>,
    /// Whether `x-should-retry`-style hints are honoured (default true).
    pub honour_hints: bool,
    /// Scopes by short name.
    pub scopes: BTreeMap<String, Scope>,
    /// Full scope names for requests that match no route (default: every scope).
    pub default_scopes: Vec<String>,
    /// Configured routes, in file order.
    pub routes: Vec<Route>,
}

/// A quota scope (`providers.P.scopes.NAME`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scope {
    /// Full name, `provider/scope`.
    pub name: String,
    /// Published limit: requests per window; `None` for a scope with queue limits only.
    pub limit: Option<u64>,
    /// The window of the published limit (`window_seconds`, default 60; at least
    /// [`MIN_WINDOW`], 1 s).
    pub window: Duration,
    /// Share of the published rate backstop paces at, `0 < h ≤ 1` (default 0.8).
    pub headroom: f64,
    /// Share of capacity kept for interactive work, `0 ≤ r < 1` (default 0.2).
    pub reserve_interactive: f64,
    /// Delayed-queue limit.
    pub max_delayed_requests: u32,
    /// Concurrency limit.
    pub max_concurrent_requests: u32,
}

impl Scope {
    /// The pacing of this scope, `None` without a published limit.
    pub fn pacer_config(&self) -> Option<PacerConfig> {
        let limit = self.limit?;
        PacerConfig::try_new(limit, self.window, self.headroom, self.reserve_interactive).ok()
    }

    /// A fresh scope record.
    pub fn record(&self) -> ScopeRecord {
        let mut record = ScopeRecord::new(
            self.name.clone(),
            self.max_concurrent_requests,
            self.max_delayed_requests,
        );
        record.limit = self.limit;
        record
    }
}

/// One segment of a route template.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    /// Must equal the path segment.
    Literal(String),
    /// `{name}`: any non-empty segment.
    Param(String),
}

/// How an uncertain write is reconciled (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReconcileBy {
    /// Look up by the idempotency key (`{key}` in the lookup).
    IdempotencyKey,
    /// Look up by a client-generated reference placed in the payload (`{ref}` in the lookup).
    ExternalReference,
    /// Look up by the provider's operation id (`{operation_id}` in the lookup).
    OperationId,
}

/// A reconciliation lookup (`routes.R.reconcile`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reconcile {
    /// What the lookup is keyed by.
    pub by: ReconcileBy,
    /// Method of the lookup (a safe method: GET or HEAD).
    pub lookup_method: String,
    /// Path and query of the lookup with its placeholder, e.g. `/v1/transfers?reference={ref}`.
    pub lookup_path: String,
    /// JSON pointer to the external reference in the write's payload.
    pub external_reference_pointer: Option<String>,
    /// JSON pointer into the lookup response that is present/true when the operation exists.
    pub found_pointer: Option<String>,
    /// JSON pointer to the provider's operation id (in the write response or the lookup).
    /// Never the empty pointer (the whole answer), which is refused at load.
    pub operation_id_pointer: Option<String>,
}

/// A configured route (`routes."METHOD /path/{param}"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    /// Upper-case method.
    pub method: String,
    /// The path template as written, e.g. `/v1/transfers/{id}`.
    pub template: String,
    /// The parsed template.
    pub segments: Vec<Segment>,
    /// Request class name.
    pub class: String,
    /// Full scope names.
    pub scopes: Vec<String>,
    /// Whether identical in-flight safe reads share one upstream call.
    pub coalesce: bool,
    /// JSON pointers of the stable payload fields for the fingerprint.
    pub fingerprint_fields: Vec<String>,
    /// Reconciliation lookup for uncertain writes.
    pub reconcile: Option<Reconcile>,
}

/// The answer of [`Policy::route`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteMatch {
    /// The provider.
    pub provider: String,
    /// Upper-case method.
    pub method: String,
    /// The route template: the configured one, or the path with ids replaced by `{id}`.
    pub template: String,
    /// Request class name.
    pub class: String,
    /// The class's `side_effect` (SPEC §4.2a): `none` makes a `POST` of this route run like a
    /// read.
    pub side_effect: SideEffect,
    /// Full scope names (`provider/scope`).
    pub scopes: Vec<String>,
    /// Whether the route coalesces identical in-flight reads.
    pub coalesce: bool,
    /// Stable payload fields for the fingerprint.
    pub fingerprint_fields: Vec<String>,
    /// Reconciliation lookup, if configured.
    pub reconcile: Option<Reconcile>,
    /// Template parameters bound by the path (configured routes only).
    pub params: BTreeMap<String, String>,
    /// Whether a configured route matched (false: SPEC §3 defaults by method).
    pub configured: bool,
}

/// [`Policy::route`] was asked about a provider the policy does not name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown provider `{0}`")]
pub struct UnknownProvider(pub String);

impl Policy {
    /// Reads and validates a policy file.
    ///
    /// # Errors
    /// [`PolicyErrors`]: the file cannot be read, is not a regular file (a device, FIFO or
    /// directory) or is larger than [`MAX_POLICY_BYTES`] (no position), or see
    /// [`Policy::from_yaml_str`].
    pub fn load(path: impl AsRef<Path>) -> Result<Policy, PolicyErrors> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let unpositioned = |message: String| {
            PolicyErrors(vec![PolicyError {
                file: file.clone(),
                line: 0,
                column: 0,
                message,
            }])
        };
        // A device (`/dev/zero`), a FIFO or a directory is refused before it is opened: opening
        // a FIFO blocks until a writer comes, and a device may never end.
        let meta = std::fs::metadata(path)
            .map_err(|e| unpositioned(format!("cannot read the policy file: {e}")))?;
        if !meta.is_file() {
            return Err(unpositioned(format!(
                "not a regular file ({}); a policy is read from a regular file",
                file_kind(&meta)
            )));
        }
        let too_large = || {
            unpositioned(format!(
                "larger than {} MiB; a policy file is at most {MAX_POLICY_BYTES} bytes",
                MAX_POLICY_BYTES / (1024 * 1024)
            ))
        };
        if meta.len() > MAX_POLICY_BYTES {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| {
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(f, MAX_POLICY_BYTES + 1),
                    &mut bytes,
                )
            })
            .map_err(|e| unpositioned(format!("cannot read the policy file: {e}")))?;
        // The file grew after its size was read.
        if bytes.len() as u64 > MAX_POLICY_BYTES {
            return Err(too_large());
        }
        let src = match String::from_utf8(bytes) {
            Ok(src) => src,
            Err(e) => {
                let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
                let line = valid.iter().filter(|&&b| b == b'\n').count() as u64 + 1;
                let column =
                    valid.len() - valid.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
                return Err(PolicyErrors(vec![PolicyError {
                    file: file.clone(),
                    line,
                    column: column as u64,
                    message: format!(
                        "not UTF-8 (invalid byte at offset {}); a policy file is UTF-8 text",
                        e.utf8_error().valid_up_to()
                    ),
                }]));
            }
        };
        Policy::from_yaml_str(&src, &file)
    }

    /// Parses and validates a policy from YAML text; `file` names it in errors.
    ///
    /// # Errors
    /// [`PolicyErrors`] with `FILE:LINE:COL: message` for: YAML syntax, unknown keys and wrong
    /// types (the first one only), then every semantic problem (ranges, unknown class or scope
    /// references, malformed route templates or JSON pointers, literal secrets).
    pub fn from_yaml_str(src: &str, file: &str) -> Result<Policy, PolicyErrors> {
        if is_blank_yaml(src) {
            return Err(PolicyErrors(vec![PolicyError {
                file: file.to_owned(),
                line: 0,
                column: 0,
                message: "empty policy file (no settings, only blank lines or comments)".to_owned(),
            }]));
        }
        let raw = read_raw(src, file)?;
        let mut ctx = Ctx {
            file: file.to_owned(),
            errors: Vec::new(),
            warnings: Vec::new(),
        };
        let mut policy = validate(raw, &mut ctx);
        if ctx.errors.is_empty() {
            ctx.warnings.sort_by_key(|w| (w.line, w.column));
            policy.warnings = ctx.warnings;
            Ok(policy)
        } else {
            ctx.errors.sort_by_key(|e| (e.line, e.column));
            Err(PolicyErrors(ctx.errors))
        }
    }

    /// Decides route, class and scopes for a request (SPEC §3).
    ///
    /// `path` may carry a query string (ignored). The configured route with the most literal
    /// segments wins; without one, the class follows the method: GET/HEAD/OPTIONS → `read`;
    /// PUT/DELETE → `idempotent_write` only if the provider sets `idempotent_put_delete`, else
    /// `uncertain_write`; POST/PATCH (and any other method) → `idempotent_write` when the provider
    /// has an `idempotency_header`, else `uncertain_write` — except the completion routes of a
    /// provider with `dialect: openai` or `anthropic` (`POST /v1/chat/completions`,
    /// `/v1/messages`, … see [`completion_route`]), which are `llm_call` (`side_effect: none`).
    /// The template of an unmatched path has
    /// its ids (numbers, UUIDs, long hex or opaque tokens) replaced by `{id}` (see
    /// [`template_for_path`]), and its scopes are the provider's `default_scopes`.
    ///
    /// # Errors
    /// [`UnknownProvider`] when the policy has no such provider.
    pub fn route(
        &self,
        provider: &str,
        method: &str,
        path: &str,
    ) -> Result<RouteMatch, UnknownProvider> {
        let p = self
            .providers
            .get(provider)
            .ok_or_else(|| UnknownProvider(provider.to_owned()))?;
        let method = method.trim().to_ascii_uppercase();
        let path = path.split(['?', '#']).next().unwrap_or("");
        let segments = path_segments(path);
        let mut best: Option<(&Route, usize, BTreeMap<String, String>)> = None;
        for route in p.routes.iter().filter(|r| r.method == method) {
            if let Some(params) = match_segments(&route.segments, &segments) {
                let literals = route
                    .segments
                    .iter()
                    .filter(|s| matches!(s, Segment::Literal(_)))
                    .count();
                if best.as_ref().is_none_or(|(_, l, _)| literals > *l) {
                    best = Some((route, literals, params));
                }
            }
        }
        if let Some((route, _, params)) = best {
            return Ok(RouteMatch {
                provider: provider.to_owned(),
                method,
                template: route.template.clone(),
                side_effect: self.side_effect_of(&route.class),
                class: route.class.clone(),
                scopes: route.scopes.clone(),
                coalesce: route.coalesce,
                fingerprint_fields: route.fingerprint_fields.clone(),
                reconcile: route.reconcile.clone(),
                params,
                configured: true,
            });
        }
        let class = match completion_route(p.dialect, &method, path) {
            Some(_) => COMPLETION_CLASS,
            None => default_class(p, &method),
        };
        Ok(RouteMatch {
            provider: provider.to_owned(),
            side_effect: self.side_effect_of(class),
            class: class.to_owned(),
            method,
            template: template_for_path(path),
            scopes: p.default_scopes.clone(),
            coalesce: false,
            fingerprint_fields: Vec::new(),
            reconcile: None,
            params: BTreeMap::new(),
            configured: false,
        })
    }

    /// The rules to classify a response of `provider` for a request of `class` (SPEC §2):
    /// the class's `retry_statuses`; the provider's error-code pointer, its `error_codes` over
    /// [`default_error_codes`], hint policy, dialect and body pointers; and the Retry-After
    /// limits of `backoff` (`min_delay_seconds`, `retry_after_ceiling_seconds`).
    ///
    /// # Errors
    /// [`UnknownProvider`] when the policy has no such provider.
    pub fn classify_rules(
        &self,
        provider: &str,
        class: &RequestClass,
    ) -> Result<ClassifyRules, UnknownProvider> {
        let p = self
            .providers
            .get(provider)
            .ok_or_else(|| UnknownProvider(provider.to_owned()))?;
        let mut error_codes = default_error_codes();
        error_codes.extend(p.error_codes.iter().map(|(k, v)| (k.clone(), *v)));
        Ok(ClassifyRules {
            retry_statuses: class.retry_statuses.clone(),
            error_code_pointer: p.error_code_pointer.clone(),
            error_codes,
            honour_hints: p.honour_hints,
            dialect: p.dialect,
            retry_after: RetryAfterOptions {
                min_delay: self.backoff.min_delay,
                ceiling: self.backoff.retry_after_ceiling,
            },
            retry_delay_pointers: p.retry_delay_pointers.clone(),
            quota_id_pointers: p.quota_id_pointers.clone(),
            resets_in_seconds_pointers: p.resets_in_seconds_pointers.clone(),
        })
    }

    /// The `side_effect` of class `class` ([`SideEffect::Write`] for a class the policy does
    /// not hold, which validation never lets a route name).
    pub fn side_effect_of(&self, class: &str) -> SideEffect {
        self.request_classes
            .get(class)
            .map_or(SideEffect::Write, |c| c.side_effect)
    }

    /// Every scope of every provider, by full name.
    pub fn scopes(&self) -> impl Iterator<Item = &Scope> {
        self.providers.values().flat_map(|p| p.scopes.values())
    }
}

/// The SPEC §3 default class for `method` (upper case) at provider `p`.
fn default_class(p: &Provider, method: &str) -> &'static str {
    match method {
        "GET" | "HEAD" | "OPTIONS" => "read",
        "PUT" | "DELETE" if p.idempotent_put_delete => "idempotent_write",
        "PUT" | "DELETE" => "uncertain_write",
        _ if p.idempotency_header.is_some() => "idempotent_write",
        _ => "uncertain_write",
    }
}

fn path_segments(path: &str) -> Vec<&str> {
    path.trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect()
}

fn match_segments(template: &[Segment], path: &[&str]) -> Option<BTreeMap<String, String>> {
    if template.len() != path.len() {
        return None;
    }
    let mut params = BTreeMap::new();
    for (segment, actual) in template.iter().zip(path) {
        match segment {
            Segment::Literal(l) if l == actual => {}
            Segment::Literal(_) => return None,
            Segment::Param(name) => {
                params.insert(name.clone(), (*actual).to_owned());
            }
        }
    }
    Some(params)
}

/// The route template of a concrete path: segments that look like ids become `{id}`, so that
/// `/v1/transfers/8412/events` and `/v1/transfers/8413/events` share one template (and one
/// fingerprint, metric and audit label). An id is: all digits; a UUID; 16 or more hex digits;
/// 16 or more characters with at least one digit; or a prefixed opaque token like `tr_8a7b6c5d`
/// (a `_`-separated prefix followed by 8 or more characters with a digit). Query and trailing
/// slash are dropped.
///
/// ```
/// use backstop_core::policy::template_for_path;
/// assert_eq!(
///     template_for_path("/v1/customers/cus_9s6XKzkNRiz8i3/charges/42?limit=3"),
///     "/v1/customers/{id}/charges/{id}"
/// );
/// assert_eq!(template_for_path("/v1/chat/completions"), "/v1/chat/completions");
/// ```
pub fn template_for_path(path: &str) -> String {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let segments = path_segments(path);
    if segments.is_empty() {
        return "/".to_owned();
    }
    let mut out = String::with_capacity(path.len());
    for segment in segments {
        out.push('/');
        if looks_like_id(segment) {
            out.push_str("{id}");
        } else {
            out.push_str(segment);
        }
    }
    out
}

fn looks_like_id(s: &str) -> bool {
    let has_digit = s.bytes().any(|b| b.is_ascii_digit());
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    if is_uuid(s) {
        return true;
    }
    if s.len() >= 16 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return true;
    }
    if s.len() >= 16 && has_digit {
        return true;
    }
    if let Some((prefix, rest)) = s.split_once('_') {
        return !prefix.is_empty()
            && rest.len() >= 8
            && rest.bytes().any(|b| b.is_ascii_digit())
            && rest.bytes().all(|b| b.is_ascii_alphanumeric());
    }
    false
}

fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

// ---------------------------------------------------------------------------------------------
// Raw, span-carrying document

std::thread_local! {
    /// The keys of the [`SpannedMap`] entries whose value failed to deserialize, innermost
    /// first: the names a failing value's key path holds where `serde_path_to_error` sees only
    /// a key it could not capture (a [`Spanned`] key). Emptied by [`read_raw`].
    static FAILED_MAP_KEYS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Deserializes the raw document; `file` names it in errors.
///
/// # Errors
/// One [`PolicyError`] for the first YAML error (syntax, unknown key, wrong type, a number
/// that is not finite), at its line and column, its message led by the key path of the value
/// it concerns (`providers.fake.routes."GET /v1/x".coalesce: invalid boolean`) — without one
/// when the error concerns the document as a whole.
///
/// The path comes from `serde_path_to_error`, which tracks struct fields and sequence
/// indexes. Two things are mended: the `value` level that every [`Spanned`] adds (its
/// internal view is a struct with a `value` field) is dropped, and the keys of
/// [`SpannedMap`]s, which the tracker cannot capture because they are read as [`Spanned`]
/// strings, are filled in from [`FAILED_MAP_KEYS`].
/// Every explicit YAML tag in `src` (`!include`, `!!binary`, `!env`, …), each a positioned
/// error: a policy uses none, and a tag ignored or decoded behind the reader's back would change
/// what a value means (`store: !include /etc/passwd` taken as a path, base64 taken as text).
/// Syntax errors are left to the deserializer, which reports them with their own position.
fn explicit_tags(src: &str, file: &str) -> Vec<PolicyError> {
    use serde_saphyr::granit_parser::{Event, Parser};
    let mut found = Vec::new();
    for parsed in Parser::new_from_str(src) {
        let Ok((event, span)) = parsed else {
            break;
        };
        let tag = match event {
            Event::Scalar(_, _, _, tag)
            | Event::SequenceStart(_, _, tag)
            | Event::MappingStart(_, _, tag) => tag,
            _ => None,
        };
        if let Some(tag) = tag {
            let at = span.tag_start.unwrap_or(span.start);
            found.push(PolicyError {
                file: file.to_owned(),
                line: u64::try_from(at.line()).unwrap_or(u64::MAX),
                column: u64::try_from(at.col() + 1).unwrap_or(u64::MAX),
                message: format!(
                    "the YAML tag `{}` is not allowed in a policy: write the value itself (no tags, includes or encodings)",
                    tag.original()
                ),
            });
        }
    }
    found
}

fn read_raw(src: &str, file: &str) -> Result<RawPolicy, PolicyErrors> {
    let tags = explicit_tags(src, file);
    if !tags.is_empty() {
        return Err(PolicyErrors(tags));
    }
    FAILED_MAP_KEYS.with(|keys| keys.borrow_mut().clear());
    let mut at = None;
    let raw = serde_saphyr::with_deserializer_from_str(src, |de| {
        serde_path_to_error::deserialize::<_, RawPolicy>(de).map_err(|e| {
            at = Some(key_path(e.path()));
            e.into_inner()
        })
    });
    let failed_keys = FAILED_MAP_KEYS.with(|keys| std::mem::take(&mut *keys.borrow_mut()));
    raw.map_err(|e| {
        let at = at.and_then(|segments| {
            let mut keys = failed_keys.into_iter().rev();
            let mut path = String::new();
            for segment in segments {
                match segment {
                    PathSegment::Field(name) => push_key(&mut path, &name),
                    PathSegment::MapKey => push_key(&mut path, &keys.next()?),
                    PathSegment::Index(index) => path.push_str(&format!("[{index}]")),
                }
            }
            (!path.is_empty()).then_some(path)
        });
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let message = match at {
            Some(at) => format!("{at}: {}", yaml_message(&e)),
            None => yaml_message(&e),
        };
        PolicyErrors(vec![PolicyError {
            file: file.to_owned(),
            line,
            column,
            message,
        }])
    })
}

/// One level of a key path as `serde_path_to_error` reports it.
enum PathSegment {
    /// A struct field (a setting's name).
    Field(String),
    /// A key the tracker could not read (the key of a [`SpannedMap`] entry).
    MapKey,
    /// A sequence index.
    Index(usize),
}

/// The levels of `path` without the `value` level each [`Spanned`] adds. No raw type has a
/// setting named `value` whose value can fail (`value` is a [`Trap`], read as anything), and
/// names chosen in the file are [`PathSegment::MapKey`]s, so no real level is lost.
fn key_path(path: &serde_path_to_error::Path) -> Vec<PathSegment> {
    path.iter()
        .filter_map(|segment| match segment {
            serde_path_to_error::Segment::Map { key } if key == "value" => None,
            serde_path_to_error::Segment::Map { key } => Some(PathSegment::Field(key.clone())),
            serde_path_to_error::Segment::Seq { index } => Some(PathSegment::Index(*index)),
            serde_path_to_error::Segment::Enum { variant } => {
                Some(PathSegment::Field(variant.clone()))
            }
            serde_path_to_error::Segment::Unknown => Some(PathSegment::MapKey),
        })
        .collect()
}

/// Appends `.key` to `path` (no dot at the start), quoting a key that is not a plain name
/// the way validation messages do (`routes."GET /v1/x"`).
fn push_key(path: &mut String, key: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if plain {
        path.push_str(key);
    } else {
        path.push('"');
        path.push_str(key);
        path.push('"');
    }
}

/// A YAML mapping read with the position of each key, in file order.
struct SpannedMap<V>(Vec<(Spanned<String>, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for SpannedMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MapVisitor<V> {
            type Value = SpannedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<Spanned<String>>()? {
                    match map.next_value() {
                        Ok(value) => entries.push((key, value)),
                        Err(e) => {
                            FAILED_MAP_KEYS.with(|keys| keys.borrow_mut().push(key.value));
                            return Err(e);
                        }
                    }
                }
                Ok(SpannedMap(entries))
            }
        }
        deserializer.deserialize_map(MapVisitor(PhantomData))
    }
}

type S<T> = Spanned<T>;
/// A key that would hold a secret in clear: read only to be refused with its own message
/// ([`Ctx::trap`]). Its name is one of [`REFUSED_SECRET_KEYS`].
type Trap = Option<S<IgnoredAny>>;

/// The names of every [`Trap`] field: keys that would hold a secret in clear, refused
/// wherever they appear. They are not settings, so the list of keys an unknown key's message
/// says are expected leaves them out (see [`PolicyMessages`]); no setting may be named like one.
const REFUSED_SECRET_KEYS: [&str; 5] = ["secret", "value", "token", "api_key", "password"];

/// A number as written in the file, read permissively so that validation — not the YAML
/// library — reports a wrong sign, size or type together with the key path
/// (`breaker.threshold: expected a non-negative integer, got -3`).
#[derive(Debug, Clone, PartialEq)]
enum Num {
    Int(i128),
    Float(f64),
    /// Not a number: the scalar as written (a string or a boolean).
    Other(String),
}

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NumVisitor;
        impl Visitor<'_> for NumVisitor {
            type Value = Num;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Num, E> {
                Ok(Num::Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Num, E> {
                Ok(Num::Int(v.into()))
            }
            fn visit_i128<E>(self, v: i128) -> Result<Num, E> {
                Ok(Num::Int(v))
            }
            fn visit_u128<E>(self, v: u128) -> Result<Num, E> {
                Ok(i128::try_from(v).map_or(Num::Float(v as f64), Num::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Num, E> {
                Ok(Num::Float(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Num, E> {
                Ok(Num::Other(v.to_string()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Num, E> {
                Ok(Num::Other(format!("{v:?}")))
            }
        }
        deserializer.deserialize_any(NumVisitor)
    }
}

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Num::Int(i) => write!(f, "{i}"),
            Num::Float(x) => write!(f, "{x}"),
            Num::Other(text) => f.write_str(text),
        }
    }
}

/// The largest number of seconds a policy duration may hold (about 136 years).
const MAX_POLICY_SECONDS: f64 = u32::MAX as f64;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    store: Option<S<String>>,
    listen: Option<S<String>>,
    request_classes: Option<SpannedMap<S<RawClass>>>,
    shared_scope: Option<S<RawSharedScope>>,
    backoff: Option<S<RawBackoff>>,
    breaker: Option<S<RawBreaker>>,
    retry_quota: Option<S<RawRetryQuota>>,
    agents: Option<SpannedMap<S<RawPrincipal>>>,
    operators: Option<SpannedMap<S<RawPrincipal>>>,
    providers: Option<SpannedMap<S<RawProvider>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    max_attempts: Option<S<Num>>,
    max_wait_seconds: Option<S<Num>>,
    retry_statuses: Option<S<Vec<S<Num>>>>,
    side_effect: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSharedScope {
    max_delayed_requests: Option<S<Num>>,
    max_concurrent_requests: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackoff {
    base_seconds: Option<S<Num>>,
    max_seconds: Option<S<Num>>,
    min_delay_seconds: Option<S<Num>>,
    retry_after_ceiling_seconds: Option<S<Num>>,
    boundary_spread_seconds: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    threshold: Option<S<Num>>,
    forget_after_seconds: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetryQuota {
    capacity: Option<S<Num>>,
    retry_cost: Option<S<Num>>,
    timeout_cost: Option<S<Num>>,
    success_refund: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrincipal {
    token_env: Option<S<String>>,
    token_file: Option<S<String>>,
    token_sha256: Option<S<String>>,
    token: Trap,
    secret: Trap,
    password: Trap,
    api_key: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredential {
    secret_env: Option<S<String>>,
    secret_file: Option<S<String>>,
    header: Option<S<String>>,
    scheme: Option<S<String>>,
    secret: Trap,
    value: Trap,
    token: Trap,
    api_key: Trap,
    password: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    base_url: Option<S<String>>,
    credential: Option<S<RawCredential>>,
    dialect: Option<S<String>>,
    idempotency_header: Option<S<String>>,
    idempotent_put_delete: Option<S<bool>>,
    error_code_pointer: Option<S<String>>,
    error_codes: Option<SpannedMap<S<String>>>,
    retry_delay_pointers: Option<S<Vec<S<String>>>>,
    quota_id_pointers: Option<S<Vec<S<String>>>>,
    resets_in_seconds_pointers: Option<S<Vec<S<String>>>>,
    honour_hints: Option<S<bool>>,
    scopes: Option<SpannedMap<S<RawScope>>>,
    default_scopes: Option<S<Vec<S<String>>>>,
    routes: Option<SpannedMap<S<RawRoute>>>,
    secret: Trap,
    token: Trap,
    api_key: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScope {
    limit: Option<S<Num>>,
    window_seconds: Option<S<Num>>,
    headroom: Option<S<Num>>,
    reserve_interactive: Option<S<Num>>,
    max_delayed_requests: Option<S<Num>>,
    max_concurrent_requests: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    class: Option<S<String>>,
    scopes: Option<S<Vec<S<String>>>>,
    coalesce: Option<S<bool>>,
    fingerprint_fields: Option<S<Vec<S<String>>>>,
    reconcile: Option<S<RawReconcile>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconcile {
    by: Option<S<String>>,
    lookup: Option<S<String>>,
    external_reference_pointer: Option<S<String>>,
    found_pointer: Option<S<String>>,
    operation_id_pointer: Option<S<String>>,
}

// ---------------------------------------------------------------------------------------------
// Validation

struct Ctx {
    file: String,
    errors: Vec<PolicyError>,
    warnings: Vec<PolicyError>,
}

impl Ctx {
    /// A legal but probably unintended setting: reported, the policy still loads.
    fn warn(&mut self, line: u64, column: u64, message: impl Into<String>) {
        self.warnings.push(PolicyError {
            file: self.file.clone(),
            line,
            column,
            message: message.into(),
        });
    }

    fn err(&mut self, at: &Location, message: impl Into<String>) {
        self.errors.push(PolicyError {
            file: self.file.clone(),
            line: at.line(),
            column: at.column(),
            message: message.into(),
        });
    }

    /// A whole number in `min..=max`, or `None` after reporting why not.
    fn integer(&mut self, s: &S<Num>, path: &str, min: u64, max: u64) -> Option<u64> {
        let value = match &s.value {
            Num::Int(i) => *i,
            Num::Float(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e30 => *x as i128,
            Num::Float(x) if x.is_finite() && *x > 0.0 && x.fract() == 0.0 => i128::MAX,
            other => {
                self.err(
                    &s.referenced,
                    format!("{path}: expected a non-negative integer, got {other}"),
                );
                return None;
            }
        };
        if value < 0 {
            self.err(
                &s.referenced,
                format!("{path}: expected a non-negative integer, got {value}"),
            );
            None
        } else if value > i128::from(max) {
            self.err(
                &s.referenced,
                format!("{path}: too large, at most {max}, got {}", s.value),
            );
            None
        } else if value < i128::from(min) {
            self.err(&s.referenced, format!("{path}: must be at least {min}"));
            None
        } else {
            u64::try_from(value).ok()
        }
    }

    /// A positive `u32` (≥ 1), or `None` when absent or invalid (reported).
    fn positive_u32(&mut self, v: &Option<S<Num>>, path: &str) -> Option<u32> {
        let s = v.as_ref()?;
        self.integer(s, path, 1, u64::from(u32::MAX))
            .and_then(|n| u32::try_from(n).ok())
    }

    /// A positive `u32` (≥ 1), or the default.
    fn at_least_one(&mut self, v: &Option<S<Num>>, path: &str, default: u32) -> u32 {
        self.positive_u32(v, path).unwrap_or(default)
    }

    /// A finite number, or `None` after reporting why not.
    fn number(&mut self, s: &S<Num>, path: &str) -> Option<f64> {
        match &s.value {
            Num::Int(i) => Some(*i as f64),
            Num::Float(x) if x.is_finite() => Some(*x),
            other => {
                self.err(
                    &s.referenced,
                    format!("{path}: expected a finite number, got {other}"),
                );
                None
            }
        }
    }

    /// Seconds as a [`Duration`] (finite, ≥ 0, at most [`MAX_POLICY_SECONDS`]), or the default.
    fn seconds(&mut self, v: &Option<S<Num>>, path: &str, default: Duration) -> Duration {
        let Some(s) = v else {
            return default;
        };
        let Some(x) = self.number(s, path) else {
            return default;
        };
        if x < 0.0 {
            self.err(
                &s.referenced,
                format!(
                    "{path}: must be a non-negative number of seconds, got {}",
                    s.value
                ),
            );
            default
        } else if x > MAX_POLICY_SECONDS {
            self.err(
                &s.referenced,
                format!(
                    "{path}: too large, at most {MAX_POLICY_SECONDS} seconds, got {}",
                    s.value
                ),
            );
            default
        } else {
            Duration::from_secs_f64(x)
        }
    }

    /// A fraction in the range `ok`, described as `range` in the message, or the default.
    fn fraction(
        &mut self,
        v: &Option<S<Num>>,
        path: &str,
        ok: impl Fn(f64) -> bool,
        range: &str,
        default: f64,
    ) -> f64 {
        let Some(s) = v else {
            return default;
        };
        match self.number(s, path) {
            Some(x) if ok(x) => x,
            Some(_) => {
                self.err(
                    &s.referenced,
                    format!("{path}: must be in {range}, got {}", s.value),
                );
                default
            }
            None => default,
        }
    }

    fn trap(&mut self, v: &Trap, path: &str, use_instead: &str) {
        if let Some(s) = v {
            self.err(
                &s.referenced,
                format!(
                    "{path}: literal secret; secrets are referenced, never written into the policy (use {use_instead})"
                ),
            );
        }
    }
}

/// Whether `src` holds no YAML content: only whitespace, comments and a byte-order mark.
fn is_blank_yaml(src: &str) -> bool {
    src.trim_start_matches('\u{feff}').lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#')
    })
}

/// Location wording of the YAML library, suppressed: the position is reported once, in
/// structured form, as the `FILE:LINE:COL` prefix.
struct NoLocationSuffix;

impl serde_saphyr::Localizer for NoLocationSuffix {
    fn attach_location<'a>(
        &self,
        base: std::borrow::Cow<'a, str>,
        _loc: Location,
    ) -> std::borrow::Cow<'a, str> {
        base
    }

    fn alias_used_at(&self, _used: Location) -> String {
        String::new()
    }

    fn alias_defined_at(&self, defined: Location) -> String {
        format!(
            " (the value comes from the anchor at {}:{})",
            defined.line(),
            defined.column()
        )
    }
}

/// The YAML library's end-user wording, with backstop's own text for duplicate keys, and
/// without the refused secret keys among the keys an unknown key's message lists as expected.
struct PolicyMessages;

impl serde_saphyr::MessageFormatter for PolicyMessages {
    fn localizer(&self) -> &dyn serde_saphyr::Localizer {
        &NoLocationSuffix
    }

    fn format_message<'a>(&self, err: &'a serde_saphyr::Error) -> std::borrow::Cow<'a, str> {
        match err {
            serde_saphyr::Error::DuplicateMappingKey { key: Some(key), .. } => {
                format!("duplicate key `{key}` (each key may appear once per mapping)").into()
            }
            serde_saphyr::Error::DuplicateMappingKey { key: None, .. } => {
                "duplicate key (each key may appear once per mapping)".into()
            }
            // The raw types list the refused secret keys as fields (to refuse them by name);
            // they are not among the keys a mapping expects.
            serde_saphyr::Error::SerdeUnknownField {
                field, expected, ..
            } => {
                let expected: Vec<&str> = expected
                    .iter()
                    .copied()
                    .filter(|name| !REFUSED_SECRET_KEYS.contains(name))
                    .collect();
                format!(
                    "unknown field `{field}`, expected one of {}",
                    expected.join(", ")
                )
                .into()
            }
            other => serde_saphyr::UserMessageFormatter.format_message(other),
        }
    }
}

/// The message of a YAML error without any position (the caller reports the library's
/// structured [`Location`] instead) and without the library's configuration advice.
fn yaml_message(e: &serde_saphyr::Error) -> String {
    let mut options = serde_saphyr::RenderOptions::new(&PolicyMessages);
    options.snippets = serde_saphyr::SnippetMode::Off;
    e.render_with_options(options)
}

/// The built-in request class `name` with its SPEC §3 defaults, or `None` for a name that is not
/// one of [`BUILTIN_CLASSES`]:
///
/// | class | `max_attempts` | `max_wait` | `retry_statuses` |
/// |---|---|---|---|
/// | `read` | 4 | 90 s | 408, 429, 500, 502, 503, 504 |
/// | `idempotent_write` | 3 | 120 s | 408, 429, 502, 503, 504 |
/// | `uncertain_write` | 1 | 0 s | none |
/// | `llm_call` | 3 | 60 s | 408, 429, 500, 502, 503, 504, 529 |
///
/// `read` and `llm_call` have `side_effect: none`, the others `write` (see
/// [`crate::side_effect`]). A policy file may override these fields per class; [`Policy`] holds the resulting classes.
///
/// ```
/// use backstop_core::policy::builtin_class;
/// let read = builtin_class("read").unwrap();
/// assert_eq!(read.retry_statuses, [408, 429, 500, 502, 503, 504]);
/// assert!(builtin_class("uncertain_write").unwrap().retry_statuses.is_empty());
/// assert!(builtin_class("bulk").is_none());
/// ```
pub fn builtin_class(name: &str) -> Option<RequestClass> {
    let (max_attempts, max_wait_seconds, retry_statuses): (u32, u64, &[u16]) = match name {
        "read" => (4, 90, &[408, 429, 500, 502, 503, 504]),
        "idempotent_write" => (3, 120, &[408, 429, 502, 503, 504]),
        "uncertain_write" => (1, 0, &[]),
        "llm_call" => (3, 60, &[408, 429, 500, 502, 503, 504, 529]),
        _ => return None,
    };
    Some(RequestClass {
        name: name.to_owned(),
        max_attempts,
        max_wait: Duration::from_secs(max_wait_seconds),
        retry_statuses: retry_statuses.to_vec(),
        side_effect: match name {
            "read" | "llm_call" => SideEffect::None,
            _ => SideEffect::Write,
        },
    })
}

/// First path segments that belong to backstop itself: a provider with one of these names would
/// be shadowed by backstop's own routes (`/v1/…`, `/metrics`). Compared case-insensitively.
pub const RESERVED_PROVIDER_NAMES: [&str; 2] = ["v1", "metrics"];

/// Whether `name` can be the first path segment of the proxy door `/{provider}/{path…}`: not
/// one of [`RESERVED_PROVIDER_NAMES`] (any case), and not the dot segments `.` or `..`, which
/// RFC 3986 §5.2.4 removes from a path before any route is matched.
///
/// # Errors
/// One sentence saying why the name cannot be served and what to do (rename the provider).
///
/// ```
/// use backstop_core::policy::check_provider_name;
/// assert!(check_provider_name("billing").is_ok());
/// assert!(check_provider_name("Metrics").unwrap_err().contains("reserved"));
/// assert!(check_provider_name("..").unwrap_err().contains("dot segment"));
/// ```
pub fn check_provider_name(name: &str) -> Result<(), String> {
    if let Some(reserved) = RESERVED_PROVIDER_NAMES
        .iter()
        .find(|r| r.eq_ignore_ascii_case(name))
    {
        return Err(format!(
            "the name `{name}` is reserved (the proxy door /{name}/… would be shadowed by backstop's own /{reserved} routes); rename the provider"
        ));
    }
    if name == "." || name == ".." {
        return Err(format!(
            "`{name}` is a dot segment, which is removed from request paths (RFC 3986 §5.2.4), so no request could reach this provider; rename the provider"
        ));
    }
    Ok(())
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// Whether `s` is a JSON pointer (RFC 6901 §3): empty, or `/` followed by reference tokens in
/// which `~` appears only as `~0` or `~1`.
///
/// ```
/// use backstop_core::policy::is_json_pointer;
/// assert!(is_json_pointer("/error/code"));
/// assert!(!is_json_pointer("error/code"));
/// assert!(!is_json_pointer("/error/~2"));
/// ```
pub fn is_json_pointer(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    if !s.starts_with('/') {
        return false;
    }
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return false;
        }
    }
    true
}

fn check_pointer(ctx: &mut Ctx, v: &Option<S<String>>, path: &str) -> Option<String> {
    let s = v.as_ref()?;
    if !is_json_pointer(&s.value) {
        ctx.err(
            &s.referenced,
            format!(
                "{path}: `{}` is not a JSON pointer (RFC 6901: empty, or `/` followed by tokens, `~` only as `~0`/`~1`)",
                s.value
            ),
        );
        return None;
    }
    Some(s.value.clone())
}

fn check_header_name(ctx: &mut Ctx, s: &S<String>, path: &str) -> bool {
    if http::HeaderName::from_bytes(s.value.as_bytes()).is_err() {
        ctx.err(
            &s.referenced,
            format!("{path}: `{}` is not a valid HTTP header name", s.value),
        );
        return false;
    }
    true
}

/// Checks that `url` (`http://` or `https://`, no userinfo, query or fragment) parses as the
/// absolute URI every request to the provider is built from, as the gateway's client parses it
/// (`http::Uri`): otherwise every request would fail to connect and burn its budget.
fn check_request_target(url: &str) -> Result<(), String> {
    let uri = url.parse::<http::Uri>().map_err(|e| {
        format!("not a URL a request can be sent to ({e}); expected http(s)://HOST[:PORT][/PATH]")
    })?;
    let authority = uri.authority().map_or("", |a| a.as_str());
    let host = uri.host().unwrap_or("");
    if host.is_empty() || host == "[]" {
        return Err("missing host".to_owned());
    }
    if let Some(port) = authority
        .strip_prefix(host)
        .and_then(|p| p.strip_prefix(':'))
    {
        if port.parse::<u16>().is_err() {
            return Err(format!("the port `{port}` is not a number 0–65535"));
        }
    }
    Ok(())
}

/// Why `name` (any case) cannot carry a provider credential or an idempotency key: HTTP or
/// backstop owns it. `None` for a header free to use.
///
/// HTTP's own: `Host`, `Content-Length`, `Expect` and the hop-by-hop headers of RFC 9110 §7.6.1
/// (`Connection`, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`),
/// which the gateway drops or the client sets per connection. backstop's own: `Prefer` (its
/// `wait` and `respond-async` preferences are read and removed) and every `X-Backstop-*`
/// header, none of which reaches the provider.
fn owned_header(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    if name.starts_with("x-backstop-") {
        Some("`X-Backstop-*` headers are backstop's own and never reach the provider")
    } else if name.starts_with("proxy-")
        || matches!(
            name.as_str(),
            "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
        )
    {
        Some("a hop-by-hop header (RFC 9110 §7.6.1): it is removed before a request is forwarded")
    } else if matches!(name.as_str(), "host" | "content-length" | "expect") {
        Some("HTTP owns it: the gateway's client sets it for each request")
    } else if name == "prefer" {
        Some("backstop reads its `wait` and `respond-async` preferences and rewrites it")
    } else {
        None
    }
}

/// Refuses an `idempotency_header` that carries credentials or that HTTP or backstop owns (see
/// [`owned_header`]): the key is stored, audited and echoed in answers, so a credential header
/// there would put the agent's token (or the provider's secret) in the audit log.
fn check_idempotency_header(
    ctx: &mut Ctx,
    s: &S<String>,
    path: &str,
    credential_header: Option<&str>,
) -> bool {
    let lower = s.value.to_ascii_lowercase();
    let credential_reason = "it carries credentials, and an idempotency key is stored, audited \
                             and echoed in answers";
    let reason = if matches!(
        lower.as_str(),
        "authorization" | "proxy-authorization" | "cookie" | "set-cookie"
    ) {
        Some(credential_reason.to_owned())
    } else if credential_header.is_some_and(|c| c.eq_ignore_ascii_case(&s.value)) {
        Some(format!(
            "it is the provider's `credential.header`: {credential_reason}"
        ))
    } else {
        owned_header(&s.value).map(str::to_owned)
    };
    match reason {
        Some(reason) => {
            ctx.err(
                &s.referenced,
                format!(
                    "{path}: `{}` cannot carry the idempotency key: {reason}",
                    s.value
                ),
            );
            false
        }
        None => true,
    }
}

/// Refuses a credential `header` that HTTP or backstop owns (see [`owned_header`]), or that is
/// `Idempotency-Key` while the provider has no `idempotency_header` (`has_key_header` false):
/// backstop then reads the agent's key there and removes it before forwarding. A credential
/// header equal to the `idempotency_header` is refused by [`check_idempotency_header`].
fn check_credential_header(ctx: &mut Ctx, s: &S<String>, path: &str, has_key_header: bool) {
    let reason = if !has_key_header && s.value.eq_ignore_ascii_case("idempotency-key") {
        Some(
            "without an `idempotency_header` it is where backstop reads the agent's idempotency \
             key, and it is removed before forwarding, so the credential would never reach the \
             provider",
        )
    } else {
        owned_header(&s.value)
    };
    if let Some(reason) = reason {
        ctx.err(
            &s.referenced,
            format!(
                "{path}: `{}` cannot carry the credential: {reason}",
                s.value
            ),
        );
    }
}

/// SPEC §1/§6: an uncertain write (no honoured idempotency key) is never resent blindly — the
/// provider may already have applied it — so its class allows one attempt and no retry statuses;
/// what comes next is reconciliation or an escalation.
fn check_uncertain_write(
    raw: &RawClass,
    max_attempts: u32,
    retry_statuses: &[u16],
    path: &str,
    ctx: &mut Ctx,
) {
    let why = "an uncertain write is never resent blindly (the provider may already have applied \
               it); it is reconciled or escalated instead (SPEC §6)";
    if max_attempts > 1 {
        if let Some(s) = &raw.max_attempts {
            ctx.err(
                &s.referenced,
                format!("{path}.max_attempts: must be 1, got {max_attempts}: {why}"),
            );
        }
    }
    if !retry_statuses.is_empty() {
        if let Some(s) = &raw.retry_statuses {
            ctx.err(
                &s.referenced,
                format!("{path}.retry_statuses: must be empty, got {retry_statuses:?}: {why}"),
            );
        }
    }
}

/// `listen`: `HOST:PORT` as a TCP listener binds it — an IPv4 address, a bracketed IPv6 address
/// or a host name, and a port 0–65535 (0 picks a free port).
fn check_listen(value: &str) -> Result<(), String> {
    let expected = "expected HOST:PORT such as 127.0.0.1:8080 or [::1]:8080";
    if value.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let Some((host, port)) = value.rsplit_once(':') else {
        return Err(format!("`{value}` has no port; {expected}"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!(
            "`{value}`: the port `{port}` is not a number 0–65535; {expected}"
        ));
    }
    let is_host_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if is_host_name {
        Ok(())
    } else {
        Err(format!(
            "`{value}`: `{host}` is not an IP address or host name; {expected}"
        ))
    }
}

/// Whether `name` is a portable environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Checks a secret or token reference (`secret_env`, `token_file`, …). An environment reference
/// must be a variable *name*; a file reference must not be empty. The message never repeats the
/// value: a value that is not a name is most likely the secret itself.
fn check_secret_ref(ctx: &mut Ctx, s: &S<String>, path: &str, env: bool) -> bool {
    if env && !is_env_name(&s.value) {
        let got = if s.value.is_empty() {
            "empty"
        } else {
            "not a name"
        };
        ctx.err(
            &s.referenced,
            format!(
                "{path}: {got}; give the NAME of the environment variable holding the secret \
                 (letters, digits and `_`, not starting with a digit), never the secret (value not shown)"
            ),
        );
        return false;
    }
    if !env && s.value.trim().is_empty() {
        ctx.err(
            &s.referenced,
            format!("{path}: empty; give the path of the file holding the secret"),
        );
        return false;
    }
    true
}

/// The `side_effect` of a class: `none` or `write`, else `default` with an error at the value.
fn class_side_effect(c: &RawClass, default: SideEffect, path: &str, ctx: &mut Ctx) -> SideEffect {
    let Some(value) = &c.side_effect else {
        return default;
    };
    SideEffect::parse(&value.value).unwrap_or_else(|| {
        ctx.err(
            &value.referenced,
            format!(
                "{path}.side_effect: unknown value `{}` (one of {})",
                value.value,
                crate::side_effect::SIDE_EFFECTS.join(", ")
            ),
        );
        default
    })
}

fn validate(raw: RawPolicy, ctx: &mut Ctx) -> Policy {
    // Request classes: built-ins first, then the file's.
    let mut request_classes: BTreeMap<String, RequestClass> = BUILTIN_CLASSES
        .iter()
        .filter_map(|n| builtin_class(n).map(|c| (n.to_string(), c)))
        .collect();
    for (key, class) in raw.request_classes.map(|m| m.0).unwrap_or_default() {
        let name = key.value.clone();
        let path = format!("request_classes.{name}");
        if !is_name(&name) {
            ctx.err(
                &key.referenced,
                format!("{path}: a class name uses letters, digits, `_`, `-`, `.` or `:`"),
            );
        }
        let builtin = builtin_class(&name);
        let c = &class.value;
        if builtin.is_none() {
            for (missing, field) in [
                (c.max_attempts.is_none(), "max_attempts"),
                (c.max_wait_seconds.is_none(), "max_wait_seconds"),
            ] {
                if missing {
                    ctx.err(
                        &class.referenced,
                        format!("{path}: missing `{field}` (required for a configured class)"),
                    );
                }
            }
        }
        let defaults = builtin.unwrap_or(RequestClass {
            name: name.clone(),
            max_attempts: 1,
            max_wait: Duration::ZERO,
            retry_statuses: Vec::new(),
            side_effect: SideEffect::Write,
        });
        let max_attempts = ctx.at_least_one(
            &c.max_attempts,
            &format!("{path}.max_attempts"),
            defaults.max_attempts,
        );
        let max_wait = ctx.seconds(
            &c.max_wait_seconds,
            &format!("{path}.max_wait_seconds"),
            defaults.max_wait,
        );
        let retry_statuses = match &c.retry_statuses {
            Some(list) => {
                let mut statuses = BTreeSet::new();
                for status in &list.value {
                    let Some(code) =
                        ctx.integer(status, &format!("{path}.retry_statuses"), 0, u64::MAX)
                    else {
                        continue;
                    };
                    if !(100..=599).contains(&code) {
                        ctx.err(
                            &status.referenced,
                            format!(
                                "{path}.retry_statuses: {code} is not an HTTP status (100–599)"
                            ),
                        );
                    } else if (200..=299).contains(&code) {
                        ctx.err(
                            &status.referenced,
                            format!(
                                "{path}.retry_statuses: {code} is a success; it cannot be retried"
                            ),
                        );
                    } else if let Ok(code) = u16::try_from(code) {
                        if !statuses.insert(code) {
                            ctx.err(
                                &status.referenced,
                                format!("{path}.retry_statuses: {code} is listed twice"),
                            );
                        }
                    }
                }
                statuses.into_iter().collect()
            }
            None => defaults.retry_statuses,
        };
        if name == "uncertain_write" {
            check_uncertain_write(c, max_attempts, &retry_statuses, &path, ctx);
        }
        let side_effect = class_side_effect(c, defaults.side_effect, &path, ctx);
        request_classes.insert(
            name.clone(),
            RequestClass {
                name,
                max_attempts,
                max_wait,
                retry_statuses,
                side_effect,
            },
        );
    }

    let shared_scope = match &raw.shared_scope {
        Some(s) => SharedScope {
            max_delayed_requests: ctx.at_least_one(
                &s.value.max_delayed_requests,
                "shared_scope.max_delayed_requests",
                25,
            ),
            max_concurrent_requests: ctx.at_least_one(
                &s.value.max_concurrent_requests,
                "shared_scope.max_concurrent_requests",
                2,
            ),
        },
        None => SharedScope {
            max_delayed_requests: 25,
            max_concurrent_requests: 2,
        },
    };

    let backoff = validate_backoff(raw.backoff.as_ref(), ctx);
    let breaker = validate_breaker(raw.breaker.as_ref(), ctx);
    let retry_quota = validate_retry_quota(raw.retry_quota.as_ref(), ctx);

    let mut tokens = TokenSources::default();
    let agents = validate_principals(raw.agents, "agents", &mut tokens, ctx);
    if agents.is_empty() {
        ctx.warn(
            1,
            1,
            "agents: none configured, so no agent can call the gateway (add `agents:` with a token_env, token_file or token_sha256 per agent)",
        );
    }
    let operators = validate_principals(raw.operators, "operators", &mut tokens, ctx);

    let mut providers = BTreeMap::new();
    for (key, provider) in raw.providers.map(|m| m.0).unwrap_or_default() {
        if let Some(p) = validate_provider(&key, provider, &request_classes, &shared_scope, ctx) {
            providers.insert(p.name.clone(), p);
        }
    }
    if operators.is_empty() && !providers.is_empty() {
        ctx.warn(
            1,
            1,
            "operators: none configured, but calls through these providers can be escalated (a write whose outcome is uncertain, an exhausted shared quota, a boundary past the deadline) and no one could decide them: `escalations list` and `decide` would refuse every token (add `operators:` with a token_env, token_file or token_sha256)",
        );
    }

    if let Some(store) = &raw.store {
        if store.value.trim().is_empty() {
            ctx.err(
                &store.referenced,
                "store: must be the path of the SQLite database file, not empty",
            );
        }
    }
    if let Some(listen) = &raw.listen {
        if let Err(reason) = check_listen(&listen.value) {
            ctx.err(&listen.referenced, format!("listen: {reason}"));
        }
    }

    Policy {
        file: ctx.file.clone(),
        store: raw.store.map(|s| PathBuf::from(s.value)),
        listen: raw.listen.map(|s| s.value),
        request_classes,
        shared_scope,
        backoff,
        breaker,
        retry_quota,
        agents,
        operators,
        providers,
        warnings: Vec::new(),
    }
}

fn validate_backoff(raw: Option<&S<RawBackoff>>, ctx: &mut Ctx) -> BackoffPolicy {
    let defaults = BackoffPolicy {
        base: Duration::from_secs(1),
        max: Duration::from_secs(60),
        min_delay: Duration::from_secs(1),
        retry_after_ceiling: Duration::from_secs(86_400),
        boundary_spread: Duration::from_secs(5),
    };
    let Some(raw) = raw else {
        return defaults;
    };
    let b = &raw.value;
    let policy = BackoffPolicy {
        base: ctx.seconds(&b.base_seconds, "backoff.base_seconds", defaults.base),
        max: ctx.seconds(&b.max_seconds, "backoff.max_seconds", defaults.max),
        min_delay: ctx.seconds(
            &b.min_delay_seconds,
            "backoff.min_delay_seconds",
            defaults.min_delay,
        ),
        retry_after_ceiling: ctx.seconds(
            &b.retry_after_ceiling_seconds,
            "backoff.retry_after_ceiling_seconds",
            defaults.retry_after_ceiling,
        ),
        boundary_spread: ctx.seconds(
            &b.boundary_spread_seconds,
            "backoff.boundary_spread_seconds",
            defaults.boundary_spread,
        ),
    };
    if let (Some(s), true) = (&b.boundary_spread_seconds, policy.boundary_spread.is_zero()) {
        ctx.warn(
            s.referenced.line(),
            s.referenced.column(),
            "backoff.boundary_spread_seconds: 0 turns off the jitter after a provider boundary, so every retry one boundary releases (one 429's Retry-After delays the whole scope) goes out in the same instant, as one burst that can hit the limit again (SPEC §4.2); keep it above 0 unless one agent's retries alone use the scope",
        );
    }
    if let (Some(s), true) = (&b.base_seconds, policy.base < MIN_BACKOFF_BASE) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.base_seconds: must be at least {} seconds, got {} (the first retry \
                 waits at most twice the base, so a smaller one retries a failing request \
                 within milliseconds, a tight retry loop)",
                MIN_BACKOFF_BASE.as_secs_f64(),
                s.value
            ),
        );
    }
    if let (Some(s), true) = (
        &b.min_delay_seconds,
        policy.min_delay < MIN_RETRY_DELAY_FLOOR,
    ) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.min_delay_seconds: must be at least {} seconds, got {} (it is the \
                 shortest wait after a Retry-After of 0 or a reset already past, so a smaller \
                 one retries a throttled request within milliseconds, a tight retry loop)",
                MIN_RETRY_DELAY_FLOOR.as_secs_f64(),
                s.value
            ),
        );
    }
    if policy.max < policy.base {
        let at = b
            .max_seconds
            .as_ref()
            .map(|s| s.referenced)
            .unwrap_or(raw.referenced);
        ctx.err(
            &at,
            "backoff.max_seconds: must be at least backoff.base_seconds",
        );
    }
    let short_ceiling = policy.retry_after_ceiling < MIN_RETRY_AFTER_CEILING;
    if let (Some(s), true) = (&b.retry_after_ceiling_seconds, short_ceiling) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.retry_after_ceiling_seconds: must be at least {} second, got {} \
                 (providers give Retry-After in whole seconds, so a smaller ceiling treats \
                 every delay of a second or more as absurd: throttled requests are retried on \
                 local backoff alone, before the provider allows it)",
                MIN_RETRY_AFTER_CEILING.as_secs(),
                s.value
            ),
        );
    } else if policy.retry_after_ceiling < policy.min_delay {
        let at = b
            .retry_after_ceiling_seconds
            .as_ref()
            .map(|s| s.referenced)
            .unwrap_or(raw.referenced);
        ctx.err(
            &at,
            "backoff.retry_after_ceiling_seconds: must be at least backoff.min_delay_seconds",
        );
    }
    policy
}

fn validate_breaker(raw: Option<&S<RawBreaker>>, ctx: &mut Ctx) -> BreakerPolicy {
    let defaults = BreakerPolicy::default();
    let Some(raw) = raw else {
        return defaults;
    };
    let b = &raw.value;
    let threshold = ctx.at_least_one(&b.threshold, "breaker.threshold", defaults.threshold);
    let forget_after = ctx.seconds(
        &b.forget_after_seconds,
        "breaker.forget_after_seconds",
        defaults.forget_after,
    );
    let too_short = forget_after < MIN_FORGET_AFTER;
    if let (Some(s), true) = (&b.forget_after_seconds, too_short) {
        ctx.err(
            &s.referenced,
            format!(
                "breaker.forget_after_seconds: must be at least {} second, got {} (a breaker \
                 forgotten sooner after a failure is forgotten before the same request can \
                 fail again, so its circuit would never open)",
                MIN_FORGET_AFTER.as_secs(),
                s.value
            ),
        );
    }
    BreakerPolicy {
        threshold,
        forget_after: if too_short {
            defaults.forget_after
        } else {
            forget_after
        },
    }
}

fn validate_retry_quota(raw: Option<&S<RawRetryQuota>>, ctx: &mut Ctx) -> RetryQuotaConfig {
    let defaults = RetryQuotaConfig::default();
    let Some(raw) = raw else {
        return defaults;
    };
    let q = &raw.value;
    let capacity = ctx.positive_u32(&q.capacity, "retry_quota.capacity");
    let retry_cost = ctx.positive_u32(&q.retry_cost, "retry_quota.retry_cost");
    let timeout_cost = ctx.positive_u32(&q.timeout_cost, "retry_quota.timeout_cost");
    let success_refund = match &q.success_refund {
        Some(s) => ctx
            .integer(s, "retry_quota.success_refund", 0, u64::from(u32::MAX))
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(defaults.success_refund),
        None => defaults.success_refund,
    };
    // A cost is compared with the capacity the file states (or the default when it states
    // none); an invalid capacity was already reported and is not compared with.
    let capacity_valid = q.capacity.is_none() || capacity.is_some();
    let capacity = capacity.unwrap_or(defaults.capacity);
    let retry_cost = retry_cost.unwrap_or(defaults.retry_cost);
    let timeout_cost = timeout_cost.unwrap_or(defaults.timeout_cost);
    for (value, field, v) in [
        (retry_cost, "retry_cost", &q.retry_cost),
        (timeout_cost, "timeout_cost", &q.timeout_cost),
    ] {
        if capacity_valid && value > capacity {
            let at = v.as_ref().map(|s| s.referenced).unwrap_or(raw.referenced);
            let whose = if q.capacity.is_some() {
                "the capacity"
            } else {
                "the default capacity"
            };
            ctx.err(
                &at,
                format!(
                    "retry_quota.{field}: {value} exceeds {whose} {capacity}; no retry could ever be paid"
                ),
            );
        }
    }
    RetryQuotaConfig {
        capacity,
        retry_cost,
        timeout_cost,
        success_refund,
    }
}

/// The token sources of the agents and operators read so far (`token_sha256` digests,
/// `token_env` variables, `token_file` paths), each with its `section.NAME.field` and where it
/// was written: two callers sharing one token could not be told apart.
#[derive(Default)]
struct TokenSources(Vec<(TokenRef, String, u64, u64)>);

impl TokenSources {
    /// Records `source` for `place` (`agents.NAME.token_env`), or reports it at `at` naming the
    /// earlier entry with the same source.
    fn claim(&mut self, source: &TokenRef, place: &str, at: &Location, ctx: &mut Ctx) {
        if let Some((_, first, line, column)) = self.0.iter().find(|(seen, ..)| seen == source) {
            let (owner, _) = place.rsplit_once('.').unwrap_or((place, ""));
            let (first_owner, _) = first.rsplit_once('.').unwrap_or((first, ""));
            let file = &ctx.file;
            let what = match source {
                TokenRef::Sha256(_) => "digest",
                TokenRef::Env(_) => "environment variable",
                TokenRef::File(_) => "file",
            };
            let message = format!(
                "{place}: the same {what} as {first} ({file}:{line}:{column}), so {first_owner} and {owner} would have one token and a caller presenting it could be either; give each agent and operator its own token"
            );
            ctx.err(at, message);
        } else {
            self.0
                .push((source.clone(), place.to_owned(), at.line(), at.column()));
        }
    }
}

fn validate_principals(
    raw: Option<SpannedMap<S<RawPrincipal>>>,
    section: &str,
    tokens: &mut TokenSources,
    ctx: &mut Ctx,
) -> BTreeMap<String, TokenRef> {
    let mut out = BTreeMap::new();
    for (key, principal) in raw.map(|m| m.0).unwrap_or_default() {
        let path = format!("{section}.{}", key.value);
        let p = &principal.value;
        let use_instead = "token_env, token_file or token_sha256";
        ctx.trap(&p.token, &format!("{path}.token"), use_instead);
        ctx.trap(&p.secret, &format!("{path}.secret"), use_instead);
        ctx.trap(&p.password, &format!("{path}.password"), use_instead);
        ctx.trap(&p.api_key, &format!("{path}.api_key"), use_instead);
        let mut refs = Vec::new();
        if let Some(s) = &p.token_env {
            check_secret_ref(ctx, s, &format!("{path}.token_env"), true);
            let source = TokenRef::Env(s.value.clone());
            tokens.claim(&source, &format!("{path}.token_env"), &s.referenced, ctx);
            refs.push(source);
        }
        if let Some(s) = &p.token_file {
            check_secret_ref(ctx, s, &format!("{path}.token_file"), false);
            let source = TokenRef::File(PathBuf::from(&s.value));
            tokens.claim(&source, &format!("{path}.token_file"), &s.referenced, ctx);
            refs.push(source);
        }
        if let Some(s) = &p.token_sha256 {
            let digest = s.value.trim().to_ascii_lowercase();
            if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                ctx.err(
                    &s.referenced,
                    format!("{path}.token_sha256: must be 64 hex digits (a SHA-256 digest)"),
                );
            }
            let source = TokenRef::Sha256(digest);
            tokens.claim(&source, &format!("{path}.token_sha256"), &s.referenced, ctx);
            refs.push(source);
        }
        match refs.len() {
            1 => {
                out.insert(key.value.clone(), refs.remove(0));
            }
            0 => {
                if p.token.is_none()
                    && p.secret.is_none()
                    && p.password.is_none()
                    && p.api_key.is_none()
                {
                    ctx.err(
                        &key.referenced,
                        format!("{path}: needs exactly one of {use_instead}"),
                    );
                }
            }
            _ => ctx.err(
                &key.referenced,
                format!("{path}: give only one of {use_instead}"),
            ),
        }
    }
    out
}

fn validate_provider(
    key: &S<String>,
    raw: S<RawProvider>,
    classes: &BTreeMap<String, RequestClass>,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> Option<Provider> {
    let name = key.value.clone();
    let path = format!("providers.{name}");
    if !is_name(&name) || name.contains('/') {
        ctx.err(
            &key.referenced,
            format!("{path}: a provider name uses letters, digits, `_`, `-`, `.` or `:`"),
        );
    } else if let Err(reason) = check_provider_name(&name) {
        ctx.err(&key.referenced, format!("{path}: {reason}"));
    }
    let p = raw.value;
    let use_instead = "credential.secret_env or credential.secret_file";
    ctx.trap(&p.secret, &format!("{path}.secret"), use_instead);
    ctx.trap(&p.token, &format!("{path}.token"), use_instead);
    ctx.trap(&p.api_key, &format!("{path}.api_key"), use_instead);

    let base_url = match &p.base_url {
        Some(s) => {
            let url = s.value.trim_end_matches('/').to_owned();
            let rest = url
                .strip_prefix("https://")
                .or_else(|| url.strip_prefix("http://"));
            match rest {
                None => ctx.err(
                    &s.referenced,
                    format!("{path}.base_url: must start with http:// or https://"),
                ),
                Some(rest) => {
                    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
                    if rest.contains(['?', '#']) {
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: must not carry a query string or fragment (they can hold keys; use {use_instead} for credentials; value not shown)"),
                        );
                    } else if authority.contains('@') {
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: literal secret; credentials in the URL are not allowed (use {use_instead})"),
                        );
                    } else if authority.is_empty() {
                        ctx.err(&s.referenced, format!("{path}.base_url: missing host"));
                    } else if let Some(c) = rest[authority.len()..].chars().find(|c| !c.is_ascii())
                    {
                        // http::Uri refuses a non-ASCII host but lets such a path through;
                        // sent raw, its bytes are not a valid request target (RFC 9112 §3.2).
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: the path holds `{c}`, which is not ASCII; a URL path is ASCII, so percent-encode the character's UTF-8 bytes (e.g. `é` as `%C3%A9`)"),
                        );
                    } else if let Err(reason) = check_request_target(&url) {
                        ctx.err(&s.referenced, format!("{path}.base_url: {reason}"));
                    }
                }
            }
            url
        }
        None => {
            ctx.err(&key.referenced, format!("{path}: missing `base_url`"));
            String::new()
        }
    };

    let credential = p
        .credential
        .as_ref()
        .and_then(|c| validate_credential(c, &format!("{path}.credential"), ctx));

    let dialect = match &p.dialect {
        Some(d) => {
            match serde_json::from_value::<Dialect>(serde_json::Value::String(d.value.clone())) {
                Ok(dialect) => dialect,
                Err(_) => {
                    ctx.err(
                        &d.referenced,
                        format!(
                            "{path}.dialect: unknown dialect `{}` (one of {})",
                            d.value,
                            DIALECTS.join(", ")
                        ),
                    );
                    Dialect::Generic
                }
            }
        }
        None => Dialect::Generic,
    };

    let credential_header = p.credential.as_ref().map(|c| {
        c.value
            .header
            .as_ref()
            .map_or("Authorization", |h| h.value.as_str())
    });
    let idempotency_header = p.idempotency_header.as_ref().and_then(|s| {
        let field = format!("{path}.idempotency_header");
        (check_header_name(ctx, s, &field)
            && check_idempotency_header(ctx, s, &field, credential_header))
        .then(|| s.value.clone())
    });
    // A credential header equal to the `idempotency_header` is reported there, once.
    if let Some(header) = p.credential.as_ref().and_then(|c| c.value.header.as_ref()) {
        let key_header = p.idempotency_header.as_ref().map(|s| s.value.as_str());
        if !key_header.is_some_and(|k| k.eq_ignore_ascii_case(&header.value))
            && http::HeaderName::from_bytes(header.value.as_bytes()).is_ok()
        {
            let field = format!("{path}.credential.header");
            check_credential_header(ctx, header, &field, key_header.is_some());
        }
    }
    // Absent: the dialect's documented place, if it has one (OpenAI: /error/code), so that a
    // provider declared `dialect: openai` reads `insufficient_quota` without more settings.
    let error_code_pointer = match &p.error_code_pointer {
        Some(_) => check_pointer(
            ctx,
            &p.error_code_pointer,
            &format!("{path}.error_code_pointer"),
        ),
        None => dialect.error_code_pointer().map(str::to_owned),
    };
    let mut error_codes = BTreeMap::new();
    for (code, disposition) in p.error_codes.map(|m| m.0).unwrap_or_default() {
        match serde_json::from_value::<Disposition>(serde_json::Value::String(
            disposition.value.clone(),
        )) {
            Ok(d) => {
                error_codes.insert(code.value, d);
            }
            Err(_) => ctx.err(
                &disposition.referenced,
                format!(
                    "{path}.error_codes.{}: unknown disposition `{}` (one of {})",
                    code.value,
                    disposition.value,
                    DISPOSITIONS.join(", ")
                ),
            ),
        }
    }
    let pointer_list = |ctx: &mut Ctx, v: &Option<S<Vec<S<String>>>>, field: &str| -> Vec<String> {
        v.as_ref()
            .map(|list| {
                list.value
                    .iter()
                    .filter_map(|f| {
                        check_pointer(ctx, &Some(f.clone()), &format!("{path}.{field}"))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let retry_delay_pointers = pointer_list(ctx, &p.retry_delay_pointers, "retry_delay_pointers");
    let quota_id_pointers = pointer_list(ctx, &p.quota_id_pointers, "quota_id_pointers");
    let resets_in_seconds_pointers = pointer_list(
        ctx,
        &p.resets_in_seconds_pointers,
        "resets_in_seconds_pointers",
    );
    if !error_codes.is_empty() && error_code_pointer.is_none() && p.error_code_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `error_codes` needs `error_code_pointer` to find the code in an error body"),
        );
    }

    let mut scopes = BTreeMap::new();
    let scope_entries = p.scopes.map(|m| m.0).unwrap_or_default();
    if scope_entries.is_empty() {
        ctx.warn(
            key.referenced.line(),
            key.referenced.column(),
            format!("{path}: no scopes, so its calls share no quota record, pacing or concurrency limit (add `scopes:`)"),
        );
    }
    for (scope_key, scope) in scope_entries {
        let scope_path = format!("{path}.scopes.{}", scope_key.value);
        if !is_name(&scope_key.value) {
            ctx.err(
                &scope_key.referenced,
                format!("{scope_path}: a scope name uses letters, digits, `_`, `-`, `.` or `:`"),
            );
        }
        let s = validate_scope(&name, &scope_key.value, &scope, &scope_path, shared, ctx);
        scopes.insert(scope_key.value.clone(), s);
    }

    let scope_ref = |ctx: &mut Ctx, s: &S<String>, at: &str| -> Option<String> {
        let short = s
            .value
            .strip_prefix(&format!("{name}/"))
            .unwrap_or(&s.value);
        if scopes.contains_key(short) {
            Some(format!("{name}/{short}"))
        } else {
            let known: Vec<&str> = scopes.keys().map(String::as_str).collect();
            ctx.err(
                &s.referenced,
                format!(
                    "{at}: unknown scope `{}` (provider {name} has: {})",
                    s.value,
                    if known.is_empty() {
                        "no scopes".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            );
            None
        }
    };

    let default_scopes = match &p.default_scopes {
        Some(list) => list
            .value
            .iter()
            .filter_map(|s| scope_ref(ctx, s, &format!("{path}.default_scopes")))
            .collect(),
        None => scopes.values().map(|s| s.name.clone()).collect::<Vec<_>>(),
    };

    let mut routes: Vec<Route> = Vec::new();
    // Each route's shape (method, literal segments, parameters without their names) and its key
    // and position: two routes of one shape match exactly the same requests.
    #[allow(clippy::type_complexity)]
    let mut seen_routes: BTreeMap<
        (String, Vec<Option<String>>),
        (String, Vec<Segment>, u64, u64),
    > = BTreeMap::new();
    for (route_key, route) in p.routes.map(|m| m.0).unwrap_or_default() {
        let route_path = format!("{path}.routes.\"{}\"", route_key.value);
        let Some((method, template, segments)) = parse_route_key(&route_key, &route_path, ctx)
        else {
            continue;
        };
        let shape = segments
            .iter()
            .map(|segment| match segment {
                Segment::Literal(text) => Some(text.clone()),
                Segment::Param(_) => None,
            })
            .collect();
        match seen_routes.entry((method.clone(), shape)) {
            std::collections::btree_map::Entry::Occupied(first) => {
                let (first_key, first_segments, line, column) = first.get();
                let message = if *first_segments == segments {
                    format!(
                        "{route_path}: the same method and template are already routed by route \"{first_key}\" ({}:{line}:{column})",
                        ctx.file
                    )
                } else {
                    format!(
                        "{route_path}: matches exactly the same requests as route \"{first_key}\" ({}:{line}:{column}), only the parameter names differ, so which of them applies would be ambiguous; keep one",
                        ctx.file
                    )
                };
                ctx.err(&route_key.referenced, message);
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert((
                    format!("{method} {template}"),
                    segments.clone(),
                    route_key.referenced.line(),
                    route_key.referenced.column(),
                ));
            }
        }
        let r = &route.value;
        // An unknown class is reported and the route's other members are still checked, so
        // that one run names every problem; the route itself is then left out.
        let class = match &r.class {
            Some(c) if classes.contains_key(&c.value) => Some(c.value.clone()),
            Some(c) => {
                ctx.err(
                    &c.referenced,
                    format!(
                        "{route_path}.class: unknown request class `{}` (known: {})",
                        c.value,
                        classes.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                );
                None
            }
            None => {
                let provider_stub = Provider {
                    name: name.clone(),
                    base_url: String::new(),
                    credential: None,
                    dialect: Dialect::Generic,
                    idempotency_header: idempotency_header.clone(),
                    idempotent_put_delete: p
                        .idempotent_put_delete
                        .as_ref()
                        .is_some_and(|b| b.value),
                    error_code_pointer: None,
                    error_codes: BTreeMap::new(),
                    retry_delay_pointers: Vec::new(),
                    quota_id_pointers: Vec::new(),
                    resets_in_seconds_pointers: Vec::new(),
                    honour_hints: true,
                    scopes: BTreeMap::new(),
                    default_scopes: Vec::new(),
                    routes: Vec::new(),
                };
                Some(default_class(&provider_stub, &method).to_owned())
            }
        };
        if let Some(c) = r.class.as_ref().filter(|c| c.value == "idempotent_write") {
            if idempotency_header.is_none() && p.idempotency_header.is_none() {
                let put_delete = matches!(method.as_str(), "PUT" | "DELETE");
                let contract = p.idempotent_put_delete.as_ref().is_some_and(|b| b.value);
                if put_delete && contract {
                    ctx.warn(
                        c.referenced.line(),
                        c.referenced.column(),
                        format!("{route_path}.class: `idempotent_write` without an `idempotency_header`: retries rely on the provider's idempotent {method} contract (`idempotent_put_delete: true`) alone; no key lets the provider deduplicate them"),
                    );
                } else if !matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS") {
                    ctx.err(
                        &c.referenced,
                        format!("{route_path}.class: `idempotent_write` needs the provider to honour an idempotency key (SPEC §3), but providers.{name} has no `idempotency_header`, so retries of this {method} would not be deduplicated{}; set `idempotency_header` or use `uncertain_write`", if put_delete { " (and `idempotent_put_delete` is not true)" } else { "" }),
                    );
                }
            }
        }
        let route_scopes = match &r.scopes {
            Some(list) => list
                .value
                .iter()
                .filter_map(|s| scope_ref(ctx, s, &format!("{route_path}.scopes")))
                .collect(),
            None => default_scopes.clone(),
        };
        let coalesce = r.coalesce.as_ref().is_some_and(|c| c.value);
        if let Some(c) = r.coalesce.as_ref().filter(|c| c.value) {
            if !matches!(method.as_str(), "GET" | "HEAD")
                || class.as_deref().is_some_and(|c| c != "read")
            {
                ctx.err(
                    &c.referenced,
                    format!("{route_path}.coalesce: only safe reads (GET/HEAD of class `read`) may be coalesced"),
                );
            }
        }
        let fingerprint_fields = match &r.fingerprint_fields {
            Some(list) => list
                .value
                .iter()
                .filter_map(|f| {
                    check_pointer(
                        ctx,
                        &Some(f.clone()),
                        &format!("{route_path}.fingerprint_fields"),
                    )
                })
                .collect(),
            None => Vec::new(),
        };
        let reconcile = r.reconcile.as_ref().and_then(|rc| {
            validate_reconcile(
                rc,
                &format!("{route_path}.reconcile"),
                idempotency_header.is_some(),
                ctx,
            )
        });
        let Some(class) = class else {
            continue;
        };
        routes.push(Route {
            method,
            template,
            segments,
            class,
            scopes: route_scopes,
            coalesce,
            fingerprint_fields,
            reconcile,
        });
    }

    Some(Provider {
        name: name.clone(),
        base_url,
        credential,
        dialect,
        idempotency_header,
        idempotent_put_delete: p.idempotent_put_delete.as_ref().is_some_and(|b| b.value),
        error_code_pointer,
        error_codes,
        retry_delay_pointers,
        quota_id_pointers,
        resets_in_seconds_pointers,
        honour_hints: p.honour_hints.as_ref().is_none_or(|b| b.value),
        scopes,
        default_scopes,
        routes,
    })
}

fn validate_credential(raw: &S<RawCredential>, path: &str, ctx: &mut Ctx) -> Option<Credential> {
    let c = &raw.value;
    let use_instead = "secret_env or secret_file";
    ctx.trap(&c.secret, &format!("{path}.secret"), use_instead);
    ctx.trap(&c.value, &format!("{path}.value"), use_instead);
    ctx.trap(&c.token, &format!("{path}.token"), use_instead);
    ctx.trap(&c.api_key, &format!("{path}.api_key"), use_instead);
    ctx.trap(&c.password, &format!("{path}.password"), use_instead);
    let header = match &c.header {
        Some(h) => {
            if http::HeaderName::from_bytes(h.value.as_bytes()).is_err() {
                ctx.err(
                    &h.referenced,
                    format!(
                        "{path}.header: not a valid HTTP header field name (no `:` or spaces; \
                         the name only, e.g. `Authorization`, never the secret; value not shown)"
                    ),
                );
            }
            h.value.clone()
        }
        None => "Authorization".to_owned(),
    };
    let scheme = c
        .scheme
        .as_ref()
        .map(|s| s.value.clone())
        .unwrap_or_else(|| "Bearer".to_owned());
    if scheme.chars().any(char::is_whitespace) {
        if let Some(s) = &c.scheme {
            ctx.err(
                &s.referenced,
                format!(
                    "{path}.scheme: one word such as `Bearer` or empty (a secret never goes here)"
                ),
            );
        }
    }
    let secret = match (&c.secret_env, &c.secret_file) {
        (Some(env), None) => {
            if !check_secret_ref(ctx, env, &format!("{path}.secret_env"), true) {
                return None;
            }
            SecretRef::Env(env.value.clone())
        }
        (None, Some(file)) => {
            if !check_secret_ref(ctx, file, &format!("{path}.secret_file"), false) {
                return None;
            }
            SecretRef::File(PathBuf::from(&file.value))
        }
        (Some(_), Some(file)) => {
            ctx.err(
                &file.referenced,
                format!("{path}: give only one of {use_instead}"),
            );
            return None;
        }
        (None, None) => {
            let trapped = [&c.secret, &c.value, &c.token, &c.api_key, &c.password]
                .iter()
                .any(|t| t.is_some());
            if !trapped {
                ctx.err(
                    &raw.referenced,
                    format!("{path}: needs one of {use_instead}"),
                );
            }
            return None;
        }
    };
    Some(Credential {
        secret,
        header,
        scheme,
    })
}

fn validate_scope(
    provider: &str,
    short: &str,
    raw: &S<RawScope>,
    path: &str,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> Scope {
    let s = &raw.value;
    let limit = s
        .limit
        .as_ref()
        .and_then(|l| ctx.integer(l, &format!("{path}.limit"), 1, u64::MAX));
    let default_window = Duration::from_secs(60);
    let window = ctx.seconds(
        &s.window_seconds,
        &format!("{path}.window_seconds"),
        default_window,
    );
    let short_window = window < MIN_WINDOW;
    if let (Some(w), true) = (&s.window_seconds, short_window) {
        ctx.err(
            &w.referenced,
            format!(
                "{path}.window_seconds: must be at least {} second, got {} (providers publish \
                 their limit windows in whole seconds; a shorter one, such as 0.0001, paces so \
                 fast that pacing holds nothing back)",
                MIN_WINDOW.as_secs(),
                w.value
            ),
        );
    }
    // A refused window is reported once: the pacing below is checked with the default.
    let window = if short_window { default_window } else { window };
    let headroom = ctx.fraction(
        &s.headroom,
        &format!("{path}.headroom"),
        |h| h > 0.0 && h <= 1.0,
        "(0, 1]",
        0.8,
    );
    let reserve_interactive = ctx.fraction(
        &s.reserve_interactive,
        &format!("{path}.reserve_interactive"),
        |r| (0.0..1.0).contains(&r),
        "[0, 1)",
        0.2,
    );
    if (s.window_seconds.is_some() || s.headroom.is_some()) && s.limit.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `window_seconds`/`headroom` need the published `limit`"),
        );
    }
    if let (Some(l), Some(limit)) = (&s.limit, limit) {
        if let Err(e) = PacerConfig::try_new(limit, window, headroom, reserve_interactive) {
            ctx.err(&l.referenced, format!("{path}: {e}"));
        }
    }
    Scope {
        name: format!("{provider}/{short}"),
        limit,
        window,
        headroom,
        reserve_interactive,
        max_delayed_requests: ctx.at_least_one(
            &s.max_delayed_requests,
            &format!("{path}.max_delayed_requests"),
            shared.max_delayed_requests,
        ),
        max_concurrent_requests: ctx.at_least_one(
            &s.max_concurrent_requests,
            &format!("{path}.max_concurrent_requests"),
            shared.max_concurrent_requests,
        ),
    }
}

/// The methods a route key may name (RFC 9110 §9.3 and RFC 5789 `PATCH`). Any other token —
/// an extension method such as `FETCH`, or `TRACE`/`CONNECT` — is refused: its class could only be
/// guessed.
pub const ROUTE_METHODS: [&str; 7] = ["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"];

/// Parses `"METHOD /path/{param}"`; the method must be one of [`ROUTE_METHODS`].
fn parse_route_key(
    key: &S<String>,
    path: &str,
    ctx: &mut Ctx,
) -> Option<(String, String, Vec<Segment>)> {
    let text = key.value.as_str();
    let Some((method, template)) = text.split_once(char::is_whitespace) else {
        ctx.err(
            &key.referenced,
            format!("{path}: a route is `METHOD /path/{{param}}`, e.g. `POST /v1/transfers`"),
        );
        return None;
    };
    // Exactly one space between method and path, none around: `GET  /v1/x` or ` GET /v1/x`
    // would be listed under a key that names no route as the gateway prints it.
    if method.is_empty()
        || template.contains(char::is_whitespace)
        || text.as_bytes()[method.len()] != b' '
    {
        ctx.err(
            &key.referenced,
            format!("{path}: a route is `METHOD /path/{{param}}` with exactly one space between the method and the path and none before or after, e.g. `POST /v1/transfers`"),
        );
        return None;
    }
    if !ROUTE_METHODS.contains(&method) {
        let upper = method.to_ascii_uppercase();
        let message = if ROUTE_METHODS.contains(&upper.as_str()) {
            format!("{path}: `{method}` is not an upper-case HTTP method: write `{upper}`")
        } else {
            format!(
                "{path}: `{method}` is not a method backstop routes (one of: {})",
                ROUTE_METHODS.join(", ")
            )
        };
        ctx.err(&key.referenced, message);
        return None;
    }
    match parse_template(template) {
        Ok(segments) => {
            let unmatchable = segments.iter().find_map(|segment| match segment {
                Segment::Literal(literal) => unmatchable_literal(literal),
                Segment::Param(_) => None,
            });
            if let Some(reason) = unmatchable {
                ctx.err(
                    &key.referenced,
                    format!("{path}: {reason}, so this route would never match"),
                );
                return None;
            }
            Some((method.to_owned(), template.to_owned(), segments))
        }
        Err(reason) => {
            ctx.err(&key.referenced, format!("{path}: {reason}"));
            None
        }
    }
}

/// Why a literal route segment can never equal a segment of a request path, as the gateway
/// matches it: normalized (RFC 3986 §6.2.2) — percent-encoded unreserved characters decoded,
/// other percent-encodings in upper-case hex, the dot segments `.` and `..` removed — and
/// ASCII only (a URL carries other characters percent-encoded). `None` for a segment that can
/// match.
fn unmatchable_literal(segment: &str) -> Option<String> {
    if !segment.is_ascii() {
        let encoded: String = segment
            .chars()
            .map(|c| {
                if c.is_ascii() {
                    c.to_string()
                } else {
                    let mut buf = [0; 4];
                    c.encode_utf8(&mut buf)
                        .bytes()
                        .map(|b| format!("%{b:02X}"))
                        .collect()
                }
            })
            .collect();
        return Some(format!(
            "`{segment}` is not ASCII: requests carry it percent-encoded and are matched that way; write `{encoded}`"
        ));
    }
    let bytes = segment.as_bytes();
    let mut normal = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            normal.push(char::from(bytes[i]));
            i += 1;
            continue;
        }
        let byte = segment
            .get(i + 1..i + 3)
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        let Some(byte) = byte else {
            return Some(format!(
                "`{segment}`: a `%` must be followed by two hex digits (RFC 3986 §2.1), and a request path with a malformed `%` is refused"
            ));
        };
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            normal.push(char::from(byte));
        } else {
            normal.push_str(&format!("%{byte:02X}"));
        }
        i += 3;
    }
    if normal == "." || normal == ".." {
        return Some(format!(
            "`{segment}` is a dot segment: request paths are normalized before matching (RFC 3986 §5.2.4) and have none; write the path it resolves to"
        ));
    }
    if normal != segment {
        return Some(format!(
            "`{segment}`: request paths are normalized before matching (RFC 3986 §6.2.2: unreserved characters decoded, other percent-encodings in upper-case hex); write `{normal}`"
        ));
    }
    None
}

fn parse_template(template: &str) -> Result<Vec<Segment>, String> {
    if !template.starts_with('/') {
        return Err(format!("the path `{template}` must start with `/`"));
    }
    if template.contains(['?', '#']) {
        return Err("a route template has no query or fragment".to_owned());
    }
    if template.chars().any(char::is_whitespace) {
        return Err("a route template has no spaces".to_owned());
    }
    let mut segments = Vec::new();
    let mut names = BTreeSet::new();
    let trimmed = template.strip_suffix('/').unwrap_or(template);
    if trimmed.is_empty() {
        return Ok(segments);
    }
    for segment in trimmed[1..].split('/') {
        if segment.is_empty() {
            return Err(format!("empty segment (`//`) in `{template}`"));
        }
        if let Some(inner) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            let valid = inner
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && inner.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "`{segment}`: a parameter is `{{name}}` with letters, digits and `_`"
                ));
            }
            if !names.insert(inner.to_owned()) {
                return Err(format!("parameter `{{{inner}}}` appears twice"));
            }
            segments.push(Segment::Param(inner.to_owned()));
        } else if segment.contains(['{', '}']) {
            return Err(format!(
                "`{segment}`: braces must enclose a whole segment, like `{{id}}`"
            ));
        } else {
            segments.push(Segment::Literal(segment.to_owned()));
        }
    }
    Ok(segments)
}

fn validate_reconcile(
    raw: &S<RawReconcile>,
    path: &str,
    provider_honours_keys: bool,
    ctx: &mut Ctx,
) -> Option<Reconcile> {
    let r = &raw.value;
    let by = match &r.by {
        Some(b) => match b.value.as_str() {
            "idempotency_key" => ReconcileBy::IdempotencyKey,
            "external_reference" => ReconcileBy::ExternalReference,
            "operation_id" => ReconcileBy::OperationId,
            other => {
                ctx.err(
                    &b.referenced,
                    format!("{path}.by: `{other}` is not one of idempotency_key, external_reference, operation_id"),
                );
                return None;
            }
        },
        None => {
            ctx.err(&raw.referenced, format!("{path}: missing `by`"));
            return None;
        }
    };
    let placeholder = match by {
        ReconcileBy::IdempotencyKey => "{key}",
        ReconcileBy::ExternalReference => "{ref}",
        ReconcileBy::OperationId => "{operation_id}",
    };
    if by == ReconcileBy::IdempotencyKey && !provider_honours_keys {
        if let Some(b) = &r.by {
            ctx.err(
                &b.referenced,
                format!("{path}.by: the provider has no `idempotency_header`, so there is no key to look up"),
            );
        }
    }
    let external_reference_pointer = match &r.external_reference_pointer {
        // The empty pointer is the whole payload: no field to write the reference into, so
        // every write on the route would be refused when it arrives.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.external_reference_pointer: the empty pointer is the whole payload, not a field the reference can be written to; point to a field (start with `/`, e.g. `/reference`)"),
            );
            None
        }
        _ => check_pointer(
            ctx,
            &r.external_reference_pointer,
            &format!("{path}.external_reference_pointer"),
        ),
    };
    if by == ReconcileBy::ExternalReference && r.external_reference_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: external_reference` needs `external_reference_pointer` (where the reference is in the payload)"),
        );
    }
    let operation_id_pointer = match &r.operation_id_pointer {
        // The empty pointer is the whole answer: the document itself, not a field holding the
        // provider's id, would be stored as the operation id.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.operation_id_pointer: the empty pointer is the whole answer, not the field holding the provider's operation id; point to a field (start with `/`, e.g. `/id`)"),
            );
            None
        }
        _ => check_pointer(
            ctx,
            &r.operation_id_pointer,
            &format!("{path}.operation_id_pointer"),
        ),
    };
    if by == ReconcileBy::OperationId && r.operation_id_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: operation_id` needs `operation_id_pointer`"),
        );
    }
    let found_pointer = match &r.found_pointer {
        // The empty pointer is the whole lookup answer: any non-empty answer (a list of other
        // records, an error object) would count as found, a false success.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.found_pointer: the empty pointer is the whole lookup answer, so any non-empty answer would count as found; point to the field that is present only when the operation exists (start with `/`, e.g. `/data/0/id`)"),
            );
            None
        }
        _ => check_pointer(ctx, &r.found_pointer, &format!("{path}.found_pointer")),
    };
    let Some(lookup) = &r.lookup else {
        ctx.err(
            &raw.referenced,
            format!("{path}: missing `lookup` (e.g. `GET /v1/transfers?reference={{ref}}`)"),
        );
        return None;
    };
    let text = lookup.value.trim();
    let Some((method, target)) = text.split_once(char::is_whitespace) else {
        ctx.err(
            &lookup.referenced,
            format!("{path}.lookup: a lookup is `GET /path?query={placeholder}`"),
        );
        return None;
    };
    let target = target.trim();
    if !matches!(method, "GET" | "HEAD") {
        ctx.err(
            &lookup.referenced,
            format!("{path}.lookup: a lookup must be a safe read (GET or HEAD), not `{method}`"),
        );
        return None;
    }
    let route_part = target.split('?').next().unwrap_or("");
    if let Err(reason) = parse_template(route_part) {
        ctx.err(&lookup.referenced, format!("{path}.lookup: {reason}"));
        return None;
    }
    if !target.contains(placeholder) {
        ctx.err(
            &lookup.referenced,
            format!(
                "{path}.lookup: `by: {}` needs the placeholder `{placeholder}` in the lookup",
                r.by.as_ref().map(|b| b.value.as_str()).unwrap_or("")
            ),
        );
        return None;
    }
    Some(Reconcile {
        by,
        lookup_method: method.to_owned(),
        lookup_path: target.to_owned(),
        external_reference_pointer,
        found_pointer,
        operation_id_pointer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_recognised() {
        for id in [
            "42",
            "550e8400-e29b-41d4-a716-446655440000",
            "0123456789abcdef01",
            "cus_9s6XKzkNRiz8i3",
            "tr_8a7b6c5d",
        ] {
            assert!(looks_like_id(id), "{id}");
        }
        for word in [
            "v1",
            "transfers",
            "chat",
            "completions",
            "by_reference",
            "v2beta",
        ] {
            assert!(!looks_like_id(word), "{word}");
        }
    }

    /// Every error of `src` as `LINE:COL: message`.
    fn problems(src: &str) -> Vec<String> {
        Policy::from_yaml_str(src, "p.yaml")
            .expect_err("the policy is refused")
            .0
            .iter()
            .map(|e| format!("{}:{}: {}", e.line, e.column, e.message))
            .collect()
    }

    #[test]
    fn an_explicit_yaml_tag_is_refused_with_its_line_and_column_never_ignored() {
        for (src, at, tag) in [
            ("store: !include /etc/passwd\n", "1:8", "!include"),
            (
                "providers: {}\nstore: !!binary aGVsbG8=\n",
                "2:8",
                "!!binary",
            ),
            ("agents:\n  a: { token_env: !env X }\n", "2:19", "!env"),
            ("store: !!str x.db\n", "1:8", "!!str"),
            ("agents: !!map { a: { token_env: X } }\n", "1:9", "!!map"),
        ] {
            let got = problems(src);
            assert_eq!(got.len(), 1, "{src}: {got:?}");
            assert!(
                got[0].starts_with(&format!("{at}: the YAML tag `{tag}`")),
                "{src}: {got:?}"
            );
        }
        // Every tag is named, not only the first.
        let got = problems("store: !a x\nlisten: !b y\n");
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[1].starts_with("2:9: the YAML tag `!b`"), "{got:?}");
    }

    #[test]
    fn a_route_with_an_unknown_class_still_has_its_scopes_checked_in_the_same_run() {
        let errors = problems(
            "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    scopes:\n      account: { limit: 10, window_seconds: 60 }\n    routes:\n      \"GET /v1/x\": { class: reed, scopes: [acount] }\n",
        );
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].contains("unknown request class `reed`"),
            "{errors:?}"
        );
        assert!(errors[1].contains("unknown scope `acount`"), "{errors:?}");
    }

    #[test]
    fn a_wrong_type_names_the_key_path_and_keeps_the_position() {
        let provider = "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    routes:\n";
        let errors = problems(&format!(
            "{provider}      \"GET /v1/x\": {{ class: read, coalesce: maybe }}\n"
        ));
        assert_eq!(
            errors,
            ["5:45: providers.fake.routes.\"GET /v1/x\".coalesce: invalid boolean"]
        );
        // Sequence items by index, names chosen in the file as written, at any depth.
        let errors = problems(&format!(
            "{provider}      \"GET /v1/x\": {{ class: read, scopes: [a, [b]] }}\n"
        ));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("5:47: providers.fake.routes.\"GET /v1/x\".scopes[1]: "),
            "{errors:?}"
        );
        let errors = problems("providers:\n  fake:\n    idempotent_put_delete: sure\n");
        assert!(
            errors[0].starts_with("3:28: providers.fake.idempotent_put_delete: "),
            "{errors:?}"
        );
        let errors = problems("request_classes:\n  bulk: [1]\n");
        assert!(
            errors[0].starts_with("2:9: request_classes.bulk: "),
            "{errors:?}"
        );
        // An error about the document as a whole has no key path to name.
        let errors = problems("- 1\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("1:1: "), "{errors:?}");
        assert!(!errors[0].starts_with("1:1: :"), "{errors:?}");
    }

    #[test]
    fn a_number_that_is_not_finite_names_its_key_path() {
        for (src, at) in [
            ("backoff:\n  base_seconds: .nan\n", "2:17: backoff.base_seconds"),
            ("breaker:\n  threshold: .NaN\n", "2:14: breaker.threshold"),
            (
                "request_classes:\n  read: { retry_statuses: [429, .nan] }\n",
                "2:33: request_classes.read.retry_statuses[1]",
            ),
            (
                "providers:\n  p:\n    base_url: https://p.example\n    scopes:\n      s: { limit: 10, window_seconds: 60, headroom: .nan }\n",
                "5:53: providers.p.scopes.s.headroom",
            ),
        ] {
            let errors = problems(src);
            assert_eq!(errors.len(), 1, "{src}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!("{at}: value `.")),
                "{src}: {errors:?}"
            );
            assert!(errors[0].ends_with("is not a finite number"), "{src}: {errors:?}");
        }
    }

    #[test]
    fn alias_error_message_is_complete_and_has_no_inline_position() {
        let errors = problems("backoff: &b\n  base_seconds: 1\nbreaker: *b\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = &errors[0];
        assert!(
            e.starts_with(
                "3:10: breaker.base_seconds: unknown field `base_seconds`, expected one of threshold"
            ),
            "{e}"
        );
        assert!(
            e.ends_with("(the value comes from the anchor at 2:3)"),
            "{e}"
        );
        assert!(!e.contains(" at line "), "{e}");
        assert!(!e.contains("(used"), "{e}");
    }

    #[test]
    fn duplicate_key_message_names_the_key_without_library_advice() {
        let errors = problems("backoff:\n  base_seconds: 1\n  base_seconds: 2\n");
        assert_eq!(
            errors,
            ["3:3: duplicate key `base_seconds` (each key may appear once per mapping)"]
        );
    }

    #[test]
    fn empty_or_comment_only_policy_is_refused() {
        for src in ["", "\n\n", "# only a comment\n  # another\n", "\u{feff}"] {
            let errors = problems(src);
            assert_eq!(errors.len(), 1, "{src:?}: {errors:?}");
            assert!(
                errors[0].contains("empty policy file"),
                "{src:?}: {errors:?}"
            );
        }
    }

    #[test]
    fn non_utf8_policy_file_names_line_and_offset() {
        let dir = std::env::temp_dir().join(format!("backstop-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("latin1.yaml");
        std::fs::write(&path, b"breaker:\n  threshold: 3\n# caf\xe9\n").expect("write");
        let errors = Policy::load(&path).expect_err("refused").0;
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(errors.len(), 1);
        assert_eq!((errors[0].line, errors[0].column), (3, 6));
        assert_eq!(
            errors[0].message,
            "not UTF-8 (invalid byte at offset 29); a policy file is UTF-8 text"
        );
    }

    #[test]
    fn wrong_number_types_name_the_field() {
        assert_eq!(
            problems("breaker:\n  threshold: -3\n"),
            ["2:14: breaker.threshold: expected a non-negative integer, got -3"]
        );
        assert_eq!(
            problems("breaker:\n  threshold: 2.5\n"),
            ["2:14: breaker.threshold: expected a non-negative integer, got 2.5"]
        );
        assert_eq!(
            problems("backoff:\n  base_seconds: one\n"),
            ["2:17: backoff.base_seconds: expected a finite number, got \"one\""]
        );
    }

    #[test]
    fn backoff_base_and_min_delay_are_at_least_a_tenth_of_a_second() {
        let base = |got: &str| {
            format!(
                "2:17: backoff.base_seconds: must be at least 0.1 seconds, got {got} (the first \
                 retry waits at most twice the base, so a smaller one retries a failing request \
                 within milliseconds, a tight retry loop)"
            )
        };
        let floor = |got: &str| {
            format!(
                "2:22: backoff.min_delay_seconds: must be at least 0.1 seconds, got {got} (it is \
                 the shortest wait after a Retry-After of 0 or a reset already past, so a \
                 smaller one retries a throttled request within milliseconds, a tight retry loop)"
            )
        };
        for got in ["0", "1e-9", "0.099"] {
            assert_eq!(
                problems(&format!("backoff:\n  base_seconds: {got}\n")),
                [base(if got == "1e-9" { "0.000000001" } else { got })]
            );
            assert_eq!(
                problems(&format!("backoff:\n  min_delay_seconds: {got}\n")),
                [floor(if got == "1e-9" { "0.000000001" } else { got })]
            );
        }
        let shortest = Policy::from_yaml_str(
            "backoff:\n  base_seconds: 0.1\n  min_delay_seconds: 0.1\n",
            "p.yaml",
        )
        .expect("a tenth of a second is allowed");
        assert_eq!(shortest.backoff.base, MIN_BACKOFF_BASE);
        assert_eq!(shortest.backoff.min_delay, MIN_RETRY_DELAY_FLOOR);
    }

    #[test]
    fn a_scope_window_under_one_second_is_refused_naming_its_place_and_why() {
        let scope = |window: &str| {
            format!(
                "providers:\n  a:\n    base_url: https://a.example\n    scopes:\n      s: {{ limit: 10, window_seconds: {window} }}\n"
            )
        };
        let too_short = |got: &str| {
            format!(
                "5:39: providers.a.scopes.s.window_seconds: must be at least 1 second, got {got} \
                 (providers publish their limit windows in whole seconds; a shorter one, such \
                 as 0.0001, paces so fast that pacing holds nothing back)"
            )
        };
        // One problem each: the pacing is not refused a second time for the same window.
        for (window, shown) in [
            ("0.0001", "0.0001"),
            ("1e-9", "0.000000001"),
            ("0.999", "0.999"),
            ("0", "0"),
        ] {
            assert_eq!(problems(&scope(window)), [too_short(shown)], "{window}");
        }
        assert_eq!(
            problems(&scope("-1")),
            ["5:39: providers.a.scopes.s.window_seconds: must be a non-negative number of seconds, got -1"]
        );
        // Refused by the YAML reader already, at the value's place and naming it.
        assert_eq!(
            problems(&scope(".nan")),
            ["5:39: providers.a.scopes.s.window_seconds: value `.nan` is not a finite number"]
        );
        let errors = problems(&scope("1e12"));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with(
                "5:39: providers.a.scopes.s.window_seconds: too large, at most 4294967295 seconds"
            ),
            "{errors:?}"
        );
        let shortest = Policy::from_yaml_str(&scope("1"), "p.yaml").expect("one second is allowed");
        let scope = &shortest.providers["a"].scopes["s"];
        assert_eq!(scope.window, MIN_WINDOW);
        let pacing = scope.pacer_config().expect("paced");
        assert_eq!(pacing.emission_interval, Duration::from_millis(125));
    }

    #[test]
    fn a_boundary_spread_of_zero_loads_with_a_warning_naming_the_burst() {
        let spread = |seconds: &str| {
            Policy::from_yaml_str(
                &format!("agents:\n  bot: {{ token_env: BOT_TOKEN }}\nbackoff:\n  boundary_spread_seconds: {seconds}\n"),
                "p.yaml",
            )
            .expect("the policy loads")
        };
        let off = spread("0");
        assert_eq!(off.backoff.boundary_spread, Duration::ZERO);
        let warnings: Vec<String> = off
            .warnings
            .iter()
            .map(|w| format!("{}:{}: {}", w.line, w.column, w.message))
            .collect();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("4:28: backoff.boundary_spread_seconds: 0 turns off the jitter after a provider boundary"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("one burst"), "{warnings:?}");
        for seconds in ["0.5", "5"] {
            assert!(spread(seconds).warnings.is_empty(), "{seconds}");
        }
    }

    #[test]
    fn the_retry_after_ceiling_is_at_least_one_second() {
        let too_small = |got: &str| {
            format!(
                "2:32: backoff.retry_after_ceiling_seconds: must be at least 1 second, got {got} \
                 (providers give Retry-After in whole seconds, so a smaller ceiling treats every \
                 delay of a second or more as absurd: throttled requests are retried on local \
                 backoff alone, before the provider allows it)"
            )
        };
        // Said once, even when the ceiling is also under the Retry-After floor.
        for (ceiling, shown) in [("0.5", "0.5"), ("1e-9", "0.000000001"), ("0", "0")] {
            assert_eq!(
                problems(&format!(
                    "backoff:\n  retry_after_ceiling_seconds: {ceiling}\n"
                )),
                [too_small(shown)],
                "{ceiling}"
            );
        }
        let shortest =
            Policy::from_yaml_str("backoff:\n  retry_after_ceiling_seconds: 1\n", "p.yaml")
                .expect("one second is allowed");
        assert_eq!(
            shortest.backoff.retry_after_ceiling,
            MIN_RETRY_AFTER_CEILING
        );
        // Above one second it is still held to the floor of every boundary.
        assert_eq!(
            problems("backoff:\n  min_delay_seconds: 5\n  retry_after_ceiling_seconds: 2\n"),
            ["3:32: backoff.retry_after_ceiling_seconds: must be at least backoff.min_delay_seconds"]
        );
    }

    #[test]
    fn breaker_forget_after_is_read_defaulted_and_at_least_one_second() {
        let policy = Policy::from_yaml_str(
            "breaker:\n  threshold: 2\n  forget_after_seconds: 3600\n",
            "p.yaml",
        )
        .expect("valid");
        assert_eq!(policy.breaker.threshold, 2);
        assert_eq!(policy.breaker.forget_after, Duration::from_secs(3600));
        let defaulted =
            Policy::from_yaml_str("breaker:\n  threshold: 2\n", "p.yaml").expect("valid");
        assert_eq!(defaulted.breaker.forget_after, Duration::from_secs(86_400));
        let too_short = |got: &str| {
            format!(
                "2:25: breaker.forget_after_seconds: must be at least 1 second, got {got} (a \
                 breaker forgotten sooner after a failure is forgotten before the same request \
                 can fail again, so its circuit would never open)"
            )
        };
        assert_eq!(
            problems("breaker:\n  forget_after_seconds: 0\n"),
            [too_short("0")]
        );
        assert_eq!(
            problems("breaker:\n  forget_after_seconds: 1e-9\n"),
            [too_short("0.000000001")]
        );
        assert_eq!(
            problems("breaker:\n  forget_after_seconds: 0.999\n"),
            [too_short("0.999")]
        );
        let shortest = Policy::from_yaml_str("breaker:\n  forget_after_seconds: 1\n", "p.yaml")
            .expect("one second is allowed");
        assert_eq!(shortest.breaker.forget_after, MIN_FORGET_AFTER);
        assert_eq!(
            problems("breaker:\n  forget_after_seconds: -5\n"),
            ["2:25: breaker.forget_after_seconds: must be a non-negative number of seconds, got -5"]
        );
        assert_eq!(
            problems("breaker:\n  forget_after_seconds: a day\n"),
            ["2:25: breaker.forget_after_seconds: expected a finite number, got \"a day\""]
        );
    }

    #[test]
    fn an_unknown_key_lists_the_expected_keys_without_the_refused_secret_keys() {
        assert_eq!(
            problems("agents:\n  bot: { tokenenv: X }\n"),
            ["2:10: agents.bot.tokenenv: unknown field `tokenenv`, expected one of token_env, token_file, token_sha256"]
        );
        assert_eq!(
            problems("operators:\n  ops: { tokenfile: X }\n"),
            ["2:10: operators.ops.tokenfile: unknown field `tokenfile`, expected one of token_env, token_file, token_sha256"]
        );
        assert_eq!(
            problems("providers:\n  a:\n    base_url: https://a.example\n    credential: { secret_envv: X }\n"),
            ["4:19: providers.a.credential.secret_envv: unknown field `secret_envv`, expected one of secret_env, secret_file, header, scheme"]
        );
        let provider =
            problems("providers:\n  a:\n    base_url: https://a.example\n    apikey: 1\n");
        assert_eq!(provider.len(), 1, "{provider:?}");
        assert!(
            provider[0].starts_with(
                "4:5: providers.a.apikey: unknown field `apikey`, expected one of base_url, "
            ) && provider[0].ends_with(", default_scopes, routes"),
            "{provider:?}"
        );
        let (_, listed) = provider[0].split_once("expected one of ").expect("a list");
        assert!(
            !listed.split(", ").any(|k| REFUSED_SECRET_KEYS.contains(&k)),
            "{listed}"
        );
        // The refused keys themselves are still refused with their own message.
        assert_eq!(
            problems("agents:\n  bot: { token: abc }\n"),
            ["2:17: agents.bot.token: literal secret; secrets are referenced, never written into the policy (use token_env, token_file or token_sha256)"]
        );
    }

    #[test]
    fn too_large_numbers_say_too_large_with_the_limit() {
        assert_eq!(
            problems("breaker:\n  threshold: 99999999999\n"),
            ["2:14: breaker.threshold: too large, at most 4294967295, got 99999999999"]
        );
        let errors = problems("backoff:\n  retry_after_ceiling_seconds: 1e300\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with(
                "2:32: backoff.retry_after_ceiling_seconds: too large, at most 4294967295 seconds"
            ),
            "{errors:?}"
        );
    }

    #[test]
    fn retry_quota_cost_is_compared_with_the_files_capacity() {
        assert_eq!(
            problems("retry_quota: {capacity: 0, retry_cost: 1000}\n"),
            ["1:25: retry_quota.capacity: must be at least 1"]
        );
        assert_eq!(
            problems("retry_quota: {capacity: 10, retry_cost: 11}\n"),
            ["1:41: retry_quota.retry_cost: 11 exceeds the capacity 10; no retry could ever be paid"]
        );
    }

    #[test]
    fn uncertain_write_cannot_be_configured_to_retry() {
        let errors = problems(
            "request_classes:\n  uncertain_write: {max_attempts: 5, retry_statuses: [500]}\n",
        );
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].starts_with("2:35: request_classes.uncertain_write.max_attempts: must be 1, got 5: an uncertain write is never resent blindly"),
            "{errors:?}"
        );
        assert!(
            errors[1].starts_with(
                "2:54: request_classes.uncertain_write.retry_statuses: must be empty, got [500]"
            ),
            "{errors:?}"
        );
        // The shipped defaults stay valid.
        Policy::from_yaml_str(
            "request_classes:\n  uncertain_write: {max_attempts: 1}\n",
            "p.yaml",
        )
        .expect("one attempt is fine");
    }

    const PROVIDER: &str = "providers:\n  billing:\n    base_url: https://billing.example\n";

    #[test]
    fn the_openai_dialect_reads_error_codes_where_openai_documents_them_unless_told_otherwise() {
        let pointer = |extra: &str| {
            let policy =
                Policy::from_yaml_str(&format!("{PROVIDER}{extra}"), "p.yaml").expect("valid");
            policy.providers["billing"].error_code_pointer.clone()
        };
        assert_eq!(
            pointer("    dialect: openai\n").as_deref(),
            Some("/error/code")
        );
        assert_eq!(
            pointer("    dialect: openai\n    error_code_pointer: /detail/code\n").as_deref(),
            Some("/detail/code")
        );
        for dialect in ["generic", "ietf", "anthropic", "github"] {
            assert_eq!(
                pointer(&format!("    dialect: {dialect}\n")),
                None,
                "{dialect}"
            );
        }
    }

    #[test]
    fn provider_names_shadowed_by_backstop_routes_or_dot_segments_are_refused() {
        for name in ["v1", "METRICS", "metrics", ".", ".."] {
            let src = format!("providers:\n  \"{name}\":\n    base_url: https://p.example\n");
            let errors = problems(&src);
            assert_eq!(errors.len(), 1, "{name}: {errors:?}");
            assert!(
                errors[0].starts_with("2:3: providers."),
                "{name}: {errors:?}"
            );
            assert!(errors[0].contains("rename the provider"), "{errors:?}");
        }
        assert!(Policy::from_yaml_str(
            "providers:\n  v2:\n    base_url: https://p.example\n",
            "p.yaml"
        )
        .is_ok());
    }

    #[test]
    fn secret_env_must_be_a_variable_name_and_is_never_echoed() {
        for value in ["sk-proj-abc123secret", "\"\"", "1ABC", "MY VAR"] {
            let src = format!("{PROVIDER}    credential:\n      secret_env: {value}\n");
            let errors = problems(&src);
            assert_eq!(errors.len(), 1, "{value}: {errors:?}");
            assert!(errors[0].contains("credential.secret_env"), "{errors:?}");
            assert!(
                !errors[0].contains("sk-proj"),
                "echoes the value: {errors:?}"
            );
            assert!(
                !errors[0].contains("MY VAR"),
                "echoes the value: {errors:?}"
            );
        }
        Policy::from_yaml_str(
            &format!("{PROVIDER}    credential:\n      secret_env: BILLING_API_KEY\n"),
            "p.yaml",
        )
        .expect("a variable name is accepted");
    }

    #[test]
    fn empty_secret_file_and_token_refs_are_refused() {
        let errors = problems(&format!(
            "{PROVIDER}    credential:\n      secret_file: \"\"\n"
        ));
        assert!(
            errors[0].contains("credential.secret_file: empty"),
            "{errors:?}"
        );
        let errors = problems("agents:\n  a1:\n    token_env: sk-live-123\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("agents.a1.token_env"), "{errors:?}");
        assert!(!errors[0].contains("sk-live"), "{errors:?}");
        let errors = problems("operators:\n  o1:\n    token_file: \"\"\n");
        assert!(
            errors[0].contains("operators.o1.token_file: empty"),
            "{errors:?}"
        );
    }

    #[test]
    fn base_url_with_a_query_or_fragment_is_refused_without_echo() {
        for url in [
            "https://x.example/?api_key=sk-123",
            "https://x.example/v1#sk-123",
        ] {
            let src = format!("providers:\n  p:\n    base_url: {url}\n");
            let errors = problems(&src);
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(errors[0].contains("query string or fragment"), "{errors:?}");
            assert!(!errors[0].contains("sk-123"), "{errors:?}");
        }
    }

    #[test]
    fn credential_header_with_a_value_is_refused_without_echo() {
        let src = format!(
            "{PROVIDER}    credential:\n      secret_env: K\n      header: \"Authorization: Bearer sk-live-9\"\n"
        );
        let errors = problems(&src);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("credential.header: not a valid HTTP header field name"));
        assert!(!errors[0].contains("sk-live"), "{errors:?}");
    }

    #[test]
    fn listen_must_be_host_and_port_and_store_not_empty() {
        assert_eq!(
            problems("listen: \"not an addr\"\n"),
            ["1:9: listen: `not an addr` has no port; expected HOST:PORT such as 127.0.0.1:8080 or [::1]:8080"]
        );
        let errors = problems("listen: \"127.0.0.1:99999\"\n");
        assert!(
            errors[0].starts_with(
                "1:9: listen: `127.0.0.1:99999`: the port `99999` is not a number 0–65535"
            ),
            "{errors:?}"
        );
        assert_eq!(
            problems("store: \"\"\n"),
            ["1:8: store: must be the path of the SQLite database file, not empty"]
        );
        for ok in [
            "127.0.0.1:8080",
            "[::1]:0",
            "localhost:9000",
            "gateway.internal:80",
        ] {
            Policy::from_yaml_str(&format!("listen: \"{ok}\"\n"), "p.yaml").expect(ok);
        }
    }

    #[test]
    fn two_callers_with_one_token_source_are_refused_naming_both() {
        let digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let errors = problems(&format!(
            "agents:\n  a: {{ token_sha256: {digest} }}\n  b: {{ token_sha256: {} }}\n",
            digest.to_ascii_uppercase()
        ));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("3:22: agents.b.token_sha256: the same digest as agents.a.token_sha256 (p.yaml:2:22), so agents.a and agents.b would have one token"), "{errors:?}");
        assert!(!errors[0].contains(digest), "{errors:?}");
        let errors = problems(&format!(
            "agents:\n  a: {{ token_sha256: {digest} }}\noperators:\n  o: {{ token_sha256: {digest} }}\n"
        ));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("4:22: operators.o.token_sha256: the same digest as agents.a.token_sha256 (p.yaml:2:22), so agents.a and operators.o"), "{errors:?}");
        let errors =
            problems("agents:\n  a: { token_env: BOT_TOKEN }\n  b: { token_env: BOT_TOKEN }\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("3:19: agents.b.token_env: the same environment variable as agents.a.token_env (p.yaml:2:19)"), "{errors:?}");
        let errors = problems(
            "agents:\n  a: { token_file: /run/t }\noperators:\n  o: { token_file: /run/t }\n",
        );
        assert!(
            errors[0].contains("operators.o.token_file: the same file as agents.a.token_file"),
            "{errors:?}"
        );
        Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  b: { token_env: B_TOKEN }\noperators:\n  o: { token_env: O_TOKEN }\n",
            "p.yaml",
        )
        .expect("distinct sources load");
    }

    #[test]
    fn two_routes_matching_the_same_requests_are_refused_naming_both() {
        let provider = "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    routes:\n";
        let errors = problems(&format!(
            "{provider}      \"POST /v1/{{a}}\": {{ class: uncertain_write }}\n      \"POST /v1/{{b}}\": {{ class: uncertain_write }}\n"
        ));
        assert_eq!(
            errors,
            ["6:7: providers.fake.routes.\"POST /v1/{b}\": matches exactly the same requests as route \"POST /v1/{a}\" (p.yaml:5:7), only the parameter names differ, so which of them applies would be ambiguous; keep one"]
        );
        let errors = problems(&format!(
            "{provider}      \"GET /v1/items/{{id}}\": {{ class: read }}\n      \"GET /v1/items/{{id}}/\": {{ class: read }}\n"
        ));
        assert_eq!(
            errors,
            ["6:7: providers.fake.routes.\"GET /v1/items/{id}/\": the same method and template are already routed by route \"GET /v1/items/{id}\" (p.yaml:5:7)"]
        );
        // Another method, or a literal where the other has a parameter, is another route.
        Policy::from_yaml_str(
            &format!(
                "{provider}      \"GET /v1/{{a}}\": {{ class: read }}\n      \"POST /v1/{{b}}\": {{ class: uncertain_write }}\n      \"GET /v1/me\": {{ class: read }}\n"
            ),
            "p.yaml",
        )
        .expect("distinct routes load");
    }

    #[test]
    fn idempotency_header_cannot_be_a_credential_or_an_owned_header() {
        for name in [
            "Authorization",
            "authorization",
            "Proxy-Authorization",
            "Cookie",
            "Set-Cookie",
            "Host",
            "Content-Length",
            "Transfer-Encoding",
            "Connection",
            "Keep-Alive",
            "TE",
            "Trailer",
            "Upgrade",
            "Expect",
            "Prefer",
            "X-Backstop-Task",
            "x-backstop-key",
        ] {
            let errors = problems(&format!("{PROVIDER}    idempotency_header: {name}\n"));
            assert_eq!(errors.len(), 1, "{name}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!(
                    "4:25: providers.billing.idempotency_header: `{name}` cannot carry the idempotency key: "
                )),
                "{errors:?}"
            );
        }
        let errors = problems(&format!(
            "{PROVIDER}    credential: {{ secret_env: K, header: X-Api-Key, scheme: \"\" }}\n    idempotency_header: x-api-key\n"
        ));
        assert_eq!(
            errors,
            ["5:25: providers.billing.idempotency_header: `x-api-key` cannot carry the idempotency key: it is the provider's `credential.header`: it carries credentials, and an idempotency key is stored, audited and echoed in answers"]
        );
        for ok in ["Idempotency-Key", "X-Request-Id", "Stripe-Idempotency-Key"] {
            Policy::from_yaml_str(
                &format!(
                    "{PROVIDER}    credential: {{ secret_env: K }}\n    idempotency_header: {ok}\n"
                ),
                "p.yaml",
            )
            .expect(ok);
        }
    }

    #[test]
    fn credential_header_cannot_be_an_owned_header_or_the_key_header() {
        for name in [
            "Host",
            "content-length",
            "Transfer-Encoding",
            "Connection",
            "Keep-Alive",
            "TE",
            "Trailer",
            "Upgrade",
            "Proxy-Authorization",
            "Expect",
            "X-Backstop-Token",
            "Idempotency-Key",
        ] {
            let errors = problems(&format!(
                "{PROVIDER}    credential: {{ secret_env: K, header: {name} }}\n"
            ));
            assert_eq!(errors.len(), 1, "{name}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!(
                    "4:42: providers.billing.credential.header: `{name}` cannot carry the credential: "
                )),
                "{errors:?}"
            );
        }
        // Another idempotency header leaves `Idempotency-Key` free for a credential.
        Policy::from_yaml_str(
            &format!("{PROVIDER}    credential: {{ secret_env: K, header: Idempotency-Key }}\n    idempotency_header: X-Request-Id\n"),
            "p.yaml",
        )
        .expect("Idempotency-Key is not the key header");
        for ok in ["Authorization", "X-Api-Key", "Cookie", "api-key"] {
            Policy::from_yaml_str(
                &format!("{PROVIDER}    credential: {{ secret_env: K, header: {ok} }}\n    idempotency_header: Idempotency-Key\n"),
                "p.yaml",
            )
            .expect(ok);
        }
    }

    #[test]
    fn a_base_url_path_with_non_ascii_characters_is_refused_with_a_hint_to_percent_encode() {
        for (url, c) in [
            ("https://api.example.com/v1/café", 'é'),
            ("https://api.example.com/données/v1", 'é'),
            ("http://127.0.0.1:9/ü", 'ü'),
        ] {
            assert_eq!(
                problems(&format!("providers:\n  p:\n    base_url: \"{url}\"\n")),
                [format!("3:15: providers.p.base_url: the path holds `{c}`, which is not ASCII; a URL path is ASCII, so percent-encode the character's UTF-8 bytes (e.g. `é` as `%C3%A9`)")],
                "{url}"
            );
        }
    }

    #[test]
    fn a_base_url_no_request_can_be_sent_to_is_refused_with_the_reason() {
        for (url, reason) in [
            (
                "http://[::1",
                "not a URL a request can be sent to (invalid authority)",
            ),
            (
                "http://ex ample.com",
                "not a URL a request can be sent to (invalid uri character)",
            ),
            (
                "https://é.example",
                "not a URL a request can be sent to (invalid uri character)",
            ),
            ("http://:8080", "missing host"),
            (
                "http://h.example:99999",
                "the port `99999` is not a number 0–65535",
            ),
        ] {
            let errors = problems(&format!("providers:\n  p:\n    base_url: \"{url}\"\n"));
            assert_eq!(errors.len(), 1, "{url}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!("3:15: providers.p.base_url: {reason}")),
                "{url}: {errors:?}"
            );
        }
        for ok in [
            "https://api.example.com/v1/caf%C3%A9",
            "http://127.0.0.1:9",
            "http://[::1]:8080/",
            "https://api.example.com/v1",
            "https://api.example.com:443",
        ] {
            Policy::from_yaml_str(
                &format!("providers:\n  p:\n    base_url: \"{ok}\"\n"),
                "p.yaml",
            )
            .expect(ok);
        }
    }

    #[test]
    fn an_empty_external_reference_pointer_is_refused_at_load() {
        let route = |pointer: &str| {
            format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: external_reference\n          lookup: \"GET /v1/transfers?reference={{ref}}\"\n          external_reference_pointer: {pointer}\n"
            )
        };
        assert_eq!(
            problems(&route("\"\"")),
            ["10:39: providers.p.routes.\"POST /v1/transfers\".reconcile.external_reference_pointer: the empty pointer is the whole payload, not a field the reference can be written to; point to a field (start with `/`, e.g. `/reference`)"]
        );
        Policy::from_yaml_str(&route("/reference"), "p.yaml").expect("a field");
    }

    #[test]
    fn an_empty_operation_id_pointer_is_refused_at_load() {
        let route = |pointer: &str| {
            format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: operation_id\n          lookup: \"GET /v1/transfers/{{operation_id}}\"\n          operation_id_pointer: {pointer}\n"
            )
        };
        assert_eq!(
            problems(&route("\"\"")),
            ["10:33: providers.p.routes.\"POST /v1/transfers\".reconcile.operation_id_pointer: the empty pointer is the whole answer, not the field holding the provider's operation id; point to a field (start with `/`, e.g. `/id`)"]
        );
        let policy = Policy::from_yaml_str(&route("/id"), "p.yaml").expect("a field");
        let reconcile = policy.providers["p"].routes[0].reconcile.as_ref().unwrap();
        assert_eq!(reconcile.operation_id_pointer.as_deref(), Some("/id"));
    }

    #[test]
    fn an_empty_found_pointer_is_refused_at_load() {
        let route = |pointer: &str| {
            format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: external_reference\n          lookup: \"GET /v1/transfers?reference={{ref}}\"\n          external_reference_pointer: /reference\n          found_pointer: {pointer}\n"
            )
        };
        assert_eq!(
            problems(&route("\"\"")),
            ["11:26: providers.p.routes.\"POST /v1/transfers\".reconcile.found_pointer: the empty pointer is the whole lookup answer, so any non-empty answer would count as found; point to the field that is present only when the operation exists (start with `/`, e.g. `/data/0/id`)"]
        );
        Policy::from_yaml_str(&route("/data/0/id"), "p.yaml").expect("a field");
    }

    #[test]
    fn a_status_listed_twice_in_retry_statuses_is_refused() {
        assert_eq!(
            problems("request_classes:\n  read: { retry_statuses: [429, 503, 429] }\n"),
            ["2:38: request_classes.read.retry_statuses: 429 is listed twice"]
        );
        let policy = Policy::from_yaml_str(
            "request_classes:\n  read: { retry_statuses: [429, 503] }\n",
            "p.yaml",
        )
        .expect("distinct statuses");
        assert_eq!(policy.request_classes["read"].retry_statuses, [429, 503]);
    }

    #[test]
    fn a_route_key_with_extra_spaces_is_refused_naming_it() {
        let route = |key: &str| {
            format!("providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"{key}\": {{ class: read }}\n")
        };
        for key in ["GET  /v1/x", " GET /v1/x", "GET /v1/x ", "GET\t/v1/x"] {
            let errors = problems(&route(key));
            assert_eq!(errors.len(), 1, "{key:?}: {errors:?}");
            assert!(
                errors[0].contains(&format!("providers.p.routes.\"{key}\": a route is `METHOD /path/{{param}}` with exactly one space between the method and the path")),
                "{key:?}: {errors:?}"
            );
        }
        Policy::from_yaml_str(&route("GET /v1/x"), "p.yaml").expect("one space");
    }

    #[cfg(unix)]
    #[test]
    fn a_policy_that_is_not_a_regular_file_or_too_large_is_refused() {
        let message = |path: &std::path::Path| {
            let errors = Policy::load(path).expect_err("refused").0;
            assert_eq!(errors.len(), 1, "{errors:?}");
            errors[0].message.clone()
        };
        assert_eq!(
            message(std::path::Path::new("/dev/zero")),
            "not a regular file (a character device); a policy is read from a regular file"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            message(dir.path()),
            "not a regular file (a directory); a policy is read from a regular file"
        );
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());
        assert_eq!(
            message(&fifo),
            "not a regular file (a FIFO); a policy is read from a regular file"
        );
        let big = dir.path().join("big.yaml");
        let mut text = String::from("# padding\n");
        while text.len() as u64 <= MAX_POLICY_BYTES {
            text.push_str(&"#".repeat(1023));
            text.push('\n');
        }
        text.push_str("providers: {}\n");
        std::fs::write(&big, text).expect("write");
        assert_eq!(
            message(&big),
            "larger than 4 MiB; a policy file is at most 4194304 bytes"
        );
    }

    #[test]
    fn route_templates_that_can_never_match_are_refused_naming_why() {
        let route = |template: &str| {
            format!("providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"GET {template}\": {{ class: read }}\n")
        };
        for (template, reason) in [
            ("/v1/élément/{id}", "`élément` is not ASCII: requests carry it percent-encoded and are matched that way; write `%C3%A9l%C3%A9ment`"),
            ("/v1/../items/{id}", "`..` is a dot segment: request paths are normalized before matching (RFC 3986 §5.2.4) and have none; write the path it resolves to"),
            ("/./v1/items", "`.` is a dot segment"),
            ("/v1/%2E%2e/items", "`%2E%2e` is a dot segment"),
            ("/v1/%6cimited", "`%6cimited`: request paths are normalized before matching (RFC 3986 §6.2.2: unreserved characters decoded, other percent-encodings in upper-case hex); write `limited`"),
            ("/v1/a%2fb", "write `a%2Fb`"),
            ("/v1/%zz", "`%zz`: a `%` must be followed by two hex digits"),
        ] {
            let errors = problems(&route(template));
            assert_eq!(errors.len(), 1, "{template}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!("5:7: providers.p.routes.\"GET {template}\": ")),
                "{errors:?}"
            );
            assert!(errors[0].contains(reason), "{template}: {errors:?}");
            assert!(
                errors[0].ends_with(", so this route would never match"),
                "{errors:?}"
            );
        }
        for ok in [
            "/v1/%C3%A9l%C3%A9ment/{id}",
            "/v1/a%2Fb",
            "/v1/.well-known/x",
            "/v1/..x",
        ] {
            Policy::from_yaml_str(&route(ok), "p.yaml").expect(ok);
        }
    }
}
