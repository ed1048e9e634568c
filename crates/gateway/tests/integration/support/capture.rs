//! Log capture for tests that read what their own gateway logs. The subscriber is the
//! process's (one for the whole test binary, installed by the first capture), but it takes only
//! the events of threads that carry a capture: the threads of that test's runtime. The other
//! tests' gateways run alongside in this process; their events are neither captured nor
//! formatted. (A subscriber set as the default of the test's threads alone is not enough:
//! tracing caches per callsite whether anyone is interested, decided on whichever thread
//! reaches the callsite first — often another test's.)

use std::{
    cell::RefCell,
    io::Write,
    sync::{Arc, Mutex, Once},
};

use tracing::Level;
use tracing_subscriber::{
    filter::DynFilterFn, fmt::writer::OptionalWriter, layer::SubscriberExt, Layer,
};

/// The captured log text (events of level debug and above, one line each, without colours).
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

thread_local! {
    /// Where the events of this thread go, if anywhere.
    static THREAD_CAPTURE: RefCell<Option<Capture>> = const { RefCell::new(None) };
}

fn thread_capture() -> Option<Capture> {
    THREAD_CAPTURE
        .try_with(|capture| capture.borrow().clone())
        .ok()
        .flatten()
}

impl Capture {
    /// Sends the current thread's events of level debug and above here, until [`Capture::detach`].
    pub fn attach(&self) {
        static SUBSCRIBER: Once = Once::new();
        SUBSCRIBER.call_once(|| {
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(|| OptionalWriter::from(thread_capture()))
                .with_filter(
                    DynFilterFn::new(|meta, _| {
                        *meta.level() <= Level::DEBUG && thread_capture().is_some()
                    })
                    .with_max_level_hint(Level::DEBUG),
                );
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
                .expect("no other global subscriber in this test binary");
        });
        THREAD_CAPTURE.with(|capture| *capture.borrow_mut() = Some(self.clone()));
    }

    /// Stops capturing the current thread's events.
    pub fn detach() {
        THREAD_CAPTURE.with(|capture| capture.borrow_mut().take());
    }

    /// A capture of the current thread's events until the returned guard is dropped: for a
    /// `#[tokio::test]` on the current-thread runtime, whose tasks all run on the test's thread
    /// (blocking store calls run elsewhere and are not captured).
    pub fn this_thread() -> (Capture, Attached) {
        let capture = Capture::default();
        capture.attach();
        (capture, Attached)
    }

    /// Everything captured so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    /// The captured lines of level `level` (`ERROR`, `WARN`, `INFO`, `DEBUG`).
    pub fn lines_at(&self, level: &str) -> Vec<String> {
        let tag = format!(" {level} ");
        self.text()
            .lines()
            .filter(|line| line.contains(&tag))
            .map(str::to_owned)
            .collect()
    }
}

/// Detaches the current thread's capture when dropped (see [`Capture::this_thread`]).
pub struct Attached;

impl Drop for Attached {
    fn drop(&mut self) {
        Capture::detach();
    }
}

/// The runtime of `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]`, every thread of
/// which (workers and blocking threads) logs into `capture`.
pub fn runtime_logging_into(capture: &Capture) -> tokio::runtime::Runtime {
    let capture = capture.clone();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || capture.attach())
        .on_thread_stop(Capture::detach)
        .build()
        .expect("runtime")
}
