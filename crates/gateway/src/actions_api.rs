//! The action API (SPEC §11): submit work without holding a connection open, read its state,
//! long-poll for its end, and cancel a task.
//!
//! Why: an agent whose call may wait minutes behind a provider's `Retry-After` should not keep
//! an HTTP connection (and an SDK timeout that retries on its own) open for it. It submits the
//! action, gets `202` with a `Location`, and reads the outcome when it is ready.
//!
//! | route | who | answer |
//! |---|---|---|
//! | `POST /v1/actions` | agent | `202`, `Location: /v1/actions/{id}`, `{id, task, state: "accepted" \| "joined", location}` when the request runs an action or joined the one running under its key; otherwise the answer of the same proxied call (see `door::submit_async`) |
//! | `GET /v1/actions/{id}[?wait=30s]` | owning agent, operator | `200` [`action_view`] plus `response` (a kept provider response) or `detail` (a gateway-made outcome); `Backstop-Action-Id`, `Backstop-Attempts` |
//! | `POST /v1/tasks/{id}/cancel` | owning agent, operator | `200 {task_id, actions_cancelled, retries_dropped, waiting_dropped, reconciling}` (see [`crate::engine::TaskCancelled`]) |
//!
//! `POST /v1/actions` takes JSON `{provider, method, path (with query), headers (object of
//! strings), body (text) | body_base64, task, priority, deadline (RFC 3339), max_wait_seconds,
//! idempotency_key, desired_outcome}`; only `provider`, `method` and `path` are required. It
//! is the same as a proxied call to `/{provider}{path}` with those headers, except that
//! `provider` alone decides the provider: a `path` whose `..` would climb above its own root
//! (into another provider's namespace) is refused, as is one with characters a URL cannot carry
//! as written (see `check_path`).
//!
//! Ambiguous input is refused, never resolved by a silent choice: a member given twice (at the
//! top or inside `headers`) is a 400 naming it; the idempotency key may be given in three places
//! (this request's own `Idempotency-Key` header, the provider's key header inside `headers`, the
//! `idempotency_key` member) and two places with different keys are a 400 naming both.
//! `desired_outcome` is at most [`MAX_DESIRED_OUTCOME_CHARS`] characters: it is shown in a
//! compact case file.
//!
//! Isolation: an agent sees only its own actions and tasks; another agent's id is answered
//! exactly like a missing one (`404 action_not_found` / `task_not_found`). Operators see all.
//! The provider's response of a background action is kept in memory for the owning agent only
//! (bounded, see [`crate::engine::KEPT_BODY_LIMIT`] and [`crate::engine::KEPT_ACTIONS`]) and
//! never written to the store or the audit log; an operator reading the action sees the state,
//! outcome and context but not the body.

use std::{sync::Arc, time::Duration};

use axum::{
    body::{Body, Bytes},
    extract::{Path, Query, State},
    http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use backstop_core::{
    outcome::NextSafe,
    pacing::Priority,
    reconcile::{validate_idempotency_key, ReconcileError},
};
use serde::{de, Deserialize, Deserializer};
use serde_json::{json, Value};

use crate::{
    action::ActionSpec,
    auth::{Caller, Role},
    door::{self, BackstopHeaders},
    engine::{Completion, Engine, EngineError},
    problem::Problem,
    state::AppState,
};

/// The longest `?wait=` honoured by `GET /v1/actions/{id}` (60 s); longer values are capped.
pub const MAX_LONG_POLL: Duration = Duration::from_secs(60);

/// The longest `desired_outcome` accepted by `POST /v1/actions`, in characters (Unicode scalar
/// values). It is the agent's one-paragraph statement of what the action is for, shown to an
/// operator in a compact case file (SPEC §8); a longer one is refused with 400 naming the
/// member and this limit.
pub const MAX_DESIRED_OUTCOME_CHARS: usize = 2_000;

/// The action API routes (see the module table).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/actions", post(submit))
        .route("/v1/actions/{id}", get(show))
        .route("/v1/tasks/{id}/cancel", post(cancel))
        .with_state(state)
}

/// The largest `POST /v1/actions` body read: room for a payload at the door's hard cap
/// ([`door::DoorConfig::max_body_bytes`]) in `body_base64` (4/3 of it) plus 64 KiB for the
/// other members. A larger body is answered `413 body_too_large`; the payload itself is then
/// held to the hard cap like a proxied body. The body is read only once the caller is
/// authenticated as an agent, under the shared cap on buffered bodies
/// ([`crate::body_budget`]: `503 body_budget_exhausted` when it has no room); the decoded
/// payload takes over the body's share of it.
pub fn submit_body_limit(config: door::DoorConfig) -> usize {
    config
        .max_body_bytes
        .saturating_add(config.max_body_bytes / 3 + 3)
        .saturating_add(64 * 1024)
}

/// The `413 body_too_large` of a `POST /v1/actions` body over [`submit_body_limit`].
fn envelope_too_large(config: door::DoorConfig) -> Problem {
    let mut problem = door::body_too_large(config);
    problem.detail = format!(
        "the request body is larger than {} bytes (room for a payload at backstop's hard cap of {} bytes in body_base64); nothing was sent",
        submit_body_limit(config),
        config.max_body_bytes
    );
    problem
}

/// The body of `POST /v1/actions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewActionBody {
    provider: String,
    method: String,
    path: String,
    #[serde(default, deserialize_with = "unique_members")]
    headers: Vec<(String, String)>,
    body: Option<String>,
    body_base64: Option<String>,
    task: Option<String>,
    priority: Option<String>,
    deadline: Option<String>,
    max_wait_seconds: Option<u64>,
    idempotency_key: Option<String>,
    desired_outcome: Option<String>,
}

/// A JSON object of strings, in order, refusing a member name given twice (serde_json would
/// keep the last one silently).
fn unique_members<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
    struct Members;
    impl<'de> de::Visitor<'de> for Members {
        type Value = Vec<(String, String)>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of header names and string values")
        }

        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut members: Vec<(String, String)> = Vec::new();
            let mut seen = std::collections::HashSet::new();
            while let Some((name, value)) = map.next_entry::<String, String>()? {
                // Header names are case-insensitive (RFC 9110 §5.1): `X-A` and `x-a` are one.
                if !seen.insert(name.to_ascii_lowercase()) {
                    return Err(de::Error::custom(format_args!(
                        "headers: member `{name}` is given more than once"
                    )));
                }
                members.push((name, value));
            }
            Ok(members)
        }
    }
    d.deserialize_map(Members)
}

fn caller(state: &AppState, headers: &HeaderMap) -> Result<Caller, Problem> {
    state.auth.authenticate(headers).map_err(Problem::from)
}

fn engine(state: &AppState, what: &str) -> Result<Engine, Problem> {
    state
        .executor
        .engine()
        .ok_or_else(|| Problem::not_supported(what))
}

/// `POST /v1/actions`; every refusal is logged at INFO ([`Problem::log_refusal`]), with the
/// agent once it is known.
async fn submit(State(state): State<Arc<AppState>>, request: Request<Body>) -> Response {
    let (parts, body) = request.into_parts();
    let mut agent = None;
    match submit_inner(&state, &parts.headers, body, &mut agent).await {
        Ok(response) => response,
        Err(problem) => {
            problem.log_refusal("POST /v1/actions", agent.as_deref(), &state.metrics);
            door::refusal(problem)
        }
    }
}

/// [`submit`]'s work; `agent` is set to the caller's name once it is authenticated as an agent.
async fn submit_inner(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    agent: &mut Option<String>,
) -> Result<Response, Problem> {
    let who = submitting_agent(state, headers)?;
    *agent = Some(who.name.clone());
    // Read only now: an unknown caller's body is never read, and a body the budget has no room
    // for is refused before the rest of it arrives.
    let envelope = state
        .body_budget
        .read(
            body,
            door::declared_length(headers),
            submit_body_limit(state.door),
        )
        .await
        .map_err(|error| door::body_problem(error, || envelope_too_large(state.door)))?;
    engine(state, "POST /v1/actions")?;
    let mut request = parse_new_action(envelope.as_slice())?;
    let method = parse_method(&request.method)?;
    if !state.policy.providers.contains_key(&request.provider) {
        return Err(Problem::unknown_provider(&request.provider));
    }
    check_path(&request.provider, &request.path)?;
    let payload = take_payload(&mut request, |bytes| envelope.replace(bytes))?;
    if payload.len() > state.door.max_body_bytes {
        return Err(door::body_too_large(state.door));
    }
    check_desired_outcome(request.desired_outcome.as_deref())?;
    let incoming = provider_headers(state, headers, &request)?;
    let backstop = backstop_headers(&mut request)?;
    let spec = action_spec(state, who, method, request, &incoming, payload, backstop)?;
    Ok(door::submit_async(state, spec).await)
}

/// The caller of a `POST /v1/actions`, which must be an agent while the gateway accepts work.
///
/// # Errors
/// `503 shutting_down` while the gateway drains, the authentication refusal, and `403` for an
/// operator.
fn submitting_agent(state: &AppState, headers: &HeaderMap) -> Result<Caller, Problem> {
    if !state.accepting() {
        return Err(Problem::shutting_down());
    }
    let who = caller(state, headers)?;
    if who.role != Role::Agent {
        return Err(Problem::forbidden(format!(
            "`{}` is an operator; actions are submitted with agent tokens",
            who.name
        )));
    }
    Ok(who)
}

/// The `POST /v1/actions` body read as JSON.
///
/// # Errors
/// 400 `bad_request` saying first whether the body is JSON at all; a JSON body of the wrong
/// shape names the member (serde's words: `invalid type: integer -1, expected u64` and the
/// like).
fn parse_new_action(envelope: &[u8]) -> Result<NewActionBody, Problem> {
    serde_json::from_slice(envelope).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "the body is not valid JSON"
            }
            serde_json::error::Category::Data | serde_json::error::Category::Io => {
                "the body is JSON, but not an action"
            }
        };
        api_bad_request(format!(
            "body: {what}: expected {{provider, method, path, headers?, body? | body_base64?, task?, priority?, deadline?, max_wait_seconds?, idempotency_key?, desired_outcome?}}: {e}"
        ))
    })
}

/// The `method` member as an HTTP method (trimmed, any case).
fn parse_method(text: &str) -> Result<Method, Problem> {
    Method::from_bytes(text.trim().to_ascii_uppercase().as_bytes())
        .map_err(|_| api_bad_request(format!("method: `{text}` is not an HTTP method")))
}

/// The payload of the action, taken out of `body` or `body_base64` (at most one of them) and
/// handed to `keep`, which accounts it in place of the envelope; empty when neither is given.
fn take_payload(
    request: &mut NewActionBody,
    keep: impl FnOnce(Vec<u8>) -> Bytes,
) -> Result<Bytes, Problem> {
    match (request.body.take(), request.body_base64.take()) {
        (Some(_), Some(_)) => Err(api_bad_request(
            "body, body_base64: give one of them, not both",
        )),
        (Some(text), None) => Ok(keep(text.into_bytes())),
        (None, Some(encoded)) => {
            Ok(keep(decode_base64(&encoded).map_err(|reason| {
                api_bad_request(format!("body_base64: {reason}"))
            })?))
        }
        (None, None) => Ok(Bytes::new()),
    }
}

/// Refuses a `desired_outcome` longer than [`MAX_DESIRED_OUTCOME_CHARS`].
fn check_desired_outcome(text: Option<&str>) -> Result<(), Problem> {
    let Some(text) = text else {
        return Ok(());
    };
    let chars = text.chars().count();
    if chars > MAX_DESIRED_OUTCOME_CHARS {
        return Err(api_bad_request(format!(
            "desired_outcome: {chars} characters, at most {MAX_DESIRED_OUTCOME_CHARS} allowed (one paragraph for the case file)"
        ))
        .with_extension("member", "desired_outcome".into())
        .with_extension("limit", MAX_DESIRED_OUTCOME_CHARS.into()));
    }
    Ok(())
}

/// The headers sent to the provider: the `headers` member, with the one idempotency key
/// ([`idempotency_key`]) under the provider's key header.
fn provider_headers(
    state: &AppState,
    own: &HeaderMap,
    request: &NewActionBody,
) -> Result<HeaderMap, Problem> {
    let key_header = door::key_header(state.policy.providers.get(&request.provider));
    let key = idempotency_key(own, request, key_header)?;
    let mut incoming = HeaderMap::new();
    for (name, value) in &request.headers {
        refuse_backstop_header(name)?;
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| api_bad_request(format!("headers: `{name}` is not a header name")))?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| api_bad_request(format!("headers.{name}: not a valid header value")))?;
        incoming.append(name, value);
    }
    if let Some(key) = key {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key_header.as_bytes()),
            HeaderValue::from_str(&key),
        ) else {
            return Err(api_bad_request(format!(
                "idempotency_key: cannot be given under the provider's header `{key_header}`"
            )));
        };
        incoming.insert(name, value);
    }
    Ok(incoming)
}

/// 400 for an `X-Backstop-*` header inside `headers`: backstop's own headers are members of
/// the action here (`task`, `priority`, `deadline`), never forwarded, and a silent choice
/// between the two places would be ambiguous.
fn refuse_backstop_header(name: &str) -> Result<(), Problem> {
    let lower = name.to_ascii_lowercase();
    let Some(rest) = lower.strip_prefix(door::BACKSTOP_HEADER_PREFIX) else {
        return Ok(());
    };
    let member = match rest {
        "task" | "priority" | "deadline" => format!("; give it as the member `{rest}`"),
        _ => String::new(),
    };
    Err(api_bad_request(format!(
        "headers: `{name}` is backstop's own header, not one for the provider{member}"
    )))
}

/// The members a proxied call gives in `X-Backstop-*` headers: `priority`, `deadline`, `task`
/// (taken out of `request`) and `max_wait_seconds`.
fn backstop_headers(request: &mut NewActionBody) -> Result<BackstopHeaders, Problem> {
    let priority = parse_priority(request.priority.as_deref())?;
    let deadline = request
        .deadline
        .as_deref()
        .map(|d| {
            door::parse_instant(d).map_err(|reason| api_bad_request(format!("deadline: {reason}")))
        })
        .transpose()?;
    check_task(request.task.as_deref())?;
    Ok(BackstopHeaders {
        task_id: request.task.take(),
        priority,
        deadline,
        max_wait: request.max_wait_seconds.map(Duration::from_secs),
    })
}

/// The `priority` member (any case); `normal` when it is not given.
fn parse_priority(text: Option<&str>) -> Result<Priority, Problem> {
    match text.map(str::to_ascii_lowercase).as_deref() {
        None | Some("normal") => Ok(Priority::Normal),
        Some("interactive") => Ok(Priority::Interactive),
        Some("background") => Ok(Priority::Background),
        Some(other) => Err(api_bad_request(format!(
            "priority: `{other}` is not one of interactive, normal, background"
        ))),
    }
}

/// Refuses a `task` member that is not a usable task id ([`is_task_id`]).
fn check_task(task: Option<&str>) -> Result<(), Problem> {
    match task {
        Some(task) if !is_task_id(task) => Err(api_bad_request(format!(
            "task: a task id must be 1 to {} visible ASCII characters",
            door::MAX_TASK_ID_BYTES
        ))),
        _ => Ok(()),
    }
}

/// The request spec of the checked action, as the proxy door would build it for a call to
/// `/{provider}{path}`.
fn action_spec(
    state: &AppState,
    who: Caller,
    method: Method,
    request: NewActionBody,
    incoming: &HeaderMap,
    payload: Bytes,
    backstop: BackstopHeaders,
) -> Result<ActionSpec, Problem> {
    let single_attempt = payload.len() > state.door.max_buffered_body_bytes;
    let path_and_query = format!("/{}{}", request.provider, request.path);
    let mut spec = door::build_spec(
        state,
        who.name,
        method,
        &path_and_query,
        incoming,
        payload,
        single_attempt,
        backstop,
    )?;
    // `provider` alone decides the provider: the checks above keep the path below its root,
    // and this one holds whatever the door's reading of `/{provider}{path}` may become.
    if spec.route.provider != request.provider {
        return Err(path_refused(
            &request.path,
            &format!("it would reach provider `{}`", spec.route.provider),
        ));
    }
    // Sanitized on intake (it is kept with the action); the case file built from it still
    // lists `desired_outcome` in its redactions.
    spec.desired_outcome = request
        .desired_outcome
        .map(|text| state.secrets.scrub(&text));
    Ok(spec)
}

/// Whether `task` is a usable task id: 1 to [`door::MAX_TASK_ID_BYTES`] visible ASCII characters.
fn is_task_id(task: &str) -> bool {
    !task.is_empty()
        && task.len() <= door::MAX_TASK_ID_BYTES
        && task.bytes().all(|b| b.is_ascii_graphic())
}

/// The `503 shutting_down` of a `POST /v1/actions` that arrives while the gateway drains,
/// whatever its token (never a 401): nothing was recorded or sent. As the proxy door's drain
/// answer ([`door::draining`]) it names the request's task — `Backstop-Task` and `task`, the
/// `task` member or one minted as a submission mints one — and for a write its key —
/// `Idempotency-Key` and `idempotency_key`, the key the action API reads (this request's
/// `Idempotency-Key` header, the provider's key header inside `headers`, the `idempotency_key`
/// member) or one minted to submit the action again with — with `Backstop-Action-Id: 0`: no
/// action exists. A task or key a submission would refuse is not echoed, and nothing is minted
/// in its place. The body is read only for a caller authenticated as an agent, and under the
/// shared cap on buffered bodies ([`crate::body_budget`]); a caller that is not, or a body that
/// cannot be read (in time, within [`submit_body_limit`] and the cap) or parsed, gets the plain
/// 503.
pub async fn draining(state: &AppState, headers: &HeaderMap, body: axum::body::Body) -> Response {
    if !state
        .auth
        .authenticate(headers)
        .is_ok_and(|caller| caller.role == Role::Agent)
    {
        return Problem::shutting_down().into_response();
    }
    let read = tokio::time::timeout(
        state.door.body_read_timeout,
        state.body_budget.read(
            body,
            door::declared_length(headers),
            submit_body_limit(state.door),
        ),
    )
    .await;
    let Some(request) = read
        .ok()
        .and_then(Result::ok)
        .and_then(|held| serde_json::from_slice::<NewActionBody>(held.as_slice()).ok())
    else {
        return Problem::shutting_down().into_response();
    };
    let task = match &request.task {
        Some(task) if is_task_id(task) => Some(task.clone()),
        Some(_) => None,
        None => Some(door::mint_id("task-")),
    };
    let write = Method::from_bytes(request.method.trim().to_ascii_uppercase().as_bytes())
        .is_ok_and(|method| !door::is_safe(&method));
    let key = if write {
        let key_header = door::key_header(state.policy.providers.get(&request.provider));
        match idempotency_key(headers, &request, key_header) {
            Ok(Some(key)) => Some(key),
            Ok(None) => Some(door::mint_key()),
            Err(_) => None,
        }
    } else {
        None
    };
    door::draining_answer(task, key)
}

/// A 400 of the action API naming the `path` member (`member: "path"`) and `reason`.
fn path_refused(path: &str, reason: &str) -> Problem {
    let shown: String = path.chars().take(64).flat_map(char::escape_debug).collect();
    api_bad_request(format!("path: `{shown}`: {reason}; nothing was sent"))
        .with_extension("member", "path".into())
}

/// Checks the `path` member of `POST /v1/actions` (path and query) before anything else reads
/// it, as the proxy door's request line is checked before it is routed:
///
/// - it starts with `/`;
/// - every character may stand in a URL path (or query) as written: no control character
///   (NUL included), no whitespace, none of `<`, `>`, `` ` `` (path) or `"`, `<`, `>` (query),
///   and no `#` (a fragment is never sent to a server) — each must be percent-encoded;
/// - its percent-encodings are well formed;
/// - its normalized form (RFC 3986 §5.2.4, `%2E%2E` being `..`; also with `%2F` read as `/`,
///   as some servers do) never climbs above its own root: the `provider` member names the
///   provider, and `/../other/…` must not reach another one with that provider's credential.
///
/// # Errors
/// 400 `bad_request` of the action API naming `path` (`member: "path"`) and the reason.
fn check_path(provider: &str, path: &str) -> Result<(), Problem> {
    if !path.starts_with('/') {
        return Err(path_refused(path, "must start with `/`"));
    }
    let mut in_query = false;
    for (n, c) in path.chars().enumerate() {
        let what = if c == '\0' {
            Some("a NUL character".to_owned())
        } else if c == ' ' {
            Some("a space".to_owned())
        } else if c.is_whitespace() || c.is_control() {
            Some(format!("the character U+{:04X}", u32::from(c)))
        } else if c == '#' {
            Some("`#`, which starts a fragment that is never sent to a server".to_owned())
        } else if matches!(c, '<' | '>') || (c == '`' && !in_query) || (c == '"' && in_query) {
            Some(format!("`{c}`"))
        } else {
            None
        };
        if let Some(what) = what {
            let mut utf8 = [0; 4];
            let encoded: String = c
                .encode_utf8(&mut utf8)
                .bytes()
                .map(|b| format!("%{b:02X}"))
                .collect();
            return Err(path_refused(
                path,
                &format!(
                    "character {} is {what}, which a URL {} cannot carry as written; percent-encode it ({encoded})",
                    n + 1,
                    if in_query { "query" } else { "path" },
                ),
            ));
        }
        in_query |= c == '?';
    }
    let bare = path.split_once('?').map_or(path, |(bare, _)| bare);
    let climbs = |reading: &str| {
        format!(
            "{reading}climbs above its root with `..`; the provider is the one `provider` names (`{provider}`), never one the path reaches"
        )
    };
    if has_malformed_percent(bare) {
        return Err(path_refused(
            path,
            "a `%` must be followed by two hex digits (RFC 3986 §2.1)",
        ));
    }
    if door::normalize_path(bare).is_err() {
        return Err(path_refused(path, &climbs("it ")));
    }
    if bare.contains("%2F") || bare.contains("%2f") {
        let decoded = bare.replace("%2F", "/").replace("%2f", "/");
        if door::normalize_path(&decoded).is_err() {
            return Err(path_refused(path, &climbs("read with `%2F` as `/`, it ")));
        }
    }
    Ok(())
}

/// Whether `text` has a `%` not followed by two hex digits.
fn has_malformed_percent(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.iter().enumerate().any(|(i, b)| {
        *b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    })
}

/// The one idempotency key of a `POST /v1/actions`, from the places an agent may give it: this
/// request's own `Idempotency-Key` header (the IETF draft's header on a `POST`), the provider's
/// key header `key_header` inside `headers`, and the `idempotency_key` member. Each is checked
/// where it was given ([`door::checked_idempotency_key`]); the checked key is returned.
///
/// # Errors
/// 400 `bad_header` for an unusable key in a header (or one header given twice), 400
/// `bad_request` for an unusable `idempotency_key` member, and 400 `bad_request` naming the
/// places (`places`) when two of them give different keys: backstop never picks one silently.
fn idempotency_key(
    own: &HeaderMap,
    request: &NewActionBody,
    key_header: &str,
) -> Result<Option<String>, Problem> {
    let mut given: Vec<(String, String)> = Vec::new();
    let mut own_values = own.get_all(door::IDEMPOTENCY_KEY).iter();
    if let Some(value) = own_values.next() {
        if own_values.next().is_some() {
            return Err(Problem::bad_header(
                "Idempotency-Key",
                "given more than once",
            ));
        }
        let text = value.to_str().map_err(|_| {
            Problem::bad_header("Idempotency-Key", "the value is not visible ASCII text")
        })?;
        let key = door::checked_idempotency_key("Idempotency-Key", text.trim())?;
        given.push(("the `Idempotency-Key` header".to_owned(), key.to_owned()));
    }
    let mut in_map = request
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case(key_header));
    if let Some((name, value)) = in_map.next() {
        if in_map.next().is_some() {
            return Err(api_bad_request(format!(
                "headers: `{key_header}` is given more than once"
            )));
        }
        let key = door::checked_idempotency_key(name, value.trim())?;
        given.push((format!("`headers.{name}`"), key.to_owned()));
    }
    if let Some(value) = &request.idempotency_key {
        let key = validate_idempotency_key(value).map_err(|e| {
            let reason = match e {
                ReconcileError::InvalidIdempotencyKey { reason } => reason,
                other => other.to_string(),
            };
            api_bad_request(format!(
                "idempotency_key: not a usable idempotency key: {reason}"
            ))
            .with_extension("member", "idempotency_key".into())
        })?;
        given.push(("`idempotency_key`".to_owned(), key.to_owned()));
    }
    if given.iter().any(|(_, key)| *key != given[0].1) {
        let places: Vec<&str> = given.iter().map(|(place, _)| place.as_str()).collect();
        return Err(api_bad_request(format!(
            "the idempotency key is given in {} with different values; give one key, in one place (nothing was sent)",
            places.join(" and ")
        ))
        .with_extension("places", json!(places)));
    }
    Ok(given.into_iter().next().map(|(_, key)| key))
}

/// 400 `bad_request` of the action API: the JSON request, a query parameter or an id is
/// malformed. Titled for the action API (nothing is forwarded from here), with `sent: false`.
fn api_bad_request(detail: impl Into<String>) -> Problem {
    let mut problem = Problem::bad_request(detail);
    problem.title = "The action API request is malformed".to_owned();
    problem
}

/// The `wait` parameter of `GET /v1/actions/{id}` (other parameters are ignored).
///
/// # Errors
/// 400 `bad_request` of the action API naming the parameter (`parameter: "wait"`) when it is
/// given more than once (`?wait=30s&wait=1` names two waits), or when the query string is not
/// `application/x-www-form-urlencoded`.
fn wait_parameter(uri: &Uri) -> Result<Option<String>, Problem> {
    let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map_err(|e| api_bad_request(format!("query: {}", e.body_text())))?;
    let mut waits = pairs
        .into_iter()
        .filter(|(name, _)| name == "wait")
        .map(|(_, value)| value);
    let wait = waits.next();
    if waits.next().is_some() {
        return Err(api_bad_request(
            "wait: the parameter is repeated; give one `?wait=` duration, like ?wait=30s",
        )
        .with_extension("parameter", "wait".into()));
    }
    Ok(wait)
}

/// `?wait=`: a Go-style duration (`30s`, `1m0s`, `500ms`) or bare seconds (`30`, read as
/// `30s`), through one parser; any longer wait — however large, even beyond what a duration can
/// hold — is capped at [`MAX_LONG_POLL`] (60 s).
///
/// # Errors
/// 400 `bad_request` for text that is not such a duration (`soon`, `-1s`, `1x`), naming the
/// parameter (`parameter: "wait"`).
fn parse_wait(text: &str) -> Result<Duration, Problem> {
    let text = text.trim();
    let spelled = if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        format!("{text}s")
    } else {
        text.to_owned()
    };
    match backstop_core::duration::parse_go_duration(&spelled) {
        Ok(wait) => Ok(wait.min(MAX_LONG_POLL)),
        Err(_) if is_duration_shaped(&spelled) => Ok(MAX_LONG_POLL),
        Err(e) => Err(api_bad_request(format!(
            "wait: `{}` is not a duration like 30s or 500ms: {e}",
            text.chars().take(64).collect::<String>()
        ))
        .with_extension("parameter", "wait".into())),
    }
}

/// Whether `text` is well-formed duration text (`<digits>[.<digits>]<unit>` repeated), so that
/// a parse failure can only mean it is too large.
fn is_duration_shaped(text: &str) -> bool {
    let mut rest = text;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let digits = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        if digits == 0 || rest[..digits].matches('.').count() > 1 {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = ["ns", "us", "µs", "μs", "ms", "s", "m", "h"]
            .iter()
            .find(|u| rest.starts_with(**u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    true
}

/// `GET /v1/actions/{id}`; every refusal is logged at INFO ([`Problem::log_refusal_to`]), with
/// the caller once it is known.
async fn show(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let mut who = None;
    match show_inner(&state, &id, &uri, &headers, &mut who).await {
        Ok(body) => {
            let (id, attempts) = (body["id"].as_i64(), body["attempts"].as_u64());
            let mut response = axum::Json(body).into_response();
            for (name, value) in [
                ("backstop-action-id", id.map(|v| v.to_string())),
                ("backstop-attempts", attempts.map(|v| v.to_string())),
            ] {
                if let Some(value) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                    response
                        .headers_mut()
                        .insert(HeaderName::from_static(name), value);
                }
            }
            response
        }
        Err(problem) => {
            problem.log_refusal_to("GET /v1/actions/{id}", who.as_ref());
            problem.into_response()
        }
    }
}

/// [`show`]'s work; `caller_of` is set to the caller once it is authenticated.
async fn show_inner(
    state: &AppState,
    id: &str,
    uri: &Uri,
    headers: &HeaderMap,
    caller_of: &mut Option<Caller>,
) -> Result<Value, Problem> {
    let who = caller_of.insert(caller(state, headers)?).clone();
    let engine = engine(state, "GET /v1/actions/{id}")?;
    let wait = wait_parameter(uri)?
        .as_deref()
        .map(parse_wait)
        .transpose()?;
    let number: i64 = id
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| Problem::not_yours("action", id))?;
    let store_error = |e: EngineError| Problem::store_error(e.to_string());
    let (record, _) = engine
        .action_view(number)
        .await
        .map_err(store_error)?
        .ok_or_else(|| Problem::not_yours("action", id))?;
    let owner = record.agent == who.name && who.role == Role::Agent;
    if !owner && who.role != Role::Operator {
        return Err(Problem::not_yours("action", id));
    }
    if let Some(wait) = wait {
        long_poll(&engine, number, wait).await;
    }
    let (record, attempts) = engine
        .action_view(number)
        .await
        .map_err(store_error)?
        .ok_or_else(|| Problem::not_yours("action", id))?;
    let completion = engine.completion(number).and_then(|rx| rx.borrow().clone());
    let honours_key = state
        .policy
        .providers
        .get(&record.provider)
        .is_some_and(|p| p.idempotency_header.is_some());
    let mut body = action_view(&record, &attempts, honours_key);
    if let Some(completion) = completion {
        match completion.as_ref() {
            Completion::Response { response, .. } if owner => {
                let mut kept = json!({
                    "status": response.status,
                    "headers": response.headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>(),
                    "body_truncated": response.body_truncated,
                });
                match std::str::from_utf8(&response.body) {
                    Ok(text) => kept["body"] = Value::String(text.to_owned()),
                    Err(_) => kept["body_base64"] = Value::String(encode_base64(&response.body)),
                }
                body["response"] = kept;
            }
            Completion::Response { .. } => {}
            Completion::Outcome {
                receipt, detail, ..
            } => {
                body["detail"] = Value::String(detail.clone());
                // A reconciliation the store could not record yet: its answer named the id.
                if let (Value::Null, Some(id)) = (
                    &body["provider_operation_id"],
                    &receipt.provider_operation_id,
                ) {
                    body["provider_operation_id"] = Value::String(id.clone());
                }
            }
        }
    }
    Ok(body)
}

/// The uniform view of a stored action (`GET /v1/actions/{id}`), without the kept response:
/// `{id, task, agent, provider, method, route, request_class, state, outcome, context,
/// attempts, idempotency_key, provider_operation_id}` plus `reconciled: true` for a write found
/// at the provider and `escalation_id` for an escalated one.
///
/// `state` is `completed` once the action has ended, else the stored state (`pending`,
/// `sent`, …). `context` is always the SPEC §5 context (`sent`, `response_received`,
/// `attempts`, `total_wait_ms`, `last_status`, `last_signal`, `boundary`, `next_safe`, each
/// option with its `description`) once the action has ended, `null` before; members a stored
/// context lacks are derived from the attempts. `detail` says in words why the gateway ended
/// the action, where it recorded why (a close at a restart, a cancellation). Where the store kept a marker instead of a context (a
/// reconciled, escalated or task-cancelled action), the context is derived from the stored
/// attempts: waits are the gaps between one attempt's result and the next attempt's send, and
/// `next_safe` is what is safe from that outcome (an escalation: `query_status`,
/// `retry_same_key` when `honours_key`, `abort`).
pub fn action_view(
    record: &backstop_store::ActionRecord,
    attempts: &[backstop_store::AttemptRecord],
    honours_key: bool,
) -> Value {
    let finished = record.state == backstop_store::ActionState::Finished;
    let is_write = !matches!(record.method.as_str(), "GET" | "HEAD" | "OPTIONS");
    let outcome = record.outcome.map(|o| o.as_str());
    let stored = record.outcome_context.clone().unwrap_or(Value::Null);
    let escalation_id = stored.get("escalation").and_then(Value::as_i64);
    let last_uncertain = attempts
        .last()
        .and_then(|a| a.disposition)
        .is_some_and(|d| d.as_str() == "uncertain");
    let reconciled = outcome == Some("succeeded")
        && (stored.get("reconciled") == Some(&Value::Bool(true)) || (is_write && last_uncertain));
    let mut context = if !finished {
        Value::Null
    } else if stored.get("sent").is_some() && stored.get("next_safe").is_some() {
        // The stored context, completed from the attempts where it left a member out (an
        // action closed at a restart keeps only what that close knew), so that every view
        // has every member.
        let mut context = derived_context(attempts, Vec::new());
        if let (Some(map), Some(kept)) = (context.as_object_mut(), stored.as_object()) {
            for (name, value) in kept {
                if !matches!(name.as_str(), "reconciled" | "detail" | "escalation") {
                    map.insert(name.clone(), value.clone());
                }
            }
        }
        context
    } else {
        let next_safe: Vec<Value> = match outcome {
            Some("succeeded") => Vec::new(),
            Some("escalated") => {
                let mut options = vec![json!({"option": "query_status"})];
                if honours_key {
                    options.push(json!({"option": "retry_same_key"}));
                }
                options.push(json!({"option": "abort"}));
                options
            }
            _ => vec![json!({"option": "abort"})],
        };
        derived_context(attempts, next_safe)
    };
    describe_next_safe(&mut context);
    let mut body = json!({
        "id": record.id.0,
        "task": record.task_id,
        "agent": record.agent,
        "provider": record.provider,
        "method": record.method,
        "route": record.route,
        "request_class": record.request_class,
        "state": if finished { "completed" } else { record.state.as_str() },
        "outcome": outcome,
        "context": context,
        "attempts": attempts.len(),
        "idempotency_key": is_write.then_some(record.idempotency_key.clone()),
        "provider_operation_id": record.provider_operation_id,
    });
    if reconciled {
        body["reconciled"] = Value::Bool(true);
    }
    // Why the gateway ended it, in words, where it said so (a restart's close, say).
    if let Some(detail) = stored
        .get("detail")
        .filter(|_| finished)
        .and_then(Value::as_str)
    {
        body["detail"] = Value::String(detail.to_owned());
    }
    if let Some(escalation) = escalation_id {
        body["escalation_id"] = json!(escalation);
    }
    body
}

/// Gives each `next_safe` option of `context` its `description`, as a problem answer
/// carries it ([`NextSafe::description`]); an option this build does not know keeps what it
/// has.
fn describe_next_safe(context: &mut Value) {
    let Some(options) = context.get_mut("next_safe").and_then(Value::as_array_mut) else {
        return;
    };
    for option in options {
        let Ok(known) = serde_json::from_value::<NextSafe>(option.clone()) else {
            continue;
        };
        if let Some(map) = option.as_object_mut() {
            map.entry("description")
                .or_insert_with(|| Value::String(known.description()));
        }
    }
}

/// A SPEC §5 context rebuilt from the stored attempts.
fn derived_context(attempts: &[backstop_store::AttemptRecord], next_safe: Vec<Value>) -> Value {
    let total_wait_ms: i64 = attempts
        .windows(2)
        .filter_map(|pair| {
            let previous = pair[0].finished_at?;
            let waited = pair[1].started_at.duration_since(previous).as_millis();
            i64::try_from(waited).ok().map(|ms| ms.max(0))
        })
        .sum();
    let last = attempts.last();
    json!({
        "sent": !attempts.is_empty(),
        "response_received": attempts.iter().any(|a| a.status.is_some()),
        "attempts": attempts.len(),
        "total_wait_ms": total_wait_ms,
        "last_status": last.and_then(|a| a.status),
        "last_signal": last.and_then(|a| a.disposition).map(|d| d.as_str()),
        "boundary": Value::Null,
        "next_safe": next_safe,
    })
}

/// Waits until the action completes or `wait` passes. A background action is awaited on its
/// completion; any other (a proxied call still running) is re-read from the store every 100 ms.
async fn long_poll(engine: &Engine, id: i64, wait: Duration) {
    let deadline = tokio::time::Instant::now() + wait;
    if let Some(mut rx) = engine.completion(id) {
        let _ = tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some)).await;
        return;
    }
    while tokio::time::Instant::now() < deadline {
        match engine.action_view(id).await {
            Ok(Some((record, _))) if record.state != backstop_store::ActionState::Finished => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(100).min(wait)).await;
    }
}

/// `POST /v1/tasks/{id}/cancel`; every refusal is logged at INFO ([`Problem::log_refusal_to`]),
/// with the caller once it is known.
async fn cancel(
    State(state): State<Arc<AppState>>,
    Path(task): Path<String>,
    headers: HeaderMap,
) -> Response {
    let mut known = None;
    let result = async {
        let who = known.insert(caller(&state, &headers)?).clone();
        let engine = engine(&state, "POST /v1/tasks/{id}/cancel")?;
        let agent = (who.role == Role::Agent).then_some(who.name.as_str());
        engine
            .cancel_task_as(&task, agent)
            .await
            .map_err(|e| match e {
                EngineError::UnknownTask(_) => Problem::not_yours("task", &task),
                other => Problem::store_error(other.to_string()),
            })
    }
    .await;
    match result {
        Ok(report) => (StatusCode::OK, axum::Json(report)).into_response(),
        Err(problem) => {
            problem.log_refusal_to("POST /v1/tasks/{id}/cancel", known.as_ref());
            let mut response = problem.into_response();
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
    }
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (RFC 4648 §4).
pub fn encode_base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (RFC 4648 §4; padding optional, whitespace not allowed).
///
/// # Errors
/// A sentence naming the first offending position.
pub fn decode_base64(text: &str) -> Result<Vec<u8>, String> {
    let trimmed = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for (i, c) in trimmed.bytes().enumerate() {
        let v = ALPHABET
            .iter()
            .position(|a| *a == c)
            .ok_or_else(|| format!("character {} (`{}`) is not base64", i + 1, char::from(c)))?;
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if trimmed.len() % 4 == 1 {
        return Err("the length is not a valid base64 length".to_owned());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_rfc4648_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(encode_base64(plain.as_bytes()), encoded);
            assert_eq!(decode_base64(encoded).unwrap(), plain.as_bytes());
        }
        assert!(decode_base64("Zm9v!").unwrap_err().contains("character 5"));
    }

    #[test]
    fn wait_accepts_durations_and_seconds_and_is_capped() {
        assert_eq!(parse_wait("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_wait("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_wait("5").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_wait("10m").unwrap(), MAX_LONG_POLL);
        assert_eq!(parse_wait("soon").unwrap_err().status, 400);
        assert_eq!(parse_wait("-1s").unwrap_err().status, 400);
        assert_eq!(parse_wait("1x").unwrap_err().status, 400);
    }

    #[test]
    fn wait_beyond_what_a_duration_holds_is_capped_like_any_long_wait() {
        for text in [
            "18446744073709551615",
            "99999999999999999999999999999",
            "99999999999s",
            "99999999999999999999999999999h",
        ] {
            assert_eq!(parse_wait(text).unwrap(), MAX_LONG_POLL, "{text}");
        }
    }
}
