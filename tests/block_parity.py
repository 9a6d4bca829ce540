"""The block families' comparisons with speculators 0.9.0, written once (DFlash in
tests/test_speculators.py, DFlash2, DSpark and XPress in tests/test_family_<name>.py):
one packed row's layout and anchors, both sides' anchor draws patched to them, the
verifier rows whose labels follow fanout's capture rule, speculators' forward on them
and the per-slot counts; each module imports it as `block`.

    import block_parity as block
    batch, pre = block.rows(vdir, block.packed_row(), seed, width, plant)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.model.verifier_dir import read_verifier_tensors


def packed_row(
    first_doc: int = 22, prompt: int = 3, hole: int | None = 10, seq_len: int = 40
) -> dict[str, torch.Tensor]:
    """One packed row [1, T = `seq_len`]: document 0 = [0, first_doc), document 1 = the
    rest; each document's first `prompt` tokens unsupervised, plus an unsupervised `hole`
    (the loss tests' row layout)."""
    T = seq_len
    doc = torch.tensor([0] * first_doc + [1] * (T - first_doc))[None]
    pos = torch.cat([torch.arange(first_doc), torch.arange(T - first_doc)])[None]
    lm = torch.ones(1, T, dtype=torch.long)
    lm[0, :prompt] = 0
    lm[0, first_doc : first_doc + prompt] = 0
    if hole is not None:
        lm[0, hole] = 0
    return {"document_ids": doc, "position_ids": pos, "loss_mask": lm}


def anchor_rows(*valid_anchors: int, pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [1, A], valid [1, A]) of `valid_anchors` and `pad` padding anchors (fanout
    pads with anchor 0)."""
    a = torch.tensor([[*valid_anchors] + [0] * pad])
    v = torch.tensor([[True] * len(valid_anchors) + [False] * pad])
    return a, v


def patch_anchors(
    monkeypatch: pytest.MonkeyPatch, anchors: torch.Tensor, valid: torch.Tensor
) -> None:
    """Both sides use exactly these anchors: fanout's select_anchors (as the block
    drafter, fanout.model.block_draft, imports it) returns them [B, A]; speculators' (as
    its DFlash core imports it: DSpark and XPress inherit DFlash's `_backbone_forward`)
    gets them as one packed row [A]."""
    from fanout.model import block_draft

    core = pytest.importorskip("speculators.models.dflash.core")
    monkeypatch.setattr(block_draft, "select_anchors", lambda *a, **k: (anchors, valid))
    monkeypatch.setattr(
        core, "select_anchors", lambda loss_mask, n, bs: (anchors.flatten(), valid.flatten())
    )


# ---- the loss comparisons: the same rows and anchors on both sides, speculators'
# forward, the per-slot counts

Row = dict[str, torch.Tensor]  # a fanout batch row by tensor name ([1, T, ...] each)
Rows = tuple[Row, torch.Tensor]  # (fanout's row, speculators' pre-norm verifier states)

# The loss cases the block families compare: name -> (fanout config update, speculators'
# loss name, its per-position weighting)
LOSS_CASES = {
    "ce-exp": ({"loss_type": "ce", "loss_weighting": "exp"}, "ce", "fixed-exp-decay"),
    "ce-dpace": ({"loss_type": "ce", "loss_weighting": "dpace"}, "ce", "dpace"),
    "kl-exp": ({"loss_type": "kl", "loss_weighting": "exp"}, "kl_div", "fixed-exp-decay"),
}

# plant(batch, pre, head, norm weight, generator): sets the pre-norm verifier states of
# the slots whose greedy token must be the draft's own (norm(c·x / w) ∝ x for c > 0)
Plant = Callable[[Row, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], None]


def rows(
    vdir: Path, layout: dict[str, torch.Tensor], seed: int, width: int, plant: Plant,
    mask_token: int = 255, eps: float = 1e-5,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """A fanout batch row over `layout` (`packed_row`) and the matching pre-norm verifier
    states for speculators: random context `[1, T, width]`, tokens below `mask_token` and
    pre-norm states, except the slots `plant` sets (so per-slot accuracies and EAL
    prefixes see hits and misses). `target_ids[p] = argmax(lm_head(norm(pre[p])))`,
    fanout's capture rule; fanout's `last_hidden_states` are the normed states (HF
    `last_hidden_state`), speculators' the pre-norm ones."""
    vt = read_verifier_tensors(vdir, ["lm_head.weight", "model.norm.weight"])
    head, w = vt["lm_head.weight"], vt["model.norm.weight"]
    t, hidden = layout["loss_mask"].shape[1], head.shape[1]
    g = torch.Generator().manual_seed(seed)
    batch = {
        "hidden_states": torch.randn(1, t, width, generator=g),
        "input_ids": torch.randint(0, mask_token, (1, t), generator=g),
        **layout,
    }
    pre = 2.0 * torch.randn(1, t, hidden, generator=g)
    with torch.no_grad():
        plant(batch, pre, head, w, g)
    post = F.rms_norm(pre, (hidden,), w, eps=eps)
    batch["target_ids"] = (post @ head.t()).argmax(-1)
    batch["last_hidden_states"] = post
    return batch, pre


def forward(
    model: Any, batch: dict[str, torch.Tensor], pre: torch.Tensor, n_anchors: int, **kw: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """speculators' block-draft `forward` on fanout's row (its verifier states pre-norm):
    (loss, metrics); `kw`: the family's loss arguments."""
    _, loss, metrics = model(
        hidden_states=batch["hidden_states"], input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"], verifier_last_hidden_states=pre,
        document_ids=batch["document_ids"], position_ids=batch["position_ids"],
        max_anchors=n_anchors, **kw,
    )  # fmt: skip
    return loss, metrics


def backbone(model: Any, batch: dict[str, torch.Tensor], pre: torch.Tensor, n_anchors: int) -> Any:
    """speculators' `_backbone_forward` on fanout's row: (hidden, logits, targets, slot
    mask, token indices), each of its blocks' slots flattened into one row."""
    return model._backbone_forward(
        batch["hidden_states"], batch["input_ids"], batch["loss_mask"], pre,
        batch["document_ids"], batch["position_ids"], max_anchors=n_anchors,
    )  # fmt: skip


def loss_case(case: str, eager: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`LOSS_CASES[case]` as (fanout's config update, speculators' forward arguments: its
    eager loss and per-position weighting; `eager`: speculators.losses.eager)."""
    update, name, weighting = LOSS_CASES[case]
    loss = getattr(eager, f"{name}_loss")
    return update, {"loss_config": {name: (loss, 1.0)}, "per_position_loss_weight": weighting}


def losses(
    draft: Any, model: Any, rows: tuple[dict[str, torch.Tensor], torch.Tensor],
    anchors: torch.Tensor, valid: torch.Tensor, monkeypatch: pytest.MonkeyPatch, **kw: Any,
) -> tuple[Any, torch.Tensor, dict[str, Any]]:  # fmt: skip
    """fanout's loss of `draft` and speculators' (`forward`, `kw`) of `model` on the same
    `rows` (batch, pre-norm states) and anchors (both sides' draws patched to them), each
    backward run: (fanout's LossOutput, speculators' loss, its metrics)."""
    batch, pre = rows
    patch_anchors(monkeypatch, anchors, valid)
    fan = draft.loss(batch, None)
    fan.loss.backward()
    loss, metrics = forward(model, batch, pre, anchors.shape[1], **kw)
    loss.backward()
    return fan, loss, metrics


def assert_grads_equal(draft: Any, model: Any, scale: float) -> None:
    """Every parameter gradient of fanout's fused linear CE/KL backward equals
    speculators' plain autograd one times `scale` (its n + eps denominator undone)."""
    spec_params = dict(model.named_parameters())
    for k, p in draft.named_parameters():
        assert p.grad is not None, k
        g_spec = spec_params[k].grad
        assert g_spec is not None, k
        # fp32 sums in another order: observed up to 3e-6 of the largest entry (KL)
        tol = 1e-5 * float(g_spec.abs().max())
        torch.testing.assert_close(p.grad, g_spec * scale, rtol=1e-4, atol=tol, msg=k)


def assert_slot_counts(fan: Any, metrics: dict[str, Any], bs: int, first: int) -> None:
    """fanout's per-slot supervised counts and accuracies are speculators'
    `position_{k}_acc_*` for k = `first` .. bs - 1 (fanout's slot k - `first`: DFlash's
    slot 0 is the anchor, its first prediction speculators' position 1)."""
    for k in range(first, bs):
        count = int(fan.per_slot_count[k - first])
        assert int(metrics[f"position_{k}_acc_total"]) == count, k
        hits = float(fan.per_slot_acc[k - first]) * count
        assert abs(float(metrics[f"position_{k}_acc_sum"]) - hits) < 1e-3, k
