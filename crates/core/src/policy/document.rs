//! The validated policy document ([`Policy`]): reading it from a file or text, and assembling
//! it from its validated sections.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::backoff::{validate_backoff, BackoffPolicy};
use super::breaker::{validate_breaker, BreakerPolicy};
use super::classes::{validate_classes, RequestClass};
use super::diagnostics::{Ctx, PolicyError, PolicyErrors};
use super::parse::{is_blank_yaml, read_raw};
use super::providers::{validate_providers, Provider};
use super::raw::{RawPolicy, S};
use super::retry_quota::validate_retry_quota;
use super::scopes::{validate_shared_scope, SharedScope};
use super::secrets::{validate_principals, TokenRef, TokenSources};
use crate::budget::RetryQuotaConfig;

/// The largest policy file [`Policy::load`] reads, in bytes (4 MiB): far above any real policy,
/// small enough that a wrong path (a log, an image) is refused at once.
pub const MAX_POLICY_BYTES: u64 = 4 * 1024 * 1024;

/// What kind of file system entry `meta` is, in words, for a refusal: `"a FIFO"`,
/// `"a character device"`, `"a block device"`, `"a socket"`, `"a directory"`, or
/// `"not a regular file"`.
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
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
        let bytes = read_policy_file(path).map_err(unpositioned)?;
        let src = String::from_utf8(bytes).map_err(|e| not_utf8(&e, &file))?;
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
}

/// The bytes of the policy file at `path`, or why it cannot be read: it is missing or
/// unreadable, not a regular file (a device, FIFO or directory), or larger than
/// [`MAX_POLICY_BYTES`], before or while it is read.
fn read_policy_file(path: &Path) -> Result<Vec<u8>, String> {
    // A device (`/dev/zero`), a FIFO or a directory is refused before it is opened: opening
    // a FIFO blocks until a writer comes, and a device may never end.
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read the policy file: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "not a regular file ({}); a policy is read from a regular file",
            file_kind(&meta)
        ));
    }
    let too_large = || {
        format!(
            "larger than {} MiB; a policy file is at most {MAX_POLICY_BYTES} bytes",
            MAX_POLICY_BYTES / (1024 * 1024)
        )
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
        .map_err(|e| format!("cannot read the policy file: {e}"))?;
    // The file grew after its size was read.
    if bytes.len() as u64 > MAX_POLICY_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The refusal of a policy `file` that is not UTF-8, at the line and column of its first
/// invalid byte.
fn not_utf8(e: &std::string::FromUtf8Error, file: &str) -> PolicyErrors {
    let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
    let line = valid.iter().filter(|&&b| b == b'\n').count() as u64 + 1;
    let column = valid.len() - valid.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
    PolicyErrors(vec![PolicyError {
        file: file.to_owned(),
        line,
        column: column as u64,
        message: format!(
            "not UTF-8 (invalid byte at offset {}); a policy file is UTF-8 text",
            e.utf8_error().valid_up_to()
        ),
    }])
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

/// Every section of `raw`, validated in file order of concern, into a [`Policy`] (without its
/// warnings, which [`Policy::from_yaml_str`] adds once it knows there is no error).
fn validate(raw: RawPolicy, ctx: &mut Ctx) -> Policy {
    let request_classes = validate_classes(raw.request_classes, ctx);
    let shared_scope = validate_shared_scope(raw.shared_scope.as_ref(), ctx);
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
    let providers = validate_providers(raw.providers, &request_classes, &shared_scope, ctx);
    if operators.is_empty() && !providers.is_empty() {
        ctx.warn(
            1,
            1,
            "operators: none configured, but calls through these providers can be escalated (a write whose outcome is uncertain, an exhausted shared quota, a boundary past the deadline) and no one could decide them: `escalations list` and `decide` would refuse every token (add `operators:` with a token_env, token_file or token_sha256)",
        );
    }
    check_store(raw.store.as_ref(), ctx);
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

/// `store`: the path of the SQLite database file, not empty.
fn check_store(store: Option<&S<String>>, ctx: &mut Ctx) {
    if let Some(store) = store {
        if store.value.trim().is_empty() {
            ctx.err(
                &store.referenced,
                "store: must be the path of the SQLite database file, not empty",
            );
        }
    }
}
