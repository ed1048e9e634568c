//! # Go-style duration strings
//!
//! Several providers write durations the way Go's `time.Duration.String()` prints them: OpenAI's
//! `x-ratelimit-reset-requests: 6m0s`, Google's `RetryInfo.retryDelay: "45.837906927s"`, and some
//! servers even put `1m0s` into `Retry-After`. This module reads that grammar (a sequence of
//! decimal numbers, each with a unit: `ns`, `us`, `µs`, `ms`, `s`, `m`, `h`; the bare `0` is also
//! accepted) into a [`std::time::Duration`].
//!
//! Unlike Go, signs are rejected (a negative wait means nothing to a scheduler, and a `+` is a
//! sign of a value that was not meant as a duration), and so is anything with a prefix such as
//! `0x`. Values beyond `u64::MAX` nanoseconds (about 584 years) are an overflow error, never a
//! wrap-around or a panic.
//!
//! ```
//! use backstop_core::duration::parse_go_duration;
//! use std::time::Duration;
//!
//! assert_eq!(parse_go_duration("1m30.5s").unwrap(), Duration::from_millis(90_500));
//! assert_eq!(parse_go_duration("20ms").unwrap(), Duration::from_millis(20));
//! assert!(parse_go_duration("-1s").is_err());
//! ```

use std::time::Duration;

/// A string that is not a valid Go-style duration; `reason` says where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration: {reason}")]
pub struct InvalidDuration {
    /// Human-readable reason, naming the offending input or part of it.
    pub reason: String,
}

impl InvalidDuration {
    fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

/// Fraction digits beyond this many are ignored (they are below a nanosecond for every unit);
/// the bound keeps the arithmetic within `u128`.
const MAX_FRACTION_DIGITS: u32 = 18;

/// Parses a Go-style duration (`1s`, `6m0s`, `1m30.5s`, `20ms`, `1h2m3.5s`, `45.837906927s`).
///
/// Grammar: `0`, or one or more `<number><unit>` pairs where `<number>` is decimal digits with an
/// optional `.` fraction (`1.`, `.5` are accepted as in Go) and `<unit>` is one of `ns`, `us`,
/// `µs` (U+00B5), `μs` (U+03BC), `ms`, `s`, `m`, `h`. Surrounding ASCII whitespace is ignored.
/// Fractions finer than a nanosecond are truncated.
///
/// # Errors
/// [`InvalidDuration`] for an empty string, a sign (`+`/`-`), a missing or unknown unit, a
/// number without digits, any other character (so `0x10` is rejected), or a total above
/// `u64::MAX` nanoseconds.
pub fn parse_go_duration(input: &str) -> Result<Duration, InvalidDuration> {
    let s = input.trim_matches(|c: char| c.is_ascii_whitespace());
    if s.is_empty() {
        return Err(InvalidDuration::new("empty duration"));
    }
    if s.starts_with(['+', '-']) {
        return Err(InvalidDuration::new(format!(
            "{s:?}: signs are not allowed in a duration"
        )));
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total_ns: u128 = 0;
    while i < bytes.len() {
        // Integer part.
        let int_start = i;
        let mut int_part: u128 = 0;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            int_part = int_part
                .checked_mul(10)
                .and_then(|v| v.checked_add(u128::from(bytes[i] - b'0')))
                .ok_or_else(|| InvalidDuration::new(format!("{s:?}: number too large")))?;
            i += 1;
        }
        let int_digits = i - int_start;
        // Fraction part.
        let mut frac: u128 = 0;
        let mut frac_scale: u128 = 1;
        let mut frac_digits = 0usize;
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let mut kept = 0u32;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                if kept < MAX_FRACTION_DIGITS {
                    frac = frac * 10 + u128::from(bytes[i] - b'0');
                    frac_scale *= 10;
                    kept += 1;
                }
                frac_digits += 1;
                i += 1;
            }
        }
        if int_digits == 0 && frac_digits == 0 {
            return Err(InvalidDuration::new(format!(
                "{s:?}: expected a number at byte {int_start}"
            )));
        }
        // Unit.
        let unit_start = i;
        while i < bytes.len() && !bytes[i].is_ascii_digit() && bytes[i] != b'.' {
            i += 1;
        }
        // `unit_start..i` lies on char boundaries: digits and '.' are ASCII.
        let unit = &s[unit_start..i];
        let unit_ns: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            "" => {
                return Err(InvalidDuration::new(format!(
                    "{s:?}: missing unit after the number at byte {int_start}"
                )))
            }
            other => {
                return Err(InvalidDuration::new(format!(
                    "{s:?}: unknown unit {other:?} (expected ns, us, µs, ms, s, m or h)"
                )))
            }
        };
        let whole = int_part
            .checked_mul(unit_ns)
            .ok_or_else(|| InvalidDuration::new(format!("{s:?}: duration overflows")))?;
        let part = frac * unit_ns / frac_scale;
        total_ns = total_ns
            .checked_add(whole)
            .and_then(|t| t.checked_add(part))
            .ok_or_else(|| InvalidDuration::new(format!("{s:?}: duration overflows")))?;
        if total_ns > u128::from(u64::MAX) {
            return Err(InvalidDuration::new(format!(
                "{s:?}: duration overflows (more than u64::MAX nanoseconds)"
            )));
        }
    }
    let total_ns = u64::try_from(total_ns)
        .map_err(|_| InvalidDuration::new(format!("{s:?}: duration overflows")))?;
    Ok(Duration::from_nanos(total_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        let cases = [
            ("1s", Duration::from_secs(1)),
            ("6m0s", Duration::from_secs(360)),
            ("1m30.5s", Duration::from_millis(90_500)),
            ("20ms", Duration::from_millis(20)),
            ("1h2m3.5s", Duration::from_millis(3_723_500)),
            ("45.837906927s", Duration::new(45, 837_906_927)),
            ("7ns", Duration::from_nanos(7)),
            ("3us", Duration::from_micros(3)),
            ("3µs", Duration::from_micros(3)),
            ("3μs", Duration::from_micros(3)),
            ("0", Duration::ZERO),
            (" 2s ", Duration::from_secs(2)),
            (".5s", Duration::from_millis(500)),
            ("1.s", Duration::from_secs(1)),
        ];
        for (input, want) in cases {
            assert_eq!(parse_go_duration(input), Ok(want), "input {input:?}");
        }
    }

    #[test]
    fn bad_durations_are_rejected_with_a_reason() {
        for input in [
            "",
            "  ",
            "-1s",
            "+3s",
            "0x10",
            "10",
            "1",
            "s",
            "1d",
            "1.5",
            ".s",
            "1s2",
            "1 s",
            "9999999999999h",
            "99999999999999999999999999999999999999999999s",
        ] {
            let err = parse_go_duration(input).expect_err(input);
            assert!(!err.reason.is_empty(), "input {input:?}");
        }
    }
}
