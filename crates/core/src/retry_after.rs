//! # Retry-After → a boundary (`retry_not_before`)
//!
//! Why normalize at all? `Retry-After` (RFC 9110 §10.2.3) looks simple — "seconds or an
//! HTTP-date" — but real servers send decimals (`1.5`), Go durations (`1m0s`), values joined by a
//! proxy (`7, 7`), dates in three formats, dates computed on a skewed clock, and OpenAI/Azure add
//! `retry-after-ms`. A retry that comes early hits the limit again and may get the whole account
//! throttled longer; a wait that was invented (a misread `0x10`, a negative number) is a
//! permission the provider never gave. So every value becomes one [`Boundary`]: either
//! [`Boundary::Known`] with the earliest instant a retry may happen and where that came from, or
//! [`Boundary::Unknown`] with the raw value and the reason it was not usable (SPEC §2.2).
//!
//! Rules, in short:
//! - delay-seconds with surrounding whitespace and decimals (`1.5` → 1500 ms, rounded up to the
//!   millisecond); Go-style durations (`1m0s`); IMF-fixdate, RFC 850 and asctime dates (plus the
//!   RFC 2822 variants some servers emit, such as `+0000` instead of `GMT`);
//! - signs, prefixes (`+3`, `-1`, `0x10`), empty values and garbage → `Unknown` with the raw
//!   value kept; a delay over [`RetryAfterOptions::ceiling`] is a known lower bound, not before
//!   now + the ceiling (the raw value kept), never unknown and never retried before it;
//! - an HTTP-date with a `Date` header in the same response: delay = Retry-After − Date, added to
//!   the local receive time ([`ClockSource::ServerDate`], immune to clock skew); without `Date` it
//!   is compared with the local receive time ([`ClockSource::Local`]);
//! - a date in the past or a zero delay → [`RetryAfterOptions::min_delay`], never a tight loop;
//!   a positive delay below it (`0.503`, `retry-after-ms: 250`) is honoured as given;
//! - several instances or a joined value → the largest valid one; `retry-after-ms` wins over
//!   `Retry-After`.
//!
//! ```
//! use backstop_core::retry_after::{normalize_value, RetryAfterOptions};
//!
//! let received_at: jiff::Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
//! let b = normalize_value(" 1.5 ", None, received_at, &RetryAfterOptions::default());
//! assert_eq!(b.retry_not_before().unwrap().to_string(), "2025-01-01T00:00:01.5Z");
//! ```

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

use crate::duration::parse_go_duration;

/// Name used in [`Boundary`] `source` for the standard header.
pub const SOURCE_RETRY_AFTER: &str = "Retry-After";
/// Name used in [`Boundary`] `source` for OpenAI/Azure's millisecond header.
pub const SOURCE_RETRY_AFTER_MS: &str = "retry-after-ms";

/// The `retry-after-ms` header as a [`http::HeaderName`] (no name parsing per lookup).
static RETRY_AFTER_MS_HEADER: http::HeaderName = http::HeaderName::from_static("retry-after-ms");

/// Limits applied while normalizing a Retry-After value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryAfterOptions {
    /// The wait given for a signal that says "now": a zero delay or a date already past (a
    /// positive delay below it is honoured as given). Default 1 s.
    pub min_delay: Duration,
    /// Largest wait counted: a longer one is the known lower bound `now + ceiling` (SPEC §2.2),
    /// its raw value kept. Default 24 h.
    pub ceiling: Duration,
}

impl Default for RetryAfterOptions {
    fn default() -> Self {
        Self {
            min_delay: Duration::from_secs(1),
            ceiling: Duration::from_secs(24 * 3600),
        }
    }
}

/// Which clock an HTTP-date Retry-After was compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockSource {
    /// The response's own `Date` header: delay = Retry-After − Date (skew-immune).
    ServerDate,
    /// The local receive time, because the response carried no usable `Date`.
    Local,
}

/// The normalized provider boundary: the earliest instant a retry may happen, or why it is not
/// known. Serialized with a `state` tag of `known` or `unknown`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Boundary {
    /// The provider gave a usable signal.
    Known {
        /// Earliest instant (UTC) a retry may be sent.
        retry_not_before: Timestamp,
        /// `retry_not_before` − receive time, in milliseconds.
        delay_ms: u64,
        /// Where the signal came from, e.g. `Retry-After`, `retry-after-ms`, a quota header
        /// family or a body pointer.
        source: String,
        /// The raw value the boundary was read from, when there was one.
        raw: Option<String>,
        /// For HTTP-dates: which clock the date was compared with.
        clock: Option<ClockSource>,
        /// Why the value was adjusted (e.g. `min_delay` applied), if it was.
        reason: Option<String>,
    },
    /// No usable signal: never guess a permission the provider did not give.
    Unknown {
        /// The raw value that could not be used, if any was present.
        raw: Option<String>,
        /// Why there is no boundary (`no Retry-After`, `negative value`, …).
        reason: String,
        /// The header or body field the unusable value came from, if any.
        source: Option<String>,
    },
}

impl Boundary {
    /// The boundary instant, if known.
    pub fn retry_not_before(&self) -> Option<Timestamp> {
        match self {
            Boundary::Known {
                retry_not_before, ..
            } => Some(*retry_not_before),
            Boundary::Unknown { .. } => None,
        }
    }

    /// Whether the boundary is only the lower bound `now + ceiling` of a signal over the
    /// ceiling (SPEC §2.2): the provider's real instant is later, so no retry is ever planned
    /// at it — the action ends with its outcome instead.
    pub fn is_lower_bound(&self) -> bool {
        matches!(self, Boundary::Known { reason: Some(r), .. } if r.contains(LOWER_BOUND))
    }

    /// Whether the provider gave a usable boundary.
    pub fn is_known(&self) -> bool {
        matches!(self, Boundary::Known { .. })
    }

    fn unknown(raw: Option<&str>, reason: impl Into<String>, source: Option<&str>) -> Self {
        Boundary::Unknown {
            raw: raw.map(str::to_owned),
            reason: reason.into(),
            source: source.map(str::to_owned),
        }
    }
}

/// The words every over-the-ceiling boundary's `reason` carries ([`Boundary::is_lower_bound`]).
pub const LOWER_BOUND: &str = "a lower bound, not before now + the ceiling";

/// The boundary of a signal whose delay (`over`, in words) is past `opts.ceiling` (SPEC §2.2):
/// NOT unknown — the provider forbade a retry for at least that long — but the known lower bound
/// `received_at + ceiling`, the raw value kept and the reason saying it is a lower bound. It is
/// beyond any budget, so the action ends at once with its outcome, never retried before it.
fn beyond_ceiling(
    received_at: Timestamp,
    opts: &RetryAfterOptions,
    source: &str,
    raw: Option<&str>,
    clock: Option<ClockSource>,
    over: &str,
) -> Boundary {
    let ceiling_ms = u64::try_from(opts.ceiling.as_millis()).unwrap_or(u64::MAX);
    let reason = format!("{over} is over the ceiling of {ceiling_ms} ms: {LOWER_BOUND}");
    let at = i64::try_from(ceiling_ms).ok().and_then(|ms| {
        received_at
            .checked_add(SignedDuration::from_millis(ms))
            .ok()
    });
    match at {
        Some(retry_not_before) => Boundary::Known {
            retry_not_before,
            delay_ms: ceiling_ms,
            source: source.to_owned(),
            raw: raw.map(str::to_owned),
            clock,
            reason: Some(reason),
        },
        None => Boundary::unknown(
            raw,
            "the ceiling does not fit after the receive time",
            Some(source),
        ),
    }
}

/// Builds a known boundary `delay` after `received_at`, applying `min_delay` and `ceiling`.
///
/// `adjust_reason` explains an adjustment already made by the caller. A zero delay (now, or a
/// date already past) gets `min_delay` (reason `zero delay; min_delay applied` unless the caller
/// gave one), never a tight loop; a positive delay below it (`Retry-After: 0.503`,
/// `retry-after-ms: 250`) is honoured as given (SPEC §2.2). A delay over the ceiling is the known
/// lower bound `received_at + ceiling` (`beyond_ceiling`). Returns `Unknown` only when the
/// instant does not fit in a `Timestamp`. Shared by the Retry-After, quota and body-hint readers
/// so that every boundary obeys the same limits.
pub fn boundary_after(
    delay: Duration,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
    source: &str,
    raw: Option<&str>,
    clock: Option<ClockSource>,
    adjust_reason: Option<String>,
) -> Boundary {
    if delay > opts.ceiling {
        let over = format!("a delay of {} ms", delay.as_millis());
        return beyond_ceiling(received_at, opts, source, raw, clock, &over);
    }
    let (delay, reason) = if delay.is_zero() {
        (
            opts.min_delay,
            Some(adjust_reason.unwrap_or_else(|| "zero delay; min_delay applied".to_owned())),
        )
    } else {
        (delay, adjust_reason)
    };
    // Round up to whole milliseconds: a boundary is never earlier than the provider said.
    let delay_ms_u128 = delay.as_nanos().div_ceil(1_000_000);
    let Ok(delay_ms) = u64::try_from(delay_ms_u128) else {
        return Boundary::unknown(raw, "delay does not fit in u64 milliseconds", Some(source));
    };
    let Ok(delay_ms_i64) = i64::try_from(delay_ms) else {
        return Boundary::unknown(raw, "delay does not fit in i64 milliseconds", Some(source));
    };
    match received_at.checked_add(SignedDuration::from_millis(delay_ms_i64)) {
        Ok(retry_not_before) => Boundary::Known {
            retry_not_before,
            delay_ms,
            source: source.to_owned(),
            raw: raw.map(str::to_owned),
            clock,
            reason,
        },
        Err(_) => Boundary::unknown(
            raw,
            "boundary lies beyond the representable time range",
            Some(source),
        ),
    }
}

/// Parses an unsigned decimal number of `unit_ns`-nanosecond units (`"1.5"` with 10^9 → 1.5 s,
/// `"250"` with 10^6 → 250 ms), as used by Retry-After delay-seconds (RFC 9110 §10.2.3, which
/// allows only integers; fractions are tolerated), `retry-after-ms` and quota reset delays.
///
/// Accepts only ASCII digits with an optional single `.` followed by at least one digit; no sign,
/// no exponent, no prefix, no surrounding whitespace. A fraction finer than one nanosecond is
/// rounded UP to the next nanosecond, however many digits it has (`"1.0000000001"` seconds →
/// 1 s + 1 ns): a wait is never shorter than the provider stated. `unit_ns` must divide
/// 10^18 (a power of ten up to 10^9: seconds, milliseconds, microseconds).
///
/// `Ok(None)` means "not this form"; `Err` means the number does not fit in a [`Duration`].
pub(crate) fn parse_decimal(s: &str, unit_ns: u128) -> Result<Option<Duration>, ()> {
    /// Fraction digits read exactly; any non-zero digit past them only rounds up.
    const EXACT_DIGITS: usize = 18;
    debug_assert!(unit_ns > 0 && 10u128.pow(18).is_multiple_of(unit_ns));
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(None);
    }
    if let Some(f) = frac {
        if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) {
            return Ok(None);
        }
    }
    let mut whole: u128 = 0;
    for b in int.bytes() {
        whole = whole
            .checked_mul(10)
            .and_then(|v| v.checked_add(u128::from(b - b'0')))
            .ok_or(())?;
    }
    let mut ns = whole.checked_mul(unit_ns).ok_or(())?;
    if let Some(f) = frac {
        let (exact, rest) = f.split_at(f.len().min(EXACT_DIGITS));
        let mut num: u128 = 0;
        let mut scale: u128 = 1;
        for b in exact.bytes() {
            num = num * 10 + u128::from(b - b'0');
            scale *= 10;
        }
        let scaled = num * unit_ns;
        // Round the fraction up so the wait is never shorter than stated. Digits past the exact
        // ones make the value strictly larger: that rounds up too when the exact part lands on a
        // whole nanosecond (otherwise the division already rounded up, and since `unit_ns`
        // divides 10^18 the remainder leaves room for them below the next nanosecond).
        let mut part = scaled.div_ceil(scale);
        if scaled.is_multiple_of(scale) && rest.bytes().any(|b| b != b'0') {
            part += 1;
        }
        ns = ns.checked_add(part).ok_or(())?;
    }
    let secs = u64::try_from(ns / 1_000_000_000).map_err(|_| ())?;
    let nanos = u32::try_from(ns % 1_000_000_000).map_err(|_| ())?;
    Ok(Some(Duration::new(secs, nanos)))
}

/// Parses an HTTP-date: IMF-fixdate, obsolete RFC 850 and asctime (via `httpdate`), then the
/// RFC 2822 variants `httpdate` rejects (numeric offsets, `UTC`, one-digit days; via jiff).
pub fn parse_http_date(s: &str) -> Option<Timestamp> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    if let Ok(t) = httpdate::parse_http_date(s) {
        return Timestamp::try_from(t).ok();
    }
    static PARSER: jiff::fmt::rfc2822::DateTimeParser = jiff::fmt::rfc2822::DateTimeParser::new();
    PARSER.parse_timestamp(s).ok()
}

/// One candidate value (no commas except inside a date).
fn normalize_single(
    raw: &str,
    date_header: Option<&str>,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    let s = raw.trim();
    let src = Some(SOURCE_RETRY_AFTER);
    if s.is_empty() {
        return Boundary::unknown(Some(raw), "empty Retry-After value", src);
    }
    if s.starts_with(['+', '-']) {
        return Boundary::unknown(
            Some(raw),
            "signed value: Retry-After must be unsigned delay-seconds or an HTTP-date",
            src,
        );
    }
    if let Some(boundary) = delay_seconds_boundary(s, raw, received_at, opts) {
        return boundary;
    }
    let lower = s.to_ascii_lowercase();
    if lower.starts_with("0x") || lower.starts_with("0o") || lower.starts_with("0b") {
        return Boundary::unknown(
            Some(raw),
            "prefixed number: Retry-After must be decimal delay-seconds",
            src,
        );
    }
    if s.as_bytes()[0].is_ascii_digit() || s.starts_with('.') {
        return duration_boundary(s, raw, received_at, opts);
    }
    let Some(at) = parse_http_date(s) else {
        return Boundary::unknown(
            Some(raw),
            "unparseable: neither delay-seconds, an HTTP-date nor a duration",
            src,
        );
    };
    date_boundary(at, raw, date_header, received_at, opts)
}

/// The boundary `delay` after `received_at` of the Retry-After value `raw`.
fn retry_after_delay(
    delay: Duration,
    raw: &str,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    boundary_after(
        delay,
        received_at,
        opts,
        SOURCE_RETRY_AFTER,
        Some(raw),
        None,
        None,
    )
}

/// The boundary of `s` (trimmed `raw`) read as decimal delay-seconds, `None` when it is not
/// a decimal number. A number too large to count is beyond the ceiling.
fn delay_seconds_boundary(
    s: &str,
    raw: &str,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Option<Boundary> {
    match parse_decimal(s, 1_000_000_000) {
        Ok(Some(d)) => Some(retry_after_delay(d, raw, received_at, opts)),
        Ok(None) => None,
        Err(()) => Some(beyond_ceiling(
            received_at,
            opts,
            SOURCE_RETRY_AFTER,
            Some(raw),
            None,
            "a delay too large to count",
        )),
    }
}

/// The boundary of `s` (trimmed `raw`, starting with a digit or `.`) read as a Go-style
/// duration (`1m30s`), else unknown naming why not.
fn duration_boundary(
    s: &str,
    raw: &str,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    match parse_go_duration(s) {
        Ok(d) => retry_after_delay(d, raw, received_at, opts),
        Err(e) => Boundary::unknown(
            Some(raw),
            format!(
                "neither delay-seconds, an HTTP-date nor a duration: {}",
                e.reason
            ),
            Some(SOURCE_RETRY_AFTER),
        ),
    }
}

/// The boundary of the HTTP-date `at` (read from `raw`), compared with the server's `Date`
/// when it parses, else the local clock. A date not in the future gets `min_delay`.
fn date_boundary(
    at: Timestamp,
    raw: &str,
    date_header: Option<&str>,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    let (clock, reference, note) = date_reference(date_header, received_at);
    let diff = reference.duration_until(at);
    let (delay, reason) = if diff.is_negative() || diff.is_zero() {
        let reason = match note {
            Some(n) => format!("date not in the future; min_delay applied ({n})"),
            None => "date not in the future; min_delay applied".to_owned(),
        };
        (Duration::ZERO, Some(reason))
    } else {
        (diff.unsigned_abs(), note.map(str::to_owned))
    };
    boundary_after(
        delay,
        received_at,
        opts,
        SOURCE_RETRY_AFTER,
        Some(raw),
        Some(clock),
        reason,
    )
}

/// The clock an HTTP-date is compared with, its "now", and a note when a `Date` header was
/// present but unparseable (the local clock is used then).
fn date_reference(
    date_header: Option<&str>,
    received_at: Timestamp,
) -> (ClockSource, Timestamp, Option<&'static str>) {
    let server_now = date_header.and_then(parse_http_date);
    match (server_now, date_header) {
        (Some(d), _) => (ClockSource::ServerDate, d, None),
        (None, Some(_)) => (
            ClockSource::Local,
            received_at,
            Some("Date header unparseable; local clock used"),
        ),
        (None, None) => (ClockSource::Local, received_at, None),
    }
}

const WEEKDAYS: [&str; 14] = [
    "mon",
    "tue",
    "wed",
    "thu",
    "fri",
    "sat",
    "sun",
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];

/// Splits a possibly proxy-joined value (`7, 7`) into candidates, keeping the comma that belongs
/// to an IMF-fixdate or RFC 850 date (`Sun, 06 Nov 1994 …`).
fn split_candidates(raw: &str) -> Vec<String> {
    let parts: Vec<&str> = raw.split(',').collect();
    let mut out = Vec::with_capacity(parts.len());
    let mut i = 0;
    while i < parts.len() {
        let part = parts[i];
        let is_weekday = WEEKDAYS.contains(&part.trim().to_ascii_lowercase().as_str());
        if is_weekday && i + 1 < parts.len() {
            out.push(format!("{},{}", part, parts[i + 1]));
            i += 2;
        } else {
            out.push(part.to_owned());
            i += 1;
        }
    }
    out
}

/// Picks the largest known boundary; if none is known, the first unknown (or `fallback()`, only
/// built when needed: it allocates its reason).
fn largest(
    candidates: impl IntoIterator<Item = Boundary>,
    fallback: impl FnOnce() -> Boundary,
) -> Boundary {
    let mut best: Option<Boundary> = None;
    let mut first_unknown: Option<Boundary> = None;
    for c in candidates {
        match (&c, &best) {
            (Boundary::Known { .. }, None) => best = Some(c),
            (Boundary::Known { .. }, Some(b)) => {
                if c.retry_not_before() > b.retry_not_before() {
                    best = Some(c);
                }
            }
            (Boundary::Unknown { .. }, _) => {
                if first_unknown.is_none() {
                    first_unknown = Some(c);
                }
            }
        }
    }
    best.or(first_unknown).unwrap_or_else(fallback)
}

/// Normalizes one raw `Retry-After` value into a [`Boundary`] (RFC 9110 §10.2.3, SPEC §2.2).
///
/// - `raw`: the header value as received; it may be joined by a proxy (`"7, 7"`, `"10, 20"`), in
///   which case the largest valid candidate wins.
/// - `date_header`: the same response's `Date` header, if any, used to turn an HTTP-date into a
///   skew-immune delay.
/// - `received_at`: local instant the response was received; every delay is added to it.
///
/// Never fails and never panics: unusable input gives [`Boundary::Unknown`] with `raw` kept and a
/// `reason`. `source` is `"Retry-After"`.
pub fn normalize_value(
    raw: &str,
    date_header: Option<&str>,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    // One value, as almost every server sends it: nothing to split.
    if !raw.contains(',') {
        return normalize_single(raw, date_header, received_at, opts);
    }
    let candidates = split_candidates(raw);
    if candidates.len() <= 1 {
        return normalize_single(raw, date_header, received_at, opts);
    }
    let mut results: Vec<Boundary> = candidates
        .iter()
        .map(|c| normalize_single(c, date_header, received_at, opts))
        .collect();
    // Report the whole joined value as raw, which is what was received.
    for r in &mut results {
        match r {
            Boundary::Known { raw: r, .. } | Boundary::Unknown { raw: r, .. } => {
                *r = Some(raw.to_owned())
            }
        }
    }
    largest(results, || {
        Boundary::unknown(
            Some(raw),
            "no valid Retry-After value",
            Some(SOURCE_RETRY_AFTER),
        )
    })
}

/// Normalizes one raw `retry-after-ms` value (milliseconds, decimals allowed; joined values →
/// largest valid).
fn normalize_ms_value(raw: &str, received_at: Timestamp, opts: &RetryAfterOptions) -> Boundary {
    let src = Some(SOURCE_RETRY_AFTER_MS);
    let results: Vec<Boundary> = raw
        .split(',')
        .map(|part| {
            let s = part.trim();
            if s.is_empty() {
                return Boundary::unknown(Some(raw), "empty retry-after-ms value", src);
            }
            match parse_decimal(s, 1_000_000) {
                Ok(Some(d)) => boundary_after(
                    d,
                    received_at,
                    opts,
                    SOURCE_RETRY_AFTER_MS,
                    Some(raw),
                    None,
                    None,
                ),
                Ok(None) => Boundary::unknown(
                    Some(raw),
                    "retry-after-ms must be unsigned decimal milliseconds",
                    src,
                ),
                Err(()) => beyond_ceiling(
                    received_at,
                    opts,
                    SOURCE_RETRY_AFTER_MS,
                    Some(raw),
                    None,
                    "a delay too large to count",
                ),
            }
        })
        .collect();
    largest(results, || {
        Boundary::unknown(Some(raw), "no valid retry-after-ms value", src)
    })
}

/// A header value as text: borrowed when it is valid UTF-8 (every visible-ASCII value is),
/// read lossily otherwise.
fn header_text(v: &http::HeaderValue) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(v.as_bytes())
}

/// Normalizes every `retry-after-ms` and `Retry-After` instance of one response (SPEC §2.2).
///
/// `retry-after-ms` (OpenAI/Azure, milliseconds) wins over `Retry-After` when it yields a valid
/// boundary; among several instances of a header the largest valid one is taken. The `Date`
/// header (first instance) is used for HTTP-dates. Without either header the result is
/// `Unknown { reason: "no Retry-After", raw: None, source: None }`. Header values that are not
/// visible ASCII are read lossily and then judged like any other value. Never panics.
pub fn normalize(
    headers: &http::HeaderMap,
    received_at: Timestamp,
    opts: &RetryAfterOptions,
) -> Boundary {
    let date = headers.get(http::header::DATE).map(header_text);
    let mut ms = headers.get_all(&RETRY_AFTER_MS_HEADER).iter().peekable();
    let ms_present = ms.peek().is_some();
    // The best retry-after-ms candidate when the header was sent and none was usable.
    let ms_best = if ms_present {
        let candidates = ms.map(|v| normalize_ms_value(&header_text(v), received_at, opts));
        match largest(candidates, || {
            Boundary::unknown(None, "no retry-after-ms", None)
        }) {
            known if known.is_known() => return known,
            unusable => Some(unusable),
        }
    } else {
        None
    };
    let mut values = headers.get_all(http::header::RETRY_AFTER).iter().peekable();
    if values.peek().is_none() {
        return ms_best.unwrap_or_else(|| Boundary::unknown(None, "no Retry-After", None));
    }
    let ra = values.map(|v| normalize_value(&header_text(v), date.as_deref(), received_at, opts));
    let best = largest(ra, || Boundary::unknown(None, "no Retry-After", None));
    match best {
        Boundary::Known {
            retry_not_before,
            delay_ms,
            source,
            raw,
            clock,
            reason,
        } if ms_present => Boundary::Known {
            retry_not_before,
            delay_ms,
            source,
            raw,
            clock,
            reason: Some(match reason {
                Some(r) => format!("{r}; retry-after-ms unusable, Retry-After used"),
                None => "retry-after-ms unusable, Retry-After used".to_owned(),
            }),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_dates_keep_their_comma() {
        let parts = split_candidates("Sun, 06 Nov 1994 08:49:37 GMT, 7");
        assert_eq!(parts, vec!["Sun, 06 Nov 1994 08:49:37 GMT", " 7"]);
    }

    #[test]
    fn decimal_fraction_rounds_up() {
        assert_eq!(
            parse_decimal("0.0001", 1_000_000_000),
            Ok(Some(Duration::from_nanos(100_000)))
        );
        assert_eq!(parse_decimal("1e3", 1_000_000_000), Ok(None));
    }

    #[test]
    fn decimal_fraction_finer_than_a_nanosecond_rounds_up_at_any_length() {
        const S: u128 = 1_000_000_000;
        const MS: u128 = 1_000_000;
        let secs = |s: &str| parse_decimal(s, S).expect("fits").expect("decimal");
        // Exactly nine digits: exact.
        assert_eq!(secs("1.000000001"), Duration::new(1, 1));
        assert_eq!(secs("1.5"), Duration::new(1, 500_000_000));
        // Ten and more digits: the sub-nanosecond rest is rounded up, never dropped.
        assert_eq!(secs("1.0000000001"), Duration::new(1, 1));
        assert_eq!(secs("1.0000000009"), Duration::new(1, 1));
        assert_eq!(secs("1.9999999991"), Duration::new(2, 0));
        assert_eq!(secs("1.0000000000"), Duration::new(1, 0));
        // Past the eighteen exactly read digits, a non-zero digit still rounds up.
        assert_eq!(secs("1.0000000000000000001"), Duration::new(1, 1));
        assert_eq!(
            secs("1.000000000000000000000000000000"),
            Duration::new(1, 0)
        );
        assert_eq!(
            secs("0.123456789000000000000000000001"),
            Duration::new(0, 123_456_790)
        );
        // Milliseconds: below a nanosecond is the seventh fraction digit.
        let ms = |s: &str| parse_decimal(s, MS).expect("fits").expect("decimal");
        assert_eq!(ms("1.000001"), Duration::new(0, 1_000_001));
        assert_eq!(ms("1.0000001"), Duration::new(0, 1_000_001));
        assert_eq!(ms("1.0000000000000000000001"), Duration::new(0, 1_000_001));
        assert_eq!(ms("1.0000000000000000000000"), Duration::new(0, 1_000_000));
        // Not the form, and too large.
        for s in ["", ".5", "1.", "1.2.3", "-1", "+1", " 1", "1 "] {
            assert_eq!(parse_decimal(s, S), Ok(None), "{s:?}");
        }
        assert_eq!(
            parse_decimal("340282366920938463463374607431768211456", S),
            Err(())
        );
        assert_eq!(parse_decimal("18446744073709551616", S), Err(()));
    }
}
