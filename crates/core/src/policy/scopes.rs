//! Quota scopes and their pacing (`shared_scope`, `providers.P.scopes`, SPEC §4.1).

use std::time::Duration;

use serde::Serialize;

use super::diagnostics::Ctx;
use super::raw::{RawScope, S};
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

pub(super) fn validate_scope(
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
