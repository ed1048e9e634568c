//! The escalation API: operators read case files and record decisions (SPEC §8, §11).
//!
//! Why operator-only: a case file names an account's endpoints, idempotency keys and budgets, and
//! a decision can send a write again. Every route therefore needs an operator token
//! (`Authorization: Bearer …`, resolved by [`EscalationsState::operators`]); agent tokens are not
//! operator tokens. Decisions are validated by [`backstop_core::escalation::validate_decision`]
//! (an option must have been offered; `send_new` must confirm that it may create a second side
//! effect) and recorded with who decided through [`Store::decide_escalation`], which audits a
//! `decision` event in the same transaction.
//!
//! | route | answer |
//! |---|---|
//! | `GET /v1/escalations` | `{"escalations": [{id, action, provider, route, reason, opened_at, state}]}`, open ones, oldest first |
//! | `GET /v1/escalations/{id}` | `{id, action, state, decision, decided_by, decided_at, note, case_file}` |
//! | `POST /v1/escalations/{id}/decision` | body `{option, confirm_second_side_effect?, note?}` → `{id, action, decision, decided_by, decided_at, effect, effect_applied, effect_detail, action_outcome, new_action, lookup, escalation_state, note}` |
//! | `POST /v1/escalations/{id}/reveal` | always `404 payload_not_stored`, audited (see below) |
//!
//! Errors are RFC 9457 `application/problem+json` bodies with `type`
//! `urn:backstop:problem:<name>`, the SDKs' error envelope `error: {message, type, code}` (as
//! every problem, see [`crate::problem`]) and `x-should-retry: false`: 401 `unauthorized` (no or unknown
//! operator token), 403 `forbidden` (an agent's token, under the gateway's router), 400
//! `bad_header` (two `Authorization` headers), 404 `escalation_not_found`, 400 `bad_decision` (body is not a decision),
//! 409 `already_decided`, 409 `request_not_held` (the decision is recorded — for
//! `retry_same_key` the action is reopened — but the gateway restarted since the escalation and
//! no longer holds the request: the agent resubmits, with the problem's `idempotency_key` for
//! `retry_same_key`, with a new key for `send_new`), 422 `decision_refused` (option not offered,
//! unknown, or `send_new` without `confirm_second_side_effect: true`), 500 `store_error`.
//!
//! The note is sanitized (what looks like a secret masked, and every credential or token the
//! gateway holds, see [`crate::scrub`]) and kept with the decision; `GET` returns it.
//!
//! ## `query_status` closes only when the write is found
//! `query_status` asks the provider before anything is recorded. When the lookup finds the
//! write, the action ends `succeeded` (reconciled) and the escalation is decided
//! (`query_status`, audited `decision`). When it answers `not_found` or is `inconclusive` (e.g.
//! the lookup itself got a 503), nothing is decided: the query is audited as its own
//! [`STATUS_QUERY`](backstop_store::STATUS_QUERY) event (who, when, the verdict), the action stays `escalated`, and the
//! escalation stays open and listed so that a later decision (`abort`, `retry_same_key`, another
//! `query_status` …) is accepted. The answer's `lookup` says what the lookup returned
//! (`{verdict, reason, provider_operation_id}`) and `escalation_state` says `open` or `decided`.
//!
//! ## Revealing a payload
//! Revealing a payload is a separate access decision (`reveal_payload`), never an approval of
//! the action. The store keeps only the payload's SHA-256 digest, never its bytes, so there is
//! nothing to reveal: the endpoint refuses explicitly with `404 payload_not_stored` and says how
//! to proceed — ask the agent for its copy and compare its SHA-256 with the case file's
//! `action.payload_digest` (backstop has no payload store to configure). Each request is audited
//! as an `access_decision` event ([`Store::record_access_decision`]: `reveal_payload`, the
//! operator, outcome [`REVEAL_REFUSED_NOT_STORED`]), separately from decisions on the action; the
//! escalation stays open.

use std::sync::Arc;

use axum::{
    body::Bytes,
    extract::{Path, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use backstop_core::clock::Clock;
use backstop_core::escalation::{
    validate_decision, CaseFile, Decision, DecisionEffect, REVEAL_PAYLOAD,
};
use backstop_store::{EscalationId, EscalationRecord, Store, StoreError};
use serde_json::{json, Value};

use crate::clock::TokioClock;

/// Resolves a bearer token to an operator name, `None` for anything that is not an operator
/// token. Comparison should be constant-time on the caller's side.
pub type OperatorLookup = dyn Fn(&str) -> Option<String> + Send + Sync;

/// What the escalation routes need.
#[derive(Clone)]
pub struct EscalationsState {
    /// The store holding escalations.
    pub store: Arc<dyn Store>,
    /// Operator token → operator name.
    pub operators: Arc<OperatorLookup>,
    /// The clock that stamps decisions.
    pub clock: TokioClock,
    /// What a decision note is scrubbed of (see [`crate::scrub`]).
    pub secrets: Arc<crate::scrub::HeldSecrets>,
}

impl std::fmt::Debug for EscalationsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EscalationsState")
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// The escalation routes (see the module table), ready to merge into the gateway's router.
/// Decisions are recorded only; [`acting_router`] also carries them out.
pub fn router(state: EscalationsState) -> Router {
    acting_router(state, None)
}

/// [`router`] whose decisions act through `engine` once recorded (see
/// [`crate::engine::Engine::apply_decision`]): `query_status` runs the reconciliation lookup now
/// (found → the action ends `succeeded`, reconciled); `abort` ends the action `cancelled`;
/// `wait` leaves it open; `retry_same_key` reopens the action and sends its held request again
/// with the SAME key; `send_new` sends it as a new action with a new key. Without a held
/// request (after a restart) the last two answer `409 request_not_held`.
pub fn acting_router(state: EscalationsState, engine: Option<crate::engine::Engine>) -> Router {
    let state = Acting {
        base: state,
        engine,
    };
    Router::new()
        .route("/v1/escalations", get(list))
        .route("/v1/escalations/{id}", get(show))
        .route(
            "/v1/escalations/{id}/decision",
            post(decide).layer(axum::extract::DefaultBodyLimit::max(
                MAX_DECISION_BODY_BYTES,
            )),
        )
        .route("/v1/escalations/{id}/reveal", post(reveal))
        .route_layer(axum::middleware::from_fn_with_state(
            state.base.clone(),
            log_refusals,
        ))
        .with_state(state)
}

/// What an [`ApiProblem`] answer refused, kept on its response for [`log_refusals`].
#[derive(Debug, Clone)]
struct RefusedHere {
    name: &'static str,
    detail: String,
}

/// Logs every refusal of these routes at INFO, on the line every refusal of backstop is logged
/// with ([`crate::problem::log_refusal`]): the route, the operator once the token names one,
/// the status, the problem type and the reason.
async fn log_refusals(
    State(state): State<EscalationsState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let at = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(
            || format!("{} /v1/escalations", request.method()),
            |path| format!("{} {}", request.method(), path.as_str()),
        );
    let authorization = request
        .headers()
        .get_all(header::AUTHORIZATION)
        .iter()
        .cloned()
        .collect::<Vec<_>>();
    let response = next.run(request).await;
    if let Some(refused) = response.extensions().get::<RefusedHere>() {
        let mut headers = HeaderMap::new();
        for value in authorization {
            headers.append(header::AUTHORIZATION, value);
        }
        let operator = operator(&state, &headers).ok();
        crate::problem::log_refusal(
            &at,
            crate::problem::Refused {
                agent: None,
                operator: operator.as_deref(),
            },
            response.status(),
            refused.name,
            &refused.detail,
        );
    }
    response
}

#[derive(Clone)]
struct Acting {
    base: EscalationsState,
    engine: Option<crate::engine::Engine>,
}

impl axum::extract::FromRef<Acting> for EscalationsState {
    fn from_ref(acting: &Acting) -> EscalationsState {
        acting.base.clone()
    }
}

/// An RFC 9457 problem made by these routes.
#[derive(Debug)]
struct ApiProblem {
    status: StatusCode,
    name: &'static str,
    title: &'static str,
    detail: String,
    /// Extension members (RFC 9457 §3.2), merged into the body.
    extensions: serde_json::Map<String, Value>,
}

impl ApiProblem {
    fn new(status: StatusCode, name: &'static str, title: &'static str, detail: String) -> Self {
        ApiProblem {
            status,
            name,
            title,
            detail,
            extensions: serde_json::Map::new(),
        }
    }

    fn unauthorized() -> Self {
        ApiProblem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Operator token required",
            "escalations are read and decided with an operator token in `Authorization: Bearer …`; this request carried none, or one that matches no operator"
                .to_owned(),
        )
    }

    fn not_found(id: &str) -> Self {
        ApiProblem::new(
            StatusCode::NOT_FOUND,
            "escalation_not_found",
            "No such escalation",
            format!("escalation `{id}` does not exist"),
        )
    }

    fn store(e: &StoreError) -> Self {
        match e {
            StoreError::NotFound { what } => ApiProblem::new(
                StatusCode::NOT_FOUND,
                "escalation_not_found",
                "No such escalation",
                format!("{what} not found"),
            ),
            StoreError::InvalidTransition { .. } => ApiProblem::new(
                StatusCode::CONFLICT,
                "already_decided",
                "Already decided",
                e.to_string(),
            ),
            _ => ApiProblem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "store_error",
                "The store failed",
                e.to_string(),
            ),
        }
    }
}

impl IntoResponse for ApiProblem {
    fn into_response(self) -> Response {
        let mut body = json!({
            "type": format!("urn:backstop:problem:{}", self.name),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Value::Object(members) = &mut body {
            for (name, value) in self.extensions {
                members.entry(name).or_insert(value);
            }
            members.insert(
                "error".into(),
                crate::problem::error_envelope(self.status, self.name, &self.detail),
            );
        }
        let mut response = (self.status, body.to_string()).into_response();
        response.extensions_mut().insert(RefusedHere {
            name: self.name,
            detail: self.detail,
        });
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert("x-should-retry", HeaderValue::from_static("false"));
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"backstop-operators\""),
            );
        }
        response
    }
}

fn operator(state: &EscalationsState, headers: &HeaderMap) -> Result<String, ApiProblem> {
    let value = crate::auth::bearer_header(headers)
        .ok()
        .and_then(|v| v.to_str().ok())
        .ok_or_else(ApiProblem::unauthorized)?;
    let (scheme, token) = value
        .trim()
        .split_once(' ')
        .ok_or_else(ApiProblem::unauthorized)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(ApiProblem::unauthorized());
    }
    (state.operators)(token.trim()).ok_or_else(ApiProblem::unauthorized)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiProblem> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(|e| ApiProblem::store(&e)),
        Err(e) => Err(ApiProblem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_error",
            "The store failed",
            format!("store task ended: {e}"),
        )),
    }
}

async fn load(state: &EscalationsState, id: &str) -> Result<EscalationRecord, ApiProblem> {
    let number: i64 = id
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ApiProblem::not_found(id))?;
    let store = state.store.clone();
    blocking(move || store.escalation(EscalationId(number)))
        .await?
        .ok_or_else(|| ApiProblem::not_found(id))
}

fn case_str<'a>(record: &'a EscalationRecord, field: &str) -> &'a str {
    record.case_file[field].as_str().unwrap_or("")
}

async fn list(
    State(state): State<EscalationsState>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiProblem> {
    operator(&state, &headers)?;
    let store = state.store.clone();
    let open = blocking(move || store.open_escalations()).await?;
    let rows: Vec<Value> = open
        .iter()
        .map(|e| {
            json!({
                "id": e.id.0,
                "action": e.action.0,
                "provider": case_str(e, "provider"),
                "route": case_str(e, "endpoint"),
                "reason": case_str(e, "reason"),
                "opened_at": e.case_file["opened_at"],
                "state": e.state.as_str(),
            })
        })
        .collect();
    Ok(Json(json!({ "escalations": rows })))
}

async fn show(
    State(state): State<EscalationsState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiProblem> {
    operator(&state, &headers)?;
    let e = load(&state, &id).await?;
    Ok(Json(json!({
        "id": e.id.0,
        "action": e.action.0,
        "state": e.state.as_str(),
        "decision": e.decision,
        "decided_by": e.decided_by,
        "decided_at": e.decided_at.map(|t| t.to_string()),
        "note": e.note,
        "case_file": e.case_file,
    })))
}

async fn decide(
    State(acting): State<Acting>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiProblem> {
    let state = &acting.base;
    let who = operator(state, &headers)?;
    let e = load(state, &id).await?;
    undecided(&e, &id)?;
    let (decision, effect) = checked_decision(&e, &id, &body)?;
    let word = effect.option().as_str();
    let note = decision.note.as_deref().map(|n| state.secrets.scrub(n));
    // The store keeps milliseconds; answer the instant exactly as recorded.
    let now = state.clock.now();
    let at = jiff::Timestamp::from_millisecond(now.as_millisecond()).unwrap_or(now);
    if matches!(effect, DecisionEffect::QueryStatus) {
        return query_status(&acting, &e, &who, &effect, note, at).await;
    }
    record_decision(state, &e, word, &who, note.clone(), at).await?;
    let applied = match &acting.engine {
        Some(engine) => engine.apply_decision(e.action, &effect, &who).await,
        None => recorded_only(),
    };
    if applied.request_not_held {
        return Err(request_not_held(&e, word, &who, at, applied.detail));
    }
    Ok(Json(json!({
        "id": e.id.0,
        "action": e.action.0,
        "decision": word,
        "decided_by": who,
        "decided_at": at.to_string(),
        "effect": effect,
        "effect_applied": applied.applied,
        "effect_detail": applied.detail,
        "action_outcome": applied.outcome,
        "new_action": applied.new_action,
        "lookup": applied.lookup,
        "escalation_state": "decided",
        "note": note,
    })))
}

/// Refuses a second decision of escalation `id` with 409 `already_decided`, naming the first.
fn undecided(e: &EscalationRecord, id: &str) -> Result<(), ApiProblem> {
    let Some(decision) = &e.decision else {
        return Ok(());
    };
    Err(ApiProblem::new(
        StatusCode::CONFLICT,
        "already_decided",
        "Already decided",
        format!(
            "escalation {id} was already decided: `{decision}` by `{}`",
            e.decided_by.as_deref().unwrap_or("unknown")
        ),
    ))
}

/// The decision in `body` and its effect, checked against the escalation's case file.
///
/// # Errors
/// 400 `bad_decision` for a body that is not a decision, 500 `store_error` for a stored case
/// file that cannot be read, 422 `decision_refused` for a decision the case file does not offer.
fn checked_decision(
    e: &EscalationRecord,
    id: &str,
    body: &[u8],
) -> Result<(Decision, DecisionEffect), ApiProblem> {
    let decision = parse_decision(body).map_err(|reason| {
        ApiProblem::new(
            StatusCode::BAD_REQUEST,
            "bad_decision",
            "Not a decision",
            format!(
                "body: expected {{\"option\": …, \"confirm_second_side_effect\": bool, \"note\": …}}: {reason}"
            ),
        )
    })?;
    let case = CaseFile::from_json(&e.case_file).map_err(|err| {
        ApiProblem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_error",
            "Case file unreadable",
            format!("escalation {id}: the stored case file cannot be read: {err}"),
        )
    })?;
    let effect = validate_decision(&case, &decision).map_err(|err| {
        ApiProblem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "decision_refused",
            "Decision refused",
            err.to_string(),
        )
    })?;
    Ok((decision, effect))
}

/// Records the decision `word` by `who` in the store and logs it.
async fn record_decision(
    state: &EscalationsState,
    e: &EscalationRecord,
    word: &'static str,
    who: &str,
    note: Option<String>,
    at: jiff::Timestamp,
) -> Result<(), ApiProblem> {
    let store = state.store.clone();
    let (escalation, decided_by) = (e.id, who.to_owned());
    blocking(move || store.decide_escalation(escalation, word, &decided_by, note.as_deref(), at))
        .await?;
    tracing::info!(
        target: "backstop::escalations",
        escalation = e.id.0,
        action = e.action.0,
        decision = word,
        decided_by = %who,
        "escalation decided"
    );
    Ok(())
}

/// The 409 `request_not_held` of a decision recorded whose effect needs the agent to submit the
/// request again (`detail` says why), with the decision and the key to resubmit with.
fn request_not_held(
    e: &EscalationRecord,
    word: &str,
    who: &str,
    at: jiff::Timestamp,
    detail: String,
) -> ApiProblem {
    let mut problem = ApiProblem::new(
        StatusCode::CONFLICT,
        "request_not_held",
        "Recorded; the agent must resubmit",
        detail,
    );
    for (name, value) in [
        ("escalation", json!(e.id.0)),
        ("action", json!(e.action.0)),
        ("decision", json!(word)),
        ("decided_by", json!(who)),
        ("decided_at", json!(at.to_string())),
        ("decision_recorded", json!(true)),
        ("idempotency_key", case_file_key(&e.case_file, word)),
    ] {
        problem.extensions.insert(name.to_owned(), value);
    }
    problem
}

fn recorded_only() -> crate::engine::DecisionApplied {
    crate::engine::DecisionApplied {
        applied: false,
        detail: "recorded only: this gateway runs no engine".to_owned(),
        outcome: None,
        request_not_held: false,
        new_action: None,
        lookup: None,
    }
}

/// `query_status`: ask the provider first, then record. Only a `found` lookup (the action is
/// then `succeeded`, reconciled) closes the escalation with the `decision`; `not_found`,
/// `inconclusive` (or no engine to ask: `not_run`) are audited as a [`STATUS_QUERY`](backstop_store::STATUS_QUERY) event and the
/// escalation stays open, listed, for a later decision.
async fn query_status(
    acting: &Acting,
    e: &EscalationRecord,
    who: &str,
    effect: &DecisionEffect,
    note: Option<String>,
    at: jiff::Timestamp,
) -> Result<Json<Value>, ApiProblem> {
    let state = &acting.base;
    let applied = match &acting.engine {
        Some(engine) => engine.apply_decision(e.action, effect, who).await,
        None => crate::engine::DecisionApplied {
            lookup: Some(crate::engine::LookupAnswer {
                verdict: "not_run".to_owned(),
                reason: Some("this gateway runs no engine to ask the provider".to_owned()),
                provider_operation_id: None,
            }),
            ..recorded_only()
        },
    };
    let found = applied.applied && applied.lookup.as_ref().is_some_and(|l| l.is_found());
    let store = state.store.clone();
    let (escalation, by) = (e.id, who.to_owned());
    let escalation_state = if found {
        let kept_note = note.clone();
        blocking(move || {
            store.decide_escalation(escalation, "query_status", &by, kept_note.as_deref(), at)
        })
        .await?;
        "decided"
    } else {
        let verdict = applied
            .lookup
            .as_ref()
            .map_or("not_run", |l| l.verdict.as_str())
            .to_owned();
        blocking(move || store.record_status_query(escalation, &by, &verdict, at)).await?;
        "open"
    };
    tracing::info!(
        target: "backstop::escalations",
        escalation = e.id.0,
        action = e.action.0,
        decided_by = %who,
        verdict = applied.lookup.as_ref().map_or("not_run", |l| l.verdict.as_str()),
        escalation_state,
        "status queried"
    );
    Ok(Json(json!({
        "id": e.id.0,
        "action": e.action.0,
        "decision": "query_status",
        "decided_by": who,
        "decided_at": at.to_string(),
        "effect": effect,
        "effect_applied": found,
        "effect_detail": applied.detail,
        "action_outcome": applied.outcome,
        "new_action": null,
        "lookup": applied.lookup,
        "escalation_state": escalation_state,
        "note": note,
    })))
}

async fn reveal(
    State(state): State<EscalationsState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiProblem> {
    let who = operator(&state, &headers)?;
    let e = load(&state, &id).await?;
    // An access decision, audited as its own event, apart from decisions on the action.
    let (store, escalation, by) = (state.store.clone(), e.id, who.clone());
    let at = state.clock.now();
    blocking(move || {
        store.record_access_decision(
            escalation,
            REVEAL_PAYLOAD,
            &by,
            REVEAL_REFUSED_NOT_STORED,
            at,
        )
    })
    .await?;
    tracing::info!(
        target: "backstop::escalations",
        escalation = e.id.0,
        action = e.action.0,
        decision = REVEAL_PAYLOAD,
        decided_by = %who,
        "payload reveal requested; refused: the payload is not stored"
    );
    let digest = case_str_nested(&e.case_file, "/action/payload_digest");
    Err(ApiProblem::new(
        StatusCode::NOT_FOUND,
        "payload_not_stored",
        "Payload not stored",
        format!(
            "backstop keeps only the payload's SHA-256 digest ({digest}), never the payload; ask \
             the agent for its copy and compare its SHA-256 with the case file's \
             action.payload_digest. backstop has no setting that keeps payloads. Revealing a \
             payload is a separate access decision and approves nothing."
        ),
    ))
}

/// The members a decision body may have.
pub const DECISION_MEMBERS: [&str; 3] = ["option", "confirm_second_side_effect", "note"];

/// The longest decision body read, in bytes (a decision is an option word and a note).
pub const MAX_DECISION_BODY_BYTES: usize = 64 * 1024;

/// Reads a decision body strictly: a JSON object whose members are among
/// [`DECISION_MEMBERS`], each given once. An unknown member is refused, not ignored: a misspelt
/// `confirm_second_side_effect` must not pass as "not confirmed". A member given twice is
/// refused, not resolved: JSON parsers disagree on which copy wins (RFC 8259 §4), and
/// `{"option":"send_new","confirm_second_side_effect":true,"option":"wait"}` must not be read as
/// either decision.
///
/// # Errors
/// A sentence: not JSON, not an object, a member given twice, an unknown member, or a member of
/// the wrong type.
fn parse_decision(body: &[u8]) -> Result<Decision, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let Value::Object(members) = &value else {
        return Err("a decision is a JSON object".to_owned());
    };
    if let Some(twice) = repeated_member(body) {
        return Err(format!(
            "member `{twice}` is given more than once, so the decision is ambiguous; give each member once"
        ));
    }
    if let Some(unknown) = members
        .keys()
        .find(|k| !DECISION_MEMBERS.contains(&k.as_str()))
    {
        return Err(format!("unknown member `{unknown}`"));
    }
    serde_json::from_value(value).map_err(|e| e.to_string())
}

/// The first member name given twice in the JSON object `body` (top level), if any. `body` is
/// already known to be a JSON object.
fn repeated_member(body: &[u8]) -> Option<String> {
    struct FirstRepeat(Option<String>);
    impl<'de> serde::Deserialize<'de> for FirstRepeat {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Names;
            impl<'de> serde::de::Visitor<'de> for Names {
                type Value = FirstRepeat;

                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }

                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<FirstRepeat, A::Error> {
                    let mut seen = std::collections::HashSet::new();
                    let mut repeat = None;
                    while let Some(name) = map.next_key::<String>()? {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        if repeat.is_none() && seen.contains(&name) {
                            repeat = Some(name);
                        } else {
                            seen.insert(name);
                        }
                    }
                    Ok(FirstRepeat(repeat))
                }
            }
            d.deserialize_map(Names)
        }
    }
    serde_json::from_slice::<FirstRepeat>(body).ok()?.0
}

/// The outcome of every `reveal_payload` request, as audited: backstop keeps no payload.
pub const REVEAL_REFUSED_NOT_STORED: &str = "refused_payload_not_stored";

/// The key the agent must resubmit with: the original one for `retry_same_key`, none (a new
/// one) for `send_new`.
fn case_file_key(case_file: &Value, decision: &str) -> Value {
    match decision {
        "retry_same_key" => case_file
            .get("idempotency_key")
            .cloned()
            .unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

fn case_str_nested<'a>(case_file: &'a Value, pointer: &str) -> &'a str {
    case_file
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn problems_carry_the_sdk_error_envelope_and_say_no_retry() {
        let response = ApiProblem::not_found("7").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(response.headers()["x-should-retry"], "false");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["type"], "urn:backstop:problem:escalation_not_found");
        assert_eq!(
            body["error"],
            json!({
                "message": "escalation `7` does not exist",
                "type": "not_found_error",
                "code": "escalation_not_found",
            })
        );
    }

    #[test]
    fn decisions_are_objects_with_known_members_only() {
        let decision = parse_decision(
            br#"{"option":"send_new","confirm_second_side_effect":true,"note":"ok"}"#,
        )
        .unwrap();
        assert_eq!(decision.option, "send_new");
        assert!(decision.confirm_second_side_effect);
        for (body, reason) in [
            (
                &br#"{"option":"abort","bogus":1}"#[..],
                "unknown member `bogus`",
            ),
            (
                br#"{"option":"send_new","confirm_second_side_efect":true}"#,
                "unknown member",
            ),
            (br#"["abort"]"#, "a decision is a JSON object"),
            (br#""abort""#, "a decision is a JSON object"),
            (b"abort", "not JSON"),
            (br#"{"option":1}"#, "invalid type"),
            (
                br#"{"option":"send_new","confirm_second_side_effect":true,"option":"wait"}"#,
                "member `option` is given more than once",
            ),
            (
                br#"{"option":"wait","confirm_second_side_effect":true,"option":"send_new"}"#,
                "member `option` is given more than once",
            ),
            (
                br#"{"option":"send_new","confirm_second_side_effect":false,"confirm_second_side_effect":true}"#,
                "member `confirm_second_side_effect` is given more than once",
            ),
        ] {
            let error = parse_decision(body).unwrap_err();
            assert!(
                error.contains(reason),
                "{}: {error}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
