//! The demo's report as text: a timeline like an audit trail, a summary table, and where to
//! look next. Colour (ANSI) only when asked for (stdout is a terminal).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use backstop_fake_api::AttemptRecord;
use backstop_gateway::engine::TaskCancelled;
use backstop_store::audit::AuditEvent;
use jiff::{SignedDuration, Timestamp};

use super::Report;

struct Style {
    on: bool,
}

impl Style {
    fn paint(&self, code: &str, text: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }
    fn bold(&self, text: &str) -> String {
        self.paint("1", text)
    }
    fn event(&self, word: &str) -> String {
        let padded = format!("{word:<17}");
        let code = match word {
            "result" | "sent" | "requested" | "provider saw" => return padded,
            "retry scheduled" | "scope updated" | "status query" => "33",
            "reconciled" | "finished" => "32",
            _ => "31",
        };
        self.paint(code, &padded)
    }
}

fn parse(at: &str) -> Option<Timestamp> {
    at.parse().ok()
}

fn relative(at: Option<Timestamp>, origin: Timestamp) -> String {
    match at {
        Some(at) => {
            let ms = at.duration_since(origin).as_millis();
            format!("+{}.{:03}s", ms / 1000, ms % 1000)
        }
        None => "+?".to_owned(),
    }
}

/// `n` and `word`, with an `s` unless `n` is 1: `1 attempt`, `4 attempts`.
fn count<N: std::fmt::Display + PartialEq + From<u8>>(n: N, word: &str) -> String {
    if n == N::from(1) {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// `text` as one POSIX shell word: as is when it holds only characters a shell leaves alone,
/// else in single quotes (a `'` inside written `'\''`), so a printed command runs as printed.
pub fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+:@%,=".contains(c));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

fn seconds(d: SignedDuration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

fn word(kind: &str) -> &str {
    match kind {
        "action_requested" => "requested",
        "action_sent" => "sent",
        "action_result" => "result",
        "action_finished" => "finished",
        "retry_scheduled" => "retry scheduled",
        "retry_started" => "retry started",
        "scope_updated" => "scope updated",
        "reconciliation_required" => "reconcile first",
        "reconciliation_lookup" => "status query",
        "reconciled" => "reconciled",
        "escalated" => "escalated",
        "decision" => "decision",
        "cancelled" => "cancelled",
        "budget_exhausted" => "budget exhausted",
        "deadline_exhausted" => "deadline exhausted",
        "circuit_opened" => "circuit opened",
        other => other,
    }
}

/// Where an audit event stands in the life of an action, for rows recorded in the same
/// millisecond: requested, then sent, then seen by the provider, then the answer's scope
/// update and result, then what backstop did about the result, then how the action ended. (An
/// uncertain write's result is recorded after its status query, so the recording order alone
/// would show the query first.)
fn stage(kind: &str) -> u8 {
    match kind {
        "task_opened" | "action_requested" => 0,
        "action_sent" | "retry_started" => 1,
        "scope_updated" => 3,
        "action_result" => 4,
        "retry_scheduled" | "reconciliation_required" | "reconciliation_lookup" => 5,
        _ => 6,
    }
}

/// The [`stage`] of a provider's attempt record: after the send, before the answer's effects.
/// A status query's attempt takes the stage of the `reconciliation_lookup` event that records
/// its answer instead (see [`StatusQueries`]).
const PROVIDER_STAGE: u8 = 2;

/// Which provider attempts were status queries, each paired with the `reconciliation_lookup`
/// event that recorded its answer: the n-th lookup event with the first attempt not yet paired
/// whose method and path fit the lookup's template and whose status is the one recorded.
#[derive(Default)]
struct StatusQueries {
    /// Attempt sequence number → the lookup event's sequence number.
    event_of: BTreeMap<u64, u64>,
}

impl StatusQueries {
    fn of(report: &Report) -> StatusQueries {
        let mut queries = StatusQueries::default();
        for e in report
            .events
            .iter()
            .filter(|e| e.kind == "reconciliation_lookup")
        {
            let Some((method, template)) = e.source.as_deref().and_then(|s| s.split_once(' '))
            else {
                continue;
            };
            let template = template.split('?').next().unwrap_or(template);
            let attempt = report.attempts.iter().find(|a| {
                !queries.event_of.contains_key(&a.seq)
                    && a.method == method
                    && path_fits(template, &a.path)
                    && (e.status.is_none() || a.status == e.status)
            });
            if let Some(attempt) = attempt {
                queries.event_of.insert(attempt.seq, e.seq);
            }
        }
        queries
    }
}

/// Whether `path` fits the route template `template` (`/v1/transfers/{id}`): segment by
/// segment, a `{placeholder}` fits any segment.
fn path_fits(template: &str, path: &str) -> bool {
    let (mut wanted, mut got) = (template.split('/'), path.split('/'));
    loop {
        match (wanted.next(), got.next()) {
            (None, None) => return true,
            (Some(w), Some(g)) if w == g || (w.starts_with('{') && w.ends_with('}')) => {}
            _ => return false,
        }
    }
}

/// Where a scope's numbers came from, in a reader's words: the gateway names quota headers by
/// their dialect (`ietf quota headers`), the rest (`HTTP 429 Retry-After`) reads as is.
fn source_words(source: &str) -> String {
    let Some(dialect) = source.strip_suffix(" quota headers") else {
        return source.to_owned();
    };
    let headers = match dialect {
        "ietf" => "IETF draft: RateLimit, RateLimit-Policy",
        "openai" => "OpenAI: x-ratelimit-*",
        "anthropic" => "Anthropic: anthropic-ratelimit-*",
        "github" => "GitHub: x-ratelimit-*",
        "generic" => "x-ratelimit-*",
        other => other,
    };
    format!("quota headers ({headers})")
}

/// What the fake provider's scripted fault did, in a reader's words.
fn fault_words(fault: &str) -> String {
    let words = match fault {
        "store_then_drop" => "the provider stored the write, then dropped the connection",
        "drop" => "the provider dropped the connection without acting",
        "timeout" => "the provider never answered",
        "slow" => "the provider answered slowly",
        "status" => "a scripted error status",
        "error_code" => "a scripted error code",
        other => {
            return match other.strip_prefix("quota:") {
                Some(quota) => format!("the provider's quota {quota} was used up"),
                None => format!("scripted fault {other}"),
            }
        }
    };
    words.to_owned()
}

/// One line of the timeline.
struct Row {
    at: Option<Timestamp>,
    /// The row's [`stage`], which orders rows of equal times causally.
    stage: u8,
    /// The sequence number of the row's record (an audit event's, or for a provider attempt its
    /// own; for a status query's attempt, the lookup event's), then 0 for a provider attempt and
    /// 1 for an audit event: the last, stable key of the order.
    order: (u64, u8),
    who: String,
    /// The action id (`Backstop-Action-Id`), the name the summary's waits use.
    action: String,
    what: String,
    route: String,
    status: String,
    disposition: String,
    reason: String,
}

/// What the agents' answers tell about each action: the concrete path it was called with and,
/// for an answer the gateway made itself, the problem's `detail` (why the action ended).
#[derive(Default)]
struct Known {
    paths: BTreeMap<i64, String>,
    details: BTreeMap<i64, String>,
}

impl Known {
    fn of(report: &Report) -> Known {
        let mut known = Known::default();
        for answer in &report.answers {
            let Some(action) = answer.action else {
                continue;
            };
            if let Some((_, path)) = answer.request.split_once(' ') {
                known.paths.insert(action, path.to_owned());
            }
            if let Some(detail) = &answer.detail {
                known.details.insert(action, detail.clone());
            }
        }
        known
    }
}

/// `text` with every RFC 3339 instant in it (a word such as `2026-07-26T18:40:10.5Z`, maybe
/// followed by punctuation) written relative to `origin` like the timeline's clock (`+2.000s`).
fn relative_instants(text: &str, origin: Timestamp) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let bare = word.trim_end_matches([':', ';', ',', '.', ')']);
        match parse(bare).filter(|_| bare.starts_with(|c: char| c.is_ascii_digit())) {
            Some(at) => {
                out.push_str(&relative(Some(at), origin));
                out.push_str(&word[bare.len()..]);
            }
            None => out.push_str(word),
        }
    }
    out
}

/// What the timeline last said about each scope (`provider/scope`): the boundary it showed and
/// the row's reason, so a `scope_updated` event that repeats them is left out.
#[derive(Default)]
struct ScopesShown {
    boundaries: BTreeMap<String, Timestamp>,
    reasons: BTreeMap<String, String>,
}

impl ScopesShown {
    /// Whether the `scope_updated` row `row` (of `scope`) says something new; remembers it.
    fn is_new(&mut self, scope: &str, row: &Row) -> bool {
        let said = format!("{} {}", row.status, row.reason);
        self.reasons.insert(scope.to_owned(), said.clone()) != Some(said)
    }
}

fn event_row(e: &AuditEvent, origin: Timestamp, known: &Known, scopes: &mut ScopesShown) -> Row {
    let mut reason = Vec::new();
    if let Some(outcome) = &e.outcome {
        match e.action.and_then(|a| known.details.get(&a)) {
            Some(detail) if outcome != "succeeded" => {
                let detail = relative_instants(detail, origin);
                reason.push(format!("outcome {outcome}: {detail}"));
            }
            _ => reason.push(format!("outcome {outcome}")),
        }
    }
    let at = parse(&e.at);
    if let Some(boundary) = e.boundary.as_deref() {
        match parse(boundary) {
            Some(b) => {
                // A scope record keeps its boundary until a newer one: said once, and not
                // again once it lies in the past.
                let repeated = match (&e.scope, e.kind.as_str()) {
                    (Some(scope), "scope_updated") => {
                        let past = at.is_some_and(|at| b <= at);
                        let shown = scopes.boundaries.insert(scope.clone(), b) == Some(b);
                        past || shown
                    }
                    _ => false,
                };
                if !repeated {
                    reason.push(format!("not before {}", relative(Some(b), origin)));
                }
            }
            None if boundary == "unknown" => {}
            None => reason.push(format!("boundary {boundary}")),
        }
    }
    if let Some(due) = e.due_at.as_deref().and_then(parse) {
        reason.push(format!("wakes at {}", relative(Some(due), origin)));
    }
    if let Some(source) = &e.source {
        reason.push(source_words(source));
    }
    if e.kind == "action_requested" || e.kind == "reconciled" {
        if let Some(key) = &e.idempotency_key {
            if !matches!(e.method.as_deref(), Some("GET" | "HEAD" | "OPTIONS")) {
                reason.push(format!("key {key}"));
            }
        }
    }
    if let Some(decision) = &e.decision {
        reason.push(format!("decision {decision}"));
    }
    let concrete = e
        .action
        .and_then(|a| known.paths.get(&a))
        .filter(|path| Some(path.as_str()) != e.route.as_deref());
    let route = match (&e.method, &e.route, concrete) {
        (Some(m), Some(r), Some(path)) => format!("{m} {r} ({path})"),
        (Some(m), Some(r), None) => format!("{m} {r}"),
        (None, Some(r), _) => r.clone(),
        _ => e
            .scope
            .clone()
            .map(|s| format!("scope {s}"))
            .unwrap_or_default(),
    };
    Row {
        at,
        stage: stage(&e.kind),
        order: (e.seq, 1),
        who: e.task.clone().unwrap_or_else(|| "backstop".to_owned()),
        action: e.action.map(|a| a.to_string()).unwrap_or_default(),
        what: word(&e.kind).to_owned(),
        route,
        status: e.status.map(|s| s.to_string()).unwrap_or_default(),
        disposition: e.disposition.clone().unwrap_or_default(),
        reason: reason.join("; "),
    }
}

fn attempt_row(a: &AttemptRecord, queries: &StatusQueries) -> Row {
    let mut reason = Vec::new();
    if let Some(fault) = &a.fault {
        reason.push(fault_words(fault));
    }
    if let Some(key) = &a.idempotency_key {
        reason.push(format!("key {key}"));
    }
    if a.replayed {
        reason.push("idempotent replay".to_owned());
    }
    let path = match &a.query {
        Some(q) => format!("{}?{q}", a.path),
        None => a.path.clone(),
    };
    Row {
        at: parse(&a.at),
        stage: match queries.event_of.get(&a.seq) {
            Some(_) => stage("reconciliation_lookup"),
            None => PROVIDER_STAGE,
        },
        order: (*queries.event_of.get(&a.seq).unwrap_or(&a.seq), 0),
        who: "  provider".to_owned(),
        action: String::new(),
        what: "provider saw".to_owned(),
        route: format!("{} {path}", a.method),
        status: a
            .status
            .map(|s| s.to_string())
            .unwrap_or_else(|| format!("{:?}", a.outcome).to_lowercase()),
        disposition: String::new(),
        reason: reason.join("; "),
    }
}

/// The whole report: timeline, summary, escalation, paths and commands. `program` is how the
/// printed commands start (`backstop`, or the path of the running binary), already a shell word.
pub fn render(report: &Report, colour: bool, program: &str) -> String {
    let style = Style { on: colour };
    let mut out = String::new();
    let origin = report
        .events
        .iter()
        .filter_map(|e| parse(&e.at))
        .chain(report.attempts.iter().filter_map(|a| parse(&a.at)))
        .min()
        .unwrap_or(Timestamp::UNIX_EPOCH);

    let _ = writeln!(
        out,
        "{}",
        style.bold("backstop demo — the reference scenario against a fake provider")
    );
    let _ = writeln!(out, "{}", header(report));
    let _ = writeln!(out, "{}", style.bold("Timeline"));
    timeline(report, &style, origin, &mut out);

    summary(report, &style, origin, &mut out);
    escalation(report, &style, &mut out);
    where_to_look(report, &style, program, &mut out);
    out
}

/// The timeline: every audit event (but task openings and scope updates that repeat the last
/// one of their scope) and every provider attempt, in time order, rows of one instant in
/// causal order.
fn timeline(report: &Report, style: &Style, origin: Timestamp, out: &mut String) {
    let known = Known::of(report);
    let mut scopes = ScopesShown::default();
    let mut rows: Vec<Row> = Vec::new();
    for e in report.events.iter().filter(|e| e.kind != "task_opened") {
        let row = event_row(e, origin, &known, &mut scopes);
        let keep = match (&e.scope, e.kind.as_str()) {
            (Some(scope), "scope_updated") => scopes.is_new(scope, &row),
            _ => true,
        };
        if keep {
            rows.push(row);
        }
    }
    let queries = StatusQueries::of(report);
    rows.extend(report.attempts.iter().map(|a| attempt_row(a, &queries)));
    rows.sort_by_key(|row| (row.at, row.stage, row.order));
    let _ = writeln!(
        out,
        "{:<9} {:<12} {:<6} {:<17} {:<40} {:<6} {:<12} reason",
        "time", "task", "action", "event", "route", "status", "disposition"
    );
    for row in &rows {
        let _ = writeln!(
            out,
            "{:<9} {:<12} {:<6} {} {:<40} {:<6} {:<12} {}",
            relative(row.at, origin),
            row.who,
            row.action,
            style.event(&row.what),
            row.route,
            row.status,
            row.disposition,
            row.reason
        );
    }
}

/// The sentence under the title: how many tasks ran and the quota scopes their calls fell
/// under, as the audit log names them.
fn header(report: &Report) -> String {
    let tasks: std::collections::BTreeSet<&str> = report
        .events
        .iter()
        .filter_map(|e| e.task.as_deref())
        .collect();
    let scopes: std::collections::BTreeSet<&str> = report
        .events
        .iter()
        .filter(|e| e.kind == "scope_updated")
        .filter_map(|e| e.scope.as_deref())
        .collect();
    let scopes: Vec<&str> = scopes.into_iter().collect();
    let shared = match scopes.as_slice() {
        [] => "no quota scope recorded".to_owned(),
        [one] => format!("one quota scope ({one})"),
        [init @ .., last] => format!("the quota scopes {} and {last}", init.join(", ")),
    };
    let tasks = match tasks.len() {
        1 => "One agent task calls".to_owned(),
        2 => "Two agent tasks call".to_owned(),
        3 => "Three agent tasks call".to_owned(),
        n => format!("{n} agent tasks call"),
    };
    format!(
        "{tasks} one fake provider under {shared}; a boundary one task\n\
         meets in a scope holds every task's calls in it. Every line below comes from backstop's\n\
         audit log or from the provider's own attempt record; times are relative to the first.\n"
    )
}

fn summary(report: &Report, style: &Style, origin: Timestamp, out: &mut String) {
    let _ = writeln!(out, "\n{}", style.bold("Summary"));
    let totals = task_table(report, out);
    provider_calls(report, &totals, out);
    let _ = writeln!(out, "\nWaits and their sources:");
    waits(report, origin, out);
    if let Some(cancelled) = &report.cancelled {
        let _ = writeln!(out, "{}.", cancellation(cancelled));
    }
}

/// One task's counts in the summary table. A status query (reconciliation lookup) is a call to
/// the provider but not an attempt of the write it reconciles (the write's answer counts its
/// attempts only), so calls = requests + status queries.
#[derive(Debug, Default, Clone, Copy)]
struct Calls {
    /// Logical actions.
    actions: usize,
    /// Requests sent.
    sent: usize,
    /// Status queries.
    queries: usize,
}

impl Calls {
    fn calls(self) -> usize {
        self.sent + self.queries
    }

    fn add(self, other: Calls) -> Calls {
        Calls {
            actions: self.actions + other.actions,
            sent: self.sent + other.sent,
            queries: self.queries + other.queries,
        }
    }
}

/// The per-task table with its total line; returns the total.
fn task_table(report: &Report, out: &mut String) -> Calls {
    let mut tasks: BTreeMap<String, Calls> = BTreeMap::new();
    for e in &report.events {
        if let Some(task) = &e.task {
            let entry = tasks.entry(task.clone()).or_default();
            match e.kind.as_str() {
                "action_requested" => entry.actions += 1,
                "action_sent" => entry.sent += 1,
                "reconciliation_lookup" => entry.queries += 1,
                _ => {}
            }
        }
    }
    let _ = writeln!(
        out,
        "{:<12} {:>15} {:>13} {:>14} {:>8}  answers the agent got",
        "task", "logical actions", "requests sent", "status queries", "calls"
    );
    for (task, calls) in &tasks {
        let Calls {
            actions,
            sent,
            queries,
        } = calls;
        let _ = writeln!(
            out,
            "{task:<12} {actions:>15} {sent:>13} {queries:>14} {:>8}  {}",
            calls.calls(),
            answers_of(report, task)
        );
    }
    let total = tasks.values().fold(Calls::default(), |sum, t| sum.add(*t));
    let Calls {
        actions: logical,
        sent,
        queries,
    } = total;
    let calls = total.calls();
    let _ = writeln!(
        out,
        "{:<12} {logical:>15} {sent:>13} {queries:>14} {calls:>8}",
        "total"
    );
    let _ = writeln!(
        out,
        "(a status query asks the provider whether a write happened: a call to the provider, counted and audited apart from the write's attempts)"
    );
    total
}

/// The answers `task`'s agent got, in order: `GET /v1/items/42 → 200 (2 attempts), …`.
fn answers_of(report: &Report, task: &str) -> String {
    let answers: Vec<String> = report
        .answers
        .iter()
        .filter(|a| a.task == task)
        .map(|a| {
            format!(
                "{} → {}{}{}",
                a.request,
                a.status,
                a.outcome
                    .as_deref()
                    .map(|o| format!(" {o}"))
                    .unwrap_or_default(),
                a.attempts
                    .as_deref()
                    .map(|n| format!(" ({n} attempt{})", if n == "1" { "" } else { "s" }))
                    .unwrap_or_default()
            )
        })
        .collect();
    answers.join(", ")
}

/// What the provider saw, per route, against what backstop recorded (`total`).
fn provider_calls(report: &Report, total: &Calls, out: &mut String) {
    let seen = report.attempts.len();
    let mut by_route: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for a in &report.attempts {
        let entry = by_route
            .entry(a.route.clone().unwrap_or_else(|| a.path.clone()))
            .or_default();
        entry.0 += 1;
        if a.status == Some(429) {
            entry.1 += 1;
        }
    }
    let Calls { sent, queries, .. } = *total;
    let calls = total.calls();
    let agreement = if seen == calls {
        format!("= {sent} requests + {queries} status queries above")
    } else {
        format!("backstop recorded {calls}: {sent} requests + {queries} status queries")
    };
    let _ = writeln!(
        out,
        "\nThe provider saw {} ({agreement}) for {}:",
        count(seen, "call"),
        count(total.actions, "logical action")
    );
    for (route, (count, throttled)) in &by_route {
        let _ = writeln!(
            out,
            "  {route:<28} {count:>3} call{} ({throttled} answered 429)",
            if *count == 1 { "" } else { "s" }
        );
    }
}

/// When each action was requested and first sent, and every scope boundary with its source, as
/// the audit log recorded them.
#[derive(Default)]
struct WaitMarks {
    requested: BTreeMap<i64, Timestamp>,
    first_sent: BTreeMap<i64, Timestamp>,
    scope_sources: Vec<(Timestamp, String)>,
}

impl WaitMarks {
    fn of(events: &[AuditEvent]) -> WaitMarks {
        let mut marks = WaitMarks::default();
        for e in events {
            let at = parse(&e.at);
            if e.kind == "scope_updated" {
                if let (Some(at), Some(source)) = (at, &e.source) {
                    if e.boundary.is_some() {
                        marks.scope_sources.push((at, source.clone()));
                    }
                }
            }
            if let (Some(action), Some(at)) = (e.action, at) {
                match e.kind.as_str() {
                    "action_requested" => {
                        marks.requested.entry(action).or_insert(at);
                    }
                    "action_sent" => {
                        marks.first_sent.entry(action).or_insert(at);
                    }
                    _ => {}
                }
            }
        }
        marks
    }
}

/// One line per scheduled retry and per action that waited in the delayed queue before its
/// first send, with where the wait came from.
fn waits(report: &Report, origin: Timestamp, out: &mut String) {
    let marks = WaitMarks::of(&report.events);
    let mut last_scope_source: Option<(Timestamp, String)> = None;
    for e in &report.events {
        let (Some(action), Some(at)) = (e.action, parse(&e.at)) else {
            continue;
        };
        let task = e.task.clone().unwrap_or_default();
        let route = e.route.clone().unwrap_or_default();
        if e.kind == "retry_scheduled" {
            if let Some(due) = e.due_at.as_deref().and_then(parse) {
                let source = e
                    .source
                    .clone()
                    .unwrap_or_else(|| "provider Retry-After (HTTP 429)".to_owned());
                let _ = writeln!(
                    out,
                    "  {task:<12} action {action:<3} retry after {} (scheduled at {}) — {source}",
                    seconds(due.duration_since(at)),
                    relative(Some(at), origin)
                );
            }
        }
        if e.kind != "action_sent" || marks.first_sent.get(&action) != Some(&at) {
            continue;
        }
        let Some(start) = marks.requested.get(&action) else {
            continue;
        };
        let queued = at.duration_since(*start);
        if queued < SignedDuration::from_millis(200) {
            continue;
        }
        last_scope_source = marks
            .scope_sources
            .iter()
            .rev()
            .find(|(when, _)| when <= start)
            .cloned()
            .or(last_scope_source);
        let source = last_scope_source
            .as_ref()
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| "pacing".to_owned());
        let _ = writeln!(
            out,
            "  {task:<12} action {action:<3} waited {} in the delayed queue before its first send ({route}) — scope boundary from {source}",
            seconds(queued)
        );
    }
}

/// The sentence on what cancelling the task changed (without its final full stop).
fn cancellation(cancelled: &TaskCancelled) -> String {
    // The cancellation's three counts look at the same actions from three places (their
    // outcomes, the delayed queue, the durable retries): they overlap, never add them up.
    let mut sentence = format!(
        "\nCancelled {}: {} ended cancelled",
        cancelled.task_id,
        count(cancelled.actions_cancelled, "action"),
    );
    let waiting = cancelled.waiting_dropped;
    if waiting > 0 {
        let (were, they) = if waiting == 1 {
            ("was", "it")
        } else {
            ("were", "they")
        };
        let _ = write!(
            sentence,
            "; {waiting} of them {were} waiting in the delayed queue and {were} dropped before {they} woke"
        );
    }
    let retries = cancelled.retries_dropped;
    if retries > 0 {
        let their = if retries == 1 { "its" } else { "their" };
        let _ = write!(
            sentence,
            ", and {retries} of those also had {their} scheduled retry removed from the store"
        );
    }
    sentence
}

fn escalation(report: &Report, style: &Style, out: &mut String) {
    let _ = writeln!(out, "\n{}", style.bold("Open escalation"));
    if report.escalations.is_empty() {
        let _ = writeln!(out, "  none");
        return;
    }
    for e in &report.escalations {
        let case = &e.case_file;
        let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_owned();
        let _ = writeln!(
            out,
            "  escalation {} (action {}): {} — {}",
            e.id.0,
            e.action.0,
            text(&case["reason"]),
            text(&case["reason_detail"])
        );
        let _ = writeln!(
            out,
            "  {}, idempotency key {}, reconciliation query {}",
            text(&case["endpoint"]).trim(),
            text(&case["idempotency_key"]),
            text(&case["reconciliation_query"])
        );
        let _ = writeln!(out, "  options:");
        for option in case["options"].as_array().into_iter().flatten() {
            let confirm = if option["requires_confirmation"].as_bool() == Some(true) {
                " [needs explicit confirmation]"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "    {:<15} {}{confirm}",
                text(&option["option"]),
                text(&option["risk"])
            );
        }
    }
}

fn where_to_look(report: &Report, style: &Style, program: &str, out: &mut String) {
    let db = shell_word(&report.store_path.display().to_string());
    let _ = writeln!(out, "\n{}", style.bold("Where to look"));
    let _ = writeln!(out, "  directory  {}", report.dir.display());
    let _ = writeln!(out, "  store      {}", report.store_path.display());
    match &report.audit_path {
        Ok(path) => {
            let _ = writeln!(out, "  audit log  {} (NDJSON export)", path.display());
        }
        Err(e) => {
            let _ = writeln!(out, "  audit log  not exported: {e}");
        }
    }
    let _ = writeln!(out, "\n  {program} audit verify --db {db}");
    let _ = writeln!(out, "  {program} audit export --db {db}");
    let _ = writeln!(out, "  {program} audit head --db {db}");
    let policy = shell_word(&report.dir.join(super::POLICY_FILE).display().to_string());
    let _ = writeln!(
        out,
        "  {program} snapshots export --db {db} --policy {policy} | {program} diagnose -"
    );
    if let Some(e) = report.escalations.first() {
        // The policy reads its secrets from the environment, as every policy does: these are
        // the demo's own throwaway values.
        let secrets = format!(
            "DEMO_AGENT_TOKEN={} DEMO_PROVIDER_KEY={} DEMO_OPERATOR_TOKEN={}",
            super::AGENT_TOKEN,
            super::PROVIDER_KEY,
            super::OPERATOR_TOKEN
        );
        let operator = format!("BACKSTOP_OPERATOR_TOKEN={}", super::OPERATOR_TOKEN);
        let _ = writeln!(
            out,
            "\n  The open escalation, on a gateway serving this store (the first command, in another\n  \
             terminal, listens on 127.0.0.1:8080; the demo's provider is gone, so a status query\n  \
             answers inconclusive and the escalation stays open):"
        );
        let _ = writeln!(out, "  {secrets} {program} serve --config {policy}");
        let _ = writeln!(out, "  {operator} {program} escalations show {}", e.id.0);
        let _ = writeln!(
            out,
            "  {operator} {program} escalations decide {} --option query_status",
            e.id.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, at: &str, kind: &str, extra: serde_json::Value) -> AuditEvent {
        let mut e = AuditEvent {
            seq,
            at: format!("2026-01-01T00:00:00.{at}Z"),
            kind: kind.to_owned(),
            task: Some("t".to_owned()),
            action: Some(4),
            method: Some("POST".to_owned()),
            route: Some("/v1/transfers".to_owned()),
            ..AuditEvent::default()
        };
        if let Some(status) = extra["status"].as_u64() {
            e.status = u16::try_from(status).ok();
        }
        e.source = extra["source"].as_str().map(str::to_owned);
        e.disposition = extra["disposition"].as_str().map(str::to_owned);
        e
    }

    fn attempt(seq: u64, at: &str, method: &str, path: &str, status: Option<u16>) -> AttemptRecord {
        serde_json::from_value(serde_json::json!({
            "seq": seq, "at": format!("2026-01-01T00:00:00.{at}Z"), "method": method,
            "path": path, "query": null, "route": null, "call": null, "idempotency_key": null,
            "body_sha256": null, "body_bytes": 0, "auth_present": true, "auth_sha256": null,
            "status": status, "outcome": if status.is_some() { "answered" } else { "dropped" },
            "fault": null, "replayed": false
        }))
        .expect("an attempt record")
    }

    /// The timeline's event words and provider methods, in printed order.
    fn order(lookup_at: &str, get_at: &str) -> Vec<String> {
        let lookup = serde_json::json!({
            "status": 200, "disposition": "found",
            "source": "GET /v1/transfers?idempotency_key={key}"
        });
        let uncertain = serde_json::json!({"disposition": "uncertain"});
        // As the gateway records them: the uncertain result after the status query it caused.
        let report = Report {
            dir: "d".into(),
            store_path: "d/backstop.db".into(),
            audit_path: Err("none".to_owned()),
            events: vec![
                event(1, "100", "action_sent", serde_json::json!({})),
                event(2, lookup_at, "reconciliation_lookup", lookup),
                event(3, "105", "action_result", uncertain),
                event(4, "110", "reconciled", serde_json::json!({})),
            ],
            attempts: vec![
                attempt(1, "105", "POST", "/v1/transfers", None),
                attempt(2, get_at, "GET", "/v1/transfers", Some(200)),
            ],
            answers: Vec::new(),
            escalations: Vec::new(),
            cancelled: None,
            failures: Vec::new(),
        };
        let mut out = String::new();
        let origin = parse("2026-01-01T00:00:00.100Z").expect("instant");
        timeline(&report, &Style { on: false }, origin, &mut out);
        out.lines()
            .skip(1)
            .map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                match words.as_slice() {
                    [_, "provider", "provider", "saw", method, ..] => format!("saw {method}"),
                    [_, _, _, first, second, ..] => format!("{first} {second}"),
                    _ => l.to_owned(),
                }
            })
            .collect()
    }

    #[test]
    fn rows_of_one_instant_print_in_causal_order() {
        let causal = [
            "sent POST",
            "saw POST",
            "result POST",
            "saw GET",
            "status query",
            "reconciled POST",
        ];
        // All of the write's rows in one millisecond, or each a millisecond apart.
        assert_eq!(order("105", "105"), causal);
        assert_eq!(order("107", "106"), causal);
    }
}
