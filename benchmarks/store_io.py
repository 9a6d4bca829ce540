"""Store I/O benchmark: publish and read of one window against raw file I/O.

    .venv/bin/python benchmarks/store_io.py                         # 256 MiB window, 3 reps
    .venv/bin/python benchmarks/store_io.py --size-mib 32 --reps 2 --json out.json

Same run, same bytes, one window in the window format of fanout.store.windowfile (the
bf16 hidden states of 4 captured layers, `hidden_states.<layer>` `[R, T, H]` each, plus
the int32/uint8 [R, T] tensors of DESIGN.md):

- publish_vs_raw = raw time / publish time, where raw = open + write the same
  tensor buffers + fsync + close, and publish = Store.publish (header, write,
  xxh3 checksum, fsync, link, unlink temp, fsync dir). Both go through the page
  cache and end with an fsync, so both pay the same writeback. Goal >= 0.9.
- read_vs_raw = raw time / read time, where raw = open + readinto a
  preallocated, already-touched buffer, and read = WindowReader (mmap, header
  validation, checksum over every byte) + every row's views built and touched.
  Page cache: warm for both (the file was just written; nothing is dropped, and
  a warm-up pass of each runs before timing). Goal >= 0.8.

Times are medians over --reps runs, alternating which goes first, with os.sync()
before each timed step; the spread is the min–max of the per-rep ratios. On a shared
machine expect noise: the JSON (benchmarks/record.py's format) keeps every rep.
`bench_publish` / `bench_read` / `rows` are importable (benchmarks/store_coordinator.py
combines them).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from fanout.store.store import RunDir, Store, WindowMeta, WindowReader
from fanout.store.windowfile import hidden_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Recorder, Row, spread  # sibling script

MiB = 1 << 20
PUBLISH_GOAL, READ_GOAL = 0.9, 0.8
T, H, LAYERS = 1024, 1024, (1, 9, 17, 25)  # 4 captured layers of H = 1024: 8 MiB/row in bf16


def make_tensors(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A window whose tensors total about `nbytes` (hidden_states dominates)."""
    per_row = T * H * 2 * len(LAYERS) + T * (4 * 4 + 1)  # hidden states + 4 int32 + 1 uint8
    rows = max(1, round(nbytes / per_row))
    g = torch.Generator().manual_seed(seed)
    ids = lambda: torch.randint(0, 151_000, (rows, T), generator=g, dtype=torch.int32)  # noqa: E731
    hidden = {hidden_name(k): torch.randn(rows, T, H, generator=g).bfloat16() for k in LAYERS}
    return {
        **hidden,  # [R, T, H] each
        "target_ids": ids(),  # [R, T]
        "input_ids": ids(),  # [R, T]
        "document_ids": ids(),  # [R, T]
        "position_ids": torch.arange(T, dtype=torch.int32).repeat(rows, 1),  # [R, T]
        "loss_mask": torch.ones(rows, T, dtype=torch.uint8),  # [R, T]
    }


def _meta(rows: int, window: int) -> WindowMeta:
    return WindowMeta(contract_hash="bench", window=window, generation=0, epoch=0,
                      row_start=window * rows, row_end=(window + 1) * rows)  # fmt: skip


def _raw_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors.values():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_publish(tmpdir: str | Path, nbytes: int, reps: int = 3) -> dict[str, Any]:
    """Median raw write+fsync vs Store.publish time for one ~nbytes window."""
    tensors = make_tensors(nbytes)
    rows = tensors["input_ids"].shape[0]
    store = Store(RunDir(Path(tmpdir) / "run_publish").create())
    raw_path = Path(tmpdir) / "raw_write.bin"
    raw_s: list[float] = []
    pub_s: list[float] = []
    size = 0
    for i in range(reps + 1):  # rep 0 is a warm-up (allocator, page cache, dir entries)
        # Alternate which goes first, and settle writeback/unlink work before each
        # timed step, so neither side pays for the other's leftovers.
        for which in ("raw", "publish") if i % 2 else ("publish", "raw"):
            os.sync()
            t0 = time.perf_counter()
            if which == "raw":
                _raw_write(raw_path, tensors)
            else:
                pub = store.publish(tensors, _meta(rows, i))
            dt = time.perf_counter() - t0
            if which == "raw":
                raw_path.unlink()
            else:
                size = pub.nbytes
                store.remove(pub.name)
            if i:
                (raw_s if which == "raw" else pub_s).append(dt)
    raw, publish = statistics.median(raw_s), statistics.median(pub_s)
    return {
        "file_bytes": size,
        "rows": rows,
        "raw_write_fsync_s": raw,
        "raw_write_fsync_s_all": raw_s,
        "publish_s_all": pub_s,
        "publish_s": publish,
        "raw_GBps": size / raw / 1e9,
        "publish_GBps": size / publish / 1e9,
        "publish_vs_raw": raw / publish,
        "publish_vs_raw_all": [r / p for r, p in zip(raw_s, pub_s)],
        "goal_publish_vs_raw": PUBLISH_GOAL,
    }


def bench_read(tmpdir: str | Path, nbytes: int, reps: int = 3) -> dict[str, Any]:
    """Median raw readinto vs (mmap + validate + checksum + touch every row) time."""
    tensors = make_tensors(nbytes, seed=1)
    rows = tensors["input_ids"].shape[0]
    store = Store(RunDir(Path(tmpdir) / "run_read").create())
    pub = store.publish(tensors, _meta(rows, 0))
    del tensors
    buf = bytearray(pub.nbytes)  # preallocated and touched: raw pays no page faults for it
    sink = 0

    def raw() -> None:
        with open(pub.path, "rb", buffering=0) as f:
            assert f.readinto(buf) == pub.nbytes

    def read() -> None:
        nonlocal sink
        with WindowReader(pub.path, verify=True) as r:
            for i in range(r.rows):
                for t in r.row(i).values():  # touch: first and last element of each row view
                    flat = t.reshape(-1)
                    sink += int(flat[0].item() != 0) + int(flat[-1].item() != 0)

    raw_s, read_s = [], []
    for i in range(reps + 1):  # rep 0 is a warm-up
        t0 = time.perf_counter()
        raw()
        t1 = time.perf_counter()
        read()
        t2 = time.perf_counter()
        if i:
            raw_s.append(t1 - t0)
            read_s.append(t2 - t1)
    store.remove(pub.name)
    r_raw, r_read = statistics.median(raw_s), statistics.median(read_s)
    return {
        "file_bytes": pub.nbytes,
        "rows": rows,
        "raw_read_s": r_raw,
        "raw_read_s_all": raw_s,
        "mmap_verify_touch_s_all": read_s,
        "mmap_verify_touch_s": r_read,
        "raw_GBps": pub.nbytes / r_raw / 1e9,
        "read_GBps": pub.nbytes / r_read / 1e9,
        "read_vs_raw": r_raw / r_read,
        "read_vs_raw_all": [r / x for r, x in zip(raw_s, read_s)],
        "goal_read_vs_raw": READ_GOAL,
        "page_cache": "warm (file just written, nothing dropped; warm-up pass before timing)",
    }


def bench_xxh3(nbytes: int) -> float:
    """xxh3-128 throughput over an in-memory buffer, GB/s (context for the ratios)."""
    data = os.urandom(nbytes)
    xxhash.xxh3_128(data).hexdigest()
    t0 = time.perf_counter()
    xxhash.xxh3_128(data).hexdigest()
    return nbytes / (time.perf_counter() - t0) / 1e9


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    p = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fstype, *_ = line.split()
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
            best, kind = mnt, fstype
    return f"{kind} ({best})"


def hardware(tmpdir: Path) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpu": cpu,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "ram_GiB": round(mem_kib / 2**20, 1),
        "filesystem": _fs_type(tmpdir),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "xxhash": xxhash.VERSION,
    }


def rows(pub: dict[str, Any], rd: dict[str, Any], reps: int) -> list[Row]:
    """The record's rows of one publish + read measurement."""
    size = f"{pub['file_bytes'] / MiB:.0f} MiB window ({pub['rows']} rows × {T} tokens × {len(LAYERS)} layers of {H} bf16), warm page cache"
    return [
        Row(stage="store", name="publish_vs_raw", what="publish vs raw write+fsync (time ratio)",
            result=pub["publish_vs_raw"], unit="×", spread=spread(pub["publish_vs_raw_all"]),
            n=reps, n_of="reps", goal=f">= {PUBLISH_GOAL}",
            met=pub["publish_vs_raw"] >= PUBLISH_GOAL,
            conditions=f"{size}; raw {pub['raw_GBps']:.2f} GB/s, publish {pub['publish_GBps']:.2f} GB/s"),
        Row(stage="store", name="read_vs_raw",
            what="read (mmap + checksum + touch rows) vs raw read (time ratio)",
            result=rd["read_vs_raw"], unit="×", spread=spread(rd["read_vs_raw_all"]), n=reps,
            n_of="reps", goal=f">= {READ_GOAL}", met=rd["read_vs_raw"] >= READ_GOAL,
            conditions=f"{size}; raw {rd['raw_GBps']:.2f} GB/s, read {rd['read_GBps']:.2f} GB/s"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="window size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median; default 3)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results as JSON")
    args = ap.parse_args(argv)
    rec = Recorder("store_io", argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fanout-store-io-") as d:
        hw = hardware(Path(d))
        nbytes = args.size_mib * MiB
        pub = bench_publish(d, nbytes, args.reps)
        rd = bench_read(d, nbytes, args.reps)
    xx = bench_xxh3(64 * MiB)
    print(
        f"store I/O — {hw['cpu']}, {hw['cpus_usable']} CPUs, {hw['ram_GiB']} GiB, fs {hw['filesystem']}"
    )
    print(f"window {pub['file_bytes'] / MiB:.1f} MiB ({pub['rows']} rows x {T} tok x "
          f"{len(LAYERS)} x {H} bf16), "
          f"median of {args.reps}; xxh3-128 {xx:.1f} GB/s")  # fmt: skip
    steps = [
        ("raw write+fsync", pub["raw_write_fsync_s"], pub["raw_GBps"], ""),
        ("publish", pub["publish_s"], pub["publish_GBps"],
         f"publish_vs_raw {pub['publish_vs_raw']:.2f} (goal >= 0.9)"),
        ("raw read (warm)", rd["raw_read_s"], rd["raw_GBps"], ""),
        ("mmap+verify+touch", rd["mmap_verify_touch_s"], rd["read_GBps"],
         f"read_vs_raw {rd['read_vs_raw']:.2f} (goal >= 0.8)"),
    ]  # fmt: skip
    print(f"{'step':<20}{'seconds':>10}{'GB/s':>8}  ratio")
    for name, s, gbps, note in steps:
        print(f"{name:<20}{s:>10.4f}{gbps:>8.2f}  {note}")
    out = {"hardware": hw, "size_mib": args.size_mib, "reps": args.reps,
           "xxh3_128_GBps": xx, "publish": pub, "read": rd}  # fmt: skip
    rec.write(args.json, rows(pub, rd, args.reps), raw=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
