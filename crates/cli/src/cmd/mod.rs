//! One module per subcommand.

pub mod audit;
pub mod classify;
pub mod client;
pub mod clock;
pub mod demo;
pub mod diagnose;
pub mod escalations;
pub mod fake_api;
pub mod output;
pub mod policy;
pub mod scopes;
pub mod serve;
pub mod snapshots;
