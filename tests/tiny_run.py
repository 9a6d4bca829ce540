"""The tiny run the producer, consumer, trainer and fp8 tests share.

A BPE tokenizer (512 tokens) and a random tiny Qwen3 (hidden 32, 4 layers, tied
embeddings) built from a chat corpus under `root`, saved with `save_pretrained`, and
a producer config over them; each test module adds its own settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from fanout.bench.assets import build_tokenizer, tiny_verifier_for_tokenizer, write_jsonl
from fanout.produce.producer import ProducerConfig


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


def tiny_producer_config(root: Path, run_dir: Path, **kw: Any) -> ProducerConfig:
    """A producer over the assets `build_tiny_assets(root, ...)` made; `kw` overrides."""
    base: dict[str, Any] = dict(
        run_dir=str(run_dir),
        verifier_name_or_path=str(root / "verifier"),
        data=[str(root / "chat.jsonl")],
        tokenizer=str(root / "tok"),
        seq_len=96,
        window_rows=4,
        target_layer_ids=[1, 2],
        workers=1,
        progress=False,
        exit_when_idle_s=0,
    )
    return ProducerConfig(**(base | kw))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """2 shared cores: intra-op threads only add contention for these tiny tensors."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def config_flags(cfg: BaseModel) -> list[str]:
    """The command-line flags that give a subcommand every set field of `cfg`."""
    out: list[str] = []
    for k, v in cfg.model_dump(exclude_none=True).items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, dict):  # --role-map a=b,c=d (a bare flag: the empty map)
            out += [flag, *(f"{a}={b}" for a, b in v.items())]
        else:
            out += [flag, *map(str, v if isinstance(v, list | tuple) else [v])]
    return out


def wait_for(pred: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.005) -> Any:
    """Poll `pred` until it returns something truthy (returned); fail after `timeout` s."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)
    return got
