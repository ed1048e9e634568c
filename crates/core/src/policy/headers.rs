//! Which headers may carry a provider credential or an idempotency key.

use super::diagnostics::Ctx;
use super::raw::S;

pub(super) fn check_header_name(ctx: &mut Ctx, s: &S<String>, path: &str) -> bool {
    if http::HeaderName::from_bytes(s.value.as_bytes()).is_err() {
        ctx.err(
            &s.referenced,
            format!("{path}: `{}` is not a valid HTTP header name", s.value),
        );
        return false;
    }
    true
}

/// Why `name` (any case) cannot carry a provider credential or an idempotency key: HTTP or
/// backstop owns it. `None` for a header free to use.
///
/// HTTP's own: `Host`, `Content-Length`, `Expect` and the hop-by-hop headers of RFC 9110 §7.6.1
/// (`Connection`, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`),
/// which the gateway drops or the client sets per connection. backstop's own: `Prefer` (its
/// `wait` and `respond-async` preferences are read and removed) and every `X-Backstop-*`
/// header, none of which reaches the provider.
fn owned_header(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    if name.starts_with("x-backstop-") {
        Some("`X-Backstop-*` headers are backstop's own and never reach the provider")
    } else if name.starts_with("proxy-")
        || matches!(
            name.as_str(),
            "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
        )
    {
        Some("a hop-by-hop header (RFC 9110 §7.6.1): it is removed before a request is forwarded")
    } else if matches!(name.as_str(), "host" | "content-length" | "expect") {
        Some("HTTP owns it: the gateway's client sets it for each request")
    } else if name == "prefer" {
        Some("backstop reads its `wait` and `respond-async` preferences and rewrites it")
    } else {
        None
    }
}

/// Refuses an `idempotency_header` that carries credentials or that HTTP or backstop owns (see
/// [`owned_header`]): the key is stored, audited and echoed in answers, so a credential header
/// there would put the agent's token (or the provider's secret) in the audit log.
pub(super) fn check_idempotency_header(
    ctx: &mut Ctx,
    s: &S<String>,
    path: &str,
    credential_header: Option<&str>,
) -> bool {
    let lower = s.value.to_ascii_lowercase();
    let credential_reason = "it carries credentials, and an idempotency key is stored, audited \
                             and echoed in answers";
    let reason = if matches!(
        lower.as_str(),
        "authorization" | "proxy-authorization" | "cookie" | "set-cookie"
    ) {
        Some(credential_reason.to_owned())
    } else if credential_header.is_some_and(|c| c.eq_ignore_ascii_case(&s.value)) {
        Some(format!(
            "it is the provider's `credential.header`: {credential_reason}"
        ))
    } else {
        owned_header(&s.value).map(str::to_owned)
    };
    match reason {
        Some(reason) => {
            ctx.err(
                &s.referenced,
                format!(
                    "{path}: `{}` cannot carry the idempotency key: {reason}",
                    s.value
                ),
            );
            false
        }
        None => true,
    }
}

/// Refuses a credential `header` that HTTP or backstop owns (see [`owned_header`]), or that is
/// `Idempotency-Key` while the provider has no `idempotency_header` (`has_key_header` false):
/// backstop then reads the agent's key there and removes it before forwarding. A credential
/// header equal to the `idempotency_header` is refused by [`check_idempotency_header`].
pub(super) fn check_credential_header(
    ctx: &mut Ctx,
    s: &S<String>,
    path: &str,
    has_key_header: bool,
) {
    let reason = if !has_key_header && s.value.eq_ignore_ascii_case("idempotency-key") {
        Some(
            "without an `idempotency_header` it is where backstop reads the agent's idempotency \
             key, and it is removed before forwarding, so the credential would never reach the \
             provider",
        )
    } else {
        owned_header(&s.value)
    };
    if let Some(reason) = reason {
        ctx.err(
            &s.referenced,
            format!(
                "{path}: `{}` cannot carry the credential: {reason}",
                s.value
            ),
        );
    }
}
