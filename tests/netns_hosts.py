"""Hosts on one machine, for tests: each its own network, UTS, PID and mount namespace.

    from netns_hosts import Hosts
    with Hosts(3) as hs:                          # skips (one line) where it cannot be built
        hs.share(run_dir, exporter=hs[0])         # over sshfs on every other host
        pg = hs.postgres(hs[1])                   # PostgreSQL on host 1, password auth
        p = hs[2].popen([sys.executable, "-m", "fanout.cli", ...], env=pg.env(...))
        hs[2].cut(); hs[2].heal()                 # a silent partition, and its end
        hs[2].lose()                              # every process of the host killed at once

A host is a long-lived `sleep` that is pid 1 of its own pid namespace (`unshare --pid
--fork --mount-proc`), with its own hostname (UTS) and mount namespace, inside a
network namespace (`ip netns`) whose one link (`eth0`) is a veth pair to a bridge of
this test. Addresses are in a private subnet (10.213.N.0/24: host i is .i+1, the
bridge .254, so the test process itself reaches the hosts) that only these hosts use;
nothing else is routed (DESIGN.md "Test hosts on one machine": the machine's rules
allow loopback and test hosts a test creates, nothing else). Processes run on a host
through `nsenter`, so each sees its own pid 1, hostname and mounts, and a host lost is
its pid 1 killed: the kernel kills everything in its pid namespace at once. Each host's
processes get a temp dir of their own ($TMPDIR), as on another machine: what fanout
keeps per host (its build locks) is not shared between test hosts either.

A silent partition (no RST, packets vanish both ways) detaches the host's veth from
the bridge (`ip link set VETH nomaster`); `heal` attaches it again. This kernel has
no `netem`: latency and loss go through a userspace proxy (tests/tcp_proxy.py).

The run dir on a network filesystem: `share(path, exporter)` runs sshd on the
exporter (on the test network only, key auth, a key made for the test) and mounts
`path` over sshfs at the same path on every other host, with sshfs's attribute and
directory caches on, the way sites run it. PostgreSQL (`postgres(host)`) listens on
the host's address with scram-sha-256 password auth (no `trust`); clients get the
password through `PGPASSWORD`, as docs/operations.md says.

Needs root, `ip`, `unshare`, `nsenter`; `share` needs `sshd` and `sshfs` (.ci/run and
./dev.sh install them, as root, where apt is); `postgres` needs the server binaries
and a `postgres` user. Where a part is missing, the test skips with one line naming it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SUBNET = "10.213"  # 10.213.N.0/24 per Hosts: private, used by nothing but these tests


def _sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def missing() -> str | None:
    """Why hosts cannot be built here (one line), or None."""
    if os.geteuid() != 0:
        return "namespaced test hosts need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"namespaced test hosts need `{tool}`"
    return None


@dataclass
class Host:
    """One test host: `name` (its hostname), `addr` on the test network."""

    name: str
    index: int
    addr: str
    netns: str
    veth: str
    bridge: str
    init: subprocess.Popen[bytes]
    pid: int = 0  # its pid 1, as the test's pid namespace numbers it
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _tmp: Path = Path("/tmp")

    def argv(self, argv: list[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """`argv` run on this host (its network, hostname, pids and mounts)."""
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", "-t", str(self.pid), "-n", "-u", "-p", "-m", f"--wd={wd}", "--", *argv]

    @property
    def tmp(self) -> Path:
        """This host's own temp dir (its processes' $TMPDIR), as another machine's."""
        return self._tmp

    def _env(self, kw: dict[str, Any]) -> dict[str, Any]:
        env = dict(kw.get("env") or os.environ)
        env.setdefault("TMPDIR", str(self._tmp))
        return kw | {"env": env}

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this host (Popen's keywords; `cwd` as the working dir)."""
        kw = self._env(kw)
        p = subprocess.Popen(self.argv(argv, kw.pop("cwd", None)), **kw)
        self.procs.append(p)
        return p

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to its end (output captured, text; check=True)."""
        kw = self._env({"capture_output": True, "text": True, "check": True} | kw)
        return subprocess.run(self.argv(argv, kw.pop("cwd", None)), **kw)

    def cut(self) -> None:
        """A silent partition: the host's link leaves the bridge (no RST, nothing)."""
        _sh("ip", "link", "set", self.veth, "nomaster")

    def heal(self) -> None:
        _sh("ip", "link", "set", self.veth, "master", self.bridge)

    def lose(self) -> None:
        """Every process of this host killed at once (its pid 1 killed)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.init.wait(60)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)


@dataclass
class Postgres:
    """A PostgreSQL server on a test host, password auth."""

    host: Host
    port: int
    password: str
    data: Path

    def url(self, schema: str | None = None) -> str:
        """The coordinator URL (no password in it: that goes through PGPASSWORD)."""
        tail = f"&schema={schema}" if schema else ""
        return (
            f"postgresql://postgres@{self.host.addr}:{self.port}/postgres?connect_timeout=5{tail}"
        )

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(base if base is not None else os.environ), "PGPASSWORD": self.password}


class Hosts:
    """`n` test hosts on one bridge; a context manager that removes everything it made
    (processes, mounts, links, namespaces). Skips the calling test where it cannot be
    built (`missing()`, or a namespace or link the kernel refuses)."""

    def __init__(self, n: int, prefix: str = "h") -> None:
        self.n = n
        self.prefix = prefix
        self.hosts: list[Host] = []
        self.base = Path(tempfile.mkdtemp(prefix="fanout-hosts-"))
        self.base.chmod(0o755)  # PostgreSQL runs as its own user, under here
        self._servers: list[subprocess.Popen[Any]] = []
        self._cleanup: list[list[str]] = []

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Any:
        return iter(self.hosts)

    def __enter__(self) -> Hosts:
        why = missing()
        if why:
            pytest.skip(why)
        try:
            self._build()
        except (subprocess.CalledProcessError, OSError) as e:
            self.__exit__()
            err = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            pytest.skip(f"namespaced test hosts cannot be built here: {err or e}"[:300])
        return self

    def _build(self) -> None:
        for _ in range(50):  # a subnet and names no other test session uses now
            net = random.randrange(1, 250)
            bridge = f"fb{net}{secrets.token_hex(2)}"
            if not Path(f"/sys/class/net/{bridge}").exists() and not any(
                Path("/run/netns").glob(f"fh{net}x*")
            ):
                break
        self.subnet, self.bridge = f"{SUBNET}.{net}", bridge
        _sh("ip", "link", "add", bridge, "type", "bridge")
        self._cleanup.append(["ip", "link", "del", bridge])
        _sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        # every host's name resolves on every host, as a cluster's DNS makes it (torchrun's
        # rendezvous and gloo look their own hostname up): `ip netns exec` bind-mounts
        # /etc/netns/NS/hosts over /etc/hosts, and each host's mount namespace keeps it
        names = "".join(f"{self.subnet}.{i + 1} {self.prefix}{i}\n" for i in range(self.n))
        for i in range(self.n):
            name, ns, veth = f"{self.prefix}{i}", f"fh{net}x{i}", f"fv{net}x{i}"
            _sh("ip", "netns", "add", ns)
            self._cleanup.append(["ip", "netns", "del", ns])
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            self._cleanup.append(["rm", "-rf", str(etc)])
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            self._cleanup.append(["ip", "link", "del", veth])
            _sh("ip", "link", "set", f"{veth}p", "netns", ns)
            _sh("ip", "link", "set", veth, "master", bridge)
            _sh("ip", "link", "set", veth, "up")
            _sh("ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0")
            addr = f"{self.subnet}.{i + 1}"
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            init = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--pid", "--mount", "--fork",
                 "--mount-proc", "--propagation", "private", "sh", "-c",
                 f"hostname {name} && exec sleep infinity"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            host = Host(name, i, addr, ns, veth, bridge, init)
            host._tmp = self.base / f"tmp-{name}"
            host._tmp.mkdir(mode=0o1777)
            self.hosts.append(host)
            host.pid = self._pid_one(host)

    def _pid_one(self, host: Host) -> int:
        """The host's pid 1 (unshare's child, `sleep` once its hostname is set)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if host.init.poll() is not None:
                err = host.init.stderr.read().decode() if host.init.stderr else ""
                raise OSError(f"host {host.name} did not start: {err.strip()}")
            for pid in _children(host.init.pid):
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                        return pid
                except OSError:
                    pass
            time.sleep(0.02)
        raise OSError(f"host {host.name}: no pid 1 after 60 s")

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            for p in host.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if host.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.pid, signal.SIGKILL)  # the host's every process, its mounts
            if host.init.poll() is None:
                host.init.kill()
            host.init.wait(60)
            if host.init.stderr is not None:
                host.init.stderr.close()
            for p in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(60)
        for p in self._servers:
            if p.poll() is None:
                p.kill()
            p.wait(60)
        for argv in reversed(self._cleanup):
            subprocess.run(argv, capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)

    # ---- a network filesystem --------------------------------------------------------

    def share(self, paths: Path | list[Path], exporter: Host, mount_opts: str = "") -> None:
        """Export `paths` (directories) from `exporter` over sshd and mount each with
        sshfs at the same path on every other host (attribute and directory caches on).
        Once per Hosts."""
        paths = paths if isinstance(paths, list) else [paths]
        for tool in ("sshfs", "ssh-keygen"):
            if shutil.which(tool) is None:
                pytest.skip(f"the run dir over sshfs needs `{tool}` (.ci/run installs it)")
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.access(sshd, os.X_OK):
            pytest.skip("the run dir over sshfs needs `sshd` (openssh-server; .ci/run installs it)")
        keys = self.base / "ssh"
        keys.mkdir(mode=0o700)
        for k in ("id", "hostkey"):
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / k))
        shutil.copy(keys / "id.pub", keys / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        config = keys / "sshd_config"
        config.write_text(
            f"ListenAddress {exporter.addr}\nPort 22\nHostKey {keys / 'hostkey'}\n"
            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nSubsystem sftp internal-sftp\nLogLevel ERROR\n"
            f"PidFile {keys / 'sshd.pid'}\n"
        )
        with (self.base / "sshd.log").open("w") as log:
            exporter.popen([sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
        opts = (
            f"IdentityFile={keys / 'id'},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
            # a server silent for a minute is gone (then reconnect): shorter, a loaded
            # machine's stalls read as outages and in-flight calls fail with EIO
            "ServerAliveInterval=5,ServerAliveCountMax=12,reconnect,"
            "dir_cache=yes,dcache_timeout=20,attr_timeout=1,entry_timeout=1"
            + (f",{mount_opts}" if mount_opts else "")
        )
        for host, path in ((h, p) for h in self.hosts for p in paths):
            if host is exporter:
                continue
            deadline = time.monotonic() + 60
            while True:  # sshd may still be starting
                r = host.run(
                    ["sshfs", f"root@{exporter.addr}:{path}", str(path), "-o", opts], check=False
                )
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"sshfs on {host.name}: {r.stderr.strip()}")
                time.sleep(0.2)
            fstype = host.run(["stat", "-f", "-c", "%T", str(path)]).stdout.strip()
            assert fstype.startswith("fuse"), (host.name, fstype)

    # ---- PostgreSQL on a host ------------------------------------------------------------

    def postgres(self, host: Host) -> Postgres:
        """A throwaway PostgreSQL cluster on `host`, listening on its address only,
        scram-sha-256 password auth for the test network (fsync off)."""
        from conftest import _postgres_bin

        initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found")
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a postgres user to run the server as")
        base = self.base / "pg"
        base.mkdir()
        os.chown(base, pw.pw_uid, pw.pw_gid)
        password = secrets.token_hex(12)
        pwfile = base / "pw"
        pwfile.write_text(password + "\n")
        os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        data, sock = base / "data", base / "sock"
        as_pg = ["runuser", "-u", "postgres", "--"]
        _sh(*as_pg, initdb, "-D", str(data), "-U", "postgres", "--auth-local=trust",
            "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--no-sync")  # fmt: skip
        with (data / "pg_hba.conf").open("a") as f:
            f.write(f"host all all {self.subnet}.0/24 scram-sha-256\n")
        _sh(*as_pg, "mkdir", "-p", str(sock))
        port = 5432
        opts = (
            f"-k {sock} -c listen_addresses={host.addr} -p {port} -c fsync=off "
            "-c max_connections=200"
        )
        host.run([*as_pg, pg_ctl, "-D", str(data), "-o", opts, "-w", "-l", str(base / "log"),
                  "start"])  # fmt: skip
        # stopped with its host: the server runs in the host's pid namespace
        return Postgres(host, port, password, data)


# ---- faults of the database host (tests/test_host_faults.py) ---------------------------


def _postmaster(pg: Postgres) -> str:
    """The postmaster's pid, as the database host's pid namespace numbers it."""
    return (pg.data / "postmaster.pid").read_text().split()[0]


def restart_postgres(pg: Postgres) -> None:
    """`pg_ctl restart -m fast` on the database host: every connection is dropped (the
    server ends its backends, as a failover or an operator's restart does), the server
    comes back on the same address with the same options."""
    from conftest import _postgres_bin

    pg_ctl = _postgres_bin("pg_ctl")
    assert pg_ctl is not None
    pg.host.run(["runuser", "-u", "postgres", "--", pg_ctl, "-D", str(pg.data), "-w",
                 "-m", "fast", "-l", str(pg.data.parent / "log"), "restart"])  # fmt: skip


def signal_postgres(pg: Postgres, sig: str) -> list[str]:
    """Send `sig` (STOP, CONT) to the postmaster and each of its children (its backends
    and helpers), by pid on the database host; the pids it signalled. STOP pauses the
    database without a word to its clients: their kernels still ack, nothing answers."""
    pm = _postmaster(pg)
    script = (
        f"kill -{sig} {pm}; for c in $(cat /proc/{pm}/task/*/children); "
        f"do kill -{sig} $c 2>/dev/null; done; echo {pm} $(cat /proc/{pm}/task/*/children)"
    )
    return pg.host.run(["sh", "-c", script]).stdout.split()


# sitecustomize for a host whose wall clock is off: every Python wall-clock reading
# (time.time, time.time_ns: fanout.coord.database.wall, logging, ...) moved by the offset.
_CLOCK_OFF = """import os, time
_off = float(os.environ["FANOUT_TEST_WALL_OFFSET_S"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _off
time.time_ns = lambda: _time_ns() + int(_off * 1e9)
"""


def clock_offset_env(env: dict[str, str], offset_s: float, where: Path) -> dict[str, str]:
    """`env` for Python processes whose wall clock is off by `offset_s` seconds (a
    sitecustomize under `where` moves time.time and time.time_ns; their monotonic
    clock is left alone, as NTP leaves a host's). Not libfaketime: 0.9.10 with Python
    3.11 hangs threading.Event.wait where it fakes the monotonic clock and fails
    time.sleep with EINVAL where it does not."""
    site = where / f"clock{offset_s:+g}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_CLOCK_OFF)
    path = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "FANOUT_TEST_WALL_OFFSET_S": repr(float(offset_s))}
