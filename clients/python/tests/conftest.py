"""The harness: a database of its own on DATABASE_URL's server, migrated by the real
`outboxd migrate`; a local HTTP receiver; the real `outboxd run` delivering to it. All
three live for the whole session and are torn down at its end (the database dropped).

OUTBOXD_BIN names the binary (default: the repository's target/debug/outboxd).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[3]
VECTORS = ROOT / "clients" / "key-vectors.json"


def admin_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        pytest.fail("DATABASE_URL is not set: run the tests with scripts/test", pytrace=False)
    return url


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Waits for a condition, checked every few milliseconds, up to a deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Receiver:
    """Records each request's path and Idempotency-Key. `/ok` answers 200 with a JSON
    body, `/reject` 400, and `/hold` waits until `release()` before answering 200."""

    server: ThreadingHTTPServer
    requests: list[tuple[str, str]] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)

    @property
    def base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def release(self) -> None:
        self.released.set()

    def seen(self, key: str) -> int:
        return sum(1 for _, k in self.requests if k == key)


def start_receiver() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(length)
            receiver.requests.append((self.path, self.headers.get("Idempotency-Key", "")))
            if self.path == "/hold":
                receiver.released.wait(30)
            status = 400 if self.path == "/reject" else 200
            body = json.dumps({"id": f"rcpt_{len(receiver.requests)}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver


@dataclass
class Outbox:
    """The session's database (`url`), receiver and daemon."""

    url: str
    receiver: Receiver
    daemon: subprocess.Popen[bytes]
    log: Path

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, **kwargs)

    def daemon_log(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="session")
def outbox() -> Iterator[Outbox]:
    admin = admin_url()
    name = f"outboxd_py_{os.getpid()}_{secrets.token_hex(4)}"
    binary = Path(os.environ.get("OUTBOXD_BIN", ROOT / "target" / "debug" / "outboxd"))
    if not binary.exists():
        pytest.fail(f"{binary} does not exist: run `cargo build` first", pytrace=False)
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin, name)
    receiver = start_receiver()
    daemon: subprocess.Popen[bytes] | None = None
    logdir = tempfile.TemporaryDirectory(prefix="outboxd-py-")
    log = Path(logdir.name) / "daemon.log"
    try:
        env = {**os.environ, "DATABASE_URL": url, "OUTBOXD_ALLOW_PRIVATE_NETWORKS": "true"}
        subprocess.run(
            [str(binary), "migrate"], env=env, check=True, capture_output=True, timeout=60
        )
        with log.open("wb") as out:
            daemon = subprocess.Popen(
                [str(binary), "run", "--worker-id", "py-tests", "--retry-base", "1s"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        yield Outbox(url, receiver, daemon, log)
    finally:
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        receiver.release()
        receiver.server.shutdown()
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        logdir.cleanup()


@pytest.fixture
def conn(outbox: Outbox) -> Iterator[psycopg.Connection[Any]]:
    with outbox.connect() as c:
        yield c


@pytest.fixture
def unique() -> Callable[[str], str]:
    """A key of this test's own (tests share the session's database)."""
    tag = secrets.token_hex(4)
    return lambda name: f"py-{tag}:{name}"


WAITER_MARK = "l.classid = 1869968482 AND l.objid = 3 AND l.objsubid = 2 AND l.granted"
THIS_DB = "l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"


@contextmanager
def settle_gate(outbox: Outbox) -> Iterator[Callable[[], None]]:
    """Holds the settle gate in share mode (as a change that decided not to notify would)
    and gives a function that returns once the one wait started meanwhile has queued
    behind it, passed it and made its look after it: what happens next is seen only by a
    later look."""

    def count(sql: str) -> int:
        with outbox.connect() as c:
            row = c.execute(sql).fetchone()
            assert row is not None
            return int(row[0])

    with outbox.connect(autocommit=True) as gate:
        gate.execute("BEGIN")
        gate.execute("SELECT pg_advisory_xact_lock_shared(1869968482, 4)")

        def let_through() -> None:
            wait_until(
                "the wait to queue at the settle gate",
                lambda: (
                    count(
                        "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory'"
                        f" AND l.classid = 1869968482 AND l.objid = 4 AND NOT l.granted AND {THIS_DB}"
                    )
                    == 1
                ),
            )
            gate.execute("COMMIT")
            wait_until(
                "the wait's look after the gate",
                lambda: (
                    count(
                        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                        f" WHERE l.locktype = 'advisory' AND {WAITER_MARK} AND {THIS_DB}"
                        " AND a.state = 'idle' AND a.query LIKE '%outbox.lookup%'"
                    )
                    == 1
                ),
            )

        yield let_through
