"""A draft trained briefly on the verifier's own greedy continuations: the family tests'
decoding fixtures (trained, decoding accepts drafts and rolls back rejected ones).

    batch = greedy_batch(decoder)   # 8 rows: a 6-token prompt + the verifier's 42 greedy tokens
    losses = fit(draft, batch, lr=3e-3, steps=60, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.decode.spec_decode import Decoder
from fanout.model.verifier import load_verifier
from fanout.ops.adamw import make_optimizer

EOS = 255  # the end of sequence of the `decoder` fixture


@pytest.fixture(scope="module")
def vdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (vocabulary 256, hidden 32, 4 layers) to decode with (the `decoder`
    fixture's; a module takes both with `from greedy_training import decoder, vdir`)."""
    return tiny_qwen3_verifier(
        tmp_path_factory.mktemp("v"), 256, hidden_size=32, num_layers=4, head_dim=8
    )


@pytest.fixture(scope="module")
def decoder(vdir: Path) -> Decoder:
    """Decoding on `vdir`, its layers 1-3 captured, ending at `EOS`."""
    v = load_verifier(vdir, device="cpu", capture_layer_ids=[1, 2, 3], num_draft_layers=None)
    return Decoder(v, {EOS})


def prompt_ids(n: int, seed: int) -> list[int]:
    """`n` token ids in [0, 250) drawn from `seed` (the tests' tiny vocabulary)."""
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_rows(decoder: Decoder) -> torch.Tensor:
    """[8, 48]: 8 prompts (6 tokens, seeds 100..107), each followed by its 42-token
    greedy continuation by `decoder`'s verifier."""
    greedy = Decoder(decoder.verifier, set()).greedy
    return torch.tensor([prompt_ids(6, 100 + s) + greedy(prompt_ids(6, 100 + s), 42).tokens
                         for s in range(8)])  # fmt: skip


def greedy_batch(decoder: Decoder) -> dict[str, torch.Tensor]:
    """A training batch of `greedy_rows`, captured by the verifier (its layers' and last
    hidden states), every token supervised, one document a row."""
    ids = greedy_rows(decoder)
    b, t = ids.shape
    pos, doc = torch.arange(t).expand(b, t), torch.zeros(b, t, dtype=torch.long)
    cap = decoder.verifier.capture(ids, pos, doc)
    assert cap.last_hidden_states is not None
    return {
        "hidden_states": cap.hidden_states.float(), "input_ids": ids,
        "target_ids": cap.target_ids.long(), "last_hidden_states": cap.last_hidden_states.float(),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8), "document_ids": doc, "position_ids": pos,
    }  # fmt: skip


def fit(
    draft: Any, batch: dict[str, torch.Tensor], *, lr: float, steps: int,
    generator: torch.Generator | None,
) -> list[float]:  # fmt: skip
    """`steps` fused-AdamW steps of `draft` on `batch` at `lr`, then `draft.eval()`; the
    loss of every step."""
    opt, _ = make_optimizer(draft.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = draft.loss(batch, generator)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    draft.eval()
    return losses


__all__ = ["fit", "greedy_batch", "greedy_rows", "prompt_ids"]
