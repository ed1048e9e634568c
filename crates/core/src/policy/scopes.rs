//! Quota scopes and their pacing (`shared_scope`, `providers.P.scopes`, SPEC §4.1).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::checks::is_name;
use super::diagnostics::Ctx;
use super::raw::{RawScope, RawSharedScope, SpannedMap, S};
use crate::pacing::{PacerConfig, ScopeRecord, MIN_WINDOW};

/// Scope limits shared by all scopes unless a scope sets its own (`shared_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SharedScope {
    /// Delayed-queue limit per scope (default 25).
    pub max_delayed_requests: u32,
    /// Concurrency limit per scope (default 2).
    pub max_concurrent_requests: u32,
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

/// `shared_scope`: each limit at least 1; absent, 25 delayed and 2 concurrent requests.
pub(super) fn validate_shared_scope(raw: Option<&S<RawSharedScope>>, ctx: &mut Ctx) -> SharedScope {
    match raw {
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
    }
}

/// The scopes of the provider whose key is `key` (`path` is `providers.NAME`), by short name. A
/// provider without scopes loads with a warning at its key.
pub(super) fn validate_scopes(
    key: &S<String>,
    raw: Option<SpannedMap<S<RawScope>>>,
    path: &str,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> BTreeMap<String, Scope> {
    let mut scopes = BTreeMap::new();
    let entries = raw.map(|m| m.0).unwrap_or_default();
    if entries.is_empty() {
        ctx.warn(
            key.referenced.line(),
            key.referenced.column(),
            format!("{path}: no scopes, so its calls share no quota record, pacing or concurrency limit (add `scopes:`)"),
        );
    }
    for (scope_key, scope) in entries {
        let scope_path = format!("{path}.scopes.{}", scope_key.value);
        if !is_name(&scope_key.value) {
            ctx.err(
                &scope_key.referenced,
                format!("{scope_path}: a scope name uses letters, digits, `_`, `-`, `.` or `:`"),
            );
        }
        let s = validate_scope(
            &key.value,
            &scope_key.value,
            &scope,
            &scope_path,
            shared,
            ctx,
        );
        scopes.insert(scope_key.value.clone(), s);
    }
    scopes
}

/// The full names (`provider/scope`) of the scopes `list` names at `at`, each given short or
/// full; a scope `provider` does not have is reported and left out.
pub(super) fn scope_refs(
    provider: &str,
    scopes: &BTreeMap<String, Scope>,
    list: &S<Vec<S<String>>>,
    at: &str,
    ctx: &mut Ctx,
) -> Vec<String> {
    list.value
        .iter()
        .filter_map(|s| scope_ref(provider, scopes, s, at, ctx))
        .collect()
}

/// The full name of the scope `s` names, short or full, or `None` after reporting at `at` a
/// scope `provider` does not have.
fn scope_ref(
    provider: &str,
    scopes: &BTreeMap<String, Scope>,
    s: &S<String>,
    at: &str,
    ctx: &mut Ctx,
) -> Option<String> {
    let short = s
        .value
        .strip_prefix(&format!("{provider}/"))
        .unwrap_or(&s.value);
    if scopes.contains_key(short) {
        return Some(format!("{provider}/{short}"));
    }
    let known: Vec<&str> = scopes.keys().map(String::as_str).collect();
    ctx.err(
        &s.referenced,
        format!(
            "{at}: unknown scope `{}` (provider {provider} has: {})",
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
    let window = scope_window(s, path, ctx);
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

/// `window_seconds` of the scope at `path`, default 60 s. One under [`MIN_WINDOW`] is
/// reported, once: the default stands in for it, so the pacing is checked with the default.
fn scope_window(s: &RawScope, path: &str, ctx: &mut Ctx) -> Duration {
    let default_window = Duration::from_secs(60);
    let window = ctx.seconds(
        &s.window_seconds,
        &format!("{path}.window_seconds"),
        default_window,
    );
    if window >= MIN_WINDOW {
        return window;
    }
    if let Some(w) = &s.window_seconds {
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
    default_window
}
