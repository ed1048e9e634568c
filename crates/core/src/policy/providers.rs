//! Providers (`providers.NAME`): base URL, credential, dialect, error codes, scopes and routes.

use std::collections::BTreeMap;

use serde::Serialize;

use super::checks::{check_pointer, is_name};
use super::classes::RequestClass;
use super::diagnostics::Ctx;
use super::headers::{check_credential_header, check_header_name, check_idempotency_header};
use super::raw::{RawProvider, S};
use super::reconcile::validate_reconcile;
use super::routes::{default_class, Route};
use super::scopes::{validate_scope, Scope, SharedScope};
use super::secrets::{validate_credential, Credential};
use super::templates::{parse_route_key, Segment};
use crate::classify::Disposition;
use crate::quota::Dialect;

/// Quota header dialects a provider may name (SPEC §2.3).
pub const DIALECTS: [&str; 5] = ["generic", "ietf", "openai", "anthropic", "github"];

/// Dispositions an `error_codes` entry may map to (SPEC §2.1).
pub const DISPOSITIONS: [&str; 9] = [
    "success",
    "rate_limited",
    "quota_exhausted",
    "unavailable",
    "transient",
    "not_sent",
    "uncertain",
    "conflict",
    "rejected",
];

/// A provider (`providers.NAME`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Provider {
    /// The provider's name.
    pub name: String,
    /// Base URL, `http://` or `https://`, without a trailing slash.
    pub base_url: String,
    /// Credential, if the provider needs one.
    pub credential: Option<Credential>,
    /// Quota header dialect (`dialect`, one of [`DIALECTS`], default `generic`).
    pub dialect: Dialect,
    /// Idempotency header name (e.g. `Idempotency-Key`); its presence means the provider
    /// honours keys, so POST/PATCH default to `idempotent_write`.
    pub idempotency_header: Option<String>,
    /// Whether PUT/DELETE are idempotent by the provider's contract.
    pub idempotent_put_delete: bool,
    /// JSON pointer (RFC 6901) to the error code in an error body (`error_code_pointer`);
    /// absent, the dialect's documented place ([`Dialect::error_code_pointer`]: `/error/code`
    /// for `openai`), else none.
    pub error_code_pointer: Option<String>,
    /// Provider error code → disposition (`error_codes`); these override
    /// [`crate::classify::default_error_codes`].
    pub error_codes: BTreeMap<String, Disposition>,
    /// JSON pointers to a Google-style `retryDelay` in error bodies (`retry_delay_pointers`).
    pub retry_delay_pointers: Vec<String>,
    /// JSON pointers to the violated quota's name (`quota_id_pointers`; `…PerDay` → quota exhausted).
    pub quota_id_pointers: Vec<String>,
    /// JSON pointers to a `resets_in_seconds` number (`resets_in_seconds_pointers`).
    pub resets_in_seconds_pointers: Vec<String>,
    /// Whether `x-should-retry`-style hints are honoured (default true).
    pub honour_hints: bool,
    /// Scopes by short name.
    pub scopes: BTreeMap<String, Scope>,
    /// Full scope names for requests that match no route (default: every scope).
    pub default_scopes: Vec<String>,
    /// Configured routes, in file order.
    pub routes: Vec<Route>,
}

/// First path segments that belong to backstop itself: a provider with one of these names would
/// be shadowed by backstop's own routes (`/v1/…`, `/metrics`). Compared case-insensitively.
pub const RESERVED_PROVIDER_NAMES: [&str; 2] = ["v1", "metrics"];

/// Whether `name` can be the first path segment of the proxy door `/{provider}/{path…}`: not
/// one of [`RESERVED_PROVIDER_NAMES`] (any case), and not the dot segments `.` or `..`, which
/// RFC 3986 §5.2.4 removes from a path before any route is matched.
///
/// # Errors
/// One sentence saying why the name cannot be served and what to do (rename the provider).
///
/// ```
/// use backstop_core::policy::check_provider_name;
/// assert!(check_provider_name("billing").is_ok());
/// assert!(check_provider_name("Metrics").unwrap_err().contains("reserved"));
/// assert!(check_provider_name("..").unwrap_err().contains("dot segment"));
/// ```
pub fn check_provider_name(name: &str) -> Result<(), String> {
    if let Some(reserved) = RESERVED_PROVIDER_NAMES
        .iter()
        .find(|r| r.eq_ignore_ascii_case(name))
    {
        return Err(format!(
            "the name `{name}` is reserved (the proxy door /{name}/… would be shadowed by backstop's own /{reserved} routes); rename the provider"
        ));
    }
    if name == "." || name == ".." {
        return Err(format!(
            "`{name}` is a dot segment, which is removed from request paths (RFC 3986 §5.2.4), so no request could reach this provider; rename the provider"
        ));
    }
    Ok(())
}

/// Checks that `url` (`http://` or `https://`, no userinfo, query or fragment) parses as the
/// absolute URI every request to the provider is built from, as the gateway's client parses it
/// (`http::Uri`): otherwise every request would fail to connect and burn its budget.
fn check_request_target(url: &str) -> Result<(), String> {
    let uri = url.parse::<http::Uri>().map_err(|e| {
        format!("not a URL a request can be sent to ({e}); expected http(s)://HOST[:PORT][/PATH]")
    })?;
    let authority = uri.authority().map_or("", |a| a.as_str());
    let host = uri.host().unwrap_or("");
    if host.is_empty() || host == "[]" {
        return Err("missing host".to_owned());
    }
    if let Some(port) = authority
        .strip_prefix(host)
        .and_then(|p| p.strip_prefix(':'))
    {
        if port.parse::<u16>().is_err() {
            return Err(format!("the port `{port}` is not a number 0–65535"));
        }
    }
    Ok(())
}

pub(super) fn validate_provider(
    key: &S<String>,
    raw: S<RawProvider>,
    classes: &BTreeMap<String, RequestClass>,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> Option<Provider> {
    let name = key.value.clone();
    let path = format!("providers.{name}");
    if !is_name(&name) || name.contains('/') {
        ctx.err(
            &key.referenced,
            format!("{path}: a provider name uses letters, digits, `_`, `-`, `.` or `:`"),
        );
    } else if let Err(reason) = check_provider_name(&name) {
        ctx.err(&key.referenced, format!("{path}: {reason}"));
    }
    let p = raw.value;
    let use_instead = "credential.secret_env or credential.secret_file";
    ctx.trap(&p.secret, &format!("{path}.secret"), use_instead);
    ctx.trap(&p.token, &format!("{path}.token"), use_instead);
    ctx.trap(&p.api_key, &format!("{path}.api_key"), use_instead);

    let base_url = match &p.base_url {
        Some(s) => {
            let url = s.value.trim_end_matches('/').to_owned();
            let rest = url
                .strip_prefix("https://")
                .or_else(|| url.strip_prefix("http://"));
            match rest {
                None => ctx.err(
                    &s.referenced,
                    format!("{path}.base_url: must start with http:// or https://"),
                ),
                Some(rest) => {
                    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
                    if rest.contains(['?', '#']) {
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: must not carry a query string or fragment (they can hold keys; use {use_instead} for credentials; value not shown)"),
                        );
                    } else if authority.contains('@') {
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: literal secret; credentials in the URL are not allowed (use {use_instead})"),
                        );
                    } else if authority.is_empty() {
                        ctx.err(&s.referenced, format!("{path}.base_url: missing host"));
                    } else if let Some(c) = rest[authority.len()..].chars().find(|c| !c.is_ascii())
                    {
                        // http::Uri refuses a non-ASCII host but lets such a path through;
                        // sent raw, its bytes are not a valid request target (RFC 9112 §3.2).
                        ctx.err(
                            &s.referenced,
                            format!("{path}.base_url: the path holds `{c}`, which is not ASCII; a URL path is ASCII, so percent-encode the character's UTF-8 bytes (e.g. `é` as `%C3%A9`)"),
                        );
                    } else if let Err(reason) = check_request_target(&url) {
                        ctx.err(&s.referenced, format!("{path}.base_url: {reason}"));
                    }
                }
            }
            url
        }
        None => {
            ctx.err(&key.referenced, format!("{path}: missing `base_url`"));
            String::new()
        }
    };

    let credential = p
        .credential
        .as_ref()
        .and_then(|c| validate_credential(c, &format!("{path}.credential"), ctx));

    let dialect = match &p.dialect {
        Some(d) => {
            match serde_json::from_value::<Dialect>(serde_json::Value::String(d.value.clone())) {
                Ok(dialect) => dialect,
                Err(_) => {
                    ctx.err(
                        &d.referenced,
                        format!(
                            "{path}.dialect: unknown dialect `{}` (one of {})",
                            d.value,
                            DIALECTS.join(", ")
                        ),
                    );
                    Dialect::Generic
                }
            }
        }
        None => Dialect::Generic,
    };

    let credential_header = p.credential.as_ref().map(|c| {
        c.value
            .header
            .as_ref()
            .map_or("Authorization", |h| h.value.as_str())
    });
    let idempotency_header = p.idempotency_header.as_ref().and_then(|s| {
        let field = format!("{path}.idempotency_header");
        (check_header_name(ctx, s, &field)
            && check_idempotency_header(ctx, s, &field, credential_header))
        .then(|| s.value.clone())
    });
    // A credential header equal to the `idempotency_header` is reported there, once.
    if let Some(header) = p.credential.as_ref().and_then(|c| c.value.header.as_ref()) {
        let key_header = p.idempotency_header.as_ref().map(|s| s.value.as_str());
        if !key_header.is_some_and(|k| k.eq_ignore_ascii_case(&header.value))
            && http::HeaderName::from_bytes(header.value.as_bytes()).is_ok()
        {
            let field = format!("{path}.credential.header");
            check_credential_header(ctx, header, &field, key_header.is_some());
        }
    }
    // Absent: the dialect's documented place, if it has one (OpenAI: /error/code), so that a
    // provider declared `dialect: openai` reads `insufficient_quota` without more settings.
    let error_code_pointer = match &p.error_code_pointer {
        Some(_) => check_pointer(
            ctx,
            &p.error_code_pointer,
            &format!("{path}.error_code_pointer"),
        ),
        None => dialect.error_code_pointer().map(str::to_owned),
    };
    let mut error_codes = BTreeMap::new();
    for (code, disposition) in p.error_codes.map(|m| m.0).unwrap_or_default() {
        match serde_json::from_value::<Disposition>(serde_json::Value::String(
            disposition.value.clone(),
        )) {
            Ok(d) => {
                error_codes.insert(code.value, d);
            }
            Err(_) => ctx.err(
                &disposition.referenced,
                format!(
                    "{path}.error_codes.{}: unknown disposition `{}` (one of {})",
                    code.value,
                    disposition.value,
                    DISPOSITIONS.join(", ")
                ),
            ),
        }
    }
    let pointer_list = |ctx: &mut Ctx, v: &Option<S<Vec<S<String>>>>, field: &str| -> Vec<String> {
        v.as_ref()
            .map(|list| {
                list.value
                    .iter()
                    .filter_map(|f| {
                        check_pointer(ctx, &Some(f.clone()), &format!("{path}.{field}"))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let retry_delay_pointers = pointer_list(ctx, &p.retry_delay_pointers, "retry_delay_pointers");
    let quota_id_pointers = pointer_list(ctx, &p.quota_id_pointers, "quota_id_pointers");
    let resets_in_seconds_pointers = pointer_list(
        ctx,
        &p.resets_in_seconds_pointers,
        "resets_in_seconds_pointers",
    );
    if !error_codes.is_empty() && error_code_pointer.is_none() && p.error_code_pointer.is_none() {
        ctx.err(
            &raw.referenced,
            format!("{path}: `error_codes` needs `error_code_pointer` to find the code in an error body"),
        );
    }

    let mut scopes = BTreeMap::new();
    let scope_entries = p.scopes.map(|m| m.0).unwrap_or_default();
    if scope_entries.is_empty() {
        ctx.warn(
            key.referenced.line(),
            key.referenced.column(),
            format!("{path}: no scopes, so its calls share no quota record, pacing or concurrency limit (add `scopes:`)"),
        );
    }
    for (scope_key, scope) in scope_entries {
        let scope_path = format!("{path}.scopes.{}", scope_key.value);
        if !is_name(&scope_key.value) {
            ctx.err(
                &scope_key.referenced,
                format!("{scope_path}: a scope name uses letters, digits, `_`, `-`, `.` or `:`"),
            );
        }
        let s = validate_scope(&name, &scope_key.value, &scope, &scope_path, shared, ctx);
        scopes.insert(scope_key.value.clone(), s);
    }

    let scope_ref = |ctx: &mut Ctx, s: &S<String>, at: &str| -> Option<String> {
        let short = s
            .value
            .strip_prefix(&format!("{name}/"))
            .unwrap_or(&s.value);
        if scopes.contains_key(short) {
            Some(format!("{name}/{short}"))
        } else {
            let known: Vec<&str> = scopes.keys().map(String::as_str).collect();
            ctx.err(
                &s.referenced,
                format!(
                    "{at}: unknown scope `{}` (provider {name} has: {})",
                    s.value,
                    if known.is_empty() {
                        "no scopes".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            );
            None
        }
    };

    let default_scopes = match &p.default_scopes {
        Some(list) => list
            .value
            .iter()
            .filter_map(|s| scope_ref(ctx, s, &format!("{path}.default_scopes")))
            .collect(),
        None => scopes.values().map(|s| s.name.clone()).collect::<Vec<_>>(),
    };

    let mut routes: Vec<Route> = Vec::new();
    // Each route's shape (method, literal segments, parameters without their names) and its key
    // and position: two routes of one shape match exactly the same requests.
    #[allow(clippy::type_complexity)]
    let mut seen_routes: BTreeMap<
        (String, Vec<Option<String>>),
        (String, Vec<Segment>, u64, u64),
    > = BTreeMap::new();
    for (route_key, route) in p.routes.map(|m| m.0).unwrap_or_default() {
        let route_path = format!("{path}.routes.\"{}\"", route_key.value);
        let Some((method, template, segments)) = parse_route_key(&route_key, &route_path, ctx)
        else {
            continue;
        };
        let shape = segments
            .iter()
            .map(|segment| match segment {
                Segment::Literal(text) => Some(text.clone()),
                Segment::Param(_) => None,
            })
            .collect();
        match seen_routes.entry((method.clone(), shape)) {
            std::collections::btree_map::Entry::Occupied(first) => {
                let (first_key, first_segments, line, column) = first.get();
                let message = if *first_segments == segments {
                    format!(
                        "{route_path}: the same method and template are already routed by route \"{first_key}\" ({}:{line}:{column})",
                        ctx.file
                    )
                } else {
                    format!(
                        "{route_path}: matches exactly the same requests as route \"{first_key}\" ({}:{line}:{column}), only the parameter names differ, so which of them applies would be ambiguous; keep one",
                        ctx.file
                    )
                };
                ctx.err(&route_key.referenced, message);
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert((
                    format!("{method} {template}"),
                    segments.clone(),
                    route_key.referenced.line(),
                    route_key.referenced.column(),
                ));
            }
        }
        let r = &route.value;
        // An unknown class is reported and the route's other members are still checked, so
        // that one run names every problem; the route itself is then left out.
        let class = match &r.class {
            Some(c) if classes.contains_key(&c.value) => Some(c.value.clone()),
            Some(c) => {
                ctx.err(
                    &c.referenced,
                    format!(
                        "{route_path}.class: unknown request class `{}` (known: {})",
                        c.value,
                        classes.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                );
                None
            }
            None => {
                let provider_stub = Provider {
                    name: name.clone(),
                    base_url: String::new(),
                    credential: None,
                    dialect: Dialect::Generic,
                    idempotency_header: idempotency_header.clone(),
                    idempotent_put_delete: p
                        .idempotent_put_delete
                        .as_ref()
                        .is_some_and(|b| b.value),
                    error_code_pointer: None,
                    error_codes: BTreeMap::new(),
                    retry_delay_pointers: Vec::new(),
                    quota_id_pointers: Vec::new(),
                    resets_in_seconds_pointers: Vec::new(),
                    honour_hints: true,
                    scopes: BTreeMap::new(),
                    default_scopes: Vec::new(),
                    routes: Vec::new(),
                };
                Some(default_class(&provider_stub, &method).to_owned())
            }
        };
        if let Some(c) = r.class.as_ref().filter(|c| c.value == "idempotent_write") {
            if idempotency_header.is_none() && p.idempotency_header.is_none() {
                let put_delete = matches!(method.as_str(), "PUT" | "DELETE");
                let contract = p.idempotent_put_delete.as_ref().is_some_and(|b| b.value);
                if put_delete && contract {
                    ctx.warn(
                        c.referenced.line(),
                        c.referenced.column(),
                        format!("{route_path}.class: `idempotent_write` without an `idempotency_header`: retries rely on the provider's idempotent {method} contract (`idempotent_put_delete: true`) alone; no key lets the provider deduplicate them"),
                    );
                } else if !matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS") {
                    ctx.err(
                        &c.referenced,
                        format!("{route_path}.class: `idempotent_write` needs the provider to honour an idempotency key (SPEC §3), but providers.{name} has no `idempotency_header`, so retries of this {method} would not be deduplicated{}; set `idempotency_header` or use `uncertain_write`", if put_delete { " (and `idempotent_put_delete` is not true)" } else { "" }),
                    );
                }
            }
        }
        let route_scopes = match &r.scopes {
            Some(list) => list
                .value
                .iter()
                .filter_map(|s| scope_ref(ctx, s, &format!("{route_path}.scopes")))
                .collect(),
            None => default_scopes.clone(),
        };
        let coalesce = r.coalesce.as_ref().is_some_and(|c| c.value);
        if let Some(c) = r.coalesce.as_ref().filter(|c| c.value) {
            if !matches!(method.as_str(), "GET" | "HEAD")
                || class.as_deref().is_some_and(|c| c != "read")
            {
                ctx.err(
                    &c.referenced,
                    format!("{route_path}.coalesce: only safe reads (GET/HEAD of class `read`) may be coalesced"),
                );
            }
        }
        let fingerprint_fields = match &r.fingerprint_fields {
            Some(list) => list
                .value
                .iter()
                .filter_map(|f| {
                    check_pointer(
                        ctx,
                        &Some(f.clone()),
                        &format!("{route_path}.fingerprint_fields"),
                    )
                })
                .collect(),
            None => Vec::new(),
        };
        let reconcile = r.reconcile.as_ref().and_then(|rc| {
            validate_reconcile(
                rc,
                &format!("{route_path}.reconcile"),
                idempotency_header.is_some(),
                ctx,
            )
        });
        let Some(class) = class else {
            continue;
        };
        routes.push(Route {
            method,
            template,
            segments,
            class,
            scopes: route_scopes,
            coalesce,
            fingerprint_fields,
            reconcile,
        });
    }

    Some(Provider {
        name: name.clone(),
        base_url,
        credential,
        dialect,
        idempotency_header,
        idempotent_put_delete: p.idempotent_put_delete.as_ref().is_some_and(|b| b.value),
        error_code_pointer,
        error_codes,
        retry_delay_pointers,
        quota_id_pointers,
        resets_in_seconds_pointers,
        honour_hints: p.honour_hints.as_ref().is_none_or(|b| b.value),
        scopes,
        default_scopes,
        routes,
    })
}
