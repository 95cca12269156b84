//! Writing a command's output to stdout and its messages to stderr, without
//! the panics `println!` and `eprintln!` give when the reader has gone away:
//! the one way `idem` and `idem-lab` print.

/// Writes `text` and a newline to stdout ([`say_raw`]).
///
/// # Errors
/// Any write error but a broken pipe.
pub fn say(text: impl std::fmt::Display) -> std::io::Result<()> {
    say_raw(format_args!("{text}\n"))
}

/// Writes `text` to stdout, for the commands' output. A reader that has gone
/// away (`idem task events ID | head`) is not an error: the rest of the output
/// is dropped and the command still ends with its own status (a chaos run
/// with violations still exits 1), instead of the panic `println!` gives on a
/// broken pipe.
///
/// # Errors
/// Any write error but a broken pipe.
pub fn say_raw(text: impl std::fmt::Display) -> std::io::Result<()> {
    match write_stdout(text) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Writes `text` and a newline to stdout, and fails on every write error, a
/// broken pipe included: for output that must not be lost without a word (a
/// plain API key, shown once).
///
/// # Errors
/// Any write error.
pub fn say_strict(text: impl std::fmt::Display) -> std::io::Result<()> {
    write_stdout(format_args!("{text}\n"))
}

/// Writes `text` to stdout and flushes it: the one place that writes there.
fn write_stdout(text: impl std::fmt::Display) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    write!(out, "{text}").and_then(|()| out.flush())
}

/// Writes `text` and a newline to stderr, for messages to the operator. A
/// write error (a reader of stderr that has gone away) is ignored, so the
/// command still ends with its own status, instead of the panic `eprintln!`
/// gives.
pub fn tell(text: impl std::fmt::Display) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}").and_then(|()| err.flush());
}
