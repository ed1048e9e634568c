//! The command line's one reading of the wall clock, and the `--now` argument that replaces it.
//!
//! The command line is the imperative shell: the core and the gateway's derivations get `now`
//! passed in; only [`current_time`] reads the real clock.

use jiff::Timestamp;

/// The default for `--now`: the current instant (UTC).
// The designated clock of the command line (clippy.toml bans `Timestamp::now` elsewhere).
#[allow(clippy::disallowed_methods)]
pub fn current_time() -> Timestamp {
    Timestamp::now()
}

/// Parses a `--now` value: an RFC 3339 instant with offset (`2026-01-05T10:00:00Z`).
///
/// # Errors
/// A sentence for clap's error line when `s` is not such an instant.
pub fn parse_now(s: &str) -> Result<Timestamp, String> {
    s.parse::<Timestamp>()
        .map_err(|e| format!("not an RFC 3339 instant with offset ({e})"))
}
