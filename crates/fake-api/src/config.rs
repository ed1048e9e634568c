//! What the fake provider does, as data: quotas, routes, scripted faults.
//!
//! A [`FakeConfig`] is written in YAML (see `examples/fake-api.yaml`) or built in Rust with the
//! constructors below. It is checked once, at start ([`FakeConfig::validate`]); a bad file is
//! refused with the place (`routes[2].quotas[0]`) and the reason, never half-applied.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Error;

/// The whole behaviour of one fake provider.
///
/// Everything random (resource ids, `probability` faults) is drawn from one generator seeded
/// with [`FakeConfig::seed`], so the same config and the same sequence of requests give the same
/// answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeConfig {
    /// Seed of the pseudo-random generator (ids and probabilistic faults). Default 0.
    #[serde(default)]
    pub seed: u64,
    /// Request header that carries the idempotency key (IETF `Idempotency-Key` draft). Default
    /// `Idempotency-Key`.
    #[serde(default = "default_idempotency_header")]
    pub idempotency_header: String,
    /// Status answered when an idempotency key is reused with a different request: 422 (IETF
    /// draft, default) or 409.
    #[serde(default = "default_idempotency_conflict_status")]
    pub idempotency_conflict_status: u16,
    /// Request header holding the credential. Only its presence and a SHA-256 prefix are ever
    /// recorded; it keys quotas whose scope is `credential`. Default `Authorization`.
    #[serde(default = "default_auth_header")]
    pub auth_header: String,
    /// Named quotas that routes refer to.
    #[serde(default)]
    pub quotas: Vec<QuotaConfig>,
    /// Routes, matched in order; the first whose method and path pattern match wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
}

fn default_idempotency_header() -> String {
    "Idempotency-Key".to_owned()
}
fn default_idempotency_conflict_status() -> u16 {
    422
}
fn default_auth_header() -> String {
    "Authorization".to_owned()
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            seed: 0,
            idempotency_header: default_idempotency_header(),
            idempotency_conflict_status: default_idempotency_conflict_status(),
            auth_header: default_auth_header(),
            quotas: Vec::new(),
            routes: Vec::new(),
        }
    }
}

/// Which requests share one quota counter.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKey {
    /// One counter for the whole account: every request counts against it.
    #[default]
    Account,
    /// One counter per distinct value of the credential header ([`FakeConfig::auth_header`]);
    /// requests without it share the `anonymous` counter.
    Credential,
}

/// How a 429 states when to come back (RFC 9110 §10.2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryAfterForm {
    /// `Retry-After: N`, whole seconds, rounded up so it is never earlier than the truth.
    #[default]
    Seconds,
    /// `Retry-After: <IMF-fixdate>` with the response's `Date` header; `Retry-After − Date` is
    /// never shorter than the real remaining time.
    HttpDate,
    /// No `Retry-After` at all (the provider gives no usable signal).
    None,
}

/// The quota header dialect written on every response of a route with a quota (SPEC §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// IETF draft: `RateLimit: "name";r=R;t=S` and `RateLimit-Policy: "name";q=L;w=W`.
    #[default]
    Ietf,
    /// OpenAI: `x-ratelimit-{limit,remaining,reset}-requests`, reset as a Go duration (`6m0s`).
    Openai,
    /// Anthropic: `anthropic-ratelimit-requests-{limit,remaining,reset}`, reset as RFC 3339.
    Anthropic,
    /// GitHub: `x-ratelimit-{limit,remaining,used,reset,resource}`, reset in epoch seconds.
    Github,
    /// No quota headers.
    None,
}

/// A fixed window: at most `limit` requests per `window_ms`, the window starting at the first
/// request after the previous one ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixedWindow {
    /// Requests allowed per window (≥ 1).
    pub limit: u32,
    /// Window length in milliseconds (≥ 1).
    pub window_ms: u64,
}

/// A token bucket: `burst` tokens, refilled at `rate_per_second`; a request takes one token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucket {
    /// Refill rate in tokens (requests) per second (finite, > 0).
    pub rate_per_second: f64,
    /// Bucket capacity in tokens (≥ 1); the bucket starts full.
    pub burst: u32,
}

/// One named quota. Exactly one of `fixed_window` and `token_bucket` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// Name used by routes and as the IETF policy name; letters, digits, `_ - . :` only.
    pub name: String,
    /// Which requests share a counter.
    #[serde(default)]
    pub scope: ScopeKey,
    /// Fixed-window limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed_window: Option<FixedWindow>,
    /// Token-bucket limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_bucket: Option<TokenBucket>,
    /// Form of `Retry-After` on the exceeded answer.
    #[serde(default)]
    pub retry_after: RetryAfterForm,
    /// Quota header dialect.
    #[serde(default)]
    pub dialect: Dialect,
    /// Status of the exceeded answer: 429 (default) or e.g. 403 as GitHub sends.
    #[serde(default = "default_exceeded_status")]
    pub exceeded_status: u16,
    /// GitHub `x-ratelimit-resource` value; defaults to the quota name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
}

fn default_exceeded_status() -> u16 {
    429
}

impl QuotaConfig {
    /// A fixed-window quota of `limit` requests per `window_ms` milliseconds, account-wide,
    /// `Retry-After` in seconds, IETF headers.
    pub fn fixed_window(name: &str, limit: u32, window_ms: u64) -> Self {
        QuotaConfig {
            name: name.to_owned(),
            scope: ScopeKey::Account,
            fixed_window: Some(FixedWindow { limit, window_ms }),
            token_bucket: None,
            retry_after: RetryAfterForm::Seconds,
            dialect: Dialect::Ietf,
            exceeded_status: default_exceeded_status(),
            resource: None,
        }
    }

    /// A token-bucket quota (`rate_per_second`, `burst`), account-wide, `Retry-After` in
    /// seconds, IETF headers.
    pub fn token_bucket(name: &str, rate_per_second: f64, burst: u32) -> Self {
        QuotaConfig {
            fixed_window: None,
            token_bucket: Some(TokenBucket {
                rate_per_second,
                burst,
            }),
            ..QuotaConfig::fixed_window(name, 1, 1)
        }
    }

    /// Sets the header dialect.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }

    /// Sets the `Retry-After` form.
    pub fn with_retry_after(mut self, form: RetryAfterForm) -> Self {
        self.retry_after = form;
        self
    }

    /// Sets the scope key.
    pub fn with_scope(mut self, scope: ScopeKey) -> Self {
        self.scope = scope;
        self
    }
}

/// What a route does when no fault is scripted for the call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Handler {
    /// A fixed answer. Without `body`: `{"ok":true,"route":"GET /v1/items/{id}","params":{"id":"7"}}`.
    Respond {
        /// Status code (default 200).
        #[serde(default = "default_ok")]
        status: u16,
        /// JSON body.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        body: Option<Value>,
    },
    /// The benchmark fast path: `200 {"ok":true}`, no quota, no faults, no idempotency; only
    /// the attempt is recorded.
    Fast,
    /// Creates a resource from a JSON object body: answers `201` with the body's fields plus
    /// `"id": "<id_prefix><16 hex>"`.
    Create {
        /// Collection name (shared with `lookup`/`get` routes).
        collection: String,
        /// Id prefix, e.g. `tr_`.
        #[serde(default)]
        id_prefix: String,
        /// Body field holding the client's external reference, e.g. `reference`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reference_field: Option<String>,
        /// Refuse a second object with the same reference (409 `duplicate_reference`).
        #[serde(default)]
        unique_reference: bool,
    },
    /// Lists a collection: `?idempotency_key=K` or `?reference=R` filter; answers `200
    /// {"object":"list","data":[…]}` (an empty `data` when nothing matches).
    Lookup {
        /// Collection name.
        collection: String,
    },
    /// Reads one object by the path parameter `id_param` (default `id`): `200` with the object
    /// or `404 {"error":{"code":"resource_missing",…}}`.
    Get {
        /// Collection name.
        collection: String,
        /// Path parameter holding the id.
        #[serde(default = "default_id_param")]
        id_param: String,
    },
    /// Server-sent events: `events` chunks spaced by `interval_ms` (query `n` and
    /// `interval_ms` override), each `data: {json}\n\n`, then `data: [DONE]\n\n`. A POST whose
    /// JSON body has `"stream": false` gets one JSON completion instead.
    Stream {
        /// Number of data events before `[DONE]` (default 5, at most 10,000).
        #[serde(default = "default_events")]
        events: u32,
        /// Milliseconds between events (default 100, at most 60,000).
        #[serde(default = "default_interval_ms")]
        interval_ms: u64,
    },
    /// An LLM completion in the shape an official SDK parses, for a POST with a JSON object
    /// body. As the real APIs do, it streams only when the body says `"stream": true`; any other
    /// body gets one JSON answer. The text is `token-0 token-1 …` (`events` tokens), `model`
    /// echoes the body's (default `fake-model`), `usage` counts `events` output tokens and one
    /// input token per 4 body bytes.
    ///
    /// - `api: openai` (`POST /v1/chat/completions`): a `chat.completion` object with
    ///   `choices[0].message.content`; streamed, one `chat.completion.chunk` per token
    ///   (`choices[0].delta.content`), then a chunk with `finish_reason: "stop"` and
    ///   `data: [DONE]`.
    /// - `api: anthropic` (`POST /v1/messages`): a `message` object with `content[0].text`;
    ///   streamed, the messages streaming protocol (`event:` and `data:` lines):
    ///   `message_start`, `content_block_start`, one `content_block_delta` per token,
    ///   `content_block_stop`, `message_delta`, `message_stop`.
    ///
    /// Streamed tokens are spaced by `interval_ms`; the opening events go with the first
    /// token, the closing ones `interval_ms` after the last.
    ///
    /// ```yaml
    /// - route: POST /v1/chat/completions
    ///   handler: { kind: completion, api: openai, events: 3, interval_ms: 20 }
    /// ```
    Completion {
        /// Which API's shapes (default `openai`).
        #[serde(default)]
        api: CompletionApi,
        /// Number of output tokens (default 5, at most 10,000).
        #[serde(default = "default_events")]
        events: u32,
        /// Milliseconds between streamed tokens (default 100, at most 60,000).
        #[serde(default = "default_interval_ms")]
        interval_ms: u64,
    },
}

/// The API whose answer shapes a [`Handler::Completion`] plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompletionApi {
    /// OpenAI chat completions (`chat.completion`, `chat.completion.chunk`, `data: [DONE]`).
    #[default]
    Openai,
    /// Anthropic messages (`message`, the `event:`-named streaming protocol).
    Anthropic,
}

fn default_ok() -> u16 {
    200
}
fn default_id_param() -> String {
    "id".to_owned()
}
fn default_events() -> u32 {
    5
}
fn default_interval_ms() -> u64 {
    100
}

impl Default for Handler {
    fn default() -> Self {
        Handler::Respond {
            status: 200,
            body: None,
        }
    }
}

/// A scripted misbehaviour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Answer normally (useful in a `script`).
    Pass,
    /// Answer `status` (e.g. 503, 500, 429) without doing the work.
    Status {
        /// Status code.
        status: u16,
        /// Raw `Retry-After` value to send, verbatim (may be deliberately invalid).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after: Option<String>,
        /// JSON body; default `{"error":{"code":"scripted_fault","message":…}}`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        body: Option<Value>,
    },
    /// A provider error code in the body, e.g. OpenAI's
    /// `429 {"error":{"code":"insufficient_quota","type":"insufficient_quota","message":…}}`.
    ErrorCode {
        /// Status code (default 429).
        #[serde(default = "default_exceeded_status")]
        status: u16,
        /// The `error.code` (and `error.type`) value.
        code: String,
        /// The `error.message` value.
        #[serde(default)]
        message: String,
    },
    /// Hold the connection without answering for `hold_ms`, then close it. Nothing is done.
    Timeout {
        /// Milliseconds to hold.
        hold_ms: u64,
    },
    /// A slow answer: do the work at once (quota, idempotency record, store, as a normal call),
    /// hold for `hold_ms`, then send the answer the call would have got — a completion that
    /// takes longer than the client's or the gateway's patience. A client that leaves during
    /// the hold finds the work done all the same (the attempt ends `timeout`, no status).
    ///
    /// ```yaml
    /// script: [ { kind: slow, hold_ms: 2000 } ]   # call 1 answers after 2 s, later ones at once
    /// ```
    Slow {
        /// Milliseconds to hold before answering.
        hold_ms: u64,
    },
    /// Close the connection at once without answering. Nothing is done.
    Drop,
    /// Do the work (quota, idempotency record, store) and commit it, optionally hold for
    /// `hold_ms`, then close the connection without sending any response byte. When the quota
    /// refuses the call, nothing is committed and the connection is still dropped.
    StoreThenDrop {
        /// Milliseconds to hold after committing (default 0).
        #[serde(default)]
        hold_ms: u64,
    },
}

/// When a [`Fault`] applies. Exactly one trigger field is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRule {
    /// 1-based call numbers of this route (every attempt counts, faulted or not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_calls: Vec<u64>,
    /// Every n-th call (n, 2n, 3n, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_nth: Option<u64>,
    /// Each call with this probability in `[0, 1]`, drawn from the seeded generator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probability: Option<f64>,
    /// What happens.
    pub fault: Fault,
}

impl FaultRule {
    /// `fault` on the given 1-based call numbers.
    pub fn on_calls(calls: impl IntoIterator<Item = u64>, fault: Fault) -> Self {
        FaultRule {
            on_calls: calls.into_iter().collect(),
            every_nth: None,
            probability: None,
            fault,
        }
    }

    /// `fault` with probability `p` per call.
    pub fn with_probability(p: f64, fault: Fault) -> Self {
        FaultRule {
            on_calls: Vec::new(),
            every_nth: None,
            probability: Some(p),
            fault,
        }
    }
}

/// One route: `METHOD /path/{param}`, its handler, quotas, idempotency and faults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `METHOD /path` with `{name}` segments, e.g. `GET /v1/transfers/{id}`.
    pub route: String,
    /// What the route does.
    #[serde(default)]
    pub handler: Handler,
    /// Names of quotas charged by every call (all must allow; headers come from the first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<String>,
    /// Honour the idempotency header: replay the stored answer for a repeated key.
    #[serde(default)]
    pub idempotency: bool,
    /// Responses in call order: call i (1-based) gets `script[i-1]`; calls past the end are
    /// answered normally. Checked before `faults`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub script: Vec<Fault>,
    /// Fault rules, the first matching one applies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<FaultRule>,
}

impl RouteConfig {
    /// A route with the given pattern and handler, no quota, no faults.
    pub fn new(route: &str, handler: Handler) -> Self {
        RouteConfig {
            route: route.to_owned(),
            handler,
            quotas: Vec::new(),
            idempotency: false,
            script: Vec::new(),
            faults: Vec::new(),
        }
    }

    /// Charges the named quota.
    pub fn with_quota(mut self, name: &str) -> Self {
        self.quotas.push(name.to_owned());
        self
    }

    /// Honours the idempotency header.
    pub fn with_idempotency(mut self) -> Self {
        self.idempotency = true;
        self
    }

    /// Sets the response script.
    pub fn with_script(mut self, script: impl IntoIterator<Item = Fault>) -> Self {
        self.script = script.into_iter().collect();
        self
    }

    /// Adds a fault rule.
    pub fn with_fault(mut self, rule: FaultRule) -> Self {
        self.faults.push(rule);
        self
    }
}

impl FakeConfig {
    /// Parses a YAML config and validates it.
    ///
    /// # Errors
    /// [`Error::Yaml`] (`LINE:COL: message`) for malformed YAML, unknown fields or duplicate keys,
    /// [`Error::Config`] for a semantically invalid config.
    pub fn from_yaml_str(text: &str) -> Result<Self, Error> {
        // YAML 1.2 booleans only (`true`/`false`): a plain `n`, `y`, `no`, `yes`, `on` or `off`
        // stays the string it was written as. A handler is read through serde's buffering of
        // its tagged fields, which would otherwise see `collection: n` as `false` and report
        // the route's line instead of the field.
        let options = serde_saphyr::options! { strict_booleans: true };
        let config: FakeConfig =
            serde_saphyr::from_str_with_options(text, options).map_err(|e| {
                let mut options = serde_saphyr::RenderOptions::new(&YamlMessages);
                options.snippets = serde_saphyr::SnippetMode::Off;
                let message = e.render_with_options(options);
                Error::Yaml(match e.location() {
                    Some(at) => format!("{}:{}: {message}", at.line(), at.column()),
                    None => message,
                })
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses a YAML config file (see [`FakeConfig::from_yaml_str`]).
    ///
    /// # Errors
    /// [`Error::Read`] when the file cannot be read, otherwise as `from_yaml_str`.
    pub fn from_yaml_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        FakeConfig::from_yaml_str(&text).map_err(|e| match e {
            Error::Yaml(msg) if msg.starts_with(|c: char| c.is_ascii_digit()) => {
                Error::Yaml(format!("{}:{msg}", path.display()))
            }
            Error::Yaml(msg) => Error::Yaml(format!("{}: {msg}", path.display())),
            Error::Config { place, reason } => Error::Config {
                place: format!("{} {place}", path.display()),
                reason,
            },
            other => other,
        })
    }

    /// Adds a quota.
    pub fn with_quota(mut self, quota: QuotaConfig) -> Self {
        self.quotas.push(quota);
        self
    }

    /// Adds a route.
    pub fn with_route(mut self, route: RouteConfig) -> Self {
        self.routes.push(route);
        self
    }

    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
}

/// The YAML library's messages without its inline position (reported once, as `LINE:COL`) and
/// without its configuration advice.
struct YamlMessages;

/// Suppresses the YAML library's `at line L, column C` suffixes.
struct NoLocationSuffix;

impl serde_saphyr::Localizer for NoLocationSuffix {
    fn attach_location<'a>(
        &self,
        base: std::borrow::Cow<'a, str>,
        _loc: serde_saphyr::Location,
    ) -> std::borrow::Cow<'a, str> {
        base
    }

    fn alias_used_at(&self, _used: serde_saphyr::Location) -> String {
        String::new()
    }
}

impl serde_saphyr::MessageFormatter for YamlMessages {
    fn localizer(&self) -> &dyn serde_saphyr::Localizer {
        &NoLocationSuffix
    }

    fn format_message<'a>(&self, err: &'a serde_saphyr::Error) -> std::borrow::Cow<'a, str> {
        match err {
            serde_saphyr::Error::DuplicateMappingKey { key: Some(key), .. } => {
                format!("duplicate key `{key}`").into()
            }
            other => serde_saphyr::UserMessageFormatter.format_message(other),
        }
    }
}
