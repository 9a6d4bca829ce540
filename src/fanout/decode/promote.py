"""Promote a better draft to serving, atomically: evaluate each new checkpoint against the served one, flip a symlink.

    fanout promote --draft drafts/b16 --served /srv/draft --verifier-name-or-path V \\
        --tokenizer V --data heldout.jsonl --num-prompts 32 --once      # cron: decide, exit
    fanout promote ... --poll-s 300                                    # watch for new ones
    fanout promote --served /srv/draft --rollback                       # back one version
    fanout promote --run-dir runs/live --draft drafts/b16 --served /srv/draft --once
        # a live run (fanout produce --follow): its held-out traffic is --data, its
        # verifier and tokenizer the defaults, and the served draft's τ on each newest
        # slice of it is recorded (drift)

The served directory (`--served DIR`) is what an engine is pointed at, through one link:

    DIR/current -> versions/v0003   # a complete speculators checkpoint (engines load this)
    DIR/versions/v0001 … v0003      # the last --keep-versions promoted ones
    DIR/promotions.jsonl            # one line per decision: both τ with intervals, n, step, time

A candidate is the newest committed checkpoint of `--draft` (a trainer's --save-path,
or one checkpoint directory). It is decoded against the served draft on the same
held-out prompts, the same seeds and temperatures, each as its server decodes it
(fanout.decode.eval's EvalSession: one session, both drafts, interleaved), and promoted
only when its τ at `--decide-temperature` is higher with the two 95% intervals apart
(fanout.decode.eval_table.tau_verdict, the rule `fanout eval` prints), or, with
`--margin M`, higher by at least M. Nothing served yet: the first candidate is measured
alone and promoted.

The floor (#52): a candidate whose τ is at most 1 + `--floor-epsilon` accepts (next to)
no draft token — a trainer that never trained, trained on another verifier, or a broken
checkpoint — and is never served, whatever it is compared with. That is said loudly: an
error line, `"floor": true` in its decision, with `--run-dir` in RUN_DIR/follow/promote.json
(`fanout status` shows it, /metrics as `fanout_promote_floor`), and `--once` exits 3.
`--run-dir R` also takes `--verifier-name-or-path` and `--tokenizer` from what R's
producer recorded (R/stream.json) unless they are given.

Promotion: the checkpoint's serving files (config.json, model.safetensors, the commit
marker, training_state.json, README.md; not the optimizer state) are copied into a new
`versions/vNNNN` directory that is renamed into place whole (FileSystem.commit_dir),
then `current` is flipped to it in one rename (FileSystem.point): an engine that
(re)loads `DIR/current` finds the old checkpoint or the new one, complete, never a
partial one, whenever this process is killed. A candidate its trainer pruned while it
was evaluated or copied (it keeps only its last few) is not promoted: a version lacking
config.json, model.safetensors or the commit marker is never made. `--rollback` flips
`current` back to the version before it, and sticks: the checkpoint it took off serving
(and any older step of the same `--draft`) is never promoted again, only a checkpoint of
a later step is a candidate. Every decision, and every rollback (naming the checkpoint
and step it took off serving), is one JSON line in `promotions.jsonl`.

Drift (`--run-dir R` of a `fanout produce --follow` run): each look also decodes the
served draft alone on the newest `--num-prompts` conversations of the run's held-out
traffic (RUN_DIR/follow/heldout.jsonl, which the producer keeps current) and appends
its τ with interval to RUN_DIR/follow/drift.jsonl; when the interval lies wholly below
the one the draft had when it was promoted, it says so (a warning line, `"below": true`
in the record, and `fanout status` shows it): the traffic has moved away from what the
draft learned.

A verifier in training (#52: `--verifier-name-or-path DIR` in the versioned layout that
`fanout produce --follow-verifier` follows): every look evaluates candidate and served
drafts against the policy's live version (`current_verifier`), and each decision and
drift record names it (`verifier_version`); the first drift look after the policy
changed re-measures the served draft and names both versions (`verifier_was`), with a
log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from fanout.checkpoints.format import read_config
from fanout.checkpoints.layout import MARKER, latest_checkpoint
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.versions import committed_versions, current_version, is_versioned
from fanout.decode.config import (
    CURRENT,
    DECISIONS,
    DRIFT,
    PROMOTE,
    VERSIONS,
    PromoteConfig,
    temperature_key,
)
from fanout.decode.eval import EvalSession
from fanout.decode.eval_table import tau_verdict
from fanout.errors import CheckpointError, ConfigError
from fanout.filesystem import FileSystem
from fanout.flags import add_model_flags, model_from_args
from fanout.netfs import temp_tag

log = logging.getLogger(__name__)

SERVED_FILES = ("config.json", "model.safetensors", MARKER, "training_state.json", "README.md")
REQUIRED = SERVED_FILES[:3]  # a version without them is not a checkpoint an engine loads
# Written into each version with its files: the checkpoint (and step) it was promoted
# from. A rollback reads it there, not from the decision log: a promoter's decision line
# is appended after its version went live, so a rollback run in between found no line
# and barred nothing (the half-hour soak: v0501 rolled back, its checkpoint not barred).
PROMOTED_FROM = "promoted_from.json"
FLOOR_EXIT = 3  # `--once` when the candidate is at the acceptance floor (1: bad input)


class Served:
    """A served directory (see the module docstring)."""

    def __init__(self, root: str | Path, fs: FileSystem | None = None) -> None:
        self.root = Path(root)
        self.fs = fs or FileSystem()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--served {self.root}: not a directory")
        if self.root.is_dir() and any(self.root.iterdir()) and not self._ours():
            raise ConfigError(
                f"--served {self.root}: holds something other than promoted checkpoints "
                f"(expected {CURRENT} -> {VERSIONS}/vNNNN and {DECISIONS}); give an empty "
                "or new directory"
            )

    def _ours(self) -> bool:
        names = {p.name for p in self.root.iterdir() if not p.name.startswith(".")}
        return names <= {CURRENT, VERSIONS, DECISIONS}

    def versions(self) -> list[Path]:
        """Promoted versions, oldest first (committed ones only: the layout's one reader,
        fanout.checkpoints.versions, which `produce --follow-verifier` reads too)."""
        return [v.path for v in committed_versions(self.root)]

    def current(self) -> Path | None:
        """The version `current` points at (None before the first promotion)."""
        v = current_version(self.root)
        return None if v is None else v.path.resolve()

    def promote(self, checkpoint: Path, keep: int) -> Path:
        """Copy `checkpoint`'s serving files into a new version, then flip `current`."""
        vs = self.versions()
        n = int(vs[-1].name[1:]) + 1 if vs else 1
        final = self.root / VERSIONS / f"v{n:04d}"
        tmp = final.with_name(f".{final.name}.tmp-{temp_tag()}")
        self.fs.makedirs(tmp)
        try:
            for name in SERVED_FILES:
                try:
                    shutil.copyfile(checkpoint / name, tmp / name)
                except FileNotFoundError:
                    # the trainer keeps its last few checkpoints: it may prune this one
                    # while it is evaluated or copied; never serve what is left of it
                    if name in REQUIRED:
                        raise CheckpointError(
                            f"{checkpoint}: its {name} went away while it was copied (its "
                            "trainer pruned it); not promoted"
                        ) from None
            origin = {"candidate": str(checkpoint.resolve()), "step": _step(checkpoint)}
            self.fs.write_new(tmp / PROMOTED_FROM, json.dumps(origin).encode())
            self.fs.commit_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.fs.point(self.root / CURRENT, f"{VERSIONS}/{final.name}")
        self._prune(keep)
        return final

    def rollback(self) -> tuple[Path, Path]:
        """Point `current` at the newest version before it that no earlier rollback took
        off serving (a second rollback never re-serves the first one's): (from, to)."""
        now = self.current()
        gone = {r.get("from") for r in _jsonl(self.root / DECISIONS) if r.get("rollback")}
        older = [
            v for v in self.versions()
            if now is not None and int(v.name[1:]) < int(now.name[1:]) and v.name not in gone
        ]  # fmt: skip
        if now is None or not older:
            raise ConfigError(f"--served {self.root}: no earlier version to roll back to")
        self.fs.point(self.root / CURRENT, f"{VERSIONS}/{older[-1].name}")
        return now, older[-1]

    def rollback_record(self, was: Path, now: Path) -> dict[str, Any]:
        """The decision line of a rollback from `was` to `now`: it names the checkpoint
        (and step) `was` was promoted from (its PROMOTED_FROM; the decision log's line
        for a version promoted before that file), so that `barred` keeps it off serving."""
        try:
            origin = json.loads((was / PROMOTED_FROM).read_text())
        except (OSError, ValueError):
            made = [d for d in _jsonl(self.root / DECISIONS)
                    if d.get("promoted") and d.get("version") == was.name]  # fmt: skip
            origin = {"candidate": made[-1].get("candidate"),
                      "step": made[-1].get("candidate_step")} if made else {}  # fmt: skip
        return {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rollback": True,
            "from": was.name, "to": now.name,
            "from_candidate": origin.get("candidate"), "from_step": origin.get("step"),
        }  # fmt: skip

    def barred(self, candidate: Path, step: int | None) -> str | None:
        """Why `candidate` (at training step `step`) may not be served, or None: a
        rollback took it, or a later step of the same save path, off serving."""
        cand = candidate.resolve()
        for r in _jsonl(self.root / DECISIONS):
            if not (r.get("rollback") and r.get("from_candidate")):
                continue  # a rollback older than this rule names no checkpoint
            was, was_step = Path(r["from_candidate"]), r.get("from_step")
            older = (was.parent == cand.parent and step is not None
                     and was_step is not None and step <= was_step)  # fmt: skip
            if cand == was or older:
                return (
                    f"{cand} (step {step}) is not served again: {r['from']} (step "
                    f"{was_step} of {was.parent}) was rolled back at {r['time']}; only a "
                    "checkpoint of a later step is a candidate"
                )
        return None

    def _prune(self, keep: int) -> None:
        """Keep the newest `keep` versions and whatever `current` points at."""
        now = self.current()
        for v in self.versions()[:-keep]:
            if v != now:
                shutil.rmtree(v, ignore_errors=True)

    def record(self, decision: dict[str, Any]) -> None:
        """Append one decision line (a line is written whole: one write of one line)."""
        self.fs.makedirs(self.root)
        with open(self.root / DECISIONS, "a") as f:
            f.write(json.dumps(decision) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _figures(report: dict[str, Any], name: str, t: float) -> dict[str, Any]:
    return dict(report["drafts"][name]["at_temperature"][temperature_key(t)])


def _step(checkpoint: Path) -> int | None:
    try:
        return int(json.loads((checkpoint / "training_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def current_verifier(cfg: PromoteConfig) -> tuple[PromoteConfig, str | None]:
    """`cfg` evaluating against the live version of a versioned --verifier-name-or-path
    (a policy in training), and that version's name; `cfg` and None for a plain model
    directory. ConfigError naming the flag while no version is committed."""
    root = Path(cfg.verifier_name_or_path)
    if not is_versioned(root):
        return cfg, None
    v = current_version(root)
    if v is None:
        raise ConfigError(
            f"--verifier-name-or-path {root}: no committed version yet (versions/vNNNN "
            "with its COMMITTED marker)"
        )
    return cfg.model_copy(update={"verifier_name_or_path": str(v.path)}), v.name


def decide(cfg: PromoteConfig, session: EvalSession | None = None) -> dict[str, Any]:
    """Evaluate the newest checkpoint of `--draft` against the served one, promote it if
    it wins, record the decision; return it (also printed by `run`)."""
    cfg, verifier_version = current_verifier(cfg)
    served = Served(cfg.served)
    candidate = latest_checkpoint(cfg.draft[0]) or Path(cfg.draft[0])
    read_config(candidate)  # CheckpointError naming it when it is not a checkpoint
    now = served.current()
    base: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "candidate": str(candidate.resolve()),
        "candidate_step": _step(candidate),
        "served": None if now is None else str(now),
        "temperature": cfg.decide_temperature,
        "verifier_version": verifier_version,
    }
    if now is not None and _same(candidate, now):
        return base | {"promoted": False, "why": "the candidate is what is served"}
    if (why := served.barred(candidate, base["candidate_step"])) is not None:
        decision = base | {"promoted": False, "why": why}
        served.record(decision)
        return decision
    vdir = Path(cfg.verifier_name_or_path)
    drafts = {"candidate": load_draft(candidate, vdir, device=cfg.device)}
    if now is not None:
        drafts["served"] = load_draft(now, vdir, device=cfg.device)
    layers = sorted({i for d in drafts.values() for i in d.cfg.target_layer_ids})
    ecfg = newest_slice(cfg)[0] if cfg.run_dir else cfg  # live: the newest held-out traffic
    session = session or EvalSession(ecfg, layers)
    report = session.run(drafts, dict.fromkeys(drafts))
    t = cfg.decide_temperature
    fc = _figures(report, "candidate", t)
    if now is None:  # measured alone all the same: a draft at the floor is never served
        decision = base | {
            "candidate_tau": fc["acceptance_length"],
            "candidate_ci95": fc["acceptance_length_ci95"], "prompts": report["prompts"],
            "lossless": report["lossless"], "why": "nothing served yet",
        }  # fmt: skip
        return _settle(served, candidate, cfg, decision, report["lossless"])
    fs_ = _figures(report, "served", t)
    tau_c, tau_s = fc["acceptance_length"], fs_["acceptance_length"]
    if cfg.margin is not None:
        win = tau_c >= tau_s + cfg.margin
        why = f"candidate τ {tau_c:.3f} vs served {tau_s:.3f}, margin {cfg.margin:g}"
    else:
        winner, why = tau_verdict("candidate", fc, "served", fs_)
        win = winner == "candidate"
    decision = base | {
        "candidate_tau": tau_c, "candidate_ci95": fc["acceptance_length_ci95"],
        "served_tau": tau_s, "served_ci95": fs_["acceptance_length_ci95"],
        "prompts": report["prompts"], "lossless": report["lossless"], "why": why,
    }  # fmt: skip
    return _settle(served, candidate, cfg, decision, win and report["lossless"])


def _settle(
    served: Served, candidate: Path, cfg: PromoteConfig, decision: dict[str, Any], win: bool
) -> dict[str, Any]:
    """Promote `candidate` if it `win`s, is lossless and is above the floor; record why."""
    if not decision["lossless"]:
        win = False  # never serve a draft whose decoding differed from greedy
        decision["why"] += "; speculative output differed from greedy: not promoted"
    tau = decision["candidate_tau"]
    decision["floor"] = tau <= 1.0 + cfg.floor_epsilon
    if decision["floor"]:  # its drafts are (next to) never accepted: untrained, or broken
        win = False
        decision["why"] += (
            f"; candidate τ {tau:.3f} is at the floor (<= 1 + {cfg.floor_epsilon:g}): its "
            "draft tokens are (next to) never accepted: not served"
        )
        log.error(
            "promote: %s is at the acceptance floor (τ %.3f on %d prompts): NOT served; "
            "is its trainer training (fanout status), on this verifier?",
            candidate, tau, decision["prompts"],
        )  # fmt: skip
    decision["promoted"] = win
    if win:
        return _promote(served, candidate, cfg, decision)
    served.record(decision)
    _say(cfg, decision)
    return decision


def _promote(
    served: Served, candidate: Path, cfg: PromoteConfig, decision: dict[str, Any]
) -> dict[str, Any]:
    """Serve `candidate` and record `decision` (not promoted after all when the candidate
    was pruned before it was copied whole)."""
    try:
        decision["version"] = served.promote(candidate, cfg.keep_versions).name
    except CheckpointError as e:
        decision |= {"promoted": False, "why": f"{decision['why']}; {e}"}
        log.warning("%s", e)
    served.record(decision)
    _say(cfg, decision)
    return decision


def _say(cfg: PromoteConfig, decision: dict[str, Any]) -> None:
    """A live run's newest decision, for `fanout status` and /metrics (--run-dir only):
    RUN_DIR/follow/promote.json, replaced whole."""
    if cfg.run_dir is None:
        return
    keep = ("time", "candidate", "candidate_step", "candidate_tau", "candidate_ci95",
            "served", "promoted", "floor", "why", "version")  # fmt: skip
    rec = {k: decision.get(k) for k in keep} | {"served_dir": str(Path(cfg.served).resolve())}
    fs = FileSystem()
    fs.makedirs(Path(cfg.run_dir) / "follow")
    fs.write_atomic(Path(cfg.run_dir) / "follow" / PROMOTE, (json.dumps(rec) + "\n").encode())


def drift(cfg: PromoteConfig) -> dict[str, Any] | None:
    """The served draft's τ on the newest --num-prompts held-out conversations of the
    live run, appended to RUN_DIR/follow/drift.jsonl; `below` when its interval lies
    under the one it was promoted with. None without --run-dir or a served draft."""
    served = Served(cfg.served)
    now = served.current()
    if cfg.run_dir is None or now is None:
        return None
    follow = Path(cfg.run_dir) / "follow"
    cfg, verifier_version = current_verifier(cfg)
    last = [d for d in _jsonl(follow / DRIFT) if d.get("served") == str(served.root.resolve())]
    verifier_was = last[-1].get("verifier_version") if last else None
    ecfg, seen = newest_slice(cfg)
    draft = load_draft(now, Path(cfg.verifier_name_or_path), device=cfg.device)
    session = EvalSession(ecfg, sorted(draft.cfg.target_layer_ids))
    report = session.run({"served": draft}, {"served": None})
    f = _figures(report, "served", cfg.decide_temperature)
    ci, was = f["acceptance_length_ci95"], _baseline(served, now, follow / DRIFT)
    below = bool(ci and was and ci[1] < was[0])
    rec = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": now.name,
        "served": str(served.root.resolve()),  # which served dir: status reads its current
        "tau": f["acceptance_length"], "ci95": ci, "prompts": report["prompts"],
        "heldout_seen": seen, "baseline_ci95": was, "below": below,
        "verifier_version": verifier_version, "verifier_was": verifier_was,
    }  # fmt: skip
    if verifier_was is not None and verifier_was != verifier_version:
        log.info(
            "drift: the verifier changed %s -> %s: the served draft %s re-measured, τ %.2f (%s)",
            verifier_was, verifier_version, now.name, rec["tau"], ci,
        )  # fmt: skip
    with open(follow / DRIFT, "a") as out:
        out.write(json.dumps(rec) + "\n")
    if below:
        log.warning(
            "drift: the served draft %s has τ %.2f (%s) on the newest %d held-out "
            "conversations, below the %s it was promoted with",
            now.name, rec["tau"], ci, rec["prompts"], was,
        )  # fmt: skip
    return rec


def newest_slice(cfg: PromoteConfig) -> tuple[PromoteConfig, int]:
    """`cfg` decoding the newest --num-prompts conversations of --data (the live run's
    held-out traffic grows at its end), and how many the file holds."""
    held = [x for x in Path(cfg.data).read_text().splitlines() if x.strip()]
    out = Path(cfg.run_dir or Path(cfg.data).parent) / "follow" / ".newest-heldout.jsonl"
    fs = FileSystem()
    fs.makedirs(out.parent)
    # whole or not at all: a second promoter may read it while this one writes
    fs.write_atomic(out, "".join(x + "\n" for x in held[-cfg.num_prompts :]).encode())
    return cfg.model_copy(update={"data": str(out)}), len(held)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _baseline(served: Served, version: Path, drift_log: Path) -> list[float] | None:
    """The τ interval `version` is held to: the one it won its promotion with, else its
    first drift record's (the first version of a served dir is promoted unmeasured)."""
    won = [d["candidate_ci95"] for d in _jsonl(served.root / DECISIONS)
           if d.get("promoted") and d.get("version") == version.name and d.get("candidate_ci95")]  # fmt: skip
    if won:
        return list(won[-1])
    first = [
        d["ci95"] for d in _jsonl(drift_log) if d.get("version") == version.name and d.get("ci95")
    ]
    return list(first[0]) if first else None


def _same(a: Path, b: Path) -> bool:
    """Is checkpoint `a` the served version `b` (same weights file bytes size and config)?"""
    try:
        return (a / "config.json").read_bytes() == (b / "config.json").read_bytes() and (
            a / "model.safetensors"
        ).read_bytes() == (b / "model.safetensors").read_bytes()
    except OSError:
        return False


def add_arguments(p: argparse.ArgumentParser, name: str = "promote") -> None:
    add_model_flags(p, PromoteConfig)


def run(args: argparse.Namespace, name: str = "promote") -> int:
    if getattr(args, "rollback", False):  # needs only --served
        if not getattr(args, "served", None):
            raise ConfigError("--rollback: give --served DIR")
        served = Served(args.served)
        was, now = served.rollback()
        served.record(served.rollback_record(was, now))
        print(f"fanout promote: {args.served}/current: {was.name} -> {now.name}")
        return 0
    cfg = model_from_args(PromoteConfig, args)
    Served(cfg.served)  # refuses a directory that is not ours before anything loads
    seen: Path | None = None
    floor: dict[str, Any] | None = None  # --once: this look's decision, at the floor
    while True:
        newest = latest_checkpoint(cfg.draft[0])
        if newest is None and not (Path(cfg.draft[0]) / MARKER).is_file():
            if cfg.once:
                raise CheckpointError(f"--draft {cfg.draft[0]}: no committed checkpoint yet")
        elif newest != seen or seen is None:
            try:
                decision = decide(cfg)
                print(json.dumps(decision), flush=True)
                floor = decision if decision.get("floor") else None
            except (CheckpointError, OSError) as e:
                if newest is None or newest.exists():
                    raise
                log.warning("%s was pruned by its trainer while it was evaluated (%s); "
                            "the next checkpoint is", newest, e)  # fmt: skip
            seen = newest
        if cfg.run_dir is not None and (d := drift(cfg)) is not None:
            print(json.dumps({"drift": d}), flush=True)
        if cfg.once:
            if floor is not None:  # a cron job's exit status says it (#52)
                print(f"fanout promote: {floor['candidate']} is at the acceptance floor "
                      f"(τ {floor['candidate_tau']:.3f}): not served", file=sys.stderr)  # fmt: skip
                return FLOOR_EXIT
            return 0
        try:
            time.sleep(cfg.poll_s)
        except KeyboardInterrupt:
            print("fanout promote: stopped", file=sys.stderr)
            return 0
