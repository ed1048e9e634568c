//! Free text scrubbed of the secrets the gateway itself holds.
//!
//! Why: an operator's decision note or an agent's `desired_outcome` is kept with the action and
//! served back (`GET /v1/escalations/{id}`, case files). [`sanitize_text`] masks what looks like
//! a secret (bearer tokens, `sk-…` keys, PEM blocks); this masks what IS one — a provider
//! credential, an agent's or an operator's token — whatever it looks like. Provider credentials
//! are held in clear and found as substrings; caller tokens are held only as SHA-256 digests, so
//! every word of the text is looked up by its digest ([`Authenticator::identify`]).
//!
//! [`sanitize_text`]: backstop_core::escalation::sanitize_text

use std::sync::Arc;

use crate::{auth::Authenticator, secrets::ProviderCredentials};

/// What replaces a secret the gateway holds.
pub const HELD_SECRET: &str = "[redacted: a credential backstop holds]";

/// Characters that end a word when looking for caller tokens: whitespace and the punctuation
/// that quotes or joins a token in prose (`token="…"`, `key: …`, `(…)`).
fn is_separator(c: char) -> bool {
    c.is_whitespace() || "\"'`,;:=()[]{}<>".contains(c)
}

/// The shortest secret looked for as a substring (shorter values would mask ordinary words).
const MIN_SECRET_CHARS: usize = 6;

/// The secrets the gateway holds, to scrub free text of: the caller tokens `auth` knows (by
/// digest) and every provider credential's text.
#[derive(Clone, Default)]
pub struct HeldSecrets {
    auth: Arc<Authenticator>,
    credentials: Vec<String>,
}

impl std::fmt::Debug for HeldSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HeldSecrets({} callers, {} credential texts)",
            self.auth.len(),
            self.credentials.len()
        )
    }
}

impl HeldSecrets {
    /// The tokens of `auth` and the credentials of `credentials` (their text copied once).
    pub fn new(auth: Arc<Authenticator>, credentials: &ProviderCredentials) -> HeldSecrets {
        let credentials = credentials
            .secret_values()
            .filter(|s| s.chars().count() >= MIN_SECRET_CHARS)
            .map(str::to_owned)
            .collect();
        HeldSecrets { auth, credentials }
    }

    /// `text` sanitized with [`backstop_core::escalation::sanitize_text`], then with every held
    /// provider credential (the whole header value and the secret after its scheme) and every
    /// caller token replaced by [`HELD_SECRET`].
    pub fn scrub(&self, text: &str) -> String {
        self.replace_held(&backstop_core::escalation::sanitize_text(text).text)
    }

    /// Whether `text` contains a secret the gateway holds (what [`HeldSecrets::scrub`]
    /// replaces): a request carrying one is never kept at rest.
    pub fn holds(&self, text: &str) -> bool {
        self.replace_held(text) != text
    }

    /// `text` with every held secret replaced by [`HELD_SECRET`] (nothing else changed).
    fn replace_held(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for secret in &self.credentials {
            out = out.replace(secret.as_str(), HELD_SECRET);
        }
        let mut scrubbed = String::with_capacity(out.len());
        let mut word = String::new();
        for c in out.chars() {
            if is_separator(c) {
                self.flush(&mut word, &mut scrubbed);
                scrubbed.push(c);
            } else {
                word.push(c);
            }
        }
        self.flush(&mut word, &mut scrubbed);
        self.tokens_inside_words(&scrubbed)
    }

    /// `text` with every caller token found inside a longer word (`x_TOKEN`, `TOKEN.`,
    /// `/TOKEN/`) replaced by [`HELD_SECRET`]: every window of a known token length is looked up
    /// by its digest (the lengths of the tokens read at start; a `token_sha256` one is found
    /// only as a whole word).
    fn tokens_inside_words(&self, text: &str) -> String {
        let bounds: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain(std::iter::once(text.len()))
            .collect();
        let chars = bounds.len() - 1;
        let mut found: Vec<(usize, usize)> = Vec::new();
        for len in self.auth.token_lengths().filter(|&l| l > 0 && l <= chars) {
            for start in 0..=chars - len {
                let (from, to) = (bounds[start], bounds[start + len]);
                if self.auth.identify(&text[from..to]).is_some() {
                    found.push((from, to));
                }
            }
        }
        if found.is_empty() {
            return text.to_owned();
        }
        found.sort_unstable();
        let mut out = String::with_capacity(text.len());
        let mut at = 0;
        for (from, to) in found {
            if to <= at {
                continue;
            }
            out.push_str(&text[at..from.max(at)]);
            out.push_str(HELD_SECRET);
            at = to;
        }
        out.push_str(&text[at..]);
        out
    }

    /// Appends `word` to `out`, or [`HELD_SECRET`] when it is a caller's token; empties `word`.
    fn flush(&self, word: &mut String, out: &mut String) {
        if !word.is_empty() && self.auth.identify(word).is_some() {
            out.push_str(HELD_SECRET);
        } else {
            out.push_str(word);
        }
        word.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Role;

    #[test]
    fn caller_tokens_and_provider_credentials_are_masked_whatever_they_look_like() {
        let auth = Authenticator::default()
            .with_token("ops", Role::Operator, "plainword-operator-77")
            .with_token("agent", Role::Agent, "agent.token.31");
        let credentials = ProviderCredentials::with_secret("fake", "x-api-key", "opaque42value");
        let held = HeldSecrets::new(Arc::new(auth), &credentials);
        let note = "provider key is opaque42value; mine is plainword-operator-77 and the agent's (agent.token.31)";
        let scrubbed = held.scrub(note);
        for secret in ["opaque42value", "plainword-operator-77", "agent.token.31"] {
            assert!(!scrubbed.contains(secret), "{scrubbed}");
        }
        assert_eq!(scrubbed.matches(HELD_SECRET).count(), 3, "{scrubbed}");
        assert!(scrubbed.starts_with("provider key is "), "{scrubbed}");
        // Inside longer words too.
        for smuggled in [
            "x_agent.token.31",
            "agent.token.31.",
            "/plainword-operator-77/",
            "*plainword-operator-77*",
            "xxagent.token.31yy",
            "me@agent.token.31@host",
        ] {
            let scrubbed = held.scrub(smuggled);
            assert!(
                !scrubbed.contains("agent.token.31") && !scrubbed.contains("plainword-operator-77"),
                "{smuggled} → {scrubbed}"
            );
        }
        // Ordinary words stay.
        let plain = held.scrub("retry tomorrow after the reset");
        assert_eq!(plain, "retry tomorrow after the reset");
    }
}
