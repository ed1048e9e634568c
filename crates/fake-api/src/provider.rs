//! The provider's decisions for one request: which route, which fault, quota, idempotency, the
//! handler's work (the streaming handlers are in `completion`). All of it runs under one lock and without awaiting, so the provider's state
//! changes atomically per request; the caller then carries the decision out (answer, stream,
//! hold, or drop the connection).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::attempt::{credential_digest, sha256_hex, AttemptOutcome, AttemptRecord};
use crate::clock::Now;
use crate::compiled::{Compiled, CompiledRoute, RouteMatch};
use crate::completion;
use crate::config::{Fault, Handler, QuotaConfig, ScopeKey};
use crate::quota::{self, QuotaState};
use crate::reply::{
    error_body, error_reply, invalid_request, json_reply, status_code, Action, Reply,
};
use crate::rng::SplitMix64;

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
    let record = attempt_record(compiled, request, now, state.attempts.len() as u64 + 1);
    let ticket = Ticket {
        generation: state.generation,
        index: state.attempts.len(),
    };
    state.attempts.push(record);
    let (mut action, hold) = decide_inner(compiled, state, request, now, ticket.index);
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

/// The record of a new attempt (number `seq`), still `pending`.
fn attempt_record(
    compiled: &Compiled,
    request: &Incoming<'_>,
    now: Now,
    seq: u64,
) -> AttemptRecord {
    let auth = request.headers.get(&compiled.auth_header);
    AttemptRecord {
        seq,
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

/// What a chosen fault makes of a request.
enum FaultEffect {
    /// Answer with this instead of serving the request.
    Answer(Action),
    /// Drop the connection without serving the request.
    Drop(Action),
    /// Serve the request (its writes are kept), then drop the connection after this hold
    /// without a response byte.
    ServeThenDrop(Duration),
    /// Serve the request; hold the answer this long first when `Some` (a slow answer).
    Serve(Option<Duration>),
}

/// The effect of `fault` (`None`: no fault chosen).
fn fault_effect(fault: Option<Fault>) -> FaultEffect {
    match fault {
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
            FaultEffect::Answer(Action::Reply(reply))
        }
        Some(Fault::ErrorCode {
            status,
            code,
            message,
        }) => FaultEffect::Answer(Action::Reply(json_reply(
            status_code(status),
            error_body(&code, &message),
        ))),
        Some(Fault::Timeout { hold_ms }) => FaultEffect::Drop(Action::Drop {
            hold: Duration::from_millis(hold_ms),
            outcome: AttemptOutcome::Timeout,
        }),
        Some(Fault::Drop) => FaultEffect::Drop(Action::Drop {
            hold: Duration::ZERO,
            outcome: AttemptOutcome::Dropped,
        }),
        Some(Fault::StoreThenDrop { hold_ms }) => {
            FaultEffect::ServeThenDrop(Duration::from_millis(hold_ms))
        }
        Some(Fault::Slow { hold_ms }) => FaultEffect::Serve(Some(Duration::from_millis(hold_ms))),
        Some(Fault::Pass) | None => FaultEffect::Serve(None),
    }
}

/// The scopes a quota counts a request in: the whole account, or the credential it carries.
struct Scopes {
    credential: String,
}

impl Scopes {
    /// The scopes of a request with `headers`.
    fn of(compiled: &Compiled, headers: &HeaderMap) -> Self {
        let credential = headers
            .get(&compiled.auth_header)
            .map(|v| format!("credential:{}", credential_digest(v.as_bytes())))
            .unwrap_or_else(|| "credential:anonymous".to_owned());
        Scopes { credential }
    }

    /// The name of the counter `key` selects.
    fn name(&self, key: &ScopeKey) -> String {
        match key {
            ScopeKey::Account => "account".to_owned(),
            ScopeKey::Credential => self.credential.clone(),
        }
    }
}

/// A request that matched a route, on its way to the route's handler.
struct Call<'r> {
    request: &'r Incoming<'r>,
    /// The request body (within the size limit).
    body: &'r Bytes,
    route: &'r CompiledRoute,
    params: BTreeMap<String, String>,
    now: Now,
    /// The attempt's index in the record.
    index: usize,
    scopes: Scopes,
}

/// Decides one recorded attempt (at `index`): its action, and how long to hold it first.
fn decide_inner<'r>(
    compiled: &'r Compiled,
    state: &mut ProviderState,
    request: &'r Incoming<'r>,
    now: Now,
    index: usize,
) -> (Action, Option<Duration>) {
    let (route_index, params) = match compiled.match_route(request.method, request.path) {
        RouteMatch::Found { index, params } => (index, params),
        RouteMatch::MethodNotAllowed => {
            let message = format!("{} is not allowed on {}", request.method, request.path);
            let refusal = error_reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                &message,
            );
            return (refusal, None);
        }
        RouteMatch::NotFound => {
            let message = format!("no route for {} {}", request.method, request.path);
            return (
                error_reply(StatusCode::NOT_FOUND, "route_not_found", &message),
                None,
            );
        }
    };
    let route = &compiled.routes[route_index];
    let call_number = count_call(state, route_index, route, index);
    let Some(body) = request.body else {
        let refusal = json_reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            error_body("body_too_large", "request body is over 1 MiB"),
        );
        return (Action::Reply(refusal), None);
    };
    if matches!(route.handler, Handler::Fast) {
        return (Action::Reply(fast_reply()), None);
    }
    let call = Call {
        request,
        body,
        route,
        params,
        now,
        index,
        scopes: Scopes::of(compiled, request.headers),
    };
    let fault = choose_fault(route, call_number, &mut state.rng);
    if let Some(fault) = &fault {
        if !matches!(fault, Fault::Pass) {
            state.attempts[index].fault = Some(fault_name(fault).to_owned());
        }
    }
    let (mut action, slow) = match fault_effect(fault) {
        FaultEffect::Answer(action) => (action, None),
        FaultEffect::Drop(action) => return (action, None),
        FaultEffect::ServeThenDrop(hold) => {
            serve(compiled, state, &call);
            let drop = Action::Drop {
                hold,
                outcome: AttemptOutcome::Dropped,
            };
            return (drop, None);
        }
        FaultEffect::Serve(slow) => (serve(compiled, state, &call), slow),
    };
    write_quota_headers(compiled, state, &call, &mut action);
    (action, slow)
}

/// Counts a call of the route at `route_index` and notes route and call number in the
/// attempt's record (at `index`); returns the call's number (from 1).
fn count_call(
    state: &mut ProviderState,
    route_index: usize,
    route: &CompiledRoute,
    index: usize,
) -> u64 {
    state.calls[route_index] += 1;
    let call = state.calls[route_index];
    let record = &mut state.attempts[index];
    record.route = Some(route.template.clone());
    record.call = Some(call);
    call
}

/// The answer of [`Handler::Fast`].
fn fast_reply() -> Reply {
    json_reply(StatusCode::OK, Bytes::from_static(b"{\"ok\":true}"))
}

/// Quota headers on every answer of a route with a quota (from its first quota).
fn write_quota_headers(
    compiled: &Compiled,
    state: &mut ProviderState,
    call: &Call<'_>,
    action: &mut Action,
) {
    if let (Some(headers), Some(&q)) = (action.headers_mut(), call.route.quotas.first()) {
        let config = &compiled.quotas[q];
        let snap = state
            .quota(q, config, &call.scopes, call.now)
            .snapshot(config, call.now.mono);
        quota::write_headers(headers, config, &snap, call.now.wall);
    }
}

/// The normal path: quota, idempotency, handler.
fn serve(compiled: &Compiled, state: &mut ProviderState, call: &Call<'_>) -> Action {
    if let Some(refusal) = refuse_over_quota(compiled, state, call) {
        return refusal;
    }
    charge_quotas(compiled, state, call);
    let key = idempotency_key(compiled, call);
    if let Some((key, fingerprint)) = &key {
        if let Some(answer) = replay(compiled, state, call.index, key, fingerprint) {
            return answer;
        }
    }
    let action = run_handler(state, call, key.as_ref().map(|(key, _)| key.as_str()));
    if let (Some((key, fingerprint)), Action::Reply(reply)) = (key, &action) {
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

/// Every quota of the route must admit the request: the refusal of the one that asks for the
/// longest wait, or `None`.
fn refuse_over_quota(
    compiled: &Compiled,
    state: &mut ProviderState,
    call: &Call<'_>,
) -> Option<Action> {
    let mut refusal: Option<(usize, Duration)> = None;
    for &q in &call.route.quotas {
        let config = &compiled.quotas[q];
        let counter = state.quota(q, config, &call.scopes, call.now);
        if let Some(wait) = counter.check(config, call.now.mono) {
            if refusal.is_none_or(|(_, longest)| wait > longest) {
                refusal = Some((q, wait));
            }
        }
    }
    let (q, wait) = refusal?;
    let config = &compiled.quotas[q];
    state.attempts[call.index].fault = Some(format!("quota:{}", config.name));
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
    quota::write_retry_after(&mut reply.headers, config.retry_after, wait, call.now.wall);
    Some(Action::Reply(reply))
}

/// Charges the admitted request to every quota of its route.
fn charge_quotas(compiled: &Compiled, state: &mut ProviderState, call: &Call<'_>) {
    for &q in &call.route.quotas {
        let config = &compiled.quotas[q];
        if let Some(counter) = state.quotas.get_mut(&(q, call.scopes.name(&config.scope))) {
            counter.charge();
        }
    }
}

/// The request's idempotency key and its request's fingerprint (method, path, body), when the
/// route keeps keys and the request carries one (IETF Idempotency-Key draft).
fn idempotency_key(compiled: &Compiled, call: &Call<'_>) -> Option<(String, String)> {
    if !call.route.idempotency {
        return None;
    }
    let key = header_str(call.request.headers, &compiled.idempotency_header)?.to_owned();
    let mut material = Vec::with_capacity(call.body.len() + 64);
    material.extend_from_slice(call.request.method.as_str().as_bytes());
    material.push(b' ');
    material.extend_from_slice(call.request.path.as_bytes());
    material.push(b'\n');
    material.extend_from_slice(call.body);
    Some((key, sha256_hex(&material)))
}

/// The answer for a `key` used before: the stored one replayed for the same request
/// (`fingerprint`), a refusal for another; `None` for a new key.
fn replay(
    compiled: &Compiled,
    state: &mut ProviderState,
    index: usize,
    key: &str,
    fingerprint: &str,
) -> Option<Action> {
    let stored = state.idempotency.get(key)?;
    if stored.fingerprint == fingerprint {
        let mut reply = json_reply(stored.status, stored.body.clone());
        reply.headers.insert(
            http::HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        );
        state.attempts[index].replayed = true;
        return Some(Action::Reply(reply));
    }
    Some(Action::Reply(json_reply(
        status_code(compiled.idempotency_conflict_status),
        error_body(
            "idempotency_key_reused",
            "this idempotency key was already used with a different request",
        ),
    )))
}

/// Carries out the route's handler; `idempotency_key` is the key a created object is kept
/// under.
fn run_handler(
    state: &mut ProviderState,
    call: &Call<'_>,
    idempotency_key: Option<&str>,
) -> Action {
    match &call.route.handler {
        Handler::Respond { status, body } => {
            let body = body.clone().unwrap_or_else(
                || json!({"ok": true, "route": call.route.template, "params": call.params}),
            );
            Action::Reply(json_reply(
                status_code(*status),
                Bytes::from(body.to_string()),
            ))
        }
        Handler::Fast => Action::Reply(fast_reply()),
        Handler::Create {
            collection,
            id_prefix,
            reference_field,
            unique_reference,
        } => {
            let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(call.body) else {
                return invalid_request("request body must be a JSON object");
            };
            let reference = reference_field.as_ref().and_then(|f| match fields.get(f) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            });
            let new = NewResource {
                fields,
                id_prefix,
                reference,
                idempotency_key,
            };
            state.create(collection, new, *unique_reference)
        }
        Handler::Lookup { collection } => {
            state.lookup(collection, &query_pairs(call.request.query))
        }
        Handler::Get {
            collection,
            id_param,
        } => {
            let id = call
                .params
                .get(id_param)
                .map(String::as_str)
                .unwrap_or_default();
            state.get(collection, id)
        }
        Handler::Stream {
            events,
            interval_ms,
        } => completion::stream(
            &query_pairs(call.request.query),
            call.body,
            *events,
            *interval_ms,
            call.index,
        ),
        Handler::Completion {
            api,
            events,
            interval_ms,
        } => completion::completion(*api, call.body, *events, *interval_ms, call.index, call.now),
    }
}

/// An object [`Handler::Create`] is asked to store.
struct NewResource<'a> {
    fields: Map<String, Value>,
    id_prefix: &'a str,
    reference: Option<String>,
    idempotency_key: Option<&'a str>,
}

impl ProviderState {
    /// The counter of quota `q` (`config`) for the request's scope, started at `now` if new.
    fn quota(
        &mut self,
        q: usize,
        config: &QuotaConfig,
        scopes: &Scopes,
        now: Now,
    ) -> &mut QuotaState {
        self.quotas
            .entry((q, scopes.name(&config.scope)))
            .or_insert_with(|| QuotaState::new(config, now.mono))
    }

    /// [`Handler::Create`]: stores `new` in `collection` under a fresh id, unless references are
    /// `unique` and an object with the same reference exists.
    fn create(&mut self, collection: &str, new: NewResource<'_>, unique: bool) -> Action {
        let objects = self.collections.entry(collection.to_owned()).or_default();
        if unique {
            if let Some(existing) = new
                .reference
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
        let id = format!("{}{:016x}", new.id_prefix, self.rng.next_u64());
        let mut object = new.fields;
        object.insert("id".to_owned(), Value::String(id.clone()));
        let object = Value::Object(object);
        let reply = json_reply(StatusCode::CREATED, Bytes::from(object.to_string()));
        objects.push(Resource {
            object,
            id,
            reference: new.reference,
            idempotency_key: new.idempotency_key.map(str::to_owned),
        });
        Action::Reply(reply)
    }

    /// [`Handler::Lookup`]: the objects of `collection` with the `query`'s `idempotency_key`
    /// and `reference`, each when given.
    fn lookup(&self, collection: &str, query: &BTreeMap<String, String>) -> Action {
        let by_key = query.get("idempotency_key");
        let by_reference = query.get("reference");
        let data: Vec<Value> = self
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

    /// [`Handler::Get`]: the object of `collection` with `id`.
    fn get(&self, collection: &str, id: &str) -> Action {
        let found = self
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
}
