"""`fanout regenerate`'s embedded engine with every verifier of the zoo: a batch of
left-padded prompts answers exactly as each prompt alone.

.venv/bin/python -m pytest tests/test_regen_zoo.py -x -q

Left padding is where architectures differ: attention layers mask the pad tokens, but
a linear-attention layer (Qwen3-Next, Qwen3.5) runs its recurrent state and its
convolution through them — transformers zeroes their inputs, which leaves the state
at zero, so the padded row starts where it would alone. Checked here rather than
argued: HFEngine (fanout.regen.hf) with batches of 4 prompts of 3-21 tokens against
batches of 1, greedy and sampled (each row's own seeded generator), for every zoo
architecture (tests/verifier_zoo.py: sliding windows and chunks of 8 tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.model.verifier import load_verifier
from fanout.regen.engine import RegenOptions, Request
from fanout.regen.hf import HFEngine
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import VOCAB, ZOO, build

EOS = VOCAB - 1


class IdsTokenizer:
    """The zoo has no tokenizer: a message's content is its token ids, space-separated,
    and the chat template adds nothing."""

    name_or_path = "ids"
    pad_token_id = 0
    eos_token_id = EOS
    padding_side = "right"

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return str(messages[-1]["content"])

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(t) for t in ids)


@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_batched_generation_equals_one_prompt_at_a_time(arch: str, tmp_path: Path) -> None:
    v = load_verifier(build(arch, tmp_path / arch), device="cpu", capture_layer_ids="all")
    g = torch.Generator().manual_seed(7)
    requests = [
        Request((i, 1), [{"role": "user", "content": " ".join(
            str(t) for t in torch.randint(1, EOS, (n,), generator=g).tolist())}], None, 100 + i)
        for i, n in enumerate((3, 9, 14, 21))
    ]  # fmt: skip
    for temperature in (0.0, 1.0):
        answers = {
            b: HFEngine(v, IdsTokenizer(), RegenOptions(
                temperature=temperature, max_new_tokens=16, regen_batch_size=b)).generate(requests)
            for b in (4, 1)
        }  # fmt: skip
        assert all(a.error is None for a in answers[4]), answers[4]
        assert answers[4] == answers[1], (arch, temperature)
