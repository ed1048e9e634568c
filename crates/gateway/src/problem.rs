//! Answers made by backstop itself: RFC 9457 problem details (`application/problem+json`), and
//! the retry hint every answer carries once no further attempt follows.
//!
//! **One retry owner.** An agent's HTTP client sits between backstop and the agent, and most
//! clients retry on their own (see "What common clients retry on" below). Backstop exists to be
//! the one layer that retries (SPEC §4.3, §11), so every answer given once it decided that no
//! further attempt follows says `x-should-retry: false`: its own outcomes (this module) and every
//! non-2xx provider answer the door passes on — a provider's 409, any 4xx, a final 5xx or 429 —
//! where [`crate::door`] sets the header, overriding a provider's own `x-should-retry: true`. The
//! OpenAI and Anthropic SDKs obey that header before their own status rules. Only door problems
//! where nothing was sent and a retry is safe by construction keep `true` (see below).
//!
//! **Errors an SDK user can read and catch.** Besides the RFC 9457 members — `type` is the
//! problem URI `urn:backstop:problem:<name>`, then `title`, `status`, `detail` and the extension
//! members (the SPEC §5 context for an outcome) — every problem carries the SDKs' error envelope
//! `"error": {"message", "type", "code"}` ([`error_envelope`]): `message` is the `detail`
//! (backstop's reason), `code` the problem name (`budget_exhausted`, `unauthorized`, …), `type`
//! the kind of error in the providers' vocabulary ([`error_type`]: `rate_limit_error`,
//! `invalid_request_error`, `overloaded_error`, …). Branch on `code`; `type` only groups. With
//! the OpenAI SDK, `str(e)` and `e.message` read `Error code: 429 - <detail>`, `e.code` is the
//! problem name, `e.type` the envelope's type and `e.body` the envelope (the whole document is
//! `e.response.json()`). With the Anthropic SDK, `str(e)` reads `Error code: 429 - {…}` with the
//! whole document, `e.api_message` is the detail, `e.type` the envelope's type and `e.body` the
//! whole document (`e.body["error"]["code"]` is the problem name); the top-level `type` URI does
//! not disturb it.
//!
//! ## Statuses of outcomes
//!
//! | outcome | status | OpenAI SDK exception | Anthropic SDK exception | `x-should-retry` | `Retry-After` |
//! |---|---|---|---|---|---|
//! | `rejected` | 400 | `BadRequestError` | `BadRequestError` | `false` | — |
//! | `circuit_open` | 403 | `PermissionDeniedError` | `PermissionDeniedError` | `false` | — |
//! | `conflict` | 422 | `UnprocessableEntityError` | `UnprocessableEntityError` | `false` | — |
//! | `cancelled` | 410 | `APIStatusError` | `APIStatusError` | `false` | — |
//! | `scope_saturated` | 429 | `RateLimitError` | `RateLimitError` | `false` | when `wait_until` is known |
//! | `budget_exhausted`, `quota_exhausted` | 429 — or the provider's error status when the last attempt got one | `RateLimitError` (the provider's: 503, 529 → `InternalServerError`; 408 → `APIStatusError`) | `RateLimitError` (503 → `ServiceUnavailableError`, 529 → `OverloadedError`, 500 → `InternalServerError`, 408 → `RequestTimeoutError`) | `false` | when `wait_until` is known |
//! | `deadline_exhausted` | as `budget_exhausted` | as `budget_exhausted` | as `budget_exhausted` | `false` | never |
//! | `reconciliation_required` | 424 | `APIStatusError` | `APIStatusError` | `false` | — |
//! | `escalated` | 424 | `APIStatusError` | `APIStatusError` | `false` | — |
//! | `succeeded` (reconciled) | 200, plain JSON (not a problem) | — | — | — | — |
//!
//! Why these ([`outcome_status`]):
//! - `rejected` 400: the request itself must change.
//! - `circuit_open` 403: the same request failed the same way too often in this task (SPEC §7),
//!   and backstop refuses to send it again; nothing was sent.
//! - `conflict` 422, not 409: the provider's own 409 is passed through as it came (with
//!   `x-should-retry: false`); backstop's `conflict` problem (a replay whose response is not kept)
//!   avoids a status that clients which do not read the header retry on their own.
//! - `cancelled` 410: the action or its task is gone for good; nothing more is sent for it.
//! - The rate and budget outcomes answer 429, what agent code catches as "out of capacity"
//!   (`RateLimitError`), whether or not a boundary is known; `Retry-After` only when it is (the
//!   instant of [`resend_advised_at`]; never for `deadline_exhausted`: the task's time is over).
//!   When the action's last attempt got an error answer from the provider (its `last_status`
//!   with a `last_signal` other than `uncertain` or `not_sent`), that status is kept instead
//!   ([`provider_status`]): an action that ends `budget_exhausted` after Anthropic's 529 answers
//!   529 (`OverloadedError`), after a 503 answers 503. `scope_saturated` is always decided before
//!   a send (backpressure) and always answers 429.
//! - `reconciliation_required` and `escalated` 424: the write may have happened (query its status)
//!   or a human decides; neither is a rate limit, no client retries 424 on its status, and the
//!   SDKs raise their base `APIStatusError`, whose `e.code` (OpenAI) or
//!   `e.body["error"]["code"]` (Anthropic) names the outcome.
//!
//! `wait_until` is the provider's boundary, or — when the action was refused before a send
//! because its scopes would have made it wait past its deadline or remaining wait budget (a
//! caller's `Prefer: wait`, the class's `max_wait`) — the instant they would have let it go,
//! local pacing included: a write never sent because pacing asked for 486 ms and the caller
//! allowed `Prefer: wait=0` is `429` + `Retry-After: 1`. Its title says that nothing was sent (no
//! attempt, so no retry budget was spent) rather than that the retry budget is exhausted.
//!
//! **What a `Retry-After` promises a write.** It says when sending the same request again is
//! safe; `x-should-retry: false` keeps clients from doing so by themselves, so the resend is the
//! agent's explicit choice, under the same `Idempotency-Key`. Such a finished write (its instant:
//! [`resend_advised_at`]) is not replayed forever: a same-key, same-payload resend
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
//! drops `wait_until` (no `Retry-After`). A `scope_saturated`, `budget_exhausted` or
//! `quota_exhausted` write refused before any attempt, with no `wait_until` (its answer promises
//! no instant) and no escalation, is backpressure, not an end: a same-key resend reopens it at
//! once. Every other finished outcome — `succeeded`, `rejected`, `conflict`, `cancelled`,
//! `escalated`, … — is replayed as it is.
//!
//! ## Problems of the door
//!
//! The request never became an action, or nothing was sent for it (`sent: false`):
//!
//! | problem | status | OpenAI SDK exception | Anthropic SDK exception | `x-should-retry` |
//! |---|---|---|---|---|
//! | `bad_header`, `bad_request` (a malformed `X-Backstop-*` or `Prefer` header, an unreadable body) | 400 | `BadRequestError` | `BadRequestError` | `false` |
//! | `unauthorized` (missing or unknown agent token) | 401 | `AuthenticationError` | `AuthenticationError` | `false` |
//! | `forbidden` (a token of the wrong role) | 403 | `PermissionDeniedError` | `PermissionDeniedError` | `false` |
//! | `unknown_provider`, `not_found`, `action_not_found`, `task_not_found` | 404 | `NotFoundError` | `NotFoundError` | `false` |
//! | `method_not_allowed` (with `Allow`) | 405 | `APIStatusError` | `APIStatusError` | `false` |
//! | `request_timeout` (the body did not arrive within the read timeout) | 408 | `APIStatusError` | `RequestTimeoutError` | `false` |
//! | `idempotency_key_in_flight` | 409 | `ConflictError` | `ConflictError` | `false` |
//! | `body_too_large` | 413 | `APIStatusError` | `ContentTooLargeError` | `false` |
//! | `idempotency_key_reused` | 422 | `UnprocessableEntityError` | `UnprocessableEntityError` | `false` |
//! | `credential_unavailable` (the provider's `secret_file` could not be read at start) | 424 | `APIStatusError` | `APIStatusError` | `false` |
//! | `store_error` (the store could not be read) | 500 | `InternalServerError` | `InternalServerError` | `false` |
//! | `not_supported` | 501 | `InternalServerError` | `HTTPNotImplementedError` | `false` |
//! | `shutting_down`, `store_unavailable` | 503 | `InternalServerError` | `ServiceUnavailableError` | `true` + `Retry-After: 1` with `sent: false`, else `false` |
//! | `body_budget_exhausted` (the request bodies held in memory fill `--buffered-body-bytes`) | 503 | `InternalServerError` | `ServiceUnavailableError` | `true` + `Retry-After: 1` |
//!
//! `x-should-retry: true` stays only where nothing reached the provider and a retry is safe by
//! construction, case by case: the gateway shutting down (the request was not taken on, or its
//! action stays open under its key and a same-key resend resumes it as that same action, once),
//! the store failing before any send (the same: nothing left, the action resumable), and the
//! cap on buffered request bodies being full (the body was refused before it was read; room
//! comes back as other actions end). The client's retry is then the request's first chance at
//! the provider, not a second layer of attempts. The engine adds one more case to the stop's
//! answers: a read whose attempt was out when the gateway stopped is answered `true` with
//! `Retry-After: 1` (a read changes nothing at the provider, and its action ends `cancelled`
//! after the restart). A `store_error`, a `request_timeout` or any refusal of the request's
//! content says `false`: the same request would be refused the same way.
//!
//! ## What common clients retry on
//!
//! Read from their sources (openai 3.60, anthropic 2.16, litellm 1.108, urllib3 2.8, tenacity
//! 9.2):
//! - **OpenAI and Anthropic SDKs** (`max_retries=2` by default): on an error status,
//!   `x-should-retry: true` or `false` decides first; without it they retry 408, 409, 429 and every
//!   status ≥ 500. They also retry connection errors and their own timeouts (600 s by default),
//!   which carry no header. Between tries they sleep `retry-after-ms` or `Retry-After` (OpenAI up
//!   to 120 s, and a longer `Retry-After` means no retry at all; Anthropic any), else 0.5 s
//!   doubling up to 8 s, and send `x-stainless-retry-count`.
//! - **LiteLLM**: `openai/…` models go through the OpenAI SDK with its `max_retries` (2 by
//!   default), so the header is obeyed; `anthropic/…` models use LiteLLM's own HTTP client, which
//!   does not retry. `num_retries` (per call or `litellm.num_retries`) becomes the SDK's
//!   `max_retries` and adds LiteLLM's own loop (tenacity) that retries any `openai.APIError`,
//!   timeout or connection error whatever the status and the header: leave it unset toward
//!   backstop.
//! - **urllib3 `Retry`** (a bare `PoolManager` uses `Retry(3)`; `requests` uses none unless an
//!   adapter is mounted with `max_retries`): only methods in `allowed_methods` (by default `GET`,
//!   `HEAD`, `PUT`, `DELETE`, `OPTIONS`, `TRACE` — not `POST`), on statuses in `status_forcelist`
//!   (empty by default) and, since `respect_retry_after_header` is on by default, on a 413, 429
//!   or 503 that carries `Retry-After`, after sleeping it. It never reads `x-should-retry`: a read
//!   answered `429` with `Retry-After` is sent again after that delay. Toward backstop use
//!   `Retry(total=0)`, or `respect_retry_after_header=False` without a `status_forcelist`.
//! - **Stripe's SDKs** (stripe-python 16: `max_network_retries` 2 by default) obey
//!   `Stripe-Should-Retry: true|false` first, then retry 409 and every status ≥ 500: backstop sets
//!   `Stripe-Should-Retry` beside `x-should-retry`, with the same value, on every answer it makes
//!   and on every provider answer it passes on after deciding that no attempt follows.
//! - **tenacity** retries whatever the decorator says, and reads no header; a bare `@retry`
//!   retries every exception, forever, without waiting. Retry on connection errors if at all, not
//!   on backstop's answers: `e.code` names the outcome and `x-should-retry: false` says that no
//!   further attempt helps.
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
//! assert!(!problem.should_retry);
//! assert_eq!(problem.body()["error"]["code"], "budget_exhausted");
//! assert_eq!(problem.body()["error"]["message"], "4 attempts used");
//!
//! // The provider's own status of the last attempt is kept: Anthropic's 529 stays a 529.
//! let context = OutcomeContext {
//!     last_status: Some(529),
//!     last_signal: Some("unavailable".into()),
//!     ..context
//! };
//! let problem = Problem::from_outcome(Outcome::BudgetExhausted, &context, "overloaded", now);
//! assert_eq!(problem.status.as_u16(), 529);
//! assert_eq!(problem.body()["error"]["type"], "overloaded_error");
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

    /// 503 `body_budget_exhausted`: the request bodies backstop holds in memory already fill
    /// its cap ([`crate::door::DoorConfig::body_budget_bytes`], `--buffered-body-bytes`), so
    /// this one was refused before more of it was read; nothing was sent. Room comes back as
    /// actions end, so a retry shortly is safe: `Retry-After: 1`, `x-should-retry: true`.
    /// `wanted`, `held` and `total` are bytes: this body's (its `Content-Length`, or what had
    /// arrived of it), the other bodies', the cap; all three are extension members too.
    pub fn body_budget_exhausted(wanted: usize, held: usize, total: usize) -> Problem {
        let mut problem = Problem::door(
            StatusCode::SERVICE_UNAVAILABLE,
            "body_budget_exhausted",
            "backstop holds too many request bodies",
            format!(
                "backstop already holds {held} bytes of request bodies; this body of {wanted} bytes does not fit under its cap of {total} bytes (--buffered-body-bytes); nothing was sent, retry shortly"
            ),
        )
        .with_extension("body_bytes", wanted.into())
        .with_extension("held_bytes", held.into())
        .with_extension("limit_bytes", total.into());
        problem.retry_after_seconds = Some(1);
        problem.should_retry = true;
        problem
    }

    /// 413 `body_too_large` for a body larger than backstop's whole cap on buffered request
    /// bodies (`total` bytes, `--buffered-body-bytes`): it could never be held, so waiting
    /// does not help; nothing was sent.
    pub fn larger_than_body_budget(total: usize) -> Problem {
        Problem::door(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "Request body too large",
            format!(
                "the request body is larger than backstop's cap of {total} bytes on all buffered request bodies (--buffered-body-bytes); nothing was sent"
            ),
        )
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
    /// table ([`outcome_status`]) and `x-should-retry: false`. The context becomes extension
    /// members: `outcome`, `sent`, `response_received`, `attempts`, `total_wait_ms`,
    /// `last_status`, `last_signal`, `boundary` (RFC 3339 or null) and `next_safe` (each option
    /// with its `description`). When `next_safe` has `wait_until` and the outcome allows a
    /// resend then ([`resend_advised_at`]), the answer carries `Retry-After` = the seconds from
    /// `now` to that instant, rounded up, at least 1.
    pub fn from_outcome(
        outcome: Outcome,
        context: &OutcomeContext,
        detail: impl Into<String>,
        now: Timestamp,
    ) -> Problem {
        let retry_after_seconds =
            resend_advised_at(outcome, context).map(|at| seconds_until(now, at));
        let status = outcome_status(outcome, context);
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
            should_retry: false,
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

    /// The JSON body: `type`, `title`, `status`, `detail`, the extension members, then the SDKs'
    /// error envelope `error` ([`error_envelope`]).
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
        map.insert(
            "error".into(),
            error_envelope(self.status, &self.name, &self.detail),
        );
        Value::Object(map)
    }
}

/// The error envelope of the OpenAI and Anthropic APIs, which their SDKs read into the
/// exception: `{"message": detail, "type": error_type(status), "code": name}` — `message` is
/// backstop's reason (the problem's `detail`), `code` the problem name (`budget_exhausted`),
/// `type` the kind of error ([`error_type`]). See the module docs for what each SDK makes of it.
pub fn error_envelope(status: StatusCode, name: &str, detail: &str) -> Value {
    json!({
        "message": detail,
        "type": error_type(status),
        "code": name,
    })
}

/// The envelope's `type` for a status, in the providers' vocabulary (Anthropic's `error.type`
/// names, which OpenAI's SDK takes as free text): 400, 405, 410, 413, 415 and 422
/// `invalid_request_error`; 401 `authentication_error`; 403 `permission_error`; 404
/// `not_found_error`; 408 `timeout_error`; 409 `conflict_error`; 429 `rate_limit_error`; 529
/// `overloaded_error`; any other status `api_error`.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 410 | 413 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    }
}

/// Marks a response that backstop made itself (a problem, [`Problem::into_response`]), so that
/// the door tells it from a provider's answer it passes on: a provider's non-2xx answer is given
/// `x-should-retry: false`, backstop's own answer keeps the hint it was made with.
#[derive(Debug, Clone, Copy)]
pub struct OwnAnswer;

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

/// Stripe's own retry hint, which Stripe's SDKs obey before their status rules (stripe-python
/// 16: `max_network_retries` 2 by default, retrying 409 and every status ≥ 500 otherwise): set
/// beside `x-should-retry` with the same value.
pub const STRIPE_SHOULD_RETRY: http::HeaderName =
    http::HeaderName::from_static("stripe-should-retry");

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        response.extensions_mut().insert(OwnAnswer);
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        let hint = HeaderValue::from_static(if self.should_retry { "true" } else { "false" });
        headers.insert(STRIPE_SHOULD_RETRY, hint.clone());
        headers.insert("x-should-retry", hint);
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

/// The instant from which a gateway-made outcome tells the agent that sending the same request
/// again is safe (a write under the same `Idempotency-Key`): the `wait_until` of its context's
/// `next_safe`, for the outcomes that may wait for one (`budget_exhausted`, `quota_exhausted`,
/// `scope_saturated`); `None` for any other outcome or context. Exactly the answers
/// [`Problem::from_outcome`] gives a `Retry-After` (with `x-should-retry: false`: the resend
/// is the agent's own choice, not its client's), and the finished writes a same-key resend
/// reopens once the instant has come (see the module docs).
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

/// The status of a gateway-made outcome (the module table): `budget_exhausted`,
/// `quota_exhausted` and `deadline_exhausted` answer the provider's error status of the action's
/// last attempt when it got one ([`provider_status`]), else 429 as `scope_saturated` always
/// does; `rejected` 400, `circuit_open` 403, `conflict` 422, `cancelled` 410,
/// `reconciliation_required` and `escalated` 424, `succeeded` 200.
pub fn outcome_status(outcome: Outcome, context: &OutcomeContext) -> StatusCode {
    match outcome {
        Outcome::Succeeded => StatusCode::OK,
        Outcome::Rejected => StatusCode::BAD_REQUEST,
        Outcome::CircuitOpen => StatusCode::FORBIDDEN,
        Outcome::Conflict => StatusCode::UNPROCESSABLE_ENTITY,
        Outcome::Cancelled => StatusCode::GONE,
        Outcome::BudgetExhausted | Outcome::QuotaExhausted | Outcome::DeadlineExhausted => {
            provider_status(context).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
        }
        Outcome::ScopeSaturated => StatusCode::TOO_MANY_REQUESTS,
        Outcome::ReconciliationRequired | Outcome::Escalated => StatusCode::FAILED_DEPENDENCY,
    }
}

/// The provider's error status (4xx or 5xx, Anthropic's 529 included) that the action's last
/// attempt was answered with: its `last_status`, when its `last_signal` is a classified answer
/// rather than a transport failure (`uncertain`, `not_sent`) or unknown. `None` when the last
/// attempt got no answer — the `last_status` of an earlier attempt is not the last word then —
/// or when nothing was answered at all.
pub fn provider_status(context: &OutcomeContext) -> Option<StatusCode> {
    let answered = context
        .last_signal
        .as_deref()
        .is_some_and(|signal| !matches!(signal, "uncertain" | "not_sent"));
    context
        .last_status
        .filter(|status| answered && (400..=599).contains(status))
        .and_then(|status| StatusCode::from_u16(status).ok())
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
    fn every_gateway_outcome_says_no_retry_with_the_status_of_the_table() {
        for outcome in Outcome::ALL {
            let problem = Problem::from_outcome(outcome, &OutcomeContext::default(), "x", now());
            let expected = match outcome {
                Outcome::Succeeded => 200,
                Outcome::Rejected => 400,
                Outcome::CircuitOpen => 403,
                Outcome::Conflict => 422,
                Outcome::Cancelled => 410,
                Outcome::BudgetExhausted
                | Outcome::QuotaExhausted
                | Outcome::ScopeSaturated
                | Outcome::DeadlineExhausted => 429,
                Outcome::ReconciliationRequired | Outcome::Escalated => 424,
            };
            assert_eq!(problem.status.as_u16(), expected, "{outcome}");
            assert!(!problem.should_retry, "{outcome}");
            assert_eq!(problem.retry_after_seconds, None);
            let response = problem.into_response();
            assert_eq!(response.headers()["x-should-retry"], "false", "{outcome}");
            assert_eq!(
                response.headers()["stripe-should-retry"],
                "false",
                "{outcome}"
            );
            assert!(response.headers().get(header::RETRY_AFTER).is_none());
        }
    }

    #[test]
    fn a_429_problem_says_no_retry_and_keeps_its_retry_after() {
        let at: Timestamp = "2026-01-01T00:00:30Z".parse().unwrap();
        let context = OutcomeContext {
            sent: true,
            response_received: true,
            attempts: 3,
            last_status: Some(429),
            last_signal: Some("rate_limited".into()),
            boundary: Some(at),
            next_safe: vec![NextSafe::WaitUntil { at }, NextSafe::Abort],
            ..OutcomeContext::default()
        };
        let response =
            Problem::from_outcome(Outcome::BudgetExhausted, &context, "3 attempts", now())
                .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()["x-should-retry"], "false");
        assert_eq!(response.headers()[header::RETRY_AFTER], "30");
        assert!(response.extensions().get::<OwnAnswer>().is_some());
    }

    #[test]
    fn the_provider_status_of_the_last_attempt_is_kept_for_budget_outcomes() {
        let after = |status: u16, signal: &str| OutcomeContext {
            sent: true,
            response_received: true,
            attempts: 3,
            last_status: Some(status),
            last_signal: Some(signal.into()),
            ..OutcomeContext::default()
        };
        for (outcome, status, signal) in [
            (Outcome::BudgetExhausted, 529, "unavailable"),
            (Outcome::BudgetExhausted, 503, "unavailable"),
            (Outcome::BudgetExhausted, 500, "transient"),
            (Outcome::BudgetExhausted, 408, "transient"),
            (Outcome::DeadlineExhausted, 503, "unavailable"),
            (Outcome::QuotaExhausted, 403, "quota_exhausted"),
        ] {
            let problem = Problem::from_outcome(outcome, &after(status, signal), "x", now());
            assert_eq!(problem.status.as_u16(), status, "{outcome} after {status}");
            assert!(!problem.should_retry);
            assert_eq!(problem.body()["status"], status);
        }
        let overloaded = Problem::from_outcome(
            Outcome::BudgetExhausted,
            &after(529, "unavailable"),
            "x",
            now(),
        );
        assert_eq!(overloaded.body()["error"]["type"], "overloaded_error");
        // The last attempt got no answer (a timeout after an earlier 503): not the provider's
        // word, so the outcome's own status.
        for signal in ["uncertain", "not_sent"] {
            let problem =
                Problem::from_outcome(Outcome::BudgetExhausted, &after(503, signal), "x", now());
            assert_eq!(problem.status, StatusCode::TOO_MANY_REQUESTS, "{signal}");
        }
        let unknown = OutcomeContext {
            last_signal: None,
            ..after(503, "unavailable")
        };
        let problem = Problem::from_outcome(Outcome::BudgetExhausted, &unknown, "x", now());
        assert_eq!(problem.status, StatusCode::TOO_MANY_REQUESTS);
        // Other outcomes keep their own status whatever the provider last answered.
        for outcome in [
            Outcome::ScopeSaturated,
            Outcome::Escalated,
            Outcome::ReconciliationRequired,
            Outcome::CircuitOpen,
            Outcome::Cancelled,
        ] {
            let problem = Problem::from_outcome(outcome, &after(503, "unavailable"), "x", now());
            assert_ne!(problem.status.as_u16(), 503, "{outcome}");
        }
    }

    #[test]
    fn every_problem_carries_the_sdk_error_envelope() {
        let problem = Problem::from_outcome(
            Outcome::Escalated,
            &OutcomeContext::default(),
            "a human decides whether the refund is sent again",
            now(),
        );
        let body = problem.body();
        assert_eq!(body["type"], "urn:backstop:problem:escalated");
        assert_eq!(
            body["error"],
            json!({
                "message": "a human decides whether the refund is sent again",
                "type": "api_error",
                "code": "escalated",
            })
        );
        let body = Problem::unauthorized("no token").body();
        assert_eq!(body["error"]["message"], "no token");
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(body["error"]["code"], "unauthorized");
        let at: Timestamp = "2026-01-01T00:00:05Z".parse().unwrap();
        let context = OutcomeContext {
            next_safe: vec![NextSafe::WaitUntil { at }],
            ..OutcomeContext::default()
        };
        let body = Problem::from_outcome(Outcome::ScopeSaturated, &context, "full", now()).body();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], "scope_saturated");
    }

    #[test]
    fn envelope_types_follow_the_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (408, "timeout_error"),
            (409, "conflict_error"),
            (410, "invalid_request_error"),
            (422, "invalid_request_error"),
            (424, "api_error"),
            (429, "rate_limit_error"),
            (503, "api_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
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
    fn wait_until_gives_an_honest_retry_after_only_where_waiting_helps() {
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
            let rate = waits || outcome == Outcome::DeadlineExhausted;
            assert_eq!(problem.status == StatusCode::TOO_MANY_REQUESTS, rate);
            assert_eq!(problem.retry_after_seconds, waits.then_some(10));
            assert_eq!(resend_advised_at(outcome, &context).is_some(), waits);
            assert!(!problem.should_retry);
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
        assert_eq!(body["error"]["code"], "reconciliation_required");
        assert_eq!(
            body["error"]["message"],
            "the connection was reset after the request was written"
        );
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
