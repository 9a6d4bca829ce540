"""Window artifacts: format round trip, corruption detection, the publish protocol
under injected I/O errors and kill -9, quarantine/eviction and the sweeper.

    .venv/bin/pytest tests/test_store.py -x -q
    .venv/bin/pytest tests/test_store.py -x -q -m root     # real ENOSPC on a tmpfs (root)
"""

from __future__ import annotations

import errno
import itertools
import multiprocessing
import os
import random
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from fanout.errors import CorruptWindow, StorageError, StorageFull
from fanout.filesystem import FaultyFileSystem, FileSystem
from fanout.store.store import (
    Published,
    RunDir,
    Store,
    WindowMeta,
    WindowReader,
    parse_window_name,
    verify_file,
    window_name,
)
from fanout.store.windowfile import TENSOR_CHECKSUM, hidden_name
from window_files import window_names

CONTRACT = "c0ffee" * 4


LAYERS = (1, 9, 17)


def make_window(
    rows: int = 4, t: int = 16, h: int = 8, layers: tuple[int, ...] = LAYERS, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The DESIGN row tensors, random, small: one hidden-state tensor per captured layer."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda: torch.randint(0, 151_000, (rows, t), generator=g, dtype=torch.int32)  # noqa: E731
    return {
        **{hidden_name(i): torch.randn(rows, t, h, generator=g).bfloat16() for i in layers},
        "last_hidden_states": torch.randn(rows, t, h, generator=g).bfloat16(),  # [R, T, H]
        "target_ids": ids(),  # [R, T]
        "input_ids": ids(),  # [R, T]
        "loss_mask": torch.randint(0, 2, (rows, t), generator=g, dtype=torch.uint8),  # [R, T]
        "document_ids": ids(),  # [R, T]
        "position_ids": torch.arange(t, dtype=torch.int32).repeat(rows, 1),  # [R, T]
    }


def make_meta(
    window: int = 3, generation: int = 0, rows: int = 4, contract: str = CONTRACT
) -> WindowMeta:
    return WindowMeta(
        contract_hash=contract,
        window=window,
        generation=generation,
        epoch=1,
        row_start=window * rows,
        row_end=(window + 1) * rows,
    )


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run").create()


def _assert_same(reader: WindowReader, tensors: dict[str, torch.Tensor]) -> None:
    assert sorted(reader.names()) == sorted(tensors)
    for k, v in tensors.items():
        got = reader.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got, v), k


def _listing(run: RunDir) -> tuple[list[str], list[str]]:
    return sorted(os.listdir(run.windows)), sorted(os.listdir(run.tmp))


# -- format ----------------------------------------------------------------------


def test_round_trip_tensors_and_metadata(run: RunDir) -> None:
    tensors, meta = make_window(), make_meta()
    pub = Store(run, chunk_bytes=256).publish(tensors, meta)
    assert pub.name == "00000003.g0.safetensors" and pub.path == run.windows / pub.name
    assert pub.nbytes == pub.path.stat().st_size
    assert pub.path.stat().st_mode & 0o777 == 0o644
    assert _listing(run) == ([pub.name], [])
    with Store(run).open(pub.name, expect_contract=CONTRACT, expect_window=3) as r:
        assert r.meta == WindowMeta(**{**meta.__dict__, "checksum": pub.checksum})
        assert r.rows == 4 and r.nbytes == pub.nbytes
        _assert_same(r, tensors)
        row2 = r.row(2)
        for k, v in tensors.items():
            assert torch.equal(row2[k], v[2]), k
        with pytest.raises(IndexError):
            r.row(4)
        with pytest.raises(KeyError):
            r.get("nope")
    # Reference reader: safetensors itself reads the same tensors and metadata.
    with safe_open(str(pub.path), framework="pt") as f:
        md = f.metadata()
        sums = {k: md.pop(k) for k in list(md) if k.startswith(TENSOR_CHECKSUM)}
        assert md == r.meta.to_metadata()
        assert sums == {TENSOR_CHECKSUM + k: v for k, v in r.checksums.items()}
        assert set(r.checksums) == set(tensors)
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k


@given(
    dtypes=st.lists(
        st.sampled_from(
            [
                torch.bfloat16,
                torch.float16,
                torch.float32,
                torch.float64,
                torch.int64,
                torch.int32,
                torch.int16,
                torch.uint8,
                torch.int8,
                torch.bool,
            ]
        ),
        min_size=1,
        max_size=5,
    ),
    rows=st.integers(1, 5),
    inner=st.lists(st.integers(0, 7), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_round_trip_random_dtypes_shapes(
    tmp_path_factory: pytest.TempPathFactory,
    dtypes: list[torch.dtype],
    rows: int,
    inner: list[int],
    seed: int,
) -> None:
    run = RunDir(tmp_path_factory.mktemp("h")).create()
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}": (torch.randn(rows, *inner, generator=g) * 100).to(dt)
        for i, dt in enumerate(dtypes)
    }
    pub = Store(run, chunk_bytes=7).publish(tensors, make_meta(rows=rows))
    with WindowReader(pub.path) as r:
        _assert_same(r, tensors)
    with safe_open(str(pub.path), framework="pt") as f:
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k


def test_reader_matches_safetensors_writer(run: RunDir) -> None:
    """Our header parser against the reference writer's layout (its own ordering and
    padding); its file has no valid checksum, so verify=True must refuse it."""
    tensors, meta = make_window(), make_meta()
    path = run.windows / window_name(3, 0)
    md = {**meta.to_metadata(), "checksum": "xxh3_128:" + "0" * 32}
    save_file(tensors, str(path), metadata=md)
    with Store(run).open(path.name, verify=False) as r:
        _assert_same(r, tensors)
    with pytest.raises(CorruptWindow, match="checksum mismatch"):
        verify_file(path)
    save_file(tensors, str(path), metadata=None)
    with pytest.raises(CorruptWindow, match="__metadata__"):
        verify_file(path)


def test_tensors_outlive_reader_and_writes_stay_private(run: RunDir) -> None:
    tensors = make_window()
    pub = Store(run).publish(tensors, make_meta())
    with Store(run).open(pub.name) as r:
        h = r.get(hidden_name(9))
        ids = r.row(1)["input_ids"]
    h[0].fill_(7.0)  # copy-on-write mapping: the file must not change
    ids.zero_()
    assert torch.equal(h[1:], tensors[hidden_name(9)][1:])
    assert verify_file(pub.path).checksum == pub.checksum


def test_window_names() -> None:
    assert window_name(42, 3) == "00000042.g3.safetensors"
    assert parse_window_name("00000042.g3.safetensors") == (42, 3)
    assert parse_window_name(window_name(123_456_789, 0)) == (123_456_789, 0)
    for bad in (
        "42.g3.safetensors",
        "00000042.g03.safetensors",
        "00000042.g3.safetensors.tmp",
        "coordinator.sqlite3",
        "00000042.safetensors",
        "x00000042.g3.safetensors",
    ):
        assert parse_window_name(bad) is None, bad
    with pytest.raises(ValueError):
        window_name(-1, 0)


@given(w=st.integers(0, 10**12), g=st.integers(0, 10**6))
def test_window_name_round_trip(w: int, g: int) -> None:
    assert parse_window_name(window_name(w, g)) == (w, g)


def test_meta_validation() -> None:
    with pytest.raises(ValueError, match="row_end"):
        WindowMeta(contract_hash="c", window=0, generation=0, epoch=0, row_start=4, row_end=4)
    with pytest.raises(ValueError, match="window"):
        WindowMeta(contract_hash="c", window=-1, generation=0, epoch=0, row_start=0, row_end=4)
    with pytest.raises(ValueError, match="contract_hash"):
        WindowMeta(contract_hash="", window=0, generation=0, epoch=0, row_start=0, row_end=4)
    m = make_meta()
    assert WindowMeta.from_metadata(m.to_metadata()) == m
    with pytest.raises(ValueError, match="epoch"):
        WindowMeta.from_metadata({**m.to_metadata(), "epoch": "+1"})


def test_publish_rejects_bad_tensors(run: RunDir) -> None:
    store = Store(run)
    good = make_window()
    cases = {
        "first dim": {**good, "input_ids": good["input_ids"][:3]},
        "contiguous": {**good, "input_ids": good["input_ids"].t()},
        "no tensors": {},
        "not a torch.Tensor": {**good, "x": [1, 2]},
        "invalid tensor name": {**good, "__metadata__": good["input_ids"]},
        "cannot be stored": {**good, "c": torch.zeros(4, 2, dtype=torch.complex64)},
    }
    for match, tensors in cases.items():
        with pytest.raises(ValueError, match=match):
            store.publish(tensors, make_meta())  # type: ignore[arg-type]
    assert _listing(run) == ([], [])


# -- corruption --------------------------------------------------------------------


def _published(run: RunDir) -> tuple[Published, bytes, int]:
    pub = Store(run).publish(make_window(), make_meta())
    raw = pub.path.read_bytes()
    return pub, raw, 8 + int.from_bytes(raw[:8], "little")


def test_every_single_bit_flip_in_header_is_caught(run: RunDir) -> None:
    pub, raw, data_start = _published(run)
    rng = random.Random(0)
    for pos in range(data_start):  # every byte of length prefix + header
        bad = bytearray(raw)
        bad[pos] ^= 1 << rng.randrange(8)
        pub.path.write_bytes(bad)
        with pytest.raises(CorruptWindow):
            verify_file(pub.path)
    pub.path.write_bytes(raw)
    assert verify_file(pub.path).checksum == pub.checksum


def test_data_bit_flips_are_caught(run: RunDir) -> None:
    pub, raw, data_start = _published(run)
    rng = random.Random(1)
    positions = [data_start, len(raw) - 1, *rng.sample(range(data_start, len(raw)), 200)]
    for pos in positions:
        bad = bytearray(raw)
        bad[pos] ^= 1 << rng.randrange(8)
        pub.path.write_bytes(bad)
        with pytest.raises(CorruptWindow, match="checksum mismatch"):
            Store(run).open(pub.name)
        with Store(run).open(pub.name, verify=False) as r:  # opt-out really skips the hash
            assert r.rows == 4


def test_truncation_and_padding_are_caught(run: RunDir) -> None:
    pub, raw, data_start = _published(run)
    for n in (0, 3, 8, data_start // 2, data_start, data_start + 1, len(raw) // 2, len(raw) - 1):
        pub.path.write_bytes(raw[:n])
        with pytest.raises(CorruptWindow):
            verify_file(pub.path)
        with pytest.raises(CorruptWindow):  # even without the checksum pass
            Store(run).open(pub.name, verify=False)
    pub.path.write_bytes(raw + b"\0")
    with pytest.raises(CorruptWindow, match="truncated or padded"):
        verify_file(pub.path)


def test_wrong_contract_window_generation_or_missing(run: RunDir) -> None:
    store = Store(run)
    pub = store.publish(make_window(), make_meta(window=3, generation=2))
    with pytest.raises(CorruptWindow, match="contract hash"):
        store.open(pub.name, expect_contract="another")
    with pytest.raises(CorruptWindow, match="expected 4"):
        store.open(pub.name, expect_window=4)
    # A valid file under another window's / generation's name is not that window.
    for other in (window_name(4, 2), window_name(3, 1)):
        os.link(pub.path, run.windows / other)
        with pytest.raises(CorruptWindow, match="expected"):
            store.open(other)
    with pytest.raises(CorruptWindow, match="missing"):
        store.open(window_name(9, 0))
    with pytest.raises(CorruptWindow, match="not a window file name"):
        store.open("coordinator.sqlite3")


def test_quarantine_and_remove(run: RunDir) -> None:
    store = Store(run)
    a = store.publish(make_window(), make_meta(window=1))
    b = store.publish(make_window(), make_meta(window=2))
    q = store.quarantine(a.name)
    assert q.parent == run.quarantine and q.name.startswith(a.name) and q.exists()
    assert not a.path.exists()
    assert not store.quarantine(a.name).exists()  # already gone: fine, nothing moved
    assert window_names(store) == [b.name]
    assert store.remove(b.name) is True
    assert store.remove(b.name) is False
    assert window_names(store) == []


# -- publish under I/O errors --------------------------------------------------------


def _count_calls(run: RunDir, chunk: int) -> int:
    fs = FaultyFileSystem(fail_at=10**9)
    Store(run, fs, chunk_bytes=chunk).publish(make_window(), make_meta(window=0))
    Store(run).sweep(lambda w, g: False)
    return fs.calls


@pytest.mark.parametrize("errno_", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("persistent", [False, True])
def test_publish_under_injected_errors(run: RunDir, errno_: int, persistent: bool) -> None:
    """Fail call N (once, or from N on) for N = 1.. until a publish completes."""
    chunk = 512
    clean_calls = _count_calls(run, chunk)
    assert clean_calls >= 8  # open, several writes, pwrite, fsync, close, link, unlink, fsync_dir
    tensors = make_window()
    for n in range(1, 200):
        fs = FaultyFileSystem(fail_at=n, errno_=errno_, persistent=persistent)
        try:
            pub = Store(run, fs, chunk_bytes=chunk).publish(tensors, make_meta())
        except StorageError as e:
            assert isinstance(e, StorageFull) == (errno_ == errno.ENOSPC), e
            assert "00000003.g0.safetensors" in str(e)
            assert fs.failures >= 1
            finals, tmps = _listing(run)
            if not persistent:
                # Cleanup worked (the fault was spent): nothing final-named, no temp.
                assert (finals, tmps) == ([], []), (n, fs.log)
            else:
                # Cleanup itself failed; what is left is either debris or a complete file.
                for f in finals:
                    verify_file(run.windows / f)
                Store(run).sweep(lambda w, g: False)
                assert _listing(run) == ([], [])
            continue
        assert n == clean_calls + 1  # every earlier call number was a failing attempt
        assert fs.failures == 0
        with WindowReader(pub.path) as r:
            _assert_same(r, tensors)
        assert _listing(run) == ([pub.name], [])
        break
    else:
        pytest.fail("publish never completed")


@pytest.mark.parametrize("ops", [{"write"}, {"write", "pwrite"}, {"fsync"}])
def test_persistent_enospc_on_writes_leaves_nothing(run: RunDir, ops: set[str]) -> None:
    """Realistic ENOSPC: data writes fail, unlink still works → strict cleanup."""
    for n in (1, 2, 5):
        fs = FaultyFileSystem(fail_at=n, errno_=errno.ENOSPC, persistent=True, ops=ops)
        with pytest.raises(StorageFull):
            Store(run, fs, chunk_bytes=256).publish(make_window(), make_meta())
        assert _listing(run) == ([], [])
        if ops == {"fsync"}:
            # An fsync failure aborts the window; fsync is never retried.
            assert [op for op, _ in fs.log].count("fsync") == 1
            break


def test_existing_final_file_is_never_overwritten(run: RunDir) -> None:
    store = Store(run)
    first = store.publish(make_window(seed=1), make_meta())
    with pytest.raises(StorageError, match="already exists"):
        store.publish(make_window(seed=2), make_meta())
    assert _listing(run) == ([first.name], [])
    assert verify_file(first.path).checksum == first.checksum


# -- kill -9 in the middle of publish -------------------------------------------------


class _KillingFileSystem(FileSystem):
    """SIGKILLs its own process right before (or after) call number `at`."""

    def __init__(self, at: int, after: bool) -> None:
        self.at, self.after, self.n = at, after, 0

    def _before(self, op: str, arg: object) -> None:
        self.n += 1
        if self.n == self.at and not self.after:
            os.kill(os.getpid(), signal.SIGKILL)

    def _after(self, op: str, arg: object) -> None:
        if self.n == self.at and self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def _publish_and_die(root: str, at: int, after: bool) -> None:
    Store(RunDir(Path(root)), _KillingFileSystem(at, after), chunk_bytes=512).publish(
        make_window(), make_meta()
    )
    os._exit(3)  # not killed: the parent reports it


def test_kill9_during_publish_leaves_only_valid_files(run: RunDir) -> None:
    calls = _count_calls(run, 512)
    ctx = multiprocessing.get_context("fork")  # cheap: the child inherits torch
    reference = make_window()
    for at in range(1, calls + 1):
        for after in (False, True):
            p = ctx.Process(target=_publish_and_die, args=(str(run.root), at, after))
            p.start()
            p.join(60)
            assert p.exitcode == -signal.SIGKILL, (at, after, p.exitcode)
            finals, tmps = _listing(run)
            for f in finals:  # anything final-named is complete and valid
                with WindowReader(run.windows / f) as r:
                    _assert_same(r, reference)
            # After the link, the final file must exist; before it, it must not.
            linked = at > calls - 2 or (at == calls - 2 and after)
            assert bool(finals) == linked, (at, after, finals)
            report = Store(run).sweep(lambda w, g: False)  # the dead producer's window is not live
            assert sorted(report.tmp_removed) == tmps
            assert _listing(run) == ([], [])


# -- sweeper --------------------------------------------------------------------------


def _populate(run: RunDir) -> dict[str, list[str]]:
    store = Store(run)
    live = [store.publish(make_window(), make_meta(window=w)).name for w in (5, 6)]
    orphans = [store.publish(make_window(), make_meta(window=w, generation=1)).name for w in (1, 6)]
    tmp_dead = [f"{window_name(2, 0)}.123-abcd.tmp", f"{window_name(6, 1)}.77-ffff.tmp"]
    tmp_live = [f"{window_name(5, 0)}.9-0000.tmp"]
    junk = ["garbage", "x.tmp"]
    for n in tmp_dead + tmp_live + junk:
        (run.tmp / n).write_bytes(b"partial")
    keep_root = ["coordinator.sqlite3", "coordinator.sqlite3-wal", "coordinator.sqlite3-shm"]
    for n in keep_root:
        (run.root / n).write_bytes(b"db")
    (run.windows / "notes.txt").write_bytes(b"not ours")
    (run.windows / "coordinator.sqlite3").write_bytes(b"misplaced db")
    (run.tmp / "other.sqlite3-wal").write_bytes(b"misplaced wal")
    return {
        "live": live,
        "orphans": orphans,
        "tmp_dead": tmp_dead + junk,
        "tmp_live": tmp_live,
        "root": keep_root,
    }


def _is_live(w: int, g: int) -> bool:
    return (w, g) in {(5, 0), (6, 0)}


def test_sweep_removes_debris_and_orphans_keeps_live(run: RunDir) -> None:
    files = _populate(run)
    report = Store(run).sweep(_is_live)
    assert sorted(report.orphans_removed) == sorted(files["orphans"])
    assert sorted(report.tmp_removed) == sorted(files["tmp_dead"])
    assert report.kept == 2 and report.removed == 6
    finals, tmps = _listing(run)
    assert finals == sorted([*files["live"], "coordinator.sqlite3", "notes.txt"])
    assert tmps == sorted([*files["tmp_live"], "other.sqlite3-wal"])
    for n in files["root"]:
        assert (run.root / n).read_bytes() == b"db"
    again = Store(run).sweep(_is_live)  # idempotent
    assert again.removed == 0 and again.kept == 2
    assert _listing(run) == (finals, tmps)


def test_two_concurrent_sweepers(run: RunDir) -> None:
    names = [window_name(w, 1) for w in range(300)]
    for n in names:
        (run.windows / n).write_bytes(b"orphan")
        (run.tmp / f"{n}.1-0000.tmp").write_bytes(b"debris")
    barrier, reports, errors = threading.Barrier(2), [], []

    def sweep() -> None:
        barrier.wait()
        try:
            reports.append(Store(run).sweep(lambda w, g: False))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    removed = [n for r in reports for n in r.orphans_removed]
    assert sorted(removed) == sorted(names)  # each file removed once, by exactly one sweeper
    assert sum(len(r.tmp_removed) for r in reports) == len(names)
    assert _listing(run) == ([], [])


def test_sweep_skips_file_another_sweeper_removed_first(run: RunDir) -> None:
    """Deterministic version of the race: the file vanishes between listing and unlink."""

    class RacingFS(FileSystem):
        def _before(self, op: str, arg: object) -> None:
            if op == "unlink":
                os.unlink(str(arg))  # the other sweeper wins

    files = _populate(run)
    report = Store(run, RacingFS()).sweep(_is_live)
    assert report.removed == 0
    assert _listing(run)[0] == sorted([*files["live"], "coordinator.sqlite3", "notes.txt"])


# -- real ENOSPC on a small tmpfs ------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.root
def test_real_enospc_on_tmpfs(tiny_tmpfs: Path) -> None:
    run = RunDir(tiny_tmpfs / "run").create()
    store = Store(run, chunk_bytes=64 << 10)
    tensors = make_window(rows=4, t=256, h=128, layers=(1, 2))  # ~0.6 MiB
    filler = tiny_tmpfs / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (700 << 10))
    with pytest.raises(StorageFull, match=r"00000003\.g0"):
        store.publish(tensors, make_meta())
    assert _listing(run) == ([], [])
    filler.unlink()  # space freed: the same publish now works
    pub = store.publish(tensors, make_meta())
    with WindowReader(pub.path) as r:
        _assert_same(r, tensors)


def test_publish_starts_writeback_behind_the_writes(run: RunDir) -> None:
    """A window of at least `writeback_bytes` hands every written chunk to
    start_writeback (exact ranges, contiguous, in order, before the fsync); a smaller
    window gets no hint at all."""

    class Recording(FileSystem):
        def __init__(self) -> None:
            self.ops: list[str] = []
            self.ranges: list[tuple[int, int]] = []

        def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
            self.ranges.append((offset, nbytes))
            super().start_writeback(fd, offset, nbytes)

        def _before(self, op: str, arg: object) -> None:
            self.ops.append(op)

    fs = Recording()
    store = Store(run, fs, chunk_bytes=1000, writeback_bytes=2500)
    tensors = {"x": torch.arange(3000, dtype=torch.int32).view(4, 750), "y": torch.ones(4, 3)}
    pub = store.publish(tensors, make_meta())  # data: 12,000 + 48 bytes in 1000-byte chunks
    data = 12_048
    header = pub.nbytes - data
    assert fs.ranges[0][0] == header
    assert [n for _, n in fs.ranges] == [1000] * 12 + [48]
    for (o1, n1), (o2, _) in itertools.pairwise(fs.ranges):
        assert o2 == o1 + n1  # contiguous, in order
    last_hint = max(i for i, op in enumerate(fs.ops) if op == "start_writeback")
    assert fs.ops.index("fsync") > last_hint
    small = Recording()
    Store(run, small).publish(tensors, make_meta(window=4))  # default: 16 MiB per hint
    assert small.ranges == [] and "fsync" in small.ops
    with store.open(pub.name) as r:
        _assert_same(r, tensors)


def test_start_writeback_is_a_hint_that_never_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fanout.filesystem as filesystem

    monkeypatch.setattr(filesystem, "_SYNC_FILE_RANGE", filesystem._SYNC_FILE_RANGE)
    fs = FileSystem()
    fd = fs.open_new(tmp_path / "f")
    fs.write(fd, b"x" * 8192)
    fs.start_writeback(fd, 0, 8192)  # real call (or a no-op off Linux)
    fs.close(fd)
    fs.start_writeback(fd, 0, 8192)  # a closed fd: the call fails, quietly
    assert filesystem._SYNC_FILE_RANGE is None  # ...and is not asked again
    fs.start_writeback(fd, 0, 8192)
