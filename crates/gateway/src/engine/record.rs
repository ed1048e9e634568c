//! Recording an action: the steps of [`Engine::run`] before its first attempt.
//!
//! 1. `prepare`: validate the route's class, template and digests, fix the idempotency key
//!    (the agent's or one minted once) and the request every attempt sends;
//! 2. `admit`: record task and action in one store operation (a write waits until both are
//!    durable; a read is recorded with the next group commit, SPEC §12);
//! 3. `take_over`: an action found under the key — a reopened write, one never sent, a
//!    finished write told to come back — is continued as the SAME action, or answered;
//! 4. the circuit check and the budget, then [the attempt loop](super::attempt).
//!
//! [`Run`] is what stays fixed about the action through its attempts.

use backstop_core::clock::Clock;
use backstop_core::{
    breaker::RequestFingerprint,
    budget::{ActionBudget, ClassBudget},
    classify::ClassifyRules,
    escalation::sanitize_text,
    outcome::{NextSafe, Outcome, OutcomeContext},
    pacing::Priority,
    policy::ReconcileBy,
    reconcile::{
        ensure_external_reference, mint_idempotency_key, upstream_idempotency_key,
        validate_idempotency_key,
    },
};
use backstop_store::{
    ActionId, ActionState, Admission as StoreAdmission, AttemptRecord,
    Completion as StoreCompletion, NewAction, NewTask, PayloadDigest, RouteTemplate, StoreError,
};
use bytes::Bytes;
use std::sync::{Arc, Mutex};

use super::{
    core_priority, is_store_failure, resend, resume, store_priority, unrecorded, ActionGuard,
    Engine, EngineError, Notify, ReadRecords, SoFar,
};
use crate::{
    action::{ActionReceipt, ActionSpec, Execution},
    coalesce::{FlightKey, LeaderGuard, Role},
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
    pub(super) request: std::borrow::Cow<'a, crate::transport::AttemptRequest>,
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

impl Engine {
    /// Records the action and runs its attempt loop.
    pub(super) async fn run(
        &self,
        spec: &ActionSpec,
        notify: Option<&Notify>,
    ) -> (Execution, Option<LeaderGuard>) {
        let inner = &self.inner;
        let route = &spec.route;
        let Some(class) = inner.policy.request_classes.get(&route.class) else {
            return (
                unrecorded(
                    Outcome::Rejected,
                    format!("request class `{}` is not in the policy", route.class),
                ),
                None,
            );
        };
        let rules = match inner.rules(&route.provider, &route.class, class) {
            Ok(rules) => rules,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let template = match RouteTemplate::try_new(&route.template) {
            Ok(t) => t,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let digest = match PayloadDigest::try_new(&spec.payload_digest) {
            Ok(d) => d,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let target_digest = match spec.target_digest.as_deref().map(PayloadDigest::try_new) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                return (
                    unrecorded(Outcome::Rejected, format!("target digest: {e}")),
                    None,
                )
            }
        };
        let fingerprint = inner.fingerprint(route, &spec.request.body);

        // One idempotency key per logical write: the agent's (validated) or minted once. A read
        // carries none: nothing is minted, stored or audited for it.
        // A read sends the agent's request as prepared by the door: borrowed, not copied.
        let mut request = std::borrow::Cow::Borrowed(&spec.request);
        let provider = inner.policy.providers.get(&route.provider);
        let is_write = spec.has_side_effect();
        let key = match &spec.idempotency_key {
            Some(supplied) => match validate_idempotency_key(supplied) {
                Ok(key) => key.to_owned(),
                Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
            },
            None if is_write => mint_idempotency_key(inner.random_16()),
            None => String::new(),
        };
        // Keys are per agent inside backstop, one namespace at the provider: send a derived one.
        let upstream_key = if is_write {
            upstream_idempotency_key(&spec.agent, &key)
        } else {
            String::new()
        };
        let mut reference = None;
        if let (true, Some(rc)) = (is_write, route.reconcile.as_ref()) {
            if let (ReconcileBy::ExternalReference, Some(pointer)) =
                (rc.by, rc.external_reference_pointer.as_deref())
            {
                match ensure_external_reference(&request.body, pointer, &upstream_key) {
                    Ok((body, found)) => {
                        request.to_mut().body = Bytes::from(body);
                        reference = Some(found);
                    }
                    Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
                }
            }
        }
        if let (true, Some(name)) = (
            is_write,
            provider.and_then(|p| p.idempotency_header.as_deref()),
        ) {
            match (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(&upstream_key),
            ) {
                (Ok(name), Ok(value)) => {
                    request.to_mut().headers.insert(name, value);
                }
                _ => {
                    return (
                        unrecorded(
                            Outcome::Rejected,
                            format!("the idempotency key cannot be sent under `{name}`"),
                        ),
                        None,
                    )
                }
            }
        }
        // Remember how to reach the provider for lookups made later without this request.
        {
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

        // Record task and action before anything is sent.
        let now = inner.clock.now();
        let task = NewTask {
            id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            priority: store_priority(spec.priority),
            deadline: spec.deadline,
        };
        let new_action = NewAction {
            task_id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            provider: route.provider.clone(),
            method: route.method.clone(),
            route: template,
            request_class: route.class.clone(),
            payload_digest: digest,
            target_digest,
            idempotency_key: if is_write { key.clone() } else { String::new() },
            external_reference: reference.clone(),
            // Kept for case files built from the store later (beside an outcome, after a
            // restart): the agent's words without credentials, and the configured fingerprint.
            desired_outcome: spec
                .desired_outcome
                .as_deref()
                .map(|text| sanitize_text(text).text),
            fingerprint: Some(fingerprint.as_str().to_owned()),
            // A write's request is kept until it ends, so that restart recovery finishes it
            // (SPEC §6); a body too large to resend is sent once and never kept.
            request: (is_write && !spec.single_attempt && !spec.holds_secret)
                .then(|| {
                    resume::kept_request_of(&spec.request, inner.credential_header(&route.provider))
                })
                .flatten(),
        };
        let mut kept = new_action.request.is_some();
        // Task and action in one store operation. A write waits until both are durable; a
        // read gets its id at once and is recorded with the next group commit (SPEC §12).
        let read_records = (!is_write).then(|| ReadRecords::new(spec));
        let admission = match &read_records {
            None => {
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
                inner
                    .queued_or_else(
                        move |s, done| s.begin_action(task, new_action, now, done),
                        orphaned,
                    )
                    .await
            }
            Some(records) => {
                let read_id =
                    inner
                        .store
                        .record_read(task, new_action, now, records.completion("request"));
                if let Ok(id) = &read_id {
                    let _ = records.action.set(id.0);
                }
                read_id.map(StoreAdmission::New).map_err(EngineError::Store)
            }
        };
        // The task of an action recorded before, which this request may name differently, with
        // the priority and the deadline recorded for it.
        let mut own_task = None;
        let (mut own_priority, mut own_deadline) = (None, None);
        // What the action had done before this run: nothing, except for a write taken over by a
        // same-key resend (see below).
        let (id, action_guard, earlier) = match admission {
            Ok(StoreAdmission::New(id)) => {
                // A layered retry finds a write again under its key and joins it; a read has no
                // key, so nothing can follow it and it is not registered.
                let guard = if is_write {
                    match inner.flights.join_or_lead(FlightKey::Action(id.0)) {
                        Role::Leader(guard) => Some(guard),
                        Role::Follower(_) => None,
                    }
                } else {
                    None
                };
                (id, guard, SoFar::default())
            }
            Ok(StoreAdmission::Existing(record)) => {
                if record.agent != spec.agent {
                    return (
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
                    None if is_write && record.state == ActionState::Finished => {
                        match Box::pin(self.take_finished(spec, &request, &key, &record, notify))
                            .await
                        {
                            resend::Taken::Send(guard) => Some(guard),
                            // Nothing runs for this request (unless it joined the resend that
                            // reopened the action, which told `notify` so).
                            resend::Taken::Answer(execution, guard) => return (execution, guard),
                            resend::Taken::Replay => None,
                        }
                    }
                    taken => taken,
                };
                match taken {
                    Some(guard) => {
                        // Its earlier attempts count: receipts and the outcome's context number
                        // attempts like the store does, from the first one ever sent. And they
                        // decide how it is closed if its caller goes away before this run
                        // sends: a reopened write whose last attempt was `uncertain` may have
                        // been acted on, so it is reconciled, never `cancelled`.
                        let id = record.id;
                        // The caller may go away while they are read. Nothing would close the
                        // write then: a never sent one would stay `requested`, out of the
                        // resumable set, its key answering `409 in flight` to every resend.
                        // So a read nobody awaits any more closes the write as its caller
                        // going away does (never sent → `cancelled`; reopened after an
                        // `uncertain` attempt → reconciled); one that failed puts a never sent
                        // write back for the next resend, and leaves a reopened one reopened.
                        let orphaned = {
                            let (inner, runtime) =
                                (inner.clone(), tokio::runtime::Handle::current());
                            let (provider, class) = (route.provider.clone(), route.class.clone());
                            move |read: Result<(Vec<AttemptRecord>, _), StoreError>| match read {
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
                        };
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
                                let refused = self.refused_by_store(e, spec, Some(&key), Some(id));
                                return (refused, None);
                            }
                        };
                        let earlier = SoFar::of_stored(&stored);
                        kept = Box::pin(inner.keep_for_takeover(spec, id)).await;
                        own_task = Some(record.task_id.clone());
                        if let Some(task) = task {
                            own_priority = Some(core_priority(task.priority));
                            own_deadline = task.deadline;
                        }
                        // SPEC §6: an attempt that may have been acted on and that no later
                        // answer settled is sent again under its key only where the provider
                        // honours the key — now, under the policy in force: it may have lost
                        // its `idempotency_header` since the write was reopened (a restart).
                        // Otherwise the rule for an uncertain write runs instead of the send.
                        if earlier.unsettled && !inner.honours_key(&record.provider) {
                            if let Some(answer) = Box::pin(
                                self.settle_before_takeover(spec, &request, &key, &record, &stored),
                            )
                            .await
                            {
                                return (answer, Some(guard));
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
                        (record.id, Some(guard), earlier)
                    }
                    None => {
                        return (Box::pin(self.existing(*record, notify)).await, None);
                    }
                }
            }
            Err(e) if is_write && is_store_failure(&e) => {
                return (Box::pin(self.write_not_admitted(e, spec, &key)).await, None);
            }
            Err(e) => {
                let key = is_write.then_some(key.as_str());
                return (self.refused_by_store(e, spec, key, None), None);
            }
        };
        if let Some(notify) = notify {
            let receipt = ActionReceipt {
                action_id: id.0,
                attempts: earlier.sent,
                idempotency_key: is_write.then(|| key.clone()),
                provider_operation_id: None,
                task: own_task.clone(),
            };
            notify.runs(receipt, false);
        }
        let mut guard = ActionGuard {
            inner: inner.clone(),
            id,
            provider: &route.provider,
            class: &route.class,
            read: !is_write,
            so_far: earlier,
            armed: true,
        };
        let run = Run {
            spec,
            id,
            fingerprint,
            rules,
            request,
            key,
            upstream_key,
            reference,
            operation_id: Mutex::new(None),
            prior: earlier,
            read_records,
            own_task,
            priority: own_priority.unwrap_or(spec.priority),
            kept,
        };

        // The per-task circuit breaker (SPEC §7), as of `now`, read when the action was recorded.
        let open = inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .check(&spec.agent, run.task(), &run.fingerprint, now)
            .err();
        if let Some(open) = open {
            guard.armed = false;
            let context = OutcomeContext {
                last_status: open.last_status,
                last_signal: Some(format!("rejected ({})", open.error_code)),
                next_safe: vec![NextSafe::ChangeRequest, NextSafe::Abort],
                ..OutcomeContext::default()
            };
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                error_code = %open.error_code,
                failures = open.failures,
                "refused: the circuit is open for this request in this task"
            );
            let detail = format!(
                "this request failed {} times in this task with `{}`; the circuit is open",
                open.failures, open.error_code
            );
            let execution = Box::pin(self.finish(
                &run,
                &ActionBudget::new(class.budget(), None),
                Outcome::CircuitOpen,
                context,
                detail,
                0,
            ))
            .await;
            return (execution, action_guard);
        }

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
        // The request's deadline, and for a write taken over its own task's too: nothing starts
        // after either.
        let deadline = match (spec.deadline, own_deadline) {
            (Some(asked), Some(own)) => Some(asked.min(own)),
            (asked, own) => asked.or(own),
        };
        let budget = ActionBudget::new(
            ClassBudget {
                max_attempts,
                max_wait,
            },
            deadline,
        );
        let execution = self.attempts(&run, budget, &mut guard).await;
        (execution, action_guard)
    }
}
