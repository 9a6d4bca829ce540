"""Helpers of tests/test_chaos.py: coordinator peeks, file surgery, bad input, argv.

from chaos_helpers import flip_tensor_byte, bad_file, produce_argv
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from pathlib import Path
from typing import Any

from fanout.chaos import ChaosAssets, ChaosRun


def ready(run: ChaosRun) -> int:
    co = run.sampler._open()
    if co is None:
        return 0
    return int(co.conn.execute("SELECT COUNT(*) FROM windows WHERE state='ready'").fetchone()[0])


def next_window(run: ChaosRun) -> int:
    co = run.sampler._open()
    return 0 if co is None else int(co.meta("next_window"))


def tree(d: Path) -> dict[str, bytes]:
    """Every file under d (bytes), to prove a failed command touched nothing."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def flip_tensor_byte(path: Path) -> None:
    """Flip one bit in the middle of the tensor data (past the safetensors header)."""
    with path.open("r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        size = path.stat().st_size
        at = 8 + header + (size - 8 - header) // 2
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


def max_gap_during(records: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Longest time between consecutive steps of one consumer that overlaps [t0, t1]."""
    times = [float(r["time"]) for r in records]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > t0 and a < t1]
    return max(gaps, default=0.0)


def produce_argv(run: Path, a: ChaosAssets, data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "produce", "--no-progress", "--run-dir", str(run), "--verifier-name-or-path",
        str(a.verifier), "--tokenizer", str(a.tokenizer), "--data", str(data), "--seq-len",
        "64", "--window-rows", "2", "--max-live-windows", "4", "--capture-layer-ids", "1", "2",
        "--workers", "1", "--cache-dir", str(cache), "--device", "cpu", *extra,
    ]  # fmt: skip


def bad_file(path: Path) -> Path:
    """Lines 1-3 good, 4 bad JSON, 5 no messages field, 6 empty content, 7 a
    conversation 10× seq_len long, 8 good."""
    rows = [
        json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                 {"role": "assistant", "content": " ".join(map(str, range(1, i + 1)))}]})
        for i in range(2, 6)
    ]  # fmt: skip
    long_text = " ".join(f"word{i}" for i in range(400))  # ≫ 640 tokens
    lines = [
        *rows[:3],
        '{"messages": [{"role": "user", "content": "unterminated"',
        json.dumps({"conversation_id": 7}),
        json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": long_text}]}),
        rows[3],
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def db_rows(run: Path) -> list[Any]:
    conn = sqlite3.connect(run / "coordinator.sqlite3")
    try:
        return [
            conn.execute("SELECT * FROM windows ORDER BY window").fetchall(),
            conn.execute("SELECT key, value FROM meta ORDER BY key").fetchall(),
            conn.execute("SELECT key, value FROM counters ORDER BY key").fetchall(),
            conn.execute("SELECT id, cursor, state FROM consumers").fetchall(),
        ]
    finally:
        conn.close()


def db_cursor(run: ChaosRun) -> int:
    co = run.sampler._open()
    return int(co.conn.execute("SELECT cursor FROM consumers WHERE id='c0:dp0'").fetchone()[0])
