//! # Quota headers: pace before failing
//!
//! A 429 is the provider telling us we already went too fast. Most providers also say, on every
//! response, how much of the quota is left and when it resets — in one of several dialects. Reading
//! those lets backstop slow down *before* the limit (SPEC §2.3). This module turns each dialect
//! into the same [`QuotaObservation`]:
//!
//! | dialect | headers | reset |
//! |---|---|---|
//! | [`Dialect::Ietf`] | `RateLimit` / `RateLimit-Policy` structured fields (draft-ietf-httpapi-ratelimit-headers), older `RateLimit-Limit/-Remaining/-Reset` | seconds from now |
//! | [`Dialect::Openai`] | `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` | Go-style duration (`6m0s`) |
//! | [`Dialect::Anthropic`] | `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}` | RFC 3339 instant |
//! | [`Dialect::Github`] | `x-ratelimit-{limit,remaining,used,reset,resource}` | epoch seconds (not a delay) |
//! | [`Dialect::Generic`] | all of the above, each observation records which matched | bare `x-ratelimit-reset`: > 10^12 epoch ms, > 10^9 epoch s (labelled `github`), else seconds from now (labelled `generic`); `interpretation` says which |
//!
//! Absolute reset instants are converted through the response's `Date` header when present
//! (`received_at + (reset − Date)`), so a skewed server or local clock does not move the reset.
//! Malformed fields are skipped; parsing never fails and never panics. The headers describe quota
//! state only: they neither undo a 429 nor say which scope they count (provider configuration
//! says that).
//!
//! ```
//! use backstop_core::quota::{parse_quota, Dialect};
//! use http::{HeaderMap, HeaderValue};
//!
//! let mut h = HeaderMap::new();
//! h.insert("x-ratelimit-remaining-requests", HeaderValue::from_static("0"));
//! h.insert("x-ratelimit-reset-requests", HeaderValue::from_static("6m0s"));
//! let now: jiff::Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
//! let obs = parse_quota(&h, Dialect::Openai, now);
//! assert_eq!(obs[0].policy.as_deref(), Some("requests"));
//! assert_eq!(obs[0].reset_at.unwrap().to_string(), "2025-01-01T00:06:00Z");
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::header::{AsHeaderName, HeaderName};
use http::HeaderMap;
use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize, Serializer};

use crate::duration::parse_go_duration;
use crate::retry_after::{
    boundary_after, parse_decimal, parse_http_date, Boundary, RetryAfterOptions,
};

/// Safety margin added to a reset instant when `remaining` is 0: retrying at the reset second
/// itself tends to hit the limit again.
pub const RESET_SAFETY_MARGIN: Duration = Duration::from_secs(1);

/// The header family a provider uses for quota state (provider configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// Try every dialect; each observation records which one matched.
    #[default]
    Generic,
    /// IETF `RateLimit` / `RateLimit-Policy` and the older `RateLimit-Limit` family.
    Ietf,
    /// OpenAI `x-ratelimit-*-{requests,tokens}`.
    Openai,
    /// Anthropic `anthropic-ratelimit-*`.
    Anthropic,
    /// GitHub `x-ratelimit-{limit,remaining,used,reset,resource}`.
    Github,
}

impl Dialect {
    /// The snake_case name (`generic`, `ietf`, `openai`, `anthropic`, `github`).
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Generic => "generic",
            Dialect::Ietf => "ietf",
            Dialect::Openai => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Github => "github",
        }
    }

    /// Where this provider's error bodies keep their error code (an RFC 6901 JSON pointer),
    /// when its documentation fixes it: OpenAI's `{"error": {"code": "insufficient_quota", …}}`
    /// (OpenAI API reference, "Error codes") → `/error/code`. `None` for the others, whose
    /// bodies are not one documented shape (a provider's `error_code_pointer` says where).
    pub fn error_code_pointer(self) -> Option<&'static str> {
        match self {
            Dialect::Openai => Some("/error/code"),
            Dialect::Generic | Dialect::Ietf | Dialect::Anthropic | Dialect::Github => None,
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dialect name that is not one of `generic|ietf|openai|anthropic|github`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown quota dialect {0:?} (expected generic, ietf, openai, anthropic or github)")]
pub struct UnknownDialect(pub String);

impl FromStr for Dialect {
    type Err = UnknownDialect;

    /// Parses a dialect name, case-insensitively.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "generic" => Ok(Dialect::Generic),
            "ietf" => Ok(Dialect::Ietf),
            "openai" => Ok(Dialect::Openai),
            "anthropic" => Ok(Dialect::Anthropic),
            "github" => Ok(Dialect::Github),
            _ => Err(UnknownDialect(s.to_owned())),
        }
    }
}

/// One provider statement about one quota policy, as read from a response's headers.
///
/// Every field but `dialect` is optional because providers send partial sets. `window` is
/// serialized as `window_seconds` (a number of seconds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaObservation {
    /// The dialect whose headers produced this observation.
    pub dialect: Dialect,
    /// Policy name: IETF policy item, OpenAI/Anthropic `requests`/`tokens`/…, GitHub resource.
    pub policy: Option<String>,
    /// Published limit of the window (requests or tokens).
    pub limit: Option<u64>,
    /// What is left in the current window.
    pub remaining: Option<u64>,
    /// When the window resets, on the local timeline (skew-corrected with `Date` when present).
    pub reset_at: Option<Timestamp>,
    /// Window length (IETF `w`).
    #[serde(rename = "window_seconds", serialize_with = "serialize_window_seconds")]
    pub window: Option<Duration>,
    /// How an ambiguous reset value was read, when the dialect had to choose (the `generic`
    /// magnitude rule for a bare `x-ratelimit-reset`), e.g. `x-ratelimit-reset 12 read as a
    /// delay in seconds (generic: ≤ 10^9)`; `None` when the dialect fixes the meaning.
    pub interpretation: Option<String>,
}

fn serialize_window_seconds<S: Serializer>(w: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match w {
        None => s.serialize_none(),
        Some(d) if d.subsec_nanos() == 0 => s.serialize_u64(d.as_secs()),
        Some(d) => s.serialize_f64(d.as_secs_f64()),
    }
}

impl QuotaObservation {
    fn new(dialect: Dialect, policy: Option<String>) -> Self {
        Self {
            dialect,
            policy,
            limit: None,
            remaining: None,
            reset_at: None,
            window: None,
            interpretation: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.limit.is_none()
            && self.remaining.is_none()
            && self.reset_at.is_none()
            && self.window.is_none()
    }
}

/// Context shared by the dialect readers: receive time and the server's `Date`, if any.
struct Ctx<'a> {
    headers: &'a HeaderMap,
    received_at: Timestamp,
}

impl Ctx<'_> {
    fn text(&self, name: impl AsHeaderName) -> Option<&str> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|s| !s.is_empty())
    }

    fn uint(&self, name: impl AsHeaderName) -> Option<u64> {
        self.text(name).and_then(parse_uint)
    }

    /// `received_at + delay`, `None` on overflow.
    fn after(&self, delay: Duration) -> Option<Timestamp> {
        let d = SignedDuration::try_from(delay).ok()?;
        self.received_at.checked_add(d).ok()
    }

    /// The server's `Date`, parsed only when an absolute reset needs it.
    fn server_date(&self) -> Option<Timestamp> {
        self.headers
            .get(http::header::DATE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_http_date)
    }

    /// Maps a server-clock instant onto the local timeline using `Date` when present.
    fn absolute(&self, at: Timestamp) -> Option<Timestamp> {
        match self.server_date() {
            Some(date) => {
                let delta = date.duration_until(at);
                self.received_at.checked_add(delta).ok()
            }
            None => Some(at),
        }
    }

    fn epoch_seconds(&self, secs: u64) -> Option<Timestamp> {
        let at = Timestamp::from_second(i64::try_from(secs).ok()?).ok()?;
        self.absolute(at)
    }

    fn epoch_millis(&self, ms: u64) -> Option<Timestamp> {
        let at = Timestamp::from_millisecond(i64::try_from(ms).ok()?).ok()?;
        self.absolute(at)
    }
}

/// Unsigned decimal integer: ASCII digits only (no sign, no prefix), at most u64.
fn parse_uint(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Unsigned decimal seconds, possibly fractional (`"1.5"`), as a duration; surrounding whitespace
/// is ignored. The same reading as Retry-After delay-seconds
/// ([`crate::retry_after`]'s `parse_decimal`): a fraction finer than a nanosecond rounds up, so a
/// reset is never read earlier than the provider stated.
fn parse_seconds(s: &str) -> Option<Duration> {
    parse_decimal(s.trim(), 1_000_000_000).ok().flatten()
}

/// Parses the quota headers of one response in `dialect` (SPEC §2.3).
///
/// `received_at` is the local receive instant; delays are added to it and absolute resets are
/// skew-corrected with the response's `Date`. Returns one observation per policy found (empty
/// when none); malformed fields are ignored. In [`Dialect::Generic`] every dialect is tried and
/// each observation's `dialect` says which one matched. Never panics.
pub fn parse_quota(
    headers: &HeaderMap,
    dialect: Dialect,
    received_at: Timestamp,
) -> Vec<QuotaObservation> {
    // Skip the readers whose headers the response does not carry at all: most responses carry
    // one family or none, and a header lookup by name costs far more than one pass over names.
    let present = Families::of(headers);
    if !(present.ietf || present.openai || present.anthropic || present.github) {
        return Vec::new();
    }
    let ctx = Ctx {
        headers,
        received_at,
    };
    let generic = dialect == Dialect::Generic;
    let mut out = Vec::new();
    if present.ietf && (generic || dialect == Dialect::Ietf) {
        ietf(&ctx, &mut out);
    }
    if present.openai && (generic || dialect == Dialect::Openai) {
        openai(&ctx, generic, &mut out);
    }
    if present.anthropic && (generic || dialect == Dialect::Anthropic) {
        anthropic(&ctx, &mut out);
    }
    if present.github && (generic || dialect == Dialect::Github) {
        github(&ctx, generic, &mut out);
    }
    out
}

/// OpenAI's header names per policy: `x-ratelimit-{limit,remaining,reset}-{policy}`. Looked up as
/// [`HeaderName`]s, which skips the name parsing a lookup by `&str` repeats on every call.
static OPENAI_HEADERS: [(&str, [HeaderName; 3]); 2] = [
    (
        "requests",
        [
            HeaderName::from_static("x-ratelimit-limit-requests"),
            HeaderName::from_static("x-ratelimit-remaining-requests"),
            HeaderName::from_static("x-ratelimit-reset-requests"),
        ],
    ),
    (
        "tokens",
        [
            HeaderName::from_static("x-ratelimit-limit-tokens"),
            HeaderName::from_static("x-ratelimit-remaining-tokens"),
            HeaderName::from_static("x-ratelimit-reset-tokens"),
        ],
    ),
];

/// Anthropic's header names per policy: `anthropic-ratelimit-{policy}-{limit,remaining,reset}`.
static ANTHROPIC_HEADERS: [(&str, [HeaderName; 3]); 4] = [
    (
        "requests",
        [
            HeaderName::from_static("anthropic-ratelimit-requests-limit"),
            HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
            HeaderName::from_static("anthropic-ratelimit-requests-reset"),
        ],
    ),
    (
        "tokens",
        [
            HeaderName::from_static("anthropic-ratelimit-tokens-limit"),
            HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
            HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
        ],
    ),
    (
        "input-tokens",
        [
            HeaderName::from_static("anthropic-ratelimit-input-tokens-limit"),
            HeaderName::from_static("anthropic-ratelimit-input-tokens-remaining"),
            HeaderName::from_static("anthropic-ratelimit-input-tokens-reset"),
        ],
    ),
    (
        "output-tokens",
        [
            HeaderName::from_static("anthropic-ratelimit-output-tokens-limit"),
            HeaderName::from_static("anthropic-ratelimit-output-tokens-remaining"),
            HeaderName::from_static("anthropic-ratelimit-output-tokens-reset"),
        ],
    ),
];

static GITHUB_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static GITHUB_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static GITHUB_USED: HeaderName = HeaderName::from_static("x-ratelimit-used");
static GITHUB_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
static GITHUB_RESOURCE: HeaderName = HeaderName::from_static("x-ratelimit-resource");

/// GitHub's header names (`x-ratelimit-{limit,remaining,used,reset,resource}`).
static GITHUB_HEADERS: [&HeaderName; 5] = [
    &GITHUB_LIMIT,
    &GITHUB_REMAINING,
    &GITHUB_USED,
    &GITHUB_RESET,
    &GITHUB_RESOURCE,
];

/// Which dialects' headers a response carries at all, from one pass over its header names.
///
/// A reader whose family is absent cannot find a field, so skipping it changes no result; the
/// test is exactly the set of names each reader looks up (IETF: every name starting with
/// `ratelimit`, which covers `ratelimit`, `ratelimit-policy` and the older separate fields).
#[derive(Debug, Clone, Copy, Default)]
struct Families {
    ietf: bool,
    openai: bool,
    anthropic: bool,
    github: bool,
}

impl Families {
    fn of(headers: &HeaderMap) -> Self {
        let mut present = Families::default();
        for key in headers.keys() {
            // Header names are stored lowercase.
            let name = key.as_str();
            if name.starts_with("ratelimit") {
                present.ietf = true;
            } else if name.starts_with("x-ratelimit-") {
                if OPENAI_HEADERS.iter().any(|(_, names)| names.contains(key)) {
                    present.openai = true;
                } else if GITHUB_HEADERS.contains(&key) {
                    present.github = true;
                }
            } else if name.starts_with("anthropic-ratelimit-") {
                present.anthropic = true;
            }
        }
        present
    }
}

fn sf_name(item: &sfv::BareItem) -> Option<String> {
    match item {
        sfv::BareItem::String(s) => Some(s.as_str().to_owned()),
        sfv::BareItem::Token(t) => Some(t.as_str().to_owned()),
        _ => None,
    }
}

fn sf_param_u64(params: &sfv::Parameters, key: &str) -> Option<u64> {
    params
        .iter()
        .find(|(k, _)| k.as_str() == key)
        .and_then(|(_, v)| v.as_integer())
        .and_then(|i| u64::try_from(i).ok())
}

fn sf_items(value: &str) -> Vec<sfv::Item> {
    sfv::Parser::new(value)
        .parse::<sfv::List>()
        .map(|list| {
            list.into_iter()
                .filter_map(|e| match e {
                    sfv::ListEntry::Item(i) => Some(i),
                    sfv::ListEntry::InnerList(_) => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn entry(
    out: &mut Vec<QuotaObservation>,
    start: usize,
    dialect: Dialect,
    policy: Option<String>,
) -> &mut QuotaObservation {
    let pos = out[start..]
        .iter()
        .position(|o| o.dialect == dialect && o.policy == policy);
    match pos {
        Some(p) => &mut out[start + p],
        None => {
            out.push(QuotaObservation::new(dialect, policy));
            let last = out.len() - 1;
            &mut out[last]
        }
    }
}

/// Leading integer of a legacy `RateLimit-Limit` value such as `100, 100;w=60`.
fn leading_uint(s: &str) -> Option<u64> {
    let first = s.split([',', ';']).next()?;
    parse_uint(first)
}

fn ietf(ctx: &Ctx<'_>, out: &mut Vec<QuotaObservation>) {
    let start = out.len();
    let d = Dialect::Ietf;
    // RateLimit-Policy: "default";q=100;w=60  (older drafts: 100;w=60)
    if let Some(v) = ctx.text("ratelimit-policy") {
        for item in sf_items(v) {
            let (name, limit) = match &item.bare_item {
                sfv::BareItem::Integer(i) => (None, u64::try_from(*i).ok()),
                other => (sf_name(other), sf_param_u64(&item.params, "q")),
            };
            let window = sf_param_u64(&item.params, "w").map(Duration::from_secs);
            let o = entry(out, start, d, name);
            o.limit = o.limit.or(limit);
            o.window = o.window.or(window);
        }
    }
    // RateLimit: "default";r=50;t=30  (older drafts: limit=100, remaining=50, reset=30)
    if let Some(v) = ctx.text("ratelimit") {
        let items = sf_items(v);
        if !items.is_empty() {
            for item in items {
                let Some(name) = sf_name(&item.bare_item) else {
                    continue;
                };
                let remaining = sf_param_u64(&item.params, "r");
                let reset =
                    sf_param_u64(&item.params, "t").and_then(|t| ctx.after(Duration::from_secs(t)));
                let o = entry(out, start, d, Some(name));
                o.remaining = remaining.or(o.remaining);
                o.reset_at = reset.or(o.reset_at);
            }
        } else if let Ok(dict) = sfv::Parser::new(v).parse::<sfv::Dictionary>() {
            let get = |k: &str| {
                dict.iter()
                    .find(|(key, _)| key.as_str() == k)
                    .and_then(|(_, e)| match e {
                        sfv::ListEntry::Item(i) => i.bare_item.as_integer(),
                        sfv::ListEntry::InnerList(_) => None,
                    })
                    .and_then(|i| u64::try_from(i).ok())
            };
            let (limit, remaining, reset) = (get("limit"), get("remaining"), get("reset"));
            if limit.is_some() || remaining.is_some() || reset.is_some() {
                let o = entry(out, start, d, None);
                o.limit = limit.or(o.limit);
                o.remaining = remaining.or(o.remaining);
                o.reset_at = reset
                    .and_then(|t| ctx.after(Duration::from_secs(t)))
                    .or(o.reset_at);
            }
        }
    }
    // Older separate fields.
    let limit = ctx.text("ratelimit-limit").and_then(leading_uint);
    let remaining = ctx.text("ratelimit-remaining").and_then(leading_uint);
    let reset = ctx
        .text("ratelimit-reset")
        .and_then(leading_uint)
        .and_then(|t| ctx.after(Duration::from_secs(t)));
    if limit.is_some() || remaining.is_some() || reset.is_some() {
        let o = entry(out, start, d, None);
        o.limit = o.limit.or(limit);
        o.remaining = o.remaining.or(remaining);
        o.reset_at = o.reset_at.or(reset);
    }
    out.retain(|o| !o.is_empty());
}

fn openai(ctx: &Ctx<'_>, generic: bool, out: &mut Vec<QuotaObservation>) {
    for (policy, [limit, remaining, reset]) in &OPENAI_HEADERS {
        let mut o = QuotaObservation::new(Dialect::Openai, None);
        o.limit = ctx.uint(limit);
        o.remaining = ctx.uint(remaining);
        o.reset_at = ctx
            .text(reset)
            .and_then(|v| {
                parse_go_duration(v)
                    .ok()
                    .or_else(|| if generic { parse_seconds(v) } else { None })
            })
            .and_then(|d| ctx.after(d));
        if !o.is_empty() {
            o.policy = Some(String::from(*policy));
            out.push(o);
        }
    }
}

fn anthropic(ctx: &Ctx<'_>, out: &mut Vec<QuotaObservation>) {
    for (policy, [limit, remaining, reset]) in &ANTHROPIC_HEADERS {
        let mut o = QuotaObservation::new(Dialect::Anthropic, None);
        o.limit = ctx.uint(limit);
        o.remaining = ctx.uint(remaining);
        o.reset_at = ctx
            .text(reset)
            .and_then(|v| v.parse::<Timestamp>().ok())
            .and_then(|t| ctx.absolute(t));
        if !o.is_empty() {
            o.policy = Some(String::from(*policy));
            out.push(o);
        }
    }
}

fn github(ctx: &Ctx<'_>, generic: bool, out: &mut Vec<QuotaObservation>) {
    let mut o = QuotaObservation::new(
        Dialect::Github,
        ctx.text(&GITHUB_RESOURCE).map(str::to_owned),
    );
    o.limit = ctx.uint(&GITHUB_LIMIT);
    o.remaining = ctx.uint(&GITHUB_REMAINING).or_else(|| {
        let used = ctx.uint(&GITHUB_USED)?;
        Some(o.limit?.saturating_sub(used))
    });
    if let Some(v) = ctx.text(&GITHUB_RESET) {
        if generic {
            // Reset headers named like GitHub's but meaning seconds-until-reset (Modrinth): only
            // the epoch-seconds reading is GitHub's; the others are labelled `generic`.
            let (reset_at, github_like, how) = match parse_uint(v) {
                Some(n) if n > 1_000_000_000_000 => (
                    ctx.epoch_millis(n),
                    false,
                    "as epoch milliseconds (generic: > 10^12)",
                ),
                Some(n) if n > 1_000_000_000 => (
                    ctx.epoch_seconds(n),
                    true,
                    "as epoch seconds (generic: > 10^9)",
                ),
                Some(n) => (
                    ctx.after(Duration::from_secs(n)),
                    false,
                    "as a delay in seconds (generic: ≤ 10^9)",
                ),
                None => (
                    parse_seconds(v).and_then(|d| ctx.after(d)),
                    false,
                    "as a delay in seconds (generic: not an integer)",
                ),
            };
            if reset_at.is_some() {
                o.reset_at = reset_at;
                o.interpretation = Some(format!("x-ratelimit-reset {v} read {how}"));
                if !github_like {
                    o.dialect = Dialect::Generic;
                }
            }
        } else {
            o.reset_at = parse_uint(v).and_then(|n| ctx.epoch_seconds(n));
        }
    }
    if o.limit.is_some() || o.remaining.is_some() || o.reset_at.is_some() {
        out.push(o);
    }
}

/// The boundary implied by exhausted quotas, with the default `min_delay` (1 s).
///
/// See [`quota_boundary_with`].
pub fn quota_boundary(obs: &[QuotaObservation], received_at: Timestamp) -> Option<Boundary> {
    quota_boundary_with(obs, received_at, &RetryAfterOptions::default())
}

/// The boundary implied by exhausted quotas (SPEC §2.3).
///
/// Only observations with `remaining == 0` and a `reset_at` count. The boundary is the latest
/// such reset plus [`RESET_SAFETY_MARGIN`] (1 s); a reset already past (reset + margin ≤
/// `received_at`) means "now", i.e. `opts.min_delay` from `received_at`, never a huge wait. A
/// boundary beyond `opts.ceiling` is `Unknown`. `None` when no quota is exhausted. `source` reads
/// like `openai quota (tokens) reset`; the reason carries the observation's `interpretation`.
pub fn quota_boundary_with(
    obs: &[QuotaObservation],
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Option<Boundary> {
    let margin = SignedDuration::try_from(RESET_SAFETY_MARGIN).unwrap_or(SignedDuration::ZERO);
    let (o, reset) = obs
        .iter()
        .filter(|o| o.remaining == Some(0))
        .filter_map(|o| Some((o, o.reset_at?)))
        .max_by_key(|(_, r)| *r)?;
    let source = match &o.policy {
        Some(p) => format!("{} quota ({p}) reset", o.dialect),
        None => format!("{} quota reset", o.dialect),
    };
    let read_as = o
        .interpretation
        .as_ref()
        .map_or_else(String::new, |i| format!("; {i}"));
    let target = reset.checked_add(margin).unwrap_or(reset);
    let until = received_at.duration_until(target);
    if until.is_negative() || until.is_zero() {
        return Some(boundary_after(
            Duration::ZERO,
            received_at,
            opts,
            &source,
            None,
            None,
            Some(format!(
                "remaining 0 but reset already past{read_as}; min_delay applied"
            )),
        ));
    }
    Some(boundary_after(
        until.unsigned_abs(),
        received_at,
        opts,
        &source,
        None,
        None,
        Some(format!("remaining 0{read_as}; reset + 1 s safety margin")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractional_reset_seconds_round_up_past_nine_digits() {
        let at: Timestamp = "2025-03-01T12:00:00Z".parse().expect("valid instant");
        for (value, expected) in [
            ("1.5", Duration::new(1, 500_000_000)),
            ("1.000000001", Duration::new(1, 1)),
            // A tenth digit is finer than a nanosecond: never read as earlier than stated.
            ("1.0000000001", Duration::new(1, 1)),
            (" 1.0000000000000000000001 ", Duration::new(1, 1)),
            ("1.0000000000", Duration::new(1, 0)),
        ] {
            assert_eq!(parse_seconds(value), Some(expected), "{value:?}");
            let mut headers = HeaderMap::new();
            headers.insert(
                HeaderName::from_static("x-ratelimit-reset"),
                http::HeaderValue::from_str(value).expect("header value"),
            );
            let obs = parse_quota(&headers, Dialect::Generic, at);
            let expected_at = at
                .checked_add(SignedDuration::try_from(expected).expect("small"))
                .expect("in range");
            assert_eq!(obs.len(), 1, "{value:?}");
            assert_eq!(obs[0].reset_at, Some(expected_at), "{value:?}");
        }
        for value in ["", "1.", ".5", "-1", "1e3", "1.5s"] {
            assert_eq!(parse_seconds(value), None, "{value:?}");
        }
    }

    fn only(name: &HeaderName) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), http::HeaderValue::from_static("1"));
        headers
    }

    /// What the test compares of one observation: dialect, policy, limit, remaining.
    type Seen = (Dialect, Option<String>, Option<u64>, Option<u64>);

    fn flags(f: Families) -> [bool; 4] {
        [f.ietf, f.openai, f.anthropic, f.github]
    }

    #[test]
    fn each_reader_name_marks_exactly_its_family() {
        let ietf = [
            "ratelimit",
            "ratelimit-policy",
            "ratelimit-limit",
            "ratelimit-remaining",
            "ratelimit-reset",
        ];
        for name in ietf.map(HeaderName::from_static) {
            assert_eq!(
                flags(Families::of(&only(&name))),
                [true, false, false, false],
                "{name}"
            );
        }
        for name in OPENAI_HEADERS.iter().flat_map(|(_, names)| names) {
            assert_eq!(
                flags(Families::of(&only(name))),
                [false, true, false, false],
                "{name}"
            );
        }
        for name in ANTHROPIC_HEADERS.iter().flat_map(|(_, names)| names) {
            assert_eq!(
                flags(Families::of(&only(name))),
                [false, false, true, false],
                "{name}"
            );
        }
        for name in GITHUB_HEADERS {
            assert_eq!(
                flags(Families::of(&only(name))),
                [false, false, false, true],
                "{name}"
            );
        }
        for name in ["retry-after", "date", "x-ratelimit-other", "x-should-retry"]
            .map(HeaderName::from_static)
        {
            assert_eq!(flags(Families::of(&only(&name))), [false; 4], "{name}");
        }
    }

    #[test]
    fn names_are_those_the_readers_document() {
        for (policy, [limit, remaining, reset]) in &OPENAI_HEADERS {
            assert_eq!(limit.as_str(), format!("x-ratelimit-limit-{policy}"));
            assert_eq!(
                remaining.as_str(),
                format!("x-ratelimit-remaining-{policy}")
            );
            assert_eq!(reset.as_str(), format!("x-ratelimit-reset-{policy}"));
        }
        for (policy, [limit, remaining, reset]) in &ANTHROPIC_HEADERS {
            assert_eq!(
                limit.as_str(),
                format!("anthropic-ratelimit-{policy}-limit")
            );
            assert_eq!(
                remaining.as_str(),
                format!("anthropic-ratelimit-{policy}-remaining")
            );
            assert_eq!(
                reset.as_str(),
                format!("anthropic-ratelimit-{policy}-reset")
            );
        }
    }

    #[test]
    fn generic_dialect_reads_every_family_of_one_response() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("ratelimit-limit", "100"),
            ("x-ratelimit-remaining-requests", "7"),
            ("anthropic-ratelimit-tokens-remaining", "9"),
            ("x-ratelimit-used", "3"),
            ("x-ratelimit-limit", "60"),
        ] {
            headers.insert(name, http::HeaderValue::from_static(value));
        }
        let now: Timestamp = "2026-03-01T12:00:00Z".parse().expect("timestamp");
        let found: Vec<Seen> = parse_quota(&headers, Dialect::Generic, now)
            .into_iter()
            .map(|o| (o.dialect, o.policy, o.limit, o.remaining))
            .collect();
        assert_eq!(
            found,
            vec![
                (Dialect::Ietf, None, Some(100), None),
                (Dialect::Openai, Some("requests".into()), None, Some(7)),
                (Dialect::Anthropic, Some("tokens".into()), None, Some(9)),
                (Dialect::Github, None, Some(60), Some(57)),
            ]
        );
    }
}
