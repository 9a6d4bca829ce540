"""Recurrent token mixers run over packed rows, their state reset at each document start.

    from fanout.model.varlen_layers import find_mixers, packed_mixers
    mixers = find_mixers(text_model.layers, rule)  # {layer index: module}, or None
    layout = SegmentLayout.from_document_ids(document_ids)  # [B, T] rows, −1 on padding
    with packed_mixers(mixers, layout):
        out = text_model(input_ids=ids, attention_mask=masks, position_ids=pos)

A linear-attention layer (the gated delta rule of Qwen3-Next / Qwen3.5, Nemotron-H's
Mamba-2, each with a causal conv1d before it), a short-convolution layer (LFM2's
`conv`) and the Mamba-2 half of a `hybrid` layer (Falcon-H1: attention and Mamba-2 in
parallel) carry a state from token to token. Over a packed row its forward in
transformers would carry one document's state into the next (its torch fallback has
no boundary input; fanout.ops.varlen_scan says why), so fanout.model.layer_types
gives such a layer a rule only where a forward of ours runs it instead: inside
`packed_mixers` the mixer module of every recurrent layer runs `FORWARDS[its class]`,
the module's own projections and norms around fanout.ops.varlen_scan's scans, which
restart at every document (`SegmentLayout`, built once per batch of rows). The
attention layers see only their own document too (fanout.model.packed_attention where
they are all full attention, else their dense masks); the rows take one forward.

Which mixers have a forward here is a table of transformers classes (`FORWARDS`):
each entry re-states that class's forward (transformers 5.25) with the two scans
swapped for their varlen forms, so a class is added only with its own forward read.
A verifier with a recurrent layer whose mixer is not in it (another gated delta rule
variant, another Mamba mixer) gets None from `find_mixers`, and its rows run each document
alone (exact, slower; fanout.model.documents).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from fanout.model.layer_types import ALONE_TYPES, PackingRule
from fanout.ops.varlen_scan import (
    CHUNK,
    SegmentLayout,
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    ssd_varlen,
)

# layer types whose mixer must be one of FORWARDS' classes for the rows to be packed
RECURRENT_TYPES = ALONE_TYPES


def gated_delta_net(m: Any, layout: SegmentLayout, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next / Qwen3.5 `…GatedDeltaNet.forward` over packed rows [B, T, H] → [B, T, H]:
    projections, causal conv1d (silu), gated delta rule with l2-normed q and k, gated
    RMS norm, output projection, as transformers has them; both scans reset per document."""
    x = hidden_states
    b, t, _ = x.shape
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z interleaved per key head
        q, k, v, z, beta_in, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
        mixed = torch.cat([y.reshape(b, t, -1) for y in (q, k, v)], dim=-1)  # [B, T, conv_dim]
    else:  # Qwen3.5: one projection each
        mixed = m.in_proj_qkv(x)  # [B, T, conv_dim]
        z = m.in_proj_z(x).reshape(b, t, -1, m.head_v_dim)  # [B, T, Hv, dv]
        beta_in, a = m.in_proj_b(x), m.in_proj_a(x)  # [B, T, Hv] each
    weight = m.conv1d.weight.squeeze(1)  # [conv_dim, K]
    mixed = causal_conv1d_varlen(
        mixed.transpose(1, 2), weight, m.conv1d.bias, layout, activation=m.activation
    ).transpose(1, 2)  # [B, T, conv_dim]
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(b, t, -1, m.head_k_dim)  # [B, T, Hk, dk]
    k = k.reshape(b, t, -1, m.head_k_dim)
    v = v.reshape(b, t, -1, m.head_v_dim)  # [B, T, Hv, dv]
    beta = beta_in.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # [B, T, Hv] ≤ 0
    o = gated_delta_rule_varlen(q, k, v, g, beta, layout)  # [B, T, Hv, dv]
    o = m.norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(b, t, -1)
    return m.out_proj(o)


def short_conv(m: Any, layout: SegmentLayout, hidden_states: torch.Tensor) -> torch.Tensor:
    """LFM2's `…ShortConv.forward` (LFM2, LFM2-MoE, LFM3) over packed rows [B, T, H] →
    [B, T, H]: in_proj into gates B, C and input x, the depthwise causal conv of B·x (no
    activation) reset per document, C times it, out_proj."""
    bcx = m.in_proj(hidden_states).transpose(-1, -2)  # [B, 3H, T]
    b_gate, c_gate, x = bcx.chunk(3, dim=-2)  # [B, H, T] each
    y = causal_conv1d_varlen(b_gate * x, m.conv.weight.squeeze(1), m.conv.bias, layout)
    y = (c_gate * y).transpose(-1, -2).contiguous()  # [B, T, H]
    return m.out_proj(y)


def mamba2_mixer(m: Any, layout: SegmentLayout, hidden_states: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's `NemotronHMamba2Mixer.forward` and Falcon-H1's `FalconH1Mixer.forward`
    (their torch path, as at inference) over packed rows [B, T, H] → [B, T, H]: in_proj
    into gate, x·B·C and dt (Falcon-H1: the input scaled by `ssm_in_multiplier`, the
    projection by `mup_vector`); the causal conv1d (its activation) and the SSD scan
    (dt_bias, softplus, the time-step clamp; D skip), both reset per document, the scan
    in chunks of CHUNK tokens whatever the module's `chunk_size` (the recurrence is the
    same at any chunk, in another float order; the pair terms cost T × chunk per head,
    and the released 128 / 256 would cost 2-4× more than 64 where heads are small); the gated
    group RMS norm (Falcon-H1 without `mamba_rms_norm`: the silu gate alone); out_proj."""
    b, t, _ = hidden_states.shape
    dtype = hidden_states.dtype
    x_in = hidden_states * getattr(m, "ssm_in_multiplier", 1.0)
    proj = m.in_proj(x_in)
    if getattr(m, "mup_vector", None) is not None:
        proj = proj * m.mup_vector
    gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    xbc = causal_conv1d_varlen(
        xbc.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias, layout,
        activation=m.activation,
    ).transpose(1, 2)  # fmt: skip
    gs = m.n_groups * m.ssm_state_size
    x, b_in, c_in = torch.split(xbc, [m.intermediate_size, gs, gs], dim=-1)
    lo, hi = m.time_step_limit
    dt = F.softplus(dt + m.dt_bias.to(dt.dtype)).clamp(min=lo, max=hi)  # [B, T, heads]
    x = x.reshape(b, t, m.num_heads, m.head_dim)  # [B, T, heads, P]
    y = ssd_varlen(
        x, dt, -torch.exp(m.A_log.float()),
        b_in.reshape(b, t, m.n_groups, -1), c_in.reshape(b, t, m.n_groups, -1), layout,
        chunk=CHUNK,
    )  # fmt: skip
    y = y + m.D[..., None] * x.float()  # the skip term
    y = y.reshape(b, t, -1)
    if getattr(m, "mamba_rms_norm", True):
        y = m.norm(y, gate)
    else:
        y = y * F.silu(gate)
    return m.out_proj(y.to(dtype))


Forward = Callable[[Any, SegmentLayout, torch.Tensor], torch.Tensor]


def _packed_forward(
    forward: Forward,
    m: Any,
    layout: SegmentLayout,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **_kwargs: Any,
) -> torch.Tensor:
    """A mixer's forward inside `packed_mixers`, called as transformers calls the
    module's own: `forward(m, layout, hidden_states)`. `attention_mask` (the 4D masks of
    the attention layers) is not read: the layout says where documents start."""
    if cache is not None:
        raise RuntimeError("packed recurrent layers run without a cache (use_cache=False)")
    return forward(m, layout, hidden_states)


# transformers classes whose forward is re-stated here, by class name
FORWARDS: dict[str, Forward] = {
    "Qwen3NextGatedDeltaNet": gated_delta_net,
    "Qwen3_5GatedDeltaNet": gated_delta_net,
    "Qwen3_5MoeGatedDeltaNet": gated_delta_net,
    "Lfm2ShortConv": short_conv,
    "Lfm2MoeShortConv": short_conv,
    "Lfm3ShortConv": short_conv,
    "NemotronHMamba2Mixer": mamba2_mixer,
    "FalconH1Mixer": mamba2_mixer,
}


def find_mixers(layers: Sequence[torch.nn.Module], rule: PackingRule) -> dict[int, Any] | None:
    """The mixer module of every recurrent layer (RECURRENT_TYPES), by layer index, where
    each is a direct child of its decoder layer of a class in FORWARDS; None where one is
    not (its rows run each document alone). {} for a verifier without recurrent layers."""
    out: dict[int, Any] = {}
    for i, kind in enumerate(rule.layer_types):
        if kind not in RECURRENT_TYPES:
            continue
        known = [c for c in layers[i].children() if type(c).__name__ in FORWARDS]
        if len(known) != 1:
            return None
        out[i] = known[0]
    return out


@contextmanager
def packed_mixers(mixers: dict[int, Any], layout: SegmentLayout) -> Iterator[None]:
    """While in this block, each of `mixers` runs its FORWARDS entry over the packed rows
    `layout` describes (the rows the model is about to run), state reset at each
    document start. The modules' own forwards come back on exit."""
    if not mixers:
        yield
        return
    for m in mixers.values():
        m.forward = partial(_packed_forward, FORWARDS[type(m).__name__], m, layout)
    try:
        yield
    finally:
        for m in mixers.values():
            del m.forward  # the class's forward again
