"""DFlash anchors and the block attention mask (pure tensor functions, no parameters).

    from fanout.model.anchors import select_anchors, block_attention_mask
    anchors, valid = select_anchors(loss_mask, document_ids, max_anchors=64, block_size=8,
                                    generator=torch.Generator().manual_seed(0))
    mask = block_attention_mask(document_ids, anchors, valid, block_size=8)  # [B,1,A·bs,T+A·bs]

Anchor rule (per row, redrawn every step from the caller's generator):
- a position p is a candidate when `loss_mask[p]` is on, `p < T - block_size` (so the
  whole block p..p+bs-1 lies inside the row), and slot 1 is supervised
  (`loss_mask[p+1]` on and `document_ids[p+1] == document_ids[p]`) — an anchor whose
  first draft slot has no label could only ever contribute zero loss;
- up to `max_anchors` candidates are drawn uniformly without replacement and sorted;
  rows with fewer candidates are padded with `valid=False` slots (anchor 0).
A block may run past the end of its anchor's document: those slots stay in the block
(the engine drafts them too) but carry no loss (`slot_supervision`).

Mask (same semantics as the speculators `create_anchor_block_mask_mod` and SpecForge's
`create_dflash_block_mask`): queries of block j see
- context positions t with `t < anchor_j` (strictly before: the context hidden state at
  t summarises tokens <= t, and at inference the verifier has not yet run the anchor
  token — it is the verifier's bonus token, which enters the draft as slot 0 of the
  block instead) and `document_ids[t] == document_ids[anchor_j]`;
- every slot of their own block (bidirectional);
- never another block. Padding blocks see only themselves (no all-masked query rows,
  which SDPA would turn into NaN).
"""

from __future__ import annotations

import torch


def select_anchors(
    loss_mask: torch.Tensor,  # [B, T] (any dtype; nonzero = supervised)
    document_ids: torch.Tensor,  # [B, T]
    max_anchors: int,
    block_size: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw sorted anchors per row. Returns `(anchors [B, A] int64, valid [B, A] bool)`
    with `A = max_anchors`; see the module docstring for the rule."""
    b, t = loss_mask.shape
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)  # [B, T]
    last = t - block_size  # exclusive upper bound for anchors
    if last > 0:
        same_doc_next = document_ids[:, 1 : last + 1] == document_ids[:, :last]
        cand[:, :last] = lm[:, :last] & lm[:, 1 : last + 1] & same_doc_next
    anchors = torch.zeros(b, max_anchors, dtype=torch.long)
    valid = torch.zeros(b, max_anchors, dtype=torch.bool)
    cand_cpu = cand.cpu()
    for r in range(b):
        pos = torch.nonzero(cand_cpu[r]).squeeze(1)  # [n]
        if pos.numel() > max_anchors:
            pick = torch.randperm(pos.numel(), generator=generator)[:max_anchors]
            pos = pos[pick].sort().values
        anchors[r, : pos.numel()] = pos
        valid[r, : pos.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row positions of every block slot: `[B, A, bs]` = anchor + k."""
    offs = torch.arange(block_size, device=anchors.device)
    return anchors[:, :, None] + offs  # [B, A, bs]


def block_attention_mask(
    document_ids: torch.Tensor,  # [B, T]
    anchors: torch.Tensor,  # [B, A]
    valid: torch.Tensor,  # [B, A]
    block_size: int,
) -> torch.Tensor:
    """Boolean SDPA mask `[B, 1, A·bs, T + A·bs]` (True = may attend); keys are the
    T context positions followed by the A·bs block slots."""
    b, t = document_ids.shape
    a = anchors.shape[1]
    anchor_doc = document_ids.gather(1, anchors)  # [B, A]
    ctx_pos = torch.arange(t, device=anchors.device)
    ctx = (
        (ctx_pos[None, None, :] < anchors[:, :, None])
        & (document_ids[:, None, :] == anchor_doc[:, :, None])
        & valid[:, :, None]
    )  # [B, A, T]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, A·bs, T]
    blk_id = torch.arange(a * block_size, device=anchors.device) // block_size  # [A·bs]
    own = (blk_id[:, None] == blk_id[None, :]).expand(b, -1, -1)  # [B, A·bs, A·bs]
    return torch.cat([ctx, own], dim=2)[:, None]  # [B, 1, A·bs, T + A·bs]


def slot_supervision(
    loss_mask: torch.Tensor,  # [B, T]
    document_ids: torch.Tensor,  # [B, T]
    anchors: torch.Tensor,  # [B, A]
    valid: torch.Tensor,  # [B, A]
    block_size: int,
) -> torch.Tensor:
    """Which slots carry a loss: `[B, A, bs]` bool. Slot 0 (the anchor's own, known token)
    never does; slot k >= 1 does when its position is supervised and in the anchor's
    document, and the block is a real (valid) one."""
    t = loss_mask.shape[1]
    pos = block_positions(anchors, block_size).clamp(max=t - 1)  # [B, A, bs]
    flat = pos.flatten(1)  # [B, A·bs]
    sup = loss_mask.bool().gather(1, flat).view_as(pos)
    same = document_ids.gather(1, flat).view_as(pos) == document_ids.gather(1, anchors)[:, :, None]
    sup = sup & same & valid[:, :, None]
    sup[:, :, 0] = False
    return sup
