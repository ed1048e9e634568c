//! The validated, ready-to-match form of a [`FakeConfig`], and the checks that build it
//! ([`FakeConfig::validate`]).

use std::collections::BTreeMap;

use http::{HeaderName, Method};

use crate::config::{
    FakeConfig, Fault, FaultRule, FixedWindow, Handler, QuotaConfig, RouteConfig, TokenBucket,
};
use crate::Error;

/// Upper bounds that keep a config from asking for absurd work.
pub(crate) const MAX_STREAM_EVENTS: u32 = 10_000;
pub(crate) const MAX_INTERVAL_MS: u64 = 60_000;
const MAX_HOLD_MS: u64 = 3_600_000;

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
}

/// A route ready to match.
#[derive(Debug, Clone)]
pub(crate) struct CompiledRoute {
    pub(crate) template: String,
    method: Method,
    segments: Vec<Segment>,
    pub(crate) handler: Handler,
    /// Indices into [`Compiled::quotas`].
    pub(crate) quotas: Vec<usize>,
    pub(crate) idempotency: bool,
    pub(crate) script: Vec<Fault>,
    pub(crate) faults: Vec<FaultRule>,
}

/// The result of matching a request against the routes.
pub(crate) enum RouteMatch {
    Found {
        index: usize,
        params: BTreeMap<String, String>,
    },
    /// The path matches some route, but not with this method.
    MethodNotAllowed,
    NotFound,
}

/// A validated config.
#[derive(Debug, Clone)]
pub(crate) struct Compiled {
    pub(crate) seed: u64,
    pub(crate) idempotency_header: HeaderName,
    pub(crate) idempotency_conflict_status: u16,
    pub(crate) auth_header: HeaderName,
    pub(crate) quotas: Vec<QuotaConfig>,
    pub(crate) routes: Vec<CompiledRoute>,
}

fn invalid(place: String, reason: impl Into<String>) -> Error {
    Error::Config {
        place,
        reason: reason.into(),
    }
}

fn check_status(place: String, status: u16) -> Result<(), Error> {
    if (100..=599).contains(&status) {
        Ok(())
    } else {
        Err(invalid(
            place,
            format!("status {status} is not an HTTP status (100..=599)"),
        ))
    }
}

fn check_name(place: String, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            place,
            format!("name {name:?} must be non-empty and use only letters, digits, `_ - . :`"),
        ))
    }
}

fn check_fault(place: &str, fault: &Fault) -> Result<(), Error> {
    match fault {
        Fault::Pass | Fault::Drop => Ok(()),
        Fault::Status {
            status,
            retry_after,
            ..
        } => {
            check_status(format!("{place}.status"), *status)?;
            if let Some(raw) = retry_after {
                if http::HeaderValue::from_str(raw).is_err() {
                    return Err(invalid(
                        format!("{place}.retry_after"),
                        "value cannot be sent as an HTTP header",
                    ));
                }
            }
            Ok(())
        }
        Fault::ErrorCode { status, .. } => check_status(format!("{place}.status"), *status),
        Fault::Timeout { hold_ms } | Fault::StoreThenDrop { hold_ms } | Fault::Slow { hold_ms } => {
            if *hold_ms > MAX_HOLD_MS {
                Err(invalid(
                    format!("{place}.hold_ms"),
                    format!("{hold_ms} ms is over the 1 h ceiling"),
                ))
            } else {
                Ok(())
            }
        }
    }
}

fn parse_pattern(place: &str, pattern: &str) -> Result<(Method, Vec<Segment>), Error> {
    let place = format!("{place}.route");
    let (method, path) = pattern.trim().split_once(' ').ok_or_else(|| {
        invalid(
            place.clone(),
            format!("{pattern:?} is not `METHOD /path` (e.g. `GET /v1/items/{{id}}`)"),
        )
    })?;
    let method = Method::from_bytes(method.as_bytes())
        .ok()
        .filter(|_| method.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or_else(|| {
            invalid(
                place.clone(),
                format!("{method:?} is not an upper-case HTTP method"),
            )
        })?;
    let path = path.trim();
    let rest = path
        .strip_prefix('/')
        .ok_or_else(|| invalid(place.clone(), format!("path {path:?} must start with `/`")))?;
    if path.starts_with("/__fake/") || path == "/__fake" {
        return Err(invalid(place, "paths under /__fake/ are reserved"));
    }
    let mut segments = Vec::new();
    if !rest.is_empty() {
        for segment in rest.split('/') {
            if let Some(inner) = segment.strip_prefix('{') {
                let name = inner.strip_suffix('}').ok_or_else(|| {
                    invalid(
                        place.clone(),
                        format!("segment {segment:?} opens `{{` but does not close it"),
                    )
                })?;
                check_name(place.clone(), name)?;
                segments.push(Segment::Param(name.to_owned()));
            } else if segment.contains(['{', '}']) {
                return Err(invalid(
                    place,
                    format!("segment {segment:?}: a parameter must be a whole segment"),
                ));
            } else {
                segments.push(Segment::Literal(segment.to_owned()));
            }
        }
    }
    Ok((method, segments))
}

impl Compiled {
    /// Validates `config` and prepares it for matching.
    pub(crate) fn new(config: &FakeConfig) -> Result<Self, Error> {
        let idempotency_header = header_name("idempotency_header", &config.idempotency_header)?;
        let auth_header = header_name("auth_header", &config.auth_header)?;
        if !matches!(config.idempotency_conflict_status, 409 | 422) {
            return Err(invalid(
                "idempotency_conflict_status".into(),
                format!("{} must be 409 or 422", config.idempotency_conflict_status),
            ));
        }
        for (i, quota) in config.quotas.iter().enumerate() {
            check_quota(&config.quotas[..i], &format!("quotas[{i}]"), quota)?;
        }
        let mut routes = Vec::with_capacity(config.routes.len());
        for (i, route) in config.routes.iter().enumerate() {
            let compiled = compile_route(config, &routes, &format!("routes[{i}]"), route)?;
            routes.push(compiled);
        }
        Ok(Compiled {
            seed: config.seed,
            idempotency_header,
            idempotency_conflict_status: config.idempotency_conflict_status,
            auth_header,
            quotas: config.quotas.clone(),
            routes,
        })
    }

    /// Finds the first route matching `method` and `path` (percent-encoded, as received).
    pub(crate) fn match_route(&self, method: &Method, path: &str) -> RouteMatch {
        let parts: Vec<&str> = match path.strip_prefix('/') {
            Some("") => Vec::new(),
            Some(rest) => rest.split('/').collect(),
            None => return RouteMatch::NotFound,
        };
        let mut path_matched = false;
        for (index, route) in self.routes.iter().enumerate() {
            if route.segments.len() != parts.len() {
                continue;
            }
            let mut params = BTreeMap::new();
            let matched = route
                .segments
                .iter()
                .zip(&parts)
                .all(|(segment, part)| match segment {
                    Segment::Literal(lit) => lit == part,
                    Segment::Param(name) => {
                        if part.is_empty() {
                            return false;
                        }
                        let value = percent_decode(part);
                        params.insert(name.clone(), value);
                        true
                    }
                });
            if !matched {
                continue;
            }
            if route.method == method {
                return RouteMatch::Found { index, params };
            }
            path_matched = true;
        }
        if path_matched {
            RouteMatch::MethodNotAllowed
        } else {
            RouteMatch::NotFound
        }
    }
}

impl FakeConfig {
    /// Checks the config: names, limits, route patterns, quota references, fault triggers.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad place (`routes[1].faults[0]`) and why.
    pub fn validate(&self) -> Result<(), Error> {
        Compiled::new(self).map(|_| ())
    }
}

/// The header named `raw`, the config's field `place`.
fn header_name(place: &str, raw: &str) -> Result<HeaderName, Error> {
    HeaderName::from_bytes(raw.as_bytes())
        .map_err(|_| invalid(place.into(), format!("{raw:?} is not a header name")))
}

/// Checks one quota at `place`; `earlier` are the quotas defined before it.
fn check_quota(earlier: &[QuotaConfig], place: &str, quota: &QuotaConfig) -> Result<(), Error> {
    check_name(format!("{place}.name"), &quota.name)?;
    if earlier.iter().any(|q| q.name == quota.name) {
        return Err(invalid(
            format!("{place}.name"),
            format!("quota {:?} is defined twice", quota.name),
        ));
    }
    match (&quota.fixed_window, &quota.token_bucket) {
        (Some(w), None) => check_fixed_window(place, w)?,
        (None, Some(b)) => check_token_bucket(place, b)?,
        _ => {
            return Err(invalid(
                place.to_owned(),
                "set exactly one of `fixed_window` and `token_bucket`",
            ))
        }
    }
    check_status(format!("{place}.exceeded_status"), quota.exceeded_status)?;
    if let Some(resource) = &quota.resource {
        check_name(format!("{place}.resource"), resource)?;
    }
    Ok(())
}

fn check_fixed_window(place: &str, window: &FixedWindow) -> Result<(), Error> {
    if window.limit == 0 {
        return Err(invalid(
            format!("{place}.fixed_window.limit"),
            "must be at least 1",
        ));
    }
    if window.window_ms == 0 {
        return Err(invalid(
            format!("{place}.fixed_window.window_ms"),
            "must be at least 1",
        ));
    }
    Ok(())
}

fn check_token_bucket(place: &str, bucket: &TokenBucket) -> Result<(), Error> {
    if bucket.burst == 0 {
        return Err(invalid(
            format!("{place}.token_bucket.burst"),
            "must be at least 1",
        ));
    }
    if !(bucket.rate_per_second.is_finite() && bucket.rate_per_second > 0.0) {
        return Err(invalid(
            format!("{place}.token_bucket.rate_per_second"),
            format!("{} must be a finite number above 0", bucket.rate_per_second),
        ));
    }
    Ok(())
}

/// Validates the route at `place` and prepares it for matching; `earlier` are the routes
/// compiled before it.
fn compile_route(
    config: &FakeConfig,
    earlier: &[CompiledRoute],
    place: &str,
    route: &RouteConfig,
) -> Result<CompiledRoute, Error> {
    let (method, segments) = parse_pattern(place, &route.route)?;
    // Two routes for the same method and path shape (parameter names aside): the second
    // could never be reached.
    if let Some(k) = earlier
        .iter()
        .position(|r| r.method == method && same_shape(&r.segments, &segments))
    {
        return Err(invalid(
            format!("{place}.route"),
            format!(
                "{:?} duplicates routes[{k}] (same method and path); each route once",
                route.route
            ),
        ));
    }
    let quotas = quota_indices(config, place, &route.quotas)?;
    check_handler(place, &route.handler, &segments)?;
    for (j, fault) in route.script.iter().enumerate() {
        check_fault(&format!("{place}.script[{j}]"), fault)?;
    }
    for (j, rule) in route.faults.iter().enumerate() {
        check_fault_rule(&format!("{place}.faults[{j}]"), rule)?;
    }
    Ok(CompiledRoute {
        template: format!("{method} /{}", route_path(&segments)),
        method,
        segments,
        handler: route.handler.clone(),
        quotas,
        idempotency: route.idempotency,
        script: route.script.clone(),
        faults: route.faults.clone(),
    })
}

/// The indices into the config's quotas of the quotas a route names.
fn quota_indices(config: &FakeConfig, place: &str, names: &[String]) -> Result<Vec<usize>, Error> {
    names
        .iter()
        .enumerate()
        .map(|(j, name)| {
            config
                .quotas
                .iter()
                .position(|q| &q.name == name)
                .ok_or_else(|| {
                    invalid(
                        format!("{place}.quotas[{j}]"),
                        format!("unknown quota {name:?}"),
                    )
                })
        })
        .collect()
}

/// Checks a route's handler against the route's path `segments`.
fn check_handler(place: &str, handler: &Handler, segments: &[Segment]) -> Result<(), Error> {
    match handler {
        Handler::Respond { status, .. } => check_status(format!("{place}.handler.status"), *status),
        Handler::Fast => Ok(()),
        Handler::Create {
            collection,
            id_prefix,
            ..
        } => {
            check_name(format!("{place}.handler.collection"), collection)?;
            if !id_prefix.is_empty() {
                check_name(format!("{place}.handler.id_prefix"), id_prefix)?;
            }
            Ok(())
        }
        Handler::Lookup { collection } => {
            check_name(format!("{place}.handler.collection"), collection)
        }
        Handler::Get {
            collection,
            id_param,
        } => {
            check_name(format!("{place}.handler.collection"), collection)?;
            if !segments.contains(&Segment::Param(id_param.clone())) {
                return Err(invalid(
                    format!("{place}.handler.id_param"),
                    format!("the pattern has no `{{{id_param}}}` segment"),
                ));
            }
            Ok(())
        }
        Handler::Stream {
            events,
            interval_ms,
        }
        | Handler::Completion {
            events,
            interval_ms,
            ..
        } => check_stream_bounds(place, *events, *interval_ms),
    }
}

fn check_stream_bounds(place: &str, events: u32, interval_ms: u64) -> Result<(), Error> {
    if events > MAX_STREAM_EVENTS {
        return Err(invalid(
            format!("{place}.handler.events"),
            format!("{events} is over {MAX_STREAM_EVENTS}"),
        ));
    }
    if interval_ms > MAX_INTERVAL_MS {
        return Err(invalid(
            format!("{place}.handler.interval_ms"),
            format!("{interval_ms} ms is over {MAX_INTERVAL_MS} ms"),
        ));
    }
    Ok(())
}

/// Checks a fault rule: exactly one trigger, a sensible one, and its fault.
fn check_fault_rule(place: &str, rule: &FaultRule) -> Result<(), Error> {
    let triggers = usize::from(!rule.on_calls.is_empty())
        + usize::from(rule.every_nth.is_some())
        + usize::from(rule.probability.is_some());
    if triggers != 1 {
        return Err(invalid(
            place.to_owned(),
            "set exactly one of `on_calls`, `every_nth`, `probability`",
        ));
    }
    if rule.on_calls.contains(&0) {
        return Err(invalid(
            format!("{place}.on_calls"),
            "call numbers start at 1",
        ));
    }
    if rule.every_nth == Some(0) {
        return Err(invalid(format!("{place}.every_nth"), "must be at least 1"));
    }
    if let Some(p) = rule.probability {
        if !(0.0..=1.0).contains(&p) {
            return Err(invalid(
                format!("{place}.probability"),
                format!("{p} is not within [0, 1]"),
            ));
        }
    }
    check_fault(&format!("{place}.fault"), &rule.fault)
}

/// Whether two patterns match the same paths: equal literals, parameters in the same places.
fn same_shape(a: &[Segment], b: &[Segment]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|pair| match pair {
            (Segment::Literal(x), Segment::Literal(y)) => x == y,
            (Segment::Param(_), Segment::Param(_)) => true,
            _ => false,
        })
}

fn route_path(segments: &[Segment]) -> String {
    segments
        .iter()
        .map(|s| match s {
            Segment::Literal(l) => l.clone(),
            Segment::Param(p) => format!("{{{p}}}"),
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Decodes one path segment (RFC 3986 §2.1): `%XX` becomes its byte, everything else — `+`, `&`,
/// `=` included — is kept as written; bytes that are not UTF-8 after decoding become U+FFFD.
fn percent_decode(part: &str) -> String {
    percent_encoding::percent_decode_str(part)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouteConfig;

    fn config_with(route: &str) -> FakeConfig {
        FakeConfig::default().with_route(RouteConfig::new(route, Handler::default()))
    }

    #[test]
    fn params_match_whole_segments_and_are_decoded() {
        let compiled = Compiled::new(&config_with("GET /v1/items/{id}")).expect("valid");
        match compiled.match_route(&Method::GET, "/v1/items/a%20b") {
            RouteMatch::Found { index, params } => {
                assert_eq!(index, 0);
                assert_eq!(params.get("id").map(String::as_str), Some("a b"));
            }
            _ => panic!("expected a match"),
        }
        assert!(matches!(
            compiled.match_route(&Method::POST, "/v1/items/1"),
            RouteMatch::MethodNotAllowed
        ));
        assert!(matches!(
            compiled.match_route(&Method::GET, "/v1/items/"),
            RouteMatch::NotFound
        ));
        assert!(matches!(
            compiled.match_route(&Method::GET, "/v1/items/1/x"),
            RouteMatch::NotFound
        ));
    }

    #[test]
    fn params_keep_reserved_characters_and_decode_escapes() {
        let compiled = Compiled::new(&config_with("GET /v1/items/{id}")).expect("valid");
        for (path, expected) in [
            ("/v1/items/a&b", "a&b"),
            ("/v1/items/a=b&c=d", "a=b&c=d"),
            ("/v1/items/a+b", "a+b"),
            ("/v1/items/a%26b%2Fc", "a&b/c"),
            ("/v1/items/%E2%82%AC", "\u{20ac}"),
            ("/v1/items/100%", "100%"),
        ] {
            match compiled.match_route(&Method::GET, path) {
                RouteMatch::Found { params, .. } => {
                    assert_eq!(
                        params.get("id").map(String::as_str),
                        Some(expected),
                        "{path}"
                    );
                }
                _ => panic!("{path}: expected a match"),
            }
        }
    }

    #[test]
    fn bad_patterns_name_the_route() {
        for (pattern, needle) in [
            ("/v1/x", "METHOD /path"),
            ("get /v1/x", "upper-case"),
            ("GET v1/x", "must start with"),
            ("GET /v1/{id", "does not close"),
            ("GET /v1/a{id}", "whole segment"),
            ("GET /__fake/x", "reserved"),
        ] {
            let err = Compiled::new(&config_with(pattern)).expect_err(pattern);
            let text = err.to_string();
            assert!(text.contains("routes[0].route"), "{text}");
            assert!(text.contains(needle), "{pattern}: {text}");
        }
    }

    #[test]
    fn unknown_quota_reference_is_refused() {
        let config = FakeConfig::default()
            .with_route(RouteConfig::new("GET /x", Handler::default()).with_quota("nope"));
        let text = Compiled::new(&config).expect_err("invalid").to_string();
        assert!(text.contains("routes[0].quotas[0]"), "{text}");
        assert!(text.contains("unknown quota"), "{text}");
    }
}
