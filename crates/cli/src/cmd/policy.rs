//! `backstop policy …`.

use std::{path::PathBuf, process::ExitCode};

/// Subcommands of `backstop policy`.
#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy file; print a summary, or `FILE:LINE:COL: message` per problem (exit 2).
    Check {
        /// The policy file (YAML).
        file: PathBuf,
    },
}

/// Runs `backstop policy …`.
pub fn run(command: PolicyCommand) -> ExitCode {
    match command {
        PolicyCommand::Check { file } => {
            eprintln!("backstop policy check {}: not built yet", file.display());
            ExitCode::from(2)
        }
    }
}
