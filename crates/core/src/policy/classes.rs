//! Request classes (`request_classes`): the built-in ones with their SPEC §3 defaults, and the
//! validation of the classes a file configures.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use super::checks::is_name;
use super::diagnostics::Ctx;
use super::raw::{Num, RawClass, SpannedMap, S};
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
/// [`crate::side_effect`]). A policy file may override these fields per class; [`Policy`](crate::policy::Policy) holds the resulting classes.
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
fn check_uncertain_write(
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
fn class_side_effect(c: &RawClass, default: SideEffect, path: &str, ctx: &mut Ctx) -> SideEffect {
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

/// The request classes: the built-in ones ([`BUILTIN_CLASSES`]), then those of the file
/// (`request_classes`), each overriding a built-in class of its name field by field.
pub(super) fn validate_classes(
    raw: Option<SpannedMap<S<RawClass>>>,
    ctx: &mut Ctx,
) -> BTreeMap<String, RequestClass> {
    let mut request_classes: BTreeMap<String, RequestClass> = BUILTIN_CLASSES
        .iter()
        .filter_map(|n| builtin_class(n).map(|c| (n.to_string(), c)))
        .collect();
    for (key, class) in raw.map(|m| m.0).unwrap_or_default() {
        let class = validate_class(&key, &class, ctx);
        request_classes.insert(class.name.clone(), class);
    }
    request_classes
}

/// The class configured at `key`: its built-in defaults (or, for a configured class, one
/// attempt and no wait) overridden by the fields the file sets.
fn validate_class(key: &S<String>, class: &S<RawClass>, ctx: &mut Ctx) -> RequestClass {
    let name = key.value.clone();
    let path = format!("request_classes.{name}");
    if !is_name(&name) {
        ctx.err(
            &key.referenced,
            format!("{path}: a class name uses letters, digits, `_`, `-`, `.` or `:`"),
        );
    }
    let builtin = builtin_class(&name);
    let c = &class.value;
    if builtin.is_none() {
        check_required_fields(class, &path, ctx);
    }
    let defaults = builtin.unwrap_or(RequestClass {
        name: name.clone(),
        max_attempts: 1,
        max_wait: Duration::ZERO,
        retry_statuses: Vec::new(),
        side_effect: SideEffect::Write,
    });
    let max_attempts = ctx.at_least_one(
        &c.max_attempts,
        &format!("{path}.max_attempts"),
        defaults.max_attempts,
    );
    let max_wait = ctx.seconds(
        &c.max_wait_seconds,
        &format!("{path}.max_wait_seconds"),
        defaults.max_wait,
    );
    let retry_statuses = match &c.retry_statuses {
        Some(list) => validate_retry_statuses(list, &path, ctx),
        None => defaults.retry_statuses,
    };
    if name == "uncertain_write" {
        check_uncertain_write(c, max_attempts, &retry_statuses, &path, ctx);
    }
    let side_effect = class_side_effect(c, defaults.side_effect, &path, ctx);
    RequestClass {
        name,
        max_attempts,
        max_wait,
        retry_statuses,
        side_effect,
    }
}

/// A configured class (not built in) states its `max_attempts` and `max_wait_seconds`.
fn check_required_fields(class: &S<RawClass>, path: &str, ctx: &mut Ctx) {
    let c = &class.value;
    for (missing, field) in [
        (c.max_attempts.is_none(), "max_attempts"),
        (c.max_wait_seconds.is_none(), "max_wait_seconds"),
    ] {
        if missing {
            ctx.err(
                &class.referenced,
                format!("{path}: missing `{field}` (required for a configured class)"),
            );
        }
    }
}

/// `retry_statuses` of the class at `path`: HTTP statuses (100–599) that are not successes,
/// each listed once; sorted. Every other entry is reported and left out.
fn validate_retry_statuses(list: &S<Vec<S<Num>>>, path: &str, ctx: &mut Ctx) -> Vec<u16> {
    let mut statuses = BTreeSet::new();
    for status in &list.value {
        let Some(code) = ctx.integer(status, &format!("{path}.retry_statuses"), 0, u64::MAX) else {
            continue;
        };
        if !(100..=599).contains(&code) {
            ctx.err(
                &status.referenced,
                format!("{path}.retry_statuses: {code} is not an HTTP status (100–599)"),
            );
        } else if (200..=299).contains(&code) {
            ctx.err(
                &status.referenced,
                format!("{path}.retry_statuses: {code} is a success; it cannot be retried"),
            );
        } else if let Ok(code) = u16::try_from(code) {
            if !statuses.insert(code) {
                ctx.err(
                    &status.referenced,
                    format!("{path}.retry_statuses: {code} is listed twice"),
                );
            }
        }
    }
    statuses.into_iter().collect()
}
