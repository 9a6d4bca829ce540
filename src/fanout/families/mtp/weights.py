"""The verifier's own MTP weights for an MTP draft: renamed and fused as speculators 0.9.0's
`MTPConverter` does (its `mtp.*` tensors, which transformers drops at load).

    from fanout.families.mtp.weights import verifier_mtp_state
    own = verifier_mtp_state(verifier_dir, {k: p.shape for k, p in draft.state_dict().items()})
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fanout.errors import ConfigError
from fanout.families.mtp.layers import unsupported_mtp

# speculators' MTPConverter renames (verifier checkpoint -> MTPDraftModel)
_EXACT = {
    "mtp.fc.weight": "mtp_layers.0.input_proj.weight",
    "mtp.norm.weight": "mtp_layers.0.final_layernorm.weight",
}
_PREFIX = (
    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),
    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),
    ("mtp.layers.0.", "mtp_layers.0."),
)
# MTPConverter's `_EXPERT_PATTERN`: per-expert tensors, fused as transformers holds them
_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _renamed(key: str) -> str:
    if key in _EXACT:
        return _EXACT[key]
    for src, dst in _PREFIX:
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def _fused_experts(
    by_name: dict[str, str], read: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The renamed tensors (`by_name`: draft name -> checkpoint name, `read`: checkpoint
    name -> tensor) with per-expert `experts.{i}.{gate,up,down}_proj.weight` fused into
    `experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up) and `experts.down_proj`
    `[E, H, I]`, as MTPConverter's `_fuse_moe_experts`; a gap in the experts is refused."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    first: dict[str, str] = {}  # a group's first checkpoint name, for the message
    for k, name in sorted(by_name.items()):
        m = _EXPERT.match(k)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = read[name]
            first.setdefault(m[1], name)
        else:
            out[k] = read[name]
    for prefix, experts in groups.items():
        n = max(experts) + 1
        parts = ("gate_proj", "up_proj", "down_proj")
        gaps = [f"{i}.{p}" for i in range(n) for p in parts if p not in experts.get(i, {})]
        if gaps:
            raise ConfigError(
                f"--draft-family mtp: the verifier's per-expert mtp.* tensors "
                f"({first[prefix]}, ...) miss {', '.join(gaps[:3])}: experts 0..{n - 1} "
                "each need gate_proj, up_proj and down_proj (MTPConverter fuses them)"
            )
        e = [experts[i] for i in range(n)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in e]
        )
        out[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in e])
    return out


def verifier_mtp_state(
    verifier_dir: Path, shapes: dict[str, torch.Size], *, zero_centred: bool = False
) -> dict[str, torch.Tensor] | None:
    """The verifier's own MTP weights under the draft's names (None: it ships none),
    renamed and their experts fused as speculators' `MTPConverter` does. A dense layer's
    norm gains are what its norms multiply by (a zero-centred checkpoint norm's w + 1);
    `zero_centred` (the hybrid layer, whose norms are zero-centred too): as stored.
    Raises ConfigError in one line when they do not fit `shapes` (the draft's tensors)."""
    from fanout.model.verifier_dir import _tensor_names, read_verifier_tensors, text_tensors

    all_names = _tensor_names(verifier_dir)
    refused = unsupported_mtp(verifier_dir, all_names)
    if refused:
        raise ConfigError(refused)
    names = sorted(n for n in all_names if n.startswith("mtp."))
    if not names:
        return None
    offset = 0.0 if zero_centred else text_tensors(verifier_dir).norm_offset
    by_name = {_renamed(n): n for n in names}
    where = f"verifier {verifier_dir}'s mtp.* weights"
    tensors = _fused_experts(by_name, read_verifier_tensors(verifier_dir, names))
    unexpected = sorted(k for k in tensors if k not in shapes)
    missing = sorted(k for k in shapes if k not in tensors)
    if unexpected or missing:
        bad = [by_name.get(k, k) for k in unexpected[:3]] + missing[:3]
        layer = "the hybrid" if zero_centred else "the dense Qwen3"
        raise ConfigError(
            f"--draft-family mtp: {where} do not match {layer} MTP layer its config "
            f"describes ({len(unexpected)} unexpected, {len(missing)} missing: "
            f"{', '.join(bad)})"
        )
    out = {}
    for k, t in tensors.items():
        if t.shape != shapes[k]:
            raise ConfigError(
                f"--draft-family mtp: {where}: {by_name.get(k, k)} is {list(t.shape)}, but "
                f"the verifier's config gives {list(shapes[k])}"
            )
        out[k] = t.float() + offset if (offset and "norm" in k) else t
    return out


__all__ = ["verifier_mtp_state"]
