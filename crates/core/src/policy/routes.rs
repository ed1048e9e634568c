//! Configured routes (`providers.P.routes`) and the SPEC §3 default class of a request.

use serde::Serialize;

use super::providers::Provider;
use super::reconcile::Reconcile;
use super::templates::Segment;

/// A configured route (`routes."METHOD /path/{param}"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    /// Upper-case method.
    pub method: String,
    /// The path template as written, e.g. `/v1/transfers/{id}`.
    pub template: String,
    /// The parsed template.
    pub segments: Vec<Segment>,
    /// Request class name.
    pub class: String,
    /// Full scope names.
    pub scopes: Vec<String>,
    /// Whether identical in-flight safe reads share one upstream call.
    pub coalesce: bool,
    /// JSON pointers of the stable payload fields for the fingerprint.
    pub fingerprint_fields: Vec<String>,
    /// Reconciliation lookup for uncertain writes.
    pub reconcile: Option<Reconcile>,
}

/// The SPEC §3 default class for `method` (upper case) at provider `p`.
pub(super) fn default_class(p: &Provider, method: &str) -> &'static str {
    match method {
        "GET" | "HEAD" | "OPTIONS" => "read",
        "PUT" | "DELETE" if p.idempotent_put_delete => "idempotent_write",
        "PUT" | "DELETE" => "uncertain_write",
        _ if p.idempotency_header.is_some() => "idempotent_write",
        _ => "uncertain_write",
    }
}
