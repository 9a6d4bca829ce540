"""Drift: τ on new traffic of the continuously trained, promoted draft vs the same draft frozen at the switch.

    .venv/bin/python benchmarks/drift.py --json benchmarks/results/drift.json   # ≈ 15 min, 2 cores
    .venv/bin/python benchmarks/drift.py --quick                                # ≈ 3 min smoke

Run from the repository root. The live loop of issue 46, end to end, on CPU:

1. Two real chat sets of /work/shared/data (its README): A = MT-Bench-101 (general
   multi-turn tasks: reasoning, maths, rewriting; the first `--max-pairs` exchanges of
   each dialogue) and B = FastChat's identity/small-talk conversations (an assistant
   persona: "I am Vicuna, trained by LMSYS"). Clearly different traffic.
2. A verifier that has learned both (τ needs one: a random verifier gives no signal):
   the demo's recipe (fanout.bench.assets: a byte-level BPE `build_tokenizer` and a tiny
   Qwen3 `build_verifier`) trained on A ∪ B, then the traffic is its own greedy answers
   (fanout regenerate, every assistant turn): what a gateway in front of it logs.
   Cached under `--work`/assets-<fingerprint> (built once: ≈ 2 min).
3. The live run: an appender (a thread here) writes A's records into a JSONL log at
   `--records-per-s`, then B's (`--b-passes` times: traffic repeats); `fanout produce
   --follow LOG` captures them (`--holdout-fraction` held out by content hash);
   `fanout train` trains one block-8 DFlash draft on the open stream (constant lr after
   warm-up, `--ema-decay`, a checkpoint every `--checkpoint-every-s`); `fanout promote
   --run-dir` (a loop, `--poll-s`) decodes each new checkpoint against the served one on
   the newest held-out traffic and promotes it when its τ is higher by `--margin`.
4. The switch: once A is written and the trainer has read all of it (its rows acked,
   a checkpoint written after that), the newest checkpoint is copied aside: the frozen
   draft (b), what serving keeps without continuous training. Then B's records go out.
5. After the switch, `--eval-points` times (evenly over B's traffic, the last after the
   stream ended and the promoter saw the final checkpoint), the served draft
   (DIR/current: (a)) and the frozen one are decoded on the same `--eval-prompts`
   held-out B conversations (never appended), T = 0, the served decoding rule
   (fanout.decode.eval.EvalSession, both drafts interleaved): τ with its 95% interval
   each, and the ratio (a)/(b) (goal ≥ 1.2 at the last point) with the interval the two
   τ intervals bound it to.
6. Promotion latency, checkpoint written → served: the mtime of a candidate's COMMITTED
   marker (seen by a watcher here before the trainer prunes it) to that of the marker
   copied into DIR/versions/vNNNN (the flip follows at once); its median, min and max.

`--json OUT` writes the record (benchmarks/record.py): rows `tau_ratio_new_traffic`,
`tau_served_new_traffic`, `tau_frozen_new_traffic`, `promotion_latency_s`; raw: every
eval point, every promotion decision (promotions.jsonl), the promoter's drift records,
steps, rows, sizes, hardware and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import MASK_TOKEN, build_tokenizer, build_verifier, write_jsonl
from fanout.checkpoints.layout import MARKER, committed_checkpoints
from fanout.checkpoints.load import load_draft
from fanout.decode.config import EvalConfig
from fanout.decode.eval import EvalSession
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.regen.regenerate import RegenerateConfig, regenerate
from fanout.train.config import TrainConfig
from fanout.train.trainlog import read_train_log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from record import Recorder, Row  # noqa: E402  (a sibling script)

DATA = REPO.parent / "shared" / "data" / "chat"
SET_A = DATA / "mt-bench-101" / "mtbench101.jsonl"
SET_B = DATA / "fastchat" / "dummy_conversation.json"
GOAL = 1.2  # τ of the served draft over the frozen one's, on the new traffic
ASSETS_VERSION = 2  # bump when the recipe below changes (part of the cache key)
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}


# ---- the two traffic sets and the verifier that has learned them ----------------------


def set_a(max_pairs: int) -> list[dict[str, Any]]:
    """MT-Bench-101 dialogues as OpenAI messages (the first `max_pairs` exchanges)."""
    out = []
    for line in SET_A.read_text().splitlines():
        if line.strip():
            h = json.loads(line)["history"][:max_pairs]
            msgs = [m for p in h for m in ({"role": "user", "content": p["user"]},
                                           {"role": "assistant", "content": p["bot"]})]  # fmt: skip
            out.append({"messages": msgs})
    return out


def set_b() -> list[dict[str, Any]]:
    """FastChat's identity conversations as OpenAI messages."""
    role = {"human": "user", "gpt": "assistant"}
    return [{"messages": [{"role": role[t["from"]], "content": t["value"]} for t in c["conversations"]]}
            for c in json.loads(SET_B.read_text())]  # fmt: skip


def sizes_key(a: argparse.Namespace) -> str:
    keys = ("seed", "max_pairs", "a_conversations", "b_conversations", "eval_prompts",
            "verifier_steps", "vocab_size", "max_new_tokens")  # fmt: skip
    blob = json.dumps({"v": ASSETS_VERSION, **{k: getattr(a, k) for k in keys}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_assets(a: argparse.Namespace) -> dict[str, Any]:
    """Tokenizer, verifier (trained on A ∪ B) and the three traffic files (its own
    greedy answers): A's, B's and the held-out B conversations; built once, cached."""
    root = Path(a.work).resolve() / f"assets-{sizes_key(a)}"
    if (root / "assets.json").is_file():
        return json.loads((root / "assets.json").read_text())
    tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    r = random.Random(a.seed)
    sa, sb = set_a(a.max_pairs), set_b()
    r.shuffle(sa)
    r.shuffle(sb)
    if a.eval_prompts + a.b_conversations > len(sb) or a.a_conversations > len(sa):
        raise SystemExit(f"drift: sets too small: A {len(sa)}, B {len(sb)} conversations")
    a_traffic, b_eval = sa[: a.a_conversations], sb[: a.eval_prompts]
    b_traffic = sb[a.eval_prompts : a.eval_prompts + a.b_conversations]
    t0 = time.monotonic()
    tok = build_tokenizer(tmp / "tokenizer", sa + sb, a.vocab_size)
    # the served model knows both kinds of traffic (all of A and B: it is the oracle)
    ver = build_verifier(tmp / "verifier", tok, sa + sb, train_steps=a.verifier_steps,
                         seed=a.seed, seq_len=128)  # fmt: skip
    built_s = time.monotonic() - t0
    files = {}
    for name, convs in (("a", a_traffic), ("b", b_traffic), ("b_eval", b_eval)):
        src = write_jsonl(tmp / "orig" / f"{name}.jsonl", convs)
        rsum = regenerate(RegenerateConfig(
            verifier_name_or_path=str(ver), tokenizer=str(tok), data=[str(src)],
            out=str(tmp / "regen" / name), device="cpu", turns="all",
            max_new_tokens=a.max_new_tokens, regen_batch_size=16, progress=False,
            keep_truncated=True,  # a gateway logs an answer cut at max_tokens too
        ))  # fmt: skip
        files[name] = str(Path(rsum["out"]).relative_to(tmp))
    from tokenizers import Tokenizer

    mask = Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id(MASK_TOKEN)
    info = {"tokenizer": "tokenizer", "verifier": "verifier", "files": files, "mask_token_id": mask,
            "verifier_training": json.loads((ver / "training.json").read_text()),
            "build_s": round(time.monotonic() - t0, 1), "verifier_build_s": round(built_s, 1)}  # fmt: skip
    (tmp / "assets.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return json.loads((root / "assets.json").read_text())


def resolve(assets: dict[str, Any], a: argparse.Namespace) -> dict[str, Path]:
    root = Path(a.work).resolve() / f"assets-{sizes_key(a)}"
    return {"tokenizer": root / assets["tokenizer"], "verifier": root / assets["verifier"],
            **{k: root / v for k, v in assets["files"].items()}}  # fmt: skip


def lines_of(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.strip()]


# ---- the live run ---------------------------------------------------------------------


class Watcher(threading.Thread):
    """Sees each checkpoint of the trainer and each promoted version before they are
    pruned: the mtimes of their COMMITTED markers."""

    def __init__(self, save: Path, served: Path) -> None:
        super().__init__(daemon=True)
        self.save, self.served = save, served
        self.ckpt: dict[str, float] = {}  # checkpoint dir name -> marker mtime
        self.version: dict[str, float] = {}  # vNNNN -> marker mtime (copy time)
        self.stop = threading.Event()

    def look(self) -> None:
        for d in committed_checkpoints(self.save) if self.save.is_dir() else []:
            self.ckpt.setdefault(d.name, (d / MARKER).stat().st_mtime)
        vdir = self.served / "versions"
        for v in sorted(vdir.iterdir()) if vdir.is_dir() else []:
            if v.name.startswith("v") and (v / MARKER).is_file():
                self.version.setdefault(v.name, (v / MARKER).stat().st_mtime)

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError):  # a directory pruned between list and stat
                self.look()
            time.sleep(0.25)


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT)


def stop(p: subprocess.Popen[bytes] | None) -> None:
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


def wait_for(pred: Any, timeout: float, what: str, procs: dict[str, Any]) -> Any:
    """Poll `pred` until truthy; fail (naming the role) when a role died or time ran out."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        for name, (p, log) in procs.items():
            if p is not None and p.poll() not in (None, 0):
                raise SystemExit(f"drift: {name} exited {p.returncode} waiting for {what}:\n"
                                 + log.read_text()[-3000:])  # fmt: skip
        if time.monotonic() > end:
            raise SystemExit(f"drift: no {what} after {timeout:.0f} s")
        time.sleep(0.25)
    return got


def append(log: Path, records: list[str], per_s: float) -> None:
    """Write `records` to the followed log at `per_s` records a second (one write each)."""
    with open(log, "a") as f:
        for rec in records:
            f.write(rec + "\n")
            f.flush()
            time.sleep(1.0 / per_s)


def follow_records(run: Path) -> int:
    """Records the follow producer has read so far: the conversations in its chunks
    (RUN_DIR/follow/chunk-*.jsonl) and in its held-out set (a bounded file: --holdout-keep
    stays above what this benchmark holds out)."""
    files = [*(run / "follow").glob("chunk-*.jsonl"), run / "follow" / "heldout.jsonl"]
    n = 0
    for f in files:
        with contextlib.suppress(OSError):
            n += f.read_bytes().count(b"\n")
    return n


_SEEN: dict[Path, tuple[int, float]] = {}


def settled(save: Path, quiet_s: float) -> bool:
    """Has the trainer's step count stood still for `quiet_s` seconds?"""
    n, now = len(read_train_log(save)), time.monotonic()
    was = _SEEN.get(save)
    if was is None or was[0] != n:
        _SEEN[save] = (n, now)
        return False
    return now - was[1] >= quiet_s


def stream_rows(run: Path) -> int:
    try:
        info = json.loads((run / "stream.json").read_text())
    except (OSError, ValueError):
        return 0
    return int((info.get("dataset_summary") or {}).get("rows_so_far") or 0)


def evaluate(session: EvalSession, served: Path, frozen: Path, verifier: Path) -> dict[str, Any]:
    """τ of the served draft and of the frozen one on the same held-out B prompts."""
    now = (served / "current").resolve()
    drafts = {"served": load_draft(now, verifier), "frozen": load_draft(frozen, verifier)}
    t0 = time.monotonic()
    rep = session.run(drafts, {"served": None, "frozen": None})
    out: dict[str, Any] = {"version": now.name, "prompts": rep["prompts"],
                           "lossless": rep["lossless"], "eval_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    for k in drafts:
        d = rep["drafts"][k]
        out[k] = {"tau": d["acceptance_length"], "ci95": d["acceptance_length_ci95"],
                  "verify_steps": d["verify_steps"]}  # fmt: skip
    ta, tb = out["served"]["tau"], out["frozen"]["tau"]
    out["ratio"] = ta / tb
    ca, cb = out["served"]["ci95"], out["frozen"]["ci95"]
    out["ratio_bounds"] = [ca[0] / cb[1], ca[1] / cb[0]] if ca and cb else None
    return out


def live(a: argparse.Namespace, p: dict[str, Path], mask: int) -> dict[str, Any]:
    work = Path(a.work) / "live"
    shutil.rmtree(work, ignore_errors=True)
    src, run, save, served = work / "src", work / "run", work / "drafts" / "d", work / "served"
    frozen, logs = work / "frozen", work / "logs"
    for d in (src, logs):
        d.mkdir(parents=True)
    traffic = src / "gateway.jsonl"
    traffic.touch()
    pcfg = {
        "run_dir": str(run), "verifier_name_or_path": str(p["verifier"]),
        "tokenizer": str(p["tokenizer"]), "follow": str(traffic),
        "follow_idle_s": a.idle_s, "follow_chunk_records": a.chunk_records,
        "follow_flush_s": 2.0, "holdout_fraction": a.holdout_fraction,
        "seq_len": a.seq_len, "window_rows": a.window_rows, "num_draft_layers": 1,
        "max_live_windows": a.k, "workers": 1, "progress": False,
        "cache_dir": str(work / "cache"), "device": "cpu",
    }  # fmt: skip
    tcfg = {
        "run_dir": str(run), "consumer_id": "d", "verifier_name_or_path": str(p["verifier"]),
        "save_path": str(save), "mask_token_id": mask, "block_size": 8, "max_anchors": 16,
        "lr": a.lr, "scheduler_type": "constant", "warmup_ratio": 0.05,
        "rows_per_step": a.rows_per_step, "checkpoint_every": a.checkpoint_every,
        "checkpoint_every_s": a.checkpoint_every_s, "keep_checkpoints": 3,
        "ema_decay": a.ema_decay, "progress": False, "seed": a.seed,
    }  # fmt: skip
    if not a.ema_decay:
        tcfg.pop("ema_decay")
    cli = [sys.executable, "-m", "fanout.cli"]
    procs: dict[str, Any] = {}
    prod = start([*cli, "produce", *to_flags(ProducerConfig, pcfg)], logs / "producer.log")
    procs["producer"] = (prod, logs / "producer.log")
    wait_for(lambda: (run / "follow").is_dir(), 120, "follow directory", procs)
    a_recs, b_recs = lines_of(p["a"]), lines_of(p["b"]) * a.b_passes
    t_start = time.monotonic()
    writer = threading.Thread(target=append, args=(traffic, a_recs, a.records_per_s), daemon=True)
    writer.start()
    wait_for(lambda: (run / "stream.json").is_file(), 300, "stream.json", procs)
    trainer = start([*cli, "train", *to_flags(TrainConfig, tcfg)], logs / "trainer.log")
    procs["trainer"] = (trainer, logs / "trainer.log")
    held = run / "follow" / "heldout.jsonl"
    wait_for(lambda: held.is_file() and latest(save), 600, "a held-out record and a checkpoint",
             procs)  # fmt: skip
    promo_cmd = [*cli, "promote", "--run-dir", str(run), "--draft", str(save), "--served",
                 str(served), "--verifier-name-or-path", str(p["verifier"]), "--tokenizer",
                 str(p["tokenizer"]), "--num-prompts", str(a.promote_prompts),
                 "--max-new-tokens", str(a.max_new_tokens), "--no-sampled-draft",
                 "--margin", str(a.margin), "--poll-s", str(a.poll_s),
                 # the first checkpoint is served whatever its τ: the run measures drift
                 # from there (a short run's first draft may sit at the floor, #52)
                 "--floor-epsilon", "-1"]  # fmt: skip
    promoter = start(promo_cmd, logs / "promoter.log")
    procs["promoter"] = (promoter, logs / "promoter.log")
    watcher = Watcher(save, served)
    watcher.start()
    try:
        writer.join()
        # the switch: the producer has read every A record (its chunk manifests say so)
        # and the trainer has read every row it will get before B arrives (the open
        # stream claims only full windows): its step count stands still for --settle-s
        wait_for(lambda: follow_records(run) >= len(a_recs), a.catch_up_s, "all of A read",
                 procs)  # fmt: skip
        wait_for(lambda: settled(save, a.settle_s), a.catch_up_s, "trainer caught up", procs)
        caught = len(read_train_log(save))
        wait_for(lambda: (served / "current").is_symlink(), 300, "a served draft", procs)
        # the newest checkpoint: a trainer waiting for rows writes none, so it is at most
        # --checkpoint-every steps (or -s seconds) behind `caught`
        ck = latest(save)
        assert ck is not None
        shutil.copytree(ck, frozen)
        if prod.poll() is not None:
            raise SystemExit("drift: the producer ended its stream before B's traffic (no record "
                             f"for --idle-s {a.idle_s:g} s during the switch): raise --idle-s")  # fmt: skip
        t_switch = time.monotonic()
        switch = {"at_s": round(t_switch - t_start, 1), "frozen_step": step_of(ck),
                  "served_version": (served / "current").resolve().name,
                  "records_read": follow_records(run), "steps_at_switch": caught}  # fmt: skip
        print(f"switch at {switch['at_s']} s: frozen step {switch['frozen_step']}, served "
              f"{switch['served_version']}; {len(b_recs)} B records next", flush=True)  # fmt: skip
        writer = threading.Thread(target=append, args=(traffic, b_recs, a.records_per_s),
                                  daemon=True)  # fmt: skip
        writer.start()
        cfg = EvalConfig(verifier_name_or_path=str(p["verifier"]), tokenizer=str(p["tokenizer"]),
                         data=str(p["b_eval"]), draft=[str(frozen)], num_prompts=a.eval_prompts,
                         max_new_tokens=a.max_new_tokens, temperature=[0.0],
                         sampled_draft=False)  # fmt: skip
        layers = sorted(load_draft(frozen, p["verifier"]).cfg.target_layer_ids)
        session = EvalSession(cfg, layers)
        points: list[dict[str, Any]] = []
        b_s = len(b_recs) / a.records_per_s
        for k in range(1, a.eval_points):
            at = t_switch + k * b_s / a.eval_points
            while time.monotonic() < at:
                wait_for(lambda: True, 1, "", procs)
                time.sleep(1.0)
            points.append(point(session, served, frozen, p, save, t_switch))
        writer.join()
        wait_for(lambda: trainer.poll() is not None, a.catch_up_s + a.idle_s + 120,
                 "the trainer's end (stream ended)", procs)  # fmt: skip
        last = latest(save)
        # the promoter's decision on the final checkpoint
        wait_for(lambda: last is None or decided(served, last), 2 * a.poll_s + 300,
                 "the promoter's look at the final checkpoint", procs)  # fmt: skip
        points.append(point(session, served, frozen, p, save, t_switch))
    finally:
        watcher.stop.set()
        for _, (proc, _) in procs.items():
            stop(proc)
    watcher.look() if save.is_dir() else None
    decisions = [json.loads(x) for x in lines_of(served / "promotions.jsonl")]
    drift_log = run / "follow" / "drift.jsonl"
    lat = []
    for d in decisions:
        v, cand = d.get("version"), Path(d.get("candidate", "")).name
        if d.get("promoted") and v in watcher.version and cand in watcher.ckpt:
            lat.append(round(watcher.version[v] - watcher.ckpt[cand], 2))
    return {
        "switch": switch, "points": points, "decisions": decisions, "promotion_latency_s": lat,
        "checkpoints_seen": len(watcher.ckpt), "steps": len(read_train_log(save)),
        "rows": stream_rows(run), "wall_s": round(time.monotonic() - t_start, 1),
        "drift": [json.loads(x) for x in lines_of(drift_log)] if drift_log.is_file() else [],
        "records": {"a": len(a_recs), "b": len(b_recs)},
    }  # fmt: skip


def latest(save: Path) -> Path | None:
    done = committed_checkpoints(save) if save.is_dir() else []
    return done[-1] if done else None


def step_of(ckpt: Path) -> int:
    return int(json.loads((ckpt / "training_state.json").read_text())["step"])


def decided(served: Path, ckpt: Path) -> bool:
    f = served / "promotions.jsonl"
    return f.is_file() and any(Path(json.loads(x).get("candidate", "")).name == ckpt.name
                               for x in lines_of(f))  # fmt: skip


def point(session: EvalSession, served: Path, frozen: Path, p: dict[str, Path], save: Path,
          t_switch: float) -> dict[str, Any]:  # fmt: skip
    at = time.monotonic() - t_switch
    steps = len(read_train_log(save))
    out: dict[str, Any] = {"after_switch_s": round(at, 1), "steps": steps}
    out |= evaluate(session, served, frozen, p["verifier"])
    s, f = out["served"], out["frozen"]
    print(f"  +{at:5.0f} s  step {steps:>5}  served {out['version']}: τ {s['tau']:.3f} "
          f"{_ci(s['ci95'])}  frozen τ {f['tau']:.3f} {_ci(f['ci95'])}  ratio "
          f"{out['ratio']:.3f}  ({out['prompts']} prompts, {out['eval_s']} s)", flush=True)  # fmt: skip
    return out


def _ci(ci: list[float] | None) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "[–]"


# ---- report ---------------------------------------------------------------------------


def summary(res: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lv, last = res["live"], res["live"]["points"][-1]
    lat = lv["promotion_latency_s"]
    lines = [
        f"hardware: {res['hardware']}; load (1 min) {res['load_avg_1m'][0]:.1f} → "
        f"{res['load_avg_1m'][1]:.1f}; torch {torch.__version__}",
        f"sizes: verifier h64 × 6 layers, vocab {a.vocab_size}, {a.verifier_steps} steps on A ∪ B; "
        f"traffic A {lv['records']['a']} then B {lv['records']['b']} records at "
        f"{a.records_per_s:g}/s; {lv['rows']} rows × {a.seq_len} tokens, {lv['steps']} steps "
        f"(block 8, {a.rows_per_step} row/step, ema {a.ema_decay}); promote margin {a.margin:g}, "
        f"poll {a.poll_s:g} s; eval {a.eval_prompts} held-out B prompts × {a.max_new_tokens} tokens",
        f"switch at {lv['switch']['at_s']} s (frozen: step {lv['switch']['frozen_step']})",
        f"{'after switch':>12} {'step':>6} {'served':>8} {'τ served':>18} {'τ frozen':>18} {'ratio':>7}",
    ]  # fmt: skip
    for q in lv["points"]:
        s, f = q["served"], q["frozen"]
        lines.append(f"{q['after_switch_s']:>10.0f} s {q['steps']:>6} {q['version']:>8} "
                     f"{s['tau']:>6.3f} {_ci(s['ci95']):>11} {f['tau']:>6.3f} {_ci(f['ci95']):>11} "
                     f"{q['ratio']:>7.3f}")  # fmt: skip
    met = "met" if last["ratio"] >= GOAL else "NOT met"
    lines.append(f"served / frozen on new traffic: {last['ratio']:.3f}× (bounds "
                 f"{_ci(last['ratio_bounds'])}; goal ≥ {GOAL}: {met})")  # fmt: skip
    promos = [d for d in lv["decisions"] if d.get("promoted")]
    lines.append(f"promotions: {len(promos)} of {len(lv['decisions'])} decisions; latency "
                 + (f"checkpoint → served median {statistics.median(lat):.1f} s "
                    f"(min {min(lat):.1f}, max {max(lat):.1f}, n {len(lat)})" if lat else "n/a"))  # fmt: skip
    return lines


def record_rows(res: dict[str, Any], a: argparse.Namespace) -> list[Row]:
    lv, last = res["live"], res["live"]["points"][-1]
    lat = lv["promotion_latency_s"]
    size = (f"verifier h64×6 (vocab {a.vocab_size}) trained on A ∪ B; A = MT-Bench-101 "
            f"({lv['records']['a']} records), B = FastChat identity ({lv['records']['b']}); "
            f"{lv['steps']} DFlash b8 steps; eval after the stream ended, T = 0, "
            f"{last['prompts']} held-out B prompts × {a.max_new_tokens} tokens")  # fmt: skip
    s, f = last["served"], last["frozen"]
    b = last["ratio_bounds"]
    rows = [
        Row(stage="eval", name="tau_ratio_new_traffic",
            what="drift: τ on new traffic, continuously trained + promoted draft ÷ the same "
            "draft frozen at the switch", result=round(last["ratio"], 4), unit="×",
            spread=(round(b[0], 4), round(b[1], 4)) if b else None,
            spread_kind="bounds from both 95% CIs", n=last["prompts"], n_of="prompts",
            goal=f">= {GOAL}", met=last["ratio"] >= GOAL,
            conditions=f"{size}; served {last['version']}, frozen step "
            f"{lv['switch']['frozen_step']}"),
        Row(stage="eval", name="tau_served_new_traffic",
            what="drift: τ of the served (promoted) draft on new traffic",
            result=s["tau"], spread=tuple(s["ci95"]) if s["ci95"] else None,
            spread_kind="95% CI", n=last["prompts"], n_of="prompts", conditions=size),
        Row(stage="eval", name="tau_frozen_new_traffic",
            what="drift: τ of the draft frozen at the switch on new traffic",
            result=f["tau"], spread=tuple(f["ci95"]) if f["ci95"] else None,
            spread_kind="95% CI", n=last["prompts"], n_of="prompts", conditions=size),
    ]  # fmt: skip
    if lat:
        rows.append(Row(stage="eval", name="promotion_latency_s",
                        what="promotion latency: checkpoint written → served (median)",
                        result=round(statistics.median(lat), 2), unit="s",
                        spread=(min(lat), max(lat)) if len(lat) > 1 else None, n=len(lat),
                        n_of="promotions",
                        conditions=f"fanout promote --poll-s {a.poll_s:g} --margin {a.margin:g}, "
                        f"{a.promote_prompts} prompts a decision, checkpoints every "
                        f"{a.checkpoint_every_s:g} s"))  # fmt: skip
    return rows


def plots(res: dict[str, Any]) -> list[dict[str, Any]]:
    pts = res["live"]["points"]
    return [{"name": "drift_tau", "stage": "eval", "kind": "line",
             "title": "τ on new traffic after the switch: served (promoted) vs frozen",
             "xlabel": "seconds after the switch", "ylabel": "τ (T = 0)",
             "series": {"served": [[q["after_switch_s"], q["served"]["tau"]] for q in pts],
                        "frozen at the switch": [[q["after_switch_s"], q["frozen"]["tau"]]
                                                 for q in pts]}}]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "drift"), help="working directory")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--quick", action="store_true", help="a ~3 min smoke (small sizes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-pairs", type=int, default=2, help="A: exchanges kept per dialogue")
    ap.add_argument("--a-conversations", type=int, default=300, help="A traffic")
    ap.add_argument("--b-conversations", type=int, default=400, help="B traffic (distinct)")
    ap.add_argument("--b-passes", type=int, default=2, help="B traffic written this many times")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out B prompts (τ)")
    ap.add_argument("--eval-points", type=int, default=3, help="evals after the switch")
    ap.add_argument("--verifier-steps", type=int, default=600)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=48, help="answers and eval")
    ap.add_argument("--records-per-s", type=float, default=5.0, help="appender rate")
    ap.add_argument("--holdout-fraction", type=float, default=0.05)
    ap.add_argument("--chunk-records", type=int, default=16)
    ap.add_argument(
        "--idle-s",
        type=float,
        default=60.0,
        help="producer --follow-idle-s (> the switch's wait for a checkpoint)",
    )
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--window-rows", type=int, default=4)
    ap.add_argument("--k", type=int, default=4, help="producer --max-live-windows")
    ap.add_argument("--rows-per-step", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ema-decay", type=float, default=0.95, help="0: no EMA")
    ap.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    ap.add_argument("--checkpoint-every-s", type=float, default=30.0)
    ap.add_argument("--margin", type=float, default=0.05, help="fanout promote --margin")
    ap.add_argument("--poll-s", type=float, default=10.0, help="fanout promote --poll-s")
    ap.add_argument("--promote-prompts", type=int, default=16, help="per promotion decision")
    ap.add_argument("--catch-up-s", type=float, default=600.0, help="wait for the trainer")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=8.0,
        help="the switch: the trainer's steps stand still this long (caught up)",
    )
    a = ap.parse_args(argv)
    if a.quick:
        for k, v in {"a_conversations": 80, "b_conversations": 120, "b_passes": 1,
                     "eval_prompts": 16, "eval_points": 2, "verifier_steps": 150,
                     "max_new_tokens": 32, "records_per_s": 10.0, "idle_s": 30.0,
                     "checkpoint_every": 10, "checkpoint_every_s": 15.0, "poll_s": 5.0, "promote_prompts": 8,
                     "holdout_fraction": 0.1, "chunk_records": 8}.items():  # fmt: skip
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rec = Recorder("drift", argv)
    torch.set_num_threads(1)  # tiny models; the other roles need the other core
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    assets = ensure_assets(a)
    p = resolve(assets, a)
    print(f"assets ready ({time.monotonic() - t0:.0f} s; verifier loss "
          f"{assets['verifier_training']['final_loss']:.2f})", flush=True)  # fmt: skip
    lv = live(a, p, assets["mask_token_id"])
    res = {
        "live": lv, "assets": assets, "goal": GOAL,
        "hardware": f"{os.uname().machine}, {os.cpu_count()} CPUs",
        "load_avg_1m": [load0, os.getloadavg()[0]], "wall_s": round(time.monotonic() - t0, 1),
        "sizes": {k: v for k, v in vars(a).items() if k not in ("json", "work")}
        | {"torch": torch.__version__},
    }  # fmt: skip
    print("\n".join(summary(res, a)), flush=True)
    rec.write(a.json, record_rows(res, a), raw=res, plots=plots(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
