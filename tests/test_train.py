"""The DFlash trainer end to end on a tiny verifier's windows: learning, exact resume, CLI.

    .venv/bin/pytest tests/test_train.py -x -q

Windows come from the real producer (in this process, all published up front; the
run expects more consumers than ever register, so nothing is evicted and every
test reads the same windows). The verifier is a random tiny Qwen3 with tied
embeddings: its greedy prediction at t is mostly token t itself, so on repetitive
data the draft's targets are learnable within a few dozen steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus
from fanout.checkpoints.layout import latest_checkpoint
from fanout.errors import ConfigError
from fanout.flags import flag_name
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.store.store import RunDir
from fanout.train.config import TrainConfig
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    build_tiny_assets,
    config_flags,
    one_thread,
    tiny_producer_config,
)
from window_files import window_names


@dataclass(frozen=True)
class Run:
    root: Path
    run_dir: Path
    verifier: Path


def repetitive_corpus(n: int, seed: int) -> list[dict[str, Any]]:
    """Assistant turns that repeat one word many times: next tokens are predictable."""
    r = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "robot"]
    out = []
    for _ in range(n):
        w = r.choice(words)
        k = r.randint(12, 30)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"Repeat {w} {k} times."},
                    {"role": "assistant", "content": " ".join([w] * k)},
                ]
            }
        )
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("train")
    corpus = repetitive_corpus(160, seed=0)
    _, _, ver = build_tiny_assets(root, corpus, corpus + generate_corpus(50, seed=1))
    summary = Producer(_producer_cfg(root, root / "run", epochs=3)).run()
    assert summary["windows"] == summary["total_windows"]
    return Run(root, root / "run", ver)


def _producer_cfg(root: Path, run_dir: Path, **kw: Any) -> ProducerConfig:
    """A run that never evicts: every test reads every window."""
    return tiny_producer_config(
        root, run_dir, **({"max_live_windows": 1000, "expected_consumers": 1000} | kw)
    )


def _cfg(run: Run, name: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        run_dir=str(run.run_dir),
        consumer_id=name,
        verifier_name_or_path=str(run.verifier),
        num_layers=1,
        block_size=4,
        max_anchors=16,
        rows_per_step=2,
        save_path=str(run.root / "drafts" / name),
        lr=1e-2,
        warmup_ratio=0.0,
        scheduler_type="constant",
        heartbeat_s=0.5,
    )
    return TrainConfig(**(base | kw))


def _log(cfg: TrainConfig) -> list[dict[str, Any]]:
    return read_train_log(cfg.save_path)


def _mean(recs: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in recs) / len(recs)


def test_loss_decreases_and_eal_rises(run: Run) -> None:
    cfg = _cfg(run, "learn", max_steps=80)
    out = Trainer(cfg).run()
    assert out["steps"] == 80 and out["adamw_backend"] in ("fused", "foreach")
    log = _log(cfg)
    assert [r["step"] for r in log] == list(range(1, 81))
    first, last = log[:3], log[-10:]
    # The frozen tiny tied head caps how sharp logits get, so the loss floor is high;
    # acceptance is the sharper signal: from ~1 (nothing accepted) to > 2.5 of 4.
    assert _mean(last, "loss") < 0.92 * _mean(first, "loss")
    assert _mean(first, "eal") < 1.3
    assert _mean(last, "eal") > 2.5
    assert _mean(last, "eal") > _mean(first, "eal") + 1.0
    for key in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "tokens_per_s", "window_wait_ms"):
        assert all(r[key] >= 0 for r in log), key
    assert len(log[0]["acc"]) == cfg.block_size - 1
    # a speculators-format checkpoint was saved at the end
    ckpts = sorted(Path(cfg.save_path).glob("**/config.json"))
    assert ckpts, "no checkpoint written"
    spec = json.loads(ckpts[-1].read_text())
    assert spec["speculators_model_type"] == "dflash" and spec["block_size"] == 4
    assert spec["fanout"]["train_eal"] == pytest.approx(_mean(log[-50:], "eal"), abs=1e-3)
    # serve it: real speculative decoding on held-out prompts from the checkpoint alone
    from fanout.bench.assets import write_jsonl
    from fanout.decode.config import EvalConfig
    from fanout.decode.eval import evaluate

    held = write_jsonl(run.root / "held.jsonl", repetitive_corpus(6, seed=77))
    rep = evaluate(
        EvalConfig(
            verifier_name_or_path=str(run.verifier),
            tokenizer=str(run.root / "tok"),
            data=str(held),
            draft=[cfg.save_path],
            num_prompts=4,
            max_new_tokens=24,
        )
    )
    assert rep["lossless"], rep["mismatches"]
    d = rep["drafts"]["learn"]
    assert d["train_eal"] == spec["fanout"]["train_eal"]
    # This verifier is random with tied embeddings: its greedy text repeats the prompt's
    # last token, which the draft never trained on, so τ here is ~1 despite train EAL >
    # 2.5 (a real train/serve gap; tests/test_eval.py trains on the verifier's own text
    # and sees acceptance).
    assert 1.0 <= d["acceptance_length"] <= cfg.block_size


def test_eval_every_logs_tau_on_held_out_prompts(run: Run) -> None:
    from fanout.bench.assets import write_jsonl

    held = write_jsonl(run.root / "held_ev.jsonl", repetitive_corpus(4, seed=78))
    cfg = _cfg(
        run, "evalev", max_steps=4, eval_every=2, eval_data=str(held),
        eval_tokenizer=str(run.root / "tok"), eval_prompts=2, eval_max_new_tokens=8,
    )  # fmt: skip
    Trainer(cfg).run()
    log = _log(cfg)
    evals = [r for r in log if "eval_tau" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval_lossless"] and r["eval_tau"] >= 1.0 for r in evals)
    with pytest.raises(ValueError, match="--eval-every needs --eval-data"):
        _cfg(run, "x", eval_every=2)


def test_resume_continues_with_identical_losses(run: Run) -> None:
    n, m = 5, 4
    full = _cfg(run, "full", max_steps=n + m, checkpoint_every=1000)
    Trainer(full).run()
    part = _cfg(run, "part", max_steps=n, checkpoint_every=1000)
    Trainer(part).run()  # saves at its last step (n)
    resumed = part.model_copy(update={"max_steps": n + m, "resume": True})
    t = Trainer(resumed)
    ckpt = latest_checkpoint(part.save_path)
    assert ckpt is not None and t.state["step"] == n
    saved = json.loads((ckpt / "training_state.json").read_text())["stream"]
    assert t.stream.state_dict() == saved and saved["cursor"] is not None  # restored
    t.run()
    a, b = _log(full), _log(part)
    assert [r["step"] for r in b] == list(range(1, n + m + 1))
    # the resumed steps read the same rows and produce the same losses, to the last digit
    assert [r["loss"] for r in b] == [r["loss"] for r in a]
    assert [r["windows"] for r in b] == [r["windows"] for r in a]


def test_resume_check_can_fail_with_another_seed(run: Run) -> None:
    # Negative control: a different seed (row order, anchors, init) gives other losses.
    a = _cfg(run, "seed0", max_steps=2)
    b = _cfg(run, "seed1", max_steps=2, seed=1)
    Trainer(a).run()
    Trainer(b).run()
    assert [r["loss"] for r in _log(a)] != [r["loss"] for r in _log(b)]


def test_help_documents_every_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name in TrainConfig.model_fields:
        assert flag_name(name) in text, name
    # the speculators-style names the issue lists
    for f in ("--verifier-name-or-path", "--block-size", "--max-anchors", "--target-layer-ids",
              "--lr", "--epochs", "--max-steps", "--save-path", "--resume", "--config"):  # fmt: skip
        assert f in text, f
    assert "(default: 0.0003)" in text  # defaults shown


def test_config_file_with_flag_override_reaches_the_trainer(
    run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fanout.train import trainer as train

    save = run.root / "drafts" / "cfgfile"
    cfg_file = run.root / "train.json"
    cfg_file.write_text(
        json.dumps(
            {
                "run_dir": str(run.run_dir),
                "consumer_id": "cfgfile",
                "verifier_name_or_path": str(run.verifier),
                "save_path": str(save),
                "block_size": 4,
                "max_anchors": 8,
                "max_steps": 50,
                "lr": 0.5,
            }
        )
    )
    rc = train.main(["--config", str(cfg_file), "--max-steps", "2", "--lr", "0.001"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2  # the flag overrode the file's 50
    log = read_train_log(save)
    assert log[0]["lr"] <= 0.001 and len(log[0]["acc"]) == 3  # lr from flag, block from file


def test_bad_config_is_a_clear_error(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    from fanout.train import trainer as train

    rc = train.main(["--run-dir", str(run.run_dir), "--consumer-id", "x", "--save-path", "s"])
    assert rc == 1
    assert "--verifier-name-or-path" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"draft vocabulary size 100000 must be in \[1, "):
        Trainer(_cfg(run, "dv", draft_vocab_size=100_000))
    # a wrong verifier directory: named at once, before waiting for a run that may not exist
    missing = run.root / "no-verifier"
    cfg = _cfg(run, "nv", acquire_timeout_s=600).model_copy(
        update={"verifier_name_or_path": str(missing), "run_dir": str(run.root / "no-run")}
    )
    with pytest.raises(ConfigError, match=f"--verifier-name-or-path: verifier directory {missing}"):
        Trainer(cfg)


def _script_argv(cfg: TrainConfig) -> list[str]:
    """scripts/train.py and a flag for every field of `cfg`."""
    return [str(Path(__file__).parents[1] / "scripts" / "train.py"), *config_flags(cfg)]


def test_torchrun_ranks_split_the_rows_stay_in_sync_and_resume(run: Run) -> None:
    """`torchrun --nproc-per-node 2 scripts/train.py` on CPU (gloo): two consumers
    ddp:dp0 / ddp:dp1 over the same windows, identical weights after every run (the
    checksum differs if gradients are not averaged), one checkpoint, and a resume
    that continues both ranks from it."""
    from fanout.coord.coordinator import Coordinator

    def torchrun(cfg: TrainConfig) -> list[dict[str, Any]]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", *_script_argv(cfg)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        return sorted((json.loads(x) for x in lines), key=lambda r: r["consumer"])

    cfg = _cfg(run, "ddp", max_steps=6, checkpoint_every=3)
    first = torchrun(cfg)
    assert [r["consumer"] for r in first] == ["ddp:dp0", "ddp:dp1"]
    assert all(r["steps"] == 6 and r["dp_world_size"] == 2 for r in first)
    assert first[0]["param_checksum"] == first[1]["param_checksum"]
    with Coordinator.open(run.run_dir) as co:
        cursors = dict(co.conn.execute("SELECT id, cursor FROM consumers WHERE id LIKE 'ddp:%'"))
    # 4-row windows, 2 rows per rank per step: each rank reads every window, half its rows
    assert cursors == {"ddp:dp0": 6, "ddp:dp1": 6}
    ckpt = latest_checkpoint(cfg.save_path)
    assert ckpt is not None and json.loads((ckpt / "training_state.json").read_text())["step"] == 6
    assert read_train_log(cfg.save_path, rank=1) != []
    assert [r["windows"] for r in _log(cfg)] == [[w] for w in range(6)]

    again = torchrun(cfg.model_copy(update={"max_steps": 9, "resume": True}))
    assert all(r["steps"] == 9 and r["cursor"] == 9 for r in again)
    assert again[0]["param_checksum"] == again[1]["param_checksum"]
    assert [r["step"] for r in _log(cfg)] == list(range(1, 10))


def test_sigterm_finishes_the_step_saves_and_exits_0(run: Run) -> None:
    """A real scripts/train.py process stopped with SIGTERM mid-training: the step in
    progress completes, a checkpoint holding that step and its cursor is saved, exit 0."""
    cfg = _cfg(run, "sigterm", checkpoint_every=10_000)
    argv = [sys.executable, *_script_argv(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while len(read_train_log(cfg.save_path)) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "trainer never logged 3 steps"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["interrupted"] is True and not summary["finished_stream"]
    steps = [r["step"] for r in _log(cfg)]
    assert steps == list(range(1, len(steps) + 1))  # no step lost or half-logged
    ckpt = latest_checkpoint(cfg.save_path)
    assert ckpt is not None and summary["checkpoint"] == str(ckpt)
    last = err.decode().strip().splitlines()[-1]  # names it, and how to continue
    assert last.endswith(f"{ckpt}; continue with --resume") and "sigterm: stopped at" in last
    state = json.loads((ckpt / "training_state.json").read_text())
    assert state["step"] == steps[-1] == summary["steps"]
    assert (state["stream"]["cursor"], state["stream"]["rows_done"]) != (0, 0)


def test_draft_vocab_size_trains_a_head_over_the_runs_most_used_tokens(run: Run) -> None:
    from safetensors import safe_open

    from fanout.coord.coordinator import Coordinator
    from fanout.data.draft_vocab import read_token_counts, select_draft_vocab
    from fanout.store.store import Store

    with Coordinator.open(run.run_dir) as co:
        stream_id = co.contract.stream_id
        window_rows = co.contract.window_rows
    stream = json.loads((run.run_dir / "stream.json").read_text())
    counts = read_token_counts(RunDir(run.run_dir).token_counts, stream_id)
    # Slow reference: the loss-masked tokens of the first epoch's rows, read back from
    # the window files (stream position < num_rows is epoch 0: every row exactly once).
    slow = torch.zeros(len(counts), dtype=torch.int64)
    store = Store(RunDir(run.run_dir))
    for name in window_names(store):
        with store.open(name) as r:
            for i in range(r.rows):
                if r.meta.window * window_rows + i < stream["num_rows"]:
                    ids, mask = r.get("input_ids")[i].long(), r.get("loss_mask")[i].bool()
                    slow += torch.bincount(ids[mask], minlength=len(counts))
    assert torch.equal(torch.from_numpy(counts), slow)

    n = int((counts > 0).sum()) // 2  # half of the tokens the drafts ever predict
    cfg = _cfg(run, "small-vocab", max_steps=30, draft_vocab_size=n)
    out = Trainer(cfg).run()
    assert out["steps"] == 30
    log = _log(cfg)
    assert _mean(log[-5:], "loss") < _mean(log[:3], "loss")
    ckpt = latest_checkpoint(cfg.save_path)
    assert ckpt is not None
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        kept = f.get_tensor("d2t") + torch.arange(n)
        assert f.get_tensor("lm_head.weight").shape[0] == n
    assert torch.equal(kept, select_draft_vocab(counts, n))
    dropped = torch.ones(len(counts), dtype=torch.bool)
    dropped[kept] = False
    assert counts[kept.numpy()].min() >= counts[dropped.numpy()].max()  # the most used ones
    resumed = Trainer(cfg.model_copy(update={"max_steps": 31, "resume": True}))
    assert resumed.state["step"] == 30  # same counts, same vocabulary: the checkpoint loads
    assert resumed.run()["steps"] == 31


def test_missing_token_counts_are_waited_for_visibly_then_named(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """--draft-vocab-size waits for the producer's token counts, saying so on stderr,
    and names the file when --acquire-timeout-s runs out."""
    from fanout.data.draft_vocab import TOKEN_COUNTS

    counts = run.run_dir / TOKEN_COUNTS
    aside = run.root / "counts.aside"
    counts.rename(aside)
    try:
        with pytest.raises(ConfigError, match=f"{TOKEN_COUNTS} is missing"):
            Trainer(_cfg(run, "no-counts", draft_vocab_size=100, acquire_timeout_s=1.5))
    finally:
        aside.rename(counts)
    assert "waiting for the producer's token counts" in capsys.readouterr().err


def test_kl_loss_trains_from_last_hidden_states_and_needs_them(run: Run) -> None:
    with pytest.raises(ConfigError, match=r"--loss-type kl trains on.*--store-last-hidden-states"):
        Trainer(_cfg(run, "kl-refused", max_steps=1, loss_type="kl"))
    # families whose recipe needs them are refused at start too, naming the producer flag
    for fam in ("dspark", "eagle3"):
        with pytest.raises(
            ConfigError, match=f"--draft-family {fam} trains on the verifier's final hidden "
            f"states, but .* --capture-for {fam} "
        ):  # fmt: skip
            Trainer(_cfg(run, f"{fam}-refused", max_steps=1, draft_family=fam))
    kl_run = run.root / "run-kl"
    Producer(_producer_cfg(run.root, kl_run, store_last_hidden_states=True)).run()
    # EAGLE-3 reads its own layers (vLLM's default: 0 and 1 of a 4-layer verifier, fanout
    # numbering); this run captured 1 and 2: refused, naming the missing one and the flag
    eagle = _cfg(run, "eagle3-layers", max_steps=1, draft_family="eagle3")
    with pytest.raises(
        ConfigError,
        match=r"eagle3 reads verifier layers \[0, 1\].*captured \[1, 2\] \(\[0\] missing\).*"
        "--capture-for eagle3",
    ):
        Trainer(eagle.model_copy(update={"run_dir": str(kl_run)}))
    cfg = _cfg(run, "kl", max_steps=30, loss_type="kl").model_copy(update={"run_dir": str(kl_run)})
    assert Trainer(cfg).run()["steps"] == 30
    log = _log(cfg)
    assert all(math.isfinite(r["loss"]) and r["loss"] >= -1e-4 for r in log)  # a KL
    assert _mean(log[-10:], "loss") < 0.8 * _mean(log[:3], "loss")
    assert _mean(log[-10:], "eal") > _mean(log[:3], "eal")
    ckpt = latest_checkpoint(cfg.save_path)
    assert ckpt is not None
    saved = json.loads((ckpt / "config.json").read_text())["fanout"]["draft_config"]
    assert saved["loss_type"] == "kl"


def test_logger_wandb_logs_every_step_and_the_producer_its_summary(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--logger wandb` (offline): rank 0's W&B run holds the same losses as the JSONL
    log, in the run dir's group; the producer's summary lands in the same group."""
    pytest.importorskip("wandb")
    from wandb_offline import read_offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(run, "wb", max_steps=4, logger="wandb", wandb_project="drafts")
    Trainer(cfg).run()
    (got,) = read_offline_runs(cfg.save_path)
    assert (got.project, got.group, got.name, got.job_type) == ("drafts", "run", "wb", "train")
    assert [h["loss"] for h in got.history] == [r["loss"] for r in _log(cfg)]
    assert [h["step"] for h in got.history] == [1, 2, 3, 4]
    assert got.config["consumer_id"] == "wb"
    other = run.root / "wb-run"
    summary = Producer(_producer_cfg(run.root, other, max_windows=2, wandb_project="drafts")).run()
    (prod,) = read_offline_runs(other)
    assert (prod.group, prod.name, prod.job_type) == ("wb-run", "producer-r0", "produce")
    assert prod.summary["windows"] == summary["windows"] == 2


def test_ema_is_served_resumed_exactly_and_checkpoints_kept_by_time(run: Run) -> None:
    """--ema-decay: model.safetensors holds the average, the resume file the raw weights
    and the average; a resumed run ends with the same average as one run through.
    --checkpoint-every-s saves by time, --keep-checkpoints bounds what stays."""
    from safetensors.torch import load_file

    n, m = 5, 4
    kw: dict[str, Any] = {"ema_decay": 0.8, "checkpoint_every": 1000}
    full = _cfg(run, "ema-full", max_steps=n + m, **kw)
    Trainer(full).run()
    part = _cfg(run, "ema-part", max_steps=n, **kw)
    Trainer(part).run()
    Trainer(part.model_copy(update={"max_steps": n + m, "resume": True})).run()
    a, b = (latest_checkpoint(c.save_path) for c in (full, part))
    assert a is not None and b is not None
    ra, rb = (load_file(str(p / "resume.safetensors")) for p in (a, b))
    avg = sorted(k for k in ra if k.startswith("ema.") and k != "ema.updates")
    assert avg and int(ra["ema.updates"]) == n + m == int(rb["ema.updates"])
    for k in avg:
        torch.testing.assert_close(ra[k], rb[k], rtol=0, atol=0)  # resumed exactly
    served = load_file(str(a / "model.safetensors"))
    moved = 0
    for k in avg:
        name = k.removeprefix("ema.")
        assert torch.equal(served[name], ra[k].to(torch.bfloat16)), name  # the average
        moved += not torch.equal(served[name], ra[f"w.{name}"].to(torch.bfloat16))
    assert moved, "the served weights are the raw ones: no average was taken"
    timed = _cfg(run, "timed", max_steps=5, checkpoint_every=1000, checkpoint_every_s=1e-6,
                 keep_checkpoints=3)  # fmt: skip
    Trainer(timed).run()
    kept = sorted(p.name for p in Path(timed.save_path).glob("checkpoint-*"))
    assert kept == [f"checkpoint-{s:08d}" for s in (3, 4, 5)], kept


def test_a_used_save_path_is_resumed_or_refused_never_pruned_away(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer restarted without --resume on a --save-path that holds checkpoints 8 and
    12 used to train from step 0, log "saved a checkpoint at step 6", exit 0 — and that
    checkpoint was already gone (pruning keeps the highest step names). Now it is refused
    at start in one line naming both ways out, and nothing there changes; --resume on a
    first start (no checkpoint yet) is a fresh start."""
    from fanout.train import trainer as train

    first = _cfg(run, "reuse", max_steps=12, checkpoint_every=4)
    Trainer(first).run()
    save = Path(first.save_path)
    before = sorted(p.name for p in save.glob("checkpoint-*"))
    assert before == ["checkpoint-00000008", "checkpoint-00000012"]
    capsys.readouterr()
    rc = train.main(config_flags(first.model_copy(update={"max_steps": 6})))
    out, err = capsys.readouterr()
    after = sorted(p.name for p in save.glob("checkpoint-*"))
    assert rc == 1, f"trained from step 0 on a used --save-path: {out[-300:]!r}; kept {after}"
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert f"--save-path {save}" in line and "checkpoint-00000012" in line, line
    assert "--resume" in line and "another --save-path" in line, line
    assert after == before
    fresh = _cfg(run, "resume-first", max_steps=2, resume=True)
    assert Trainer(fresh).run()["steps"] == 2  # nothing to resume: from the start


def test_a_resume_is_checked_against_the_checkpoints_training_config(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint records the trainer's whole validated config (training_config.json).
    A resume that would not continue it exactly (another --seed, --lr) is refused before
    anything is built, naming each differing flag with both values; a longer --max-steps
    is named in a log line and resumes; a checkpoint written before the config was
    recorded resumes unchecked, with a warning."""
    cfg = _cfg(run, "recorded", max_steps=3, seed=5)
    Trainer(cfg).run()
    ckpt = latest_checkpoint(cfg.save_path)
    assert ckpt is not None
    rec = json.loads((ckpt / "training_config.json").read_text())
    assert (rec["seed"], rec["rows_per_step"], rec["lr"]) == (5, 2, 1e-2)
    assert TrainConfig.model_validate(rec).recorded() == rec == cfg.recorded()
    again = cfg.model_copy(update={"resume": True, "max_steps": 4})
    with pytest.raises(ConfigError) as e:
        Trainer(again.model_copy(update={"seed": 6, "lr": 0.02}))
    msg = str(e.value)
    assert "--seed 6 (the checkpoint's: 5)" in msg and "--lr 0.02 (the checkpoint's: 0.01)" in msg
    assert "--max-steps" not in msg and "another --save-path" in msg and "\n" not in msg
    assert latest_checkpoint(cfg.save_path) == ckpt  # nothing was trained or written
    with caplog.at_level(logging.INFO):
        t = Trainer(again)
    assert t.state["step"] == 3 and t.run()["steps"] == 4
    assert any("--max-steps 4 (the checkpoint's: 3)" in r.getMessage() for r in caplog.records)
    # a checkpoint from before training_config.json: resumed, with a warning saying so
    old = latest_checkpoint(cfg.save_path)
    assert old is not None and old.name == "checkpoint-00000004"
    (old / "training_config.json").unlink()
    caplog.clear()
    t = Trainer(again.model_copy(update={"max_steps": 5, "seed": 6}))
    assert t.state["step"] == 4 and t.run()["steps"] == 5
    (warned,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "records no training config" in warned.getMessage()
