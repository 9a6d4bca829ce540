"""A run dir shared by several hosts: temp names, the shared cache, lock files, a run
half-made (issue 55's four bugs; DESIGN.md "What clusters do to a shared run dir").

.venv/bin/pytest tests/test_shared_rundir.py -x -q

"Another host" is simulated where a host is only a name: the same pid under another
hostname and pid namespace (two hosts both run pid 1). tests/test_hosts.py runs the
same roles on real namespaced hosts with the run dir over sshfs.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import fanout.netfs as netfs
from fanout.data.cache import MANIFEST, PackedDataset, ShardWriter
from fanout.errors import NoCoordinator
from fanout.filesystem import FileSystem
from fanout.rows import PACKED_ROW


def _as_host(monkeypatch: pytest.MonkeyPatch, host: str, pid: int = 1) -> None:
    """Make this process look like pid `pid` of host `host` (its own pid namespace)."""
    monkeypatch.setattr(os, "getpid", lambda: pid)
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    space = f"{abs(hash(host)) % (1 << 32):08x}"
    monkeypatch.setattr(netfs, "_pid_space", lambda: space, raising=False)


def _rows(n: int, t: int = 8, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n * t, dtype=np.int32).reshape(n, t)
    return {k: ids.astype(np.uint8 if k == "loss_mask" else np.int32) for k in PACKED_ROW}


_EXTRA = {"fingerprint": "f", "tokenizer_fingerprint": "t", "pad_token_id": 0, "summary": {}}


# ---- 1. temp names unique across hosts ------------------------------------------------


def test_two_hosts_with_one_pid_build_one_cache_entry_without_touching_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host a and host b, both pid 1, prepare the same rows into one shared cache entry
    at once: b starting must not remove a's temp (it did: `<entry>.tmp-<pid>` was the
    same name on both, and b's writer rmtree'd it), and the entry committed is whole."""
    final = tmp_path / "prepared" / "fp"
    _as_host(monkeypatch, "host-a")
    a = ShardWriter(final, 8, rows_per_shard=2)
    a.write(_rows(4))  # two shards on disk in a's temp
    _as_host(monkeypatch, "host-b")
    b = ShardWriter(final, 8, rows_per_shard=2)
    assert a.tmp != b.tmp
    assert sorted(p.name for p in a.tmp.iterdir()) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    b.write(_rows(4))
    _as_host(monkeypatch, "host-a")
    assert a.commit(_EXTRA) == final
    _as_host(monkeypatch, "host-b")
    assert b.commit(_EXTRA) == final
    assert PackedDataset(final).num_rows == 4
    assert sorted(p.name for p in final.parent.iterdir()) == ["fp"]  # both temps gone


def test_temp_names_differ_across_hosts_processes_and_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _as_host(monkeypatch, "h1")
    one, again = netfs.temp_tag(), netfs.temp_tag()
    _as_host(monkeypatch, "h2")
    other = netfs.temp_tag()
    assert len({one, again, other}) == 3
    assert "@h1." in one and ".1." in one and "@h2." in other


def test_another_hosts_temp_is_debris_only_by_age(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid says nothing about another host's process: its temp goes only once old."""
    _as_host(monkeypatch, "far", pid=999_999_999)  # no such pid here: "dead" if asked
    theirs = tmp_path / f".tmp-checkpoint-00000002-{netfs.temp_tag()}"
    theirs.mkdir()
    (theirs / "resume.safetensors").write_bytes(b"x")
    monkeypatch.undo()
    assert not netfs.temp_writer_gone(theirs)
    old = time.time() - netfs.TEMP_STALE_S - 60
    for p in (theirs, theirs / "resume.safetensors"):
        os.utime(p, (old, old))
    assert netfs.temp_writer_gone(theirs)
    # this host's: by pid, at once
    mine = tmp_path / f"x.tmp{netfs.temp_tag()}"
    assert not netfs.temp_writer_gone(mine)  # this process is alive
    dead = tmp_path / f"x.tmp{netfs.temp_tag().replace(f'.{os.getpid()}.', '.999999999.')}"
    assert netfs.temp_writer_gone(dead)


# ---- 2. a shared cache entry: built once, never swapped under a reader ------------------


def test_a_second_commit_keeps_the_first_entry_a_reader_holds(tmp_path: Path) -> None:
    """Two builders of one cache entry: the second finds the first's complete entry,
    drops its own and keeps the first in place (it did replace it: renamed aside and
    removed, so a worker reading the first's files found them gone)."""
    final = tmp_path / "prepared" / "fp"
    a = ShardWriter(final, 8, rows_per_shard=2)
    b = ShardWriter(final, 8, rows_per_shard=2)
    a.write(_rows(2))
    b.write(_rows(2))
    a.commit(_EXTRA)
    held = final / "shard-00000.safetensors"
    inode = held.stat().st_ino
    b.commit(_EXTRA)
    assert held.stat().st_ino == inode  # the first one's file, still under its path
    assert not b.tmp.exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["fp"]


def test_commit_dir_once_loses_to_a_rename_race_and_uses_the_winner(tmp_path: Path) -> None:
    """The winner commits between the loser's look and its rename (as on another host):
    the loser keeps the winner's entry, without an error, and never moves it (it did:
    set it aside as "incomplete" and put it back, and in that moment a replica on
    another host reading its own new entry found its shard gone)."""
    final = tmp_path / "entry"
    mine, theirs = (
        tmp_path / f"entry.tmp{netfs.temp_tag()}",
        tmp_path / f"entry.tmp{netfs.temp_tag()}",
    )
    for d, tag in ((mine, b"mine"), (theirs, b"theirs")):
        d.mkdir()
        (d / MANIFEST).write_bytes(tag)
    looks = []

    def complete(p: Path) -> bool:
        looks.append(p)
        if len(looks) == 1:  # our first look: nothing there; the other host commits now
            os.rename(theirs, final)
            return False
        return (p / MANIFEST).is_file()

    moved: list[Path] = []

    class Renames(FileSystem):
        def rename(self, src: Any, dst: Any) -> None:
            moved.append(Path(src))
            super().rename(src, dst)

    assert Renames().commit_dir_once(mine, final, complete) is False
    assert (final / MANIFEST).read_bytes() == b"theirs" and not mine.exists()
    assert final not in moved, moved


# ---- 3. no lock across hosts through a lock file ---------------------------------------


def test_a_lock_file_that_cannot_be_taken_builds_anyway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """sshfs with caches on refused the lock file's open (`PermissionError: Operation not
    permitted`), a traceback; now the build goes on without the lock, in one log line."""
    import filelock

    from fanout.data import prepare

    def refuse(self: object, *a: object, **k: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(filelock.UnixFileLock, "_acquire", refuse)
    ran = []
    with prepare._building(tmp_path / "prepared" / "fp"):
        ran.append(1)
    assert ran == [1]
    assert "without a lock" in caplog.text and "Traceback" not in caplog.text
    assert not (tmp_path / "locks").exists()  # no lock file beside the shared cache


def test_the_tokenizer_cache_is_built_once_by_racing_processes(
    tmp_path: Path, qwen3_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three builders of one tokenizer entry with no lock between them (as on three
    hosts): every one gets a whole entry, and the entry the first one committed stays."""
    import filelock

    from fanout.data import template

    def refuse(self: object, *a: object, **k: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(filelock.UnixFileLock, "_acquire", refuse)
    errors: list[BaseException] = []
    specs = []
    go = threading.Barrier(3)

    def build() -> None:
        try:
            go.wait()
            specs.append(template.load_chat_spec(qwen3_tokenizer_dir, tmp_path))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({s.tokenizer_json for s in specs}) == 1
    entry = Path(specs[0].tokenizer_json).parent
    assert json.loads((entry / "chat.json").read_text())["v"] == template.SPEC_VERSION
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # no temps left


def test_a_failed_tokenizer_build_is_one_line(tmp_path: Path) -> None:
    """The error names the tokenizer and the build's own last line, never a traceback."""
    from fanout.data import template
    from fanout.errors import ConfigError

    bad = tmp_path / "tok"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as ei:
        template.load_chat_spec(bad, tmp_path / "cache")
    msg = str(ei.value)
    assert msg.startswith(f"--tokenizer {bad}: cannot load it: ")
    assert "Traceback" not in msg and "\n" not in msg


# ---- 4. a run half-made is waited for, like a missing one ------------------------------


def _sshfs_mountinfo(root: Path) -> str:
    return (
        "22 1 0:21 / / rw - ext4 /dev/root rw\n"
        f"90 22 0:50 / {root} rw,nosuid,nodev - fuse.sshfs host0:/srv/run rw\n"
    )


def test_a_run_dir_on_sshfs_with_no_database_yet_is_a_run_not_made_yet(tmp_path: Path) -> None:
    """Trainers started before the producer wrote coordinator.dbpath (a PostgreSQL run
    on a shared run dir) were refused as "SQLite on fuse.sshfs"; nothing says SQLite
    yet, so it is NoCoordinator, which the trainer waits on."""
    from fanout.coord.coordinator import Coordinator

    with pytest.raises(NoCoordinator):
        Coordinator.open(tmp_path, mountinfo=_sshfs_mountinfo(tmp_path))


def test_the_trainer_waits_for_a_half_made_run_on_sshfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait_for_run waits through "no database yet" on a network run dir, then finds
    the run once the producer has made it (here: a SQLite database elsewhere, named by
    the pointer, as a PostgreSQL run's would be)."""
    from fanout.coord import sqlitedb
    from fanout.coord.coordinator import Coordinator
    from fanout.train.progress import WaitNotice, wait_for_run

    run = tmp_path / "run"
    run.mkdir()
    real = sqlitedb.filesystem_type
    monkeypatch.setattr(
        sqlitedb,
        "filesystem_type",
        lambda p, m=None: real(p, _sshfs_mountinfo(run)) if Path(p) == run else real(p, m),
    )
    found: list[object] = []
    errors: list[BaseException] = []
    looked = threading.Event()

    class Notice(WaitNotice):
        def tick(self) -> str | None:
            looked.set()  # called after each look that found no run yet
            return super().tick()

    def trainer() -> None:
        try:
            found.append(wait_for_run(run, None, 60.0, Notice(60.0)))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=trainer)
    t.start()
    while not looked.is_set() and t.is_alive():  # its first look found no run, or it failed
        time.sleep(0.01)
    assert errors == [] and t.is_alive()  # waiting, not refused
    db = tmp_path / "local" / "coordinator.sqlite3"
    Coordinator.create(run, _contract(), db_path=str(db)).close()
    t.join(30)
    assert errors == [] and len(found) == 1


# ---- a window named ready but not yet visible; a window removed under its reader -------


def _window_store(tmp_path: Path) -> tuple[Any, str, dict[str, Any]]:
    import torch

    from fanout.store.store import RunDir, Store, WindowMeta

    store = Store(RunDir(tmp_path / "run").create())
    g = torch.Generator().manual_seed(0)
    tensors = {
        "hidden_states.1": torch.randn(4, 64, 256, generator=g).bfloat16(),  # [R, T, H]
        "input_ids": torch.randint(0, 1000, (4, 64), generator=g, dtype=torch.int32),
    }
    meta = WindowMeta(
        contract_hash="c0ffee", window=3, generation=0, epoch=0, row_start=12, row_end=16
    )
    return store, store.publish(tensors, meta).name, tensors


def test_a_window_not_yet_visible_here_is_retried_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host published it and the coordinator named it ready, but this host's
    view of windows/ is stale for a moment: the open is retried for FANOUT_STALE_VIEW_S
    (a missing file used to be CorruptWindow at once: reported, recaptured)."""
    import torch

    from fanout.errors import CorruptWindow
    from fanout.store import windowreader

    store, name, tensors = _window_store(tmp_path)
    real_open, misses = os.open, cast(list[object], [])

    def stale_open(path: object, *a: object, **k: object) -> int:
        if str(path).endswith(name) and len(misses) < 3:  # not visible for 3 looks
            misses.append(path)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(windowreader.os, "open", stale_open)
    monkeypatch.setenv("FANOUT_STALE_VIEW_S", "30")
    with store.open(name) as r:
        assert torch.equal(r.get("input_ids"), tensors["input_ids"])
    assert len(misses) == 3
    misses.clear()
    monkeypatch.setenv("FANOUT_STALE_VIEW_S", "0")  # no wait: reported at once
    with pytest.raises(CorruptWindow, match="missing"):
        store.open(name)


def test_only_network_filesystems_wait_for_a_stale_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FANOUT_STALE_VIEW_S", raising=False)
    assert netfs.stale_view_s(tmp_path) == 0.0  # a local disk is never stale
    monkeypatch.setattr(netfs, "on_network_filesystem", lambda p: True)
    assert netfs.stale_view_s(tmp_path) == 5.0


_TRUNCATE_UNDER_READER = """
import os, sys
from fanout.errors import CorruptWindow
from fanout.store.windowreader import WindowReader
path = sys.argv[1]
r = WindowReader(path, tensors=[], copy=True)  # the header verified, no tensor read yet
os.truncate(path, r.nbytes // 2)               # a fault (or eviction on NFS) cuts it
try:
    r.get("hidden_states.1")
except CorruptWindow as e:
    print("CorruptWindow:", e.reason)
"""


def test_a_window_truncated_under_a_copying_reader_is_corrupt_not_sigbus(
    tmp_path: Path,
) -> None:
    """A mapped window truncated under its reader kills it with SIGBUS at the next
    fault (safetensors' safe_open on Lustre; our own map too); reads that copy see a
    short read: CorruptWindow, which the consumer reports. In a child process, so a
    SIGBUS fails this test instead of killing pytest."""
    import subprocess
    import sys

    store, name, _ = _window_store(tmp_path)
    path = store.path(name)
    r = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_UNDER_READER, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("CorruptWindow: file shrank"), r.stdout


def test_copying_and_mapping_reads_hand_out_the_same_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from fanout.errors import CorruptWindow
    from fanout.store.windowreader import WindowReader

    store, name, tensors = _window_store(tmp_path)
    path = store.path(name)
    for copy in (True, False):
        with WindowReader(path, copy=copy) as r:
            assert r.copy is copy
            for k, v in tensors.items():
                assert torch.equal(r.get(k), v), (copy, k)
            r.get("input_ids")[0, 0] = -1  # private: the file is unchanged
    monkeypatch.setenv("FANOUT_WINDOW_READS", "copy")
    with WindowReader(path) as r:
        assert r.copy and r.get("input_ids")[0, 0] != -1
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # a flipped bit in the last tensor: caught by a copying reader too
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptWindow, match="checksum mismatch"), WindowReader(path, copy=True):
        pass


# ---- replicas on several hosts start one run: the database decides, not a lock file -----


def _contract() -> Any:
    from fanout.contract import CaptureContract

    return CaptureContract.model_validate(
        dict(
            verifier_config_hash="cfg", verifier_weights_fingerprint="w",
            verifier_num_layers=4, hidden_size=8, vocab_size=32, target_layer_ids=(1, 2),
            dataset_fingerprint="data", tokenizer_fingerprint="tok", seq_len=4,
            window_rows=2, shuffle_seed=0,
        )
    )  # fmt: skip


def test_a_replica_whose_create_lost_the_race_joins_the_run(tmp_path: Path) -> None:
    """Replicas on two hosts both found no run (the join lock is a lock file: no lock
    across hosts) and both create it: the second's create is refused by the database,
    and it joins the run the first made (it failed the start, and removed the first's
    files as its own)."""
    from fanout.coord.coordinator import Coordinator, RunConfig
    from fanout.produce.run_start import create_run
    from fanout.store.store import RunDir, Store

    run = tmp_path / "run"
    store = Store(RunDir(run).create())
    Coordinator.create(run, _contract(), RunConfig()).close()
    coord, created = create_run(run, _contract(), RunConfig(), None, store, False, 1, 2)
    with coord:
        assert created is False and coord.contract == _contract()


def test_a_failed_start_leaves_a_run_another_host_made_meanwhile(tmp_path: Path) -> None:
    """Replica 1 noted the run dir empty, then failed before creating anything; replica 0
    on another host created the run meanwhile (its lock files did not order the two).
    Replica 1's cleanup removes nothing: the database says a run is there, not its."""
    from fanout.coord.coordinator import Coordinator, RunConfig
    from fanout.produce.run_start import CreatedPaths, take_start_lock
    from fanout.store.store import RunDir

    run = tmp_path / "run"
    lock, rank = take_start_lock(run, None, False, 1, 2)
    created = CreatedPaths.note(run, None, lock, rank, 2)
    RunDir(run).create()  # the other host's replica 0, at the same moment
    Coordinator.create(run, _contract(), RunConfig()).close()
    assert created.discard_if_unused(None, False, "h1:1") is False
    assert (run / "windows").is_dir() and (run / "coordinator.sqlite3").is_file()
    assert (run / "contract.json").is_file()


def _create_racer(run: str, url: str, rank: int, barrier: Any, delay_s: float, out: Any) -> None:
    """One replica on its own host: no join lock orders it (a lock file there is none)."""
    from fanout.coord.coordinator import RunConfig
    from fanout.produce.run_start import create_run
    from fanout.store.store import RunDir, Store

    barrier.wait(120)
    time.sleep(delay_s)
    try:
        store = Store(RunDir(Path(run)).create())
        coord, created = create_run(Path(run), _contract(), RunConfig(), url, store, False, rank, 4)
        coord.close()
        out.put((rank, "created" if created else "joined"))
    except BaseException as e:  # reported, not raised: the parent names what went wrong
        out.put((rank, f"{type(e).__module__}.{type(e).__name__}: {e}"))


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_replicas_on_four_hosts_race_to_create_one_postgres_run(
    tmp_path: Path, postgres_server: str, stagger: bool
) -> None:
    """Four replicas that all found no run, released together by a barrier (or each a
    random fraction of a second after it), create the run on PostgreSQL at once: one
    creates it, the three others join it; none fails. (CI saw the loser end with the
    server's `relation "meta" already exists`: the tables were checked before the
    write lock was taken, and created under it.)"""
    import multiprocessing as mp
    import random
    import uuid

    import fanout.produce.run_start  # noqa: F401  once, here: each fork has it then

    ctx = mp.get_context("fork")
    rng = random.Random(55)
    for round_ in range(3):
        url = f"{postgres_server}&schema=race_{uuid.uuid4().hex[:10]}"
        run = tmp_path / f"run{round_}"
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [
            ctx.Process(
                target=_create_racer,
                args=(str(run), url, rank, barrier, rng.uniform(0, 0.3) if stagger else 0.0, out),
            )
            for rank in range(4)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
        assert sorted(results.values()) == ["created", "joined", "joined", "joined"], results
