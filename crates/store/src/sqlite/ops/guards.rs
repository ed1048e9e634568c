//! What the guards record: a circuit breaker opening, and a watchdog's finding about an action.

use jiff::Timestamp;

use super::{require_text, WriteTx};
use crate::audit::{format_instant, AuditEvent, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, JobId, RouteTemplate};

impl WriteTx<'_> {
    pub(crate) fn record_circuit_opened(
        &mut self,
        agent: &str,
        task: &str,
        provider: &str,
        method: &str,
        route: &RouteTemplate,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let mut e = AuditEvent::new(EventKind::CircuitOpened.as_str(), &format_instant(at));
        e.task = Some(task.to_owned());
        e.agent = Some(agent.to_owned());
        e.provider = Some(provider.to_owned());
        e.method = Some(method.to_owned());
        e.route = Some(route.as_str().to_owned());
        self.append(e)
    }

    pub(crate) fn record_watchdog_finding(
        &mut self,
        action: ActionId,
        finding: &str,
        job: Option<JobId>,
        due_at: Option<Timestamp>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        require_text(&[("finding", finding)])?;
        let f = self.facts(action)?;
        let mut e = Self::action_event(EventKind::WatchdogFinding, &format_instant(at), action, &f);
        e.source = Some(finding.to_owned());
        e.job = job.map(|j| j.0);
        e.due_at = due_at.map(format_instant);
        self.append(e)
    }
}
