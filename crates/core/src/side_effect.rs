//! What a request changes at the provider: the `side_effect` of a request class (SPEC §4.2a).
//!
//! Why a class says it, and not the method: an LLM completion is a `POST`, yet it changes
//! nothing at the provider that a second call would duplicate — it only costs tokens. Treated
//! as a write, it would be made durable before every send, a timeout after its send would be
//! escalated as "side effect unknown", and a slow completion would reach a human. A class with
//! `side_effect: none` is carried out like a read instead: recorded off the hot path, retried
//! after a timeout within its budget, never reconciled or escalated for an unknown side effect.
//!
//! Providers whose `dialect` is `openai` or `anthropic` class their completion routes this way
//! when the policy lists no route for them ([`completion_route`]).
//!
//! ```
//! use backstop_core::quota::Dialect;
//! use backstop_core::side_effect::{completion_route, SideEffect};
//!
//! assert_eq!(SideEffect::parse("none"), Some(SideEffect::None));
//! assert!(completion_route(Dialect::Openai, "POST", "/v1/chat/completions").is_some());
//! assert!(completion_route(Dialect::Anthropic, "POST", "/v1/messages").is_some());
//! // OpenAI's Responses API stores the response (`store` defaults to true): a side effect.
//! assert!(completion_route(Dialect::Openai, "POST", "/v1/responses").is_none());
//! assert!(completion_route(Dialect::Generic, "POST", "/v1/chat/completions").is_none());
//! ```

use serde::Serialize;

use crate::quota::Dialect;

/// What a request of a class changes at the provider (`side_effect` of a request class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SideEffect {
    /// Nothing a second call would duplicate (reads, LLM completions): recorded like a read,
    /// retried after a timeout within the budget, never escalated as `side_effect_unknown`.
    None,
    /// The call may change state at the provider (the default of every class but `read` and
    /// `llm_call`): durable before its send, reconciled when its outcome is uncertain.
    #[default]
    Write,
}

/// The accepted values of `side_effect`, for error messages.
pub const SIDE_EFFECTS: [&str; 2] = ["none", "write"];

impl SideEffect {
    /// Reads a policy value: `none` or `write`; `None` for anything else.
    pub fn parse(value: &str) -> Option<SideEffect> {
        match value {
            "none" => Some(SideEffect::None),
            "write" => Some(SideEffect::Write),
            _ => None,
        }
    }

    /// The policy spelling (`none`, `write`).
    pub fn as_str(self) -> &'static str {
        match self {
            SideEffect::None => "none",
            SideEffect::Write => "write",
        }
    }
}

/// The built-in class that [`completion_route`] routes are given.
pub const COMPLETION_CLASS: &str = "llm_call";

/// The completion routes of each dialect, with why each has no side effect to protect. The
/// paths are matched with and without the `/v1` prefix (a provider's `base_url` may hold it).
const COMPLETION_ROUTES: [(Dialect, &str, &str); 7] = [
    (
        Dialect::Openai,
        "/v1/chat/completions",
        "a chat completion creates nothing at the provider (OpenAI API reference: chat completions)",
    ),
    (
        Dialect::Openai,
        "/v1/completions",
        "a legacy completion creates nothing at the provider",
    ),
    (
        Dialect::Openai,
        "/v1/embeddings",
        "an embedding is computed from its input and stored nowhere",
    ),
    (
        Dialect::Openai,
        "/v1/moderations",
        "a moderation classifies its input and stores nothing",
    ),
    (
        Dialect::Anthropic,
        "/v1/messages",
        "a message creates nothing at the provider (Anthropic Messages API)",
    ),
    (
        Dialect::Anthropic,
        "/v1/messages/count_tokens",
        "counting tokens reads its input only",
    ),
    (
        Dialect::Anthropic,
        "/v1/complete",
        "a legacy text completion creates nothing at the provider",
    ),
];

/// The completion routes (`/v1/…` paths, all `POST`) that a provider with `dialect` classes
/// `llm_call` when the policy lists no route for them; empty for the other dialects.
pub fn completion_routes(dialect: Dialect) -> impl Iterator<Item = &'static str> {
    COMPLETION_ROUTES
        .iter()
        .filter(move |(d, _, _)| *d == dialect)
        .map(|(_, route, _)| *route)
}

/// Whether `method path` of a provider with `dialect` is a completion route that has no side
/// effect (SPEC §4.2a), with the reason; `None` for any other route. `path` is the path below
/// the provider's base URL, without a query. OpenAI's `/v1/responses` and `/v1/batches`,
/// Assistants threads and file uploads are not listed: they store state at the provider.
pub fn completion_route(dialect: Dialect, method: &str, path: &str) -> Option<&'static str> {
    if !method.eq_ignore_ascii_case("POST") {
        return None;
    }
    let path = path.trim_end_matches('/');
    COMPLETION_ROUTES
        .iter()
        .find(|(d, route, _)| {
            *d == dialect && (path == *route || Some(path) == route.strip_prefix("/v1"))
        })
        .map(|(_, _, why)| *why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_routes_match_with_and_without_the_v1_prefix() {
        for path in [
            "/v1/chat/completions",
            "/chat/completions",
            "/v1/chat/completions/",
        ] {
            assert!(
                completion_route(Dialect::Openai, "POST", path).is_some(),
                "{path}"
            );
        }
        assert!(completion_route(Dialect::Openai, "GET", "/v1/chat/completions").is_none());
        assert!(completion_route(Dialect::Anthropic, "POST", "/v1/chat/completions").is_none());
        assert!(completion_route(Dialect::Openai, "POST", "/v2/chat/completions").is_none());
        assert!(completion_route(Dialect::Openai, "POST", "/v1/files").is_none());
    }

    #[test]
    fn side_effect_values_round_trip() {
        for value in SIDE_EFFECTS {
            assert_eq!(SideEffect::parse(value).unwrap().as_str(), value);
        }
        assert_eq!(SideEffect::parse("None"), None);
    }
}
