//! Route templates: parsing `"METHOD /path/{param}"` keys, matching a request path against a
//! template, and the template of an unconfigured path.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::diagnostics::Ctx;
use super::raw::S;

/// One segment of a route template.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    /// Must equal the path segment.
    Literal(String),
    /// `{name}`: any non-empty segment.
    Param(String),
}

pub(super) fn path_segments(path: &str) -> Vec<&str> {
    path.trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect()
}

pub(super) fn match_segments(
    template: &[Segment],
    path: &[&str],
) -> Option<BTreeMap<String, String>> {
    if template.len() != path.len() {
        return None;
    }
    let mut params = BTreeMap::new();
    for (segment, actual) in template.iter().zip(path) {
        match segment {
            Segment::Literal(l) if l == actual => {}
            Segment::Literal(_) => return None,
            Segment::Param(name) => {
                params.insert(name.clone(), (*actual).to_owned());
            }
        }
    }
    Some(params)
}

/// The route template of a concrete path: segments that look like ids become `{id}`, so that
/// `/v1/transfers/8412/events` and `/v1/transfers/8413/events` share one template (and one
/// fingerprint, metric and audit label). An id is: all digits; a UUID; 16 or more hex digits;
/// 16 or more characters with at least one digit; or a prefixed opaque token like `tr_8a7b6c5d`
/// (a `_`-separated prefix followed by 8 or more characters with a digit). Query and trailing
/// slash are dropped.
///
/// ```
/// use backstop_core::policy::template_for_path;
/// assert_eq!(
///     template_for_path("/v1/customers/cus_9s6XKzkNRiz8i3/charges/42?limit=3"),
///     "/v1/customers/{id}/charges/{id}"
/// );
/// assert_eq!(template_for_path("/v1/chat/completions"), "/v1/chat/completions");
/// ```
pub fn template_for_path(path: &str) -> String {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let segments = path_segments(path);
    if segments.is_empty() {
        return "/".to_owned();
    }
    let mut out = String::with_capacity(path.len());
    for segment in segments {
        out.push('/');
        if looks_like_id(segment) {
            out.push_str("{id}");
        } else {
            out.push_str(segment);
        }
    }
    out
}

fn looks_like_id(s: &str) -> bool {
    let has_digit = s.bytes().any(|b| b.is_ascii_digit());
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    if is_uuid(s) {
        return true;
    }
    if s.len() >= 16 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return true;
    }
    if s.len() >= 16 && has_digit {
        return true;
    }
    if let Some((prefix, rest)) = s.split_once('_') {
        return !prefix.is_empty()
            && rest.len() >= 8
            && rest.bytes().any(|b| b.is_ascii_digit())
            && rest.bytes().all(|b| b.is_ascii_alphanumeric());
    }
    false
}

fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The methods a route key may name (RFC 9110 §9.3 and RFC 5789 `PATCH`). Any other token —
/// an extension method such as `FETCH`, or `TRACE`/`CONNECT` — is refused: its class could only be
/// guessed.
pub const ROUTE_METHODS: [&str; 7] = ["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"];

/// Parses `"METHOD /path/{param}"`; the method must be one of [`ROUTE_METHODS`].
pub(super) fn parse_route_key(
    key: &S<String>,
    path: &str,
    ctx: &mut Ctx,
) -> Option<(String, String, Vec<Segment>)> {
    let text = key.value.as_str();
    let Some((method, template)) = text.split_once(char::is_whitespace) else {
        ctx.err(
            &key.referenced,
            format!("{path}: a route is `METHOD /path/{{param}}`, e.g. `POST /v1/transfers`"),
        );
        return None;
    };
    // Exactly one space between method and path, none around: `GET  /v1/x` or ` GET /v1/x`
    // would be listed under a key that names no route as the gateway prints it.
    if method.is_empty()
        || template.contains(char::is_whitespace)
        || text.as_bytes()[method.len()] != b' '
    {
        ctx.err(
            &key.referenced,
            format!("{path}: a route is `METHOD /path/{{param}}` with exactly one space between the method and the path and none before or after, e.g. `POST /v1/transfers`"),
        );
        return None;
    }
    if !ROUTE_METHODS.contains(&method) {
        let upper = method.to_ascii_uppercase();
        let message = if ROUTE_METHODS.contains(&upper.as_str()) {
            format!("{path}: `{method}` is not an upper-case HTTP method: write `{upper}`")
        } else {
            format!(
                "{path}: `{method}` is not a method backstop routes (one of: {})",
                ROUTE_METHODS.join(", ")
            )
        };
        ctx.err(&key.referenced, message);
        return None;
    }
    match parse_template(template) {
        Ok(segments) => {
            let unmatchable = segments.iter().find_map(|segment| match segment {
                Segment::Literal(literal) => unmatchable_literal(literal),
                Segment::Param(_) => None,
            });
            if let Some(reason) = unmatchable {
                ctx.err(
                    &key.referenced,
                    format!("{path}: {reason}, so this route would never match"),
                );
                return None;
            }
            Some((method.to_owned(), template.to_owned(), segments))
        }
        Err(reason) => {
            ctx.err(&key.referenced, format!("{path}: {reason}"));
            None
        }
    }
}

/// Why a literal route segment can never equal a segment of a request path, as the gateway
/// matches it: normalized (RFC 3986 §6.2.2) — percent-encoded unreserved characters decoded,
/// other percent-encodings in upper-case hex, the dot segments `.` and `..` removed — and
/// ASCII only (a URL carries other characters percent-encoded). `None` for a segment that can
/// match.
fn unmatchable_literal(segment: &str) -> Option<String> {
    if !segment.is_ascii() {
        let encoded: String = segment
            .chars()
            .map(|c| {
                if c.is_ascii() {
                    c.to_string()
                } else {
                    let mut buf = [0; 4];
                    c.encode_utf8(&mut buf)
                        .bytes()
                        .map(|b| format!("%{b:02X}"))
                        .collect()
                }
            })
            .collect();
        return Some(format!(
            "`{segment}` is not ASCII: requests carry it percent-encoded and are matched that way; write `{encoded}`"
        ));
    }
    let bytes = segment.as_bytes();
    let mut normal = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            normal.push(char::from(bytes[i]));
            i += 1;
            continue;
        }
        let byte = segment
            .get(i + 1..i + 3)
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        let Some(byte) = byte else {
            return Some(format!(
                "`{segment}`: a `%` must be followed by two hex digits (RFC 3986 §2.1), and a request path with a malformed `%` is refused"
            ));
        };
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            normal.push(char::from(byte));
        } else {
            normal.push_str(&format!("%{byte:02X}"));
        }
        i += 3;
    }
    if normal == "." || normal == ".." {
        return Some(format!(
            "`{segment}` is a dot segment: request paths are normalized before matching (RFC 3986 §5.2.4) and have none; write the path it resolves to"
        ));
    }
    if normal != segment {
        return Some(format!(
            "`{segment}`: request paths are normalized before matching (RFC 3986 §6.2.2: unreserved characters decoded, other percent-encodings in upper-case hex); write `{normal}`"
        ));
    }
    None
}

pub(super) fn parse_template(template: &str) -> Result<Vec<Segment>, String> {
    if !template.starts_with('/') {
        return Err(format!("the path `{template}` must start with `/`"));
    }
    if template.contains(['?', '#']) {
        return Err("a route template has no query or fragment".to_owned());
    }
    if template.chars().any(char::is_whitespace) {
        return Err("a route template has no spaces".to_owned());
    }
    let mut segments = Vec::new();
    let mut names = BTreeSet::new();
    let trimmed = template.strip_suffix('/').unwrap_or(template);
    if trimmed.is_empty() {
        return Ok(segments);
    }
    for segment in trimmed[1..].split('/') {
        if segment.is_empty() {
            return Err(format!("empty segment (`//`) in `{template}`"));
        }
        if let Some(inner) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            let valid = inner
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && inner.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "`{segment}`: a parameter is `{{name}}` with letters, digits and `_`"
                ));
            }
            if !names.insert(inner.to_owned()) {
                return Err(format!("parameter `{{{inner}}}` appears twice"));
            }
            segments.push(Segment::Param(inner.to_owned()));
        } else if segment.contains(['{', '}']) {
            return Err(format!(
                "`{segment}`: braces must enclose a whole segment, like `{{id}}`"
            ));
        } else {
            segments.push(Segment::Literal(segment.to_owned()));
        }
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_recognised() {
        for id in [
            "42",
            "550e8400-e29b-41d4-a716-446655440000",
            "0123456789abcdef01",
            "cus_9s6XKzkNRiz8i3",
            "tr_8a7b6c5d",
        ] {
            assert!(looks_like_id(id), "{id}");
        }
        for word in [
            "v1",
            "transfers",
            "chat",
            "completions",
            "by_reference",
            "v2beta",
        ] {
            assert!(!looks_like_id(word), "{word}");
        }
    }
}
