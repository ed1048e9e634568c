//! `backstop classify`.

use std::process::ExitCode;

/// Arguments of `backstop classify`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HTTP status of the response.
    #[arg(long)]
    pub status: Option<u16>,
}

/// Runs `backstop classify`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("backstop classify: not built yet");
    ExitCode::from(2)
}
