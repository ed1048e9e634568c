//! Where secrets and tokens are found, never the values themselves: provider credentials
//! (`providers.P.credential`) and the tokens of agents and operators (`agents`, `operators`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;
use serde_saphyr::Location;

use super::diagnostics::Ctx;
use super::raw::{RawCredential, RawPrincipal, SpannedMap, S};

/// Where an agent's or operator's token is found. Never the token itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenRef {
    /// `token_env`: the environment variable holding the token.
    Env(String),
    /// `token_file`: the file holding the token.
    File(PathBuf),
    /// `token_sha256`: the lowercase hex SHA-256 of the token.
    Sha256(String),
}

/// Where a provider secret is found. Never the secret itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretRef {
    /// `secret_env`: the environment variable holding the secret.
    Env(String),
    /// `secret_file`: the file holding the secret.
    File(PathBuf),
}

/// How the gateway authenticates to a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Credential {
    /// Where the secret is.
    pub secret: SecretRef,
    /// Header carrying it (default `Authorization`).
    pub header: String,
    /// Scheme before the secret (default `Bearer`; empty for a bare value like `x-api-key`).
    pub scheme: String,
}

/// Whether `name` is a portable environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Checks a secret or token reference (`secret_env`, `token_file`, …). An environment reference
/// must be a variable *name*; a file reference must not be empty. The message never repeats the
/// value: a value that is not a name is most likely the secret itself.
fn check_secret_ref(ctx: &mut Ctx, s: &S<String>, path: &str, env: bool) -> bool {
    if env && !is_env_name(&s.value) {
        let got = if s.value.is_empty() {
            "empty"
        } else {
            "not a name"
        };
        ctx.err(
            &s.referenced,
            format!(
                "{path}: {got}; give the NAME of the environment variable holding the secret \
                 (letters, digits and `_`, not starting with a digit), never the secret (value not shown)"
            ),
        );
        return false;
    }
    if !env && s.value.trim().is_empty() {
        ctx.err(
            &s.referenced,
            format!("{path}: empty; give the path of the file holding the secret"),
        );
        return false;
    }
    true
}

/// The token sources of the agents and operators read so far (`token_sha256` digests,
/// `token_env` variables, `token_file` paths), each with its `section.NAME.field` and where it
/// was written: two callers sharing one token could not be told apart.
#[derive(Default)]
pub(super) struct TokenSources(Vec<(TokenRef, String, u64, u64)>);

impl TokenSources {
    /// Records `source` for `place` (`agents.NAME.token_env`), or reports it at `at` naming the
    /// earlier entry with the same source.
    fn claim(&mut self, source: &TokenRef, place: &str, at: &Location, ctx: &mut Ctx) {
        if let Some((_, first, line, column)) = self.0.iter().find(|(seen, ..)| seen == source) {
            let (owner, _) = place.rsplit_once('.').unwrap_or((place, ""));
            let (first_owner, _) = first.rsplit_once('.').unwrap_or((first, ""));
            let file = &ctx.file;
            let what = match source {
                TokenRef::Sha256(_) => "digest",
                TokenRef::Env(_) => "environment variable",
                TokenRef::File(_) => "file",
            };
            let message = format!(
                "{place}: the same {what} as {first} ({file}:{line}:{column}), so {first_owner} and {owner} would have one token and a caller presenting it could be either; give each agent and operator its own token"
            );
            ctx.err(at, message);
        } else {
            self.0
                .push((source.clone(), place.to_owned(), at.line(), at.column()));
        }
    }
}

/// The agents or operators of `section` (`agents`, `operators`), each with exactly one token
/// source; a source another caller already has is reported (see [`TokenSources`]).
pub(super) fn validate_principals(
    raw: Option<SpannedMap<S<RawPrincipal>>>,
    section: &str,
    tokens: &mut TokenSources,
    ctx: &mut Ctx,
) -> BTreeMap<String, TokenRef> {
    let mut out = BTreeMap::new();
    for (key, principal) in raw.map(|m| m.0).unwrap_or_default() {
        if let Some(source) = validate_principal(&key, &principal.value, section, tokens, ctx) {
            out.insert(key.value.clone(), source);
        }
    }
    out
}

/// Where the token of the caller at `key` is found, or `None` after reporting that it gives
/// none (unless it wrote one in clear, which is reported as such) or more than one.
fn validate_principal(
    key: &S<String>,
    p: &RawPrincipal,
    section: &str,
    tokens: &mut TokenSources,
    ctx: &mut Ctx,
) -> Option<TokenRef> {
    let path = format!("{section}.{}", key.value);
    let use_instead = "token_env, token_file or token_sha256";
    ctx.trap(&p.token, &format!("{path}.token"), use_instead);
    ctx.trap(&p.secret, &format!("{path}.secret"), use_instead);
    ctx.trap(&p.password, &format!("{path}.password"), use_instead);
    ctx.trap(&p.api_key, &format!("{path}.api_key"), use_instead);
    let mut refs = token_sources(p, &path, tokens, ctx);
    match refs.len() {
        1 => return refs.pop(),
        0 => {
            let trapped = p.token.is_some()
                || p.secret.is_some()
                || p.password.is_some()
                || p.api_key.is_some();
            if !trapped {
                ctx.err(
                    &key.referenced,
                    format!("{path}: needs exactly one of {use_instead}"),
                );
            }
        }
        _ => ctx.err(
            &key.referenced,
            format!("{path}: give only one of {use_instead}"),
        ),
    }
    None
}

/// Every token source the caller at `path` gives, each checked and claimed in `tokens`.
fn token_sources(
    p: &RawPrincipal,
    path: &str,
    tokens: &mut TokenSources,
    ctx: &mut Ctx,
) -> Vec<TokenRef> {
    let mut refs = Vec::new();
    if let Some(s) = &p.token_env {
        check_secret_ref(ctx, s, &format!("{path}.token_env"), true);
        let source = TokenRef::Env(s.value.clone());
        tokens.claim(&source, &format!("{path}.token_env"), &s.referenced, ctx);
        refs.push(source);
    }
    if let Some(s) = &p.token_file {
        check_secret_ref(ctx, s, &format!("{path}.token_file"), false);
        let source = TokenRef::File(PathBuf::from(&s.value));
        tokens.claim(&source, &format!("{path}.token_file"), &s.referenced, ctx);
        refs.push(source);
    }
    if let Some(s) = &p.token_sha256 {
        let digest = s.value.trim().to_ascii_lowercase();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            ctx.err(
                &s.referenced,
                format!("{path}.token_sha256: must be 64 hex digits (a SHA-256 digest)"),
            );
        }
        let source = TokenRef::Sha256(digest);
        tokens.claim(&source, &format!("{path}.token_sha256"), &s.referenced, ctx);
        refs.push(source);
    }
    refs
}

/// Where a credential's secret is referenced from, as the messages that refuse a literal one or
/// ask for one say.
const SECRET_REFS: &str = "secret_env or secret_file";

/// The credential at `path` (`providers.P.credential`): exactly one of `secret_env` or
/// `secret_file`, a valid header name (default `Authorization`) and a one-word scheme (default
/// `Bearer`). `None` after reporting a missing, doubled or invalid secret reference.
pub(super) fn validate_credential(
    raw: &S<RawCredential>,
    path: &str,
    ctx: &mut Ctx,
) -> Option<Credential> {
    let c = &raw.value;
    let use_instead = SECRET_REFS;
    ctx.trap(&c.secret, &format!("{path}.secret"), use_instead);
    ctx.trap(&c.value, &format!("{path}.value"), use_instead);
    ctx.trap(&c.token, &format!("{path}.token"), use_instead);
    ctx.trap(&c.api_key, &format!("{path}.api_key"), use_instead);
    ctx.trap(&c.password, &format!("{path}.password"), use_instead);
    let header = credential_header(c, path, ctx);
    let scheme = credential_scheme(c, path, ctx);
    let secret = credential_secret(raw, path, ctx)?;
    Some(Credential {
        secret,
        header,
        scheme,
    })
}

/// `header`, default `Authorization`; a value that is not a header name is reported (never
/// echoed) and still returned.
fn credential_header(c: &RawCredential, path: &str, ctx: &mut Ctx) -> String {
    let Some(h) = &c.header else {
        return "Authorization".to_owned();
    };
    if http::HeaderName::from_bytes(h.value.as_bytes()).is_err() {
        ctx.err(
            &h.referenced,
            format!(
                "{path}.header: not a valid HTTP header field name (no `:` or spaces; \
                 the name only, e.g. `Authorization`, never the secret; value not shown)"
            ),
        );
    }
    h.value.clone()
}

/// `scheme`, default `Bearer`; one with whitespace is reported and still returned.
fn credential_scheme(c: &RawCredential, path: &str, ctx: &mut Ctx) -> String {
    let scheme = c
        .scheme
        .as_ref()
        .map(|s| s.value.clone())
        .unwrap_or_else(|| "Bearer".to_owned());
    if scheme.chars().any(char::is_whitespace) {
        if let Some(s) = &c.scheme {
            ctx.err(
                &s.referenced,
                format!(
                    "{path}.scheme: one word such as `Bearer` or empty (a secret never goes here)"
                ),
            );
        }
    }
    scheme
}

/// Where the secret is: exactly one valid `secret_env` or `secret_file`, else `None` after
/// reporting (no second report when a secret was written in clear).
fn credential_secret(raw: &S<RawCredential>, path: &str, ctx: &mut Ctx) -> Option<SecretRef> {
    let c = &raw.value;
    let use_instead = SECRET_REFS;
    let secret = match (&c.secret_env, &c.secret_file) {
        (Some(env), None) => {
            if !check_secret_ref(ctx, env, &format!("{path}.secret_env"), true) {
                return None;
            }
            SecretRef::Env(env.value.clone())
        }
        (None, Some(file)) => {
            if !check_secret_ref(ctx, file, &format!("{path}.secret_file"), false) {
                return None;
            }
            SecretRef::File(PathBuf::from(&file.value))
        }
        (Some(_), Some(file)) => {
            ctx.err(
                &file.referenced,
                format!("{path}: give only one of {use_instead}"),
            );
            return None;
        }
        (None, None) => {
            let trapped = [&c.secret, &c.value, &c.token, &c.api_key, &c.password]
                .iter()
                .any(|t| t.is_some());
            if !trapped {
                ctx.err(
                    &raw.referenced,
                    format!("{path}: needs one of {use_instead}"),
                );
            }
            return None;
        }
    };
    Some(secret)
}
