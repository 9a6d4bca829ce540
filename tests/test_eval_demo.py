"""The demo's eval prompts: enough held-out conversations, none from the training corpus.

.venv/bin/python -m pytest tests/test_eval_demo.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

from fanout.bench.assets import generate_corpus
from fanout.bench.config import AssetsSpec
from fanout.bench.demo import DEMO_EVAL_MAX_PROMPTS, heldout_prompts


def _rows(path: Path) -> list[str]:
    return [json.dumps(json.loads(x), sort_keys=True) for x in path.read_text().splitlines()]


def test_demo_eval_gets_all_its_heldout_prompts(tmp_path: Path) -> None:
    # the demo's corpus (assets seed 0, its default size): heldout_prompts silently
    # returns fewer than asked when the generator runs out of unseen conversations,
    # which would leave the eval short of prompts to bring τ to ±0.1
    train = tmp_path / "chat.jsonl"
    generate_corpus(AssetsSpec().demo_conversations, seed=0, out_path=train)
    held = heldout_prompts([str(train)], tmp_path / "heldout.jsonl", n=DEMO_EVAL_MAX_PROMPTS)
    rows = _rows(held)
    assert len(rows) == DEMO_EVAL_MAX_PROMPTS
    assert not set(rows) & set(_rows(train))
    # mostly distinct: repeats would add steps without adding independent prompts
    assert len(set(rows)) >= 0.95 * DEMO_EVAL_MAX_PROMPTS
