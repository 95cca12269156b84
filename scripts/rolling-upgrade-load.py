#!/usr/bin/env python3
"""Steady submit/claim/report load on every idem instance listed in a file,
for scripts/rolling-upgrade.sh (standard library only; 127.0.0.1 only).

Each worker thread, in turn on every instance listed so far: submits a
`generation.dispatch` task under a new Idempotency-Key, claims one attempt
and reports it succeeded. A poller reads every instance's /readyz every
READYZ_EVERY seconds. The instances file gains lines (`NAME URL`) while the
load runs; an instance is used from the moment its line appears.

Writes, when the duration is over: the ids of every acknowledged submit (one
per line) to --acked, and a JSON summary (per instance: requests, those
answered once a new binary's instance was listed, statuses, readyz answers,
transport errors) to --summary.
"""

import argparse
import http.client
import json
import threading
import time
import urllib.parse
import uuid

READYZ_EVERY = 0.2
TIMEOUT_S = 30


def instances(path):
    """The (name, host, port) of every line of the instances file."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:
                    u = urllib.parse.urlsplit(parts[1])
                    if u.hostname != "127.0.0.1":
                        raise SystemExit(f"refusing a non-local instance: {parts[1]}")
                    out.append((parts[0], u.hostname, u.port))
    except FileNotFoundError:
        pass
    return out


class Tally:
    """Answers per instance, shared by all threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by = {}
        self.acked = []

    def per(self, name):
        return self.by.setdefault(name, {"requests": 0, "requests_beside_new": 0, "status": {},
                                         "readyz": {}, "errors": 0, "error_samples": []})

    def count(self, name, kind, status, beside_new=False):
        with self.lock:
            per = self.per(name)
            if kind == "readyz":
                per["readyz"][str(status)] = per["readyz"].get(str(status), 0) + 1
            else:
                per["requests"] += 1
                per["requests_beside_new"] += int(beside_new)
                per["status"][str(status)] = per["status"].get(str(status), 0) + 1

    def error(self, name, what):
        with self.lock:
            per = self.per(name)
            per["errors"] += 1
            if len(per["error_samples"]) < 5:
                per["error_samples"].append(what)


def call(conns, inst, method, path, key, body=None, headers=None):
    """One request on this thread's keep-alive connection to `inst`:
    (status, parsed JSON or None)."""
    name, host, port = inst
    conn = conns.get(name)
    if conn is None:
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        conns[name] = conn
    h = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException):
        conn.close()
        conns.pop(name, None)
        raise
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        doc = None
    return resp.status, doc


def worker(n, args, tally, stop):
    conns = {}
    i = n
    while not stop.is_set():
        live = instances(args.instances)
        if not live:
            time.sleep(0.05)
            continue
        i += 1
        beside_new = len(live) > args.old
        inst = live[i % len(live)]
        name = inst[0]
        try:
            key = f"roll-{n}-{uuid.uuid4()}"
            status, doc = call(conns, inst, "POST", "/v1/tasks", args.client_key,
                               {"operation": "generation.dispatch", "params": {"prompt": key}},
                               {"Idempotency-Key": f'"{key}"'})
            tally.count(name, "submit", status, beside_new)
            if status in (200, 201) and doc and "task" in doc:
                with tally.lock:
                    tally.acked.append(doc["task"]["id"])
            # Claim and report on the next instance: work crosses binaries.
            inst = live[(i + 1) % len(live)]
            name = inst[0]
            status, doc = call(conns, inst, "POST", "/v1/attempts/claim", args.executor_key,
                               {"executor_id": f"roll-{n}", "operations": ["generation.dispatch"],
                                "max": 1, "lease_ms": 30000, "wait_ms": 0})
            tally.count(name, "claim", status, beside_new)
            for a in (doc or {}).get("attempts", []) if status == 200 else []:
                status, _ = call(conns, inst, "POST", f"/v1/attempts/{a['id']}/report",
                                 args.executor_key,
                                 {"generation": a["generation"], "outcome": "succeeded",
                                  "result": {"ok": True}})
                tally.count(name, "report", status, beside_new)
        except (OSError, http.client.HTTPException) as e:
            tally.error(name, repr(e))


def poll_readyz(args, tally, stop):
    conns = {}
    while not stop.is_set():
        for inst in instances(args.instances):
            try:
                status, doc = call(conns, inst, "GET", "/readyz", None)
                tally.count(inst[0], "readyz", status)
                if status != 200:
                    tally.error(inst[0], f"/readyz {status}: {(doc or {}).get('detail')}")
            except (OSError, http.client.HTTPException) as e:
                tally.error(inst[0], "/readyz " + repr(e))
        time.sleep(READYZ_EVERY)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--instances", required=True)
    p.add_argument("--client-key", required=True)
    p.add_argument("--executor-key", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--old", type=int, default=2,
                   help="instances listed before the new binary's (requests_beside_new counts "
                        "the answers given once more were listed)")
    p.add_argument("--acked", required=True)
    p.add_argument("--summary", required=True)
    args = p.parse_args()
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=worker, args=(n, args, tally, stop)) for n in range(args.workers)]
    threads.append(threading.Thread(target=poll_readyz, args=(args, tally, stop)))
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    with open(args.acked, "w") as f:
        f.writelines(f"{t}\n" for t in tally.acked)
    with open(args.summary, "w") as f:
        json.dump({"seconds": round(time.monotonic() - started, 1), "instances": tally.by,
                   "acked": len(tally.acked)}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
