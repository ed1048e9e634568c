//! `backstop demo`: runs the reference scenario (SPEC §13) on loopback and prints its timeline,
//! a summary table and where to inspect the evidence. See [`crate::demo`].
//!
//! The printed commands run as printed from the directory the demo was started in: they start
//! with `backstop` when that name on `PATH` is this very binary, else with the binary's own
//! path (relative when it lies under the working directory, e.g. `target/release/backstop`
//! after `cargo run --release -- demo`). Those that serve the demo's store and show or decide
//! its open escalation set the demo policy's environment variables first (its throwaway agent,
//! provider and operator secrets).

use std::{
    io::IsTerminal,
    path::{Path, PathBuf},
    process::ExitCode,
};

use crate::cmd::output::{self, errln};

/// Arguments of `backstop demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep the store, the policy and the audit export in this directory instead of a fresh
    /// `backstop-demo-<pid>` directory under the system temp dir. It must be new (it is
    /// created) or empty: a directory holding anything is refused, nothing in it is touched.
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
    let text = crate::demo::render(&report, colour, &program());
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

/// Creates `dir` when missing; refuses a directory that holds anything (a store above all),
/// so that the demo never writes over someone's files.
fn prepare(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let store = dir.join("backstop.db");
    if store.exists() {
        return Err(format!(
            "{} already holds a store ({}); choose a new or empty directory",
            dir.display(),
            store.display()
        ));
    }
    let mut entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if let Some(entry) = entries.next() {
        let name = entry
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .unwrap_or_else(|e| format!("an entry that cannot be read: {e}"));
        return Err(format!(
            "{} is not empty (it holds {name}); the demo writes backstop.db, {} and audit.ndjson \
             there: choose a new or empty directory",
            dir.display(),
            crate::demo::POLICY_FILE
        ));
    }
    Ok(())
}

/// How the printed commands start: `backstop` when the first `backstop` on `PATH` is this
/// binary; else the path of this binary (relative to the working directory when it lies under
/// it), as a shell word; `backstop` when the running binary cannot be found.
fn program() -> String {
    let Ok(exe) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "backstop".to_owned();
    };
    let on_path = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("backstop"))
        .find(|candidate| candidate.is_file());
    if on_path.and_then(|found| std::fs::canonicalize(found).ok()) == Some(exe.clone()) {
        return "backstop".to_owned();
    }
    let shown = std::env::current_dir()
        .ok()
        .and_then(|cwd| std::fs::canonicalize(cwd).ok())
        .and_then(|cwd| exe.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .filter(|relative| relative.components().count() > 1)
        .unwrap_or(exe);
    crate::demo::shell_word(&shown.display().to_string())
}
