#!/usr/bin/env python3
"""A fake payment provider for idem's examples: an HTTP server with its own
idempotent ledger and injectable faults. Python 3.10+, standard library only.

    python3 examples/provider/provider.py [--port 0] [--link-to http://127.0.0.1:8787]

prints ``provider listening on http://127.0.0.1:PORT`` (and, with ``--link-to``,
``link listening on http://127.0.0.1:PORT``) and serves until SIGTERM/SIGINT.

Provider API (JSON):

- ``POST /payouts`` with header ``Idempotency-Key`` and body
  ``{"payee", "amount", "currency", "reference"?}`` → 201 ``{"id", "key",
  "payee", "amount", "currency", "reference"}``. A payout is recorded once per
  key: a repeat with the same key answers the recorded payout (200) and moves
  no money again. Missing key or fields → 400.
- ``GET /payouts/{key}`` → 200 the payout, or 404 ``{"error": "not found"}``.
- ``GET /ledger`` → ``{"payouts": [...], "pay_requests", "lookups",
  "dropped"}``: every payout in the order recorded, and the counts of pay
  requests (repeats included), lookups and answers dropped.
- ``POST /faults`` merges into the faults in force and answers them:
  ``{"drop_response_after_commit": [key, ...]}``: the next pay request with one
  of these keys (its ``Idempotency-Key`` or its ``reference``) records the payout, then closes the connection unanswered
  (once per key); ``{"drop_ratio": 0.1, "seed": 1}``: the same for that share of
  first pay requests, chosen by a seeded generator; ``{"delay_ms": N}``: every
  pay request waits N ms after recording before it answers (a window in which
  an executor can die with the money moved); ``{"drop_link_responses": N}``:
  the link (below) drops the next N answers. ``GET /faults`` answers them.

The link (``--link-to URL``) is an HTTP relay to idem that a client can be
pointed at: it forwards every request and its answer, except that while
``drop_link_responses`` is above zero it forwards the request, reads idem's
answer and closes the client's connection instead of relaying it (idem did
the work; the client never hears of it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Ledger:
    """The provider's state, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.payouts: dict[str, dict] = {}
        self.pay_requests = 0
        self.lookups = 0
        self.dropped = 0
        self.drop_keys: set[str] = set()
        self.drop_ratio = 0.0
        self.rng = random.Random(0)
        self.delay_ms = 0
        self.drop_link_responses = 0

    def faults(self) -> dict:
        return {
            "drop_response_after_commit": sorted(self.drop_keys),
            "drop_ratio": self.drop_ratio,
            "delay_ms": self.delay_ms,
            "drop_link_responses": self.drop_link_responses,
        }


LEDGER = Ledger()


class Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def answer(self, status: int, doc: object) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ProviderHandler(Quiet):
    def do_GET(self) -> None:  # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        if path == "/ledger":
            with LEDGER.lock:
                doc = {
                    "payouts": list(LEDGER.payouts.values()),
                    "pay_requests": LEDGER.pay_requests,
                    "lookups": LEDGER.lookups,
                    "dropped": LEDGER.dropped,
                }
            self.answer(200, doc)
        elif path == "/faults":
            with LEDGER.lock:
                doc = LEDGER.faults()
            self.answer(200, doc)
        elif path.startswith("/payouts/"):
            key = urllib.parse.unquote(path.removeprefix("/payouts/"))
            with LEDGER.lock:
                LEDGER.lookups += 1
                payout = LEDGER.payouts.get(key)
            if payout is None:
                self.answer(404, {"error": "not found"})
            else:
                self.answer(200, payout)
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        try:
            doc = json.loads(self.body() or b"{}")
        except json.JSONDecodeError:
            self.answer(400, {"error": "the body is not JSON"})
            return
        if path == "/faults":
            self.set_faults(doc)
        elif path == "/payouts":
            self.pay(doc)
        else:
            self.answer(404, {"error": "not found"})

    def set_faults(self, doc: dict) -> None:
        with LEDGER.lock:
            LEDGER.drop_keys.update(doc.get("drop_response_after_commit", []))
            if "drop_ratio" in doc:
                LEDGER.drop_ratio = float(doc["drop_ratio"])
                LEDGER.rng = random.Random(doc.get("seed", 0))
            if "delay_ms" in doc:
                LEDGER.delay_ms = int(doc["delay_ms"])
            if "drop_link_responses" in doc:
                LEDGER.drop_link_responses = int(doc["drop_link_responses"])
            faults = LEDGER.faults()
        self.answer(200, faults)

    def pay(self, doc: dict) -> None:
        key = self.headers.get("Idempotency-Key")
        missing = [f for f in ("payee", "amount", "currency") if f not in doc]
        if not key or missing:
            self.answer(400, {"error": "needs an Idempotency-Key header", "missing": missing})
            return
        with LEDGER.lock:
            LEDGER.pay_requests += 1
            payout = LEDGER.payouts.get(key)
            first = payout is None
            if first:
                payout = {
                    "id": f"po_{len(LEDGER.payouts) + 1:05d}",
                    "key": key,
                    "payee": doc["payee"],
                    "amount": doc["amount"],
                    "currency": doc["currency"],
                    "reference": doc.get("reference"),
                }
                LEDGER.payouts[key] = payout
            reference = doc.get("reference")
            named = key in LEDGER.drop_keys or reference in LEDGER.drop_keys
            drop = named or (first and LEDGER.rng.random() < LEDGER.drop_ratio)
            LEDGER.drop_keys.discard(key)
            LEDGER.drop_keys.discard(reference)
            if drop:
                LEDGER.dropped += 1
            delay = LEDGER.delay_ms
        if delay:
            time.sleep(delay / 1000)
        if drop:
            # Committed, but the caller never hears of it.
            self.close_connection = True
            return
        self.answer(201 if first else 200, payout)


def link_handler(upstream: urllib.parse.SplitResult) -> type[Quiet]:
    class LinkHandler(Quiet):
        def relay(self) -> None:
            body = self.body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                r = conn.getresponse()
                data = r.read()
            finally:
                conn.close()
            with LEDGER.lock:
                drop = LEDGER.drop_link_responses > 0
                if drop:
                    LEDGER.drop_link_responses -= 1
            if drop:
                self.close_connection = True
                return
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = relay  # noqa: N815

    return LinkHandler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--link-to", help="idem's URL: also serve a relay to it that can lose answers")
    args = ap.parse_args()

    servers = [ThreadingHTTPServer((args.host, args.port), ProviderHandler)]
    print(f"provider listening on http://{args.host}:{servers[0].server_port}", flush=True)
    if args.link_to:
        upstream = urllib.parse.urlsplit(args.link_to)
        servers.append(ThreadingHTTPServer((args.host, 0), link_handler(upstream)))
        print(f"link listening on http://{args.host}:{servers[1].server_port}", flush=True)
    for s in servers:
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for s in servers:
        s.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
