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

impl ReconcileBy {
    /// The placeholder a lookup keyed this way holds: `{key}`, `{ref}` or `{operation_id}`.
    fn placeholder(self) -> &'static str {
        match self {
            ReconcileBy::IdempotencyKey => "{key}",
            ReconcileBy::ExternalReference => "{ref}",
            ReconcileBy::OperationId => "{operation_id}",
        }
    }
}

/// The reconciliation lookup at `path` (`providers.P.routes."R".reconcile`) of a route whose
/// provider honours idempotency keys or not. `None` after reporting a missing or unknown `by` or
/// an unusable `lookup`; every pointer is checked either way.
pub(super) fn validate_reconcile(
    raw: &S<RawReconcile>,
    path: &str,
    provider_honours_keys: bool,
    ctx: &mut Ctx,
) -> Option<Reconcile> {
    let r = &raw.value;
    let by = reconcile_by(raw, path, ctx)?;
    if by == ReconcileBy::IdempotencyKey && !provider_honours_keys {
        if let Some(b) = &r.by {
            ctx.err(
                &b.referenced,
                format!("{path}.by: the provider has no `idempotency_header`, so there is no key to look up"),
            );
        }
    }
    // The empty pointer is the whole payload: no field to write the reference into, so every
    // write on the route would be refused when it arrives.
    let external_reference_pointer = field_pointer(
        &r.external_reference_pointer,
        &format!("{path}.external_reference_pointer"),
        "the whole payload, not a field the reference can be written to; point to a field (start with `/`, e.g. `/reference`)",
        ctx,
    );
    if by == ReconcileBy::ExternalReference && r.external_reference_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: external_reference` needs `external_reference_pointer` (where the reference is in the payload)"),
        );
    }
    // The empty pointer is the whole answer: the document itself, not a field holding the
    // provider's id, would be stored as the operation id.
    let operation_id_pointer = field_pointer(
        &r.operation_id_pointer,
        &format!("{path}.operation_id_pointer"),
        "the whole answer, not the field holding the provider's operation id; point to a field (start with `/`, e.g. `/id`)",
        ctx,
    );
    if by == ReconcileBy::OperationId && r.operation_id_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `by: operation_id` needs `operation_id_pointer`"),
        );
    }
    // The empty pointer is the whole lookup answer: any non-empty answer (a list of other
    // records, an error object) would count as found, a false success.
    let found_pointer = field_pointer(
        &r.found_pointer,
        &format!("{path}.found_pointer"),
        "the whole lookup answer, so any non-empty answer would count as found; point to the field that is present only when the operation exists (start with `/`, e.g. `/data/0/id`)",
        ctx,
    );
    let (lookup_method, lookup_path) = validate_lookup(raw, by, path, ctx)?;
    Some(Reconcile {
        by,
        lookup_method,
        lookup_path,
        external_reference_pointer,
        found_pointer,
        operation_id_pointer,
    })
}

/// `by`: what the lookup is keyed by, or `None` after reporting it missing or unknown.
fn reconcile_by(raw: &S<RawReconcile>, path: &str, ctx: &mut Ctx) -> Option<ReconcileBy> {
    let Some(b) = &raw.value.by else {
        ctx.err(&raw.referenced, format!("{path}: missing `by`"));
        return None;
    };
    match b.value.as_str() {
        "idempotency_key" => Some(ReconcileBy::IdempotencyKey),
        "external_reference" => Some(ReconcileBy::ExternalReference),
        "operation_id" => Some(ReconcileBy::OperationId),
        other => {
            ctx.err(
                &b.referenced,
                format!("{path}.by: `{other}` is not one of idempotency_key, external_reference, operation_id"),
            );
            None
        }
    }
}

/// The JSON pointer `v` to one field, checked at `path`; the empty pointer, which points to
/// the whole document, is refused saying that it is `whole` (the rest of the message).
fn field_pointer(v: &Option<S<String>>, path: &str, whole: &str, ctx: &mut Ctx) -> Option<String> {
    match v {
        Some(s) if s.value.is_empty() => {
            ctx.err(
                &s.referenced,
                format!("{path}: the empty pointer is {whole}"),
            );
            None
        }
        _ => check_pointer(ctx, v, path),
    }
}

/// `lookup`: `GET` or `HEAD`, one space, then a path template with an optional query that
/// holds the placeholder of `by`. Its method and target, or `None` after reporting why not.
fn validate_lookup(
    raw: &S<RawReconcile>,
    by: ReconcileBy,
    path: &str,
    ctx: &mut Ctx,
) -> Option<(String, String)> {
    let r = &raw.value;
    let placeholder = by.placeholder();
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
    let problem = if !matches!(method, "GET" | "HEAD") {
        Some(format!(
            "a lookup must be a safe read (GET or HEAD), not `{method}`"
        ))
    } else if let Err(reason) = parse_template(target.split('?').next().unwrap_or("")) {
        Some(reason)
    } else if !target.contains(placeholder) {
        Some(format!(
            "`by: {}` needs the placeholder `{placeholder}` in the lookup",
            r.by.as_ref().map(|b| b.value.as_str()).unwrap_or("")
        ))
    } else {
        None
    };
    if let Some(problem) = problem {
        ctx.err(&lookup.referenced, format!("{path}.lookup: {problem}"));
        return None;
    }
    Some((method.to_owned(), target.to_owned()))
}
