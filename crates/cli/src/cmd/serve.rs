//! `backstop serve`.

use std::process::ExitCode;

/// Arguments of `backstop serve`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `backstop serve`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("backstop serve: not built yet");
    ExitCode::from(2)
}
