"""RL co-training: a draft following a verifier in training vs the same draft frozen at its first version.

    .venv/bin/python benchmarks/rl_follow.py --json benchmarks/results/rl_follow.json  # ≈ 9 min, 2 loaded cores (+3 the 1st time)
    .venv/bin/python benchmarks/rl_follow.py --versions 8 --every-s 60 --records 320   # more versions, more traffic

Run from the repository root. Issue #52 item 5, end to end on CPU, in one run:

1. The policy: the demo's tiny Qwen3 (fanout.bench.assets, cached under --work/assets) is
   v0001 of a versioned directory (fanout.checkpoints.versions: versions/vNNNN, COMMITTED
   written last, then `current` flipped). The RL side fine-tunes it toward a shifted chat
   set (the same tasks, every answer opened by a preamble and closed by a closing line:
   `shift`), --policy-steps AdamW steps a version (one optimizer throughout), committing
   the next version every --every-s seconds, --versions in all.
2. Traffic: after each commit the current version answers fresh prompts of the same
   generator (another seed; `fanout regenerate` with that version, every assistant turn,
   greedy unless --temperature), --first-records for v0001 then --records a version,
   appended to a JSONL log at --records-per-s.
3. `fanout produce --follow LOG --follow-verifier --verifier-name-or-path POLICY` and
   `fanout train --verifier-name-or-path POLICY --max-verifier-lag N` (one block-8 DFlash
   draft) run on it.
4. The freeze: once v0001's traffic is read and trained on (the trainer's steps stood
   still --settle-s), its newest checkpoint is copied aside: the frozen draft.
5. The end: the last traffic read and trained on, the trainer is stopped (its final
   checkpoint: the followed draft). Both are decoded against the newest version on
   --eval-prompts prompts never appended (T = 0, the served rule,
   fanout.decode.eval.EvalSession): τ (mean accepted length, the verifier's own token
   counted) with its 95% interval, and followed / frozen (goal ≥ 1.3) with the bounds
   both intervals give it; the frozen draft also against v0001, its own version.
   The same-steps control (benchmarks/rl_follow_control.py; --no-same-steps: none): the
   frozen draft stopped at the freeze, the followed one trained on for as many steps
   again, so that ratio mixes following with more steps; the same draft trained from its
   start on v0001's traffic alone, captured with v0001, for the followed draft's steps
   exactly, is decoded beside them: followed / same-steps is the gain at equal steps.
6. Swap latency per version: the flip of `current` → the producer's `verifier version …
   loaded` log line (every window after it is captured with it), goal ≤ one window's
   capture + publish (the producer's mean) + that load; and → the first window file
   whose metadata names the version (this also waits for traffic to fill a window).
7. Disk: bytes under the run dir every --disk-every-s, by part, beside the log's; flat:
   the stream's files (the run dir less windows/, bounded by K, and the SQLite WAL,
   bounded by the coordinator's checkpoints) peak over the run's second half ≤ 1.1 × over
   its first, while the log keeps growing.

`--json OUT` writes the record (benchmarks/record.py); raw: each version (commit, load,
latencies, policy loss), each eval, the disk samples, steps per version, sizes, load.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import torch

from fanout.bench.assets import AssetSettings, ensure_demo_assets, generate_corpus, write_jsonl
from fanout.checkpoints.layout import MARKER
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.versions import CURRENT, VERSIONS, version_name
from fanout.coord import reads
from fanout.coord.coordinator import Coordinator
from fanout.decode.config import EvalConfig
from fanout.decode.eval import EvalSession
from fanout.filesystem import FileSystem
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.regen.regenerate import RegenerateConfig, regenerate
from fanout.store.windowfile import parse_window_name
from fanout.train.config import TrainConfig
from fanout.train.trainlog import read_train_log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from drift import append, latest, lines_of, settled, start, step_of, stop  # noqa: E402
from record import Recorder, Row  # noqa: E402  (sibling scripts)
from rl_follow_control import control_row, same_steps  # noqa: E402

GOAL = 1.3  # τ of the followed draft over the frozen one's, against the newest version
FLAT = 1.1  # the run dir's peak, second half of the run over first half
PREAMBLE, CLOSING = "Let me think step by step.", "That is my final answer."
LOADED = re.compile(r"^(\S+ \S+) .*verifier version (v\d+) -> (v\d+) loaded in ([\d.]+) s")
DONE = re.compile(r"producer done: (\{.*\})")


# ---- the policy and its traffic -------------------------------------------------------


def shift(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shifted chat set: every answer opened by PREAMBLE and closed by CLOSING."""
    out = []
    for c in convs:
        msgs = [dict(m) for m in c["messages"]]
        for m in msgs:
            if m["role"] == "assistant":
                m["content"] = f"{PREAMBLE} {m['content']} {CLOSING}"
        out.append({"messages": msgs})
    return out


class Policy:
    """The RL side: the verifier in training, fine-tuned in steps toward the shifted set
    and committed as versioned directory `root`'s next version."""

    def __init__(self, root: Path, base: Path, tokenizer: Path, a: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.root, self.batch, self.number = root, a.policy_batch, 0
        self.model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        ids: list[int] = []
        for c in shift(generate_corpus(a.shift_conversations, seed=a.seed + 3)):
            ids += cast("list[int]", tok.apply_chat_template(c["messages"], return_dict=False))
        n = len(ids) // a.policy_seq_len
        self.rows = torch.tensor(ids[: n * a.policy_seq_len]).view(n, a.policy_seq_len)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.policy_lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(a.seed)

    def train(self, steps: int) -> float:
        """`steps` optimizer steps on the shifted set; the mean loss of the last few."""
        self.model.train()
        losses = []
        for _ in range(steps):
            b = self.rows[torch.randint(len(self.rows), (self.batch,), generator=self.gen)]
            loss = self.model(input_ids=b, labels=b).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            losses.append(loss.item())
        self.model.eval()
        return statistics.fmean(losses[-5:]) if losses else float("nan")

    def commit(self) -> tuple[Path, float]:
        """Write the next version (its marker last), then flip `current` to it: the
        version's directory and the wall time of the flip (it is live from then on)."""
        self.number += 1
        d = self.root / VERSIONS / version_name(self.number)
        self.model.save_pretrained(d)
        (d / MARKER).write_text("")
        FileSystem().point(self.root / CURRENT, f"{VERSIONS}/{d.name}")
        return d, time.time()


def traffic(version: Path, prompts: list[dict[str, Any]], tag: str, a: argparse.Namespace,
            tokenizer: Path) -> list[str]:  # fmt: skip
    """`prompts` answered by `version` (every assistant turn): the records to append."""
    work = Path(a.work) / "live"
    src = write_jsonl(work / "prompts" / f"{tag}.jsonl", prompts)
    rsum = regenerate(RegenerateConfig(
        verifier_name_or_path=str(version), tokenizer=str(tokenizer), data=[str(src)],
        out=str(work / "regen" / tag), device="cpu", turns="all", seed=a.seed,
        max_new_tokens=a.max_new_tokens, regen_batch_size=16, temperature=a.temperature,
        progress=False, keep_truncated=True,
    ))  # fmt: skip
    return lines_of(Path(rsum["out"]))


# ---- what the run is watched for ------------------------------------------------------


def du(path: Path) -> dict[str, int]:
    """Bytes of the files under `path` by its top-level entry (a file removed while
    listed counts 0)."""
    out: dict[str, int] = {}
    for d, _, files in os.walk(path):
        top = Path(d).relative_to(path).parts[:1]
        for f in files:
            with contextlib.suppress(OSError):
                n = os.lstat(os.path.join(d, f)).st_size
                out[top[0] if top else f] = out.get(top[0] if top else f, 0) + n
    return out


class Watcher(threading.Thread):
    """Each window file as it appears (the version in its metadata, its mtime: when it
    was published) and, every `disk_every_s`, the bytes under the run dir and of the log."""

    def __init__(self, run: Path, log: Path, disk_every_s: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.log, self.every = run, log, disk_every_s
        self.windows: dict[tuple[int, int], tuple[int | None, float]] = {}
        self.disk: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def look(self) -> None:
        from safetensors import safe_open

        wdir = self.run_dir / "windows"
        for p in sorted(wdir.iterdir()) if wdir.is_dir() else []:
            key = parse_window_name(p.name)
            if key is None or key in self.windows:
                continue
            with contextlib.suppress(Exception):  # evicted between the listing and here
                mtime = p.stat().st_mtime
                with safe_open(str(p), "pt") as f:
                    v = (f.metadata() or {}).get("verifier_version")
                self.windows[key] = (None if v is None else int(v), mtime)

    def sample(self) -> None:
        log = self.log.stat().st_size if self.log.is_file() else 0
        parts = du(self.run_dir)
        run, windows = sum(parts.values()), parts.get("windows", 0)
        wal = sum(n for k, n in parts.items() if k.endswith(("-wal", "-shm")))
        self.disk.append({"t": time.time(), "run": run, "windows": windows, "wal": wal,
                          "stream": run - windows - wal, "log": log, "parts": parts})  # fmt: skip

    def run(self) -> None:
        last = 0.0
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                self.look()
                if time.monotonic() - last >= self.every:
                    last = time.monotonic()
                    self.sample()
            time.sleep(0.25)


def wait_for(pred: Any, timeout: float, what: str, procs: dict[str, Any]) -> Any:
    """Poll `pred` until truthy; exit naming the role that died, or the wait that ran out."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        for name, (p, log) in procs.items():
            if p.poll() not in (None, 0):
                raise SystemExit(f"rl_follow: {name} exited {p.returncode} waiting for {what}:\n"
                                 + log.read_text()[-3000:])  # fmt: skip
        if time.monotonic() > end:
            raise SystemExit(f"rl_follow: no {what} after {timeout:.0f} s")
        time.sleep(0.25)
    return got


def records_read(run: Path) -> int:
    """Records the producer has read from the log (its newest committed chunk's count)."""
    with contextlib.suppress(Exception), Coordinator.open(run) as co:  # not created yet
        return int((co.follow_position() or {}).get("records", 0))
    return 0


def swaps(log: Path) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """The producer log's swaps (version -> wall time of the line, load seconds) and its
    final summary (capture and publish seconds, windows)."""
    out, summary = {}, {}
    for line in log.read_text(errors="replace").splitlines():
        if m := LOADED.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out[m.group(3)] = {"loaded_at": at, "load_s": float(m.group(4))}
        elif m := DONE.search(line):
            with contextlib.suppress(ValueError, SyntaxError):
                summary = ast.literal_eval(m.group(1))
    return out, summary


# ---- the run ---------------------------------------------------------------------------


def live(a: argparse.Namespace, assets: Any) -> dict[str, Any]:
    work = Path(a.work) / "live"
    shutil.rmtree(work, ignore_errors=True)
    policy_dir, run, save = work / "policy", work / "run", work / "drafts" / "d"
    frozen, logs, log = work / "frozen", work / "logs", work / "src" / "rollouts.jsonl"
    for d in (logs, log.parent):
        d.mkdir(parents=True)
    log.touch()
    tok = assets.tokenizer_dir
    policy = Policy(policy_dir, assets.verifier_dir, tok, a)
    pool = generate_corpus(a.first_records + a.records * (a.versions - 1), seed=a.seed + 1)
    v1, t1 = policy.commit()
    versions: list[dict[str, Any]] = [{"version": v1.name, "committed_at": t1, "policy_loss": None}]
    first = traffic(v1, pool[: a.first_records], v1.name, a, tok)
    pcfg = {
        "run_dir": str(run), "verifier_name_or_path": str(policy_dir), "follow_verifier": True,
        "tokenizer": str(tok), "follow": str(log), "follow_flush_s": 2.0,
        "follow_chunk_records": a.chunk_records, "follow_keep_windows": a.keep_windows,
        "seq_len": a.seq_len, "window_rows": a.window_rows, "num_draft_layers": 1,
        "max_live_windows": a.k, "expected_consumers": 1, "workers": 1, "progress": False,
        "device": "cpu",  # prepared rows in RUN_DIR/cache: retired with their chunks
    }  # fmt: skip
    tcfg = {
        "run_dir": str(run), "consumer_id": "d", "verifier_name_or_path": str(policy_dir),
        "save_path": str(save), "mask_token_id": assets.mask_token_id, "block_size": 8,
        "max_anchors": 16, "lr": a.lr, "scheduler_type": "constant", "warmup_ratio": 0.05,
        "rows_per_step": 1, "checkpoint_every": a.checkpoint_every, "checkpoint_every_s": 20.0,
        "keep_checkpoints": 3, "max_verifier_lag": a.max_verifier_lag, "progress": False,
        "seed": a.seed,
    }  # fmt: skip
    cli = [sys.executable, "-m", "fanout.cli"]
    procs: dict[str, Any] = {}
    prod = start([*cli, "produce", *to_flags(ProducerConfig, pcfg)], logs / "producer.log")
    procs["producer"] = (prod, logs / "producer.log")
    watcher = Watcher(run, log, a.disk_every_s)
    t0 = time.time()
    writer = threading.Thread(target=append, args=(log, first, a.records_per_s), daemon=True)
    writer.start()
    appended = len(first)
    try:
        wait_for(lambda: (run / "stream.json").is_file(), 600, "stream.json", procs)
        watcher.start()
        trainer = start([*cli, "train", *to_flags(TrainConfig, tcfg)], logs / "trainer.log")
        procs["trainer"] = (trainer, logs / "trainer.log")
        writer.join()
        # the freeze: the first version's traffic read, the trainer's steps standing still
        caught = lambda: records_read(run) >= appended and settled(save, a.settle_s)  # noqa: E731
        wait_for(lambda: caught() and latest(save), a.catch_up_s,
                 "the first version's traffic trained on", procs)  # fmt: skip
        ck = latest(save)
        assert ck is not None
        shutil.copytree(ck, frozen)
        freeze = {"at_s": round(time.time() - t0, 1), "frozen_step": step_of(ck),
                  "steps": len(read_train_log(save))}  # fmt: skip
        print(f"freeze at {freeze['at_s']} s: frozen step {freeze['frozen_step']} of "
              f"{freeze['steps']}; {a.versions - 1} versions next", flush=True)  # fmt: skip
        for k in range(2, a.versions + 1):
            due = time.monotonic() + a.every_s
            loss = policy.train(a.policy_steps)
            vk, tk = policy.commit()
            versions.append({"version": vk.name, "committed_at": tk, "policy_loss": loss})
            lo = a.first_records + (k - 2) * a.records
            recs = traffic(vk, pool[lo : lo + a.records], vk.name, a, tok)
            writer.join()  # the previous version's traffic first: the log stays in order
            writer = threading.Thread(target=append, args=(log, recs, a.records_per_s),
                                      daemon=True)  # fmt: skip
            writer.start()
            appended += len(recs)
            print(f"  {vk.name} committed at {tk - t0:.0f} s (policy loss {loss:.2f}); "
                  f"{len(recs)} records", flush=True)  # fmt: skip
            while time.monotonic() < due and k < a.versions:
                wait_for(lambda: True, 1, "", procs)
                time.sleep(0.5)
        writer.join()
        wait_for(caught, a.catch_up_s, "the last traffic trained on", procs)
        stop(trainer)  # its final checkpoint: the followed draft
        with Coordinator.open(run) as co:
            skipped = sum(reads.lag_skipped(co.conn).values())
    finally:
        watcher.stop.set()
        for _, (p, _) in procs.items():
            stop(p)
    watcher.look()
    watcher.sample()
    return {"policy": policy_dir, "frozen": frozen, "followed": latest(save), "t0": t0,
            "freeze": freeze, "versions": versions, "windows": watcher.windows,
            "disk": watcher.disk, "producer_log": logs / "producer.log", "save": save,
            "appended": appended, "lag_skipped": skipped, "first": first, "pcfg": pcfg,
            "tcfg": tcfg}  # fmt: skip


def tau(vdir: Path, drafts: dict[str, Path], prompts: Path, a: argparse.Namespace) -> dict:
    """τ of each draft against verifier `vdir`, on the same prompts (T = 0)."""
    cfg = EvalConfig(verifier_name_or_path=str(vdir), tokenizer=str(a.tokenizer),
                     data=str(prompts), draft=[str(p) for p in drafts.values()],
                     num_prompts=a.eval_prompts, max_new_tokens=a.eval_new_tokens,
                     temperature=[0.0], sampled_draft=False)  # fmt: skip
    loaded = {k: load_draft(p, vdir) for k, p in drafts.items()}
    layers = sorted(next(iter(loaded.values())).cfg.target_layer_ids)
    rep = EvalSession(cfg, layers).run(loaded, dict.fromkeys(loaded))
    out: dict[str, Any] = {"verifier": vdir.name, "prompts": rep["prompts"],
                           "lossless": rep["lossless"]}  # fmt: skip
    for k in loaded:
        d = rep["drafts"][k]
        out[k] = {"tau": d["acceptance_length"], "ci95": d["acceptance_length_ci95"]}
    return out


# ---- report ----------------------------------------------------------------------------


def latencies(lv: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per version after the first: commit → loaded by the producer, → its first window,
    and the bound (one window's capture + publish, the producer's mean, + the load)."""
    loaded, summary = swaps(lv["producer_log"])
    n = int(summary.get("windows") or 0)
    per_window = (summary["capture_s"] + summary["publish_s"]) / n if n else None
    out = []
    for v in lv["versions"][1:]:
        num = int(v["version"][1:])
        got = loaded.get(v["version"])
        firsts = [t for ver, t in lv["windows"].values() if ver == num]
        row: dict[str, Any] = {"version": v["version"], "policy_loss": v["policy_loss"]}
        if got is not None:
            row |= {"load_s": got["load_s"],
                    "to_loaded_s": round(got["loaded_at"] - v["committed_at"], 3)}  # fmt: skip
            if per_window is not None:
                row["bound_s"] = round(per_window + got["load_s"], 3)
        if firsts:
            row["to_first_window_s"] = round(min(firsts) - v["committed_at"], 3)
        out.append(row)
    return out, {"windows": n, "capture_publish_s_per_window": per_window}


def disk(lv: dict[str, Any]) -> dict[str, Any]:
    """Peaks over the second half of the run over those over its first: of the run dir,
    and of what the stream leaves in it (less windows/, which K bounds, and the SQLite
    WAL, which the coordinator's checkpoints bound); the log's growth over the same."""
    s = lv["disk"]
    if len(s) < 4:
        return {"samples": len(s)}
    mid = (s[0]["t"] + s[-1]["t"]) / 2
    halves = [x for x in s if x["t"] <= mid], [x for x in s if x["t"] > mid]
    peak = {k: [max(x[k] for x in h) for h in halves] for k in ("run", "stream", "wal")}
    log_mid = max(x["log"] for x in halves[0])
    return {"samples": len(s), "span_s": round(s[-1]["t"] - s[0]["t"], 1), "peaks": peak,
            "flat_ratio": peak["stream"][1] / max(1, peak["stream"][0]),
            "run_ratio": peak["run"][1] / max(1, peak["run"][0]),
            "log_bytes": [log_mid, s[-1]["log"]], "log_growth": s[-1]["log"] / max(1, log_mid)}  # fmt: skip


def steps_by_version(save: Path) -> dict[str, int]:
    n = Counter(r.get("verifier_version") for r in read_train_log(save))
    return {"none" if v is None else version_name(int(v)): k for v, k in sorted(n.items(), key=str)}


def summary(res: dict[str, Any], a: argparse.Namespace, rows: list[Row]) -> list[str]:
    """The table: hardware and sizes, each version's swap, then every row of the record."""
    nan = float("nan")
    lines = [
        f"hardware: {res['hardware']}; load (1 min) {res['load_avg_1m'][0]:.1f} → "
        f"{res['load_avg_1m'][1]:.1f}; torch {torch.__version__}",
        f"sizes: verifier h64 × 6 layers, vocab {a.vocab_size}; {a.versions} versions × "
        f"{a.policy_steps} policy steps, every {a.every_s:g} s; traffic {a.first_records} + "
        f"{a.records} records a version at {a.records_per_s:g}/s; {res['steps']} DFlash b8 "
        f"steps {res['steps_by_version']}, frozen at {res['freeze']['frozen_step']}; "
        f"{res['lag_skipped']} windows skipped as too old",
        f"{'version':>8} {'policy loss':>12} {'load s':>7} {'→ loaded s':>11} {'bound s':>8} "
        f"{'→ 1st window s':>15}",
    ]  # fmt: skip
    for r in res["swaps"]:
        lines.append(f"{r['version']:>8} {r['policy_loss']:>12.3f} {r.get('load_s', nan):>7.2f} "
                     f"{r.get('to_loaded_s', nan):>11.2f} {r.get('bound_s', nan):>8.2f} "
                     f"{r.get('to_first_window_s', nan):>15.2f}")  # fmt: skip
    for w in rows:
        spread = f" [{w.spread[0]:.3g}, {w.spread[1]:.3g}]" if w.spread else ""
        goal = f"; goal {w.goal}: {'met' if w.met else 'NOT met'}" if w.goal else ""
        lines.append(f"{w.what}: {w.result:.3f}{w.unit}{spread} (n = {w.n} {w.n_of}{goal})")
    return lines


def record_rows(res: dict[str, Any], a: argparse.Namespace) -> list[Row]:
    e, f, d = res["eval_newest"], res.get("eval_first"), res["disk"]
    size = (f"verifier h64×6 (vocab {a.vocab_size}) fine-tuned toward answers in a preamble "
            f"and a closing line, {a.versions} versions × {a.policy_steps} steps every "
            f"{a.every_s:g} s; {res['appended']} records of its own answers; {res['steps']} "
            f"DFlash b8 steps, frozen at step {res['freeze']['frozen_step']}; T = 0, "
            f"{e['prompts']} prompts × {a.eval_new_tokens} tokens")  # fmt: skip
    b = res["tau_ratio_bounds"]
    rows = [
        Row(stage="eval", name="tau_ratio_rl_follow",
            what="RL co-training: τ against the newest verifier version, draft trained with "
            "--follow-verifier ÷ the same draft frozen at the first version",
            result=round(res["tau_ratio"], 4), unit="×",
            spread=(round(b[0], 4), round(b[1], 4)) if b else None,
            spread_kind="bounds from both 95% CIs", n=e["prompts"], n_of="prompts",
            goal=f">= {GOAL}", met=res["tau_ratio"] >= GOAL, conditions=size),
    ]  # fmt: skip
    if res.get("same_steps"):  # the control trained as long as the followed draft
        rows.append(control_row(e, res["same_steps"], GOAL, size))
    taus = [("tau_followed_newest", e, "followed", "against the newest version, the draft "
             "trained with --follow-verifier"),
            ("tau_frozen_newest", e, "frozen", "against the newest version, the draft frozen "
             "at the first version"),
            ("tau_frozen_first", f, "frozen", "of the frozen draft against its own, first version")]  # fmt: skip
    if "same_steps" in e:
        taus.insert(2, ("tau_same_steps_newest", e, "same_steps", "against the newest version, "
                        "the draft trained as many steps on the first version's traffic alone"))  # fmt: skip
    for name, ev, k, what in taus if f else taus[:-1]:
        t = ev[k]
        rows.append(Row(stage="eval", name=name, what=f"RL co-training: τ {what}", result=t["tau"],
                        spread=tuple(t["ci95"]) if t["ci95"] else None, spread_kind="95% CI",
                        n=ev["prompts"], n_of="prompts", conditions=f"{ev['verifier']}; {size}"))  # fmt: skip
    lat = [r for r in res["swaps"] if "to_loaded_s" in r]
    if lat:
        worst = max(lat, key=lambda r: r["to_loaded_s"] - r.get("bound_s", float("inf")))
        met = all("bound_s" in r and r["to_loaded_s"] <= r["bound_s"] for r in lat)
        xs = [r["to_loaded_s"] for r in lat]
        rows.append(Row(stage="producer", name="version_swap_s",
                        what="RL co-training: verifier version swap, `current` flipped → the "
                        "producer's next window captured with it (max)",
                        result=max(xs), unit="s", spread=(min(xs), max(xs)) if len(xs) > 1 else None,
                        n=len(xs), n_of="versions",
                        goal="<= one window's capture + publish + the load",
                        met=met if all("bound_s" in r for r in lat) else None,
                        conditions=f"tiny verifier, {a.window_rows}×{a.seq_len}-token windows; "
                        f"closest to its bound: {worst['version']} {worst['to_loaded_s']:.2f} s vs "
                        f"{worst.get('bound_s', float('nan')):.2f} s (load {worst['load_s']:.2f} s)"))  # fmt: skip
    firsts = [r["to_first_window_s"] for r in res["swaps"] if "to_first_window_s" in r]
    if firsts:
        rows.append(Row(stage="producer", name="version_first_window_s",
                        what="RL co-training: `current` flipped → the first window published "
                        "with that version (median; waits for traffic to fill a window)",
                        result=round(statistics.median(firsts), 2), unit="s",
                        spread=(min(firsts), max(firsts)) if len(firsts) > 1 else None,
                        n=len(firsts), n_of="versions",
                        conditions=f"traffic {a.records_per_s:g} records/s, "
                        f"{a.window_rows}×{a.seq_len}-token windows"))  # fmt: skip
    if "flat_ratio" in d:
        pk = {k: f"{v[0] / 2**20:.2f} → {v[1] / 2**20:.2f} MiB" for k, v in d["peaks"].items()}
        rows.append(Row(stage="store", name="rl_follow_disk_flat",
                        what="RL co-training: the stream's files under the run dir (less "
                        "windows/ and the SQLite WAL), peak over the run's second half ÷ first",
                        result=round(d["flat_ratio"], 3), unit="×", n=d["samples"],
                        n_of="samples", goal=f"<= {FLAT}", met=d["flat_ratio"] <= FLAT,
                        conditions=f"{d['span_s']:g} s, the log grew {d['log_growth']:.2f}× "
                        f"(to {d['log_bytes'][1] / 2**10:.0f} KiB); peaks: these {pk['stream']}, "
                        f"run dir {pk['run']}, WAL {pk['wal']} (checkpointed at 4000 pages); "
                        f"K = {a.k}, --follow-keep-windows {a.keep_windows}"))  # fmt: skip
    return rows


def plots(res: dict[str, Any]) -> list[dict[str, Any]]:
    s = res["disk_samples"]
    parts = (("run dir", "run"), ("stream files (less windows/, WAL)", "stream"),
             ("SQLite WAL", "wal"), ("followed log", "log"))  # fmt: skip
    return [{"name": "rl_follow_disk", "stage": "store", "kind": "line", "xlabel": "seconds",
             "title": "RL co-training: bytes under the run dir vs the followed log", "ylabel": "MiB",
             "series": {k: [[round(x["t"] - s[0]["t"], 1), round(x[key] / 2**20, 3)] for x in s]
                        for k, key in parts}}] if s else []  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "rl_follow"), help="working directory")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512, help="the demo assets' tokenizer")
    ap.add_argument("--asset-conversations", type=int, default=2000, help="the base's corpus")
    ap.add_argument("--asset-steps", type=int, default=200, help="the base's training steps")
    ap.add_argument("--versions", type=int, default=4, help="policy versions in all (>= 2)")
    ap.add_argument("--every-s", type=float, default=45.0, help="seconds between versions")
    ap.add_argument("--policy-steps", type=int, default=25, help="optimizer steps a version")
    ap.add_argument("--policy-lr", type=float, default=2e-3)
    ap.add_argument("--policy-batch", type=int, default=8, help="rows a policy step")
    ap.add_argument("--policy-seq-len", type=int, default=128)
    ap.add_argument("--shift-conversations", type=int, default=1000, help="the shifted set")
    ap.add_argument("--first-records", type=int, default=480, help="traffic of v0001")
    ap.add_argument("--records", type=int, default=120, help="traffic of each later version")
    ap.add_argument("--records-per-s", type=float, default=4.0, help="appender rate")
    ap.add_argument("--temperature", type=float, default=0.0, help="traffic sampling; 0: greedy")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="traffic answers")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--window-rows", type=int, default=4)
    ap.add_argument("--k", type=int, default=4, help="producer --max-live-windows")
    ap.add_argument("--keep-windows", type=int, default=4, help="--follow-keep-windows")
    ap.add_argument("--chunk-records", type=int, default=8, help="--follow-chunk-records")
    ap.add_argument("--lr", type=float, default=2e-3, help="the draft's")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    ap.add_argument("--max-verifier-lag", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=32, help="prompts never appended")
    ap.add_argument("--eval-new-tokens", type=int, default=48)
    ap.add_argument("--no-first-eval", action="store_true", help="no τ against v0001")
    ap.add_argument("--no-same-steps", action="store_true", help="no same-steps control")
    ap.add_argument("--settle-s", type=float, default=8.0, help="caught up: steps still this long")
    ap.add_argument("--catch-up-s", type=float, default=600.0, help="wait for the trainer")
    ap.add_argument("--disk-every-s", type=float, default=2.0, help="disk samples")
    a = ap.parse_args(argv)
    if a.versions < 2:
        ap.error("--versions: at least 2 (the first and one it moves to)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rec = Recorder("rl_follow", argv)
    torch.set_num_threads(1)  # tiny models; the producer and trainer need the other core
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    settings = AssetSettings(
        n_conversations=a.asset_conversations, vocab_size=a.vocab_size, train_steps=a.asset_steps
    )
    assets = ensure_demo_assets(Path(a.work) / "assets", settings)
    a.tokenizer = assets.tokenizer_dir
    print(f"assets ready ({time.monotonic() - t0:.0f} s)", flush=True)
    lv = live(a, assets)
    held = write_jsonl(Path(a.work) / "live" / "eval.jsonl",
                       generate_corpus(a.eval_prompts, seed=a.seed + 2))  # fmt: skip
    versions = sorted((lv["policy"] / VERSIONS).iterdir())
    drafts = {"followed": lv["followed"], "frozen": lv["frozen"]}
    control = None
    if not a.no_same_steps:  # the followed draft's steps, on v0001's traffic alone
        drafts["same_steps"], control = same_steps(
            Path(a.work) / "same", versions[0], lv["first"], step_of(lv["followed"]),
            lv["freeze"]["steps"],
            lv["pcfg"], lv["tcfg"], a.catch_up_s)  # fmt: skip
    ev = tau(versions[-1], drafts, held, a)
    first = None if a.no_first_eval else tau(versions[0], {"frozen": lv["frozen"]}, held, a)
    ta, tb = ev["followed"]["tau"], ev["frozen"]["tau"]
    ca, cb = ev["followed"]["ci95"], ev["frozen"]["ci95"]
    lat, per_window = latencies(lv)
    dk = disk(lv)
    res = {
        "eval_newest": ev, "eval_first": first, "tau_ratio": ta / tb,
        "tau_ratio_bounds": [ca[0] / cb[1], ca[1] / cb[0]] if ca and cb else None,
        "same_steps": control,
        "swaps": lat, "producer": per_window, "disk": dk, "disk_samples": lv["disk"],
        "freeze": lv["freeze"], "appended": lv["appended"], "lag_skipped": lv["lag_skipped"],
        "steps": len(read_train_log(lv["save"])), "steps_by_version": steps_by_version(lv["save"]),
        "windows_by_version": {version_name(v): sum(1 for x, _ in lv["windows"].values() if x == v)
                               for v in sorted({x for x, _ in lv["windows"].values() if x})},
        "hardware": f"{os.uname().machine}, {os.cpu_count()} CPUs",
        "load_avg_1m": [load0, os.getloadavg()[0]], "wall_s": round(time.monotonic() - t0, 1),
        "sizes": {k: str(v) for k, v in vars(a).items() if k not in ("json", "work")}
        | {"torch": torch.__version__},
    }  # fmt: skip
    rows = record_rows(res, a)
    print("\n".join(summary(res, a, rows)), flush=True)
    rec.write(a.json, rows, raw=res, plots=plots(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
