"""What each verifier layer type computes for a document alone: the packing rule.

    from fanout.model.layer_types import PackingRule
    rule = PackingRule.from_config(model.config, "/models/gemma-3-4b")  # ConfigError if unknown
    if rule.needs_alone(t):
        ...  # run each document of the rows as its own sequence (fanout.model.verifier)
    else:
        mask = rule.masks(document_ids, position_ids)  # one [B, 1, T, T] bool, or {type: mask}

A packed row (several documents, `document_ids` −1 on padding, `position_ids`
restarting at 0 per document) is exact only if every decoder layer computes for each
document what it computes for that document alone. Per layer type (the text config's
`layer_types`, the names transformers uses; derived when a config has none):

| layer type          | alone it sees                              | packed row keeps it by        |
|---------------------|--------------------------------------------|-------------------------------|
| `full_attention`    | earlier tokens of its document             | block-diagonal causal mask    |
| `sliding_attention` | those within `sliding_window` (self incl.) | the same mask ∧ q − k < W     |
| `chunked_attention` | those in its `attention_chunk_size` chunk  | the same mask ∧ same chunk    |
| `linear_attention`  | a recurrent state and a short causal conv  | running each document alone   |
|                     | that start from zero at the document start |                               |

Window conventions are transformers' own (masking_utils.sliding_window_overlay:
`kv_idx > q_idx − sliding_window`; chunked_overlay: `kv_idx // C == q_idx // C` on
the document's positions). Run alone, a sliding / chunked layer gets no mask at all:
fanout.model.local_attention computes the same window in query blocks, O(L·w) memory
for a document of L tokens (by the layer type this rule gives each `layer_idx`).
Attention sinks (gpt-oss) add a learned logit per head to every softmax; they need no
rule of their own, only an attention implementation that has them (the verifier loads
such models with eager when sdpa is not supported; alone, local_attention keeps
eager's math), and the mask stays per layer type. MLA (DeepSeek-V3) and MoE layers
are full attention / per-token and need nothing more.

Why linear attention runs each document alone: transformers passes packed boundaries
to the gated delta rule and the causal conv1d as `cu_seq_lens_q`, but their torch
fallbacks (the only ones on CPU, and on GPU without flash-linear-attention and
causal-conv1d) swallow it in `**kwargs` (transformers 5.25: qwen3_next / qwen3_5
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`), so the state would flow from one
document into the next. Run alone, every state starts at zero by construction, on
every device and kernel, and the rule does not depend on a kernel honouring a keyword.

Llama-4 scales the queries of its NoPE layers by a function of the *row index*
(`attn_temperature_tuning`; identity below `floor_scale` tokens), not of
`position_ids`, so rows of `floor_scale` tokens or more also run each document alone.

Any other layer type is refused at load in one line naming it and the verifier:
fanout would rather not capture than capture a layer wrong. The list of what is known
is the table above, never a list of model names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fanout.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
MASKED_TYPES = (FULL, SLIDING, CHUNKED)  # exact in a packed row given their mask
ALONE_TYPES = (LINEAR,)  # exact only with each document run as its own sequence
KNOWN_TYPES = MASKED_TYPES + ALONE_TYPES


@dataclass(frozen=True, slots=True)
class PackingRule:
    """The layer types of a verifier's text model and what keeps each exact."""

    layer_types: tuple[str, ...]  # one per decoder layer, transformers' names
    sliding_window: int | None = None  # tokens a sliding layer sees, itself included
    chunk_size: int | None = None  # tokens per chunk of a chunked layer
    row_index_scale_from: int | None = None  # rows this long scale queries by row index

    @classmethod
    def from_config(cls, config: Any, path: str) -> PackingRule:
        """The rule for a transformers config (a multimodal one's text config is used).

        Raises ConfigError (one line, naming `path`) for a layer type without a rule,
        bidirectional attention, or a local-attention layer whose size is unset.
        """
        text = config.get_text_config()
        types = getattr(text, "layer_types", None)
        sliding: Any = getattr(text, "sliding_window", None)
        chunk: Any = getattr(text, "attention_chunk_size", None)
        if types is None:
            # As the models without `layer_types` build their one mask (e.g. Mistral,
            # Phi-3, Qwen3-MoE: `sliding_window is None` → causal, else sliding).
            n = int(text.num_hidden_layers)
            on = sliding is not None and getattr(text, "use_sliding_window", True) is not False
            types = [SLIDING if on else CHUNKED if chunk is not None else FULL] * n
        types = tuple(str(t) for t in types)
        unknown = sorted(set(types) - set(KNOWN_TYPES))
        if unknown:
            where = [i for i, t in enumerate(types) if t in unknown]
            raise ConfigError(
                f"verifier {path}: layer type(s) {unknown} (layers {where}) have no packing "
                f"rule in fanout (known: {', '.join(KNOWN_TYPES)}); refusing to capture them"
            )
        if getattr(text, "use_bidirectional_attention", False):
            raise ConfigError(
                f"verifier {path}: use_bidirectional_attention is set; a causal verifier is needed"
            )
        for t, size, field in (
            (SLIDING, sliding, "sliding_window"),
            (CHUNKED, chunk, "attention_chunk_size"),
        ):
            if t in types and not (isinstance(size, int) and size > 0):
                raise ConfigError(f"verifier {path}: {t} layers but {field} is {size!r}")
        scale_from = None
        if getattr(text, "attn_temperature_tuning", False) and getattr(text, "floor_scale", None):
            scale_from = int(text.floor_scale)
        return cls(
            layer_types=types,
            sliding_window=sliding if SLIDING in types else None,  # checked int above
            chunk_size=chunk if CHUNKED in types else None,
            row_index_scale_from=scale_from,
        )

    @property
    def distinct(self) -> tuple[str, ...]:
        """The layer types present, in first-layer order."""
        return tuple(dict.fromkeys(self.layer_types))

    def needs_alone(self, t: int) -> bool:
        """Whether rows of `t` tokens must run each document alone (no mask can keep them)."""
        if any(x in ALONE_TYPES for x in self.layer_types):
            return True
        return self.row_index_scale_from is not None and t >= self.row_index_scale_from

    def mask_bytes(self, b: int, t: int, element_bytes: int) -> int:
        """Bytes of the dense masks `masks` would build for [B, T] rows."""
        return len(self.distinct) * b * t * t * element_bytes

    def masks(
        self, document_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Boolean [B, 1, T, T] masks (True = may attend), one per layer type present:
        one tensor when all layers share a type (every model takes a prepared 4D mask),
        else a dict keyed by layer type (what the models with mixed types index by
        `config.layer_types[i]`). Padding (document id −1) attends only to itself, so
        no softmax row is empty."""
        d = document_ids  # [B, T]
        t = d.shape[1]
        ar = torch.arange(t, device=d.device)
        causal = ar[:, None] >= ar[None, :]  # [T, T] q ≥ k
        same = (d[:, :, None] == d[:, None, :]) & (d >= 0)[:, :, None]  # [B, T, T]
        eye = torch.eye(t, dtype=torch.bool, device=d.device)  # [T, T]
        out: dict[str, torch.Tensor] = {}
        for kind in self.distinct:
            allowed = same & causal  # [B, T, T]
            if kind == SLIDING:
                assert self.sliding_window is not None
                allowed &= (ar[:, None] - ar[None, :]) < self.sliding_window  # [T, T]
            elif kind == CHUNKED:
                assert self.chunk_size is not None
                c = position_ids.to(d.device) // self.chunk_size  # [B, T] chunk of each token
                allowed &= c[:, :, None] == c[:, None, :]  # [B, T, T]
            out[kind] = (allowed | eye)[:, None]  # [B, 1, T, T]
        return next(iter(out.values())) if len(out) == 1 else out
