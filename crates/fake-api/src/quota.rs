//! Quota counters and the headers that describe them.
//!
//! Each named quota keeps one counter per scope value (the account, or one credential). A
//! request is admitted only if every quota of its route admits it; then it is charged to all of
//! them. A refusal carries the honest remaining time, which becomes `Retry-After` rounded *up*
//! (an answer that invites an early retry would be a lie the fake must not tell).

use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue};
use jiff::Timestamp;

use crate::config::{Dialect, QuotaConfig, RetryAfterForm};

/// The counter of one quota for one scope value.
#[derive(Debug, Clone)]
pub(crate) enum QuotaState {
    /// Fixed window that started at `start` and has admitted `used` requests.
    Window { start: Instant, used: u64 },
    /// Token bucket holding `tokens` at instant `at`.
    Bucket { tokens: f64, at: Instant },
}

/// What a quota looks like at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct QuotaSnapshot {
    /// Requests per window (fixed window) or bucket capacity.
    pub(crate) limit: u64,
    /// Requests still admitted now.
    pub(crate) remaining: u64,
    /// Time until the quota is whole again (window end, or bucket full).
    pub(crate) reset_after: Duration,
    /// Window length (for a bucket: time to refill from empty).
    pub(crate) window: Duration,
}

impl QuotaState {
    /// A fresh counter at `now`.
    pub(crate) fn new(config: &QuotaConfig, now: Instant) -> Self {
        match (&config.fixed_window, &config.token_bucket) {
            (_, Some(bucket)) => QuotaState::Bucket {
                tokens: f64::from(bucket.burst),
                at: now,
            },
            _ => QuotaState::Window {
                start: now,
                used: 0,
            },
        }
    }

    /// Brings the counter up to `now` (a new window, or refilled tokens).
    fn advance(&mut self, config: &QuotaConfig, now: Instant) {
        match self {
            QuotaState::Window { start, used } => {
                let window_ms = config.fixed_window.map_or(1, |w| w.window_ms);
                if now.saturating_duration_since(*start) >= Duration::from_millis(window_ms) {
                    *start = now;
                    *used = 0;
                }
            }
            QuotaState::Bucket { tokens, at } => {
                if let Some(bucket) = config.token_bucket {
                    let elapsed = now.saturating_duration_since(*at).as_secs_f64();
                    *tokens =
                        (*tokens + elapsed * bucket.rate_per_second).min(f64::from(bucket.burst));
                    *at = now;
                }
            }
        }
    }

    /// `None` when a request is admitted now, else how long until one would be.
    pub(crate) fn check(&mut self, config: &QuotaConfig, now: Instant) -> Option<Duration> {
        self.advance(config, now);
        match self {
            QuotaState::Window { start, used } => {
                let window = config.fixed_window?;
                if *used < u64::from(window.limit) {
                    None
                } else {
                    let end = *start + Duration::from_millis(window.window_ms);
                    Some(end.saturating_duration_since(now))
                }
            }
            QuotaState::Bucket { tokens, .. } => {
                let bucket = config.token_bucket?;
                if *tokens >= 1.0 {
                    None
                } else {
                    Some(Duration::from_secs_f64(
                        (1.0 - *tokens) / bucket.rate_per_second,
                    ))
                }
            }
        }
    }

    /// Charges one request (call after `check` admitted it).
    pub(crate) fn charge(&mut self) {
        match self {
            QuotaState::Window { used, .. } => *used += 1,
            QuotaState::Bucket { tokens, .. } => *tokens = (*tokens - 1.0).max(0.0),
        }
    }

    /// The quota as of `now`.
    pub(crate) fn snapshot(&mut self, config: &QuotaConfig, now: Instant) -> QuotaSnapshot {
        self.advance(config, now);
        match (self, &config.fixed_window, &config.token_bucket) {
            (QuotaState::Window { start, used }, Some(w), _) => {
                let window = Duration::from_millis(w.window_ms);
                QuotaSnapshot {
                    limit: u64::from(w.limit),
                    remaining: u64::from(w.limit).saturating_sub(*used),
                    reset_after: (*start + window).saturating_duration_since(now),
                    window,
                }
            }
            (QuotaState::Bucket { tokens, .. }, _, Some(b)) => {
                let burst = f64::from(b.burst);
                QuotaSnapshot {
                    limit: u64::from(b.burst),
                    remaining: tokens.floor() as u64,
                    reset_after: Duration::from_secs_f64((burst - *tokens) / b.rate_per_second),
                    window: Duration::from_secs_f64(burst / b.rate_per_second),
                }
            }
            _ => QuotaSnapshot {
                limit: 0,
                remaining: 0,
                reset_after: Duration::ZERO,
                window: Duration::ZERO,
            },
        }
    }
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `t` rounded up to the next whole second (unchanged when already whole).
pub(crate) fn ceil_to_second(t: Timestamp) -> Timestamp {
    let second = t.as_second() + i64::from(t.subsec_nanosecond() > 0);
    Timestamp::from_second(second).unwrap_or(t)
}

/// `t` rounded down to a whole second.
pub(crate) fn floor_to_second(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// IMF-fixdate (RFC 9110 §5.6.7) of a timestamp.
pub(crate) fn http_date(t: Timestamp) -> String {
    t.strftime("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

/// `wall + d`, saturating at the end of jiff's range.
pub(crate) fn add(wall: Timestamp, d: Duration) -> Timestamp {
    wall.checked_add(d).unwrap_or(Timestamp::MAX)
}

/// Go's `time.Duration.String()` for a whole number of milliseconds: `0s`, `20ms`, `1.5s`,
/// `6m0s`, `1h2m3.5s` (the format OpenAI uses in `x-ratelimit-reset-*`).
pub(crate) fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = (ms / 60_000) % 60;
    let seconds = (ms / 1000) % 60;
    let frac = ms % 1000;
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h{minutes}m"));
    } else if minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    out.push_str(&seconds.to_string());
    if frac > 0 {
        let digits = format!("{frac:03}");
        out.push('.');
        out.push_str(digits.trim_end_matches('0'));
    }
    out.push('s');
    out
}

fn put(headers: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

/// Writes the quota headers of `dialect` describing `snap`, observed at wall time `wall`.
pub(crate) fn write_headers(
    headers: &mut HeaderMap,
    config: &QuotaConfig,
    snap: &QuotaSnapshot,
    wall: Timestamp,
) {
    let reset_at = ceil_to_second(add(wall, snap.reset_after));
    match config.dialect {
        Dialect::Ietf => {
            put(
                headers,
                "ratelimit",
                format!(
                    "\"{}\";r={};t={}",
                    config.name,
                    snap.remaining,
                    ceil_seconds(snap.reset_after)
                ),
            );
            put(
                headers,
                "ratelimit-policy",
                format!(
                    "\"{}\";q={};w={}",
                    config.name,
                    snap.limit,
                    ceil_seconds(snap.window).max(1)
                ),
            );
        }
        Dialect::Openai => {
            put(
                headers,
                "x-ratelimit-limit-requests",
                snap.limit.to_string(),
            );
            put(
                headers,
                "x-ratelimit-remaining-requests",
                snap.remaining.to_string(),
            );
            // Rounded up to the millisecond so the advertised reset is never early.
            let ms = snap.reset_after.as_nanos().div_ceil(1_000_000);
            let rounded = Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX));
            put(headers, "x-ratelimit-reset-requests", go_duration(rounded));
        }
        Dialect::Anthropic => {
            put(
                headers,
                "anthropic-ratelimit-requests-limit",
                snap.limit.to_string(),
            );
            put(
                headers,
                "anthropic-ratelimit-requests-remaining",
                snap.remaining.to_string(),
            );
            put(
                headers,
                "anthropic-ratelimit-requests-reset",
                reset_at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            );
        }
        Dialect::Github => {
            put(headers, "x-ratelimit-limit", snap.limit.to_string());
            put(headers, "x-ratelimit-remaining", snap.remaining.to_string());
            put(
                headers,
                "x-ratelimit-used",
                snap.limit.saturating_sub(snap.remaining).to_string(),
            );
            put(
                headers,
                "x-ratelimit-reset",
                reset_at.as_second().to_string(),
            );
            put(
                headers,
                "x-ratelimit-resource",
                config
                    .resource
                    .clone()
                    .unwrap_or_else(|| config.name.clone()),
            );
        }
        Dialect::None => {}
    }
}

/// Writes `Retry-After` (and, for the date form, relies on the response's `Date` being
/// `floor(wall)`) for a refusal that lifts after `wait`.
pub(crate) fn write_retry_after(
    headers: &mut HeaderMap,
    form: RetryAfterForm,
    wait: Duration,
    wall: Timestamp,
) {
    match form {
        RetryAfterForm::Seconds => {
            put(
                headers,
                "retry-after",
                ceil_seconds(wait).max(1).to_string(),
            );
        }
        RetryAfterForm::HttpDate => {
            let at = ceil_to_second(add(wall, wait));
            // Never equal to Date: a zero delay would invite an immediate retry.
            let at = if at <= floor_to_second(wall) {
                add(floor_to_second(wall), Duration::from_secs(1))
            } else {
                at
            };
            put(headers, "retry-after", http_date(at));
        }
        RetryAfterForm::None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QuotaConfig;

    #[test]
    fn go_durations_match_go_formatting() {
        let cases = [
            (0, "0s"),
            (20, "20ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (1250, "1.25s"),
            (360_000, "6m0s"),
            (90_500, "1m30.5s"),
            (3_723_500, "1h2m3.5s"),
            (3_600_000, "1h0m0s"),
        ];
        for (ms, text) in cases {
            assert_eq!(go_duration(Duration::from_millis(ms)), text, "{ms} ms");
        }
    }

    #[test]
    fn fixed_window_refuses_with_the_remaining_window_time() {
        let config = QuotaConfig::fixed_window("w", 2, 10_000);
        let t0 = crate::clock::now().mono;
        let mut state = QuotaState::new(&config, t0);
        for _ in 0..2 {
            assert_eq!(state.check(&config, t0), None);
            state.charge();
        }
        let wait = state.check(&config, t0 + Duration::from_millis(2500));
        assert_eq!(wait, Some(Duration::from_millis(7500)));
        assert_eq!(
            state.check(&config, t0 + Duration::from_millis(10_000)),
            None
        );
    }

    #[test]
    fn token_bucket_refills_at_its_rate() {
        let config = QuotaConfig::token_bucket("b", 2.0, 1);
        let t0 = crate::clock::now().mono;
        let mut state = QuotaState::new(&config, t0);
        assert_eq!(state.check(&config, t0), None);
        state.charge();
        assert_eq!(state.check(&config, t0), Some(Duration::from_millis(500)));
        let t1 = t0 + Duration::from_millis(250);
        let wait = state.check(&config, t1).expect("still empty");
        assert!((wait.as_secs_f64() - 0.25).abs() < 1e-9, "{wait:?}");
        assert_eq!(state.check(&config, t0 + Duration::from_millis(500)), None);
    }

    #[test]
    fn retry_after_seconds_never_rounds_down() {
        let mut headers = HeaderMap::new();
        write_retry_after(
            &mut headers,
            RetryAfterForm::Seconds,
            Duration::from_millis(1001),
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(headers["retry-after"], "2");
    }
}
