//! Providers (`providers.NAME`): base URL, credential, dialect, error codes, scopes and routes.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_saphyr::Location;

use super::checks::{check_pointer, check_pointers, is_name};
use super::classes::RequestClass;
use super::diagnostics::Ctx;
use super::headers::{check_credential_header, check_header_name, check_idempotency_header};
use super::raw::{RawProvider, SpannedMap, S};
use super::routes::{validate_routes, Route, RouteContext};
use super::scopes::{scope_refs, validate_scopes, Scope, SharedScope};
use super::secrets::{validate_credential, Credential};
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

/// Where a provider's secret is referenced from, as the messages that refuse a literal one say.
const SECRET_REFS: &str = "credential.secret_env or credential.secret_file";

/// Validates every provider (`providers`) against the request classes and shared scope limits
/// already read, keyed by provider name.
pub(super) fn validate_providers(
    raw: Option<SpannedMap<S<RawProvider>>>,
    classes: &BTreeMap<String, RequestClass>,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> BTreeMap<String, Provider> {
    let mut providers = BTreeMap::new();
    for (key, provider) in raw.map(|m| m.0).unwrap_or_default() {
        if let Some(p) = validate_provider(&key, provider, classes, shared, ctx) {
            providers.insert(p.name.clone(), p);
        }
    }
    providers
}

fn validate_provider(
    key: &S<String>,
    raw: S<RawProvider>,
    classes: &BTreeMap<String, RequestClass>,
    shared: &SharedScope,
    ctx: &mut Ctx,
) -> Option<Provider> {
    let name = key.value.clone();
    let path = format!("providers.{name}");
    check_provider_key(key, &path, ctx);
    let p = raw.value;
    ctx.trap(&p.secret, &format!("{path}.secret"), SECRET_REFS);
    ctx.trap(&p.token, &format!("{path}.token"), SECRET_REFS);
    ctx.trap(&p.api_key, &format!("{path}.api_key"), SECRET_REFS);
    let base_url = validate_base_url(p.base_url.as_ref(), key, &path, ctx);
    let credential = p
        .credential
        .as_ref()
        .and_then(|c| validate_credential(c, &format!("{path}.credential"), ctx));
    let dialect = validate_dialect(p.dialect.as_ref(), &path, ctx);
    let idempotency_header = validate_idempotency_header(&p, &path, ctx);
    check_credential_header_of(&p, &path, ctx);
    let body = validate_error_body(&p, dialect, &raw.referenced, &path, ctx);
    let scopes = validate_scopes(key, p.scopes, &path, shared, ctx);
    let default_scopes = match &p.default_scopes {
        Some(list) => scope_refs(&name, &scopes, list, &format!("{path}.default_scopes"), ctx),
        None => scopes.values().map(|s| s.name.clone()).collect::<Vec<_>>(),
    };
    let idempotent_put_delete = p.idempotent_put_delete.as_ref().is_some_and(|b| b.value);
    let routes = validate_routes(
        p.routes,
        &RouteContext {
            provider: &name,
            path: &path,
            classes,
            scopes: &scopes,
            default_scopes: &default_scopes,
            idempotency_header: idempotency_header.as_deref(),
            declares_idempotency_header: p.idempotency_header.is_some(),
            idempotent_put_delete,
        },
        ctx,
    );
    Some(Provider {
        name: name.clone(),
        base_url,
        credential,
        dialect,
        idempotency_header,
        idempotent_put_delete,
        error_code_pointer: body.error_code_pointer,
        error_codes: body.error_codes,
        retry_delay_pointers: body.retry_delay_pointers,
        quota_id_pointers: body.quota_id_pointers,
        resets_in_seconds_pointers: body.resets_in_seconds_pointers,
        honour_hints: p.honour_hints.as_ref().is_none_or(|b| b.value),
        scopes,
        default_scopes,
        routes,
    })
}

/// Reports a provider name (the key at `path`, `providers.NAME`) that is not a name or that the
/// proxy door cannot serve ([`check_provider_name`]).
fn check_provider_key(key: &S<String>, path: &str, ctx: &mut Ctx) {
    let name = &key.value;
    if !is_name(name) || name.contains('/') {
        ctx.err(
            &key.referenced,
            format!("{path}: a provider name uses letters, digits, `_`, `-`, `.` or `:`"),
        );
    } else if let Err(reason) = check_provider_name(name) {
        ctx.err(&key.referenced, format!("{path}: {reason}"));
    }
}

/// `base_url` without its trailing slashes (empty when missing, reported at the provider's
/// `key`); a URL no request can be sent to is reported and still returned.
fn validate_base_url(
    raw: Option<&S<String>>,
    key: &S<String>,
    path: &str,
    ctx: &mut Ctx,
) -> String {
    let Some(s) = raw else {
        ctx.err(&key.referenced, format!("{path}: missing `base_url`"));
        return String::new();
    };
    let url = s.value.trim_end_matches('/').to_owned();
    if let Err(reason) = base_url_problem(&url) {
        ctx.err(&s.referenced, format!("{path}.base_url: {reason}"));
    }
    url
}

/// Why `url` (without trailing slashes) cannot be a provider's `base_url`, in the words that
/// follow `providers.P.base_url: `. Never echoes a query, fragment or userinfo, which can hold
/// keys.
fn base_url_problem(url: &str) -> Result<(), String> {
    let use_instead = SECRET_REFS;
    let Some(rest) = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
    else {
        return Err("must start with http:// or https://".to_owned());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if rest.contains(['?', '#']) {
        Err(format!("must not carry a query string or fragment (they can hold keys; use {use_instead} for credentials; value not shown)"))
    } else if authority.contains('@') {
        Err(format!(
            "literal secret; credentials in the URL are not allowed (use {use_instead})"
        ))
    } else if authority.is_empty() {
        Err("missing host".to_owned())
    } else if let Some(c) = rest[authority.len()..].chars().find(|c| !c.is_ascii()) {
        // http::Uri refuses a non-ASCII host but lets such a path through; sent raw, its bytes
        // are not a valid request target (RFC 9112 §3.2).
        Err(format!("the path holds `{c}`, which is not ASCII; a URL path is ASCII, so percent-encode the character's UTF-8 bytes (e.g. `é` as `%C3%A9`)"))
    } else {
        check_request_target(url)
    }
}

/// `dialect`, one of [`DIALECTS`]; absent or unknown (reported), [`Dialect::Generic`].
fn validate_dialect(raw: Option<&S<String>>, path: &str, ctx: &mut Ctx) -> Dialect {
    let Some(d) = raw else {
        return Dialect::Generic;
    };
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

/// `idempotency_header`, if set and a header that may carry the key (see
/// [`check_idempotency_header`]); a refused one is reported and dropped.
fn validate_idempotency_header(p: &RawProvider, path: &str, ctx: &mut Ctx) -> Option<String> {
    let credential_header = p.credential.as_ref().map(|c| {
        c.value
            .header
            .as_ref()
            .map_or("Authorization", |h| h.value.as_str())
    });
    p.idempotency_header.as_ref().and_then(|s| {
        let field = format!("{path}.idempotency_header");
        (check_header_name(ctx, s, &field)
            && check_idempotency_header(ctx, s, &field, credential_header))
        .then(|| s.value.clone())
    })
}

/// Reports a `credential.header` that cannot carry the credential (see
/// [`check_credential_header`]). A credential header equal to the `idempotency_header` is
/// reported there, once, and an invalid header name by [`validate_credential`].
fn check_credential_header_of(p: &RawProvider, path: &str, ctx: &mut Ctx) {
    let Some(header) = p.credential.as_ref().and_then(|c| c.value.header.as_ref()) else {
        return;
    };
    let key_header = p.idempotency_header.as_ref().map(|s| s.value.as_str());
    if !key_header.is_some_and(|k| k.eq_ignore_ascii_case(&header.value))
        && http::HeaderName::from_bytes(header.value.as_bytes()).is_ok()
    {
        let field = format!("{path}.credential.header");
        check_credential_header(ctx, header, &field, key_header.is_some());
    }
}

/// How a provider's error bodies are read: where the error code is and what each code means,
/// and where retry delays, quota names and reset times are.
struct ErrorBodyRules {
    error_code_pointer: Option<String>,
    error_codes: BTreeMap<String, Disposition>,
    retry_delay_pointers: Vec<String>,
    quota_id_pointers: Vec<String>,
    resets_in_seconds_pointers: Vec<String>,
}

/// The error-body settings of provider `p` (at `path`, its section at `at`), each pointer
/// checked. `error_codes` without any `error_code_pointer` (the file's or the dialect's) is
/// reported.
fn validate_error_body(
    p: &RawProvider,
    dialect: Dialect,
    at: &Location,
    path: &str,
    ctx: &mut Ctx,
) -> ErrorBodyRules {
    let error_code_pointer = validate_error_code_pointer(p, dialect, path, ctx);
    let error_codes = validate_error_codes(p.error_codes.as_ref(), path, ctx);
    let mut pointers = |field: &str, v: &Option<S<Vec<S<String>>>>| {
        check_pointers(ctx, v, &format!("{path}.{field}"))
    };
    let retry_delay_pointers = pointers("retry_delay_pointers", &p.retry_delay_pointers);
    let quota_id_pointers = pointers("quota_id_pointers", &p.quota_id_pointers);
    let resets_in_seconds_pointers =
        pointers("resets_in_seconds_pointers", &p.resets_in_seconds_pointers);
    if !error_codes.is_empty() && error_code_pointer.is_none() && p.error_code_pointer.is_none() {
        ctx.err(
            at,
            format!("{path}: `error_codes` needs `error_code_pointer` to find the code in an error body"),
        );
    }
    ErrorBodyRules {
        error_code_pointer,
        error_codes,
        retry_delay_pointers,
        quota_id_pointers,
        resets_in_seconds_pointers,
    }
}

/// `error_code_pointer`, checked; absent, the dialect's documented place, if it has one
/// (OpenAI: `/error/code`), so that a provider declared `dialect: openai` reads
/// `insufficient_quota` without more settings.
fn validate_error_code_pointer(
    p: &RawProvider,
    dialect: Dialect,
    path: &str,
    ctx: &mut Ctx,
) -> Option<String> {
    match &p.error_code_pointer {
        Some(_) => check_pointer(
            ctx,
            &p.error_code_pointer,
            &format!("{path}.error_code_pointer"),
        ),
        None => dialect.error_code_pointer().map(str::to_owned),
    }
}

/// `error_codes`: provider error code → one of [`DISPOSITIONS`]; an unknown disposition is
/// reported and its entry left out.
fn validate_error_codes(
    raw: Option<&SpannedMap<S<String>>>,
    path: &str,
    ctx: &mut Ctx,
) -> BTreeMap<String, Disposition> {
    let mut error_codes = BTreeMap::new();
    for (code, disposition) in raw.map_or(&[][..], |m| &m.0[..]) {
        match serde_json::from_value::<Disposition>(serde_json::Value::String(
            disposition.value.clone(),
        )) {
            Ok(d) => {
                error_codes.insert(code.value.clone(), d);
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
    error_codes
}
