//! Reconciliation lookups for uncertain writes (`routes.R.reconcile`, SPEC §6).

use serde::Serialize;

use super::checks::check_pointer;
use super::diagnostics::Ctx;
use super::raw::{RawReconcile, S};
use super::templates::parse_template;

/// How an uncertain write is reconciled (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReconcileBy {
    /// Look up by the idempotency key (`{key}` in the lookup).
    IdempotencyKey,
    /// Look up by a client-generated reference placed in the payload (`{ref}` in the lookup).
    ExternalReference,
    /// Look up by the provider's operation id (`{operation_id}` in the lookup).
    OperationId,
}

/// A reconciliation lookup (`routes.R.reconcile`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reconcile {
    /// What the lookup is keyed by.
    pub by: ReconcileBy,
    /// Method of the lookup (a safe method: GET or HEAD).
    pub lookup_method: String,
    /// Path and query of the lookup with its placeholder, e.g. `/v1/transfers?reference={ref}`.
    pub lookup_path: String,
    /// JSON pointer to the external reference in the write's payload.
    pub external_reference_pointer: Option<String>,
    /// JSON pointer into the lookup response that is present/true when the operation exists.
    pub found_pointer: Option<String>,
    /// JSON pointer to the provider's operation id (in the write response or the lookup).
    /// Never the empty pointer (the whole answer), which is refused at load.
    pub operation_id_pointer: Option<String>,
}

pub(super) fn validate_reconcile(
    raw: &S<RawReconcile>,
    path: &str,
    provider_honours_keys: bool,
    ctx: &mut Ctx,
) -> Option<Reconcile> {
    let r = &raw.value;
    let by = match &r.by {
        Some(b) => match b.value.as_str() {
            "idempotency_key" => ReconcileBy::IdempotencyKey,
            "external_reference" => ReconcileBy::ExternalReference,
            "operation_id" => ReconcileBy::OperationId,
            other => {
                ctx.err(
                    &b.referenced,
                    format!("{path}.by: `{other}` is not one of idempotency_key, external_reference, operation_id"),
                );
                return None;
            }
        },
        None => {
            ctx.err(&raw.referenced, format!("{path}: missing `by`"));
            return None;
        }
    };
    let placeholder = match by {
        ReconcileBy::IdempotencyKey => "{key}",
        ReconcileBy::ExternalReference => "{ref}",
        ReconcileBy::OperationId => "{operation_id}",
    };
    if by == ReconcileBy::IdempotencyKey && !provider_honours_keys {
        if let Some(b) = &r.by {
            ctx.err(
                &b.referenced,
                format!("{path}.by: the provider has no `idempotency_header`, so there is no key to look up"),
            );
        }
    }
    let external_reference_pointer = match &r.external_reference_pointer {
        // The empty pointer is the whole payload: no field to write the reference into, so
        // every write on the route would be refused when it arrives.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.external_reference_pointer: the empty pointer is the whole payload, not a field the reference can be written to; point to a field (start with `/`, e.g. `/reference`)"),
            );
            None
        }
        _ => check_pointer(
            ctx,
            &r.external_reference_pointer,
            &format!("{path}.external_reference_pointer"),
        ),
    };
    if by == ReconcileBy::ExternalReference && r.external_reference_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: external_reference` needs `external_reference_pointer` (where the reference is in the payload)"),
        );
    }
    let operation_id_pointer = match &r.operation_id_pointer {
        // The empty pointer is the whole answer: the document itself, not a field holding the
        // provider's id, would be stored as the operation id.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.operation_id_pointer: the empty pointer is the whole answer, not the field holding the provider's operation id; point to a field (start with `/`, e.g. `/id`)"),
            );
            None
        }
        _ => check_pointer(
            ctx,
            &r.operation_id_pointer,
            &format!("{path}.operation_id_pointer"),
        ),
    };
    if by == ReconcileBy::OperationId && r.operation_id_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: operation_id` needs `operation_id_pointer`"),
        );
    }
    let found_pointer = match &r.found_pointer {
        // The empty pointer is the whole lookup answer: any non-empty answer (a list of other
        // records, an error object) would count as found, a false success.
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}.found_pointer: the empty pointer is the whole lookup answer, so any non-empty answer would count as found; point to the field that is present only when the operation exists (start with `/`, e.g. `/data/0/id`)"),
            );
            None
        }
        _ => check_pointer(ctx, &r.found_pointer, &format!("{path}.found_pointer")),
    };
    let Some(lookup) = &r.lookup else {
        ctx.err(
            &raw.referenced,
            format!("{path}: missing `lookup` (e.g. `GET /v1/transfers?reference={{ref}}`)"),
        );
        return None;
    };
    let text = lookup.value.trim();
    let Some((method, target)) = text.split_once(char::is_whitespace) else {
        ctx.err(
            &lookup.referenced,
            format!("{path}.lookup: a lookup is `GET /path?query={placeholder}`"),
        );
        return None;
    };
    let target = target.trim();
    if !matches!(method, "GET" | "HEAD") {
        ctx.err(
            &lookup.referenced,
            format!("{path}.lookup: a lookup must be a safe read (GET or HEAD), not `{method}`"),
        );
        return None;
    }
    let route_part = target.split('?').next().unwrap_or("");
    if let Err(reason) = parse_template(route_part) {
        ctx.err(&lookup.referenced, format!("{path}.lookup: {reason}"));
        return None;
    }
    if !target.contains(placeholder) {
        ctx.err(
            &lookup.referenced,
            format!(
                "{path}.lookup: `by: {}` needs the placeholder `{placeholder}` in the lookup",
                r.by.as_ref().map(|b| b.value.as_str()).unwrap_or("")
            ),
        );
        return None;
    }
    Some(Reconcile {
        by,
        lookup_method: method.to_owned(),
        lookup_path: target.to_owned(),
        external_reference_pointer,
        found_pointer,
        operation_id_pointer,
    })
}
