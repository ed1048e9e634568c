//! Who is calling: agent and operator bearer tokens, checked in constant time.
//!
//! Why digests: the gateway must recognise tokens but has no reason to keep them. At start every
//! `token_env`/`token_file` is read and only its SHA-256 kept (a `token_sha256` is used as
//! given), so a memory dump or a debug print shows no usable token. A presented token is hashed
//! and compared with *every* known digest using [`subtle::ConstantTimeEq`], without an early
//! exit, so the time taken says nothing about which entry (or how much of it) matched.
//!
//! Who may use what: the proxy door takes agent tokens only (an agent's calls are charged to
//! it); `GET /v1/scopes` takes agent or operator tokens; `GET /metrics` takes either too, and is
//! open without a token when the gateway listens on a loopback address (see [`crate::server`]).

use axum::http::{header, HeaderMap};
use backstop_core::policy::{Policy, TokenRef};
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

use crate::secrets::{read_token, EnvLookup, SecretError};

/// The role a token grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An agent (`agents.NAME`): may use the proxy door.
    Agent,
    /// An operator (`operators.NAME`): may read scopes and metrics.
    Operator,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The name from the policy (`agents.NAME` or `operators.NAME`).
    pub name: String,
    /// Its role.
    pub role: Role,
}

/// Why a request is not authenticated. Messages never contain the presented token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("the Authorization header is missing; send `Authorization: Bearer <backstop token>`")]
    Missing,
    /// Not `Bearer <token>`.
    #[error("the Authorization header is not a bearer token")]
    NotBearer,
    /// `Bearer` with nothing after it, as a client sends when the variable meant to hold the
    /// token is unset or empty (`Authorization: Bearer $TOKEN`). HTTP drops the trailing space,
    /// so the header arrives as the bare scheme.
    #[error("the bearer token is empty: the Authorization header is `Bearer` with no token after it (is the variable holding the backstop token unset or empty?)")]
    EmptyToken,
    /// No agent or operator has this token.
    #[error("the bearer token matches no agent or operator of the policy")]
    Unknown,
    /// More than one `Authorization` header: the credentials are ambiguous, so none is used.
    #[error("the Authorization header is given more than once, so the credentials are ambiguous; send exactly one")]
    Duplicate,
}

#[derive(Clone)]
struct Entry {
    name: String,
    role: Role,
    digest: [u8; 32],
}

/// The known token digests.
#[derive(Default)]
pub struct Authenticator {
    entries: Vec<Entry>,
    unavailable: Vec<SecretError>,
    /// The lengths (in characters) of the tokens read in clear at start, never the tokens: what
    /// [`crate::scrub`] slides over free text to find a token inside a longer word.
    lengths: std::collections::BTreeSet<usize>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("tokens", &self.entries.len())
            .finish()
    }
}

/// The SHA-256 digest of a token.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Authenticator {
    /// Reads every agent's and operator's token (keeping only digests). A `token_file` that
    /// cannot be read leaves that agent or operator unable to authenticate
    /// ([`Authenticator::unavailable`]) instead of failing.
    ///
    /// # Errors
    /// The first [`SecretError`] naming `agents.NAME` or `operators.NAME`: a missing environment
    /// variable, an empty token, a `token_sha256` that is not 64 hex digits, or a token that
    /// another agent or operator has too ([`SecretError::SharedToken`], naming both).
    /// [`Authenticator::resolve_each`] reports all of them.
    pub fn resolve(policy: &Policy, env: EnvLookup<'_>) -> Result<Authenticator, SecretError> {
        let (auth, errors) = Authenticator::resolve_each(policy, env);
        match errors.into_iter().next() {
            Some(first) => Err(first),
            None => Ok(auth),
        }
    }

    /// As [`Authenticator::resolve`], but every agent and operator is tried, so that `backstop
    /// serve` can name every missing token at once instead of one per start: the tokens that
    /// resolved (with the unreadable `token_file`s under [`Authenticator::unavailable`]) and
    /// every other [`SecretError`], agents before operators and each in name order (empty when
    /// all resolved).
    pub fn resolve_each(policy: &Policy, env: EnvLookup<'_>) -> (Authenticator, Vec<SecretError>) {
        let mut entries = Vec::new();
        let mut unavailable = Vec::new();
        let mut errors = Vec::new();
        let mut lengths = std::collections::BTreeSet::new();
        for (section, role, tokens) in [
            ("agents", Role::Agent, &policy.agents),
            ("operators", Role::Operator, &policy.operators),
        ] {
            for (name, source) in tokens {
                let place = format!("{section}.{name}");
                let digest = match source {
                    TokenRef::Sha256(hex_digest) => match decode_digest(&place, hex_digest) {
                        Ok(digest) => digest,
                        Err(error) => {
                            errors.push(error);
                            continue;
                        }
                    },
                    other => match read_token(&place, other, env) {
                        Ok(Some(token)) => {
                            lengths.insert(token.expose().chars().count());
                            token_digest(token.expose())
                        }
                        Ok(None) => continue,
                        Err(error @ SecretError::ReadFile { .. }) => {
                            unavailable.push(error);
                            continue;
                        }
                        Err(error) => {
                            errors.push(error);
                            continue;
                        }
                    },
                };
                let first = entries.iter().find(|e: &&Entry| e.digest == digest);
                if let Some(first) = first {
                    let first_section = match first.role {
                        Role::Agent => "agents",
                        Role::Operator => "operators",
                    };
                    errors.push(SecretError::SharedToken {
                        place,
                        first: format!("{first_section}.{}", first.name),
                    });
                    continue;
                }
                entries.push(Entry {
                    name: name.clone(),
                    role,
                    digest,
                });
            }
        }
        (
            Authenticator {
                entries,
                unavailable,
                lengths,
            },
            errors,
        )
    }

    /// Token files that could not be read at start (their owners cannot authenticate).
    pub fn unavailable(&self) -> &[SecretError] {
        &self.unavailable
    }

    /// The lengths, in characters, of the tokens read in clear at start (none for a
    /// `token_sha256`, whose token backstop never sees).
    pub fn token_lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.lengths.iter().copied()
    }

    /// Adds one token (tests and embedding).
    pub fn with_token(mut self, name: &str, role: Role, token: &str) -> Authenticator {
        self.lengths.insert(token.chars().count());
        self.entries.push(Entry {
            name: name.to_owned(),
            role,
            digest: token_digest(token),
        });
        self
    }

    /// Number of known tokens.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no token is known (then nobody can use the door).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Identifies the caller of a request from `Authorization: Bearer <token>` (RFC 6750 §2.1;
    /// the scheme is case-insensitive).
    ///
    /// # Errors
    /// [`AuthError`]: missing header, more than one header, not a bearer token, an empty bearer
    /// token, or an unknown token.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, AuthError> {
        self.identify(bearer_token(headers)?)
            .ok_or(AuthError::Unknown)
    }

    /// The caller a token belongs to, compared in constant time against every entry.
    pub fn identify(&self, token: &str) -> Option<Caller> {
        let presented = token_digest(token);
        let mut found: Option<&Entry> = None;
        for entry in &self.entries {
            let equal: Choice = entry.digest.ct_eq(&presented);
            // Every entry is compared; the first match is kept without branching on the bytes.
            if bool::from(equal) && found.is_none() {
                found = Some(entry);
            }
        }
        found.map(|entry| Caller {
            name: entry.name.clone(),
            role: entry.role,
        })
    }
}

/// The token of the one `Authorization: Bearer <token>` header of a request (RFC 6750 §2.1;
/// the scheme is case-insensitive), not yet identified.
///
/// # Errors
/// [`AuthError`]: missing header, more than one header, not a bearer token, an empty bearer
/// token.
pub fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = bearer_header(headers)?;
    let value = value.to_str().map_err(|_| AuthError::NotBearer)?.trim();
    if value.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::EmptyToken);
    }
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::NotBearer)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::NotBearer);
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(AuthError::EmptyToken);
    }
    Ok(token)
}

/// The one `Authorization` header of a request (RFC 9110 §11.6.2 defines a single credential).
///
/// # Errors
/// [`AuthError::Missing`] without one, [`AuthError::Duplicate`] with two or more.
pub fn bearer_header(headers: &HeaderMap) -> Result<&axum::http::HeaderValue, AuthError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next().ok_or(AuthError::Missing)?;
    if values.next().is_some() {
        return Err(AuthError::Duplicate);
    }
    Ok(value)
}

fn decode_digest(place: &str, hex_digest: &str) -> Result<[u8; 32], SecretError> {
    let bytes = hex::decode(hex_digest.trim()).map_err(|_| SecretError::BadDigest {
        place: place.to_owned(),
    })?;
    bytes.try_into().map_err(|_| SecretError::BadDigest {
        place: place.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn tokens_from_env_and_digest() {
        let policy = Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  b: { token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 }\noperators:\n  o: { token_env: O_TOKEN }\n",
            "p.yaml",
        )
        .unwrap();
        let env = |name: &str| match name {
            "A_TOKEN" => Some("tok-a\n".to_owned()),
            "O_TOKEN" => Some("tok-o".to_owned()),
            _ => None,
        };
        let auth = Authenticator::resolve(&policy, &env).unwrap();
        assert_eq!(auth.len(), 3);
        let a = auth.authenticate(&headers("Bearer tok-a")).unwrap();
        assert_eq!((a.name.as_str(), a.role), ("a", Role::Agent));
        // sha256("test") is the digest configured for b.
        let b = auth.authenticate(&headers("bearer test")).unwrap();
        assert_eq!((b.name.as_str(), b.role), ("b", Role::Agent));
        let o = auth.authenticate(&headers("Bearer tok-o")).unwrap();
        assert_eq!(o.role, Role::Operator);
        assert!(!format!("{auth:?}").contains("tok-a"));
    }

    #[test]
    fn two_callers_whose_tokens_resolve_alike_stop_the_start_naming_both() {
        let policy = Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  b: { token_env: B_TOKEN }\n  c: { token_env: C_TOKEN }\n  d: { token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 }\noperators:\n  o: { token_env: O_TOKEN }\n",
            "p.yaml",
        )
        .unwrap();
        let env = |name: &str| match name {
            "A_TOKEN" => Some("tok-shared".to_owned()),
            "B_TOKEN" => Some("tok-b".to_owned()),
            // sha256("test") is the digest configured for d.
            "C_TOKEN" => Some("test".to_owned()),
            "O_TOKEN" => Some("tok-shared\n".to_owned()),
            _ => None,
        };
        let (auth, errors) = Authenticator::resolve_each(&policy, &env);
        let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            messages,
            [
                "agents.d: has the same token as agents.c, so a caller presenting it could be either; give each agent and operator its own token",
                "operators.o: has the same token as agents.a, so a caller presenting it could be either; give each agent and operator its own token",
            ]
        );
        assert!(!format!("{messages:?}{auth:?}").contains("tok-shared"));
        let first = Authenticator::resolve(&policy, &env).unwrap_err();
        assert!(matches!(first, SecretError::SharedToken { .. }), "{first}");
    }

    #[test]
    fn bad_authorization_headers() {
        let auth = Authenticator::default().with_token("a", Role::Agent, "secret-token");
        assert_eq!(
            auth.authenticate(&HeaderMap::new()),
            Err(AuthError::Missing)
        );
        assert_eq!(
            auth.authenticate(&headers("Basic abc")),
            Err(AuthError::NotBearer)
        );
        for empty in ["Bearer ", "Bearer", "bearer   ", "Bearer \t"] {
            assert_eq!(
                auth.authenticate(&headers(empty)),
                Err(AuthError::EmptyToken),
                "{empty:?}"
            );
        }
        assert!(AuthError::EmptyToken.to_string().contains("token is empty"));
        assert_eq!(
            auth.authenticate(&headers("secret-token")),
            Err(AuthError::NotBearer)
        );
        assert_eq!(
            auth.authenticate(&headers("Bearer secret-tokeN")),
            Err(AuthError::Unknown)
        );
        assert!(!AuthError::Unknown.to_string().contains("secret-token"));
    }

    #[test]
    fn two_authorization_headers_are_ambiguous_even_when_one_is_valid() {
        let auth = Authenticator::default().with_token("a", Role::Agent, "secret-token");
        let mut two = headers("Bearer secret-token");
        two.append(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer other"),
        );
        assert_eq!(auth.authenticate(&two), Err(AuthError::Duplicate));
    }

    #[test]
    fn unreadable_token_file_disables_only_that_agent() {
        let policy = Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  r: { token_file: /nonexistent/backstop-token }\n",
            "p.yaml",
        )
        .unwrap();
        let auth = Authenticator::resolve(&policy, &|_| Some("tok-a".into())).unwrap();
        assert_eq!(auth.len(), 1);
        assert_eq!(auth.unavailable().len(), 1);
        assert!(auth.unavailable()[0]
            .to_string()
            .starts_with("agents.r: cannot read secret file"));
        assert!(auth.identify("tok-a").is_some());
    }

    #[test]
    fn missing_token_env_is_named() {
        let policy =
            Policy::from_yaml_str("agents:\n  a: { token_env: A_TOKEN }\n", "p.yaml").unwrap();
        let err = Authenticator::resolve(&policy, &|_| None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "agents.a: environment variable A_TOKEN is not set"
        );
    }

    #[test]
    fn resolve_each_names_every_missing_token() {
        let policy = Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  b: { token_env: B_TOKEN }\n  c: { token_env: C_TOKEN }\noperators:\n  o: { token_env: O_TOKEN }\n",
            "p.yaml",
        )
        .unwrap();
        let env = |name: &str| (name == "B_TOKEN").then(|| "tok-b".to_owned());
        let (auth, errors) = Authenticator::resolve_each(&policy, &env);
        let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            messages,
            [
                "agents.a: environment variable A_TOKEN is not set",
                "agents.c: environment variable C_TOKEN is not set",
                "operators.o: environment variable O_TOKEN is not set",
            ]
        );
        assert_eq!(auth.len(), 1);
        assert!(auth.identify("tok-b").is_some());
        // `resolve` stops at the first.
        assert_eq!(
            Authenticator::resolve(&policy, &env)
                .unwrap_err()
                .to_string(),
            messages[0]
        );
    }
}
