//! Configured routes (`providers.P.routes`) and the SPEC §3 default class of a request.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use serde::Serialize;

use super::checks::check_pointers;
use super::classes::RequestClass;
use super::diagnostics::Ctx;
use super::raw::{RawRoute, SpannedMap, S};
use super::reconcile::{validate_reconcile, Reconcile};
use super::scopes::{scope_refs, Scope};
use super::templates::{parse_route_key, Segment};

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

/// The SPEC §3 default class for `method` (upper case) at a provider whose PUT/DELETE are
/// idempotent by contract (`idempotent_put_delete`) and that honours idempotency keys or not
/// (`honours_keys`: it has an `idempotency_header`).
pub(super) fn default_class(
    method: &str,
    idempotent_put_delete: bool,
    honours_keys: bool,
) -> &'static str {
    match method {
        "GET" | "HEAD" | "OPTIONS" => "read",
        "PUT" | "DELETE" if idempotent_put_delete => "idempotent_write",
        "PUT" | "DELETE" => "uncertain_write",
        _ if honours_keys => "idempotent_write",
        _ => "uncertain_write",
    }
}

/// What validating the routes of one provider needs to know about it.
pub(super) struct RouteContext<'a> {
    /// The provider's name.
    pub(super) provider: &'a str,
    /// The provider's key path, `providers.NAME`.
    pub(super) path: &'a str,
    /// The request classes a route may name.
    pub(super) classes: &'a BTreeMap<String, RequestClass>,
    /// The provider's scopes by short name.
    pub(super) scopes: &'a BTreeMap<String, Scope>,
    /// The full scope names of a route that names none.
    pub(super) default_scopes: &'a [String],
    /// The validated `idempotency_header`, if any.
    pub(super) idempotency_header: Option<&'a str>,
    /// Whether the file sets an `idempotency_header`, valid or not.
    pub(super) declares_idempotency_header: bool,
    /// `idempotent_put_delete`.
    pub(super) idempotent_put_delete: bool,
}

/// The routes of one provider (`providers.P.routes`), in file order. A route whose key cannot
/// be parsed or whose class is unknown is reported and left out; the other members of such a
/// route are still checked, so that one run names every problem.
pub(super) fn validate_routes(
    raw: Option<SpannedMap<S<RawRoute>>>,
    rc: &RouteContext<'_>,
    ctx: &mut Ctx,
) -> Vec<Route> {
    let mut routes = Vec::new();
    let mut shapes = RouteShapes::default();
    for (key, route) in raw.map(|m| m.0).unwrap_or_default() {
        let path = format!("{}.routes.\"{}\"", rc.path, key.value);
        let Some((method, template, segments)) = parse_route_key(&key, &path, ctx) else {
            continue;
        };
        shapes.claim(&key, &method, &template, &segments, &path, ctx);
        let parsed = ParsedKey {
            method,
            template,
            segments,
        };
        if let Some(route) = validate_route(&route.value, parsed, &path, rc, ctx) {
            routes.push(route);
        }
    }
    routes
}

/// A route key as [`parse_route_key`] reads it.
struct ParsedKey {
    method: String,
    template: String,
    segments: Vec<Segment>,
}

/// The shape of a route: its method, and its segments with the parameters' names left out.
type Shape = (String, Vec<Option<String>>);

/// The routes of one provider read so far, by shape, each with its key (`METHOD /template`),
/// segments and position: two routes of one shape match exactly the same requests.
#[derive(Default)]
struct RouteShapes(BTreeMap<Shape, (String, Vec<Segment>, u64, u64)>);

impl RouteShapes {
    /// Records the route at `key`, or reports it naming the earlier route of the same shape.
    fn claim(
        &mut self,
        key: &S<String>,
        method: &str,
        template: &str,
        segments: &[Segment],
        path: &str,
        ctx: &mut Ctx,
    ) {
        let shape = segments
            .iter()
            .map(|segment| match segment {
                Segment::Literal(text) => Some(text.clone()),
                Segment::Param(_) => None,
            })
            .collect();
        match self.0.entry((method.to_owned(), shape)) {
            Entry::Occupied(first) => {
                let (first_key, first_segments, line, column) = first.get();
                let message = if first_segments == segments {
                    format!(
                        "{path}: the same method and template are already routed by route \"{first_key}\" ({}:{line}:{column})",
                        ctx.file
                    )
                } else {
                    format!(
                        "{path}: matches exactly the same requests as route \"{first_key}\" ({}:{line}:{column}), only the parameter names differ, so which of them applies would be ambiguous; keep one",
                        ctx.file
                    )
                };
                ctx.err(&key.referenced, message);
            }
            Entry::Vacant(slot) => {
                slot.insert((
                    format!("{method} {template}"),
                    segments.to_vec(),
                    key.referenced.line(),
                    key.referenced.column(),
                ));
            }
        }
    }
}

/// One route's members; `None` (after reporting) when its class is unknown.
fn validate_route(
    r: &RawRoute,
    key: ParsedKey,
    path: &str,
    rc: &RouteContext<'_>,
    ctx: &mut Ctx,
) -> Option<Route> {
    let method = key.method;
    let class = route_class(r, &method, path, rc, ctx);
    check_idempotent_write(r, &method, path, rc, ctx);
    let scopes = match &r.scopes {
        Some(list) => scope_refs(rc.provider, rc.scopes, list, &format!("{path}.scopes"), ctx),
        None => rc.default_scopes.to_vec(),
    };
    let coalesce = r.coalesce.as_ref().is_some_and(|c| c.value);
    check_coalesce(r, &method, class.as_deref(), path, ctx);
    let fingerprint_fields = check_pointers(
        ctx,
        &r.fingerprint_fields,
        &format!("{path}.fingerprint_fields"),
    );
    let reconcile = r.reconcile.as_ref().and_then(|rc_raw| {
        validate_reconcile(
            rc_raw,
            &format!("{path}.reconcile"),
            rc.idempotency_header.is_some(),
            ctx,
        )
    });
    Some(Route {
        method,
        template: key.template,
        segments: key.segments,
        class: class?,
        scopes,
        coalesce,
        fingerprint_fields,
        reconcile,
    })
}

/// The route's `class`: a known class, else `None` after reporting; absent, the SPEC §3 default
/// for `method` at the provider.
fn route_class(
    r: &RawRoute,
    method: &str,
    path: &str,
    rc: &RouteContext<'_>,
    ctx: &mut Ctx,
) -> Option<String> {
    match &r.class {
        Some(c) if rc.classes.contains_key(&c.value) => Some(c.value.clone()),
        Some(c) => {
            ctx.err(
                &c.referenced,
                format!(
                    "{path}.class: unknown request class `{}` (known: {})",
                    c.value,
                    rc.classes.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            );
            None
        }
        None => Some(
            default_class(
                method,
                rc.idempotent_put_delete,
                rc.idempotency_header.is_some(),
            )
            .to_owned(),
        ),
    }
}

/// A route of class `idempotent_write` at a provider without an `idempotency_header`: an error
/// for a write (its retries would not be deduplicated), a warning for a PUT/DELETE that relies on
/// `idempotent_put_delete` alone.
fn check_idempotent_write(
    r: &RawRoute,
    method: &str,
    path: &str,
    rc: &RouteContext<'_>,
    ctx: &mut Ctx,
) {
    let Some(c) = r.class.as_ref().filter(|c| c.value == "idempotent_write") else {
        return;
    };
    if rc.idempotency_header.is_some() || rc.declares_idempotency_header {
        return;
    }
    let name = rc.provider;
    let put_delete = matches!(method, "PUT" | "DELETE");
    if put_delete && rc.idempotent_put_delete {
        ctx.warn(
            c.referenced.line(),
            c.referenced.column(),
            format!("{path}.class: `idempotent_write` without an `idempotency_header`: retries rely on the provider's idempotent {method} contract (`idempotent_put_delete: true`) alone; no key lets the provider deduplicate them"),
        );
    } else if !matches!(method, "GET" | "HEAD" | "OPTIONS") {
        ctx.err(
            &c.referenced,
            format!("{path}.class: `idempotent_write` needs the provider to honour an idempotency key (SPEC §3), but providers.{name} has no `idempotency_header`, so retries of this {method} would not be deduplicated{}; set `idempotency_header` or use `uncertain_write`", if put_delete { " (and `idempotent_put_delete` is not true)" } else { "" }),
        );
    }
}

/// `coalesce: true` on anything but a safe read (GET/HEAD of class `read`) is reported.
fn check_coalesce(r: &RawRoute, method: &str, class: Option<&str>, path: &str, ctx: &mut Ctx) {
    let Some(c) = r.coalesce.as_ref().filter(|c| c.value) else {
        return;
    };
    if !matches!(method, "GET" | "HEAD") || class.is_some_and(|c| c != "read") {
        ctx.err(
            &c.referenced,
            format!("{path}.coalesce: only safe reads (GET/HEAD of class `read`) may be coalesced"),
        );
    }
}
