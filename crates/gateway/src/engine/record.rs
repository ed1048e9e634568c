//! Recording an action: the steps of [`Engine::run`] before its first attempt.
//!
//! 1. `prepare`: validate the route's class, template and digests, fix the idempotency key
//!    (the agent's or one minted once) and the request every attempt sends;
//! 2. `admit_action`: record task and action in one store operation (`record_new`: a write
//!    waits until both are durable; a read is recorded with the next group commit, SPEC §12);
//! 3. `found_under_key` / `take_over`: an action found under the key — a reopened write, one
//!    never sent, a finished write told to come back — is continued as the SAME action, or
//!    answered from the store;
//! 4. `circuit_open`, `budget_of`, then [the attempt loop](super::attempt).
//!
//! [`Run`] is what stays fixed about the action through its attempts.

use std::{
    borrow::Cow,
    sync::{Arc, Mutex},
};

use backstop_core::{
    breaker::RequestFingerprint,
    budget::{ActionBudget, ClassBudget},
    classify::ClassifyRules,
    clock::Clock,
    escalation::sanitize_text,
    outcome::{NextSafe, Outcome, OutcomeContext},
    pacing::Priority,
    policy::{ReconcileBy, RequestClass},
    reconcile::{
        ensure_external_reference, mint_idempotency_key, upstream_idempotency_key,
        validate_idempotency_key,
    },
};
use backstop_store::{
    ActionId, ActionRecord, ActionState, Admission as StoreAdmission, AttemptRecord,
    Completion as StoreCompletion, NewAction, NewTask, PayloadDigest, RouteTemplate, StoreError,
    TaskRecord,
};
use bytes::Bytes;
use jiff::Timestamp;

use super::{
    core_priority, is_store_failure, resend, resume, store_priority, unrecorded, ActionGuard,
    Engine, EngineError, Inner, Notify, ReadRecords, SoFar,
};
use crate::{
    action::{ActionReceipt, ActionSpec, Execution},
    coalesce::{FlightKey, LeaderGuard, Role},
    transport::AttemptRequest,
};

/// Everything fixed about one recorded action during its attempt loop.
pub(super) struct Run<'a> {
    pub(super) spec: &'a ActionSpec,
    pub(super) id: ActionId,
    pub(super) fingerprint: RequestFingerprint,
    pub(super) rules: Arc<ClassifyRules>,
    /// The request every attempt sends: the agent's, with the idempotency key under the
    /// provider's header and the external reference written into the payload when configured
    /// (a read's is the agent's as it is, borrowed from the spec).
    pub(super) request: Cow<'a, AttemptRequest>,
    /// The one idempotency key of this logical action, as the agent knows it.
    pub(super) key: String,
    /// The key the provider is sent ([`upstream_idempotency_key`] of agent and key); empty for
    /// a read.
    pub(super) upstream_key: String,
    /// The client-generated external reference, if the route reconciles by one.
    pub(super) reference: Option<String>,
    /// The provider's operation id, once a response carried it.
    pub(super) operation_id: Mutex<Option<String>>,
    /// What the action's attempts did before this run: nothing, except for a write taken over
    /// by a same-key resend (reopened, or recorded and never sent), which continues its count
    /// and whose last answer an answer given before this run sends (a refusal, a stop) reports.
    pub(super) prior: SoFar,
    /// A read's records, which nobody awaits (`None` for a write).
    pub(super) read_records: Option<Arc<ReadRecords>>,
    /// The action's task when this run took over a write recorded before (a same-key resend,
    /// which may name another task): its receipts name it. `None` for a new action.
    pub(super) own_task: Option<String>,
    /// The priority its attempts are paced with: the request's for a new action, the action's
    /// own task's for one taken over.
    pub(super) priority: Priority,
    /// Whether the store keeps this write's request until it ends (SPEC §6), so that the next
    /// start resumes it rather than cancelling it.
    pub(super) kept: bool,
}

impl Run<'_> {
    /// The task the action belongs to: the request's for a new action, the action's own for a
    /// write taken over (see [`Run::own_task`]). Its attempts are scheduled under it (its
    /// cancellation stops them), its circuit breaker counts them, its case files name it.
    pub(super) fn task(&self) -> &str {
        self.own_task.as_deref().unwrap_or(&self.spec.task_id)
    }

    /// The receipt of this action after `attempts` attempts.
    pub(super) fn receipt(&self, attempts: u32) -> ActionReceipt {
        ActionReceipt {
            action_id: self.id.0,
            idempotency_key: self.agent_key(),
            attempts,
            provider_operation_id: None,
            task: self.own_task.clone(),
        }
    }

    /// The idempotency key in effect, as told to the agent: writes only.
    pub(super) fn agent_key(&self) -> Option<String> {
        (self.spec.has_side_effect()).then(|| self.key.clone())
    }

    /// The completion of a read's record `what` that nobody awaits (see [`ReadRecords`]).
    pub(super) fn read_completion<T: Send + 'static>(
        &self,
        what: &'static str,
    ) -> StoreCompletion<T> {
        match &self.read_records {
            Some(records) => records.completion(what),
            // A write's records are awaited; this is not reached for one.
            None => Box::new(|_| {}),
        }
    }
}

/// What [`Engine::prepare`] fixed about a request before anything is recorded.
struct Prepared<'s> {
    class: &'s RequestClass,
    rules: Arc<ClassifyRules>,
    template: RouteTemplate,
    digest: PayloadDigest,
    target_digest: Option<PayloadDigest>,
    fingerprint: RequestFingerprint,
    /// The request every attempt sends (see [`Run::request`]).
    request: Cow<'s, AttemptRequest>,
    /// The idempotency key as the agent knows it, and as the provider is sent it.
    key: String,
    upstream_key: String,
    /// The client-generated external reference, if the route reconciles by one.
    reference: Option<String>,
}

/// The action a request runs once it is recorded: new, or recorded before and taken over.
struct Admitted {
    id: ActionId,
    /// The write's leader registration: a layered retry under its key joins this run.
    leader: Option<LeaderGuard>,
    /// What its attempts did before this run (see [`Run::prior`]).
    earlier: SoFar,
    /// The task recorded for an action taken over, with its priority and deadline.
    own_task: Option<String>,
    own_priority: Option<Priority>,
    own_deadline: Option<Timestamp>,
    /// Whether the store keeps the write's request until it ends (see [`Run::kept`]).
    kept: bool,
}

/// What a step of recording leads to: on to the next one, or the request's answer (with the
/// leader registration of the action it joined, if any).
// The answer is the one `run` returns, moved out at once: boxing it would only add an
// allocation to every answer given before the attempt loop.
#[allow(clippy::large_enum_variant)]
enum Step<T> {
    On(T),
    Answered(Execution, Option<LeaderGuard>),
}

impl Engine {
    /// Records the action and runs its attempt loop: [`Engine::prepare`] the request,
    /// [`Engine::admit_action`] it (new, or taken over), check its circuit, then
    /// [`Engine::attempts`] within its budget.
    pub(super) async fn run(
        &self,
        spec: &ActionSpec,
        notify: Option<&Notify>,
    ) -> (Execution, Option<LeaderGuard>) {
        let inner = &self.inner;
        let prepared = match self.prepare(spec) {
            Ok(prepared) => prepared,
            Err(detail) => return (unrecorded(Outcome::Rejected, detail), None),
        };
        self.remember_credential(spec, &prepared.request);
        // Record task and action before anything is sent.
        let now = inner.clock.now();
        let (records, admitted) = match self.admit_action(spec, &prepared, now, notify).await {
            (records, Step::On(admitted)) => (records, admitted),
            (_, Step::Answered(execution, guard)) => return (execution, guard),
        };
        let Admitted {
            id,
            leader,
            earlier,
            own_task,
            own_priority,
            own_deadline,
            kept,
        } = admitted;
        let is_write = spec.has_side_effect();
        if let Some(notify) = notify {
            let receipt = ActionReceipt {
                action_id: id.0,
                attempts: earlier.sent,
                idempotency_key: is_write.then(|| prepared.key.clone()),
                provider_operation_id: None,
                task: own_task.clone(),
            };
            notify.runs(receipt, false);
        }
        let route = &spec.route;
        let mut guard = ActionGuard {
            inner: inner.clone(),
            id,
            provider: &route.provider,
            class: &route.class,
            read: !is_write,
            so_far: earlier,
            armed: true,
        };
        let class = prepared.class;
        let run = Run {
            spec,
            id,
            fingerprint: prepared.fingerprint,
            rules: prepared.rules,
            request: prepared.request,
            key: prepared.key,
            upstream_key: prepared.upstream_key,
            reference: prepared.reference,
            operation_id: Mutex::new(None),
            prior: earlier,
            read_records: records,
            own_task,
            priority: own_priority.unwrap_or(spec.priority),
            kept,
        };
        if let Some(execution) = self.circuit_open(&run, class, now, &mut guard).await {
            return (execution, leader);
        }
        let budget = budget_of(&run, class, own_deadline);
        let execution = self.attempts(&run, budget, &mut guard).await;
        (execution, leader)
    }

    /// Validates the request's class, route template and digests, and fixes what every
    /// attempt sends: one idempotency key per logical write — the agent's (validated) or
    /// minted once — under the provider's header, and the external reference written into the
    /// payload when the route reconciles by one. A read carries none: nothing is minted,
    /// stored or audited for it, and it sends the agent's request as prepared by the door,
    /// borrowed, not copied. `Err` is why the request is rejected.
    fn prepare<'s>(&'s self, spec: &'s ActionSpec) -> Result<Prepared<'s>, String> {
        let inner = &self.inner;
        let route = &spec.route;
        let Some(class) = inner.policy.request_classes.get(&route.class) else {
            return Err(format!(
                "request class `{}` is not in the policy",
                route.class
            ));
        };
        let rules = inner
            .rules(&route.provider, &route.class, class)
            .map_err(|e| e.to_string())?;
        let template = RouteTemplate::try_new(&route.template).map_err(|e| e.to_string())?;
        let digest = PayloadDigest::try_new(&spec.payload_digest).map_err(|e| e.to_string())?;
        let target_digest = match spec.target_digest.as_deref().map(PayloadDigest::try_new) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => return Err(format!("target digest: {e}")),
        };
        let fingerprint = inner.fingerprint(route, &spec.request.body);
        let is_write = spec.has_side_effect();
        let key = match &spec.idempotency_key {
            Some(supplied) => validate_idempotency_key(supplied)
                .map_err(|e| e.to_string())?
                .to_owned(),
            None if is_write => mint_idempotency_key(inner.random_16()),
            None => String::new(),
        };
        // Keys are per agent inside backstop, one namespace at the provider: send a derived one.
        let upstream_key = if is_write {
            upstream_idempotency_key(&spec.agent, &key)
        } else {
            String::new()
        };
        let mut request = Cow::Borrowed(&spec.request);
        let reference = self.with_reference(spec, &mut request, &upstream_key)?;
        self.with_key_header(spec, &mut request, &upstream_key)?;
        Ok(Prepared {
            class,
            rules,
            template,
            digest,
            target_digest,
            fingerprint,
            request,
            key,
            upstream_key,
            reference,
        })
    }

    /// Writes the client-generated external reference into a write's payload when its route
    /// reconciles by one (SPEC §6); the reference it carries.
    fn with_reference(
        &self,
        spec: &ActionSpec,
        request: &mut Cow<'_, AttemptRequest>,
        upstream_key: &str,
    ) -> Result<Option<String>, String> {
        let (true, Some(rc)) = (spec.has_side_effect(), spec.route.reconcile.as_ref()) else {
            return Ok(None);
        };
        let (ReconcileBy::ExternalReference, Some(pointer)) =
            (rc.by, rc.external_reference_pointer.as_deref())
        else {
            return Ok(None);
        };
        let (body, found) = ensure_external_reference(&request.body, pointer, upstream_key)
            .map_err(|e| e.to_string())?;
        request.to_mut().body = Bytes::from(body);
        Ok(Some(found))
    }

    /// Puts a write's idempotency key under the provider's `idempotency_header`, if it names
    /// one.
    fn with_key_header(
        &self,
        spec: &ActionSpec,
        request: &mut Cow<'_, AttemptRequest>,
        upstream_key: &str,
    ) -> Result<(), String> {
        let provider = self.inner.policy.providers.get(&spec.route.provider);
        let (true, Some(name)) = (
            spec.has_side_effect(),
            provider.and_then(|p| p.idempotency_header.as_deref()),
        ) else {
            return Ok(());
        };
        match (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(upstream_key),
        ) {
            (Ok(name), Ok(value)) => {
                request.to_mut().headers.insert(name, value);
                Ok(())
            }
            _ => Err(format!("the idempotency key cannot be sent under `{name}`")),
        }
    }

    /// Remembers how to reach the provider for lookups made later without this request.
    fn remember_credential(&self, spec: &ActionSpec, request: &AttemptRequest) {
        let inner = &self.inner;
        let route = &spec.route;
        let provider = inner.policy.providers.get(&route.provider);
        let mut known = inner
            .credentials
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if !known.contains_key(&route.provider) {
            if let Some(cred) = provider
                .and_then(|p| p.credential.as_ref())
                .and_then(|c| http::HeaderName::from_bytes(c.header.as_bytes()).ok())
            {
                if let Some(value) = request.headers.get(&cred) {
                    let value = value.clone();
                    known.insert(route.provider.clone(), (cred, value));
                }
            }
        }
    }

    /// The task and action records of a prepared request.
    fn new_records(&self, spec: &ActionSpec, prepared: &Prepared<'_>) -> (NewTask, NewAction) {
        let route = &spec.route;
        let is_write = spec.has_side_effect();
        let task = NewTask {
            id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            priority: store_priority(spec.priority),
            deadline: spec.deadline,
        };
        let action = NewAction {
            task_id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            provider: route.provider.clone(),
            method: route.method.clone(),
            route: prepared.template.clone(),
            request_class: route.class.clone(),
            payload_digest: prepared.digest.clone(),
            target_digest: prepared.target_digest.clone(),
            idempotency_key: if is_write {
                prepared.key.clone()
            } else {
                String::new()
            },
            external_reference: prepared.reference.clone(),
            // Kept for case files built from the store later (beside an outcome, after a
            // restart): the agent's words without credentials, and the configured fingerprint.
            desired_outcome: spec
                .desired_outcome
                .as_deref()
                .map(|text| sanitize_text(text).text),
            fingerprint: Some(prepared.fingerprint.as_str().to_owned()),
            // A write's request is kept until it ends, so that restart recovery finishes it
            // (SPEC §6); a body too large to resend is sent once and never kept.
            request: (is_write && !spec.single_attempt && !spec.holds_secret)
                .then(|| {
                    resume::kept_request_of(
                        &spec.request,
                        self.inner.credential_header(&route.provider),
                    )
                })
                .flatten(),
        };
        (task, action)
    }

    /// Records task and action in one store operation — a write waits until both are
    /// durable; a read gets its id at once and is recorded with the next group commit (SPEC
    /// §12) — and takes over an action found under the key instead ([`Engine::found_under_key`]).
    /// Gives back the read's records, which nobody awaits (`None` for a write).
    async fn admit_action(
        &self,
        spec: &ActionSpec,
        prepared: &Prepared<'_>,
        now: Timestamp,
        notify: Option<&Notify>,
    ) -> (Option<Arc<ReadRecords>>, Step<Admitted>) {
        let is_write = spec.has_side_effect();
        let (task, action) = self.new_records(spec, prepared);
        let kept = action.request.is_some();
        let records = (!is_write).then(|| ReadRecords::new(spec));
        let admission = self
            .record_new(spec, task, action, now, records.as_ref())
            .await;
        let step = match admission {
            Ok(StoreAdmission::New(id)) => Step::On(Admitted {
                id,
                leader: self.lead_new_write(spec, id),
                earlier: SoFar::default(),
                own_task: None,
                own_priority: None,
                own_deadline: None,
                kept,
            }),
            Ok(StoreAdmission::Existing(record)) => {
                self.found_under_key(spec, prepared, record, notify).await
            }
            Err(e) if is_write && is_store_failure(&e) => {
                let answer = Box::pin(self.write_not_admitted(e, spec, &prepared.key)).await;
                Step::Answered(answer, None)
            }
            Err(e) => {
                let key = is_write.then_some(prepared.key.as_str());
                Step::Answered(self.refused_by_store(e, spec, key, None), None)
            }
        };
        (records, step)
    }

    /// The store operation that records a new action (`task` and `action`): a write's is
    /// awaited; a read's (`records` given) is not.
    async fn record_new(
        &self,
        spec: &ActionSpec,
        task: NewTask,
        action: NewAction,
        now: Timestamp,
        records: Option<&Arc<ReadRecords>>,
    ) -> Result<StoreAdmission, EngineError> {
        let inner = &self.inner;
        let route = &spec.route;
        let Some(records) = records else {
            // The caller may go away while the write's record commits (its fsync). The
            // record is durable all the same, and nothing would close it: the new action
            // would stay `requested`, its key answering `409 in flight` to every resend.
            // So an admission nobody awaits any more cancels the action it created, as a
            // caller gone before the first send does.
            let orphaned = {
                let (inner, runtime) = (inner.clone(), tokio::runtime::Handle::current());
                let (provider, class) = (route.provider.clone(), route.class.clone());
                move |admission: Result<StoreAdmission, StoreError>| {
                    if let Ok(StoreAdmission::New(id)) = admission {
                        tracing::info!(
                            action = id.0,
                            "client disconnected while the write was being recorded: the action is cancelled and never sends"
                        );
                        runtime.spawn(async move {
                            inner
                                .cancel_for_gone_client(id, SoFar::default(), &provider, &class)
                                .await
                        });
                    }
                }
            };
            return inner
                .queued_or_else(
                    move |s, done| s.begin_action(task, action, now, done),
                    orphaned,
                )
                .await;
        };
        let read_id = inner
            .store
            .record_read(task, action, now, records.completion("request"));
        if let Ok(id) = &read_id {
            let _ = records.action.set(id.0);
        }
        read_id.map(StoreAdmission::New).map_err(EngineError::Store)
    }

    /// A layered retry finds a write again under its key and joins it; a read has no key, so
    /// nothing can follow it and it is not registered.
    fn lead_new_write(&self, spec: &ActionSpec, id: ActionId) -> Option<LeaderGuard> {
        if !spec.has_side_effect() {
            return None;
        }
        match self.inner.flights.join_or_lead(FlightKey::Action(id.0)) {
            Role::Leader(guard) => Some(guard),
            Role::Follower(_) => None,
        }
    }

    /// An action was recorded before under the key (`record`): a write that may be sent again
    /// is taken over ([`Engine::take_over`]); anything else is answered from the store.
    async fn found_under_key(
        &self,
        spec: &ActionSpec,
        prepared: &Prepared<'_>,
        record: Box<ActionRecord>,
        notify: Option<&Notify>,
    ) -> Step<Admitted> {
        let inner = &self.inner;
        if record.agent != spec.agent {
            return Step::Answered(
                unrecorded(
                    Outcome::Rejected,
                    "the idempotency key belongs to another agent's action".to_owned(),
                ),
                None,
            );
        }
        // An operator reopened this escalated write for a same-key retry: this request
        // (held by the gateway, or resubmitted by the agent under the same key) sends it
        // again as the SAME logical action, unless another one already does.
        // A write recorded and never sent (the previous run stopped while it waited for
        // its first send, or the store could not record that send): nothing left, so
        // this resend sends it, once.
        let never_sent = record.state == ActionState::Requested
            && inner
                .unsent
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .remove(&record.id.0);
        let taken = if record.state == ActionState::Reopened || never_sent {
            match inner.flights.join_or_lead(FlightKey::Action(record.id.0)) {
                Role::Leader(guard) => Some(guard),
                Role::Follower(_) => None,
            }
        } else {
            None
        };
        // A finished write whose answer said to send it again under this key, once that
        // is due (see `resend`): reopened and taken over here, or answered.
        let taken = match taken {
            None if spec.has_side_effect() && record.state == ActionState::Finished => {
                let (request, key) = (&prepared.request, &prepared.key);
                match Box::pin(self.take_finished(spec, request, key, &record, notify)).await {
                    resend::Taken::Send(guard) => Some(guard),
                    // Nothing runs for this request (unless it joined the resend that
                    // reopened the action, which told `notify` so).
                    resend::Taken::Answer(execution, guard) => {
                        return Step::Answered(execution, guard)
                    }
                    resend::Taken::Replay => None,
                }
            }
            taken => taken,
        };
        match taken {
            Some(guard) => {
                self.take_over(spec, prepared, &record, never_sent, guard)
                    .await
            }
            None => Step::Answered(Box::pin(self.existing(*record, notify)).await, None),
        }
    }

    /// Takes over the write `record` (reopened, or `never_sent`) under `guard`: its earlier
    /// attempts count — receipts and the outcome's context number attempts like the store
    /// does, from the first one ever sent — and they decide how it is closed if its caller
    /// goes away before this run sends: a reopened write whose last attempt was `uncertain`
    /// may have been acted on, so it is reconciled, never `cancelled`.
    async fn take_over(
        &self,
        spec: &ActionSpec,
        prepared: &Prepared<'_>,
        record: &ActionRecord,
        never_sent: bool,
        guard: LeaderGuard,
    ) -> Step<Admitted> {
        let inner = &self.inner;
        let id = record.id;
        // The caller may go away while they are read. Nothing would close the
        // write then: a never sent one would stay `requested`, out of the
        // resumable set, its key answering `409 in flight` to every resend.
        // So a read nobody awaits any more closes the write as its caller
        // going away does (never sent → `cancelled`; reopened after an
        // `uncertain` attempt → reconciled); one that failed puts a never sent
        // write back for the next resend, and leaves a reopened one reopened.
        let orphaned = orphaned_takeover(inner, spec, id, never_sent);
        // With the action's own task: its attempts are scheduled under it, not
        // under the task this request names.
        let (agent, task) = (record.agent.clone(), record.task_id.clone());
        let (stored, task) = match inner
            .blocking_or_else(
                move |s| Ok((s.attempts(id)?, s.task(&agent, &task)?)),
                orphaned,
            )
            .await
        {
            Ok(read) => read,
            Err(e) => {
                if never_sent {
                    // Not taken over after all: the next resend may take it.
                    inner
                        .unsent
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .insert(id.0);
                }
                let refused = self.refused_by_store(e, spec, Some(&prepared.key), Some(id));
                return Step::Answered(refused, None);
            }
        };
        let earlier = SoFar::of_stored(&stored);
        let kept = Box::pin(inner.keep_for_takeover(spec, id)).await;
        let (own_priority, own_deadline) = match task {
            Some(task) => (Some(core_priority(task.priority)), task.deadline),
            None => (None, None),
        };
        // SPEC §6: an attempt that may have been acted on and that no later
        // answer settled is sent again under its key only where the provider
        // honours the key — now, under the policy in force: it may have lost
        // its `idempotency_header` since the write was reopened (a restart).
        // Otherwise the rule for an uncertain write runs instead of the send.
        if earlier.unsettled && !inner.honours_key(&record.provider) {
            let (request, key) = (&prepared.request, &prepared.key);
            if let Some(answer) =
                Box::pin(self.settle_before_takeover(spec, request, key, record, &stored)).await
            {
                return Step::Answered(answer, Some(guard));
            }
        }
        if never_sent {
            tracing::info!(
                action = record.id.0,
                "a write recorded but never sent (before a restart, or because the store could not record its first send) is sent now with its original idempotency key"
            );
        } else {
            tracing::info!(
                action = record.id.0,
                prior_attempts = earlier.sent,
                "reopened write sent again with its original idempotency key"
            );
        }
        Step::On(Admitted {
            id: record.id,
            leader: Some(guard),
            earlier,
            own_task: Some(record.task_id.clone()),
            own_priority,
            own_deadline,
            kept,
        })
    }

    /// The per-task circuit breaker (SPEC §7), as of `now`, read when the action was
    /// recorded: an open circuit ends the action `circuit_open` before anything is sent.
    async fn circuit_open(
        &self,
        run: &Run<'_>,
        class: &RequestClass,
        now: Timestamp,
        guard: &mut ActionGuard<'_>,
    ) -> Option<Execution> {
        let spec = run.spec;
        let open = self
            .inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .check(&spec.agent, run.task(), &run.fingerprint, now)
            .err()?;
        guard.armed = false;
        let context = OutcomeContext {
            last_status: open.last_status,
            last_signal: Some(format!("rejected ({})", open.error_code)),
            next_safe: vec![NextSafe::ChangeRequest, NextSafe::Abort],
            ..OutcomeContext::default()
        };
        tracing::info!(
            task = %run.task(),
            route = %spec.route.template,
            error_code = %open.error_code,
            failures = open.failures,
            "refused: the circuit is open for this request in this task"
        );
        let detail = format!(
            "this request failed {} times in this task with `{}`; the circuit is open",
            open.failures, open.error_code
        );
        let execution = Box::pin(self.finish(
            run,
            &ActionBudget::new(class.budget(), None),
            Outcome::CircuitOpen,
            context,
            detail,
            0,
        ))
        .await;
        Some(execution)
    }
}

/// The action's budget (SPEC §5): the class's attempts and wait — the wait capped further by
/// `Prefer: wait=N` — and the deadline: the request's, and for a write taken over its own
/// task's too (`own_deadline`): nothing starts after either.
fn budget_of(run: &Run<'_>, class: &RequestClass, own_deadline: Option<Timestamp>) -> ActionBudget {
    let spec = run.spec;
    let max_wait = match spec.max_wait {
        Some(prefer) => class.max_wait.min(prefer),
        None => class.max_wait,
    };
    let max_attempts = if spec.single_attempt {
        1
    } else if spec.resumed {
        // Resumed after a restart: the attempts made before it count (one is always left
        // for the resend its lookup judged safe).
        class.max_attempts.saturating_sub(run.prior.sent).max(1)
    } else {
        class.max_attempts
    };
    let deadline = match (spec.deadline, own_deadline) {
        (Some(asked), Some(own)) => Some(asked.min(own)),
        (asked, own) => asked.or(own),
    };
    ActionBudget::new(
        ClassBudget {
            max_attempts,
            max_wait,
        },
        deadline,
    )
}

/// What a take-over reads of the write: its stored attempts and its own task.
type TakenOverRead = (Vec<AttemptRecord>, Option<TaskRecord>);

/// What closes a write taken over (`id`, `never_sent` or reopened) when nobody awaits the read
/// of its attempts any more (see [`Engine::take_over`]).
fn orphaned_takeover(
    inner: &Arc<Inner>,
    spec: &ActionSpec,
    id: ActionId,
    never_sent: bool,
) -> impl FnOnce(Result<TakenOverRead, StoreError>) + Send + 'static {
    let route = &spec.route;
    let (inner, runtime) = (inner.clone(), tokio::runtime::Handle::current());
    let (provider, class) = (route.provider.clone(), route.class.clone());
    move |read: Result<TakenOverRead, StoreError>| match read {
        Ok((attempts, _)) => {
            tracing::info!(
                action = id.0,
                "client disconnected while its same-key resend took the write over, before the resend sent anything"
            );
            inner.close_for_gone_client(
                &runtime,
                id,
                false,
                SoFar::of_stored(&attempts),
                (&provider, &class),
            );
        }
        Err(_) if never_sent => {
            inner
                .unsent
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .insert(id.0);
        }
        Err(_) => {}
    }
}
