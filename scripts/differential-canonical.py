#!/usr/bin/env python3
"""Differential RFC 8785 canonicalisation: idem against an independent implementation.

Generates JSON documents from a seed, one per line, and compares byte for byte
the canonical form idem gives (the ``idem-canonical`` example of idem-harness:
``idem_core::json::parse_strict`` then ``idem_core::fingerprint::canonical_json``,
the serialiser of the canonical request and fingerprint) with the reference:
Python's ``json`` module (RFC 8259) with duplicate member names refused (I-JSON
RFC 7493 §2.3, which RFC 8785 §3.1 requires of its input) and NaN/Infinity
refused, then ``rfc8785.dumps`` from PyPI (pinned below).

Every document gets one verdict:

- ``same``: both accept, same bytes;
- ``both-reject``: both refuse it (the pair of reasons is counted);
- ``by-design``: idem refuses what the reference accepts, for a rule idem
  adds on purpose: an integral number beyond ±(2^53−1) written as a double
  (I-JSON RFC 7493 §2.2; ``1e21``, ``9007199254740993.0``), or nesting deeper
  than 64 (SPEC §4); the script checks the reason on the reference's value;
- ``differ``: anything else. Any ``differ`` makes the exit status 1.

Documents of the ``numbers-format`` category and RFC 8785's Appendix B numbers
are also given to ``idem-canonical --reader serde-json`` (plain serde_json,
then the same canonicaliser), so the number form is compared on doubles the
strict reader refuses (≥ 2^53, the 1e21 boundary).

The RFC's own vectors (Appendix B, the §3.2.2 and §3.2.3 examples, typed in
from the RFC text; the same as crates/idem-core/tests/rfc8785.rs) come first,
and both implementations must also give the RFC's text for them.

Usage:
  scripts/differential-canonical.py [--count N] [--seed S] [--bin PATH] [--release]
                                    [--show N] [--json] [--only INDEX]

``rfc8785`` is installed with pip into a virtualenv this script creates in a
temporary directory and removes afterwards (unless the running Python already
has the pinned version). Without --bin the driver is built with
``cargo build -p idem-harness --example idem-canonical`` (debug; --release for the
release profile) into ``$CARGO_TARGET_DIR`` (default ``target``).
"""

from __future__ import annotations

import argparse
import collections
import decimal
import json
import math
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

RFC8785_VERSION = "0.1.4"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_SAFE = 2**53 - 1
MAX_DEPTH = 64
BATCH = 2000

# --------------------------------------------------------------------------
# The reference: an independent RFC 8785 implementation.
# --------------------------------------------------------------------------


def have_pinned_rfc8785() -> bool:
    try:
        from importlib.metadata import version

        return version("rfc8785") == RFC8785_VERSION
    except Exception:
        return False


def rerun_in_venv() -> int:
    """Creates a throwaway virtualenv with the pinned rfc8785, reruns this script in it."""
    tmp = tempfile.mkdtemp(prefix="idem-differential-")
    # SIGTERM too leaves through `finally`, which removes the virtualenv.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        subprocess.run(
            [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             f"rfc8785=={RFC8785_VERSION}"],
            check=True,
        )
        env = dict(os.environ, IDEM_DIFFERENTIAL_VENV="1")
        return subprocess.run([py, os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Duplicate(ValueError):
    pass


def _pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise Duplicate(k)
        out[k] = v
    return out


def _constant(name):
    raise ValueError(f"{name} is not JSON")


def reference(line: bytes):
    """('ok', bytes, value) or ('error', kind, None)."""
    import rfc8785

    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return ("error", "utf8", None)
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except Duplicate:
        return ("error", "duplicate", None)
    except RecursionError:
        return ("error", "recursion", None)
    except ValueError:
        return ("error", "syntax", None)
    try:
        return ("ok", rfc8785.dumps(value), value)
    except rfc8785.IntegerDomainError:
        return ("error", "integer-domain", None)
    except rfc8785.FloatDomainError:
        return ("error", "float-domain", None)
    except (rfc8785.CanonicalizationError, UnicodeEncodeError):
        return ("error", "string", None)


def depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    return 0


def has_unsafe_double(v) -> bool:
    if isinstance(v, float):
        return v.is_integer() and abs(v) > MAX_SAFE
    if isinstance(v, dict):
        return any(has_unsafe_double(x) for x in v.values())
    if isinstance(v, list):
        return any(has_unsafe_double(x) for x in v)
    return False


def verdict(idem: str, ref) -> tuple[str, str]:
    """(verdict, detail) for one idem answer line and one reference result."""
    parts = idem.split("\t", 2)
    if parts[0] == "ok" and ref[0] == "ok":
        if parts[1].encode("utf-8") == ref[1]:
            return ("same", "")
        return ("differ", "different bytes")
    if parts[0] == "error" and ref[0] == "error":
        return ("both-reject", f"{parts[1]}/{ref[1]}")
    if parts[0] == "error" and ref[0] == "ok":
        if parts[1] == "unsafe_integer" and has_unsafe_double(ref[2]):
            return ("by-design", "integral double beyond 2^53-1 (I-JSON)")
        if parts[1] == "too_deep" and depth(ref[2]) > MAX_DEPTH:
            return ("by-design", "nesting deeper than 64 (SPEC 4)")
        return ("differ", f"idem refuses ({parts[1]}), reference accepts")
    return ("differ", f"idem accepts, reference refuses ({ref[1]})")


# --------------------------------------------------------------------------
# RFC 8785's own vectors (typed in from the RFC text).
# --------------------------------------------------------------------------

APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]

SECTION_3_2_2 = (
    '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], '
    '"string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/", '
    '"literals": [null, true, false]}'
)
SECTION_3_2_2_OUT = (
    '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
    '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
)
SECTION_3_2_3 = (
    '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", '
    '"\\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", '
    '"\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control", '
    '"\\u00f6": "Latin Small Letter O With Diaeresis"}'
)
SECTION_3_2_3_OUT = (
    '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
    '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
    '"\U0001f600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
)


def rfc_vectors():
    """(name, JSON line, RFC output text)."""
    out = []
    for bits, expected in APPENDIX_B:
        x = struct.unpack(">d", bytes.fromhex(bits))[0]
        # A double spelling (Python reads it as a float, serde_json as f64).
        out.append((f"appendix-b {bits}", repr(x), expected))
    out.append(("section 3.2.2", SECTION_3_2_2, SECTION_3_2_2_OUT))
    out.append(("section 3.2.3", SECTION_3_2_3, SECTION_3_2_3_OUT))
    return out


# --------------------------------------------------------------------------
# Document generation.
# --------------------------------------------------------------------------

WS = ["", "", "", " ", "\t", "\r", "  "]
SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def u_escape(rng: random.Random, unit: int) -> str:
    s = f"\\u{unit:04x}"
    return s.upper().replace("\\U", "\\u") if rng.random() < 0.3 else s


def write_string(rng: random.Random, s: str, escape_rate: float) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if 0xD800 <= c <= 0xDFFF:  # a lone surrogate: only as an escape
            out.append(u_escape(rng, c))
            continue
        must = ch in SHORT or c < 0x20
        if must or rng.random() < escape_rate:
            if ch in SHORT and rng.random() < 0.6:
                out.append(SHORT[ch])
            elif ch == "/" and rng.random() < 0.5:
                out.append("\\/")
            elif c > 0xFFFF:
                hi, lo = 0xD800 + ((c - 0x10000) >> 10), 0xDC00 + ((c - 0x10000) & 0x3FF)
                out.append(u_escape(rng, hi) + u_escape(rng, lo))
            else:
                out.append(u_escape(rng, c))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class Doc:
    """A JSON tree that may hold what JSON text can but Python values cannot:
    duplicate member names, lone surrogates and chosen number spellings."""

    def __init__(self, rng: random.Random, escape_rate: float = 0.1):
        self.rng = rng
        self.escape_rate = escape_rate

    def ws(self) -> str:
        return self.rng.choice(WS)

    def render(self, node) -> str:
        kind = node[0]
        if kind == "obj":
            members = [
                self.ws() + write_string(self.rng, k, self.escape_rate) + self.ws() + ":"
                + self.ws() + self.render(v) + self.ws()
                for k, v in node[1]
            ]
            return "{" + (",".join(members) if members else self.ws()) + "}"
        if kind == "arr":
            items = [self.ws() + self.render(v) + self.ws() for v in node[1]]
            return "[" + (",".join(items) if items else self.ws()) + "]"
        if kind == "str":
            return write_string(self.rng, node[1], self.escape_rate)
        return node[1]  # "raw": numbers and literals, as written


# Character pools.
ASCII = [chr(c) for c in range(0x20, 0x7F)]
CONTROLS = [chr(c) for c in range(0x00, 0x20)] + ["\x7f"] + [chr(c) for c in range(0x80, 0xA0)]
BMP_LOW = ["\u00e9", "\u00f6", "\u0100", "\u03a9", "\u0416", "\u05d0", "\u20ac", "\u2028", "\u2029",
           "\u3042", "\u4e2d", "\ud7ff", "\u00a0", "\u0300", "\u1e9e"]
BMP_HIGH = ["\ue000", "\uf8ff", "\ufb33", "\ufe0f", "\ufeff", "\uff01", "\uff5e", "\ufffd",
            "\ufffe", "\uffff", "\uf900", "\ue801"]
ASTRAL = ["\U00010000", "\U0001f600", "\U0001d11e", "\U00020000", "\U0010ffff", "\U000e0001",
          "\U0001f1eb", "\U00010437"]


def rand_char(rng: random.Random, pools) -> str:
    pool = rng.choice(pools)
    if pool == "bmp-high-any":
        return chr(rng.randint(0xE000, 0xFFFF))
    if pool == "astral-any":
        return chr(rng.randint(0x10000, 0x10FFFF))
    if pool == "bmp-any":
        c = rng.randint(0x80, 0xD7FF)
        return chr(c)
    return rng.choice(pool)


def rand_key(rng: random.Random) -> str:
    n = rng.randint(0, 4)
    return "".join(rng.choice("abcdeAZ_09 -/~") for _ in range(n))


def rand_text(rng: random.Random, n: int, pools) -> str:
    return "".join(rand_char(rng, pools) for _ in range(n))


def safe_int_node(rng: random.Random):
    r = rng.random()
    if r < 0.4:
        n = rng.randint(-1000, 1000)
    elif r < 0.8:
        n = rng.randint(-MAX_SAFE, MAX_SAFE)
    else:
        n = rng.choice([0, 1, -1, MAX_SAFE, -MAX_SAFE, 2**31, -(2**31), 2**32, 2**52, -(2**52)])
    return ("raw", str(n))


def leaf(rng: random.Random):
    r = rng.random()
    if r < 0.15:
        return ("raw", rng.choice(["null", "true", "false"]))
    if r < 0.35:
        return safe_int_node(rng)
    if r < 0.55:
        return ("raw", spell_double(rng, accepted_double(rng)))
    n = rng.randint(0, 8)
    return ("str", rand_text(rng, n, [ASCII, ASCII, BMP_LOW, BMP_HIGH, ASTRAL, CONTROLS]))


def tree(rng: random.Random, max_depth: int, keyf=rand_key, leaff=leaf):
    if max_depth == 0 or rng.random() < 0.3:
        return leaff(rng)
    n = rng.randint(0, 5)
    if rng.random() < 0.5:
        return ("arr", [tree(rng, max_depth - 1, keyf, leaff) for _ in range(n)])
    members = {}
    for _ in range(n):
        members[keyf(rng)] = tree(rng, max_depth - 1, keyf, leaff)
    items = list(members.items())
    rng.shuffle(items)
    return ("obj", items)


# ---- numbers ----


def from_bits(bits: int) -> float:
    return struct.unpack(">d", struct.pack(">Q", bits))[0]


def to_bits(x: float) -> int:
    return struct.unpack(">Q", struct.pack(">d", x))[0]


def neighbour(x: float, steps: int) -> float:
    """The double `steps` ulps away from x (same sign side; through zero by bits)."""
    if steps == 0:
        return x
    return math.nextafter(x, math.inf if steps > 0 else -math.inf) if abs(steps) == 1 else \
        neighbour(math.nextafter(x, math.inf if steps > 0 else -math.inf), steps - (1 if steps > 0 else -1))


def any_double(rng: random.Random) -> float:
    """Any finite double, weighted towards the edges of IEEE 754 and of the ES number form."""
    r = rng.random()
    sign = -1.0 if rng.random() < 0.5 else 1.0
    if r < 0.25:
        while True:
            x = from_bits(rng.getrandbits(64))
            if math.isfinite(x):
                return x
    if r < 0.35:  # subnormals
        return sign * from_bits(rng.randint(1, 2**52 - 1))
    if r < 0.50:  # powers of two and their neighbours
        x = math.ldexp(1.0, rng.randint(-1074, 1023))
        return sign * neighbour(x, rng.randint(-2, 2)) if x < 1.7e308 else sign * x
    if r < 0.70:  # powers of ten and their neighbours (1e21 and 1e-7 boundaries included)
        k = rng.choice([21, 21, -7, -7, -6, 20, 22, 23, 15, 16, 17]) if rng.random() < 0.5 else rng.randint(-323, 308)
        x = float(f"1e{k}")
        return sign * neighbour(x, rng.randint(-3, 3))
    if r < 0.80:  # the extremes
        return sign * rng.choice([5e-324, 1e-323, 2.2250738585072014e-308, 2.225073858507201e-308,
                                  1.7976931348623157e308, 1.7976931348623155e308, 0.0])
    if r < 0.90:  # around ±2^53 and other integers
        return sign * float(rng.choice([2**53 - 1, 2**53, 2**53 + 2, 2**54, 2**63, 2**64, 10**21, 10**21 - 2**17]))
    # random magnitudes with up to 17 significant digits
    return sign * rng.random() * 10.0 ** rng.randint(-30, 30)


def accepted_double(rng: random.Random) -> float:
    """A double idem's strict reader accepts (not an integer beyond ±(2^53−1))."""
    while True:
        x = any_double(rng)
        if not (x.is_integer() and abs(x) > MAX_SAFE):
            return x


def exact_decimal(x: float) -> str:
    d = decimal.Decimal(x)
    return format(d, "f") if -30 < d.adjusted() < 30 else format(d, "e")


def halfway(x: float, rng: random.Random) -> str | None:
    """The exact decimal halfway between x and its upper neighbour (round-half-even test)."""
    up = math.nextafter(x, math.inf)
    if not math.isfinite(up):
        return None
    with decimal.localcontext() as ctx:
        ctx.prec = 1200
        mid = (decimal.Decimal(x) + decimal.Decimal(up)) / 2
    return format(mid, "e")


def spell_double(rng: random.Random, x: float) -> str:
    """A JSON number text that reads as exactly x (or, for halfway cases, rounds to even)."""
    r = rng.random()
    if x == 0.0:
        return rng.choice(["0", "-0", "0.0", "-0.0", "0e0", "-0E+5", "0.000e-10"]) if math.copysign(1, x) > 0 or rng.random() < 0.5 else rng.choice(["-0", "-0.0", "-0e-3"])
    if r < 0.35:
        return repr(x).replace("e+", rng.choice(["e+", "e", "E+", "E"]))
    if r < 0.50:
        return "%.17g" % x
    if r < 0.60:
        s = "%.17e" % x
        mant, exp = s.split("e")
        return mant + rng.choice(["e", "E"]) + exp[0] + "0" * rng.randint(0, 3) + exp[1:].lstrip("0").rjust(1, "0")
    if r < 0.70:
        return "%.25e" % x
    if r < 0.78:
        return exact_decimal(x)
    if r < 0.85:
        h = halfway(x, rng)
        if h is not None:
            return h
    if r < 0.92 and x.is_integer() and abs(x) <= MAX_SAFE:
        return rng.choice([f"{int(x)}", f"{int(x)}.0", f"{int(x)}e0", f"{int(x)}0e-1"])
    s = repr(x)
    return s + ("0" * rng.randint(1, 3) if "." in s and "e" not in s else "")


def int_edge_node(rng: random.Random):
    n = rng.choice([
        MAX_SAFE, MAX_SAFE - 1, 2**53, 2**53 + 1, 2**53 + 2, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
        10**21, 10**22, 10**30, 2**100, rng.randint(0, MAX_SAFE), rng.randint(MAX_SAFE, 2**70),
        rng.randint(0, 10**60), 0,
    ])
    if rng.random() < 0.5:
        n = -n
    r = rng.random()
    if r < 0.5:
        text = str(n)
    elif r < 0.7:
        text = f"{n}.0"
    elif r < 0.8:
        text = f"{n}e0"
    elif r < 0.9:
        digits = str(abs(n))
        text = ("-" if n < 0 else "") + digits[0] + "." + (digits[1:] or "0") + f"e{len(digits) - 1}"
    else:
        text = f"{n}.5"
    return ("raw", text)


def wrap(rng: random.Random, node):
    r = rng.random()
    if r < 0.3:
        return node
    if r < 0.6:
        return ("arr", [node])
    return ("obj", [(rand_key(rng), node)])


# ---- categories ----


def gen_nested(rng):
    return tree(rng, rng.randint(1, 6))


def gen_keys_utf16(rng):
    pools = [ASCII, BMP_LOW, BMP_HIGH, ASTRAL, "bmp-high-any", "astral-any"]
    prefix = rng.choice(["", "", "k", "\u00e9"])

    def key(r):
        return prefix + rand_text(r, r.randint(1, 3), pools)

    members = {key(rng): tree(rng, 2, key) for _ in range(rng.randint(2, 8))}
    items = list(members.items())
    rng.shuffle(items)
    return ("obj", items)


def gen_strings(rng):
    pools = [ASCII, CONTROLS, BMP_LOW, BMP_HIGH, ASTRAL, "bmp-any", "astral-any", ['"', "\\", "/"]]
    items = [("str", rand_text(rng, rng.randint(0, 12), pools)) for _ in range(rng.randint(1, 4))]
    return wrap(rng, ("arr", items)) if len(items) > 1 else wrap(rng, items[0])


def gen_numbers_ieee(rng):
    items = [("raw", spell_double(rng, accepted_double(rng))) for _ in range(rng.randint(1, 4))]
    return wrap(rng, ("arr", items)) if len(items) > 1 else wrap(rng, items[0])


def gen_numbers_format(rng):
    items = [("raw", repr(any_double(rng)) if rng.random() < 0.7 else "%.17e" % any_double(rng))
             for _ in range(rng.randint(1, 3))]
    return wrap(rng, ("arr", items)) if len(items) > 1 else wrap(rng, items[0])


def gen_int_edge(rng):
    items = [int_edge_node(rng) for _ in range(rng.randint(1, 3))]
    return wrap(rng, ("arr", items)) if len(items) > 1 else wrap(rng, items[0])


def gen_duplicates(rng):
    k = rand_key(rng) or "a"
    spelled = k
    members = [(k, leaf(rng)), (spelled, leaf(rng))]
    members += [(rand_key(rng) + "x", leaf(rng)) for _ in range(rng.randint(0, 3))]
    rng.shuffle(members)
    node = ("obj", members)
    return wrap(rng, node) if rng.random() < 0.5 else ("arr", [leaf(rng), node])


def gen_lone_surrogates(rng):
    s = rng.choice([
        chr(rng.randint(0xD800, 0xDBFF)),
        chr(rng.randint(0xDC00, 0xDFFF)),
        "\ude00\ud83d",
        "\ud83dA",
        "x\udfff",
    ])
    node = ("str", "a" + s if rng.random() < 0.5 else s)
    return ("obj", [(s, ("raw", "1"))]) if rng.random() < 0.3 else wrap(rng, node)


BAD_SYNTAX = [
    "NaN", "Infinity", "-Infinity", "[NaN]", "1e400", "-1e400", "[1,]", "{\"a\":1,}", "01", "-01",
    "1.", ".5", "+1", "1e", "1e+", "0x10", "{'a':1}", "[1 2]", "{\"a\" 1}", "tru", "nul", "\"\\x41\"",
    "\"\\u12\"", "\"\\U0041\"", "[", "]", "{", "}", "", " ", "//c\n", "/*c*/1", "1 1", "{\"a\":1}x",
    "\"\t\"", "\"a\x01b\"", "\"\x1f\"", "[\"\x00\"]", "\ufeff{}", "{\"a\"}", "[1,,2]", "-", "--1",
    "1.0e", "1.e5", "00", "\"\\\"", "\"abc", "[true false]", "{,}", "\"\\a\"",
]


def gen_bad_syntax(rng):
    return ("raw", rng.choice(BAD_SYNTAX).replace("\n", " "))


def gen_bad_bytes(rng):
    """Raw bytes that are not UTF-8, inside a string (returned as bytes)."""
    bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82",
                      b"\xf0\x9f\x98"])
    return b'["a' + bad + b'"]'


def gen_deep(rng):
    d = rng.randint(60, 70)
    node = leaf(rng) if rng.random() < 0.5 else ("arr", [])
    for _ in range(d - (0 if node[0] != "arr" else 1)):
        node = ("arr", [node]) if rng.random() < 0.5 else ("obj", [(rand_key(rng), node)])
    return node


# (name, weight, generator, also through the serde-json reader)
CATEGORIES = [
    ("nested", 23, gen_nested, False),
    ("keys-utf16", 12, gen_keys_utf16, False),
    ("strings", 14, gen_strings, False),
    ("numbers-ieee", 18, gen_numbers_ieee, False),
    ("numbers-int-edge", 10, gen_int_edge, False),
    ("numbers-format", 8, gen_numbers_format, True),
    ("reject-duplicate", 4, gen_duplicates, False),
    ("reject-lone-surrogate", 3, gen_lone_surrogates, False),
    ("reject-syntax", 3, gen_bad_syntax, False),
    ("reject-utf8", 1, gen_bad_bytes, False),
    ("deep", 4, gen_deep, False),
]
_CUMULATIVE = []
_total = 0
for _c in CATEGORIES:
    _total += _c[1]
    _CUMULATIVE.append(_total)


def document(seed: int, index: int):
    """(category, line bytes, also-serde-json) of document `index` under `seed`."""
    rng = random.Random(f"{seed}:{index}")
    pick = rng.random() * _total
    for (name, _, gen, plain), bound in zip(CATEGORIES, _CUMULATIVE):
        if pick < bound:
            break
    node = gen(rng)
    if isinstance(node, bytes):
        return name, node, plain
    doc = Doc(rng, escape_rate=rng.choice([0.0, 0.05, 0.3, 1.0]))
    text = doc.ws() + doc.render(node) + doc.ws()
    return name, text.encode("utf-8", "surrogatepass"), plain


# --------------------------------------------------------------------------
# The idem driver.
# --------------------------------------------------------------------------


class Driver:
    """An `idem-canonical` process fed by a writer thread, answers read in order."""

    def __init__(self, binary: str, reader: str):
        self.proc = subprocess.Popen([binary, "--reader", reader], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=1 << 16)
        self.todo: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self):
        try:
            while True:
                lines = self.todo.get()
                if lines is None:
                    break
                self.proc.stdin.write(b"".join(line + b"\n" for line in lines))
                self.proc.stdin.flush()
        except BaseException as e:  # reported by collect()
            self.error = e
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def submit(self, lines):
        self.todo.put(lines)

    def collect(self, n: int):
        out = []
        for _ in range(n):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"idem-canonical ended early ({self.error or self.proc.poll()})")
            out.append(line.rstrip(b"\n").decode("utf-8"))
        return out

    def close(self):
        self.todo.put(None)
        self.thread.join()
        rest = self.proc.stdout.read()
        code = self.proc.wait()
        if rest or code != 0:
            raise RuntimeError(f"idem-canonical: exit {code}, {len(rest)} unexpected bytes")


def build_driver(release: bool) -> str:
    cmd = ["cargo", "build", "--quiet", "-p", "idem-harness", "--example", "idem-canonical"]
    if release:
        cmd.append("--release")
    subprocess.run(cmd, cwd=REPO, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    return os.path.join(target, "release" if release else "debug", "examples", "idem-canonical")


# --------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20000, help="generated documents (default 20000)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the generator (default 1)")
    ap.add_argument("--bin", help="idem-canonical binary (default: build it with cargo)")
    ap.add_argument("--release", action="store_true", help="build the driver with --release")
    ap.add_argument("--show", type=int, default=10, help="differences printed in full (default 10)")
    ap.add_argument("--json", action="store_true", help="one JSON summary object on stdout")
    ap.add_argument("--only", type=int, help="print document INDEX of the seed and both answers")
    args = ap.parse_args()
    if args.count < 1:
        ap.error("--count must be at least 1 (a run over no generated document compares only the RFC vectors)")

    if not have_pinned_rfc8785():
        if os.environ.get("IDEM_DIFFERENTIAL_VENV"):
            print(f"rfc8785=={RFC8785_VERSION} is not importable", file=sys.stderr)
            return 2
        return rerun_in_venv()

    binary = args.bin or build_driver(args.release)
    started = time.monotonic()
    strict = Driver(binary, "strict")
    plain = Driver(binary, "serde-json")

    if args.only is not None:
        name, line, also = document(args.seed, args.only)
        strict.submit([line])
        plain.submit([line])
        ref = reference(line)
        print(f"category: {name}\ndocument: {line!r}\nreference: {ref[0]} {ref[1]!r}")
        print(f"idem strict: {strict.collect(1)[0]!r}\nidem serde-json: {plain.collect(1)[0]!r}")
        strict.close()
        plain.close()
        return 0

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    shown = []
    rfc_failures = []

    def record(category, index, line, answer, ref):
        v, detail = verdict(answer, ref)
        counts[category][v] += 1
        if detail:
            reasons[category][f"{v}: {detail}"] += 1
        if v == "differ" and len(shown) < args.show:
            shown.append((category, index, line, answer, ref))

    # RFC 8785's own vectors, through both readers, and against the RFC text.
    vectors = rfc_vectors()
    lines = [v[1].encode("utf-8") for v in vectors]
    strict.submit(lines)
    plain.submit(lines)
    for (name, text, expected), line, a_strict, a_plain in zip(
        vectors, lines, strict.collect(len(lines)), plain.collect(len(lines))
    ):
        ref = reference(line)
        record("rfc-vectors (strict)", name, line, a_strict, ref)
        record("rfc-vectors (serde-json)", name, line, a_plain, ref)
        if ref[0] != "ok" or ref[1] != expected.encode("utf-8"):
            rfc_failures.append(f"{name}: reference gives {ref[1]!r}, RFC {expected!r}")
        if a_plain != f"ok\t{expected}":
            rfc_failures.append(f"{name}: idem (serde-json) gives {a_plain!r}, RFC {expected!r}")
        if not (a_strict == f"ok\t{expected}" or a_strict.startswith("error\tunsafe_integer\t")):
            rfc_failures.append(f"{name}: idem (strict) gives {a_strict!r}, RFC {expected!r}")

    # Generated documents, in batches through both drivers.
    done = 0
    last_report = time.monotonic()
    while done < args.count:
        n = min(BATCH, args.count - done)
        docs = [document(args.seed, done + i) for i in range(n)]
        strict.submit([d[1] for d in docs])
        plain_docs = [(i, d) for i, d in enumerate(docs) if d[2]]
        plain.submit([d[1] for _, d in plain_docs])
        refs = [reference(d[1]) for d in docs]
        for i, ((name, line, _), answer) in enumerate(zip(docs, strict.collect(n))):
            record(name, done + i, line, answer, refs[i])
        for (i, (name, line, _)), answer in zip(plain_docs, plain.collect(len(plain_docs))):
            record(f"{name} (serde-json)", done + i, line, answer, refs[i])
        done += n
        if not args.json and time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            print(f"  {done}/{args.count} documents, {time.monotonic() - started:.0f} s", file=sys.stderr)
    strict.close()
    plain.close()
    elapsed = time.monotonic() - started

    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    generated = sum(sum(c.values()) for k, c in counts.items()
                    if not k.startswith("rfc-vectors") and not k.endswith("(serde-json)"))
    summary = {
        "seed": args.seed,
        "documents": generated,
        "rfc_vectors": len(vectors),
        "comparisons": sum(total.values()),
        "verdicts": dict(total),
        "categories": {k: dict(v) for k, v in sorted(counts.items())},
        "reasons": {k: dict(v) for k, v in sorted(reasons.items())},
        "rfc_vector_failures": rfc_failures,
        "rfc8785": RFC8785_VERSION,
        "seconds": round(elapsed, 1),
    }
    if args.json:
        print(json.dumps(summary, indent=1, ensure_ascii=False))
    else:
        print(f"differential RFC 8785: idem vs rfc8785 {RFC8785_VERSION} (Python {sys.version.split()[0]}), "
              f"seed {args.seed}, {generated} generated documents + {len(vectors)} RFC vectors, {elapsed:.1f} s")
        print(f"{'category':38} {'docs':>8} {'same':>8} {'both-rej':>8} {'by-design':>9} {'differ':>7}")
        for k, c in sorted(counts.items()):
            print(f"{k:38} {sum(c.values()):>8} {c['same']:>8} {c['both-reject']:>8} "
                  f"{c['by-design']:>9} {c['differ']:>7}")
        print(f"{'total':38} {sum(total.values()):>8} {total['same']:>8} {total['both-reject']:>8} "
              f"{total['by-design']:>9} {total['differ']:>7}")
        print("reasons (idem/reference):")
        for k, c in sorted(reasons.items()):
            print(f"  {k}: " + ", ".join(f"{r} {n}" for r, n in c.most_common()))
    for category, index, line, answer, ref in shown:
        print(f"DIFFER [{category} #{index}] {line!r}\n  idem:      {answer!r}\n  reference: {ref[0]} {ref[1]!r}",
              file=sys.stderr)
    for failure in rfc_failures:
        print(f"RFC VECTOR: {failure}", file=sys.stderr)
    return 1 if total["differ"] or rfc_failures else 0


if __name__ == "__main__":
    sys.exit(main())
