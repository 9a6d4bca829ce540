"""Lock files that name their holder (fanout.coord.pathlock), and what they guard.

    .venv/bin/pytest tests/test_pathlock.py -x -q -p no:randomly

A live holder (a real child process) refuses others, naming it; kill -9 frees its
lock at once; a file unlinked under a waiter is not "held" twice; a forked child
does not keep its parent's lock; a record naming a live process is honoured even
where flock let us in. Beside them: process identity (two processes that started
in the same clock tick are two processes) and a checkpoint's clean-up, which never
removes a live process's temp directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.coord.liveness import Holder, ProcessInfo, this_process
from fanout.coord.pathlock import PathLock
from fanout.errors import RoleHeld
from fanout.netfs import pid_gone

CTX = mp.get_context("spawn")
HOST = socket.gethostname()


def _hold(path: str, ready: Any) -> None:
    lock = PathLock(Path(path), "the thing", role="a test holder")
    lock.acquire()  # kept referenced: a dropped PathLock lets go
    ready.put(os.getpid())
    time.sleep(600)  # killed here
    lock.release()


def _holder(path: Path) -> tuple[Any, int]:
    ready = CTX.Queue()
    p = CTX.Process(target=_hold, args=(str(path), ready))
    p.start()
    return p, int(ready.get(timeout=120))


def test_a_live_holder_is_named_and_a_killed_ones_lock_is_free(tmp_path: Path) -> None:
    path = tmp_path / "made" / "x.lock"
    p, child = _holder(path)
    try:
        mine = PathLock(path, "the thing")
        with pytest.raises(RoleHeld) as held:
            mine.acquire()
        msg = str(held.value)
        assert f"the thing is held by {HOST} pid {child} (a test holder, holding it since" in msg
        assert str(path) in msg and not mine.held
        os.kill(child, signal.SIGKILL)
        p.join(60)
        mine.acquire()  # no flag, no waiting: the kernel let go of a dead holder's lock
        rec = json.loads(path.read_text())
        assert (rec["host"], rec["pid"], rec["proc"]) == (HOST, os.getpid(), this_process().proc)
        mine.release()
        assert path.read_text() == ""  # a released lock names nobody
        mine.acquire()  # and is taken again by anyone, this process included
        mine.release()
    finally:
        if p.is_alive():
            p.kill()
        p.join(60)


def test_a_file_unlinked_under_a_waiter_is_not_held_twice(tmp_path: Path) -> None:
    """The holder removes the file while another waits on it (a failed producer start
    removing the run dir it made): the waiter ends up holding the file now at the
    path, so a third process is refused rather than locking a second inode."""
    path = tmp_path / "run" / "x.lock"
    first = PathLock(path, "the thing")
    first.acquire()
    waiter = PathLock(path, "the thing")
    t = threading.Thread(target=waiter.acquire, kwargs={"wait": True})
    t.start()
    while _open_count(path) < 2:
        time.sleep(0.01)  # until the waiter has opened the file (then it blocks in flock)
    first.release(unlink=True)
    # The waiter wakes as soon as the flock goes and may make the file again before this
    # rmdir runs (then the directory is not empty): both orders are real, and in each
    # the waiter holds the file at the path; it made the directory iff rmdir removed it.
    try:
        path.parent.rmdir()
        removed_dir = True
    except OSError as e:
        assert e.errno == errno.ENOTEMPTY, e
        removed_dir = False
    t.join(60)
    assert waiter.held and waiter.made_file
    assert waiter.made_parent is removed_dir
    assert waiter._fd is not None
    assert os.fstat(waiter._fd).st_ino == os.stat(path).st_ino
    with pytest.raises(RoleHeld, match=f"pid {os.getpid()}"):
        PathLock(path, "the thing").acquire()
    waiter.release()


def _open_count(path: Path) -> int:
    """How many descriptors of this process have `path` open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile (listdir's own)
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return n


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """The data stage forks workers while the producer holds its start lock: a worker
    outliving its parent must not hold the lock of a process that is gone."""
    path = tmp_path / "x.lock"
    lock = PathLock(path, "the thing")
    lock.acquire()
    pid = os.fork()
    if pid == 0:  # the child: outlives the parent's hold
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        other = PathLock(path, "the thing")
        other.acquire()  # refused if the child still held the inherited lock
        other.release()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_record_naming_a_live_process_is_honoured(tmp_path: Path) -> None:
    """Where flock is not honoured (some network filesystems) the record still refuses:
    here a live process's record in a file nobody has flocked."""
    path = tmp_path / "x.lock"
    p = CTX.Process(target=time.sleep, args=(600,))
    p.start()
    try:
        me = this_process()
        proc = f"{me.proc.rpartition('/')[0]}/{Path(f'/proc/{p.pid}/stat').read_text().rpartition(')')[2].split()[19]}"
        path.write_text(
            json.dumps({"host": HOST, "pid": p.pid, "proc": proc, "since": 0, "role": ""})
        )
        with pytest.raises(RoleHeld, match=f"pid {p.pid} .*filesystem let us lock it too"):
            PathLock(path, "the thing").acquire()
        p.kill()
        p.join(60)
        lock = PathLock(path, "the thing")
        lock.acquire()  # the record's process is gone: taken over
        lock.release()
    finally:
        if p.is_alive():
            p.kill()
        p.join(60)


def test_processes_started_in_one_clock_tick_are_two_processes() -> None:
    """`proc` (boot id, pid namespace, start tick) is equal for processes a launcher
    starts within one tick: the pid tells them apart (the holder line said "this same
    process registered the role again" of another process)."""
    me = this_process()
    twin = Holder("active", 1, 0, time.time(), me.host, me.pid + 1, me.proc)
    assert not twin.is_process(me)
    assert Holder("active", 1, 0, time.time(), me.host, me.pid, me.proc).is_process(me)
    assert not Holder("active", 1, 0, time.time(), me.host, me.pid, "x/y/1").is_process(me)
    assert Holder("active", 1, 0, 0.0, me.host, me.pid, "").is_process(
        ProcessInfo(me.host, me.pid, "")
    )


def test_checkpoint_clean_up_never_removes_a_live_processs_temp_dir(tmp_path: Path) -> None:
    from fanout.bench.assets import tiny_qwen3_verifier
    from fanout.checkpoints.save import save_checkpoint
    from fanout.families.dflash.model import DFlashDraft
    from fanout.ops.adamw import make_optimizer

    live = CTX.Process(target=time.sleep, args=(600,))
    live.start()
    dead = CTX.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join(60)
    assert live.pid is not None and dead.pid is not None and pid_gone(dead.pid)
    try:
        save = tmp_path / "draft"
        theirs = save / f".tmp-checkpoint-00000002-{live.pid}"
        debris = save / f".tmp-checkpoint-00000002-{dead.pid}"
        for d in (theirs, debris):
            d.mkdir(parents=True)
            (d / "config.json").write_text("{}")
        vdir = tiny_qwen3_verifier(tmp_path / "verifier", 256, hidden_size=32, num_layers=4,
                                   head_dim=8, intermediate_size=64)  # fmt: skip
        draft = DFlashDraft.from_verifier(
            vdir, target_layer_ids=[1, 2], block_size=4, max_anchors=6, mask_token_id=255
        )
        opt, _ = make_optimizer(draft.parameters(), lr=1e-3)
        save_checkpoint(save, draft, opt, {"step": 1})
        assert (theirs / "config.json").is_file()  # a live writer's: untouched
        assert not debris.exists()  # an exited one's: removed
    finally:
        live.kill()
        live.join(60)
