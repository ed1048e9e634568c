//! The `backstop` command line: one thin binary over the library crates.
//!
//! Each subcommand lives in its own module under `cmd/` and returns the process exit code.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// backstop — the one layer that owns retries for AI agents' outbound API calls.
#[derive(Debug, Parser)]
#[command(name = "backstop", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Classify one provider response (or transport error) and print the normalized signal as JSON.
    Classify(cmd::classify::Args),
    /// Work with policy files.
    #[command(subcommand)]
    Policy(cmd::policy::PolicyCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Classify(args) => cmd::classify::run(args),
        Command::Policy(command) => cmd::policy::run(command),
    }
}
