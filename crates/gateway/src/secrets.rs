//! Provider credentials and agent tokens, read once at start from where the policy points.
//!
//! Why read at start: a missing environment variable is a configuration error, and
//! `backstop serve` should refuse to start naming it, not fail the first agent call an hour
//! later. The policy only ever names *where* a secret is (`secret_env`, `secret_file`,
//! `token_env`, `token_file`); the values live in [`Secret`], whose `Debug` never shows them, and
//! provider credentials become header values marked sensitive (so HTTP/2 HPACK never indexes
//! them). Agent tokens are not kept at all: [`crate::auth`] keeps their SHA-256 digests.
//!
//! A file's content is used without its trailing newline (`echo "sk-…" > file` works).
//!
//! Environment variables and files differ in one way: a missing environment variable stops the
//! start (it is part of how the process was launched), while a secret *file* that cannot be read
//! (not mounted on this host) only makes its owner unavailable — the agent cannot authenticate,
//! the provider's calls are refused with `credential_unavailable` before anything is sent — and
//! is reported as a warning at start, naming the file. A policy that lists secrets for several
//! deployments thus starts wherever its environment is complete.

use std::{collections::BTreeMap, path::PathBuf};

use backstop_core::policy::{Credential, Policy, SecretRef, TokenRef};
use http::{HeaderName, HeaderValue};

/// A secret value. `Debug` prints `Secret(<redacted>)`; there is no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value (tests and the resolvers below).
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value. Callers must not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A secret could not be resolved. Each variant names the policy place (e.g.
/// `providers.billing-api.credential`) and where it looked; none carries the value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The environment variable is not set (or not valid UTF-8).
    #[error("{place}: environment variable {var} is not set")]
    MissingEnv {
        /// Policy place.
        place: String,
        /// The variable's name.
        var: String,
    },
    /// The secret's source is empty.
    #[error("{place}: {source_name} is empty")]
    Empty {
        /// Policy place.
        place: String,
        /// `environment variable NAME` or `file PATH`.
        source_name: String,
    },
    /// The file cannot be read.
    #[error("{place}: cannot read secret file {}: {source}", path.display())]
    ReadFile {
        /// Policy place.
        place: String,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The value cannot be sent as an HTTP header (control characters, or the header name is
    /// invalid).
    #[error("{place}: {reason}")]
    InvalidHeader {
        /// Policy place.
        place: String,
        /// Why (never the value).
        reason: String,
    },
    /// Two agents or operators have one token (read at start, or a `token_sha256` equal to a
    /// token read at start): a caller presenting it could be either, so neither is used.
    #[error("{place}: has the same token as {first}, so a caller presenting it could be either; give each agent and operator its own token")]
    SharedToken {
        /// Policy place of the later entry (`agents.NAME` or `operators.NAME`).
        place: String,
        /// Policy place of the earlier entry with the same token.
        first: String,
    },
    /// A `token_sha256` is not 64 hex digits.
    #[error("{place}: token_sha256 must be 64 hex digits")]
    BadDigest {
        /// Policy place.
        place: String,
    },
}

/// How to look up an environment variable (`std::env::var` in production; a map in tests).
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment as an [`EnvLookup`].
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Reads a provider secret from its reference.
///
/// # Errors
/// [`SecretError::MissingEnv`], [`SecretError::ReadFile`] or [`SecretError::Empty`], naming
/// `place`.
pub fn read_secret(
    place: &str,
    source: &SecretRef,
    env: EnvLookup<'_>,
) -> Result<Secret, SecretError> {
    match source {
        SecretRef::Env(var) => read_env(place, var, env),
        SecretRef::File(path) => read_file(place, path),
    }
}

/// Reads an agent or operator token from its reference; `Ok(None)` for `token_sha256` (there is
/// nothing to read).
///
/// # Errors
/// As [`read_secret`].
pub fn read_token(
    place: &str,
    source: &TokenRef,
    env: EnvLookup<'_>,
) -> Result<Option<Secret>, SecretError> {
    match source {
        TokenRef::Env(var) => read_env(place, var, env).map(Some),
        TokenRef::File(path) => read_file(place, path).map(Some),
        TokenRef::Sha256(_) => Ok(None),
    }
}

fn read_env(place: &str, var: &str, env: EnvLookup<'_>) -> Result<Secret, SecretError> {
    let value = env(var).ok_or_else(|| SecretError::MissingEnv {
        place: place.to_owned(),
        var: var.to_owned(),
    })?;
    non_empty(place, format!("environment variable {var}"), value)
}

fn read_file(place: &str, path: &std::path::Path) -> Result<Secret, SecretError> {
    let value = std::fs::read_to_string(path).map_err(|source| SecretError::ReadFile {
        place: place.to_owned(),
        path: path.to_owned(),
        source,
    })?;
    non_empty(place, format!("file {}", path.display()), value)
}

fn non_empty(place: &str, source_name: String, value: String) -> Result<Secret, SecretError> {
    let trimmed = value.trim_end_matches(['\n', '\r']);
    if trimmed.trim().is_empty() {
        return Err(SecretError::Empty {
            place: place.to_owned(),
            source_name,
        });
    }
    Ok(Secret(trimmed.to_owned()))
}

/// The header one provider's credential travels in: name and (sensitive) value, e.g.
/// `authorization: Bearer sk-…` or `x-api-key: …`.
#[derive(Clone)]
pub struct CredentialHeader {
    /// Header name (from the policy's `credential.header`, default `Authorization`).
    pub name: HeaderName,
    /// `scheme + " " + secret`, or the bare secret when the scheme is empty; marked sensitive.
    pub value: HeaderValue,
}

impl std::fmt::Debug for CredentialHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CredentialHeader({}: <redacted>)", self.name)
    }
}

/// Every provider's credential header, resolved at start.
#[derive(Debug, Default)]
pub struct ProviderCredentials {
    by_provider: BTreeMap<String, CredentialHeader>,
    unavailable: BTreeMap<String, SecretError>,
}

impl ProviderCredentials {
    /// Resolves the credential of every provider that has one. A `secret_file` that cannot be
    /// read makes that provider unavailable ([`ProviderCredentials::unavailable`]) instead of
    /// failing.
    ///
    /// # Errors
    /// The first [`SecretError`] in provider order, naming `providers.NAME.credential`: a
    /// missing environment variable, an empty secret, a value or header name HTTP cannot carry.
    /// [`ProviderCredentials::resolve_each`] reports all of them.
    pub fn resolve(
        policy: &Policy,
        env: EnvLookup<'_>,
    ) -> Result<ProviderCredentials, SecretError> {
        let (credentials, errors) = ProviderCredentials::resolve_each(policy, env);
        match errors.into_iter().next() {
            Some(first) => Err(first),
            None => Ok(credentials),
        }
    }

    /// As [`ProviderCredentials::resolve`], but every provider is tried, so that `backstop
    /// serve` can name every missing secret at once instead of one per start: the credentials
    /// that resolved (with the unreadable `secret_file`s under
    /// [`ProviderCredentials::unavailable`]) and every other [`SecretError`], in provider order,
    /// each naming `providers.NAME.credential` (empty when all resolved).
    pub fn resolve_each(
        policy: &Policy,
        env: EnvLookup<'_>,
    ) -> (ProviderCredentials, Vec<SecretError>) {
        let mut by_provider = BTreeMap::new();
        let mut unavailable = BTreeMap::new();
        let mut errors = Vec::new();
        for (name, provider) in &policy.providers {
            let Some(credential) = &provider.credential else {
                continue;
            };
            match credential_header(name, credential, env) {
                Ok(header) => {
                    by_provider.insert(name.clone(), header);
                }
                Err(error @ SecretError::ReadFile { .. }) => {
                    unavailable.insert(name.clone(), error);
                }
                Err(error) => errors.push(error),
            }
        }
        (
            ProviderCredentials {
                by_provider,
                unavailable,
            },
            errors,
        )
    }

    /// The credential header of `provider`, if it has one.
    pub fn get(&self, provider: &str) -> Option<&CredentialHeader> {
        self.by_provider.get(provider)
    }

    /// Providers whose `secret_file` could not be read at start, with the reason.
    pub fn unavailable(&self) -> &BTreeMap<String, SecretError> {
        &self.unavailable
    }

    /// Every credential's text as it could appear in free text: the whole header value
    /// (`Bearer sk-…`) and, for a value with a scheme, the secret after it. For scrubbing
    /// (see [`crate::scrub`]); never logged.
    pub fn secret_values(&self) -> impl Iterator<Item = &str> {
        self.by_provider.values().flat_map(|header| {
            let whole = header.value.to_str().unwrap_or("");
            let after_scheme = whole.split_once(' ').map(|(_, secret)| secret.trim());
            std::iter::once(whole).chain(after_scheme)
        })
    }

    /// Credentials for tests and embedding: `provider`'s credential sent as `header: value`.
    ///
    /// # Panics
    /// When `header` is not a header name or `value` not a header value.
    pub fn with_secret(provider: &str, header: &str, value: &str) -> ProviderCredentials {
        let mut value = HeaderValue::from_str(value).expect("a header value");
        value.set_sensitive(true);
        let header = CredentialHeader {
            name: HeaderName::from_bytes(header.as_bytes()).expect("a header name"),
            value,
        };
        ProviderCredentials {
            by_provider: BTreeMap::from([(provider.to_owned(), header)]),
            unavailable: BTreeMap::new(),
        }
    }
}

/// One provider's credential header, from its `credential` section.
fn credential_header(
    name: &str,
    credential: &Credential,
    env: EnvLookup<'_>,
) -> Result<CredentialHeader, SecretError> {
    let place = format!("providers.{name}.credential");
    let secret = read_secret(&place, &credential.secret, env)?;
    let header = HeaderName::try_from(credential.header.as_str()).map_err(|_| {
        SecretError::InvalidHeader {
            place: place.clone(),
            reason: format!("`{}` is not a valid header name", credential.header),
        }
    })?;
    let text = if credential.scheme.is_empty() {
        secret.expose().to_owned()
    } else {
        format!("{} {}", credential.scheme, secret.expose())
    };
    let mut value = HeaderValue::try_from(text).map_err(|_| SecretError::InvalidHeader {
        place,
        reason: "the secret contains characters not allowed in an HTTP header".into(),
    })?;
    value.set_sensitive(true);
    Ok(CredentialHeader {
        name: header,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> Policy {
        let src = format!("providers:\n  billing:\n    base_url: http://127.0.0.1:9\n{extra}");
        Policy::from_yaml_str(&src, "p.yaml").unwrap()
    }

    #[test]
    fn env_credential_becomes_a_sensitive_header() {
        let p = policy("    credential: { secret_env: BILL_KEY }\n");
        let env = |name: &str| (name == "BILL_KEY").then(|| "sk-123".to_owned());
        let creds = ProviderCredentials::resolve(&p, &env).unwrap();
        let header = creds.get("billing").unwrap();
        assert_eq!(header.name, "authorization");
        assert_eq!(header.value, "Bearer sk-123");
        assert!(header.value.is_sensitive());
        assert!(!format!("{creds:?}").contains("sk-123"));
    }

    #[test]
    fn missing_env_names_the_variable_and_place() {
        let p = policy("    credential: { secret_env: BILL_KEY }\n");
        let err = ProviderCredentials::resolve(&p, &|_| None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "providers.billing.credential: environment variable BILL_KEY is not set"
        );
    }

    #[test]
    fn file_credential_drops_the_trailing_newline_and_bare_scheme() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "k-9\n").unwrap();
        let p = policy(&format!(
            "    credential: {{ secret_file: {}, header: x-api-key, scheme: \"\" }}\n",
            path.display()
        ));
        let creds = ProviderCredentials::resolve(&p, &|_| None).unwrap();
        let header = creds.get("billing").unwrap();
        assert_eq!(header.name, "x-api-key");
        assert_eq!(header.value, "k-9");
    }

    #[test]
    fn unreadable_files_make_the_provider_unavailable_and_empty_secrets_fail() {
        let p = policy("    credential: { secret_file: /nonexistent/backstop-key }\n");
        let creds = ProviderCredentials::resolve(&p, &|_| None).unwrap();
        assert!(creds.get("billing").is_none());
        assert!(creds.unavailable()["billing"].to_string().starts_with(
            "providers.billing.credential: cannot read secret file /nonexistent/backstop-key"
        ));
        let p = policy("    credential: { secret_env: K }\n");
        let err = ProviderCredentials::resolve(&p, &|_| Some("\n".into())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "providers.billing.credential: environment variable K is empty"
        );
    }

    #[test]
    fn control_characters_are_refused_without_echo() {
        let p = policy("    credential: { secret_env: K }\n");
        let err = ProviderCredentials::resolve(&p, &|_| Some("sk\u{7}x".into())).unwrap_err();
        assert!(!err.to_string().contains("sk"));
    }

    #[test]
    fn resolve_each_names_every_missing_secret_and_keeps_unreadable_files_apart() {
        let src = "providers:\n  a:\n    base_url: http://127.0.0.1:9\n    credential: { secret_env: A_KEY }\n  b:\n    base_url: http://127.0.0.1:9\n    credential: { secret_file: /nonexistent/backstop-key }\n  c:\n    base_url: http://127.0.0.1:9\n    credential: { secret_env: C_KEY }\n  d:\n    base_url: http://127.0.0.1:9\n    credential: { secret_env: D_KEY }\n";
        let p = Policy::from_yaml_str(src, "p.yaml").unwrap();
        let env = |name: &str| (name == "D_KEY").then(|| "sk-d".to_owned());
        let (creds, errors) = ProviderCredentials::resolve_each(&p, &env);
        let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            messages,
            [
                "providers.a.credential: environment variable A_KEY is not set",
                "providers.c.credential: environment variable C_KEY is not set",
            ]
        );
        assert!(creds.unavailable().contains_key("b"));
        assert_eq!(creds.get("d").unwrap().value, "Bearer sk-d");
    }
}
