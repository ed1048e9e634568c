//! # What did the provider say? Response or transport error → [`Signal`]
//!
//! Every retry decision starts by classifying what came back (SPEC §2.1). The classification must
//! keep apart things that look alike but need opposite handling: a 429 slows down the whole scope
//! while a 503 must not; a daily quota is not a short rate limit; a connect error (`not_sent`, the
//! provider never saw the request) may be resent while a timeout after the bytes left
//! (`uncertain`) must be reconciled first. Provider hints (`x-should-retry`,
//! `Stripe-Should-Retry`) override the table where policy allows, and provider error codes are read
//! from the error body through a configured JSON pointer (RFC 6901) — only that field is read,
//! nothing of the body is kept.
//!
//! The result, a [`Signal`], also carries the [`Boundary`]: the later of Retry-After and the
//! boundary of an exhausted quota (`remaining: 0` with a reset), else a hint from the error body
//! (Google `RetryInfo.retryDelay`, `resets_in_seconds`), else `unknown`.
//!
//! ```
//! use backstop_core::classify::{classify, ClassifyRules, Disposition, Observed, ResponseView};
//! use http::HeaderMap;
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after", "10".parse().unwrap());
//! let rules = ClassifyRules::with_retry_statuses(vec![408, 429, 500, 502, 503, 504]);
//! let now: jiff::Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
//! let view = ResponseView { status: 429, headers: &headers, body: None };
//! let signal = classify(&Observed::Response(view), &rules, now);
//! assert_eq!(signal.disposition, Disposition::RateLimited);
//! assert!(signal.retryable);
//! assert_eq!(signal.boundary.retry_not_before().unwrap().to_string(), "2025-01-01T00:00:10Z");
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::duration::parse_go_duration;
use crate::quota::{parse_quota, quota_boundary_with, Dialect, QuotaObservation};
use crate::retry_after::{boundary_after, normalize, Boundary, RetryAfterOptions};

pub use http::{HeaderMap, HeaderName, HeaderValue};

/// What a response or transport error means for scheduling (SPEC §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    /// 2xx: done (an outcome receipt may still be required).
    Success,
    /// Slow down the whole scope and honour the boundary (429; 403 with GitHub-style limit signs).
    RateLimited,
    /// Billing or daily quota exhausted: wait for the reset or escalate, never a short loop.
    QuotaExhausted,
    /// 503/529: bounded retry, may honour Retry-After, does not lower the scope's pacing.
    Unavailable,
    /// 408/500/502/504: bounded retry within the class budget.
    Transient,
    /// Connect/DNS/TLS failure before any request byte was written: the provider never saw it.
    NotSent,
    /// Timeout, reset or EOF after bytes were written, or a cut response: reconcile first.
    Uncertain,
    /// 409: duplicate, version conflict or lock; no blind retry.
    Conflict,
    /// The request (or permissions) must change; retrying is waste.
    Rejected,
}

impl Disposition {
    /// The snake_case name used in JSON and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Disposition::Success => "success",
            Disposition::RateLimited => "rate_limited",
            Disposition::QuotaExhausted => "quota_exhausted",
            Disposition::Unavailable => "unavailable",
            Disposition::Transient => "transient",
            Disposition::NotSent => "not_sent",
            Disposition::Uncertain => "uncertain",
            Disposition::Conflict => "conflict",
            Disposition::Rejected => "rejected",
        }
    }
}

impl fmt::Display for Disposition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transport failure, split by whether request bytes had been written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportError {
    /// TCP connect failed: nothing was sent.
    Connect,
    /// Name resolution failed: nothing was sent.
    Dns,
    /// TLS handshake failed: no request byte was sent.
    Tls,
    /// Timed out after request bytes were written.
    TimeoutAfterSend,
    /// Connection reset (or EOF) after request bytes were written.
    ResetAfterSend,
    /// The response started but was cut short.
    ResponseCut,
}

impl TransportError {
    /// Whether the request may have reached the provider.
    pub fn maybe_delivered(self) -> bool {
        matches!(
            self,
            TransportError::TimeoutAfterSend
                | TransportError::ResetAfterSend
                | TransportError::ResponseCut
        )
    }

    /// The kebab-case name (`connect`, `timeout-after-send`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            TransportError::Connect => "connect",
            TransportError::Dns => "dns",
            TransportError::Tls => "tls",
            TransportError::TimeoutAfterSend => "timeout-after-send",
            TransportError::ResetAfterSend => "reset-after-send",
            TransportError::ResponseCut => "response-cut",
        }
    }

    /// What happened, in words for a person (`could not connect`, …).
    pub fn describe(self) -> &'static str {
        match self {
            TransportError::Connect => "could not connect",
            TransportError::Dns => "could not resolve the host name",
            TransportError::Tls => "the TLS handshake failed",
            TransportError::TimeoutAfterSend => "no response in time after the request was sent",
            TransportError::ResetAfterSend => {
                "the connection was closed after the request was sent"
            }
            TransportError::ResponseCut => "the response was cut short",
        }
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transport error name that is not one of the known kinds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport error {0:?} (expected connect, dns, tls, timeout-after-send, reset-after-send or response-cut)")]
pub struct UnknownTransportError(pub String);

impl FromStr for TransportError {
    type Err = UnknownTransportError;

    /// Accepts `connect|dns|tls|timeout-after-send|reset-after-send|response-cut` (also with `_`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "connect" => Ok(TransportError::Connect),
            "dns" => Ok(TransportError::Dns),
            "tls" => Ok(TransportError::Tls),
            "timeout-after-send" => Ok(TransportError::TimeoutAfterSend),
            "reset-after-send" => Ok(TransportError::ResetAfterSend),
            "response-cut" => Ok(TransportError::ResponseCut),
            _ => Err(UnknownTransportError(s.to_owned())),
        }
    }
}

/// The provider error codes every rule set knows unless overridden:
/// OpenAI `insufficient_quota` and `billing_hard_limit_reached`, ChatGPT `usage_limit_reached`
/// → [`Disposition::QuotaExhausted`]; Google `RESOURCE_EXHAUSTED` → [`Disposition::RateLimited`]
/// (upgraded to `QuotaExhausted` when the violated quota is a `…PerDay` one).
pub fn default_error_codes() -> BTreeMap<String, Disposition> {
    [
        ("insufficient_quota", Disposition::QuotaExhausted),
        ("billing_hard_limit_reached", Disposition::QuotaExhausted),
        ("usage_limit_reached", Disposition::QuotaExhausted),
        ("RESOURCE_EXHAUSTED", Disposition::RateLimited),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// How to read one provider's responses for one request class.
///
/// `Default` gives: no retry statuses, no pointers, [`default_error_codes`], hints honoured,
/// generic dialect, default Retry-After limits.
#[derive(Debug, Clone)]
pub struct ClassifyRules {
    /// Statuses the request class may retry (SPEC §3 `retry_statuses`); decides `retryable`.
    pub retry_statuses: Vec<u16>,
    /// RFC 6901 JSON pointer to the provider error code in the error body, e.g. `/error/code`.
    pub error_code_pointer: Option<String>,
    /// Provider error code → disposition (applies to non-2xx responses).
    pub error_codes: BTreeMap<String, Disposition>,
    /// Honour `x-should-retry` / `Stripe-Should-Retry` (default true).
    pub honour_hints: bool,
    /// Quota header dialect of the provider.
    pub dialect: Dialect,
    /// Limits for Retry-After and every other boundary.
    pub retry_after: RetryAfterOptions,
    /// RFC 6901 pointers to a Google-style `retryDelay` (`"45.837906927s"`); first match wins.
    /// Example: `/error/details/1/retryDelay`.
    pub retry_delay_pointers: Vec<String>,
    /// RFC 6901 pointers to the violated quota's name (e.g. Google `quotaId`); a name containing
    /// `PerDay` makes the response `quota_exhausted`.
    pub quota_id_pointers: Vec<String>,
    /// RFC 6901 pointers to a `resets_in_seconds` number (ChatGPT `usage_limit_reached`).
    pub resets_in_seconds_pointers: Vec<String>,
}

impl Default for ClassifyRules {
    fn default() -> Self {
        Self {
            retry_statuses: Vec::new(),
            error_code_pointer: None,
            error_codes: default_error_codes(),
            honour_hints: true,
            dialect: Dialect::Generic,
            retry_after: RetryAfterOptions::default(),
            retry_delay_pointers: Vec::new(),
            quota_id_pointers: Vec::new(),
            resets_in_seconds_pointers: Vec::new(),
        }
    }
}

impl ClassifyRules {
    /// Defaults with the given retry statuses of the request class.
    pub fn with_retry_statuses(retry_statuses: Vec<u16>) -> Self {
        Self {
            retry_statuses,
            ..Self::default()
        }
    }

    fn allows(&self, status: u16) -> bool {
        self.retry_statuses.contains(&status)
    }
}

/// A received response, borrowed: status, headers and (optionally) the error body bytes.
#[derive(Debug, Clone, Copy)]
pub struct ResponseView<'a> {
    /// HTTP status code.
    pub status: u16,
    /// Response headers.
    pub headers: &'a HeaderMap,
    /// The body, when the caller wants error codes or body hints read from it.
    pub body: Option<&'a [u8]>,
}

/// What came back from one attempt.
#[derive(Debug, Clone, Copy)]
pub enum Observed<'a> {
    /// A response with a status line.
    Response(ResponseView<'a>),
    /// No (complete) response.
    Transport(TransportError),
}

/// A provider retry hint seen on the response and whether it was applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hint {
    /// Header name as matched (`x-should-retry` or `stripe-should-retry`).
    pub header: String,
    /// Raw header value.
    pub value: String,
    /// The hint's meaning: `Some(true)` retry, `Some(false)` don't, `None` unreadable.
    pub should_retry: Option<bool>,
    /// Whether the hint changed or confirmed `retryable`.
    pub applied: bool,
    /// Why the hint was (not) applied.
    pub reason: String,
}

/// The normalized signal of one attempt.
#[derive(Debug, Clone, Serialize)]
pub struct Signal {
    /// What the response means (SPEC §2.1).
    pub disposition: Disposition,
    /// Whether the request class may try again (after the boundary, if any).
    pub retryable: bool,
    /// Earliest retry instant, or why it is unknown.
    pub boundary: Boundary,
    /// Quota observations from the headers (empty for transport errors).
    pub quota: Vec<QuotaObservation>,
    /// A provider retry hint, if one was present.
    pub hint: Option<Hint>,
    /// The provider error code read through `error_code_pointer`, if any (at most
    /// [`MAX_ERROR_CODE_CHARS`] characters).
    pub error_code: Option<String>,
    /// Why no error code was read although `error_code_pointer` is set: `no body`,
    /// `body is not JSON`, `nothing at the pointer`, `not a string, number or boolean at the
    /// pointer`, or `longer than 256 characters`. `None` when a code was read or none was asked for.
    pub error_code_reason: Option<String>,
}

/// The longest provider error code taken from a body, in characters; a longer value is not a
/// code (it is ignored, with a reason in [`Signal::error_code_reason`]).
pub const MAX_ERROR_CODE_CHARS: usize = 256;

/// Values read from the error body through configured pointers only; the body itself is dropped.
#[derive(Default)]
struct BodyFields {
    error_code: Option<String>,
    error_code_reason: Option<String>,
    retry_delay: Option<(String, String)>,
    quota_id: Option<String>,
    resets_in: Option<(String, String)>,
}

fn scalar_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn read_body(body: Option<&[u8]>, rules: &ClassifyRules) -> BodyFields {
    let wants = rules.error_code_pointer.is_some()
        || !rules.retry_delay_pointers.is_empty()
        || !rules.quota_id_pointers.is_empty()
        || !rules.resets_in_seconds_pointers.is_empty();
    let no_code = |reason: &str| BodyFields {
        error_code_reason: rules.error_code_pointer.as_ref().map(|_| reason.to_owned()),
        ..BodyFields::default()
    };
    let Some(body) = body.filter(|b| wants && !b.is_empty()) else {
        return no_code("no body");
    };
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return no_code("body is not JSON");
    };
    let first = |pointers: &[String]| {
        pointers.iter().find_map(|p| {
            json.pointer(p)
                .and_then(scalar_text)
                .map(|v| (p.clone(), v))
        })
    };
    let (error_code, error_code_reason) = match rules.error_code_pointer.as_deref() {
        None => (None, None),
        Some(p) => match json.pointer(p).filter(|v| !v.is_null()) {
            // ChatGPT's `usage_limit_reached` carries its code as the sibling `type` with no
            // `code`: taken only when it is a code the rules know.
            None => match sibling_type(&json, p, rules) {
                Some(code) => (Some(code), None),
                None => (None, Some("nothing at the pointer".to_owned())),
            },
            Some(v) => match scalar_text(v) {
                None => (
                    None,
                    Some("not a string, number or boolean at the pointer".to_owned()),
                ),
                Some(code) if code.chars().count() > MAX_ERROR_CODE_CHARS => (
                    None,
                    Some(format!("longer than {MAX_ERROR_CODE_CHARS} characters")),
                ),
                Some(code) => (Some(code), None),
            },
        },
    };
    BodyFields {
        error_code,
        error_code_reason,
        retry_delay: first(&rules.retry_delay_pointers),
        quota_id: first(&rules.quota_id_pointers).map(|(_, v)| v),
        resets_in: first(&rules.resets_in_seconds_pointers),
    }
}

/// The `type` beside an error-code `pointer` ending in `/code` (`/error/code` → `/error/type`),
/// when it is a code `rules.error_codes` maps: the shape ChatGPT answers `usage_limit_reached`
/// in (`{"error":{"type":"usage_limit_reached","resets_in_seconds":…}}`, no `code`).
fn sibling_type(json: &serde_json::Value, pointer: &str, rules: &ClassifyRules) -> Option<String> {
    let parent = pointer.strip_suffix("/code")?;
    let code = json.pointer(&format!("{parent}/type"))?.as_str()?;
    rules
        .error_codes
        .contains_key(code)
        .then(|| code.to_owned())
}

/// The table of SPEC §2.1 for a status, before codes, envoy marks and hints.
fn status_disposition(status: u16, headers: &HeaderMap, rules: &ClassifyRules) -> Disposition {
    match status {
        200..=299 => Disposition::Success,
        429 => Disposition::RateLimited,
        503 | 529 => Disposition::Unavailable,
        408 | 500 | 502 | 504 => Disposition::Transient,
        409 => Disposition::Conflict,
        403 => {
            let exhausted = headers
                .get_all(&X_RATELIMIT_REMAINING)
                .iter()
                .any(|v| v.to_str().map(|s| s.trim() == "0").unwrap_or(false));
            let has_retry_after = headers.contains_key(http::header::RETRY_AFTER)
                || headers.contains_key(&RETRY_AFTER_MS);
            if exhausted || has_retry_after {
                Disposition::RateLimited
            } else {
                Disposition::Rejected
            }
        }
        400 | 401 | 404 | 405 | 410 | 413 | 422 => Disposition::Rejected,
        s if rules.allows(s) => Disposition::Transient,
        _ => Disposition::Rejected,
    }
}

/// Whether the class allows retrying this disposition at this status (before hints).
fn class_allows(disposition: Disposition, status: u16, rules: &ClassifyRules, known: bool) -> bool {
    match disposition {
        Disposition::Success | Disposition::Uncertain => false,
        Disposition::NotSent => !rules.retry_statuses.is_empty(),
        Disposition::RateLimited => rules.allows(status) || rules.allows(429),
        // Only with a known reset: without one, waiting for "later" would be a guess.
        Disposition::QuotaExhausted => known && (rules.allows(status) || rules.allows(429)),
        Disposition::Unavailable => rules.allows(status) || rules.allows(503),
        Disposition::Transient | Disposition::Conflict | Disposition::Rejected => {
            rules.allows(status)
        }
    }
}

/// Hint header names, looked up as [`HeaderName`]s (no name parsing per lookup).
static X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
static STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");
static X_ENVOY_RATELIMITED: HeaderName = HeaderName::from_static("x-envoy-ratelimited");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

fn read_hint(headers: &HeaderMap) -> Option<(String, String, Option<bool>)> {
    [&X_SHOULD_RETRY, &STRIPE_SHOULD_RETRY]
        .into_iter()
        .find_map(|name| {
            let v = headers.get(name)?;
            let raw = String::from_utf8_lossy(v.as_bytes()).into_owned();
            let meaning = match raw.trim().to_ascii_lowercase().as_str() {
                "true" => Some(true),
                "false" => Some(false),
                _ => None,
            };
            Some((name.as_str().to_owned(), raw, meaning))
        })
}

/// A boundary from the body hints. A `retryDelay` is skipped for a per-day quota: Google sends a
/// short delay there, and retrying every few seconds until the daily reset is the loop SPEC §2.1
/// forbids.
fn body_boundary(
    fields: &BodyFields,
    per_day: bool,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Option<Boundary> {
    if let Some((pointer, raw)) = fields.retry_delay.as_ref().filter(|_| !per_day) {
        if let Ok(d) = parse_go_duration(raw) {
            let source = format!("body {pointer}");
            return Some(boundary_after(
                d,
                received_at,
                opts,
                &source,
                Some(raw),
                None,
                None,
            ));
        }
    }
    if let Some((pointer, raw)) = &fields.resets_in {
        let secs = raw
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0);
        if let Some(secs) = secs {
            if let Ok(d) = std::time::Duration::try_from_secs_f64(secs) {
                let source = format!("body {pointer}");
                return Some(boundary_after(
                    d,
                    received_at,
                    opts,
                    &source,
                    Some(raw),
                    None,
                    None,
                ));
            }
        }
    }
    None
}

/// Joins a known Retry-After boundary with a known exhausted-quota boundary: the LATER one wins,
/// because retrying before either would hit the limit again (SPEC §2.2: never invent a permission
/// the provider did not give). The winner keeps its own `source`, `raw` and `clock`; its `reason`
/// records the other boundary, so both are visible.
fn later_of(retry_after: Boundary, quota: Boundary) -> Boundary {
    let describe = |b: &Boundary| match b {
        Boundary::Known {
            retry_not_before,
            delay_ms,
            source,
            raw,
            ..
        } => match raw {
            Some(raw) => format!("{source} {raw:?} gives {retry_not_before} ({delay_ms} ms)"),
            None => format!("{source} gives {retry_not_before} ({delay_ms} ms)"),
        },
        Boundary::Unknown { .. } => String::new(),
    };
    let (ra_at, q_at) = match (retry_after.retry_not_before(), quota.retry_not_before()) {
        (Some(a), Some(b)) => (a, b),
        _ => return retry_after,
    };
    let (mut winner, note) = if q_at > ra_at {
        let note = format!(
            "{}; the exhausted quota's boundary is later and wins",
            describe(&retry_after)
        );
        (quota, note)
    } else {
        let note = format!("{} is not later; Retry-After wins", describe(&quota));
        (retry_after, note)
    };
    if let Boundary::Known { reason, .. } = &mut winner {
        *reason = Some(match reason.take() {
            Some(r) => format!("{r}; {note}"),
            None => note,
        });
    }
    winner
}

/// Whether the engine tries `signal`'s request again (within its budget and after its
/// boundary): the signal's own [`Signal::retryable`], or, for a request without side effects
/// (`has_side_effect` false: a safe method, or a class with `side_effect: none` such as a read or
/// an LLM completion, SPEC §4.2a), an `uncertain` answer too — it changed nothing to protect, so
/// there is nothing to reconcile first. One rule for the gateway and `backstop classify`.
pub fn tried_again(signal: &Signal, has_side_effect: bool) -> bool {
    signal.retryable || (signal.disposition == Disposition::Uncertain && !has_side_effect)
}

/// Classifies one attempt's result (SPEC §2.1–§2.3).
///
/// - `observed`: the response (status, headers, optional body) or the transport error.
/// - `rules`: the provider's and request class's rules.
/// - `received_at`: local instant the response (or error) was observed; all boundaries are
///   relative to it.
///
/// `retryable` = the class allows the status/disposition AND no honoured hint forbids it (a
/// `true` hint may allow a status the table would not retry, but never beyond a class without
/// retries, an `uncertain` result or a success). `not_sent` is retryable when the class has any
/// retry status; `uncertain` never is (reconcile first). `quota_exhausted` is retryable only with
/// a known boundary. The boundary is Retry-After, or an exhausted quota's reset (+ 1 s margin)
/// when that is later (both are recorded in `reason`), else the exhausted quota's reset, then a
/// body hint (a Google `retryDelay` is not used for a `…PerDay` quota), else `unknown`. Never panics, whatever the headers or body.
pub fn classify(observed: &Observed<'_>, rules: &ClassifyRules, received_at: Timestamp) -> Signal {
    let view = match observed {
        Observed::Transport(e) => return transport_signal(e, rules),
        Observed::Response(view) => view,
    };
    let headers = view.headers;
    let status = view.status;
    let quota = parse_quota(headers, rules.dialect, received_at);
    let fields = read_body(view.body, rules);
    let per_day = status >= 400
        && fields
            .quota_id
            .as_deref()
            .is_some_and(|q| q.contains("PerDay"));
    let disposition = response_disposition(status, headers, &fields, per_day, rules);
    let boundary = response_boundary(headers, &quota, &fields, per_day, received_at, rules);
    let mut retryable = class_allows(disposition, status, rules, boundary.is_known());
    let hint = read_hint(headers).map(|(header, value, should_retry)| {
        let verdict = hint_verdict(should_retry, disposition, boundary.is_known(), rules);
        if let Some(allowed) = verdict.retryable {
            retryable = allowed;
        }
        Hint {
            header,
            value,
            should_retry,
            applied: verdict.applied,
            reason: verdict.reason,
        }
    });
    Signal {
        disposition,
        retryable,
        boundary,
        quota,
        hint,
        error_code: fields.error_code,
        error_code_reason: fields.error_code_reason,
    }
}

/// The signal of an attempt without a (complete) response: `uncertain` when the request may
/// have reached the provider (never retryable), else `not_sent` (retryable when the class has
/// any retry status). Its boundary is unknown.
fn transport_signal(e: &TransportError, rules: &ClassifyRules) -> Signal {
    let (disposition, retryable, reason) = if e.maybe_delivered() {
        (
            Disposition::Uncertain,
            false,
            format!("{e}: the provider may have acted; a write is reconciled before any resend, a request without side effects (a read, an LLM completion) is retried"),
        )
    } else {
        (
            Disposition::NotSent,
            !rules.retry_statuses.is_empty(),
            format!("{e}: no request byte reached the provider"),
        )
    };
    Signal {
        disposition,
        retryable,
        boundary: Boundary::Unknown {
            raw: None,
            reason,
            source: None,
        },
        quota: Vec::new(),
        hint: None,
        error_code: None,
        error_code_reason: rules
            .error_code_pointer
            .as_ref()
            .map(|_| "no response (transport error)".to_owned()),
    }
}

/// The disposition of a response: 1. the status table; on an error response, 2. the provider's
/// error code, then a per-day quota name (`rate_limited` becomes `quota_exhausted`), then
/// 3. Envoy's rate-limit mark, even on 503.
fn response_disposition(
    status: u16,
    headers: &HeaderMap,
    fields: &BodyFields,
    per_day: bool,
    rules: &ClassifyRules,
) -> Disposition {
    let mut disposition = status_disposition(status, headers, rules);
    if status < 400 {
        return disposition;
    }
    if let Some(mapped) = fields
        .error_code
        .as_ref()
        .and_then(|c| rules.error_codes.get(c))
    {
        disposition = *mapped;
    }
    if per_day && matches!(disposition, Disposition::RateLimited) {
        disposition = Disposition::QuotaExhausted;
    }
    if headers.contains_key(&X_ENVOY_RATELIMITED)
        && !matches!(disposition, Disposition::QuotaExhausted)
    {
        disposition = Disposition::RateLimited;
    }
    disposition
}

/// The boundary of a response: Retry-After (or an exhausted quota's reset when that is later),
/// else the exhausted quota's reset, else a body hint, else Retry-After's unknown boundary.
fn response_boundary(
    headers: &HeaderMap,
    quota: &[QuotaObservation],
    fields: &BodyFields,
    per_day: bool,
    received_at: Timestamp,
    rules: &ClassifyRules,
) -> Boundary {
    let opts = &rules.retry_after;
    let ra = normalize(headers, received_at, opts);
    let exhausted = quota_boundary_with(quota, received_at, opts).filter(Boundary::is_known);
    if ra.is_known() {
        match exhausted {
            Some(q) => later_of(ra, q),
            None => ra,
        }
    } else if let Some(b) = exhausted {
        b
    } else if let Some(b) =
        body_boundary(fields, per_day, received_at, opts).filter(Boundary::is_known)
    {
        b
    } else {
        ra
    }
}

/// What a provider retry hint does to a response's `retryable`.
struct HintVerdict {
    /// The new `retryable`, when the hint is applied.
    retryable: Option<bool>,
    /// Whether the hint was applied.
    applied: bool,
    /// Why or why not.
    reason: String,
}

/// The verdict on a hint whose value says `should_retry` (`None`: unreadable). A "retry" hint
/// applies only when the class has retry statuses, the disposition is neither a success nor
/// `uncertain`, and an exhausted quota has a known boundary (`boundary_known`).
fn hint_verdict(
    should_retry: Option<bool>,
    disposition: Disposition,
    boundary_known: bool,
    rules: &ClassifyRules,
) -> HintVerdict {
    let verdict = |retryable: Option<bool>, applied: bool, reason: &str| HintVerdict {
        retryable,
        applied,
        reason: reason.to_owned(),
    };
    match (rules.honour_hints, should_retry) {
        (false, _) => verdict(None, false, "hints are not honoured for this provider"),
        (true, None) => verdict(None, false, "unreadable hint value"),
        (true, Some(false)) => verdict(Some(false), true, "provider says do not retry"),
        (true, Some(true)) => {
            let can = !rules.retry_statuses.is_empty()
                && !matches!(disposition, Disposition::Success | Disposition::Uncertain)
                && (disposition != Disposition::QuotaExhausted || boundary_known);
            if can {
                verdict(Some(true), true, "provider says retry")
            } else {
                verdict(
                    None,
                    false,
                    "provider says retry, but the class or disposition forbids it",
                )
            }
        }
    }
}
