//! The watch feed: the audit events a health watcher needs, kept in memory as the writer
//! commits them, so [`crate::Store::watch_events`] does not read the log back from SQLite.
//!
//! ## Why
//! The gateway's watchdog looks at every committed event every few seconds. Reading them back
//! from the database made SQLite read every new page of the log (≈ 70,000 events a second
//! under load) only to leave out almost all of them: 14 % of the gateway's CPU in the proxy
//! benchmark. The writer already holds each event it seals; keeping the few that matter costs
//! one move per event and one pass per group commit.
//!
//! ## What is kept
//! The same as the SQL path keeps ([`crate::Store::watch_events`]), with the group commit in the
//! role of the page: `task_opened` is left out; an action whose whole life lies in one group and
//! is one plain success (`action_requested`, one `action_sent`, one `action_result` that is not
//! `rate_limited`/`quota_exhausted`/`unavailable`, `action_finished` `succeeded`) is left out
//! except its `action_sent`, the heartbeat. Of those heartbeats only the latest (by `at`) is
//! kept, and a heartbeat directly after another one in the feed replaces it: a watcher takes
//! from them only the latest instant at which work moved. Every other event is kept as sealed.
//!
//! ## Bounds
//! At most [`FEED_CAP`] events are held; beyond that the oldest are dropped and a watcher that
//! had not read them reads that part from SQLite (the feed knows from which `seq` on it is
//! complete). A watcher's call also drops what it has read, so an idle watcher costs memory only
//! up to the cap.

use std::collections::{HashMap, HashSet, VecDeque};

use jiff::Timestamp;

use crate::audit::{format_instant, AuditEvent, EventKind};

/// The most events the feed holds (≈ 10–20 MiB of events at the cap). A watcher that falls
/// further behind reads from SQLite until it has caught up.
pub const FEED_CAP: usize = 32_768;

/// The dispositions of a result that throttled its action (such an action is never plain):
/// the watch feed and the database path of [`crate::Store::watch_events`] both use these.
pub(crate) const THROTTLING: [&str; 3] = ["rate_limited", "quota_exhausted", "unavailable"];

/// Whether a result with this disposition throttled its action.
pub(crate) fn throttled(disposition: &str) -> bool {
    THROTTLING.contains(&disposition)
}

/// The send of a plain answered read, as the writer notes it instead of a copy of the event:
/// what a watcher takes from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heartbeat {
    /// The `action_sent` event's `seq`.
    pub(crate) seq: u64,
    /// Its action.
    pub(crate) action: i64,
    /// Its attempt.
    pub(crate) attempt: u32,
    /// Its `at`.
    pub(crate) at: Timestamp,
}

impl Heartbeat {
    /// The event a watcher is handed for it: `seq`, `at`, `kind` (`action_sent`), `action` and
    /// `attempt` as sealed; the other members are left out (the action's other events are not
    /// kept either, so a watcher has no trail to put them in).
    fn event(self) -> AuditEvent {
        AuditEvent {
            seq: self.seq,
            action: Some(self.action),
            attempt: Some(self.attempt),
            ..AuditEvent::new(EventKind::ActionSent.as_str(), &format_instant(self.at))
        }
    }
}

/// What the open transaction sealed so far, for the feed once it commits: the events
/// themselves (`task_opened` left out), and the plain answered reads' sends as [`Heartbeat`]s.
#[derive(Debug, Default)]
pub(crate) struct Watched {
    events: Vec<AuditEvent>,
    heartbeats: Vec<Heartbeat>,
}

/// How far [`Watched`] was filled, to undo what an operation added.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark(usize, usize);

impl Watched {
    /// Notes a sealed event (`task_opened` is left out: a watcher never needs it).
    pub(crate) fn event(&mut self, event: AuditEvent) {
        if event.kind != EventKind::TaskOpened.as_str() {
            self.events.push(event);
        }
    }

    /// Notes a plain answered read's send.
    pub(crate) fn heartbeat(&mut self, heartbeat: Heartbeat) {
        self.heartbeats.push(heartbeat);
    }

    /// Where it stands now.
    pub(crate) fn mark(&self) -> Mark {
        Mark(self.events.len(), self.heartbeats.len())
    }

    /// Forgets what was noted after `mark` (the operations that added it were undone).
    pub(crate) fn undo(&mut self, mark: Mark) {
        self.events.truncate(mark.0);
        self.heartbeats.truncate(mark.1);
    }

    /// Forgets everything (the transaction was rolled back).
    pub(crate) fn clear(&mut self) {
        self.undo(Mark(0, 0));
    }
}

/// Committed events kept for watchers, in `seq` order.
#[derive(Debug)]
pub(crate) struct WatchFeed {
    /// Every kept event with `seq > from` is in `events`.
    from: u64,
    /// The `seq` of the last committed event.
    head: u64,
    events: VecDeque<AuditEvent>,
    /// Whether the last of `events` is a heartbeat (a later heartbeat replaces it).
    back_is_heartbeat: bool,
    cap: usize,
}

/// One answer of [`WatchFeed::page`]: the events and the `seq` looked up to.
pub(crate) type Page = (Vec<AuditEvent>, Option<u64>);

impl WatchFeed {
    /// A feed for a log whose last committed event is `head` (0 when empty): everything up to
    /// it is only in the database.
    pub(crate) fn after(head: u64) -> Self {
        Self::with_cap(head, FEED_CAP)
    }

    fn with_cap(head: u64, cap: usize) -> Self {
        WatchFeed {
            from: head,
            head,
            events: VecDeque::new(),
            back_is_heartbeat: false,
            cap: cap.max(1),
        }
    }

    /// Takes in what one group commit sealed (see [`Watched`], emptied) and the chain's last
    /// `seq` after that commit.
    pub(crate) fn committed(&mut self, watched: &mut Watched, head: u64) {
        let plain = plain_actions(&watched.events);
        // The group's latest heartbeat, by `at`: the plain answered reads' notes, then the sends
        // of plain actions among the events (fixed-width RFC 3339 orders as instants).
        let mut latest: Option<AuditEvent> = watched
            .heartbeats
            .drain(..)
            .max_by_key(|h| h.at)
            .map(Heartbeat::event);
        let mut kept: Vec<AuditEvent> = Vec::new();
        for event in watched.events.drain(..) {
            if !event.action.is_some_and(|a| plain.contains(&a)) {
                kept.push(event);
                continue;
            }
            if event.kind == EventKind::ActionSent.as_str()
                && latest.as_ref().is_none_or(|l| l.at < event.at)
            {
                latest = Some(event);
            }
        }
        if let Some(heartbeat) = latest {
            let at = kept.partition_point(|e| e.seq < heartbeat.seq);
            kept.insert(at, heartbeat);
            self.push(kept, Some(at));
        } else {
            self.push(kept, None);
        }
        self.head = self.head.max(head);
        while self.events.len() > self.cap {
            if let Some(dropped) = self.events.pop_front() {
                self.from = dropped.seq;
            }
        }
        if self.events.is_empty() {
            self.back_is_heartbeat = false;
        }
    }

    /// Appends a group's kept events; `heartbeat` is the index of its heartbeat among them.
    fn push(&mut self, kept: Vec<AuditEvent>, heartbeat: Option<usize>) {
        for (i, event) in kept.into_iter().enumerate() {
            let is_heartbeat = Some(i) == heartbeat;
            if is_heartbeat && self.back_is_heartbeat {
                // Only the latest instant of consecutive heartbeats matters to a watcher.
                if self.events.back().is_some_and(|back| back.at > event.at) {
                    continue;
                }
                self.events.pop_back();
            }
            self.back_is_heartbeat = is_heartbeat;
            self.events.push_back(event);
        }
    }

    /// The kept events with `seq > since`, at most `limit`, and the `seq` looked up to — or
    /// `None` when the feed does not hold everything after `since` (read the database then).
    /// The events handed out leave the feed, as does what is at or before `since` (the caller
    /// has it): asking again from an earlier `seq` is answered `None`.
    pub(crate) fn page(&mut self, since: u64, limit: usize) -> Option<Page> {
        if since < self.from {
            return None;
        }
        let start = self.events.partition_point(|e| e.seq <= since);
        self.events.drain(..start);
        self.from = since;
        if since >= self.head {
            self.back_is_heartbeat = false;
            return Some((Vec::new(), None));
        }
        let n = limit.max(1).min(self.events.len());
        let page: Vec<AuditEvent> = self.events.drain(..n).collect();
        let last = match (self.events.is_empty(), page.last()) {
            (false, Some(e)) => e.seq,
            _ => self.head,
        };
        if self.events.is_empty() {
            self.back_is_heartbeat = false;
        }
        self.from = last;
        Some((page, Some(last)))
    }
}

/// What one action did within a group.
#[derive(Default)]
struct Life {
    events: u32,
    requested: u32,
    sent: u32,
    ok_results: u32,
    succeeded: u32,
}

/// The actions whose whole life in `group` is one plain success (see the module docs).
fn plain_actions(group: &[AuditEvent]) -> HashSet<i64> {
    let mut lives: HashMap<i64, Life> = HashMap::new();
    for e in group {
        let Some(action) = e.action else { continue };
        let life = lives.entry(action).or_default();
        life.events += 1;
        match e.kind.as_str() {
            "action_requested" => life.requested += 1,
            "action_sent" => life.sent += 1,
            "action_result" if !throttled(e.disposition.as_deref().unwrap_or_default()) => {
                life.ok_results += 1
            }
            "action_finished" if e.outcome.as_deref() == Some("succeeded") => life.succeeded += 1,
            _ => {}
        }
    }
    lives
        .into_iter()
        .filter(|(_, l)| {
            l.events == 4
                && l.requested == 1
                && l.sent == 1
                && l.ok_results == 1
                && l.succeeded == 1
        })
        .map(|(a, _)| a)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, kind: &str, action: Option<i64>, at: &str) -> AuditEvent {
        AuditEvent {
            seq,
            at: at.to_owned(),
            kind: kind.to_owned(),
            action,
            ..AuditEvent::default()
        }
    }

    /// A plain read's four events from `seq` on.
    fn plain_read(seq: u64, action: i64, at: &str) -> Vec<AuditEvent> {
        let mut result = event(seq + 2, "action_result", Some(action), at);
        result.disposition = Some("success".into());
        let mut finished = event(seq + 3, "action_finished", Some(action), at);
        finished.outcome = Some("succeeded".into());
        vec![
            event(seq, "action_requested", Some(action), at),
            event(seq + 1, "action_sent", Some(action), at),
            result,
            finished,
        ]
    }

    /// `events` as one group's notes.
    fn notes(events: Vec<AuditEvent>) -> Watched {
        let mut watched = Watched::default();
        for e in events {
            watched.event(e);
        }
        watched
    }

    fn kinds(events: &[AuditEvent]) -> Vec<(u64, String)> {
        events.iter().map(|e| (e.seq, e.kind.clone())).collect()
    }

    #[test]
    fn plain_reads_leave_only_their_latest_heartbeat() {
        let mut feed = WatchFeed::after(0);
        let mut group = plain_read(1, 1, "2026-11-30T10:00:00.000Z");
        group.extend(plain_read(5, 2, "2026-11-30T10:00:02.000Z"));
        group.extend(plain_read(9, 3, "2026-11-30T10:00:01.000Z"));
        feed.committed(&mut notes(std::mem::take(&mut group)), 12);
        assert!(group.is_empty(), "the group is taken");
        let (page, last) = feed.page(0, 100).expect("held");
        assert_eq!(kinds(&page), vec![(6, "action_sent".to_owned())]);
        assert_eq!(last, Some(12));
    }

    #[test]
    fn a_throttled_read_is_kept_whole_and_plain_ones_around_it_are_not() {
        let mut feed = WatchFeed::after(0);
        let mut group = plain_read(1, 1, "2026-11-30T10:00:00.000Z");
        let mut throttled = plain_read(5, 2, "2026-11-30T10:00:01.000Z");
        throttled[2].disposition = Some("rate_limited".into());
        throttled[3].outcome = Some("failed".into());
        group.extend(throttled);
        group.extend(plain_read(9, 3, "2026-11-30T10:00:02.000Z"));
        feed.committed(&mut notes(std::mem::take(&mut group)), 12);
        let (page, last) = feed.page(0, 100).expect("held");
        assert_eq!(
            kinds(&page),
            vec![
                (5, "action_requested".to_owned()),
                (6, "action_sent".to_owned()),
                (7, "action_result".to_owned()),
                (8, "action_finished".to_owned()),
                (10, "action_sent".to_owned()),
            ]
        );
        assert_eq!(last, Some(12));
    }

    #[test]
    fn an_action_not_finished_within_its_group_is_kept() {
        let mut feed = WatchFeed::after(0);
        let mut group = plain_read(1, 1, "2026-11-30T10:00:00.000Z");
        group.truncate(2);
        feed.committed(&mut notes(std::mem::take(&mut group)), 2);
        let (page, _) = feed.page(0, 100).expect("held");
        assert_eq!(
            kinds(&page),
            vec![
                (1, "action_requested".to_owned()),
                (2, "action_sent".to_owned())
            ]
        );
    }

    #[test]
    fn consecutive_heartbeats_across_groups_keep_the_latest() {
        let mut feed = WatchFeed::after(0);
        feed.committed(&mut notes(plain_read(1, 1, "2026-11-30T10:00:00.000Z")), 4);
        feed.committed(&mut notes(plain_read(5, 2, "2026-11-30T10:00:03.000Z")), 8);
        feed.committed(&mut notes(plain_read(9, 3, "2026-11-30T10:00:02.000Z")), 12);
        let (page, last) = feed.page(0, 100).expect("held");
        assert_eq!(kinds(&page), vec![(6, "action_sent".to_owned())]);
        assert_eq!(last, Some(12));
    }

    #[test]
    fn pages_continue_where_the_last_ended_and_drop_what_was_read() {
        let mut feed = WatchFeed::after(0);
        let mut group: Vec<AuditEvent> = (1..=5)
            .map(|s| event(s, "scope_updated", None, "2026-11-30T10:00:00.000Z"))
            .collect();
        feed.committed(&mut notes(std::mem::take(&mut group)), 5);
        let (page, last) = feed.page(0, 2).expect("held");
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(last, Some(2));
        let (page, last) = feed.page(2, 2).expect("held");
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(last, Some(4));
        let (page, last) = feed.page(4, 2).expect("held");
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![5]);
        assert_eq!(last, Some(5));
        assert_eq!(feed.page(5, 2), Some((Vec::new(), None)));
        // What was read is gone: an earlier cursor goes to the database.
        assert_eq!(feed.page(1, 2), None);
    }

    #[test]
    fn what_was_committed_before_the_feed_or_dropped_past_the_cap_is_not_claimed() {
        let mut feed = WatchFeed::with_cap(10, 3);
        assert_eq!(feed.page(9, 100), None, "before the feed began");
        assert_eq!(feed.page(10, 100), Some((Vec::new(), None)));
        let mut group: Vec<AuditEvent> = (11..=15)
            .map(|s| event(s, "scope_updated", None, "2026-11-30T10:00:00.000Z"))
            .collect();
        feed.committed(&mut notes(std::mem::take(&mut group)), 15);
        assert_eq!(feed.page(11, 100), None, "12 was dropped past the cap");
        let (page, last) = feed.page(12, 100).expect("held from 12 on");
        assert_eq!(
            page.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![13, 14, 15]
        );
        assert_eq!(last, Some(15));
    }

    #[test]
    fn a_group_with_nothing_kept_still_moves_the_head() {
        let mut feed = WatchFeed::after(0);
        let mut group: Vec<AuditEvent> = vec![];
        feed.committed(&mut notes(std::mem::take(&mut group)), 7);
        assert_eq!(feed.page(0, 10), Some((Vec::new(), Some(7))));
        assert_eq!(feed.page(7, 10), Some((Vec::new(), None)));
    }

    #[test]
    fn a_noted_heartbeat_stands_for_its_send_and_the_latest_of_a_group_wins() {
        let at = |text: &str| -> Timestamp { text.parse().expect("instant") };
        let mut feed = WatchFeed::after(0);
        let mut watched = notes(vec![event(
            1,
            "scope_updated",
            None,
            "2026-11-30T10:00:00.000Z",
        )]);
        watched.heartbeat(Heartbeat {
            seq: 3,
            action: 7,
            attempt: 1,
            at: at("2026-11-30T10:00:05Z"),
        });
        watched.heartbeat(Heartbeat {
            seq: 7,
            action: 8,
            attempt: 1,
            at: at("2026-11-30T10:00:04Z"),
        });
        // A plain action among the events, sent earlier than the noted sends.
        for e in plain_read(9, 9, "2026-11-30T10:00:01.000Z") {
            watched.event(e);
        }
        feed.committed(&mut watched, 12);
        let (page, last) = feed.page(0, 100).expect("held");
        assert_eq!(
            kinds(&page),
            vec![
                (1, "scope_updated".to_owned()),
                (3, "action_sent".to_owned())
            ]
        );
        assert_eq!(page[1].action, Some(7));
        assert_eq!(page[1].attempt, Some(1));
        assert_eq!(page[1].at, "2026-11-30T10:00:05.000Z");
        assert_eq!(last, Some(12));
    }

    #[test]
    fn what_an_undone_operation_noted_is_forgotten() {
        let mut watched = Watched::default();
        watched.event(event(1, "scope_updated", None, "2026-11-30T10:00:00.000Z"));
        let mark = watched.mark();
        watched.event(event(2, "scope_updated", None, "2026-11-30T10:00:00.000Z"));
        watched.heartbeat(Heartbeat {
            seq: 3,
            action: 1,
            attempt: 1,
            at: "2026-11-30T10:00:00Z".parse().expect("instant"),
        });
        watched.undo(mark);
        let mut feed = WatchFeed::after(0);
        feed.committed(&mut watched, 1);
        let (page, _) = feed.page(0, 100).expect("held");
        assert_eq!(kinds(&page), vec![(1, "scope_updated".to_owned())]);
        // task_opened is never noted.
        watched.event(event(2, "task_opened", None, "2026-11-30T10:00:00.000Z"));
        assert_eq!(watched.mark().0, 0);
    }
}
