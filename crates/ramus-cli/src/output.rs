//! Standard output, written so that a reader who stops reading
//! (`ramus infer … | head -1`) ends the command quietly instead of a
//! `println!` panic ("failed printing to stdout: Broken pipe").
//!
//! Rust ignores `SIGPIPE`, so writing to a closed pipe fails with
//! `BrokenPipe`. Restoring the signal's default action (what many Unix
//! CLIs do) would end the process at that write, wherever it is; a training
//! run would die without its checkpoint (and without the save on
//! SIGINT/SIGTERM). So the signal stays ignored and the error is handled
//! here instead, by what a command's output is:
//!
//! - A command whose product *is* its output (`infer`, `eval`, `bench`,
//!   `inspect`, `plan-memory`, `bench-swap`) writes with [`outln!`]: a
//!   broken pipe returns [`OutputClosed`], which the command passes up with
//!   `?` and `main` turns into a quiet successful exit (there is nobody left
//!   to produce output for). Any other write error is an error.
//! - `train`'s product is its checkpoint; its lines are a log, written with
//!   [`logln!`]: once standard output fails, later log lines are dropped and
//!   training goes on to save its model.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Standard output was closed by its reader: the command stops and exits
/// quietly with success.
#[derive(Debug)]
pub struct OutputClosed;

impl fmt::Display for OutputClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for OutputClosed {}

/// Set once a log line could not be written: later ones are dropped.
static LOG_FAILED: AtomicBool = AtomicBool::new(false);

/// Set in the workers of a run on several GPUs other than rank 0, which
/// alone logs.
static LOG_QUIET: AtomicBool = AtomicBool::new(false);

/// Drops every later log line (errors still reach standard error).
pub fn quiet_log() {
    LOG_QUIET.store(true, Ordering::Relaxed);
}

/// Writes `args` to standard output: [`OutputClosed`] on a broken pipe, an
/// error naming standard output on any other failure.
pub fn write(args: fmt::Arguments<'_>) -> Result<(), Box<dyn std::error::Error>> {
    let mut out = io::stdout().lock();
    match out.write_fmt(args) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(OutputClosed.into()),
        Err(e) => Err(format!("cannot write to standard output: {e}").into()),
    }
}

/// Writes a log line (see the module docs): once one fails, this and every
/// later log line is dropped; a failure other than a closed pipe is noted
/// once on standard error.
pub fn log(args: fmt::Arguments<'_>) {
    if LOG_FAILED.load(Ordering::Relaxed) || LOG_QUIET.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = write(args) {
        LOG_FAILED.store(true, Ordering::Relaxed);
        if !e.is::<OutputClosed>() {
            note(format_args!("{e}; the rest of the log is dropped\n"));
        }
    }
}

/// Writes to standard error, ignoring failure (a closed standard error
/// has nobody to tell).
pub fn note(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// `println!` for a command's product: evaluates to
/// `Result<(), Box<dyn Error>>`, [`OutputClosed`] on a broken pipe.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `println!` for a log line: never fails (see [`crate::output::log`]).
macro_rules! logln {
    ($($arg:tt)*) => {
        $crate::output::log(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that ignores a closed standard error.
macro_rules! noteln {
    ($($arg:tt)*) => {
        $crate::output::note(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {logln, noteln, outln};
