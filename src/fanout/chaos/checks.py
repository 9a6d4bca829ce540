"""What a chaos run must show: in-order covers, whole files, bounded live windows, clean end.

    from fanout.chaos.checks import check_cover
    from fanout.train.trainlog import read_train_log
    cover = check_cover(read_train_log(Path("drafts/c0")), total_windows=115)
    assert not cover.errors

`Sampler` watches a run while it happens (coordinator snapshot as `fanout status
--json` prints it; every new final-named window file fully verified and digested);
`final_state` reads the database once everything stopped; `ChaosReport.problems()`
lists every broken promise: among them, more than K live windows at any sample
(K is the bound, the slowest consumer's slot inside it), and a window captured
more than once (files of distinct generations seen) beyond what the run counted
(recaptures, and claims of lost or replaced producer replicas made again).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fanout.coord.states import LIVE, RoleState
from fanout.store.rundir import RunDir

# ---------------------------------------------------------------- checks


@dataclass
class Cover:
    """What check_cover found in one consumer's log."""

    windows: int = 0  # distinct windows trained on
    records: int = 0
    restarts: int = 0  # incarnation boundaries visible in the log (step went back)
    repeated_steps: int = 0  # steps logged again after a restart
    errors: list[str] = field(default_factory=list)


def check_cover(records: list[dict[str, Any]], total_windows: int) -> Cover:
    """In-order cover: the windows of successive steps never go back or skip one,
    except that after a restart (step number ≤ the previous one) the trainer replays
    from its checkpoint — the same windows at the same step numbers as before — and
    the union is exactly windows 0 .. total_windows-1."""
    c = Cover(records=len(records))
    by_step: dict[int, list[int]] = {}
    seen: set[int] = set()
    prev_step, prev_hi = 0, -1
    for i, r in enumerate(records):
        step, ws = int(r["step"]), [int(w) for w in r["windows"]]
        where = f"record {i + 1} (step {step}, windows {ws})"
        if ws != sorted(ws) or not ws or ws[-1] - ws[0] != len(ws) - 1:
            c.errors.append(f"{where}: windows of one step are not consecutive")
        if step != prev_step + 1:
            if step > prev_step + 1 or step < 1:
                c.errors.append(f"{where}: step jumped from {prev_step}")
            c.restarts += 1
        elif ws[0] < prev_hi:
            c.errors.append(f"{where}: went back from window {prev_hi} without a restart")
        if ws[0] > prev_hi + 1 and step != 1:
            c.errors.append(f"{where}: skipped windows after {prev_hi}")
        if step == 1 and ws[0] != 0:
            c.errors.append(f"{where}: the first step does not start at window 0")
        if step in by_step:
            c.repeated_steps += 1
            if by_step[step] != ws:
                c.errors.append(f"{where}: replayed step had windows {by_step[step]} before")
        by_step[step] = ws
        seen.update(ws)
        prev_step, prev_hi = step, ws[-1]
    missing = sorted(set(range(total_windows)) - seen)
    extra = sorted(seen - set(range(total_windows)))
    if missing:
        c.errors.append(
            f"windows never trained on: {missing[:20]}{' …' if len(missing) > 20 else ''}"
        )
    if extra:
        c.errors.append(f"windows beyond the stream: {extra[:20]}")
    c.windows = len(seen)
    return c


def window_digest(path: Path) -> tuple[int, int, str]:
    """(window, generation, hash of every tensor's name and bytes) of a fully verified
    window file. Raises CorruptWindow for a partial or damaged file."""
    import torch

    from fanout.hashing import hasher
    from fanout.store.store import WindowReader

    with WindowReader(path, verify=True) as r:
        h = hasher()
        for n in sorted(r.names()):
            h.update(n.encode())
            h.update(r.get(n).contiguous().view(torch.uint8).numpy().tobytes())
        return r.meta.window, r.meta.generation, h.hexdigest()


class Sampler:
    """Samples the coordinator and windows/ of one run while chaos happens."""

    def __init__(self, run_dir: Path, k: int, db_path: str | None = None) -> None:
        self.run_dir, self.k, self.db_path = run_dir, k, db_path
        self.co: Any = None
        self.samples = 0
        self.max_live = 0  # ready + capturing + evicting rows (the capacity rule's count)
        self.max_ready = 0
        self.max_files = 0  # final-named files, debris of killed publishes included
        self.over_k = 0  # samples with more than K live windows (a broken promise)
        self.verified: dict[str, tuple[int, int, str]] = {}  # file name -> (w, g, digest)
        self.bad_files: list[str] = []
        self.digest_by_window: dict[int, str] = {}
        self.digest_mismatch: list[str] = []

    def _open(self) -> Any:
        if self.co is None:
            from fanout.coord.coordinator import Coordinator
            from fanout.errors import ConfigError, CoordinatorUnavailable, SchemaVersionError

            try:  # None while the producer has not created it (the coordinator says so)
                self.co = Coordinator.open_if_created(self.run_dir, db_path=self.db_path)
            except (ConfigError, SchemaVersionError, CoordinatorUnavailable):
                return None  # half-made: its pointer or contract not written yet
        return self.co

    def sample(self) -> None:
        from fanout.errors import CorruptWindow
        from fanout.status.snapshot import snapshot

        co = self._open()
        if co is not None:
            s = snapshot(co)
            w = s["windows"]
            live = sum(w[state] for state in LIVE)
            self.samples += 1
            self.max_live, self.max_ready = (
                max(self.max_live, live),
                max(self.max_ready, w["ready"]),
            )
            self.over_k += live > self.k
        wdir = RunDir(self.run_dir).windows
        names = [n for n in os.listdir(wdir) if n.endswith(".safetensors")] if wdir.is_dir() else []
        self.max_files = max(self.max_files, len(names))
        for n in names:
            if n in self.verified:
                continue
            try:
                wgd = window_digest(wdir / n)
            except FileNotFoundError:
                continue  # evicted between listdir and open
            except CorruptWindow as e:
                if (wdir / n).exists():  # still there under its final name: a real failure
                    self.bad_files.append(f"{n}: {e.reason}")
                continue
            self.verified[n] = wgd
            first = self.digest_by_window.setdefault(wgd[0], wgd[2])
            if first != wgd[2]:
                self.digest_mismatch.append(
                    f"window {wgd[0]} g{wgd[1]} differs from its first capture"
                )

    def close(self) -> None:
        if self.co is not None:
            self.co.close()
            self.co = None


def final_state(run_dir: Path, db_path: str | None = None) -> dict[str, Any]:
    """The coordinator's audit after a run (Coordinator.audit: integrity check, leases
    left, consumer states, counters; the same on SQLite and PostgreSQL) and the debris
    left in windows/ and tmp/."""
    from fanout.coord.coordinator import Coordinator
    from fanout.errors import ConfigError

    try:
        co = Coordinator.open(run_dir, db_path=db_path)
    except ConfigError as e:
        return {"integrity_check": f"no database: {e}"}
    rd = RunDir(run_dir)
    try:
        return {
            **co.audit(),
            "files_left": sorted(os.listdir(rd.windows)),
            "tmp_left": sorted(os.listdir(rd.tmp)),
        }
    finally:
        co.close()


@dataclass
class ChaosReport:
    config: dict[str, Any]
    elapsed_s: float = 0.0
    killing_s: float = 0.0  # seconds from the start until the kill goal was met (or the end)
    kills: dict[str, int] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, list[int]] = field(default_factory=dict)
    total_windows: int = 0
    rows_checked: int = 0
    covers: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = 0
    cli_samples: int = 0
    max_live: int = 0
    max_ready: int = 0
    max_files: int = 0
    over_k_samples: int = 0
    files_verified: int = 0  # distinct (window, generation) files seen, each verified whole
    windows_seen: int = 0  # distinct windows among them
    bad_files: list[str] = field(default_factory=list)
    digest_mismatch: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def problems(self) -> list[str]:
        """Every broken promise; empty when the run kept them all."""
        k, m = self.config["max_live_windows"], self.config.get("replicas", 1)
        out = [f"{c}: {e}" for c, cov in self.covers.items() for e in cov["errors"]]
        out += [f"partial/corrupt file under a final name: {b}" for b in self.bad_files]
        out += self.digest_mismatch
        if not self.total_windows:
            out.append("no stream.json: the producer never started the run")
        if self.timed_out:
            out.append(f"timed out after {self.elapsed_s:.0f} s")
        if self.max_live > k or self.over_k_samples:
            out.append(f"live windows {self.max_live} exceed K={k} ({self.over_k_samples} samples)")
        if self.max_files > k + m:  # a killed replica's publish may leave one file, swept later
            out.append(f"window files {self.max_files} exceed K + replicas = {k + m}")
        f = self.final
        counted = sum(f.get("counters", {}).get(c, 0) for c in ("recaptures", "claims_reclaimed"))
        if self.files_verified - self.windows_seen > counted:
            out.append(
                f"{self.files_verified - self.windows_seen} windows captured again beyond the "
                f"{counted} the run counted (recaptures + claims_reclaimed)"
            )
        if f.get("integrity_check") != "ok":
            out.append(f"integrity_check: {f.get('integrity_check')}")
        if f.get("leases_left"):
            out.append(f"{f['leases_left']} leases left at the end")
        if any(s != RoleState.FINISHED for s in f.get("consumers", {}).values()):
            out.append(f"consumers not finished: {f.get('consumers')}")
        if f.get("failed_windows"):
            out.append(f"{f['failed_windows']} windows failed")
        if f.get("files_left") or f.get("tmp_left"):
            out.append(f"debris after sweep: {f.get('files_left')} {f.get('tmp_left')}")
        return out
