//! What the HTTP faces need from the engine: the [`Executor`] seam. The proxy door, the action
//! API and the server run actions through it; `engine::Engine` implements it, and tests plug in
//! simpler executors.

use std::{future::Future, pin::Pin};

use crate::action::{ActionSpec, Execution};

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the HTTP edge needs from the engine (implemented by `engine::Engine`; tests plug in
/// simpler executors).
pub trait Executor: Send + Sync + 'static {
    /// Runs one action to its end (see `Engine::execute`). Dropping the future before the first
    /// send cancels the action.
    fn execute(&self, spec: ActionSpec) -> BoxFuture<Execution>;
    /// The scope records as JSON (an array), for `GET /v1/scopes`.
    fn scopes(&self) -> serde_json::Value;
    /// Stops taking new work; accepted actions stay recoverable in the store.
    fn shutdown(&self) -> BoxFuture<()>;
    /// The stop's grace is running out: attempts still out are no longer waited for, and their
    /// callers are answered `503 shutting_down` at once (see `Engine::give_up_attempts`).
    /// Nothing by default.
    fn give_up_attempts(&self) {}
    /// The engine behind this executor, when it is one: the action API, task cancellation and
    /// acting escalation decisions need it. Executors that are not an engine answer those
    /// routes with `501 not_supported`.
    fn engine(&self) -> Option<crate::engine::Engine> {
        None
    }
}

impl Executor for crate::engine::Engine {
    fn execute(&self, spec: ActionSpec) -> BoxFuture<Execution> {
        let engine = self.clone();
        // The spec lives here once; the engine borrows it (see `Engine::execute_notifying`).
        Box::pin(async move { engine.execute_notifying(&spec, None).await })
    }

    /// Each scope record with `name`: the full scope name `provider/scope`
    /// (`billing-api/account`), as metrics and `backstop diagnose` spell it.
    fn scopes(&self) -> serde_json::Value {
        let mut records = serde_json::to_value(crate::engine::Engine::scopes(self))
            .unwrap_or_else(|_| serde_json::Value::Array(Vec::new()));
        if let Some(list) = records.as_array_mut() {
            for record in list {
                let name = match (record.get("provider"), record.get("scope")) {
                    (Some(serde_json::Value::String(p)), Some(serde_json::Value::String(s))) => {
                        format!("{p}/{s}")
                    }
                    _ => continue,
                };
                if let Some(map) = record.as_object_mut() {
                    map.insert("name".into(), serde_json::Value::String(name));
                }
            }
        }
        records
    }

    fn shutdown(&self) -> BoxFuture<()> {
        let engine = self.clone();
        Box::pin(async move { crate::engine::Engine::shutdown(&engine).await })
    }

    fn give_up_attempts(&self) {
        crate::engine::Engine::give_up_attempts(self);
    }

    fn engine(&self) -> Option<crate::engine::Engine> {
        Some(self.clone())
    }
}
