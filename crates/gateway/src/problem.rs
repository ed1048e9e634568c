//! Answers made by backstop itself: RFC 9457 problem details (`application/problem+json`).
//!
//! Why a careful status table: an agent's SDK sits between backstop and the agent, and common SDKs
//! retry on their own (the OpenAI and Anthropic SDKs retry 408, 409, 429 and 5xx; Stripe's
//! retries 409, 429 and 5xx). If backstop answered "budget exhausted" with a 503, the SDK would
//! quietly send the call again — the layered retry backstop exists to prevent (SPEC §4.3, §11).
//! So every final outcome made by backstop uses a status those SDKs do not retry, carries
//! `x-should-retry: false`, and only when a later retry really is safe (the outcome's
//! [`NextSafe::WaitUntil`] names the provider's boundary) does it answer 429 with an honest
//! `Retry-After` and `x-should-retry: true`.
//!
//! | outcome                   | status | when a later retry is safe (`next_safe` has `wait_until`) |
//! |---------------------------|--------|------------------------------------------------------------|
//! | `rejected`                | 400    | never 429                                                  |
//! | `circuit_open`            | 403    | never 429                                                  |
//! | `quota_exhausted`         | 403    | 429 + `Retry-After`                                        |
//! | `conflict`                | 422    | never 429 (409 would be retried by SDKs)                   |
//! | `cancelled`               | 410    | never 429                                                  |
//! | `deadline_exhausted`      | 424    | never 429 (the task's time is over)                        |
//! | `budget_exhausted`        | 424    | 429 + `Retry-After`                                        |
//! | `scope_saturated`         | 424    | 429 + `Retry-After`                                        |
//! | `reconciliation_required` | 424    | never 429 (query the status first)                         |
//! | `escalated`               | 424    | never 429 (a human decides)                                |
//! | `succeeded` (reconciled)  | 200    | — (plain JSON, not a problem)                              |
//!
//! `wait_until` is the provider's boundary, or — when the action was refused before a send
//! because its scopes would have made it wait past its deadline or remaining wait budget (a
//! caller's `Prefer: wait`, the class's `max_wait`) — the instant they would have let it go,
//! local pacing included: a write never sent because pacing asked for 486 ms and the caller
//! allowed `Prefer: wait=0` is `429` + `Retry-After: 1`, not a `424` with only `abort`. Its
//! title says that nothing was sent (no attempt, so no retry budget was spent) rather than that
//! the retry budget is exhausted.
//!
//! **What the 429 promises a write.** The answer says "send this again after `Retry-After`",
//! and SDKs do exactly that, under the same `Idempotency-Key`. So such a finished write (its
//! instant: [`resend_advised_at`]) is not replayed forever: a same-key, same-payload resend
//! before the instant replays the outcome with the `Retry-After` left; from the instant on the
//! action is reopened (audited `action_reopened`) and this request is sent as the same action
//! under the same key. When an attempt of it is unsettled (`uncertain`, no later answer under
//! the same key settling it), the SPEC §6 rule runs first and
//! nothing is sent blindly: a route with a lookup asks the provider (found → `succeeded`,
//! nothing sent); the request is sent under the same key only where the provider honours it;
//! otherwise the write is escalated and nothing is sent. An escalation opened beside a
//! `budget_exhausted`, `deadline_exhausted` or `quota_exhausted` outcome and decided `wait`
//! (from its `retry_not_before`, when it names one), `raise_quota` or `change_plan` reopens the
//! write the same way, once per decision; decided `abort`, the outcome stays, and its replay
//! drops `wait_until` (not 429, `x-should-retry: false`). A `scope_saturated`,
//! `budget_exhausted` or `quota_exhausted` write refused before any attempt, with no
//! `wait_until` (its `424` promises no instant) and no escalation, is backpressure, not an end:
//! a same-key resend reopens it at once. Every other finished outcome —
//! `succeeded`, `rejected`, `conflict`, `cancelled`, `escalated`, … — is replayed as it is.
//!
//! Problems of the door itself (the request never became an action, nothing was sent):
//! missing or unknown agent token → 401; a malformed `X-Backstop-*` or `Prefer` header → 400
//! naming the header; unknown provider → 404; the provider's `secret_file` could not be read at
//! start → 424 `credential_unavailable`; a body over the hard cap → 413; a request body that cannot be read → 400;
//! a request body not received within the read timeout → 408 `request_timeout`; a method a
//! backstop endpoint does not take → 405 `method_not_allowed` (with `Allow`); the
//! gateway is shutting down → 503 with `Retry-After: 1` and `x-should-retry: true` (nothing was
//! sent, so a retry is safe by construction).
//!
//! ```
//! use backstop_core::outcome::{NextSafe, Outcome, OutcomeContext};
//! use backstop_gateway::problem::Problem;
//!
//! let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
//! let at: jiff::Timestamp = "2026-01-01T00:00:30Z".parse().unwrap();
//! let context = OutcomeContext {
//!     sent: true,
//!     attempts: 4,
//!     next_safe: vec![NextSafe::WaitUntil { at }, NextSafe::Abort],
//!     ..OutcomeContext::default()
//! };
//! let problem = Problem::from_outcome(Outcome::BudgetExhausted, &context, "4 attempts used", now);
//! assert_eq!(problem.status.as_u16(), 429);
//! assert_eq!(problem.retry_after_seconds, Some(30));
//! assert!(problem.should_retry);
//!
//! let problem = Problem::from_outcome(Outcome::Rejected, &OutcomeContext::default(), "bad", now);
//! assert_eq!(problem.status.as_u16(), 400);
//! assert!(!problem.should_retry);
//! ```

use axum::{
    body::Body,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use backstop_core::{
    escalation::sanitize_text,
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use jiff::Timestamp;
use serde_json::{json, Map, Value};

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The prefix of every problem `type` URI: `urn:backstop:problem:<name>`, where `<name>` is the
/// outcome (`budget_exhausted`) or the door problem (`unauthorized`).
pub const TYPE_PREFIX: &str = "urn:backstop:problem:";

/// One problem response (RFC 9457): status, the standard members, extension members and the
/// retry headers that go with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The HTTP status (see the module table).
    pub status: StatusCode,
    /// The problem name, the last part of `type` (`budget_exhausted`, `bad_header`, …).
    pub name: String,
    /// A short, fixed summary of the problem type.
    pub title: String,
    /// One human sentence about this occurrence.
    pub detail: String,
    /// Extension members (SPEC §5 context for outcomes; `header` for a bad header, …).
    pub extensions: Map<String, Value>,
    /// `Retry-After` in whole seconds (rounded up), only on a 429 or 503 whose retry is safe.
    pub retry_after_seconds: Option<u64>,
    /// The value of `x-should-retry`.
    pub should_retry: bool,
}

impl Problem {
    fn door(status: StatusCode, name: &str, title: &str, detail: impl Into<String>) -> Problem {
        let mut extensions = Map::new();
        extensions.insert("sent".into(), Value::Bool(false));
        Problem {
            status,
            name: name.to_owned(),
            title: title.to_owned(),
            detail: detail.into(),
            extensions,
            retry_after_seconds: None,
            should_retry: false,
        }
    }

    /// 401: the `Authorization` header is missing, not a bearer token, or names no agent.
    /// `detail` says which, never echoing the token.
    pub fn unauthorized(detail: impl Into<String>) -> Problem {
        Problem::door(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Missing or unknown backstop token",
            detail,
        )
    }

    /// 400: the header `header` is malformed; `reason` says why (the `header` extension member
    /// names it for programs).
    pub fn bad_header(header: &str, reason: impl std::fmt::Display) -> Problem {
        let mut problem = Problem::door(
            StatusCode::BAD_REQUEST,
            "bad_header",
            "Malformed request header",
            format!("header `{header}`: {reason}"),
        );
        problem
            .extensions
            .insert("header".into(), Value::String(header.to_owned()));
        problem
    }

    /// 400: the request itself cannot be turned into an action (unreadable body, bad path).
    pub fn bad_request(detail: impl Into<String>) -> Problem {
        Problem::door(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "The request cannot be forwarded",
            detail,
        )
    }

    /// 404: the policy names no provider `provider`.
    pub fn unknown_provider(provider: &str) -> Problem {
        let mut problem = Problem::door(
            StatusCode::NOT_FOUND,
            "unknown_provider",
            "Unknown provider",
            format!("the policy names no provider `{provider}`"),
        );
        problem
            .extensions
            .insert("provider".into(), Value::String(provider.to_owned()));
        problem
    }

    /// 404: no such backstop endpoint.
    pub fn not_found(path: &str) -> Problem {
        Problem::door(
            StatusCode::NOT_FOUND,
            "not_found",
            "No such endpoint",
            format!("backstop has no endpoint `{path}`; the proxy door is /{{provider}}/{{path}}"),
        )
    }

    /// 424: the provider's credential could not be read at start (its `secret_file` is missing);
    /// nothing was sent. Not retried by SDKs: an operator must provide the file and restart.
    pub fn credential_unavailable(provider: &str) -> Problem {
        let mut problem = Problem::door(
            StatusCode::FAILED_DEPENDENCY,
            "credential_unavailable",
            "Provider credential unavailable",
            format!(
                "the credential of provider `{provider}` could not be read when backstop started; nothing was sent"
            ),
        );
        problem
            .extensions
            .insert("provider".into(), Value::String(provider.to_owned()));
        problem
    }

    /// 409 `idempotency_key_in_flight`: the agent's `Idempotency-Key` names one of its actions
    /// that is still in flight and could not be joined (a layered retry, SPEC §4.3). Nothing was
    /// sent for this request; `x-should-retry: false` (SDKs retry 409, so the header says no).
    pub fn key_in_flight(action_id: i64, key: Option<&str>) -> Problem {
        let mut problem = Problem::door(
            StatusCode::CONFLICT,
            "idempotency_key_in_flight",
            "An action with this Idempotency-Key is in flight",
            format!(
                "action {action_id} with this Idempotency-Key is still in flight; nothing was sent for this request; read GET /v1/actions/{action_id} instead of sending again"
            ),
        );
        problem
            .extensions
            .insert("action_id".into(), json!(action_id));
        if let Some(key) = key {
            problem
                .extensions
                .insert("idempotency_key".into(), Value::String(key.to_owned()));
        }
        problem
    }

    /// 422 `idempotency_key_reused`: the agent already used this `Idempotency-Key` for another
    /// request (IETF Idempotency-Key draft §2.7; SPEC §6: a key binds one provider, method,
    /// route template, concrete target — the path and query sent — and payload). `differs`
    /// names what differs, in the order `provider`, `method`, `route`, `target` (named only
    /// for the same route template), `payload`; `bound` is the `(provider, method, route template)` the key
    /// is bound to. Members: `differs` (array), `bound_to` `{provider, method, route}`, `sent:
    /// false` and `idempotency_key` (the agent's `key`, answered as the `Idempotency-Key` header
    /// too, as on every answer to a write); no action id is named. Nothing was sent;
    /// `x-should-retry: false`.
    pub fn key_reused(differs: &[&str], bound: (&str, &str, &str), key: Option<&str>) -> Problem {
        let (provider, method, route) = bound;
        let (title, what) = match differs {
            ["payload"] => (
                "This Idempotency-Key was already used with a different request body",
                "a different request body".to_owned(),
            ),
            ["target"] => (
                "This Idempotency-Key was already used for a different path or query",
                "a different path or query string (the same route)".to_owned(),
            ),
            _ => (
                "This Idempotency-Key was already used for a different request",
                format!("a different request ({} differs)", differs.join(", ")),
            ),
        };
        let problem = Problem::door(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            title,
            format!(
                "this Idempotency-Key was already used with {what}: it is bound to {method} {route} at provider `{provider}`; nothing was sent; send a different request under a new key, or the original request under this key"
            ),
        )
        .with_extension("differs", json!(differs))
        .with_extension(
            "bound_to",
            json!({"provider": provider, "method": method, "route": route}),
        );
        match key {
            Some(key) => problem.with_extension("idempotency_key", json!(key)),
            None => problem,
        }
    }

    /// 404 `action_not_found` / `task_not_found`: no such action or task *for this caller* (an
    /// agent asking about another agent's work gets the same answer as for a missing one).
    pub fn not_yours(what: &str, id: &str) -> Problem {
        Problem::door(
            StatusCode::NOT_FOUND,
            &format!("{what}_not_found"),
            "Not found",
            format!("no {what} `{id}` for this caller"),
        )
    }

    /// 501 `not_supported`: this gateway's executor is not an engine (embedded tests).
    pub fn not_supported(what: &str) -> Problem {
        Problem::door(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported",
            "Not supported",
            format!("{what} needs the engine, which this gateway does not run"),
        )
    }

    /// 500 `store_error`: the store could not be read; nothing was sent.
    pub fn store_error(detail: impl Into<String>) -> Problem {
        Problem::door(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_error",
            "The store failed",
            detail,
        )
    }

    /// 403: the caller is authenticated but may not use this endpoint.
    pub fn forbidden(detail: impl Into<String>) -> Problem {
        Problem::door(StatusCode::FORBIDDEN, "forbidden", "Not allowed", detail)
    }

    /// 405 `method_not_allowed`: backstop's endpoint `path` exists but not for `method` (the
    /// `Allow` header of the answer lists the methods it takes).
    pub fn method_not_allowed(method: &str, path: &str) -> Problem {
        Problem::door(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "Method not allowed",
            format!("backstop's endpoint `{path}` does not take {method}; see the Allow header"),
        )
    }

    /// 408 `request_timeout`: the request body did not arrive within `limit` of the request
    /// head; nothing was sent. Not retried automatically by backstop; `x-should-retry: false`.
    pub fn request_timeout(limit: std::time::Duration) -> Problem {
        Problem::door(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "Request body too slow",
            format!(
                "the request body was not received within {} s of the request head; nothing was sent",
                limit.as_secs_f64()
            ),
        )
    }

    /// The problem for an error answer made without one (an extractor's rejection, a route's
    /// bare status): `status` kept, `name` from the status (`bad_request`, `not_found`,
    /// `method_not_allowed`, `request_timeout`, `body_too_large`, `unsupported_media_type`,
    /// `unprocessable`, otherwise `http_<code>`), `detail` = `text` when it has any, else a
    /// sentence from the status's reason phrase.
    pub fn from_status(status: StatusCode, text: &str) -> Problem {
        let name = match status.as_u16() {
            400 => "bad_request".to_owned(),
            404 => "not_found".to_owned(),
            405 => "method_not_allowed".to_owned(),
            408 => "request_timeout".to_owned(),
            413 => "body_too_large".to_owned(),
            415 => "unsupported_media_type".to_owned(),
            422 => "unprocessable".to_owned(),
            code => format!("http_{code}"),
        };
        let reason = status.canonical_reason().unwrap_or("Error");
        let text = text.trim();
        let detail = if text.is_empty() {
            format!("{reason} ({})", status.as_u16())
        } else {
            text.to_owned()
        };
        let mut problem = Problem::door(status, &name, reason, detail);
        problem.name = name;
        problem
    }

    /// 503: the gateway is shutting down and takes no new work. Nothing was sent, so a retry
    /// (against this or another instance) is safe: `Retry-After: 1`, `x-should-retry: true`.
    /// The proxy door and `POST /v1/actions` add the request's `task` and a write's
    /// `idempotency_key` ([`crate::door::draining`], [`crate::actions_api::draining`]).
    pub fn shutting_down() -> Problem {
        let mut problem = Problem::door(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "backstop is shutting down",
            "backstop is shutting down and takes no new work; nothing was sent",
        );
        problem.retry_after_seconds = Some(1);
        problem.should_retry = true;
        problem
    }

    /// 503 `store_unavailable`: backstop's store failed (a damaged file, a full disk, the
    /// writer gone), so the action could not be recorded or carried on. The `sent` member
    /// says whether any attempt of the action had left: only when nothing was sent is a retry
    /// safe (`Retry-After: 1`, `x-should-retry: true`); otherwise `x-should-retry: false` and
    /// the agent must check the action's status (SPEC §5, §12: a write is sent only after it
    /// is durable). The engine adds `task`, a write's `idempotency_key` and, when an action was
    /// recorded, its `action_id`; during a stop, after an attempt was sent, also
    /// `after_restart`, `last_status` and `last_signal` as [`Problem::shutting_down_during`].
    pub fn store_unavailable(sent: bool, detail: impl Into<String>) -> Problem {
        Problem::door(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "backstop's store is unavailable",
            detail,
        )
        .with_sent(sent)
    }

    /// 503 `shutting_down` for a caller whose action was still waiting (or whose write's
    /// answer never came) when the gateway began to stop. With `sent` false nothing left for
    /// it, so a retry is safe (`Retry-After: 1`, `x-should-retry: true`); with `sent` true an
    /// attempt left, the action stays recorded and `x-should-retry` is `false`. The engine adds
    /// `task`, a write's `idempotency_key` and the action's `action_id`, and with `sent` true
    /// what the next start does with the action (`after_restart`: `reconcile`, `cancel`,
    /// `retry_same_key`, or `unknown` when the store's writer went away without telling what it
    /// kept; said in `detail` too) and the last attempt's `last_status` and `last_signal`.
    pub fn shutting_down_during(sent: bool, detail: impl Into<String>) -> Problem {
        Problem::door(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "backstop is shutting down",
            detail,
        )
        .with_sent(sent)
    }

    /// Adds the `sent` member; when nothing was sent a retry is safe, so it also sets
    /// `Retry-After: 1` and `x-should-retry: true`.
    fn with_sent(self, sent: bool) -> Problem {
        let mut problem = self.with_extension("sent", Value::Bool(sent));
        if !sent {
            problem.retry_after_seconds = Some(1);
            problem.should_retry = true;
        }
        problem
    }

    /// The problem for a gateway-made final outcome (SPEC §5), with the status of the module
    /// table. The context becomes extension members: `outcome`, `sent`, `response_received`,
    /// `attempts`, `total_wait_ms`, `last_status`, `last_signal`, `boundary` (RFC 3339 or null)
    /// and `next_safe` (each option with its `description`). When `next_safe` has
    /// `wait_until` and the outcome allows it, the answer is 429 with `Retry-After` = the
    /// seconds from `now` to that instant, rounded up, at least 1.
    pub fn from_outcome(
        outcome: Outcome,
        context: &OutcomeContext,
        detail: impl Into<String>,
        now: Timestamp,
    ) -> Problem {
        let retry_after_seconds =
            resend_advised_at(outcome, context).map(|at| seconds_until(now, at));
        let status = match (retry_after_seconds, outcome) {
            (Some(_), _) => StatusCode::TOO_MANY_REQUESTS,
            (None, outcome) => outcome_status(outcome),
        };
        let mut extensions = Map::new();
        extensions.insert("outcome".into(), Value::String(outcome.as_str().into()));
        extensions.insert("sent".into(), Value::Bool(context.sent));
        extensions.insert(
            "response_received".into(),
            Value::Bool(context.response_received),
        );
        extensions.insert("attempts".into(), json!(context.attempts));
        extensions.insert("total_wait_ms".into(), json!(context.total_wait_ms));
        extensions.insert("last_status".into(), json!(context.last_status));
        extensions.insert("last_signal".into(), json!(context.last_signal));
        extensions.insert(
            "boundary".into(),
            json!(context.boundary.map(|b| b.to_string())),
        );
        let next_safe: Vec<Value> = context
            .next_safe
            .iter()
            .map(|option| {
                let mut value = serde_json::to_value(option).unwrap_or(Value::Null);
                if let Value::Object(map) = &mut value {
                    map.insert("description".into(), Value::String(option.description()));
                }
                value
            })
            .collect();
        extensions.insert("next_safe".into(), Value::Array(next_safe));
        Problem {
            status,
            name: outcome.as_str().to_owned(),
            title: outcome_title(outcome, context).to_owned(),
            detail: detail.into(),
            extensions,
            should_retry: retry_after_seconds.is_some(),
            retry_after_seconds,
        }
    }

    /// Logs this problem at INFO as a refusal of a request, `at` where it was decided (`door`
    /// for the proxy door, `POST /v1/actions`, or `admission` when the action was about to be
    /// recorded, e.g. a reused idempotency key): the `agent` when it is known (authenticated),
    /// the status, the problem type and its `detail` as the reason. The reason is sanitized
    /// ([`sanitize_text`]) before it is logged, although a refusal's detail names headers,
    /// members and rules rather than echoing values: tokens, keys and bodies never reach the
    /// log. The refusal is counted in `backstop_refusals_total` under its problem name.
    pub fn log_refusal(&self, at: &str, agent: Option<&str>, metrics: &crate::metrics::Metrics) {
        metrics.refusal(&self.name);
        log_refusal(
            at,
            Refused::by_agent(agent),
            self.status,
            &self.name,
            &self.detail,
        );
    }

    /// [`Problem::log_refusal`] for a route that agents and operators both call (the action
    /// view, task cancellation, the escalations API): `caller` is whoever was authenticated,
    /// logged as `agent` or `operator` by its role.
    pub fn log_refusal_to(&self, at: &str, caller: Option<&crate::auth::Caller>) {
        log_refusal(
            at,
            Refused::by(caller),
            self.status,
            &self.name,
            &self.detail,
        );
    }

    /// Adds (or replaces) one extension member.
    pub fn with_extension(mut self, key: &str, value: Value) -> Problem {
        self.extensions.insert(key.to_owned(), value);
        self
    }

    /// The JSON body: `type`, `title`, `status`, `detail`, then the extension members.
    pub fn body(&self) -> Value {
        let mut map = Map::new();
        map.insert(
            "type".into(),
            Value::String(format!("{TYPE_PREFIX}{}", self.name)),
        );
        map.insert("title".into(), Value::String(self.title.clone()));
        map.insert("status".into(), json!(self.status.as_u16()));
        map.insert("detail".into(), Value::String(self.detail.clone()));
        for (key, value) in &self.extensions {
            map.insert(key.clone(), value.clone());
        }
        Value::Object(map)
    }
}

/// Who made a refused request, as far as it was authenticated: logged as `agent` or `operator`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Refused<'a> {
    /// The agent's name, when an agent's token was presented.
    pub agent: Option<&'a str>,
    /// The operator's name, when an operator's token was presented.
    pub operator: Option<&'a str>,
}

impl<'a> Refused<'a> {
    /// A request of `agent`, when it is known.
    pub fn by_agent(agent: Option<&'a str>) -> Refused<'a> {
        Refused {
            agent,
            operator: None,
        }
    }

    /// A request of `caller` (by its role), when it is known.
    pub fn by(caller: Option<&'a crate::auth::Caller>) -> Refused<'a> {
        match caller {
            Some(c) if c.role == crate::auth::Role::Agent => Refused::by_agent(Some(&c.name)),
            Some(c) => Refused {
                agent: None,
                operator: Some(&c.name),
            },
            None => Refused::default(),
        }
    }
}

/// The one INFO line of every refusal backstop makes (see [`Problem::log_refusal`]): where it
/// was decided (`at`: `door`, `admission` or the route, such as `GET /v1/actions/{id}`), who
/// asked (`agent` or `operator`, once authenticated), the `status`, the problem type (`name`)
/// and its `detail` as the reason, sanitized ([`sanitize_text`]): tokens, keys and bodies never
/// reach the log.
pub fn log_refusal(at: &str, by: Refused<'_>, status: StatusCode, name: &str, detail: &str) {
    tracing::info!(
        at,
        agent = by.agent,
        operator = by.operator,
        status = status.as_u16(),
        problem = %name,
        reason = %sanitize_text(detail).text,
        "refused: nothing was sent"
    );
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        headers.insert(
            "x-should-retry",
            HeaderValue::from_static(if self.should_retry { "true" } else { "false" }),
        );
        if let Some(seconds) = self.retry_after_seconds {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"backstop\""),
            );
        }
        response
    }
}

/// The instant from which a gateway-made outcome tells the agent to send the same request again
/// (a write under the same `Idempotency-Key`): the `wait_until` of its context's `next_safe`,
/// for the outcomes the module table answers `429` with one (`budget_exhausted`,
/// `quota_exhausted`, `scope_saturated`); `None` for any other outcome or context. Exactly
/// the answers [`Problem::from_outcome`] makes `429` + `Retry-After` + `x-should-retry: true`,
/// and the finished writes a same-key resend reopens once the instant has come (see the module
/// docs).
pub fn resend_advised_at(outcome: Outcome, context: &OutcomeContext) -> Option<Timestamp> {
    let may_wait = matches!(
        outcome,
        Outcome::BudgetExhausted | Outcome::QuotaExhausted | Outcome::ScopeSaturated
    );
    if !may_wait {
        return None;
    }
    context.next_safe.iter().find_map(|option| match option {
        NextSafe::WaitUntil { at } => Some(*at),
        _ => None,
    })
}

/// The status of an outcome without a safe later retry (the module table).
pub fn outcome_status(outcome: Outcome) -> StatusCode {
    match outcome {
        Outcome::Succeeded => StatusCode::OK,
        Outcome::Rejected => StatusCode::BAD_REQUEST,
        Outcome::CircuitOpen | Outcome::QuotaExhausted => StatusCode::FORBIDDEN,
        Outcome::Conflict => StatusCode::UNPROCESSABLE_ENTITY,
        Outcome::Cancelled => StatusCode::GONE,
        Outcome::DeadlineExhausted
        | Outcome::BudgetExhausted
        | Outcome::ScopeSaturated
        | Outcome::ReconciliationRequired
        | Outcome::Escalated => StatusCode::FAILED_DEPENDENCY,
    }
}

/// The problem's title: what happened, said of who decided it — a `rejected` outcome with
/// nothing sent was backstop's refusal (e.g. a payload it could not read), not the provider's;
/// a `budget_exhausted` outcome without any attempt was no retry: the wait before the first
/// send (pacing, a scope's boundary) was longer than the wait budget allows.
fn outcome_title(outcome: Outcome, context: &OutcomeContext) -> &'static str {
    match outcome {
        Outcome::Succeeded => "The action succeeded",
        Outcome::Rejected if !context.sent => "backstop refused the request; nothing was sent",
        Outcome::Rejected => "The provider rejected the request",
        Outcome::Conflict => "The provider reported a conflict",
        Outcome::BudgetExhausted if context.attempts == 0 => {
            "Nothing was sent: the wait before sending is longer than the wait budget allows"
        }
        Outcome::BudgetExhausted => "The retry budget is exhausted",
        Outcome::DeadlineExhausted => "The task deadline is exhausted",
        Outcome::QuotaExhausted => "The provider quota is exhausted",
        Outcome::ScopeSaturated => "The quota scope is saturated",
        Outcome::CircuitOpen => "The circuit for this request is open",
        Outcome::ReconciliationRequired => "The request may have been acted upon",
        Outcome::Escalated => "A human must decide",
        Outcome::Cancelled => "The action was cancelled",
    }
}

/// Whole seconds from `now` until `at`, rounded up, at least 1 (`Retry-After` delay-seconds,
/// RFC 9110 §10.2.3).
fn seconds_until(now: Timestamp, at: Timestamp) -> u64 {
    let millis = at.duration_since(now).as_millis();
    let millis = u64::try_from(millis.max(0)).unwrap_or(u64::MAX);
    millis.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    #[test]
    fn no_gateway_outcome_uses_a_status_sdks_retry() {
        let retried_by_sdks = [408, 409, 429, 500, 502, 503, 504];
        for outcome in Outcome::ALL {
            let problem = Problem::from_outcome(outcome, &OutcomeContext::default(), "x", now());
            assert!(
                !retried_by_sdks.contains(&problem.status.as_u16()),
                "{outcome} answers {}",
                problem.status
            );
            assert!(!problem.should_retry, "{outcome}");
            assert_eq!(problem.retry_after_seconds, None);
        }
    }

    #[test]
    fn a_rejection_names_who_rejected() {
        let refused = Problem::from_outcome(
            Outcome::Rejected,
            &OutcomeContext::default(),
            "payload: not JSON",
            now(),
        );
        assert_eq!(
            refused.title,
            "backstop refused the request; nothing was sent"
        );
        let sent = OutcomeContext {
            sent: true,
            ..OutcomeContext::default()
        };
        let by_provider = Problem::from_outcome(Outcome::Rejected, &sent, "HTTP 400", now());
        assert_eq!(by_provider.title, "The provider rejected the request");
    }

    #[test]
    fn wait_until_makes_an_honest_429_only_where_waiting_helps() {
        let at: Timestamp = "2026-01-01T00:00:09.200Z".parse().unwrap();
        let context = OutcomeContext {
            next_safe: vec![NextSafe::WaitUntil { at }],
            ..OutcomeContext::default()
        };
        for outcome in Outcome::ALL {
            let problem = Problem::from_outcome(outcome, &context, "x", now());
            let waits = matches!(
                outcome,
                Outcome::BudgetExhausted | Outcome::QuotaExhausted | Outcome::ScopeSaturated
            );
            assert_eq!(problem.status == StatusCode::TOO_MANY_REQUESTS, waits);
            assert_eq!(problem.retry_after_seconds, waits.then_some(10));
            assert_eq!(problem.should_retry, waits);
        }
    }

    #[test]
    fn past_boundary_still_gives_at_least_one_second() {
        let at: Timestamp = "2025-12-31T23:59:00Z".parse().unwrap();
        assert_eq!(seconds_until(now(), at), 1);
    }

    #[test]
    fn body_carries_the_outcome_context() {
        let at: Timestamp = "2026-01-01T00:01:00Z".parse().unwrap();
        let context = OutcomeContext {
            sent: true,
            response_received: true,
            attempts: 2,
            total_wait_ms: 1500,
            last_status: Some(503),
            last_signal: Some("unavailable".into()),
            boundary: Some(at),
            next_safe: vec![NextSafe::QueryStatus, NextSafe::Abort],
        };
        let problem = Problem::from_outcome(
            Outcome::ReconciliationRequired,
            &context,
            "the connection was reset after the request was written",
            now(),
        );
        let body = problem.body();
        assert_eq!(body["type"], "urn:backstop:problem:reconciliation_required");
        assert_eq!(body["status"], 424);
        assert_eq!(body["outcome"], "reconciliation_required");
        assert_eq!(body["sent"], true);
        assert_eq!(body["response_received"], true);
        assert_eq!(body["attempts"], 2);
        assert_eq!(body["total_wait_ms"], 1500);
        assert_eq!(body["last_status"], 503);
        assert_eq!(body["last_signal"], "unavailable");
        assert_eq!(body["boundary"], "2026-01-01T00:01:00Z");
        assert_eq!(body["next_safe"][0]["option"], "query_status");
        assert!(body["next_safe"][0]["description"]
            .as_str()
            .unwrap()
            .starts_with("query the provider"));
    }

    #[test]
    fn bare_statuses_become_named_problems() {
        let p = Problem::from_status(StatusCode::METHOD_NOT_ALLOWED, "");
        assert_eq!(p.name, "method_not_allowed");
        assert_eq!(p.detail, "Method Not Allowed (405)");
        let p = Problem::from_status(StatusCode::BAD_REQUEST, " Invalid URL ");
        assert_eq!(
            (p.name.as_str(), p.detail.as_str()),
            ("bad_request", "Invalid URL")
        );
        assert_eq!(
            Problem::from_status(StatusCode::IM_A_TEAPOT, "").name,
            "http_418"
        );
        assert_eq!(p.body()["sent"], false);
    }

    #[test]
    fn store_unavailable_invites_a_retry_only_when_nothing_was_sent() {
        let unsent = Problem::store_unavailable(false, "nothing was sent").into_response();
        assert_eq!(unsent.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(unsent.headers()["x-should-retry"], "true");
        assert_eq!(unsent.headers()[header::RETRY_AFTER], "1");
        let sent = Problem::store_unavailable(true, "an attempt was sent");
        assert_eq!(
            sent.body()["type"],
            format!("{TYPE_PREFIX}store_unavailable")
        );
        assert_eq!(sent.body()["sent"], true);
        let sent = sent.into_response();
        assert_eq!(sent.headers()["x-should-retry"], "false");
        assert!(sent.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn response_headers() {
        let response =
            Problem::bad_header("X-Backstop-Priority", "must be one of …").into_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(response.headers()["content-type"], PROBLEM_JSON);
        assert_eq!(response.headers()["x-should-retry"], "false");
        assert!(response.headers().get("retry-after").is_none());
        let response = Problem::shutting_down().into_response();
        assert_eq!(response.headers()["retry-after"], "1");
        assert_eq!(response.headers()["x-should-retry"], "true");
        let response = Problem::unauthorized("no token").into_response();
        assert!(response.headers().contains_key("www-authenticate"));
    }
}
