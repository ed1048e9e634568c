//! Scheduler scale: how much resident memory one delayed action costs when 10^5 or 10^6 of them
//! are held at once, and how late they are released when they come due in waves.
//!
//! Why: a 429 storm or a long `Retry-After` parks every action of a scope in the delayed queue
//! (SPEC §4.1); a gateway shared by many agent runs must hold very large queues cheaply and still
//! release each action on time, or retries arrive late (wasted budget) or the process runs out
//! of memory.
//!
//! How (through the scheduler's public API only, with the real tokio runtime and clock):
//! 1. One scope whose `max_delayed_requests` and `max_concurrent_requests` exceed N, paced at a
//!    published limit far above the release rate (so the GCRA check runs and never throttles).
//! 2. N tasks each build an [`AcquireRequest`] and call [`SchedulerHandle::acquire`] with a
//!    `not_before` in the future, as the engine does: the scheduler holds them in its delayed
//!    queue. Each is what a waiting action of the gateway is: one tokio task awaiting its
//!    answer, plus the scheduler's entry for it. The sizes of the task's future and of
//!    `acquire`'s future are printed (`std::mem::size_of_val`).
//! 3. Resident memory (`VmRSS` of /proc/self/status) is read before the tasks are spawned and
//!    again once the scheduler reports all N delayed ([`SchedulerHandle::scopes`]); the
//!    difference divided by N is the cost of one delayed action (task + queue entry + the
//!    request's strings).
//! 4. The actions come due in 10 waves one second apart. `burst`: every action of a wave has
//!    the same instant (what a shared boundary without jitter would do). `spread`: each wave's
//!    actions are spread uniformly over its second (what the §4.2 jitter after a boundary does).
//!    Lateness = the clock when `acquire` returned `Go` minus the action's `not_before`. The
//!    scheduler's own part ("granted") is
//!    [`Permit::granted_at`](backstop_gateway::scheduler::Permit::granted_at) (its clock as it
//!    sent `Go`) minus `not_before`; the rest is the runtime waking the waiting task.
//! 5. `wake`, the runtime's floor without the scheduler: the same N tasks in the same burst
//!    waves, each awaiting a plain `tokio::sync::oneshot`; one task per wave sleeps until the
//!    wave's instant and sends to each in turn ("granted" = its clock at each send). Its memory
//!    per action is the task plus the channel (and 8 B of the bench's sender list).
//!
//! Run: `cargo bench -p backstop-gateway --bench scheduler_scale` (both sizes, all modes); or
//! `... --bench scheduler_scale -- 100000 spread` for one size and one mode.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backstop_core::budget::{ActionBudget, ClassBudget};
use backstop_core::clock::Clock;
use backstop_core::pacing::Priority;
use backstop_core::policy::Policy;
use backstop_gateway::clock::TokioClock;
use backstop_gateway::metrics::Metrics;
use backstop_gateway::scheduler::{AcquireRequest, Acquired, SchedulerHandle};
use jiff::{SignedDuration, Timestamp};
use tokio::sync::oneshot;

/// The allocator the `backstop` binary ships with (crates/cli/src/main.rs): resident memory per
/// delayed action and the cost of freeing each released task are the allocator's as much as
/// the scheduler's, so the bench measures them with the one in use.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WAVES: u64 = 10;
const WAVE_GAP: Duration = Duration::from_secs(1);
/// Distinct task ids among the actions (a run has many actions).
const TASKS: u64 = 1_000;
/// Lateness slot value of an action that never got `Go`.
const NOT_RELEASED: u32 = u32::MAX;
/// The budget class of every action: a wait far longer than the run.
const CLASS: ClassBudget = ClassBudget {
    max_attempts: 4,
    max_wait: Duration::from_secs(3600),
};
/// The one scope every action falls under.
const SCOPE: &str = "bench/account";

const POLICY: &str = r#"
shared_scope:
  max_delayed_requests: 4000000
  max_concurrent_requests: 4000000
providers:
  bench:
    base_url: http://127.0.0.1:9
    scopes:
      account: { limit: 1000000000, window_seconds: 1, headroom: 0.8 }
    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
"#;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Burst,
    Spread,
    Wake,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Burst => "burst",
            Mode::Spread => "spread",
            Mode::Wake => "wake",
        }
    }
}

/// Resident set size of this process in KiB, from `VmRSS` in /proc/self/status.
fn rss_kib() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("/proc/self/status: cannot read: {e}"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "/proc/self/status: no readable VmRSS line".to_owned())
}

fn at_offset(base: Timestamp, offset: Duration) -> Result<Timestamp, String> {
    SignedDuration::try_from(offset)
        .ok()
        .and_then(|d| base.checked_add(d).ok())
        .ok_or_else(|| format!("{base} + {offset:?}: out of range"))
}

/// Percentile (0..=100) of sorted microsecond values, nearest rank.
fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Microseconds from `due` to `at` (0 when early), saturated below [`NOT_RELEASED`].
fn micros_since(due: Timestamp, at: Timestamp) -> u32 {
    let late = at.duration_since(due);
    u32::try_from(late.as_micros().max(0)).unwrap_or(NOT_RELEASED - 1)
}

/// A request with nothing to wait for, for measuring the size of `acquire`'s future; the
/// scheduler admits it at once.
fn probe_request() -> AcquireRequest {
    AcquireRequest {
        task_id: "probe".to_owned(),
        agent: "bench-agent".to_owned(),
        priority: Priority::Normal,
        scopes: vec![SCOPE.to_owned()],
        budget: ActionBudget::new(CLASS, None),
        not_before: None,
        route: "GET /v1/items/{id}".to_owned(),
        reconciliation: false,
    }
}

/// Sorted microsecond values of the slots that were set.
fn sorted_values(slots: &[AtomicU32]) -> Vec<u32> {
    let mut values: Vec<u32> = slots
        .iter()
        .map(|slot| slot.load(Ordering::Relaxed))
        .filter(|v| *v != NOT_RELEASED)
        .collect();
    values.sort_unstable();
    values
}

/// What the waiting tasks write down, shared by all of them.
struct Record {
    clock: TokioClock,
    /// Per action: µs from `not_before` to the task seeing `Go`.
    lateness: Vec<AtomicU32>,
    /// Per action: µs from `not_before` to `Permit::granted_at`.
    granted: Vec<AtomicU32>,
}

struct Report {
    n: u64,
    mode: Mode,
    rss_before_kib: u64,
    rss_held_kib: u64,
    enqueue: Duration,
    released: usize,
    p50_us: u32,
    p99_us: u32,
    max_us: u32,
    /// The scheduler's part: `Permit::granted_at` − `not_before`, p50 / p99 / max.
    granted_us: [u32; 3],
    future_bytes: usize,
    acquire_bytes: usize,
}

/// The runtime's floor: N tasks each awaiting a plain oneshot, released in burst waves by one
/// sending task per wave, with no scheduler in between.
async fn run_wake(n: u64) -> Result<Report, String> {
    let clock = TokioClock::system();
    let record = Arc::new(Record {
        clock,
        lateness: (0..n).map(|_| AtomicU32::new(NOT_RELEASED)).collect(),
        granted: (0..n).map(|_| AtomicU32::new(NOT_RELEASED)).collect(),
    });
    let lead = Duration::from_secs(2) + Duration::from_micros(10 * n);
    let start = clock.now();
    let first_wave = at_offset(start, lead)?;
    let per_wave = n.div_ceil(WAVES);
    let wave_due = |wave: u64| at_offset(first_wave, WAVE_GAP * wave as u32);

    let rss_before_kib = rss_kib()?;
    let mut tasks = Vec::with_capacity(n as usize);
    let mut senders: Vec<Vec<oneshot::Sender<Timestamp>>> = (0..WAVES)
        .map(|_| Vec::with_capacity(per_wave as usize))
        .collect();
    let mut future_bytes = 0;
    for i in 0..n {
        let wave = i / per_wave;
        let due = wave_due(wave)?;
        let (tx, rx) = oneshot::channel::<Timestamp>();
        if let Some(wave) = senders.get_mut(wave as usize) {
            wave.push(tx);
        }
        let record = record.clone();
        let index = usize::try_from(i).map_err(|e| format!("action {i}: {e}"))?;
        let waiting = async move {
            if let Ok(sent_at) = rx.await {
                let now = record.clock.now();
                record.lateness[index].store(micros_since(due, now), Ordering::Relaxed);
                record.granted[index].store(micros_since(due, sent_at), Ordering::Relaxed);
            }
        };
        future_bytes = std::mem::size_of_val(&waiting);
        tasks.push(tokio::spawn(waiting));
    }
    // Held: the tasks and channels are allocated by now; let every task reach its await.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let enqueue = Duration::try_from(clock.now().duration_since(start)).unwrap_or_default();
    let rss_held_kib = rss_kib()?;

    let mut releasers = Vec::new();
    for (wave, txs) in senders.into_iter().enumerate() {
        let due = wave_due(wave as u64)?;
        releasers.push(tokio::spawn(async move {
            tokio::time::sleep_until(clock.instant_at(due)).await;
            for tx in txs {
                let _ = tx.send(clock.now());
            }
        }));
    }
    for task in releasers.into_iter().chain(tasks) {
        task.await
            .map_err(|e| format!("a waiting task failed: {e}"))?;
    }
    let values = sorted_values(&record.lateness);
    let granted = sorted_values(&record.granted);
    Ok(Report {
        n,
        mode: Mode::Wake,
        rss_before_kib,
        rss_held_kib,
        enqueue,
        released: values.len(),
        p50_us: percentile(&values, 50.0),
        p99_us: percentile(&values, 99.0),
        max_us: values.last().copied().unwrap_or(0),
        granted_us: [
            percentile(&granted, 50.0),
            percentile(&granted, 99.0),
            granted.last().copied().unwrap_or(0),
        ],
        future_bytes,
        acquire_bytes: 0,
    })
}

async fn run(n: u64, mode: Mode) -> Result<Report, String> {
    let policy = Policy::from_yaml_str(POLICY, "scheduler_scale.yaml")
        .map_err(|e| format!("bench policy: {e}"))?;
    let clock = TokioClock::system();
    let scheduler = SchedulerHandle::spawn(&policy, clock, Arc::new(Metrics::new()), 7);
    let record = Arc::new(Record {
        clock,
        lateness: (0..n).map(|_| AtomicU32::new(NOT_RELEASED)).collect(),
        granted: (0..n).map(|_| AtomicU32::new(NOT_RELEASED)).collect(),
    });
    let acquire_bytes = std::mem::size_of_val(&scheduler.acquire(probe_request()));

    // Enough lead for every acquire to be queued before the first wave (≈ 5 µs each, doubled).
    let lead = Duration::from_secs(2) + Duration::from_micros(10 * n);
    let start = clock.now();
    let first_wave = at_offset(start, lead)?;
    let per_wave = n.div_ceil(WAVES);

    let rss_before_kib = rss_kib()?;
    let mut tasks = Vec::with_capacity(n as usize);
    let mut future_bytes = 0;
    for i in 0..n {
        let wave = i / per_wave;
        let within = match mode {
            Mode::Burst | Mode::Wake => Duration::ZERO,
            Mode::Spread => WAVE_GAP.mul_f64((i % per_wave) as f64 / per_wave as f64),
        };
        let due = at_offset(first_wave, WAVE_GAP * wave as u32 + within)?;
        let scheduler = scheduler.clone();
        let record = record.clone();
        let index = usize::try_from(i).map_err(|e| format!("action {i}: {e}"))?;
        // As the engine does: the request is built where `acquire` is called, so the task's
        // future keeps only what `acquire` returns, not a copy of the request.
        let waiting = async move {
            let request = AcquireRequest {
                task_id: format!("run-{}", index as u64 % TASKS),
                agent: "bench-agent".to_owned(),
                priority: Priority::Normal,
                scopes: vec![SCOPE.to_owned()],
                budget: ActionBudget::new(CLASS, None),
                not_before: Some(due),
                route: "GET /v1/items/{id}".to_owned(),
                reconciliation: false,
            };
            if let Acquired::Go { permit, .. } = scheduler.acquire(request).await {
                let now = record.clock.now();
                record.lateness[index].store(micros_since(due, now), Ordering::Relaxed);
                record.granted[index]
                    .store(micros_since(due, permit.granted_at()), Ordering::Relaxed);
                drop(permit);
            }
        };
        future_bytes = std::mem::size_of_val(&waiting);
        tasks.push(tokio::spawn(waiting));
    }
    // Held: the scheduler reports every action in the scope's delayed queue.
    loop {
        let delayed: u64 = scheduler
            .scopes()
            .iter()
            .map(|s| u64::from(s.delayed))
            .sum();
        if delayed >= n {
            break;
        }
        if clock.now() >= first_wave {
            return Err(format!(
                "only {delayed} of {n} actions were queued before the first wave was due; \
                 raise the lead time"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let enqueue = Duration::try_from(clock.now().duration_since(start)).unwrap_or_default();
    let rss_held_kib = rss_kib()?;

    for task in tasks {
        task.await
            .map_err(|e| format!("an acquiring task failed: {e}"))?;
    }
    scheduler.shutdown().await;

    let values = sorted_values(&record.lateness);
    let granted = sorted_values(&record.granted);
    Ok(Report {
        n,
        mode,
        rss_before_kib,
        rss_held_kib,
        enqueue,
        released: values.len(),
        p50_us: percentile(&values, 50.0),
        p99_us: percentile(&values, 99.0),
        max_us: values.last().copied().unwrap_or(0),
        granted_us: [
            percentile(&granted, 50.0),
            percentile(&granted, 99.0),
            granted.last().copied().unwrap_or(0),
        ],
        future_bytes,
        acquire_bytes,
    })
}

fn main() {
    let mut sizes: Vec<u64> = Vec::new();
    let mut modes: Vec<Mode> = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "burst" => modes.push(Mode::Burst),
            "spread" => modes.push(Mode::Spread),
            "wake" => modes.push(Mode::Wake),
            other => {
                if let Ok(n) = other.parse::<u64>() {
                    if n > 0 {
                        sizes.push(n);
                    }
                }
                // Anything else is a flag of cargo bench (`--bench`): ignored.
            }
        }
    }
    let child = sizes.len() == 1 && modes.len() == 1;
    // `cargo bench` passes `--bench`; a test-mode run (`cargo test --all-targets`) does not, and
    // must not spend a minute and 1.6 GiB here.
    if sizes.is_empty() && !std::env::args().any(|a| a == "--bench") {
        println!("scheduler_scale: a benchmark; run it with `cargo bench` or give sizes");
        return;
    }
    if sizes.is_empty() {
        sizes = vec![100_000, 1_000_000];
    }
    if modes.is_empty() {
        modes = vec![Mode::Spread, Mode::Burst, Mode::Wake];
    }
    if !child {
        // One fresh process per measurement: memory freed by an earlier run stays mapped by the
        // allocator and would hide the next run's growth.
        print_header();
        for &n in &sizes {
            for &mode in &modes {
                let status = std::env::current_exe().and_then(|exe| {
                    std::process::Command::new(exe)
                        .args([n.to_string(), mode.name().to_owned(), "--child".to_owned()])
                        .status()
                });
                match status {
                    Ok(status) if status.success() => {}
                    Ok(status) => {
                        eprintln!("scheduler_scale: {n} actions, {}: {status}", mode.name());
                        std::process::exit(1);
                    }
                    Err(e) => {
                        eprintln!("scheduler_scale: cannot run a measurement process: {e}");
                        std::process::exit(2);
                    }
                }
            }
        }
        return;
    }
    if !std::env::args().any(|a| a == "--child") {
        print_header();
    }
    measure(&sizes, &modes);
}

fn print_header() {
    println!(
        "scheduler_scale: {WAVES} waves {WAVE_GAP:?} apart; lateness = clock at Go − not_before"
    );
    println!(
        "{:>9} {:>7} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "actions",
        "mode",
        "RSS held",
        "B/action",
        "queued in",
        "released",
        "p50 late",
        "p99 late",
        "max late"
    );
}

fn measure(sizes: &[u64], modes: &[Mode]) {
    for &n in sizes {
        for &mode in modes {
            // The gateway runs a multi-thread runtime; two workers match this machine.
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    eprintln!("scheduler_scale: cannot build the runtime: {e}");
                    std::process::exit(2);
                }
            };
            let report = match mode {
                Mode::Wake => runtime.block_on(run_wake(n)),
                _ => runtime.block_on(run(n, mode)),
            };
            match report {
                Ok(r) => {
                    let held_bytes = r.rss_held_kib.saturating_sub(r.rss_before_kib) * 1024;
                    println!(
                        "{:>9} {:>7} {:>7} MiB {:>10} {:>10.2} s {:>10} {:>7.2} ms {:>7.2} ms {:>7.2} ms",
                        r.n,
                        r.mode.name(),
                        r.rss_held_kib / 1024,
                        held_bytes / r.n,
                        r.enqueue.as_secs_f64(),
                        r.released,
                        f64::from(r.p50_us) / 1000.0,
                        f64::from(r.p99_us) / 1000.0,
                        f64::from(r.max_us) / 1000.0,
                    );
                    let granted_by = match r.mode {
                        Mode::Wake => "sent by the releasing task (its clock − due)",
                        _ => "granted by the scheduler (Permit::granted_at − not_before)",
                    };
                    println!(
                        "{:>9} {:>7} {granted_by}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                        "",
                        "",
                        f64::from(r.granted_us[0]) / 1000.0,
                        f64::from(r.granted_us[1]) / 1000.0,
                        f64::from(r.granted_us[2]) / 1000.0,
                    );
                    println!(
                        "{:>9} {:>7} the waiting task's future: {} bytes, of which acquire's: {} bytes",
                        "", "", r.future_bytes, r.acquire_bytes
                    );
                }
                Err(message) => {
                    eprintln!("scheduler_scale: {n} actions, {}: {message}", mode.name());
                    std::process::exit(1);
                }
            }
        }
    }
}
