"""The MTP layer of a hybrid verifier (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): the verifier
architecture's own full-attention decoder layer with the MTP modules around it.

    from fanout.families.mtp.layers import verifier_layer_config, HybridMTPLayer
    layer_config = verifier_layer_config(Path("models/Qwen3-Next-80B-A3B"))  # None: dense
    layer = HybridMTPLayer(layer_config)            # speculators' mtp_layers.0
    out = layer.run(emb, hidden, attend)            # [B, L, H], final-normed

speculators 0.9.0 (`speculators/models/mtp/model_definitions.py`) builds the MTP layer of
model types qwen3_next, qwen3_5_text and qwen3_5_moe_text as transformers' decoder layer
of that architecture (`Qwen3NextDecoderLayer`, `Qwen3_5DecoderLayer`,
`Qwen3_5MoeDecoderLayer`) at the verifier's last full-attention layer index
(`_last_full_attention_idx`, `hybrid=True`), wrapped by `MTPLayerMixin`; its config is
the verifier's text config as is (`transformer_layer_config`). This module is that
layer with transformers' parameter names, so `trainable_state()` keys are speculators':
- gated attention: `q_proj` (H -> 2·nh·hd: per head the query, then a gate), per-head
  zero-centred `q_norm` / `k_norm`, RoPE on the first `partial_rotary_factor`·hd
  channels (Qwen3.5's interleaved MRoPE is the same rotation for text positions, whose
  three sections are equal), `o_proj(attention · sigmoid(gate))`;
- the MLP of that layer index: a dense SwiGLU `mlp.{gate,up,down}_proj` (Qwen3.5), or
  the sparse MoE block (Qwen3-Next where `decoder_sparse_step` and `mlp_only_layers`
  put one, Qwen3.5-MoE always): softmax top-k router `mlp.gate.weight` (renormalised
  top-k with `norm_topk_prob`), fused experts `mlp.experts.gate_up_proj` `[E, 2I, H]` /
  `down_proj` `[E, H, I]`, and `mlp.shared_expert` gated by
  `sigmoid(mlp.shared_expert_gate)`;
- every norm zero-centred (`x̂ · (1 + w)`, transformers' `Qwen3NextRMSNorm`): the
  decoder's `input_layernorm` / `post_attention_layernorm` and the MTP modules
  `hidden_layernorm`, `token_layernorm`, `final_layernorm` (speculators passes the
  architecture's norm class to `_setup_mtp_modules`); the verifier's `mtp.*` norm
  tensors load as stored.

Initialisation (speculators' `MTPDraftModel(config)`, transformers' generic
`_init_weights` under a config without `initializer_range`): linears normal(0, 0.02),
biases 0, every norm's weight 1 (its "RMSNorm" class name; a gain of 2 here), the
router 0 (its `torch.zeros`). speculators leaves the fused experts as `torch.empty`
(uninitialised memory); fanout draws them normal(0, 0.02), as transformers' own init
of these models does.

DeepSeek-V3 / GLM-4.5 style MTP layers (MLA, `model.layers.{L}.*` with
`enorm`/`hnorm`/`eh_proj`) have no MTP layer in speculators 0.9.0: `unsupported_mtp`
says so in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.model.draft_attention import attention

# speculators 0.9.0's `mtp_model_classes` beyond "qwen3" (the dense layer of .model)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# checkpoints that ship an MTP layer speculators 0.9.0 has no class for
_NO_SPECULATORS_LAYER = {
    "deepseek_v3": "MLA + MoE",
    "deepseek_v32": "MLA + MoE",
    "glm4_moe": "MoE",
}
# the fields fanout's checkpoint reader takes from `transformer_layer_config`
# (fanout.checkpoints.load.draft_config), written even where they equal the config
# class's defaults (which speculators' `to_diff_dict` would leave out)
_READ_BACK = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "vocab_size", "rope_parameters", "tie_word_embeddings",
)  # fmt: skip


def _text_config(vdir: Path) -> dict[str, Any]:
    top = json.loads((vdir / "config.json").read_text())
    return cast("dict[str, Any]", top.get("text_config", top))


def verifier_layer_config(vdir: Path) -> dict[str, Any] | None:
    """speculators' `transformer_layer_config` for a hybrid verifier at `vdir`: its text
    config (`AutoConfig`, a multimodal one's `text_config`) as speculators serialises it
    (`to_diff_dict`), plus the fields fanout reads back; None for any other model type
    (the dense Qwen3 layer)."""
    if _text_config(vdir).get("model_type") not in HYBRID_MODEL_TYPES:
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(vdir), local_files_only=True)
    cfg = getattr(cfg, "text_config", None) or cfg  # speculators' train CLI unwraps it
    full = cfg.to_dict()
    out = cfg.to_diff_dict() | {k: full[k] for k in _READ_BACK if k in full}
    out["model_type"] = cfg.model_type
    rope = out.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"--draft-family mtp: verifier {vdir}'s rope_parameters.rope_type "
            f"{rope['rope_type']!r}: fanout's MTP layer computes default RoPE only"
        )
    return cast("dict[str, Any]", json.loads(json.dumps(out)))  # JSON-native, as read back


def unsupported_mtp(vdir: Path, names: set[str]) -> str | None:
    """Why the verifier's own MTP layer (its checkpoint tensor `names`) is one fanout's
    mtp cannot train (None: it ships none, or one speculators 0.9.0 has a class for)."""
    c = _text_config(vdir)
    kind = _NO_SPECULATORS_LAYER.get(str(c.get("model_type")))
    if kind is None:
        return None
    n = int(c.get("num_hidden_layers", 0))
    own = [s for s in names if s.startswith("mtp.") or f"layers.{n}." in s]
    if not own:
        return None  # no MTP weights: fanout's dense Qwen3 MTP layer from scratch
    return (
        f"--draft-family mtp: verifier {vdir} ships a {c['model_type']} ({kind}) MTP layer "
        f"({sorted(own)[0]}, ...); speculators 0.9.0 has no MTP layer for it (its MTP "
        f"layers: qwen3, {', '.join(HYBRID_MODEL_TYPES)})"
    )


class ZeroCentredRMSNorm(nn.Module):
    """transformers' `Qwen3NextRMSNorm` / `Qwen3_5RMSNorm`: fp32 `x̂ · (1 + w)`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))  # speculators' init (module docstring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class PartialRope(nn.Module):
    """transformers' default RoPE of these models over the first `rotary` channels of
    each head: `(cos, sin)` `[B, L, rotary]` of positions `[B, L]`."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, partial: float, theta: float) -> None:
        super().__init__()
        dim = int(head_dim * partial)
        # transformers' compute_default_rope_parameters, in its float32
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        f = pos.float()[..., None] * self.inv_freq  # [B, L, rotary/2]
        emb = torch.cat((f, f), dim=-1)  # [B, L, rotary]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[B, h, L, hd]` with its first `rotary` channels rotated (`cos`/`sin` `[B, L,
    rotary]`), the rest passed through (transformers' `apply_rotary_pos_emb`)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rot[..., r // 2 :], rot[..., : r // 2]), dim=-1)
    return torch.cat((rot * cos[:, None] + half * sin[:, None], rest), dim=-1)


class GatedAttention(nn.Module):
    """Qwen3-Next / Qwen3.5 full attention (module docstring), as `kv` / `attend` as
    every draft attention of fanout (the drafting cache calls them apart)."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        h, hd, bias = c.hidden_size, c.head_dim, bool(c.attention_bias)
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(hd, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k-normed, rotated) and values of `x` `[B, L, H]`: `[B, nkv, L, hd]` each."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.nkv, self.hd).transpose(1, 2)
        return _rope_part(k, *rope), v

    def attend(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any, mask: Any
    ) -> torch.Tensor:
        """Queries of `x` `[B, Q, H]` over `k`, `v` `[B, nkv, K, hd]` -> `[B, Q, H]`."""
        b, q_len, _ = x.shape
        qg = self.q_proj(x).view(b, q_len, self.nh, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd :].reshape(b, q_len, -1)
        q = _rope_part(self.q_norm(q).transpose(1, 2), *rope)  # [B, nh, Q, hd]
        o = attention(q, k, v, mask).transpose(1, 2).reshape(b, q_len, -1)  # [B, Q, nh·hd]
        return cast("torch.Tensor", self.o_proj(o * torch.sigmoid(gate)))


class SwiGLU(nn.Module):
    """transformers' `Qwen3NextMLP` / `Qwen3_5MLP` of width `inner`."""

    def __init__(self, h: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast("torch.Tensor", self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Router(nn.Module):
    """Softmax top-k router (`mlp.gate.weight` `[E, H]`)."""

    def __init__(self, h: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, h))  # speculators keeps the zeros


class Experts(nn.Module):
    """Fused experts: `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`."""

    def __init__(self, h: int, inner: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, h) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, h, inner) * 0.02)


class SparseMoe(nn.Module):
    """transformers' `Qwen3NextSparseMoeBlock` / `Qwen3_5MoeSparseMoeBlock`."""

    def __init__(self, c: Any, *, norm_topk: bool) -> None:
        super().__init__()
        h = c.hidden_size
        self.top_k, self.norm_topk = c.num_experts_per_tok, norm_topk
        self.gate = Router(h, c.num_experts)
        self.experts = Experts(h, c.moe_intermediate_size, c.num_experts)
        self.shared_expert = SwiGLU(h, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xs = x.reshape(-1, shape[-1])  # [N, H]
        probs = F.softmax(F.linear(xs, self.gate.weight), dim=-1, dtype=torch.float)  # [N, E]
        top, idx = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(xs.dtype)
        out = torch.zeros_like(xs)
        e = self.experts
        for j in idx.unique().tolist():  # the experts some row routes to
            rows, slot = torch.where(idx == j)
            g, u = F.linear(xs[rows], e.gate_up_proj[j]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, e.down_proj[j]) * top[rows, slot, None]
            out = out.index_add(0, rows, y.to(out.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(xs)) * self.shared_expert(xs)
        return (out + shared).reshape(shape)


class HybridMTPLayer(nn.Module):
    """speculators' `MTPLayerMixin` over the verifier architecture's full-attention
    decoder layer (module docstring), built from its `transformer_layer_config`."""

    def __init__(self, layer_config: dict[str, Any]) -> None:
        super().__init__()
        c = _transformers_config(layer_config)
        h, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = GatedAttention(c)
        self.mlp: nn.Module = _mlp(c)
        self.input_layernorm = ZeroCentredRMSNorm(h, eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(h, eps)
        self.hidden_layernorm = ZeroCentredRMSNorm(h, eps)
        self.token_layernorm = ZeroCentredRMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = ZeroCentredRMSNorm(h, eps)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def run(self, emb: torch.Tensor, x: torch.Tensor, attention: Any) -> torch.Tensor:
        """The layer on hidden states `x` `[B, L, H]` fed tokens embedded as `emb`
        (`attention`: normed input -> attention output): the final-normed output."""
        cat = torch.cat([self.token_layernorm(emb), self.hidden_layernorm(x)], dim=-1)
        x = self.input_proj(cat)  # [B, L, H]
        x = x + attention(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return cast("torch.Tensor", self.final_layernorm(x))


def layer_rope(layer_config: dict[str, Any]) -> PartialRope:
    """The RoPE of the MTP layer of `layer_config` (partial, default type)."""
    c = _transformers_config(layer_config)
    rp = c.rope_parameters or {}
    return PartialRope(
        c.head_dim, float(rp.get("partial_rotary_factor", 1.0)), float(rp["rope_theta"])
    )


def _transformers_config(layer_config: dict[str, Any]) -> Any:
    """The transformers config object of `layer_config` (its class's defaults filled)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in layer_config.items() if k != "model_type"}
    return AutoConfig.for_model(layer_config["model_type"], **fields)


def _mlp(c: Any) -> nn.Module:
    """The MLP transformers puts at the MTP layer's index (the last full-attention one,
    speculators' `_last_full_attention_idx`)."""
    if c.model_type == "qwen3_5_text":
        return SwiGLU(c.hidden_size, c.intermediate_size)
    if c.model_type == "qwen3_5_moe_text":
        return SparseMoe(c, norm_topk=True)
    idx = max(i for i, t in enumerate(c.layer_types) if t == "full_attention")
    sparse = idx not in c.mlp_only_layers and c.num_experts > 0
    if sparse and (idx + 1) % c.decoder_sparse_step == 0:
        return SparseMoe(c, norm_topk=bool(c.norm_topk_prob))
    return SwiGLU(c.hidden_size, c.intermediate_size)


__all__ = [
    "HYBRID_MODEL_TYPES",
    "GatedAttention",
    "HybridMTPLayer",
    "PartialRope",
    "SparseMoe",
    "ZeroCentredRMSNorm",
    "layer_rope",
    "unsupported_mtp",
    "verifier_layer_config",
]
