//! What validation reports: positioned errors and warnings ([`PolicyError`]), and the context
//! that collects them while the sections of a raw document are read ([`Ctx`]), with the number
//! readers every section shares.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_saphyr::Location;

use super::raw::{Num, Trap, S};

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

/// The largest number of seconds a policy duration may hold (about 136 years).
const MAX_POLICY_SECONDS: f64 = u32::MAX as f64;

pub(super) struct Ctx {
    pub(super) file: String,
    pub(super) errors: Vec<PolicyError>,
    pub(super) warnings: Vec<PolicyError>,
}

impl Ctx {
    /// A legal but probably unintended setting: reported, the policy still loads.
    pub(super) fn warn(&mut self, line: u64, column: u64, message: impl Into<String>) {
        self.warnings.push(PolicyError {
            file: self.file.clone(),
            line,
            column,
            message: message.into(),
        });
    }

    pub(super) fn err(&mut self, at: &Location, message: impl Into<String>) {
        self.errors.push(PolicyError {
            file: self.file.clone(),
            line: at.line(),
            column: at.column(),
            message: message.into(),
        });
    }

    /// A whole number in `min..=max`, or `None` after reporting why not.
    pub(super) fn integer(&mut self, s: &S<Num>, path: &str, min: u64, max: u64) -> Option<u64> {
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
    pub(super) fn positive_u32(&mut self, v: &Option<S<Num>>, path: &str) -> Option<u32> {
        let s = v.as_ref()?;
        self.integer(s, path, 1, u64::from(u32::MAX))
            .and_then(|n| u32::try_from(n).ok())
    }

    /// A positive `u32` (≥ 1), or the default.
    pub(super) fn at_least_one(&mut self, v: &Option<S<Num>>, path: &str, default: u32) -> u32 {
        self.positive_u32(v, path).unwrap_or(default)
    }

    /// A finite number, or `None` after reporting why not.
    pub(super) fn number(&mut self, s: &S<Num>, path: &str) -> Option<f64> {
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
    pub(super) fn seconds(
        &mut self,
        v: &Option<S<Num>>,
        path: &str,
        default: Duration,
    ) -> Duration {
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
    pub(super) fn fraction(
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

    pub(super) fn trap(&mut self, v: &Trap, path: &str, use_instead: &str) {
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
