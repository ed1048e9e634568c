//! Writing to stdout and stderr without ever panicking.
//!
//! `println!` and `eprintln!` panic (exit 101) when the stream cannot be written: a reader that
//! went away (`backstop … | head -c 10`), a full device (`> /dev/full`), a closed stderr. A
//! command line tool must not crash for that. Every subcommand prints through this module:
//!
//! - [`stdout`] writes and flushes; [`exit_after_stdout`] turns the outcome into the exit status:
//!   a broken pipe ends quietly with the command's own status (0 on success paths), any other
//!   write error prints one line on stderr and exits 2;
//! - [`errln!`] writes one line to stderr and ignores a failure — there is
//!   nowhere left to report it.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};
use std::process::ExitCode;

/// `text` safe to print on a terminal: control characters (C0, DEL, C1: ESC, BEL, CR, …) and
/// the invisible format characters that reorder or hide text (bidirectional controls U+061C,
/// U+200E–U+200F, U+202A–U+202E, U+2066–U+2069; zero-width U+200B–U+200D, U+2060, U+FEFF) are
/// written as `\u{…}` (hex), and a backslash as `\\`, so a value from an input file can
/// neither drive the terminal nor pass for another value. Unchanged text is borrowed.
pub fn terminal_safe(text: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| {
        c == '\\'
            || c.is_control()
            || matches!(
                c,
                '\u{061C}'
                    | '\u{200B}'..='\u{200F}'
                    | '\u{202A}'..='\u{202E}'
                    | '\u{2060}'
                    | '\u{2066}'..='\u{2069}'
                    | '\u{FEFF}'
            )
    };
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if unsafe_char(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Writes one formatted line to stderr, ignoring a write failure (never panics): the
/// `eprintln!` of this binary.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cmd::output::stderr_line(::std::format_args!($($arg)*))
    };
}
pub(crate) use errln;

/// Writes `args` and a newline to stderr; a failure is ignored (there is nowhere to report it).
pub fn stderr_line(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// Writes `args` to stderr without a newline (progress counters); a failure is ignored.
pub fn stderr_raw(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.flush());
}

/// Writes `text` to stdout and flushes it.
///
/// # Errors
/// The I/O error of the write or flush, for [`exit_after_stdout`].
pub fn stdout(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// The exit status after writing a command's output: `code` when the write succeeded or the
/// reader closed the pipe (`io::ErrorKind::BrokenPipe`, e.g. `| head`); otherwise one line
/// `backstop COMMAND: cannot write to stdout: REASON` on stderr and exit 2.
pub fn exit_after_stdout(command: &str, written: io::Result<()>, code: ExitCode) -> ExitCode {
    match written {
        Ok(()) => code,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => code,
        Err(e) => {
            stderr_line(format_args!(
                "backstop {command}: cannot write to stdout: {e}"
            ));
            ExitCode::from(2)
        }
    }
}

/// Writes `text` to stdout and returns the exit status per [`exit_after_stdout`].
pub fn print(command: &str, text: &str, code: ExitCode) -> ExitCode {
    exit_after_stdout(command, stdout(text), code)
}

/// A writer that remembers whether a write failed because the reader closed the pipe, for
/// library functions that turn I/O errors into their own error type (the audit export).
#[derive(Debug)]
pub struct PipeWatch<W> {
    inner: W,
    /// The reader closed the pipe (`io::ErrorKind::BrokenPipe`) during some write.
    pub broken_pipe: bool,
}

impl<W> PipeWatch<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        PipeWatch {
            inner,
            broken_pipe: false,
        }
    }

    fn watch<T>(&mut self, result: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &result {
            if e.kind() == io::ErrorKind::BrokenPipe {
                self.broken_pipe = true;
            }
        }
        result
    }
}

impl<W: Write> Write for PipeWatch<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let result = self.inner.write(buf);
        self.watch(result)
    }

    fn flush(&mut self) -> io::Result<()> {
        let result = self.inner.flush();
        self.watch(result)
    }
}
