"""What each verifier layer type computes for a document alone: the packing rule.

    from fanout.model.layer_types import PackingRule
    rule = PackingRule.from_config(model.config, "/models/gemma-3-4b", strict=True)
    if rule.needs_alone(t):
        ...  # run each document of the rows as its own sequence (fanout.model.verifier)
    else:
        mask = rule.masks(document_ids, position_ids)  # one [B, 1, T, T] bool, or {type: mask}

A packed row (several documents, `document_ids` −1 on padding, `position_ids`
restarting at 0 per document) is exact only if every decoder layer computes for each
document what it computes for that document alone. Per layer type (the text config's
`layer_types`, the names transformers uses; derived when a config has none, unless
it has one of UNDECLARED_MIXING_FIELDS: then a type without a rule):

| layer type          | alone it sees                              | packed row keeps it by        |
|---------------------|--------------------------------------------|-------------------------------|
| `full_attention`    | earlier tokens of its document             | block-diagonal causal mask    |
| `sliding_attention` | those within `sliding_window` (self incl.) | the same mask ∧ q − k < W     |
| `chunked_attention` | those in its `attention_chunk_size` chunk  | the same mask ∧ same chunk    |
| `linear_attention`  | a recurrent state and a short causal conv  | both reset at each document   |
|                     | that start from zero at the document start | start (`varlen`), else running|
|                     |                                            | each document alone           |
| `conv`              | itself and `conv_L_cache` − 1 tokens before| as `linear_attention`         |
|                     | it, zeros before the document start        |                               |
| `hybrid`            | full attention's, and a Mamba-2 state      | the full mask, and the state  |
|                     | from zero at the document start            | as `linear_attention`'s       |
| `mlp`, `moe`        | its own token (they mix no tokens)         | nothing: packed as they are   |
| `indexed_attention` | the `index_topk` earlier tokens of its     | the full mask, which its      |
|                     | document its indexer scores highest        | indexer applies to its scores |
|                     |                                            | before the top-k (see below)  |

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

Linear attention in a packed row: transformers passes packed boundaries to the gated
delta rule and the causal conv1d as `cu_seq_lens_q`, but their torch fallbacks (the
only ones on CPU, and on GPU without flash-linear-attention and causal-conv1d) swallow
it in `**kwargs` (transformers 5.25: qwen3_next / qwen3_5
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`), so the state would flow from one
document into the next. Where every linear-attention layer's mixer is one whose
forward fanout re-states with both scans reset at document starts
(fanout.model.varlen_layers, over fanout.ops.varlen_scan), the verifier sets `varlen`
and the rows are packed: those layers take no mask, the attention layers theirs.
Otherwise (a mixer class fanout has no forward for) each document runs alone, where
every state starts at zero by construction, on every device and kernel.

Llama-4 scales the queries of its NoPE layers by a function of the *row index*
(`attn_temperature_tuning`; identity below `floor_scale` tokens), not of
`position_ids`, so rows of `floor_scale` tokens or more also run each document alone.

Layers that mix no tokens (`mlp`, `moe`: Nemotron-H's attention-free blocks) need no
rule: a packed row runs them as they are, and they take no mask.

DeepSeek-V3.2's sparse attention (`indexed_attention`): a lightning indexer scores
every earlier key, keeps the `index_topk` best per query, and the MLA attention sees
only those. Alone, the top-k chooses among the document's keys; in a packed row it
must too. transformers' indexers take the layer's mask and add it to their scores
before the top-k (`index_scores + attention_mask`, or −inf where a boolean mask is
False), and under eager / sdpa (the attention implementations fanout loads a verifier
with) the attention ANDs the top-k's keys with that same mask: given the
block-diagonal full mask, the top-k ranks the document's keys exactly as alone (same
scores: positions restart per document), and a query with fewer than `index_topk`
keys in its document, whose top-k also takes masked keys, still attends to none of
them. That holds for the indexer classes whose forward was read for it
(`MASK_AWARE_INDEXERS`, transformers 5.25): the verifier checks every
`indexed_attention` layer holds one (`PackingRule.with_indexers`); a layer whose
indexer is another class (one that selects compressed blocks over the whole row, say)
makes the type one without a rule, as below. Ties in the scores at the k-th place
may be broken differently packed and alone (torch's top-k order among equal values),
as they may between any two batch shapes. Its attention is transformers' own, never
fanout's (`own_attention`): fanout.model.local_attention does not apply a top-k.

Any other layer type (a type newer than this table) has no rule here, and its rows
run each document alone, as linear attention's do without a varlen forward: exact by construction for any causal model (each document's
forward is the one plain transformers runs for it), only slower (one forward per
length-batch of documents instead of one per batch of rows), with one warning at load
naming the type (`unruled_warning`). transformers' own attention and masks run them
(fanout.model.local_attention is not entered: it knows only the types above).
`strict` (`--strict-layer-types`) refuses such a verifier at load instead, in one
line naming the type and the verifier. The list of what is known is the table above,
never a list of model names (MASK_AWARE_INDEXERS, like fanout.model.varlen_layers'
FORWARDS, lists the transformers classes whose forward the rule was read from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fanout.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
CONV = "conv"  # LFM2's gated short causal convolution
HYBRID = "hybrid"  # Falcon-H1: full attention and Mamba-2 in parallel in one layer
INDEXED = "indexed_attention"  # DeepSeek-V3.2: MLA over the keys its indexer's top-k keeps
MASKED_TYPES = (FULL, SLIDING, CHUNKED, INDEXED)  # exact in a packed row given their mask
# exact with each document run as its own sequence, or packed with their state reset
# at each document start (`PackingRule.varlen`)
ALONE_TYPES = (LINEAR, CONV, HYBRID)
TOKENWISE_TYPES = ("mlp", "moe")  # mix no tokens: exact in a packed row as they are
KNOWN_TYPES = MASKED_TYPES + ALONE_TYPES + TOKENWISE_TYPES
# Config fields that declare a token mixing of their own in a config without
# `layer_types` (local / LSH attention lists, a dynamic top-k key mask, short
# convolutions): all-full is not derived for such a config; its layers get a type
# without a rule, so documents run alone.
UNDECLARED_MIXING_FIELDS = ("attention_layers", "attn_layers", "keep_window_size", "conv_L_cache")
# Indexer classes (transformers 5.25) whose forward adds the layer's mask to its scores
# before the top-k, and whose attention ANDs the chosen keys with that mask under eager
# and sdpa; each read for it (DeepSeek-V3.2's and the copies transformers generates from
# it). An `indexed_attention` layer holding none of them has no rule.
MASK_AWARE_INDEXERS = frozenset(
    {
        "DeepseekV32Indexer",
        "GlmMoeDsaIndexer",
        "MistralLarge4TextIndexer",
        "AXK2Indexer",
        "HYV4Indexer",
        "HYV4VLIndexer",
        "Dots3NoteTextIndexer",
    }
)


@dataclass(frozen=True, slots=True)
class PackingRule:
    """The layer types of a verifier's text model and what keeps each exact."""

    layer_types: tuple[str, ...]  # one per decoder layer, transformers' names
    sliding_window: int | None = None  # tokens a sliding layer sees, itself included
    chunk_size: int | None = None  # tokens per chunk of a chunked layer
    row_index_scale_from: int | None = None  # rows this long scale queries by row index
    unruled: tuple[str, ...] = ()  # layer types without a rule: documents run alone
    # every ALONE_TYPES layer runs a forward that resets its state at each document
    # start (fanout.model.varlen_layers; set by the verifier, which sees the modules)
    varlen: bool = False

    @classmethod
    def from_config(cls, config: Any, path: str, *, strict: bool = False) -> PackingRule:
        """The rule for a transformers config (a multimodal one's text config is used).

        Raises ConfigError (one line, naming `path`) for bidirectional attention, a
        local-attention layer whose size is unset, or (`strict`) a layer type without
        a rule; without `strict` such types run each document alone (`unruled`).
        """
        text = config.get_text_config()
        types = getattr(text, "layer_types", None)
        sliding: Any = getattr(text, "sliding_window", None)
        chunk: Any = getattr(text, "attention_chunk_size", None)
        mixing = [f for f in UNDECLARED_MIXING_FIELDS if getattr(text, f, None) is not None]
        if types is None and mixing:
            types = [f"undeclared ({mixing[0]})"] * int(text.num_hidden_layers)
        elif types is None:
            # As the models without `layer_types` build their one mask (e.g. Mistral,
            # Phi-3, Qwen3-MoE: `sliding_window is None` → causal, else sliding).
            n = int(text.num_hidden_layers)
            on = sliding is not None and getattr(text, "use_sliding_window", True) is not False
            types = [SLIDING if on else CHUNKED if chunk is not None else FULL] * n
        types = tuple(str(t) for t in types)
        unknown = sorted(set(types) - set(KNOWN_TYPES))
        if unknown and strict:
            where = [i for i, t in enumerate(types) if t in unknown]
            raise ConfigError(
                f"verifier {path}: layer type(s) {unknown} (layers {where}) have no packing "
                f"rule in fanout (known: {', '.join(KNOWN_TYPES)}); --strict-layer-types "
                "refuses to capture them (without it, each document would run alone)"
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
            unruled=tuple(unknown),
        )

    def with_indexers(
        self, layers: Sequence[torch.nn.Module], path: str, *, strict: bool = False
    ) -> PackingRule:
        """This rule, seen with the verifier's decoder `layers`: `indexed_attention`
        keeps its rule only where every such layer holds an indexer of
        MASK_AWARE_INDEXERS; else it becomes a type without a rule (its rows run each
        document alone), or, `strict`, a ConfigError naming `path` and the class."""
        if INDEXED not in self.layer_types:
            return self
        for i, t in enumerate(self.layer_types):
            if t != INDEXED:
                continue
            if any(type(m).__name__ in MASK_AWARE_INDEXERS for m in layers[i].modules()):
                continue
            if strict:
                raise ConfigError(
                    f"verifier {path}: layer {i} ({INDEXED}) holds no indexer fanout knows "
                    f"masks its scores by document ({', '.join(sorted(MASK_AWARE_INDEXERS))}); "
                    "--strict-layer-types refuses to capture it (without it, each document "
                    "would run alone)"
                )
            return replace(self, unruled=tuple(sorted({*self.unruled, INDEXED})))
        return self

    @property
    def own_attention(self) -> bool:
        """Whether fanout's own attention functions (fanout.model.local_attention,
        fanout.model.packed_attention) may run this verifier's attention layers: no
        type without a rule, and no indexer's top-k (they do not apply one)."""
        return not self.unruled and INDEXED not in self.layer_types

    def unruled_warning(self, path: str) -> str | None:
        """The one warning a verifier with layer types without a rule gets at load
        (None for one without): which types, which layers, what it costs."""
        if not self.unruled:
            return None
        where = [i for i, t in enumerate(self.layer_types) if t in self.unruled]
        return (
            f"verifier {path}: layer type(s) {list(self.unruled)} (layers {where}) have no "
            "packing rule in fanout: each document of a row runs alone (exact, but one "
            "forward per batch of equal-length documents instead of one per batch of rows: "
            "slower where rows hold many short documents); --strict-layer-types refuses "
            "such a verifier instead"
        )

    @property
    def distinct(self) -> tuple[str, ...]:
        """The layer types present, in first-layer order."""
        return tuple(dict.fromkeys(self.layer_types))

    @property
    def mask_types(self) -> tuple[str, ...]:
        """The layer types that take a mask of their own: those present that mix tokens
        (a model of token-wise layers alone, none: it still gets the full mask)."""
        takes = [t for t in self.distinct if t not in TOKENWISE_TYPES]
        if self.varlen:  # recurrent layers reset by document instead; a hybrid one's
            # attention takes the full mask
            takes = [FULL if t == HYBRID else t for t in takes]
            takes = [t for t in dict.fromkeys(takes) if t not in ALONE_TYPES]
        return tuple(takes) or (FULL,)

    def needs_alone(self, t: int) -> bool:
        """Whether rows of `t` tokens must run each document alone (no mask can keep them)."""
        if self.unruled:
            return True
        if not self.varlen and any(x in ALONE_TYPES for x in self.layer_types):
            return True
        return self.row_index_scale_from is not None and t >= self.row_index_scale_from

    def mask_bytes(self, b: int, t: int, element_bytes: int) -> int:
        """Bytes of the dense masks `masks` would build for [B, T] rows."""
        return len(self.mask_types) * b * t * t * element_bytes

    def masks(
        self, document_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Boolean [B, 1, T, T] masks (True = may attend), one per layer type present:
        one tensor when all layers share a type (every model takes a prepared 4D mask),
        else a dict keyed by layer type (what the models with mixed types index by
        `config.layer_types[i]`; a token-wise type's key holds the first mask, shared,
        for the models that look every layer's type up). Padding (document id −1)
        attends only to itself, so no softmax row is empty."""
        d = document_ids  # [B, T]
        t = d.shape[1]
        ar = torch.arange(t, device=d.device)
        causal = ar[:, None] >= ar[None, :]  # [T, T] q ≥ k
        same = (d[:, :, None] == d[:, None, :]) & (d >= 0)[:, :, None]  # [B, T, T]
        eye = torch.eye(t, dtype=torch.bool, device=d.device)  # [T, T]
        out: dict[str, torch.Tensor] = {}
        for kind in self.mask_types:
            allowed = same & causal  # [B, T, T]
            if kind == SLIDING:
                assert self.sliding_window is not None
                allowed &= (ar[:, None] - ar[None, :]) < self.sliding_window  # [T, T]
            elif kind == CHUNKED:
                assert self.chunk_size is not None
                c = position_ids.to(d.device) // self.chunk_size  # [B, T] chunk of each token
                allowed &= c[:, :, None] == c[:, None, :]  # [B, T, T]
            out[kind] = (allowed | eye)[:, None]  # [B, 1, T, T]
        if len(self.distinct) == 1:
            return next(iter(out.values()))
        first = next(iter(out.values()))
        # a hybrid layer's attention is full attention
        return {k: out.get(FULL if k == HYBRID else k, first) for k in self.distinct}
