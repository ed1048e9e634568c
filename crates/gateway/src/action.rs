//! What the proxy door (or the action API) hands the executor, and what comes back.
//!
//! An [`ActionSpec`] is one *logical* operation (SPEC §1): it may take several attempts, all
//! sending the same [`AttemptRequest`]. The executor answers with an [`Execution`]: either the
//! provider's response to pass through (2xx bodies stream unbuffered; once bytes reached the agent
//! nothing is retried), or a gateway-made outcome that the door renders as an RFC 9457 problem.

use std::time::Duration;

use axum::body::Body;
use backstop_core::{
    outcome::{Outcome, OutcomeContext},
    pacing::Priority,
    policy::RouteMatch,
    side_effect::SideEffect,
};
use jiff::Timestamp;

use crate::transport::AttemptRequest;

/// One logical action, fully resolved by the door.
#[derive(Debug, Clone)]
pub struct ActionSpec {
    /// The task (run) id from `X-Backstop-Task` (or a minted one).
    pub task_id: String,
    /// Whether the agent named the task (`X-Backstop-Task`, or the action API's `task`); a
    /// minted task groups nothing, so a client's re-send of a side-effect-free call is then
    /// recognized by agent and fingerprint alone (SPEC §4.3).
    pub task_given: bool,
    /// The authenticated agent's name (from the policy's `agents`).
    pub agent: String,
    /// From `X-Backstop-Priority` (default `normal`).
    pub priority: Priority,
    /// From `X-Backstop-Deadline` (RFC 3339): nothing starts after it.
    pub deadline: Option<Timestamp>,
    /// From `Prefer: wait=N`: the most this caller is willing to wait in total.
    pub max_wait: Option<Duration>,
    /// The route, class and scopes resolved from the policy.
    pub route: RouteMatch,
    /// The prepared request, resent byte-identical on every attempt.
    pub request: AttemptRequest,
    /// The body was too large to buffer: exactly one attempt is allowed, and the outcome says so.
    pub single_attempt: bool,
    /// Idempotency key sent under the provider's header (agent-supplied or minted), for writes.
    pub idempotency_key: Option<String>,
    /// SHA-256 hex of the request body.
    pub payload_digest: String,
    /// SHA-256 hex of the concrete target sent to the provider: the normalized path and query
    /// (e.g. `/v1/accounts/acct_A/charges?dry_run=1`). An idempotency key binds it (SPEC §6);
    /// `None` binds no target (the key is then compared without one); the door sets it only
    /// when the agent supplied a key, the one kind of key an agent can reuse.
    pub target_digest: Option<String>,
    /// Agent-supplied description of the desired outcome (action API), for case files.
    pub desired_outcome: Option<String>,
    /// Restart recovery resumes this write from its kept request (SPEC §12): the attempts it
    /// made before the restart count against its class's `max_attempts` (one attempt is always
    /// left for a write resent under its key after its lookup found nothing). `false` for every
    /// request an agent sends.
    pub resumed: bool,
    /// The request carries a secret the gateway holds (a provider credential, an agent's or
    /// operator's token) in its URL or in a header other than the provider's credential header:
    /// it is never kept at rest (SPEC §6), so after a restart it is recovered as a write whose
    /// request was not kept.
    pub holds_secret: bool,
}

impl ActionSpec {
    /// Whether this action may change state at the provider, so that it is carried out as a
    /// write (durable before its send, one idempotency key, reconciled when uncertain): its
    /// method is not safe (RFC 9110 §9.2.1: GET, HEAD, OPTIONS) and its class's `side_effect` is
    /// `write`. A `POST` of a `side_effect: none` class (an LLM completion, SPEC §4.2a) runs
    /// like a read.
    pub fn has_side_effect(&self) -> bool {
        !is_safe_method(&self.request.method) && self.route.side_effect == SideEffect::Write
    }

    /// Whether this is a call of a `side_effect: none` class with an unsafe method (an LLM
    /// completion `POST`): run detached from its caller, a client's re-send joined or answered
    /// as the same call (SPEC §4.2a, §4.3).
    pub fn is_side_effect_free_call(&self) -> bool {
        !is_safe_method(&self.request.method) && self.route.side_effect == SideEffect::None
    }
}

/// Whether `method` is one the engine carries out as a read whatever its class: GET, HEAD or
/// OPTIONS (RFC 9110 §9.2.1).
pub(crate) fn is_safe_method(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

/// Identity and accounting that every answer to the agent carries
/// (`Backstop-Action-Id`, `Backstop-Attempts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionReceipt {
    /// The store's action id.
    pub action_id: i64,
    /// Attempts made for this action, one that could not connect (nothing left) included.
    pub attempts: u32,
    /// The idempotency key in effect for a write (the agent's or the one backstop minted),
    /// answered as `Idempotency-Key` so the agent can resend with the same key; `None` for reads
    /// and for requests refused before being recorded.
    pub idempotency_key: Option<String>,
    /// The provider's operation id of a write reconciliation found at the provider (SPEC §6),
    /// when the lookup named one: told with the answer as soon as the lookup found it, even
    /// while the store cannot record it yet; replays carry the stored one. `None` otherwise.
    pub provider_operation_id: Option<String>,
    /// The task the action belongs to, when the answer is about an action recorded before (a
    /// same-key resend: replayed, joined, taken over), which may belong to another task than
    /// the one the request names: answered as `Backstop-Task` and `task`. `None`: the
    /// request's task.
    pub task: Option<String>,
}

/// The executor's answer.
#[derive(Debug)]
pub enum Execution {
    /// The provider's response, passed through (status, headers, streaming body).
    Response {
        /// Identity and accounting.
        receipt: ActionReceipt,
        /// The provider's response.
        response: http::Response<Body>,
    },
    /// A gateway-made final outcome (rendered as `application/problem+json`).
    Outcome {
        /// Identity and accounting (`action_id` is 0 when refused before being recorded).
        receipt: ActionReceipt,
        /// The terminal outcome.
        outcome: Outcome,
        /// Its SPEC §5 context.
        context: OutcomeContext,
        /// One human sentence on why.
        detail: String,
    },
    /// The agent's idempotency key names an action of its own that is still in flight and could
    /// not be joined (a layered retry, SPEC §4.3): refused with `409 idempotency_key_in_flight`
    /// and `x-should-retry: false`. This is not the provider's `conflict`; nothing was sent.
    InFlight {
        /// The action in flight.
        receipt: ActionReceipt,
    },
}

/// The `detail` of an [`Execution::Outcome`] that answers a same-key resend of a completed write
/// with the outcome it already ended with (reconciled, or a gateway outcome such as
/// `cancelled`): nothing was sent for the resend, and the door marks the answer
/// `Idempotent-Replayed: true`, as it marks a replayed provider response.
pub const REPLAYED_OUTCOME: &str = "replayed: this idempotency key already ended with this outcome";

impl Execution {
    /// Whether this answers a same-key resend with its write's stored outcome
    /// ([`REPLAYED_OUTCOME`]).
    pub fn is_replayed_outcome(&self) -> bool {
        matches!(self, Execution::Outcome { detail, .. } if detail == REPLAYED_OUTCOME)
    }

    /// The receipt of any answer.
    pub fn receipt(&self) -> &ActionReceipt {
        match self {
            Execution::Response { receipt, .. }
            | Execution::Outcome { receipt, .. }
            | Execution::InFlight { receipt } => receipt,
        }
    }
}
