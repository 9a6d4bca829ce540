"""The tiny run the producer, consumer, trainer and fp8 tests share.

A BPE tokenizer (512 tokens) and a random tiny Qwen3 (hidden 32, 4 layers, tied
embeddings) built from a chat corpus under `root`, saved with `save_pretrained`, and
a producer config over them; each test module adds its own settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from fanout.bench.assets import (
    build_tokenizer,
    generate_corpus,
    tiny_verifier_for_tokenizer,
    write_jsonl,
)
from fanout.families.dflash.model import DFlashDraft
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer

# a test's child processes: one intra-op thread (2 shared cores), output as it is written
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def build_tiny_assets(
    root: Path, corpus: list[dict[str, Any]], tokenizer_corpus: list[dict[str, Any]] | None = None
) -> tuple[Path, Path, Path]:
    """(data, tokenizer dir, verifier dir) under `root`: chat.jsonl, tok/, verifier/."""
    data = write_jsonl(root / "chat.jsonl", corpus)
    tok = build_tokenizer(root / "tok", tokenizer_corpus or corpus, 512)
    ver = tiny_verifier_for_tokenizer(
        root / "verifier", tok, hidden_size=32, num_layers=4, tie_word_embeddings=True
    )
    return data, tok, ver


@dataclass(frozen=True)
class TinyAssets:
    """The tiny run's inputs under `root` (`tiny_assets`)."""

    root: Path
    data: Path
    tokenizer: Path
    verifier: Path


def tiny_assets(root: Path, records: int = 60, seed: int = 0) -> TinyAssets:
    """`build_tiny_assets` over `records` generated chats (`generate_corpus`, `seed`)."""
    return TinyAssets(root, *build_tiny_assets(root, generate_corpus(records, seed=seed)))


def tiny_producer_config(root: Path, run_dir: Path, **kw: Any) -> ProducerConfig:
    """A producer over the assets `build_tiny_assets(root, ...)` made; `kw` overrides."""
    base: dict[str, Any] = dict(
        run_dir=str(run_dir),
        verifier_name_or_path=str(root / "verifier"),
        data=[str(root / "chat.jsonl")],
        tokenizer=str(root / "tok"),
        seq_len=96,
        window_rows=4,
        capture_layer_ids=[1, 2],
        workers=1,
        progress=False,
        exit_when_idle_s=0,
    )
    return ProducerConfig(**(base | kw))


def tiny_dflash(vdir: Path, seed: int = 1, **kw: Any) -> DFlashDraft:
    """A one-layer DFlash draft (block 4, 8 anchors, mask token 255) over layers 1 and 2
    of a tiny verifier, its init seeded with `seed`; `kw` overrides its fields."""
    torch.manual_seed(seed)
    fields: dict[str, Any] = {"target_layer_ids": [1, 2], "num_layers": 1, "block_size": 4,
                              "max_anchors": 8, "mask_token_id": 255}  # fmt: skip
    return DFlashDraft.from_verifier(vdir, **(fields | kw))


def produced_run(root: Path, **kw: Any) -> Path:
    """`root` with the tiny assets of 60 chats and the whole stream a `Producer` wrote
    over them under `root / "run"` (`kw`: producer config overrides); returns `root`."""
    tiny_assets(root)
    Producer(tiny_producer_config(root, root / "run", **kw)).run()
    return root


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """2 shared cores: intra-op threads only add contention for these tiny tensors."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def config_flags(cfg: BaseModel) -> list[str]:
    """The command-line flags that give a subcommand every set field of `cfg`."""
    return to_flags(type(cfg), cfg.model_dump(exclude_none=True))


def wait_for(pred: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.005) -> Any:
    """Poll `pred` until it returns something truthy (returned); fail after `timeout` s."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)
    return got


def run_recorder(
    script: Path, args: dict[str, Any], until: Callable[[], Any] | None = None
) -> None:
    """Runs the `RECORDER` consumer at `script` with `args` (a checkpoint every 3 steps):
    with `until`, slowly (0.05 s a step) and SIGKILLed once `until()` holds, a crash
    mid-stream; without, at full speed to the stream's end (exit 0)."""
    cmd = [sys.executable, str(script)]
    if until is None:
        p = subprocess.Popen([*cmd, json.dumps(args | {"sleep": 0.0, "every": 3})], env=ENV)
        assert p.wait(120) == 0
        return
    p = subprocess.Popen([*cmd, json.dumps(args | {"sleep": 0.05, "every": 3})], env=ENV)
    try:
        wait_for(lambda: until() or p.poll() is not None, 120, "rows")
        p.send_signal(signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()


# A consumer process (`python recorder.py JSON`) that records every row it is handed, one
# JSON line per row {"pid", "w", "i", "h": xxh3 of the row's hidden states}, acks after
# each "step" of `sleep` s and writes a checkpoint {cursor, rows_done, seen} every `every`
# steps (atomically, like a trainer); with a checkpoint it resumes from it. JSON keys:
# run_dir, out, ckpt, sleep, every, and cfg (ConsumerConfig fields: consumer_id, ...).
RECORDER = """
import json, os, sys, time
import torch, xxhash
torch.set_num_threads(1)
from fanout.train.consumer import ConsumerConfig, ConsumerStream
a = json.loads(sys.argv[1])
ckpt = a["ckpt"]
state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"cursor": None, "rows_done": 0,
                                                              "seen": 0}
cfg = ConsumerConfig(run_dir=a["run_dir"], heartbeat_s=0.3, acquire_timeout_s=60, **a["cfg"])
out = open(a["out"], "a")
seen = state["seen"]
s = ConsumerStream(cfg)
s.load_state_dict(state)
with s:
    for step, b in enumerate(s.batches(1), 1):
        for k, (w, i) in enumerate(b.rows):
            raw = b.tensors["hidden_states"][k].contiguous().view(torch.uint8).numpy().tobytes()
            h = xxhash.xxh3_64_hexdigest(raw)
            out.write(json.dumps({"pid": os.getpid(), "w": w, "i": i, "h": h}) + "\\n")
        out.flush()
        time.sleep(a["sleep"])
        s.ack(b)
        seen += len(b.rows)
        if step % a["every"] == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump(s.state_dict() | {"seen": seen}, f)
            os.replace(ckpt + ".tmp", ckpt)
"""
