"""Fixtures: one real ``idem serve`` per test session, a fresh tenant per test,
and a TCP proxy that can lose answers; for the fault suites, ``idem serve`` on
SQLite and on a scratch PostgreSQL database behind the fault-injecting proxy
(``FaultProxy``).

The server binary is ``$IDEM_BIN``, else ``target/debug/idem`` of this
repository (built with ``cargo build -p idem`` when missing). It runs the
bundled operation classes with short backoffs (as ``fast_toml()`` of
crates/idem/tests/http/support.rs), except ``generation.dispatch``, whose
backoff is 400 ms so that a test can see a retry wait for it, and sweeps
every 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import idem

REPO = Path(__file__).resolve().parents[3]

#: Backoff of ``generation.dispatch`` in the test server, ms.
DISPATCH_BACKOFF_MS = 400

SERVER_ENV = {
    "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__INITIAL_MS": "50",
    "IDEM_OPERATIONS__PAYMENT_RELEASE__RETRY__BACKOFF__MAX_MS": "200",
    "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__INITIAL_MS": str(DISPATCH_BACKOFF_MS),
    "IDEM_OPERATIONS__GENERATION_DISPATCH__RETRY__BACKOFF__MAX_MS": str(DISPATCH_BACKOFF_MS),
}


def idem_bin() -> str:
    if os.environ.get("IDEM_BIN"):
        return os.environ["IDEM_BIN"]
    path = REPO / "target" / "debug" / "idem"
    if not path.exists():
        subprocess.run(["cargo", "build", "-p", "idem"], cwd=REPO, check=True)
    return str(path)


@dataclass
class Server:
    url: str
    store: str
    dir: Path

    def create_key(self, tenant: str, role: str) -> str:
        return self.create_key_with_id(tenant, role)[0]

    def create_key_with_id(self, tenant: str, role: str) -> tuple[str, str]:
        """A new key of ``tenant`` and its id (for ``revoke``)."""
        out = subprocess.run(
            [idem_bin(), "keys", "create", "--tenant", tenant, "--role", role, "--store", self.store],
            check=True,
            capture_output=True,
            text=True,
        )
        m = re.search(r"created API key (\S+)", out.stderr)
        return out.stdout.strip(), m.group(1) if m else ""

    def revoke(self, key_id: str) -> None:
        subprocess.run([idem_bin(), "keys", "revoke", key_id, "--store", self.store], check=True, capture_output=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("idem")
    with serve(f"sqlite://{d / 'idem.db'}", d) as s:
        yield s


@contextlib.contextmanager
def serve(store: str, d: Path) -> Iterator[Server]:
    """``idem serve`` on ``store`` for the block, its logs in ``d``."""
    with open(d / "stdout.log", "w") as stdout, open(d / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(
            [idem_bin(), "serve", "--listen", "127.0.0.1:0", "--store", store, "--sweep-interval-ms", "50"],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, **SERVER_ENV},
        )
    try:
        deadline = time.monotonic() + 30
        url = None
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"idem serve did not start; see {d / 'stderr.log'}")
            time.sleep(0.02)
            m = re.search(r"idem listening on (http://\S+)", (d / "stdout.log").read_text())
            url = m.group(1) if m else None
        yield Server(url, store, d)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass
class Tenant:
    """A tenant of its own (no test sees another's tasks), with a client and an executor key."""

    name: str
    url: str
    client_key: str
    executor_key: str

    def client(self, **kw) -> idem.Client:
        return idem.Client(self.url, self.client_key, **kw)

    def async_client(self, **kw) -> idem.AsyncClient:
        return idem.AsyncClient(self.url, self.client_key, **kw)

    def executor(self, **kw) -> idem.AsyncClient:
        return idem.AsyncClient(self.url, self.executor_key, **kw)


@pytest.fixture
def tenant(server: Server) -> Tenant:
    name = f"t-{uuid.uuid4().hex[:12]}"
    return Tenant(name, server.url, server.create_key(name, "client"), server.create_key(name, "executor"))


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def payment(amount: int = 1250) -> dict:
    return {"payee": "acct-42", "amount": amount, "currency": "EUR"}


@contextlib.asynccontextmanager
async def serving(worker: idem.Worker, stop_within: float = 10.0):
    """Runs ``worker.serve()`` for the block, then stops it and waits for it."""
    task = asyncio.create_task(worker.serve())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, stop_within)


class Proxy:
    """A TCP proxy in front of the server. The n-th accepted connection is
    handled by ``modes[n]`` (later ones: ``"pass"``):

    - ``"pass"``: relays both ways;
    - ``"drop"``: relays the request, then closes the connection as soon as the
      answer starts, relaying none of it (the server did the work; the client
      never hears of it);
    - ``"503"``: reads the request, answers ``503 UNAVAILABLE`` with
      ``Retry-After: 1`` itself (nothing reaches the server);
    - ``"cut"``: relays the answer up to the end of its first Server-Sent Event
      (the first blank line of the body), then closes.
    """

    def __init__(self, upstream_url: str, modes: list[str]) -> None:
        host, port = upstream_url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.modes = list(modes)
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            n = self.connections
            self.connections += 1
            mode = self.modes[n] if n < len(self.modes) else "pass"
            threading.Thread(target=self._handle, args=(conn, mode), daemon=True).start()

    def _handle(self, client: socket.socket, mode: str) -> None:
        with client:
            if mode == "503":
                _read_request(client)
                body = b'{"title":"Service Unavailable","status":503,"detail":"proxy","code":"UNAVAILABLE"}'
                client.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                    b"Content-Type: application/problem+json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                return
            with socket.create_connection(self.upstream) as upstream:
                threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
                answer = b""
                while chunk := _recv(upstream):
                    if mode == "drop":
                        break
                    if mode == "cut":
                        answer += chunk
                        head_end = answer.find(b"\r\n\r\n")
                        cut = answer.find(b"\n\n", head_end + 4) if head_end >= 0 else -1
                        if cut >= 0:
                            client.sendall(answer[: cut + 2])
                            break
                        continue
                    client.sendall(chunk)
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    while chunk := _recv(src):
        try:
            dst.sendall(chunk)
        except OSError:
            return
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _read_request(s: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = _recv(s)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    need = int(m.group(1)) if m else 0
    while len(body) < need and (chunk := _recv(s)):
        body += chunk


#: PostgreSQL server the fault suites create their scratch databases on.
PG_URL = os.environ.get("IDEM_TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/test")
_scratch = iter(range(1_000_000))


@contextlib.contextmanager
def store_url(kind: str, d: Path) -> Iterator[str]:
    """A store for one server: a SQLite file in ``d``, or a scratch PostgreSQL
    database ``idem_t_sdk_<pid>_<n>`` on ``IDEM_TEST_PG_URL``'s server, dropped
    afterwards even when the block fails."""
    if kind == "sqlite":
        yield f"sqlite://{d / 'idem.db'}"
        return
    name = f"idem_t_sdk_{os.getpid()}_{next(_scratch)}"
    subprocess.run(["psql", PG_URL, "-qc", f"CREATE DATABASE {name}"], check=True)
    try:
        yield PG_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        subprocess.run(["psql", PG_URL, "-qc", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], check=True)


def fault_proxy_bin() -> str:
    """``$FAULT_PROXY_BIN``, else the example binary of idem-harness under
    ``$CARGO_TARGET_DIR`` or the repository's target (built with ``cargo build
    -p idem-harness --example fault-proxy``)."""
    if os.environ.get("FAULT_PROXY_BIN"):
        return os.environ["FAULT_PROXY_BIN"]
    target = REPO / os.environ.get("CARGO_TARGET_DIR", "target")
    path = target / "debug" / "examples" / "fault-proxy"
    if not path.exists():
        raise RuntimeError(f"no fault proxy at {path}: cargo build -p idem-harness --example fault-proxy")
    return str(path)


class FaultProxy:
    """The fault-injecting proxy (crates/idem-harness/examples/fault-proxy.rs)
    in front of ``upstream_url``: ``set()`` replaces its rules (route class →
    mode, or ``{"mode", "after"}``), ``counts()`` reads its counters."""

    def __init__(self, upstream_url: str) -> None:
        upstream = upstream_url.removeprefix("http://").rstrip("/")
        self.proc = subprocess.Popen(
            [fault_proxy_bin(), "--upstream", upstream, "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        m = re.match(r"listening on (127\.0\.0\.1:\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"the fault proxy did not start: {line!r}")
        self.url = f"http://{m.group(1)}"

    def set(self, rules: dict) -> None:
        r = httpx.put(f"{self.url}/__faults", json=rules, timeout=5)
        assert r.status_code == 204, r.text

    def counts(self) -> dict:
        return httpx.get(f"{self.url}/__faults/counts", timeout=5).json()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass
class Faulty:
    """One store's server, the fault proxy in front of it, and the store's name."""

    kind: str
    server: Server
    proxy: FaultProxy

    def tenant(self) -> Tenant:
        name = f"t-{uuid.uuid4().hex[:12]}"
        s = self.server
        return Tenant(name, s.url, s.create_key(name, "client"), s.create_key(name, "executor"))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def faulty(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    d = tmp_path_factory.mktemp(f"idem-{request.param}")
    with store_url(request.param, d) as store, serve(store, d) as server:
        proxy = FaultProxy(server.url)
        try:
            yield Faulty(request.param, server, proxy)
        finally:
            proxy.close()
