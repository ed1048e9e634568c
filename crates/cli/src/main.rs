//! The `backstop` command line: one thin binary over the library crates.
//!
//! Each subcommand lives in its own module under `cmd/` and returns the process exit code.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;
mod demo;

/// mimalloc instead of glibc's allocator: the proxy path allocates per request on every tokio
/// worker, and mimalloc's thread-local free lists cost less there (measured in bench/HISTORY.md,
/// "Gateway overhead after the watchdog's read-back and with mimalloc"). Built with its
/// `override` feature, it also serves the C code's malloc/free (the bundled SQLite).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// backstop — the one layer that owns retries for AI agents' outbound API calls.
#[derive(Debug, Parser)]
#[command(name = "backstop", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    // Listed first in `backstop --help`: the variants are shown in declaration order.
    /// Run the reference scenario on loopback and print its timeline: start here.
    Demo(cmd::demo::Args),
    /// Run the gateway: the proxy door and the action API on one listener.
    Serve(cmd::serve::Args),
    /// Classify one provider response (or transport error) and print the normalized signal as JSON.
    Classify(cmd::classify::Args),
    /// Work with policy files.
    #[command(subcommand)]
    Policy(cmd::policy::PolicyCommand),
    /// Inspect and verify the hash-chained audit log.
    Audit(cmd::audit::Args),
    /// Diagnose throttled runs from NDJSON snapshots: waiting, stuck, or out of budget.
    Diagnose(cmd::diagnose::Args),
    /// Run the controllable fake provider.
    FakeApi(cmd::fake_api::Args),
    /// Read escalation case files and record decisions on a running gateway.
    Escalations(cmd::escalations::Args),
    /// Print the scope records of a running gateway: who may send when, what is in flight.
    Scopes(cmd::scopes::Args),
    /// Export health snapshots of throttled actions from a gateway database (NDJSON).
    Snapshots(cmd::snapshots::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => cmd::demo::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Classify(args) => cmd::classify::run(args),
        Command::Policy(command) => cmd::policy::run(command),
        Command::Audit(args) => cmd::audit::run(args),
        Command::Diagnose(args) => cmd::diagnose::run(args),
        Command::FakeApi(args) => cmd::fake_api::run(args),
        Command::Escalations(args) => cmd::escalations::run(args),
        Command::Scopes(args) => cmd::scopes::run(args),
        Command::Snapshots(args) => cmd::snapshots::run(args),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    #[test]
    fn help_lists_demo_first() {
        let command = Cli::command();
        let first = command.get_subcommands().next().map(|c| c.get_name());
        assert_eq!(first, Some("demo"));
    }
}
