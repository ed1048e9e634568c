//! `backstop demo`: runs the reference scenario (SPEC §13) on loopback and prints its timeline,
//! a summary table and where to inspect the evidence. See [`crate::demo`].

use std::{io::IsTerminal, path::PathBuf, process::ExitCode};

use crate::cmd::output::{self, errln};

/// Arguments of `backstop demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep the store and the audit export in this (new or empty) directory instead of a fresh
    /// `backstop-demo-<pid>` directory under the system temp dir.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Colour: `auto` (only on a terminal), `always` or `never`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "always", "never"])]
    pub color: String,
}

/// Runs `backstop demo`: exit 0 when every step behaved as the scenario requires, 1 when a step
/// did not (each named on stderr), 2 when the demo could not be set up.
pub fn run(args: Args) -> ExitCode {
    let dir = match args.dir {
        Some(dir) => match prepare(&dir) {
            Ok(()) => dir,
            Err(e) => {
                errln!("backstop demo: {e}");
                return ExitCode::from(2);
            }
        },
        None => match crate::demo::fresh_dir() {
            Ok(dir) => dir,
            Err(e) => {
                errln!("backstop demo: {e}");
                return ExitCode::from(2);
            }
        },
    };
    errln!(
        "backstop demo: starting a fake provider and a gateway on loopback (store in {})",
        dir.display()
    );
    let report = match crate::demo::run(&dir) {
        Ok(report) => report,
        Err(e) => {
            errln!("backstop demo: {e}");
            return ExitCode::from(2);
        }
    };
    let colour = match args.color.as_str() {
        "always" => true,
        "never" => false,
        _ => std::io::stdout().is_terminal(),
    };
    let text = crate::demo::render(&report, colour);
    let code = if report.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    let written = output::stdout(&text);
    for failure in &report.failures {
        errln!("backstop demo: FAILED {failure}");
    }
    output::exit_after_stdout("demo", written, code)
}

/// Creates `dir` when missing; refuses a directory that already holds a store.
fn prepare(dir: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let store = dir.join("backstop.db");
    if store.exists() {
        return Err(format!(
            "{} already holds a store ({}); choose a new directory",
            dir.display(),
            store.display()
        ));
    }
    Ok(())
}
