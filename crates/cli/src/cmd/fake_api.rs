//! `backstop fake-api`.

use std::process::ExitCode;

/// Arguments of `backstop fake-api`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `backstop fake-api`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("backstop fake-api: not built yet");
    ExitCode::from(2)
}
