//! `backstop diagnose`.

use std::process::ExitCode;

/// Arguments of `backstop diagnose`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `backstop diagnose`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("backstop diagnose: not built yet");
    ExitCode::from(2)
}
