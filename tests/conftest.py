"""Shared fixtures. Test data comes from ../shared/data (never copied here)."""

from __future__ import annotations

import functools
import glob
import importlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FANOUT_SHARED_DATA", REPO.parent / "shared" / "data"))


def repo_module(folder: str, name: str) -> ModuleType:
    """This repository's `<folder>/<name>.py` as a module (`repo_module("benchmarks",
    "report")`): scripts/ and benchmarks/ are folders of scripts, not packages."""
    path = str(REPO / folder)
    sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(path)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data: real chat datasets and the Qwen3 tokenizer (see its README)."""
    if not (SHARED_DATA / "chat").is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(shared_data: Path) -> Path:
    return shared_data / "tokenizers" / "qwen3"


# ---- PostgreSQL: a private server for the coordinator's PostgreSQL backend -------------


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on loopback TCP (initdb + pg_ctl; fsync off),
    for this test session; yields a libpq URL. Skips when the server binaries or
    psycopg are missing. PostgreSQL refuses to run as root, so as root the cluster
    runs as the `postgres` user."""
    pytest.importorskip("psycopg")
    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found")
    # Not under pytest's tmp dir: that is private to us (0700), and the server may run
    # as another user.
    base = Path(tempfile.mkdtemp(prefix="fanout-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a postgres user to run the server as")
        as_user = ["runuser", "-u", "postgres", "--"]
        os.chown(base, pw.pw_uid, pw.pw_gid)
    data, sock = base / "data", base / "sock"
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
    run([*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync"])
    run([*as_user, "mkdir", "-p", str(sock)])
    # TCP on loopback, as trainers on other hosts connect (the socket dir is only for
    # pg_ctl's own readiness check); a free port picked by the kernel.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    opts = f"-k {sock} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off -c max_connections=300"
    start = [*as_user, pg_ctl, "-D", str(data), "-o", opts, "-w", "-l", str(base / "log"), "start"]
    run(start)
    _PG_CONTROL["start"] = start
    _PG_CONTROL["stop"] = [*as_user, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"]
    _PG_CONTROL["status"] = [*as_user, pg_ctl, "-D", str(data), "status"]
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=5"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], check=False)
        shutil.rmtree(base, ignore_errors=True)


_PG_CONTROL: dict[str, list[str]] = {}


class PostgresControl:
    """Stop and start the test server (stopping drops every connection)."""

    def stop(self) -> None:
        subprocess.run(_PG_CONTROL["stop"], check=True, capture_output=True)

    def start(self) -> None:
        subprocess.run(_PG_CONTROL["start"], check=True, capture_output=True)

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture
def postgres_control(postgres_server: str) -> Iterator[PostgresControl]:
    control = PostgresControl()
    yield control
    if subprocess.run(_PG_CONTROL["status"], capture_output=True).returncode:
        control.start()  # a failed test must not leave the server down for the next ones


@pytest.fixture
def pg_url(postgres_server: str) -> str:
    """A coordinator URL with a schema of its own (one run per schema)."""
    return f"{postgres_server}&schema=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest) -> str | None:
    """Where a test's coordinator lives: None (SQLite in the run dir) or a PostgreSQL URL."""
    if request.param == "sqlite":
        return None
    return str(request.getfixturevalue("pg_url"))


# ---- what skipped, and why ---------------------------------------------------------------


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skipped tests grouped by their reason, counted (a fresh clone skips the tests
    that need ../shared/data, speculators, PostgreSQL or Chromium; README says which)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons: dict[str, int] = {}
    for rep in skipped:
        longrepr = getattr(rep, "longrepr", None)
        # a skip's longrepr is (file, line, "Skipped: reason")
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else "?"
        reason = str(reason).removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:5d} × {reason}")
