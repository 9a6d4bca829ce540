"""Tensor-parallel verifier shards: what can be split N ways, and loading one rank's shard.

    torchrun --nproc-per-node 2 -m fanout.cli produce --tp 2 --verifier-name-or-path DIR ...

    check_tp_model("/models/Qwen3-8B", 2)   # ConfigError before any weight is read
    AutoModelForCausalLM.from_pretrained(root, **tp_load_kwargs(2), ...)  # this rank's shard

The sharding is transformers' own (`tp_plan="auto"`: the model class's
`base_model_tp_plan`, DTensor over a device mesh of the torchrun ranks; NCCL on
GPUs, gloo on CPU), not fanout's. Under that plan q/k/v and gate/up projections are
split by columns (heads, intermediate channels) and o_proj/down_proj by rows, whose
partial sums are all-reduced, so every decoder layer's output — what the producer
captures — is whole and identical on every rank; the LM head is split by vocabulary
rows and gathered.

What must divide by N (checked from config.json alone, before the weights load):
attention heads, key/value heads and the MLP's intermediate size (an MoE expert's
too), since each rank holds whole heads and an equal slice of every MLP. A model class without a TP plan
(`base_model_tp_plan` empty), or whose plan splits no decoder-layer weight (gpt-oss:
only its embedding), is refused: transformers would load its layers unsharded on
every rank.

Every layer type of the verifier zoo is exact under the plans (tests/test_tp.py, 2
ranks on CPU against one process): full, sliding and chunked attention, MLA
(DeepSeek-V3's `mla_kv_a_proj`), linear attention (Qwen3-Next, Qwen3.5: its
projections are split and their outputs gathered, so each rank runs the recurrence
whole), MoE (experts replicated: no expert parallelism), multimodal text towers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from fanout.errors import ConfigError

# config fields each rank takes an equal share of, under transformers' TP plans
_SPLIT_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",  # each expert's MLP (Qwen3-MoE, GLM-4 MoE, DeepSeek-V3)
)


def check_tp_model(path: str | Path, tp: int) -> None:
    """Refuse a verifier that cannot be split `tp` ways, naming the field and the numbers
    (reads config.json only; ConfigError). Also refuses when `accelerate`, which
    transformers' TP loading needs, is not installed."""
    from transformers import AutoConfig

    root = Path(path)
    try:
        cfg = AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"verifier directory {root}: cannot read its config: {e}") from None
    text = cfg.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or getattr(cfg, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"--tp {tp}: verifier {root} ({cfg.model_type}) has no tensor-parallel plan in "
            "transformers (config.base_model_tp_plan is empty); run it with --tp 1"
        )
    if not any(k.startswith("layers.") for k in plan):
        # gpt-oss: attention with sinks and the experts are outside transformers' plan
        raise ConfigError(
            f"--tp {tp}: transformers' tensor-parallel plan for verifier {root} "
            f"({cfg.model_type}) splits no decoder-layer weight (only {', '.join(plan)}): "
            "every rank would hold and run every layer whole; run it with --tp 1"
        )
    for name in _SPLIT_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and value % tp:
            raise ConfigError(
                f"--tp {tp}: verifier {root} has {name} = {value}, not divisible by {tp}; "
                f"use a --tp that divides it"
            )
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            f"--tp {tp}: transformers' tensor parallelism needs the `accelerate` package "
            "(pip install 'fanout[tp]')"
        )


def tp_load_kwargs(tp: int) -> dict[str, Any]:
    """The `from_pretrained` arguments that load this rank's shard of a `tp`-way split
    (torch.distributed already started with `tp` ranks; the shard lands on this rank's
    device: cuda:LOCAL_RANK, or cpu)."""
    try:  # transformers 5.x: the `tp_plan=` keyword is deprecated for DistributedConfig
        from transformers.distributed import DistributedConfig
    except ImportError:  # 4.x
        return {"tp_plan": "auto", "tp_size": tp}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}


def model_device(model: Any) -> torch.device:
    """The device of this rank's shard (DTensor parameters report their local device)."""
    return torch.device(next(model.parameters()).device)


class ShardedHead:
    """Greedy ids from a vocabulary-split LM head without gathering the logits.

    transformers' plan gathers each rank's `[c, V/N]` logits into `[c, V]` on every
    rank (`colwise_gather_output`): N·c·V values over the interconnect per chunk, for
    an argmax. Instead each rank takes the argmax of its own shard and the ranks
    exchange one (max, index) pair per row — 2·N·c numbers. The winner is the rank
    with the largest maximum, the lowest rank on a tie; shards hold consecutive
    vocabulary rows, so that is the first index of the maximum, what `argmax` of the
    gathered logits returns.
    """

    def __init__(self, weight: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(weight, DTensor) or tuple(weight.placements) != (Shard(0),):
            raise ConfigError(
                f"tensor-parallel LM head: want a vocabulary-sharded DTensor weight, got "
                f"{type(weight).__name__} {getattr(weight, 'placements', '')}"
            )
        self._dist = dist
        self.group = weight.device_mesh.get_group()
        self.local_t = weight.to_local().t()  # [H, V/N] view
        rows = torch.tensor([self.local_t.shape[1]], device=self.local_t.device)
        sizes = [torch.empty_like(rows) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(sizes, rows, group=self.group)
        rank = dist.get_rank(self.group)
        self.offset = int(sum(int(s) for s in sizes[:rank]))  # first vocabulary row here
        self._buf: torch.Tensor | None = None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [c, H] → int64 [c]: argmax over the whole vocabulary of x · Wᵀ."""
        from fanout.ops.argmax import row_argmax

        c = x.shape[0]
        if self._buf is None or self._buf.shape[0] < c:  # reused: see Verifier._logits_buffer
            self._buf = torch.empty(c, self.local_t.shape[1], dtype=x.dtype, device=x.device)
        logits = torch.mm(x, self.local_t, out=self._buf[:c])  # [c, V/N]
        idx = row_argmax(logits)  # [c] within the shard
        best = logits.gather(1, idx[:, None])[:, 0]  # [c]
        # float64 holds both exactly: any logit dtype, any vocabulary index
        mine = torch.stack([best.double(), (idx + self.offset).double()])  # [2, c]
        every = [torch.empty_like(mine) for _ in range(self._dist.get_world_size(self.group))]
        self._dist.all_gather(every, mine, group=self.group)
        stacked = torch.stack(every)  # [N, 2, c]
        winner = stacked[:, 0].argmax(dim=0)  # [c] first rank holding the row maximum
        return stacked[winner, 1, torch.arange(c, device=x.device)].long()
