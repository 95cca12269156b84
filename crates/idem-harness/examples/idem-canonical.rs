//! `idem-canonical`: idem's RFC 8785 canonical form of JSON documents, one per
//! line, for comparison with other implementations
//! (scripts/differential-canonical.py; docs/verification.md, "Differential
//! canonicalisation").
//!
//! Reads stdin as lines separated by `\n` (bytes, not necessarily UTF-8; a
//! document therefore never contains a raw newline, which JSON allows only as
//! whitespace between tokens). For each line it writes one line to stdout:
//!
//! - `ok\t<canonical form>`: the RFC 8785 serialisation, which never contains
//!   a raw tab or newline (§3.2.2.2 escapes every control character);
//! - `error\t<kind>\t<message>`: the document was refused; `kind` is
//!   `duplicate_key`, `unsafe_integer`, `too_deep` or `syntax` (the
//!   [`JsonError`] variants) or `canonicalize`; the message has tabs and
//!   newlines replaced by spaces.
//!
//! `--reader strict` (the default) reads each document as a submit body is
//! read, with `idem_core::json::parse_strict`; `--reader serde-json` reads it
//! with plain `serde_json` (float_roundtrip, as the workspace builds it), so
//! the canonicaliser alone can be compared on doubles the strict reader
//! refuses (integers beyond ±(2^53−1), such as `1e21`). Either way the
//! canonical form is `idem_core::fingerprint::canonical_json`, the serialiser
//! of the canonical request and fingerprint (SPEC §1).
//!
//! Exit status 0 once stdin ends, 2 on a usage error, 1 on an I/O error.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::process::ExitCode;

use idem_core::fingerprint::{FingerprintError, canonical_json};
use idem_core::json::{JsonError, parse_strict};
use serde_json::Value;

/// How each line is read before it is canonicalised.
#[derive(Clone, Copy)]
enum Reader {
    /// `idem_core::json::parse_strict`: the submit body's reader.
    Strict,
    /// `serde_json::from_slice`: any RFC 8259 text (the last of duplicate
    /// names wins; integers beyond ±(2^53−1) become doubles or stay u64/i64).
    SerdeJson,
}

fn main() -> ExitCode {
    let reader = match parse_args(std::env::args().skip(1)) {
        Ok(r) => r,
        Err(message) => {
            eprintln!("{message}\nusage: idem-canonical [--reader strict|serde-json] < lines");
            return ExitCode::from(2);
        }
    };
    match run(
        reader,
        BufReader::new(io::stdin().lock()),
        io::stdout().lock(),
    ) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-canonical: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Reader, String> {
    let mut reader = Reader::Strict;
    while let Some(arg) = args.next() {
        let value = match arg.as_str() {
            "--reader" => args.next(),
            other => match other.strip_prefix("--reader=") {
                Some(v) => Some(v.to_owned()),
                None => return Err(format!("unknown argument {other:?}")),
            },
        };
        reader = match value.as_deref() {
            Some("strict") => Reader::Strict,
            Some("serde-json") => Reader::SerdeJson,
            other => {
                return Err(format!(
                    "--reader takes strict or serde-json, not {other:?}"
                ));
            }
        };
    }
    Ok(reader)
}

fn run<R: Read>(reader: Reader, mut input: BufReader<R>, output: impl Write) -> io::Result<()> {
    let mut out = BufWriter::new(output);
    let mut line = Vec::new();
    loop {
        line.clear();
        if input.read_until(b'\n', &mut line)? == 0 {
            break;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        }
        match canonical_line(reader, &line) {
            Ok(canonical) => writeln!(out, "ok\t{canonical}")?,
            Err((kind, message)) => {
                let message = message.replace(['\t', '\n', '\r'], " ");
                writeln!(out, "error\t{kind}\t{message}")?;
            }
        }
        // Answer at once when no more input is at hand: the writer may be
        // waiting for these answers before it sends more.
        if input.buffer().is_empty() {
            out.flush()?;
        }
    }
    out.flush()
}

/// The canonical form of one document, or the refusal's kind and message.
fn canonical_line(reader: Reader, line: &[u8]) -> Result<String, (&'static str, String)> {
    let value = match reader {
        Reader::Strict => parse_strict(line).map_err(|e| (json_error_kind(&e), e.to_string()))?,
        Reader::SerdeJson => {
            serde_json::from_slice::<Value>(line).map_err(|e| ("syntax", e.to_string()))?
        }
    };
    canonical_json(&value).map_err(|e: FingerprintError| ("canonicalize", e.to_string()))
}

fn json_error_kind(e: &JsonError) -> &'static str {
    match e {
        JsonError::DuplicateKey { .. } => "duplicate_key",
        JsonError::UnsafeInteger => "unsafe_integer",
        JsonError::TooDeep => "too_deep",
        JsonError::Syntax { .. } => "syntax",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(reader: Reader, input: &[u8]) -> String {
        let mut out = Vec::new();
        run(reader, BufReader::new(input), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn one_answer_per_line() {
        let input = b"{\"b\":1,\"a\":[1.0,\"\\u0061\"]}\n{\"a\":1,\"a\":2}\n9007199254740992\n\n\"\xff\"\n[1e21]";
        let out = lines(Reader::Strict, input);
        // The kind of each answer (messages are serde_json's and idem's).
        let kinds: Vec<String> = out
            .lines()
            .map(|l| l.splitn(3, '\t').take(2).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            kinds,
            [
                "ok {\"a\":[1,\"a\"],\"b\":1}",
                "error duplicate_key",
                "error unsafe_integer",
                "error syntax",
                "error syntax",
                "error unsafe_integer",
            ]
        );
        assert!(out.lines().skip(1).all(|l| l.split('\t').count() == 3));
        let plain = lines(
            Reader::SerdeJson,
            b"[1e21,9007199254740993.0]\n{\"a\":1,\"a\":2}",
        );
        assert_eq!(plain, "ok\t[1e+21,9007199254740992]\nok\t{\"a\":2}\n");
    }

    #[test]
    fn arguments() {
        let args = |a: &[&str]| parse_args(a.iter().map(|s| (*s).to_owned()));
        assert!(matches!(args(&[]), Ok(Reader::Strict)));
        assert!(matches!(
            args(&["--reader", "serde-json"]),
            Ok(Reader::SerdeJson)
        ));
        assert!(matches!(args(&["--reader=strict"]), Ok(Reader::Strict)));
        assert!(args(&["--reader"]).is_err());
        assert!(args(&["--reader", "lenient"]).is_err());
        assert!(args(&["-x"]).is_err());
    }
}
