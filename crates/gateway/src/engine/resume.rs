//! Restart recovery that finishes writes itself, from their kept requests (SPEC §6, §12).
//!
//! Why: a write's idempotency key is only half of what a resend needs — the other half is the
//! request. The seed's rule (SPEC §6) is to store the key WITH the request content before the
//! first send; then a restart need not hand a human work that a machine can finish.
//!
//! What is kept: a write's request as it is sent — method, URL, end-to-end headers without
//! any credential ([`kept_request_of`]), body — up to `--retry-body-bytes` (a larger body is
//! sent once and never kept), in the store's `kept_requests` table from before the first send
//! until the action ends; never in the audit chain. Recovery adds the provider's configured
//! credential when it sends ([`Inner::resumed_spec`]).
//!
//! What recovery does with it, where the previous run left the write:
//! - recorded and never sent (a `202 Accepted` or a caller gone with the crash): sent now, once,
//!   under its key ([`Inner::resume_unsent`]);
//! - an attempt sent without a result, or left `uncertain`: reconciled first — found →
//!   `succeeded`; nothing found (or no lookup) and the provider honours the key → resumed under
//!   the same key; otherwise escalated, as before;
//! - between two attempts, its last answer definite (a 429, a 503): resumed, the retry not sent
//!   before the instant it was scheduled for nor before the scope's boundary.
//!
//! A resumed write runs as a same-key resend would ([`Inner::resume`]): the store moves it to
//! `reopened` (audited `action_reopened`, source
//! [`backstop_store::RESUMED_AFTER_RESTART`]), and the engine takes it over in the background —
//! its earlier attempts counting against its class budget ([`ActionSpec::resumed`]) — so an
//! agent's resend under the key joins it and a polling agent sees its attempts.

use std::sync::Arc;

use backstop_core::clock::Clock as _;

use backstop_store::{ActionRecord, KeptRequest};

use super::{Engine, Inner};
use crate::{action::ActionSpec, transport::AttemptRequest};

/// Headers never kept at rest, whatever the provider's policy: credentials of the agent or of
/// the provider (RFC 9110 §11.6.2, §11.7.2; RFC 6265 §5.4).
const NEVER_KEPT: [http::HeaderName; 3] = [
    http::header::AUTHORIZATION,
    http::header::PROXY_AUTHORIZATION,
    http::header::COOKIE,
];

/// The request of a write as the store keeps it ([`KeptRequest`]): `request` without the
/// provider's credential header `credential` (when the policy names one), without any header
/// marked sensitive or listed in [`NEVER_KEPT`]. `None` when a header value is not visible
/// ASCII text (the store keeps text), so the write is recovered as one whose request was not
/// kept.
pub(super) fn kept_request_of(
    request: &AttemptRequest,
    credential: Option<&str>,
) -> Option<KeptRequest> {
    let mut headers = Vec::with_capacity(request.headers.len());
    for (name, value) in &request.headers {
        let credential_header = credential.is_some_and(|c| name.as_str().eq_ignore_ascii_case(c));
        if credential_header || value.is_sensitive() || NEVER_KEPT.contains(name) {
            continue;
        }
        headers.push((name.as_str().to_owned(), value.to_str().ok()?.to_owned()));
    }
    Some(KeptRequest {
        method: request.method.as_str().to_owned(),
        url: request.url.clone(),
        headers,
        body: request.body.to_vec(),
    })
}

/// Whether a kept header `name` may be sent again: not hop-by-hop (RFC 9110 §7.6.1, including
/// the names a `Connection` header lists, `listed`, lower case), not `Host`, the framing the
/// client redoes (`Content-Length`, `Expect`) or one of backstop's own `X-Backstop-*` — as the
/// proxy door forwards an agent's headers.
fn forwarded(name: &str, listed: &[String]) -> bool {
    let name = name.to_ascii_lowercase();
    let hop_by_hop = matches!(
        name.as_str(),
        "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    ) || name.starts_with("proxy-");
    !(hop_by_hop
        || matches!(name.as_str(), "host" | "content-length" | "expect")
        || name.starts_with("x-backstop-")
        || listed.contains(&name))
}

impl Inner {
    /// Whether `kept` is the request of the write `record`: its URL under the provider's
    /// `base_url` in the policy now, its method the action's, and its body the payload the
    /// action recorded (SHA-256). A row edited or damaged at rest is never sent — above all
    /// not to another host with the provider's credential.
    fn kept_matches(&self, record: &ActionRecord, kept: &KeptRequest) -> Result<(), String> {
        let base = self
            .policy
            .providers
            .get(&record.provider)
            .map(|p| p.base_url.trim_end_matches('/').to_owned())
            .ok_or_else(|| format!("provider `{}` is not in the policy", record.provider))?;
        let rest = kept.url.strip_prefix(&base).unwrap_or("\0");
        if !(rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')) {
            return Err(format!(
                "its URL is not under the provider's base_url {base}"
            ));
        }
        if !kept.method.eq_ignore_ascii_case(&record.method) {
            return Err(format!(
                "its method {} is not the action's {}",
                kept.method, record.method
            ));
        }
        let digest = backstop_store::PayloadDigest::of(&kept.body);
        if digest.as_str() != record.payload_digest {
            return Err("its body is not the payload the action recorded".to_owned());
        }
        Ok(())
    }

    /// The name of `provider`'s credential header in the policy, if it names one.
    pub(super) fn credential_header(&self, provider: &str) -> Option<&str> {
        self.policy
            .providers
            .get(provider)
            .and_then(|p| p.credential.as_ref())
            .map(|c| c.header.as_str())
    }

    /// Whether restart recovery of `id` is this caller's: `true` the first time a recovery
    /// path of this run asks, `false` after. The lists read at start can name one action twice
    /// over time (a re-armed retry that resumed it, then the scan of actions between attempts
    /// reached after slow lookups), and an action this run already resumed is running here:
    /// recovering it again would send it twice or escalate a write that is in flight.
    pub(super) fn take_up(&self, id: backstop_store::ActionId) -> bool {
        if self.runs_here(id) {
            tracing::debug!(
                action = id.0,
                "restart recovery: a request of this run already sends the action; left to it"
            );
            return false;
        }
        let first = self
            .recovering
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(id.0);
        if !first {
            tracing::debug!(
                action = id.0,
                "restart recovery: this run already took the action up; left to it"
            );
        }
        first
    }

    /// Whether a request of this run drives the write `id` now (an agent's same-key resend took
    /// it over, or recovery resumed it): it leads the action's flight.
    fn runs_here(&self, id: backstop_store::ActionId) -> bool {
        self.flights
            .follow(&crate::coalesce::FlightKey::Action(id.0))
            .is_some()
    }

    /// Keeps the request of `spec`, a same-key resend taking the write `id` over, as the
    /// write's request until it ends (a write reopened after it ended has none kept any more).
    /// A store that cannot keep it is logged and the resend goes on: the write is then
    /// recovered after a restart as one whose request was not kept. Whether it is kept.
    pub(super) async fn keep_for_takeover(
        &self,
        spec: &ActionSpec,
        id: backstop_store::ActionId,
    ) -> bool {
        if spec.resumed {
            // Sent from the very row the store keeps, checked against the action.
            return true;
        }
        if spec.single_attempt || spec.holds_secret || !spec.has_side_effect() {
            return false;
        }
        let Some(kept) =
            kept_request_of(&spec.request, self.credential_header(&spec.route.provider))
        else {
            return false;
        };
        match self.blocking(move |s| s.keep_request(id, kept)).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(action = id.0, error = %e, "could not keep the write's request; after a restart it is recovered without it");
                false
            }
        }
    }

    /// The request kept for the write `id`, if any (`None`, logged, when it cannot be read).
    pub(super) async fn kept(&self, id: backstop_store::ActionId) -> Option<KeptRequest> {
        match self.blocking(move |s| s.kept_request(id)).await {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!(action = id.0, error = %e, "restart recovery: cannot read the write's kept request");
                None
            }
        }
    }

    /// The action spec that sends the stored write `record` again from its `kept` request:
    /// its own task, agent, key and payload digest, the route the policy now gives its
    /// template, the provider's credential added (the take-over paces it with its task's
    /// recorded priority and deadline). `None` (logged) when the policy no longer routes it or
    /// the kept request cannot be sent.
    fn resumed_spec(&self, record: &ActionRecord, kept: KeptRequest) -> Option<ActionSpec> {
        let id = record.id.0;
        let route = match self
            .policy
            .route(&record.provider, &record.method, &record.route)
        {
            Ok(route) => route,
            Err(e) => {
                tracing::warn!(action = id, error = %e, "restart recovery: the policy no longer routes the write; it is not resumed");
                return None;
            }
        };
        let Ok(method) = http::Method::from_bytes(kept.method.as_bytes()) else {
            tracing::warn!(action = id, method = %kept.method, "restart recovery: the kept request's method cannot be sent");
            return None;
        };
        if let Err(why) = self.kept_matches(record, &kept) {
            tracing::warn!(action = id, reason = %why, "restart recovery: the kept request is not the write's own; it is not sent");
            return None;
        }
        let mut headers = http::HeaderMap::with_capacity(kept.headers.len() + 1);
        let listed: Vec<String> = kept
            .headers
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
            .flat_map(|(_, value)| value.split(',').map(|n| n.trim().to_ascii_lowercase()))
            .collect();
        for (name, value) in kept
            .headers
            .iter()
            .filter(|(name, _)| forwarded(name, &listed))
        {
            match (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(value),
            ) {
                (Ok(name), Ok(value)) => {
                    headers.append(name, value);
                }
                _ => {
                    tracing::warn!(action = id, header = %name, "restart recovery: a kept header cannot be sent; the write is not resumed");
                    return None;
                }
            }
        }
        if let Some((name, value)) = self
            .credentials
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&record.provider)
        {
            headers.insert(name.clone(), value.clone());
        }
        Some(ActionSpec {
            task_id: record.task_id.clone(),
            task_given: true,
            agent: record.agent.clone(),
            priority: backstop_core::pacing::Priority::Normal,
            deadline: None,
            max_wait: None,
            route,
            request: AttemptRequest {
                method,
                url: kept.url,
                headers,
                body: kept.body.into(),
            },
            single_attempt: false,
            idempotency_key: Some(record.idempotency_key.clone()),
            payload_digest: record.payload_digest.clone(),
            target_digest: None,
            desired_outcome: record.desired_outcome.clone(),
            resumed: true,
            holds_secret: false,
        })
    }

    /// Resumes the write `record` from its `kept` request: moves it to `reopened` when
    /// `reopen` (an action that was sent before; one never sent is taken over as it is), then
    /// runs it in the background as a same-key resend of it. `false` (logged) when it could not
    /// be resumed — the caller then closes it as recovery did before requests were kept.
    pub(super) async fn resume(
        self: &Arc<Self>,
        record: &ActionRecord,
        kept: KeptRequest,
        reopen: bool,
    ) -> bool {
        let id = record.id;
        let Some(spec) = self.resumed_spec(record, kept) else {
            return false;
        };
        if reopen {
            let now = self.clock.now();
            if let Err(e) = self
                .blocking(move |s| s.resume_after_restart(id, now))
                .await
            {
                if self.runs_here(id) {
                    // Taken over by its agent's same-key resend between the listing and now.
                    tracing::info!(action = id.0, "restart recovery: the write was taken over by a resend under its key; left to it");
                    return true;
                }
                tracing::warn!(action = id.0, error = %e, "restart recovery: the write cannot be resumed");
                return false;
            }
        } else if !self
            .unsent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(&id.0)
        {
            // Its agent's resend under the key took it over first: that run sends it.
            return true;
        }
        tracing::info!(
            action = id.0,
            idempotency_key = %record.idempotency_key,
            "restart recovery: the write is resumed from its kept request under its original idempotency key"
        );
        let engine = Engine {
            inner: self.clone(),
        };
        if let Err(answer) = engine.submit(spec).await {
            tracing::warn!(action = id.0, answer = ?answer.receipt(), "restart recovery: the resumed write was answered before it ran");
        }
        true
    }

    /// Restart recovery of the write `record` whose last attempt may have been acted on
    /// (`uncertain`, recorded as such): the SPEC §6 rule runs with its original key — found →
    /// `succeeded`; nothing found (or no lookup) and the provider honours the key → resumed
    /// from its kept request ([`Inner::resume`]); otherwise, or with no kept request,
    /// escalated ([`Inner::close_after_recovery`]).
    ///
    /// # Errors
    /// The store failed to record how the write ended, or [`super::EngineError::ShuttingDown`]:
    /// the lookup was not sent, and the write is left as it is for the next start.
    pub(super) async fn reconcile_then_resume(
        self: &Arc<Self>,
        record: &ActionRecord,
    ) -> Result<(), super::EngineError> {
        let facts = self.stored_facts(record, None).await;
        let end = self
            .reconcile_uncertain(&facts, None)
            .await
            .map_err(|super::writes::LookupNotSent| super::EngineError::ShuttingDown)?;
        if end == super::writes::UncertainEnd::RetrySameKey {
            if let Some(kept) = self.kept(record.id).await {
                if self.resume(record, kept, true).await {
                    return Ok(());
                }
            }
        }
        self.close_after_recovery(&facts, end, super::writes::PayloadGone::Restart)
            .await
    }

    /// Restart recovery of the write `record` left between two attempts (its stored
    /// `attempts`), or whose re-armed retry fell due: resumed from its kept request when it
    /// has one — reconciled first ([`Inner::reconcile_then_resume`]) when its last attempt may
    /// have been acted on, else resumed while its class budget has an attempt left. `false`
    /// when recovery closes it as before requests were kept (no kept request, a read, the
    /// budget used up).
    pub(super) async fn resume_between_attempts(
        self: &Arc<Self>,
        record: &ActionRecord,
        attempts: &[backstop_store::AttemptRecord],
    ) -> bool {
        use super::writes::Closing;
        if record.idempotency_key.is_empty() {
            return false;
        }
        let Some(kept) = self.kept(record.id).await else {
            return false;
        };
        match Closing::of_stored(&self.policy, record, attempts) {
            Closing::Reconcile => match self.reconcile_then_resume(record).await {
                Ok(()) => true,
                // Closed as before requests were kept, once the store commits again.
                Err(e) if super::is_store_failure(&e) => false,
                Err(e) => {
                    tracing::warn!(action = record.id.0, error = %e, "restart recovery: cannot end the recovered write");
                    true
                }
            },
            Closing::Cancel => {
                let budget = self
                    .policy
                    .request_classes
                    .get(&record.request_class)
                    .map_or(0, |c| c.max_attempts);
                let sent = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
                sent < budget && self.resume(record, kept, true).await
            }
        }
    }

    /// Restart recovery of a write reopened for a send under its key (judged safe when it was
    /// reopened) and stopped before that send: its kept request is sent now; without one,
    /// nothing is done (its agent's resend under the key sends it).
    pub(super) async fn resume_reopened(self: &Arc<Self>, record: &ActionRecord) {
        if let Some(kept) = self.kept(record.id).await {
            self.resume(record, kept, true).await;
        }
    }

    /// Restart recovery of the writes recorded and never sent (SPEC §12), listed at start and
    /// held in `unsent` for an agent's resend to take over: each whose request was kept is
    /// sent now under its key ([`Inner::resume`]), unless its agent's resend took it over
    /// first; one whose request was not kept (a body over `--retry-body-bytes`) ends
    /// `cancelled` with [`super::RESTARTED_BEFORE_WRITE_SENT`], nothing sent, and its agent's
    /// resend under the same key reopens and sends it.
    pub(super) async fn resume_unsent(self: &Arc<Self>, unsent: Vec<backstop_store::ActionId>) {
        for id in unsent {
            if !self.take_up(id) {
                continue;
            }
            let Some(record) = self.recovered_action(id).await else {
                continue;
            };
            let resumed = match self.kept(id).await {
                Some(kept) => self.resume(&record, kept, false).await,
                None => false,
            };
            let still_unsent = self
                .unsent
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .remove(&id.0);
            if resumed || !still_unsent {
                continue;
            }
            tracing::info!(
                action = id.0,
                "restart recovery: a write recorded but never sent has no kept request; it is cancelled, and its agent's resend under the same key sends it"
            );
            let context = serde_json::json!({
                "sent": false, "response_received": false, "attempts": 0,
                "next_safe": [{"option": "retry_same_key"}, {"option": "abort"}],
                "detail": super::RESTARTED_BEFORE_WRITE_SENT,
            });
            self.record_or_defer(super::writes::Deferred {
                action: id,
                result: None,
                end: super::writes::DeferredEnd::Outcome(super::Finish {
                    outcome: backstop_store::Outcome::Cancelled,
                    context,
                    response: None,
                }),
                count: None,
            })
            .await;
        }
    }
}
