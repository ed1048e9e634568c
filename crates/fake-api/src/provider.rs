//! The provider's decisions for one request: which route, which fault, quota, idempotency, the
//! handler's work. All of it runs under one lock and without awaiting, so the provider's state
//! changes atomically per request; the caller then carries the decision out (answer, stream,
//! hold, or drop the connection).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::attempt::{credential_digest, sha256_hex, AttemptOutcome, AttemptRecord};
use crate::clock::Now;
use crate::compiled::{Compiled, CompiledRoute, RouteMatch, MAX_INTERVAL_MS, MAX_STREAM_EVENTS};
use crate::config::{CompletionApi, Fault, Handler, ScopeKey};
use crate::quota::{self, QuotaState};
use crate::rng::SplitMix64;

/// A complete answer.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// What the caller must do with the connection.
#[derive(Debug)]
pub(crate) enum Action {
    /// Send this answer.
    Reply(Reply),
    /// Send a 200 event stream: `chunks` in order, the first at once and each later one
    /// `interval` after the one before.
    Stream {
        headers: HeaderMap,
        chunks: Vec<Bytes>,
        interval: Duration,
    },
    /// Hold for `hold`, then close the connection without a response byte.
    Drop {
        hold: Duration,
        outcome: AttemptOutcome,
    },
}

impl Action {
    /// The headers of an answer (`Reply` or `Stream`); `None` for `Drop`, which sends none.
    pub(crate) fn headers_mut(&mut self) -> Option<&mut HeaderMap> {
        match self {
            Action::Reply(reply) => Some(&mut reply.headers),
            Action::Stream { headers, .. } => Some(headers),
            Action::Drop { .. } => None,
        }
    }

    /// The status this action answers with; `None` when it sends no answer.
    pub(crate) fn status(&self) -> Option<StatusCode> {
        match self {
            Action::Reply(reply) => Some(reply.status),
            Action::Stream { .. } => Some(StatusCode::OK),
            Action::Drop { .. } => None,
        }
    }
}

/// Identifies an attempt record across a possible reset.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    generation: u64,
    index: usize,
}

/// One created object.
#[derive(Debug, Clone)]
struct Resource {
    object: Value,
    id: String,
    reference: Option<String>,
    idempotency_key: Option<String>,
}

/// A stored result for an idempotency key.
#[derive(Debug, Clone)]
struct Stored {
    fingerprint: String,
    status: StatusCode,
    body: Bytes,
}

/// Everything the provider remembers; cleared by a reset.
#[derive(Debug)]
pub(crate) struct ProviderState {
    generation: u64,
    attempts: Vec<AttemptRecord>,
    calls: Vec<u64>,
    rng: SplitMix64,
    quotas: HashMap<(usize, String), QuotaState>,
    collections: HashMap<String, Vec<Resource>>,
    idempotency: HashMap<String, Stored>,
}

impl ProviderState {
    /// Fresh state for `compiled`.
    pub(crate) fn new(compiled: &Compiled, generation: u64) -> Self {
        ProviderState {
            generation,
            attempts: Vec::new(),
            calls: vec![0; compiled.routes.len()],
            rng: SplitMix64::new(compiled.seed),
            quotas: HashMap::new(),
            collections: HashMap::new(),
            idempotency: HashMap::new(),
        }
    }

    /// Forgets everything (attempts, counters, quotas, stores) and reseeds the generator.
    pub(crate) fn reset(&mut self, compiled: &Compiled) {
        *self = ProviderState::new(compiled, self.generation + 1);
    }

    /// All attempt records so far.
    pub(crate) fn attempts(&self) -> &[AttemptRecord] {
        &self.attempts
    }

    /// Sets the end of an attempt; `None` if a reset happened meanwhile.
    pub(crate) fn finish(
        &mut self,
        ticket: Ticket,
        outcome: AttemptOutcome,
        status: Option<u16>,
    ) -> Option<AttemptRecord> {
        if ticket.generation != self.generation {
            return None;
        }
        let record = self.attempts.get_mut(ticket.index)?;
        record.outcome = outcome;
        record.status = status;
        Some(record.clone())
    }
}

/// The request as the provider sees it.
pub(crate) struct Incoming<'a> {
    pub(crate) method: &'a Method,
    pub(crate) path: &'a str,
    pub(crate) query: Option<&'a str>,
    pub(crate) headers: &'a HeaderMap,
    /// `None` when the body was over the size limit.
    pub(crate) body: Option<&'a Bytes>,
}

fn error_body(code: &str, message: &str) -> Bytes {
    Bytes::from(json!({"error": {"code": code, "type": code, "message": message}}).to_string())
}

fn json_reply(status: StatusCode, body: Bytes) -> Reply {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Reply {
        status,
        headers,
        body,
    }
}

fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn header_str<'h>(headers: &'h HeaderMap, name: &header::HeaderName) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn query_pairs(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

/// What [`decide`] decided for one request.
pub(crate) struct Decision {
    /// What to do with the connection.
    pub(crate) action: Action,
    /// A `slow` answer: hold this long first (the work is done), then carry out `action`; the
    /// attempt stays `pending` until then.
    pub(crate) hold: Option<Duration>,
    /// The attempt's record.
    pub(crate) ticket: Ticket,
    /// The record, when the attempt already ended (an answer sent without a hold).
    pub(crate) finished: Option<AttemptRecord>,
}

/// Decides what to do with one request and records the attempt (still `pending`).
pub(crate) fn decide(
    compiled: &Compiled,
    state: &mut ProviderState,
    request: &Incoming<'_>,
    now: Now,
) -> Decision {
    let auth = request.headers.get(&compiled.auth_header);
    let record = AttemptRecord {
        seq: state.attempts.len() as u64 + 1,
        at: format!("{:.3}", now.wall),
        method: request.method.to_string(),
        path: request.path.to_owned(),
        query: request.query.map(str::to_owned),
        route: None,
        call: None,
        idempotency_key: header_str(request.headers, &compiled.idempotency_header)
            .map(str::to_owned),
        body_sha256: request
            .body
            .filter(|b| !b.is_empty())
            .map(|b| sha256_hex(b)),
        body_bytes: request.body.map_or(0, Bytes::len),
        auth_present: auth.is_some(),
        auth_sha256: auth.map(|v| credential_digest(v.as_bytes())),
        status: None,
        outcome: AttemptOutcome::Pending,
        fault: None,
        replayed: false,
    };
    let ticket = Ticket {
        generation: state.generation,
        index: state.attempts.len(),
    };
    state.attempts.push(record);
    let mut hold = None;
    let mut action = decide_inner(compiled, state, request, now, ticket.index, &mut hold);
    if let Some(headers) = action.headers_mut() {
        stamp_date(headers, now);
    }
    let finished = match (&action, hold) {
        (_, Some(_)) | (Action::Drop { .. }, None) => None,
        (answer, None) => state.finish(
            ticket,
            AttemptOutcome::Answered,
            answer.status().map(|s| s.as_u16()),
        ),
    };
    Decision {
        action,
        hold,
        ticket,
        finished,
    }
}

/// Sets the `Date` header of an answer to `now` (whole seconds).
pub(crate) fn stamp_date(headers: &mut HeaderMap, now: Now) {
    if let Ok(value) = HeaderValue::from_str(&quota::http_date(quota::floor_to_second(now.wall))) {
        headers.insert(header::DATE, value);
    }
}

fn choose_fault(route: &CompiledRoute, call: u64, rng: &mut SplitMix64) -> Option<Fault> {
    let scripted = usize::try_from(call - 1)
        .ok()
        .and_then(|i| route.script.get(i));
    if let Some(fault) = scripted {
        return Some(fault.clone());
    }
    for rule in &route.faults {
        let hit = if !rule.on_calls.is_empty() {
            rule.on_calls.contains(&call)
        } else if let Some(n) = rule.every_nth {
            call % n == 0
        } else if let Some(p) = rule.probability {
            rng.next_unit() < p
        } else {
            false
        };
        if hit {
            return Some(rule.fault.clone());
        }
    }
    None
}

fn fault_name(fault: &Fault) -> &'static str {
    match fault {
        Fault::Pass => "pass",
        Fault::Status { .. } => "status",
        Fault::ErrorCode { .. } => "error_code",
        Fault::Timeout { .. } => "timeout",
        Fault::Slow { .. } => "slow",
        Fault::Drop => "drop",
        Fault::StoreThenDrop { .. } => "store_then_drop",
    }
}

fn decide_inner(
    compiled: &Compiled,
    state: &mut ProviderState,
    request: &Incoming<'_>,
    now: Now,
    index: usize,
    hold: &mut Option<Duration>,
) -> Action {
    let (route_index, params) = match compiled.match_route(request.method, request.path) {
        RouteMatch::Found { index, params } => (index, params),
        RouteMatch::MethodNotAllowed => {
            return Action::Reply(json_reply(
                StatusCode::METHOD_NOT_ALLOWED,
                error_body(
                    "method_not_allowed",
                    &format!("{} is not allowed on {}", request.method, request.path),
                ),
            ))
        }
        RouteMatch::NotFound => {
            return Action::Reply(json_reply(
                StatusCode::NOT_FOUND,
                error_body(
                    "route_not_found",
                    &format!("no route for {} {}", request.method, request.path),
                ),
            ))
        }
    };
    let route = &compiled.routes[route_index];
    state.calls[route_index] += 1;
    let call = state.calls[route_index];
    let record = &mut state.attempts[index];
    record.route = Some(route.template.clone());
    record.call = Some(call);

    let Some(body) = request.body else {
        return Action::Reply(json_reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            error_body("body_too_large", "request body is over 1 MiB"),
        ));
    };
    if matches!(route.handler, Handler::Fast) {
        return Action::Reply(json_reply(
            StatusCode::OK,
            Bytes::from_static(b"{\"ok\":true}"),
        ));
    }

    let credential = request
        .headers
        .get(&compiled.auth_header)
        .map(|v| format!("credential:{}", credential_digest(v.as_bytes())))
        .unwrap_or_else(|| "credential:anonymous".to_owned());
    let scope = move |key: &ScopeKey| match key {
        ScopeKey::Account => "account".to_owned(),
        ScopeKey::Credential => credential.clone(),
    };

    let fault = choose_fault(route, call, &mut state.rng);
    if let Some(fault) = &fault {
        if !matches!(fault, Fault::Pass) {
            state.attempts[index].fault = Some(fault_name(fault).to_owned());
        }
    }
    let mut drop_after_commit = None;
    let mut slow = None;
    let action = match fault {
        Some(Fault::Status {
            status,
            retry_after,
            body,
        }) => {
            let body = body.map_or_else(
                || error_body("scripted_fault", &format!("scripted {status} answer")),
                |b| Bytes::from(b.to_string()),
            );
            let mut reply = json_reply(status_code(status), body);
            if let Some(raw) = retry_after.and_then(|r| HeaderValue::from_str(&r).ok()) {
                reply.headers.insert(header::RETRY_AFTER, raw);
            }
            Some(Action::Reply(reply))
        }
        Some(Fault::ErrorCode {
            status,
            code,
            message,
        }) => Some(Action::Reply(json_reply(
            status_code(status),
            error_body(&code, &message),
        ))),
        Some(Fault::Timeout { hold_ms }) => {
            return Action::Drop {
                hold: Duration::from_millis(hold_ms),
                outcome: AttemptOutcome::Timeout,
            }
        }
        Some(Fault::Drop) => {
            return Action::Drop {
                hold: Duration::ZERO,
                outcome: AttemptOutcome::Dropped,
            }
        }
        Some(Fault::StoreThenDrop { hold_ms }) => {
            drop_after_commit = Some(Duration::from_millis(hold_ms));
            None
        }
        Some(Fault::Slow { hold_ms }) => {
            slow = Some(Duration::from_millis(hold_ms));
            None
        }
        Some(Fault::Pass) | None => None,
    };

    let mut action = match action {
        Some(action) => action,
        None => serve(
            compiled, state, request, body, route, &params, now, index, &scope,
        ),
    };
    if let Some(hold) = drop_after_commit {
        return Action::Drop {
            hold,
            outcome: AttemptOutcome::Dropped,
        };
    }
    // Quota headers on every answer of a route with a quota (from its first quota).
    if let (Some(headers), Some(&q)) = (action.headers_mut(), route.quotas.first()) {
        let config = &compiled.quotas[q];
        let counter = state
            .quotas
            .entry((q, scope(&config.scope)))
            .or_insert_with(|| QuotaState::new(config, now.mono));
        let snap = counter.snapshot(config, now.mono);
        quota::write_headers(headers, config, &snap, now.wall);
    }
    *hold = slow;
    action
}

/// The normal path: quota, idempotency, handler.
#[allow(clippy::too_many_arguments)]
fn serve(
    compiled: &Compiled,
    state: &mut ProviderState,
    request: &Incoming<'_>,
    body: &Bytes,
    route: &CompiledRoute,
    params: &BTreeMap<String, String>,
    now: Now,
    index: usize,
    scope: &dyn Fn(&ScopeKey) -> String,
) -> Action {
    // Quota: every quota of the route must admit the request; then all are charged.
    let mut refusal: Option<(usize, Duration)> = None;
    for &q in &route.quotas {
        let config = &compiled.quotas[q];
        let counter = state
            .quotas
            .entry((q, scope(&config.scope)))
            .or_insert_with(|| QuotaState::new(config, now.mono));
        if let Some(wait) = counter.check(config, now.mono) {
            if refusal.is_none_or(|(_, longest)| wait > longest) {
                refusal = Some((q, wait));
            }
        }
    }
    if let Some((q, wait)) = refusal {
        let config = &compiled.quotas[q];
        state.attempts[index].fault = Some(format!("quota:{}", config.name));
        let mut reply = json_reply(
            status_code(config.exceeded_status),
            error_body(
                "rate_limit_exceeded",
                &format!(
                    "quota {} exceeded; retry in {} s",
                    config.name,
                    quota::ceil_seconds(wait)
                ),
            ),
        );
        quota::write_retry_after(&mut reply.headers, config.retry_after, wait, now.wall);
        return Action::Reply(reply);
    }
    for &q in &route.quotas {
        let config = &compiled.quotas[q];
        if let Some(counter) = state.quotas.get_mut(&(q, scope(&config.scope))) {
            counter.charge();
        }
    }

    // Idempotency (IETF Idempotency-Key draft): replay, or refuse a reused key.
    let key = if route.idempotency {
        header_str(request.headers, &compiled.idempotency_header).map(str::to_owned)
    } else {
        None
    };
    let fingerprint = key.as_ref().map(|_| {
        let mut material = Vec::with_capacity(body.len() + 64);
        material.extend_from_slice(request.method.as_str().as_bytes());
        material.push(b' ');
        material.extend_from_slice(request.path.as_bytes());
        material.push(b'\n');
        material.extend_from_slice(body);
        sha256_hex(&material)
    });
    if let (Some(key), Some(fingerprint)) = (&key, &fingerprint) {
        if let Some(stored) = state.idempotency.get(key) {
            if &stored.fingerprint == fingerprint {
                let mut reply = json_reply(stored.status, stored.body.clone());
                reply.headers.insert(
                    http::HeaderName::from_static("idempotent-replayed"),
                    HeaderValue::from_static("true"),
                );
                state.attempts[index].replayed = true;
                return Action::Reply(reply);
            }
            return Action::Reply(json_reply(
                status_code(compiled.idempotency_conflict_status),
                error_body(
                    "idempotency_key_reused",
                    "this idempotency key was already used with a different request",
                ),
            ));
        }
    }

    let action = run_handler(
        state,
        request,
        body,
        route,
        params,
        key.as_deref(),
        index,
        now,
    );
    if let (Some(key), Some(fingerprint), Action::Reply(reply)) = (key, fingerprint, &action) {
        state.idempotency.insert(
            key,
            Stored {
                fingerprint,
                status: reply.status,
                body: reply.body.clone(),
            },
        );
    }
    action
}

#[allow(clippy::too_many_arguments)]
fn run_handler(
    state: &mut ProviderState,
    request: &Incoming<'_>,
    body: &Bytes,
    route: &CompiledRoute,
    params: &BTreeMap<String, String>,
    idempotency_key: Option<&str>,
    index: usize,
    now: Now,
) -> Action {
    match &route.handler {
        Handler::Respond { status, body } => {
            let body = body
                .clone()
                .unwrap_or_else(|| json!({"ok": true, "route": route.template, "params": params}));
            Action::Reply(json_reply(
                status_code(*status),
                Bytes::from(body.to_string()),
            ))
        }
        Handler::Fast => Action::Reply(json_reply(
            StatusCode::OK,
            Bytes::from_static(b"{\"ok\":true}"),
        )),
        Handler::Create {
            collection,
            id_prefix,
            reference_field,
            unique_reference,
        } => {
            let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) else {
                return Action::Reply(json_reply(
                    StatusCode::BAD_REQUEST,
                    error_body("invalid_request", "request body must be a JSON object"),
                ));
            };
            let reference = reference_field.as_ref().and_then(|f| match fields.get(f) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            });
            let objects = state.collections.entry(collection.clone()).or_default();
            if *unique_reference {
                if let Some(existing) = reference
                    .as_ref()
                    .and_then(|r| objects.iter().find(|o| o.reference.as_ref() == Some(r)))
                {
                    return Action::Reply(json_reply(
                        StatusCode::CONFLICT,
                        Bytes::from(
                            json!({"error": {
                                "code": "duplicate_reference",
                                "type": "duplicate_reference",
                                "message": "an object with this reference already exists",
                                "existing_id": existing.id,
                            }})
                            .to_string(),
                        ),
                    ));
                }
            }
            let id = format!("{id_prefix}{:016x}", state.rng.next_u64());
            let mut object: Map<String, Value> = fields;
            object.insert("id".to_owned(), Value::String(id.clone()));
            let object = Value::Object(object);
            let reply = json_reply(StatusCode::CREATED, Bytes::from(object.to_string()));
            objects.push(Resource {
                object,
                id,
                reference,
                idempotency_key: idempotency_key.map(str::to_owned),
            });
            Action::Reply(reply)
        }
        Handler::Lookup { collection } => {
            let query = query_pairs(request.query);
            let by_key = query.get("idempotency_key");
            let by_reference = query.get("reference");
            let data: Vec<Value> = state
                .collections
                .get(collection)
                .map(|objects| {
                    objects
                        .iter()
                        .filter(|o| by_key.is_none_or(|k| o.idempotency_key.as_ref() == Some(k)))
                        .filter(|o| by_reference.is_none_or(|r| o.reference.as_ref() == Some(r)))
                        .map(|o| o.object.clone())
                        .collect()
                })
                .unwrap_or_default();
            Action::Reply(json_reply(
                StatusCode::OK,
                Bytes::from(json!({"object": "list", "data": data}).to_string()),
            ))
        }
        Handler::Get {
            collection,
            id_param,
        } => {
            let id = params.get(id_param).map(String::as_str).unwrap_or_default();
            let found = state
                .collections
                .get(collection)
                .and_then(|objects| objects.iter().find(|o| o.id == id));
            match found {
                Some(object) => Action::Reply(json_reply(
                    StatusCode::OK,
                    Bytes::from(object.object.to_string()),
                )),
                None => Action::Reply(json_reply(
                    StatusCode::NOT_FOUND,
                    error_body(
                        "resource_missing",
                        &format!("no {collection} object with id {id:?}"),
                    ),
                )),
            }
        }
        Handler::Stream {
            events,
            interval_ms,
        } => stream(request, body, *events, *interval_ms, index),
        Handler::Completion {
            api,
            events,
            interval_ms,
        } => completion(*api, body, *events, *interval_ms, index, now),
    }
}

fn stream(
    request: &Incoming<'_>,
    body: &Bytes,
    events: u32,
    interval_ms: u64,
    index: usize,
) -> Action {
    let query = query_pairs(request.query);
    let events = match query.get("n").map(|n| n.parse::<u32>()) {
        None => events,
        Some(Ok(n)) if n <= MAX_STREAM_EVENTS => n,
        Some(_) => {
            return Action::Reply(json_reply(
                StatusCode::BAD_REQUEST,
                error_body(
                    "invalid_request",
                    &format!("query n must be an integer in 0..={MAX_STREAM_EVENTS}"),
                ),
            ))
        }
    };
    let interval_ms = match query.get("interval_ms").map(|n| n.parse::<u64>()) {
        None => interval_ms,
        Some(Ok(ms)) if ms <= MAX_INTERVAL_MS => ms,
        Some(_) => {
            return Action::Reply(json_reply(
                StatusCode::BAD_REQUEST,
                error_body(
                    "invalid_request",
                    &format!("query interval_ms must be an integer in 0..={MAX_INTERVAL_MS}"),
                ),
            ))
        }
    };
    let stream_id = format!("chatcmpl-{}", index + 1);
    if !body.is_empty() {
        match serde_json::from_slice::<Value>(body) {
            Ok(value) if value.get("stream") == Some(&Value::Bool(false)) => {
                let text: String = (0..events).map(|i| format!("token-{i} ")).collect();
                return Action::Reply(json_reply(
                    StatusCode::OK,
                    Bytes::from(
                        json!({
                            "id": stream_id,
                            "object": "chat.completion",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                        })
                        .to_string(),
                    ),
                ));
            }
            Ok(_) => {}
            Err(_) => {
                return Action::Reply(json_reply(
                    StatusCode::BAD_REQUEST,
                    error_body("invalid_request", "request body is not valid JSON"),
                ))
            }
        }
    }
    let chunks = (0..events)
        .map(|i| {
            let chunk = json!({
                "id": stream_id,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": token(i)}}],
            });
            sse(None, &chunk)
        })
        .chain([Bytes::from_static(b"data: [DONE]\n\n")])
        .collect();
    event_stream(chunks, interval_ms)
}

/// Output token `i` of every fake completion.
fn token(i: u32) -> String {
    format!("token-{i} ")
}

/// One server-sent event: an optional `event:` line and one `data:` line of JSON.
fn sse(event: Option<&str>, data: &Value) -> Bytes {
    Bytes::from(match event {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    })
}

fn event_stream(chunks: Vec<Bytes>, interval_ms: u64) -> Action {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Action::Stream {
        headers,
        chunks,
        interval: Duration::from_millis(interval_ms),
    }
}

/// [`Handler::Completion`]: one JSON answer, or the stream when the body says `"stream": true`.
fn completion(
    api: CompletionApi,
    body: &Bytes,
    events: u32,
    interval_ms: u64,
    index: usize,
    now: Now,
) -> Action {
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(body) else {
        return Action::Reply(json_reply(
            StatusCode::BAD_REQUEST,
            error_body("invalid_request", "request body must be a JSON object"),
        ));
    };
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("fake-model");
    let streamed = request.get("stream") == Some(&Value::Bool(true));
    let input_tokens = body.len().div_ceil(4);
    let text: String = (0..events).map(token).collect();
    let seq = index + 1;
    match (api, streamed) {
        (CompletionApi::Openai, false) => Action::Reply(json_reply(
            StatusCode::OK,
            Bytes::from(
                json!({
                    "id": format!("chatcmpl-{seq}"),
                    "object": "chat.completion",
                    "created": now.wall.as_second(),
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }],
                    "usage": {
                        "prompt_tokens": input_tokens,
                        "completion_tokens": events,
                        "total_tokens": input_tokens + events as usize,
                    },
                })
                .to_string(),
            ),
        )),
        (CompletionApi::Openai, true) => {
            let id = format!("chatcmpl-{seq}");
            let created = now.wall.as_second();
            let chunk = |delta: Value, finish: Value| {
                sse(
                    None,
                    &json!({
                        "id": id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    }),
                )
            };
            let chunks = (0..events)
                .map(|i| {
                    let delta = if i == 0 {
                        json!({"role": "assistant", "content": token(i)})
                    } else {
                        json!({"content": token(i)})
                    };
                    chunk(delta, Value::Null)
                })
                .chain([concat(&[
                    chunk(json!({}), json!("stop")),
                    Bytes::from_static(b"data: [DONE]\n\n"),
                ])])
                .collect();
            event_stream(chunks, interval_ms)
        }
        (CompletionApi::Anthropic, false) => Action::Reply(json_reply(
            StatusCode::OK,
            Bytes::from(
                json!({
                    "id": format!("msg_fake{seq}"),
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn",
                    "stop_sequence": null,
                    "usage": {"input_tokens": input_tokens, "output_tokens": events},
                })
                .to_string(),
            ),
        )),
        (CompletionApi::Anthropic, true) => {
            let opening = concat(&[
                sse(
                    Some("message_start"),
                    &json!({"type": "message_start", "message": {
                        "id": format!("msg_fake{seq}"),
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": null,
                        "stop_sequence": null,
                        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                    }}),
                ),
                sse(
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}),
                ),
            ]);
            let closing = concat(&[
                sse(
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                sse(
                    Some("message_delta"),
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                            "usage": {"output_tokens": events}}),
                ),
                sse(Some("message_stop"), &json!({"type": "message_stop"})),
            ]);
            let mut chunks: Vec<Bytes> = (0..events)
                .map(|i| {
                    sse(
                        Some("content_block_delta"),
                        &json!({"type": "content_block_delta", "index": 0,
                                "delta": {"type": "text_delta", "text": token(i)}}),
                    )
                })
                .collect();
            match chunks.first_mut() {
                Some(first) => *first = concat(&[opening, first.clone()]),
                None => chunks.push(opening),
            }
            match chunks.len() {
                // No token: the opening and the closing events go together.
                1 if events == 0 => chunks[0] = concat(&[chunks[0].clone(), closing]),
                _ => chunks.push(closing),
            }
            event_stream(chunks, interval_ms)
        }
    }
}

fn concat(parts: &[Bytes]) -> Bytes {
    Bytes::from(parts.concat())
}
