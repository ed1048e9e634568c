//! `backstop audit`.

use std::process::ExitCode;

/// Arguments of `backstop audit`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `backstop audit`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("backstop audit: not built yet");
    ExitCode::from(2)
}
