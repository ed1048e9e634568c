//! Request classes (`request_classes`): the built-in ones with their SPEC §3 defaults, and the
//! validation of the classes a file configures.

use std::time::Duration;

use serde::Serialize;

use super::diagnostics::Ctx;
use super::raw::RawClass;
use crate::budget::ClassBudget;
use crate::side_effect::SideEffect;

/// The names of the three built-in request classes (SPEC §1).
pub const BUILTIN_CLASSES: [&str; 4] = ["read", "idempotent_write", "uncertain_write", "llm_call"];

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

/// SPEC §1/§6: an uncertain write (no honoured idempotency key) is never resent blindly — the
/// provider may already have applied it — so its class allows one attempt and no retry statuses;
/// what comes next is reconciliation or an escalation.
pub(super) fn check_uncertain_write(
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

/// The `side_effect` of a class: `none` or `write`, else `default` with an error at the value.
pub(super) fn class_side_effect(
    c: &RawClass,
    default: SideEffect,
    path: &str,
    ctx: &mut Ctx,
) -> SideEffect {
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
