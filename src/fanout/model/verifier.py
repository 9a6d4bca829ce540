"""The verifier: load an HF causal LM from a local directory and capture what DFlash drafts need.

    from fanout.model.verifier import load_verifier
    v = load_verifier("/models/Qwen3-8B", num_draft_layers=5)        # CUDA + bf16 if present
    cap = v.capture(input_ids, position_ids, document_ids)            # each [B, T]
    cap.layers         # n × [B, T, H] storage dtype — outputs of decoder layers v.capture_layer_ids
    cap.layer_scales   # n × [B, T] float32 per-token scales with fp8 storage (fanout.ops.fp8), else None
    cap.target_ids     # [B, T] int32 — argmax of the verifier's logits at every position
    cap.hidden_states  # [B, T, n·H]: the layers side by side (a copy; what a draft's fc takes)
    cap.layer_stats    # [n, B, T, 3] float32 min, max, sum per token: the capture check's input

CPU-sized example (a random tiny Qwen3, no downloads):

    python -c "from fanout.bench.assets import tiny_qwen3_verifier as t; t('/tmp/v', 1000)"
    python -c "from fanout.model.verifier import load_verifier as l; print(l('/tmp/v', capture_layer_ids=[1, 2]))"

**What "layer i" means.** Layer `i` (0-based) is the *output of decoder layer i*: the
residual stream after that layer's MLP, before any final norm. That is HF's
`output_hidden_states=True` entry `hidden_states[i + 1]` (entry 0 is the embeddings)
for every `i < L − 1`; for the last layer HF reports the final-normed state instead,
while we still capture the raw layer output (the DFlash rule never picks it). The
same convention is used by the DFlash reference code (`extract_context_feature`
indexes `hidden_states[layer_id + 1]`).

**How it captures.** Forward hooks on the captured decoder layers copy each output into
its own preallocated `[B, T, H]` buffer — one per layer, because windows store one
tensor per layer (no `output_hidden_states`, which would keep every layer alive). The base model (`model.model`) runs without the LM head; we apply
the head ourselves in `chunk_tokens`-row chunks and keep only the argmax, so the full
`[T, vocab]` logits (1.9 GB for T = 3072 on Qwen3 in fp32) never exist at once.

**Packed rows.** A row holds several documents (`document_ids`, −1 on padding;
`position_ids` restart at 0 per document), and each document must be computed exactly
as if it ran alone, in every layer. fanout.model.layer_types holds that rule per layer
type (full, sliding, chunked attention: a block-diagonal causal mask per type, passed
as a dict where layer types are mixed; recurrent layers — linear attention, short
convolutions, a hybrid layer's Mamba-2 — their state reset at each document start,
where fanout.model.varlen_layers has a forward for the layer's mixer (`self.mixers`),
else each document run alone; layers that mix no tokens: as they are). A layer type
without a rule runs each document alone too, with one warning at load;
`--strict-layer-types` refuses it at load instead. Rows go one of two ways:
- *packed*: one forward over the rows, while the masks would fit
  `dense_mask_max_bytes`: with the per-type [B, 1, T, T] masks (padding attends only to
  itself); a verifier with recurrent layers runs their varlen forwards instead of
  transformers' (`_packed_forward`), and where its attention is all full attention,
  fanout.model.packed_attention's document blocks instead of any mask;
- *alone*: each document as its own sequence without a mask (fanout.model.documents:
  batched by length, right-padded, outputs scattered back into the [B, T, H] buffers;
  each padding token runs as a one-token document, as under the mask). Recurrent
  layers without a varlen forward and layer types without a rule need it; long rows
  take it so that no T × T mask exists: full layers run SDPA is_causal, sliding /
  chunked ones fanout.model.local_attention (O(T·w)); with a type without a rule,
  transformers' own attention and masks run every layer.
Both are checked against each document run alone through plain transformers for every
architecture of tests/verifier_zoo.py (tests/test_verifier_zoo.py). Attention implementations: `sdpa` (boolean
masks) and `eager` (additive); a model class without sdpa (gpt-oss: sinks; Gemma-2:
soft-capping) loads with eager. A multimodal checkpoint (`…ForConditionalGeneration`)
is captured through its text model: layers, hidden size and vocabulary are the text
model's, the head is the top-level one.

**Tensor parallel** (`tp` > 1, one process per rank under torchrun): each rank loads
its shard with transformers' TP plan (fanout.model.tp_shard) and `capture` runs unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fanout.errors import ConfigError
from fanout.model.capture_layers import resolve_capture_layer_ids
from fanout.model.documents import DocumentBatch, document_batches
from fanout.model.layer_types import FULL, HYBRID, PackingRule
from fanout.model.local_attention import local_attention
from fanout.model.packed_attention import packed_attention
from fanout.model.tp_shard import ShardedHead
from fanout.model.varlen_layers import find_mixers, packed_mixers
from fanout.model.verifier_config import (  # noqa: F401 - re-exported: callers import them here
    DTYPES,
    DTypeName,
    StorageDType,
    VerifierConfig,
    VerifierOptions,
    resolve_device,
    resolve_dtype,
)
from fanout.model.verifier_dir import (  # noqa: F401 - re-exported: callers import them here
    check_verifier_dir,
    config_hash,
    logit_scale,
    max_position_embeddings,
    weights_fingerprint,
)
from fanout.model.verifier_load import load_model
from fanout.ops.argmax import row_argmax
from fanout.ops.fp8 import FP8, quantize_into
from fanout.ops.varlen_scan import SegmentLayout
from fanout.rows import DOCUMENT_IDS, POSITION_IDS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Capture:
    """What one verifier forward yields for a batch of packed rows (on the model's device)."""

    layers: tuple[torch.Tensor, ...]  # n × [B, T, H] storage dtype, in capture_layer_ids order
    target_ids: torch.Tensor  # [B, T] int32 — argmax of logits at t (prediction of token t+1)
    # [B, T, H] storage dtype (bf16 for fp8), or None: the final-normed states times the
    # logit scale (Falcon-H1's lm_head_multiplier), so that logits = last · Wᵀ
    last_hidden_states: torch.Tensor | None
    layer_scales: tuple[torch.Tensor, ...] | None = None  # n × [B, T] float32 with fp8 storage
    # [n, B, T, 3] float32: each captured token's min, max and sum over H, taken from the
    # layer output before storage (fanout.produce.capture_check reads them)
    layer_stats: torch.Tensor | None = None

    @property
    def hidden_states(self) -> torch.Tensor:
        """The layers side by side, [B, T, n·H] (a copy): what a draft's `fc` reads."""
        return torch.cat(self.layers, dim=-1)

    @property
    def hidden_scales(self) -> torch.Tensor | None:
        """The fp8 scales side by side, [B, T, n] (a copy), or None."""
        return None if self.layer_scales is None else torch.stack(self.layer_scales, dim=-1)


def _out_buffers(
    given: Sequence[torch.Tensor] | None,
    n: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    name: str,
) -> tuple[torch.Tensor, ...]:
    """`given` (n tensors of `shape`) after checking them, or n views of one fresh
    device tensor [n, *shape]."""
    if given is None:
        return tuple(torch.empty((n, *shape), dtype=dtype, device=device).unbind(0))
    if len(given) != n:
        raise ValueError(f"{name} has {len(given)} tensors; want one per layer ({n})")
    for g in given:
        if tuple(g.shape) != shape or g.dtype != dtype:
            raise ValueError(f"{name} holds {tuple(g.shape)} {g.dtype}; want {shape} {dtype}")
    return tuple(given)


def text_model(model: Any) -> Any:
    """The decoder stack a causal LM runs its tokens through: `model.model` for a text
    model, `model.model.language_model` for a multimodal one; None if there is none."""
    for c in (model.get_decoder(), getattr(model, "model", None)):
        for m in (c, getattr(c, "language_model", None)):
            if m is not None and isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
                return m
    return None


# Dense masks above this many bytes (all layer types, whole batch) are not built; the
# rows run each document alone instead (no T × T tensor at all under SDPA).
DENSE_MASK_MAX_BYTES = 128 << 20


class Verifier:
    """A loaded verifier in eval mode, ready to `capture` packed rows. Build with `load_verifier`."""

    def __init__(self, model: Any, config: VerifierConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.storage_dtype = DTYPES[config.storage_dtype]
        # what the forward multiplies its logits by after the head (Falcon-H1's
        # lm_head_multiplier): stored last_hidden_states carry it, so that every
        # family's teacher, last_hidden_states · Wᵀ, is the verifier's own logits
        self.logit_scale = logit_scale(model.config.to_dict(), config.path)
        # last_hidden_states are stored as bf16 under fp8 storage (they feed a KL loss
        # through the frozen head, where per-token scales would only add error).
        self.last_hidden_dtype = torch.bfloat16 if self.storage_dtype == FP8 else self.storage_dtype
        base = text_model(model)
        head = model.get_output_embeddings()
        if base is None or head is None:
            raise ConfigError(
                f"verifier {config.path}: {type(model).__name__} has no decoder layers / "
                "lm_head; only decoder-only causal LMs (or a multimodal model's text model) "
                "are supported"
            )
        layers = base.layers
        self.base = base
        self.layers = layers
        self.lm_head = head
        text_cfg = model.config.get_text_config()
        # --strict-layer-types refuses layer types without a rule (checked before the
        # weights load too); else their rows run each document alone, said once here
        self.rule = PackingRule.from_config(
            model.config, config.path, strict=config.strict_layer_types
        ).with_indexers(layers, config.path, strict=config.strict_layer_types)
        if (warning := self.rule.unruled_warning(config.path)) is not None:
            log.warning("%s", warning)
        # recurrent layers whose mixers fanout runs with per-document resets: their rows
        # are packed (fanout.model.varlen_layers); None: each document alone instead
        self.mixers = find_mixers(layers, self.rule)
        if self.mixers:
            self.rule = dataclasses.replace(self.rule, varlen=True)
        self.attn_implementation: str = text_cfg._attn_implementation  # after fallbacks
        self.dense_mask_max_bytes = DENSE_MASK_MAX_BYTES
        # False: transformers' own masks alone (a benchmark's baseline; always for layer
        # types without a rule, whose attention local_attention does not know, for an
        # indexer's top-k, which it does not apply (PackingRule.own_attention), and for
        # `hybrid` layers whose mixers fanout has no forward for: their attention may be
        # a block shared by several layers with no layer index of its own, as Zamba's)
        self.local_attention = self.rule.own_attention and (
            HYBRID not in self.rule.layer_types or bool(self.mixers)
        )
        self.num_layers: int = len(layers)
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.vocab_size: int = int(head.weight.shape[0])
        self.capture_layer_ids: list[int] = resolve_capture_layer_ids(
            self.num_layers, config.capture_layer_ids, config.num_draft_layers
        )
        self._logits: torch.Tensor | None = None  # see _logits_buffer
        plain = isinstance(head, torch.nn.Linear) and head.bias is None
        self._plain_head = plain and config.tp == 1
        self._sharded_head = ShardedHead(head.weight) if plain and config.tp > 1 else None

    @classmethod
    def from_config(cls, config: VerifierConfig) -> Verifier:
        """Load per `config` (see `load_verifier`)."""
        model, dev = load_model(config)
        return cls(model, config, dev)

    def __repr__(self) -> str:
        return (
            f"Verifier({self.config.path!r}, layers={self.num_layers}, H={self.hidden_size}, "
            f"vocab={self.vocab_size}, capture_layer_ids={self.capture_layer_ids}, "
            f"device={self.device}, dtype={self.dtype}, storage={self.storage_dtype})"
        )

    def contract_fields(self) -> dict[str, Any]:
        """The capture-contract fields the verifier decides (hashes read the directory)."""
        return {
            "verifier_config_hash": config_hash(self.config.path),
            "verifier_weights_fingerprint": weights_fingerprint(self.config.path),
            "verifier_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            # contract.json's name for the capture set, kept: it is an on-disk format
            "target_layer_ids": tuple(self.capture_layer_ids),
            "storage_dtype": self.config.storage_dtype,
            "store_last_hidden_states": self.config.store_last_hidden_states,
        }

    @torch.inference_mode()
    def capture(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        *,
        hidden_out: Sequence[torch.Tensor] | None = None,
        scale_out: Sequence[torch.Tensor] | None = None,
        stats_out: torch.Tensor | None = None,
    ) -> Capture:
        """Run the verifier once over packed rows; return captured-layer states and greedy ids.

        input_ids, position_ids, document_ids: [B, T] integer tensors (any device);
        position_ids restart at 0 for each document, document_ids are −1 on padding.
        hidden_out: optional n [B, T, H] storage-dtype tensors on the model's device,
        one per captured layer, for the hooks to write into (the CPU producer passes its
        window buffers, which saves a copy of every batch); fresh device buffers otherwise.
        scale_out: the same for the n [B, T] float32 scales of fp8 storage.
        stats_out: the same for the [n, B, T, 3] float32 `layer_stats`.

        Nothing here waits for the device: CPU inputs are staged through pinned memory
        and copied asynchronously on CUDA, so a caller that also copies the results
        back asynchronously (the producer does) keeps the GPU queue full across batches.
        Rows that run each document alone (`runs_alone`) split them by the host copy of
        `document_ids`, so they too need no sync when it is on the CPU.
        """
        for name, x in ((POSITION_IDS, position_ids), (DOCUMENT_IDS, document_ids)):
            if x.shape != input_ids.shape:
                raise ValueError(
                    f"{name} shape {tuple(x.shape)} != input_ids {tuple(input_ids.shape)}"
                )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        n, h = len(self.capture_layer_ids), self.hidden_size
        dev = self.device
        ids = self._to_device(input_ids)  # [B, T] long
        pos = self._to_device(position_ids)  # [B, T] long
        docs = self._to_device(document_ids)  # [B, T] long

        hidden = _out_buffers(hidden_out, n, (b, t, h), self.storage_dtype, dev, "hidden_out")
        fp8 = self.storage_dtype == FP8
        scales = (
            _out_buffers(scale_out, n, (b, t), torch.float32, dev, "scale_out") if fp8 else None
        )
        (stats,) = _out_buffers(
            None if stats_out is None else [stats_out], 1, (n, b, t, 3), torch.float32, dev,
            "stats_out",
        )  # fmt: skip
        # Where the running forward's tokens go: None = it runs the [B, T] rows
        # themselves; else the DocumentBatch it runs.
        place: list[DocumentBatch | None] = [None]
        handles = []
        for j, layer_id in enumerate(self.capture_layer_ids):
            sl = hidden[j]  # [B, T, H]: this layer's buffer
            sc = scales[j] if scales is not None else None  # [B, T]
            st = stats[j]  # [B, T, 3]

            def hook(
                _m: Any,
                _a: Any,
                out: Any,
                sl: torch.Tensor = sl,
                sc: torch.Tensor | None = sc,
                st: torch.Tensor = st,
                layer_id: int = layer_id,
            ) -> None:
                x = out[0] if isinstance(out, tuple) else out  # [B, T, H] or [k, L, H]
                if x.dim() != 3 or x.shape[-1] != h:  # e.g. hyper-connections: [B, T, m, H]
                    raise ConfigError(
                        f"verifier {self.config.path}: decoder layer {layer_id} outputs "
                        f"{tuple(x.shape)}, not one hidden state of size {h} per token; "
                        "fanout cannot capture it"
                    )
                _store(x, sl, sc, place[0])
                _store_stats(x, st, place[0])

            handles.append(self.layers[layer_id].register_forward_hook(hook))
        try:
            if self.runs_alone(b, t):
                last = torch.empty((b, t, h), dtype=self.dtype, device=dev)  # [B, T, H]
                on = self.local_attention and not self.rule.unruled
                with local_attention(self.base.config, self.rule, on=on):
                    for db in document_batches(ids, pos, document_ids):  # host spans
                        place[0] = db
                        o = self.base(
                            input_ids=db.input_ids, position_ids=db.position_ids, use_cache=False
                        )
                        last[db.rows, db.cols] = db.take(o.last_hidden_state)  # [N, H]
            else:
                o = self._packed_forward(ids, pos, docs, document_ids)
                last = o.last_hidden_state  # [B, T, H], after the final norm
        finally:
            for hd in handles:
                hd.remove()
        target = self._greedy_ids(last)  # [B, T] int32
        last_store = None
        if self.config.store_last_hidden_states:
            scaled = last if self.logit_scale == 1.0 else last * self.logit_scale
            last_store = scaled.to(self.last_hidden_dtype)
        return Capture(
            layers=hidden,
            target_ids=target,
            last_hidden_states=last_store,
            layer_scales=scales,
            layer_stats=stats,
        )

    def runs_alone(self, b: int, t: int) -> bool:
        """Whether [B, T] rows run each document alone rather than under dense masks:
        when a layer type needs it (fanout.model.layer_types) or the masks would take
        more than `dense_mask_max_bytes`."""
        if self.rule.needs_alone(t):
            return True
        elem = 1 if self.attn_implementation == "sdpa" else self.dtype.itemsize
        return self.rule.mask_bytes(b, t, elem) > self.dense_mask_max_bytes

    def _packed_forward(
        self, ids: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, host_docs: torch.Tensor
    ) -> Any:
        """The text model over [B, T] packed rows: dense masks per layer type, or (a
        verifier whose recurrent layers reset per document and whose attention is all
        full: the hybrids) fanout.model.packed_attention's document blocks and the
        mixers' varlen forwards (fanout.model.varlen_layers), from one SegmentLayout of
        `host_docs` (the document ids as the caller gave them: no device sync on CPU)."""
        if not self.rule.varlen:
            mask = self._masks(docs, pos)
            return self.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        layout = SegmentLayout.from_document_ids(host_docs).to(self.device)
        with packed_mixers(self.mixers or {}, layout):
            if self.rule.mask_types != (FULL,):
                mask = self._masks(docs, pos)
                return self.base(
                    input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
                )
            with packed_attention(self.base.config, layout):
                return self.base(input_ids=ids, position_ids=pos, use_cache=False)

    def _masks(
        self, docs: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The packing rule's [B, 1, T, T] masks, as the attention implementation takes
        them: boolean for sdpa, additive (0 / dtype min) for eager."""
        masks = self.rule.masks(docs, pos)
        if self.attn_implementation == "sdpa":
            return masks

        def additive(m: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(m.shape, dtype=self.dtype, device=m.device)
            return z.masked_fill_(~m, torch.finfo(self.dtype).min)

        if isinstance(masks, dict):
            return {k: additive(m) for k, m in masks.items()}
        return additive(masks)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A [B, T] integer input as int64 on the model's device, without a host sync.

        A plain `.to("cuda")` of pageable memory blocks until the GPU has drained
        every kernel queued before it, which would stall the producer once per batch.
        Pinned staging plus `non_blocking` keeps the copy in stream order instead
        (PyTorch's pinned-memory cache keeps the staging buffer alive until it ran).
        """
        if self.device.type != "cuda" or x.device.type == "cuda":
            return x.to(self.device, torch.long)
        staged = torch.empty(x.shape, dtype=torch.long, pin_memory=True).copy_(x)  # one copy
        return staged.to(self.device, non_blocking=True)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """A reused [rows, vocab] logits chunk (model dtype, model device).

        Why reuse: a fresh 620 MB fp32 chunk per 1024 tokens is page-faulted in on
        every call on CPU (the CPU allocator does not cache), which made the chunked
        head cost more than the one big logits matmul it replaces.
        """
        buf = self._logits
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(rows, self.vocab_size, dtype=self.dtype, device=self.device)
            self._logits = buf
        return buf[:rows]

    def _greedy_ids(self, last: torch.Tensor) -> torch.Tensor:
        """argmax(lm_head(last)) in row chunks; never builds [B·T, vocab] at once.

        argmax is invariant to the monotone logit transforms some heads add after
        the projection (positive logit scales, tanh soft-capping), so the plain
        projection suffices for them too. A bias-free `nn.Linear` head (every
        Llama/Qwen-style model) multiplies into one reused chunk buffer (under tensor
        parallelism: its vocabulary shard, fanout.model.tp_shard.ShardedHead); any other
        head is called as a module.
        """
        b, t, h = last.shape
        flat = last.reshape(b * t, h)  # [B·T, H]
        ids = torch.empty(b * t, dtype=torch.int32, device=last.device)  # [B·T]
        step = self.config.chunk_tokens
        head = self.lm_head
        sharded = self._sharded_head
        weight_t = head.weight.t() if self._plain_head else None  # [H, vocab] view
        for s in range(0, b * t, step):
            x = flat[s : s + step]  # [c, H]
            if sharded is not None:
                ids[s : s + step] = sharded.argmax(x)
                continue
            if weight_t is not None:
                logits = torch.mm(x, weight_t, out=self._logits_buffer(x.shape[0]))  # [c, vocab]
            else:
                logits = head(x)  # [c, vocab]
            ids[s : s + step] = row_argmax(logits)
        return ids.view(b, t)


def _store(
    x: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None,
    place: DocumentBatch | None,
) -> None:
    """Write a layer output into its [B, T, H] buffer (fp8: and [B, T] scales).

    x: [B, T, H] for whole rows (place None), or [k, L, H] for a batch of documents,
    whose valid tokens go to (rows, cols) of the buffer.
    """
    if place is None:
        if scale is None:
            out.copy_(x)
        else:
            quantize_into(x, out, scale)
        return
    rows, cols = place.rows, place.cols  # [N] each
    xs = place.take(x)  # [N, H]
    if scale is None:
        out[rows, cols] = xs.to(out.dtype)
        return
    q = torch.empty(xs.shape, dtype=FP8, device=xs.device)  # [N, H]
    s = torch.empty(xs.shape[0], dtype=torch.float32, device=xs.device)  # [N]
    quantize_into(xs, q, s)
    out.view(torch.uint8)[rows, cols] = q.view(torch.uint8)  # fp8 has no index_put
    scale[rows, cols] = s


def token_stats(x: torch.Tensor) -> torch.Tensor:
    """[..., H] → [..., 3] float32: each token's min, max and sum over H (NaN and inf
    propagate into them). Two passes over the layer output, no copy of it: what the
    capture check (fanout.produce.capture_check) needs to see non-finite, all-zero and
    constant rows."""
    lo, hi = torch.aminmax(x, dim=-1)
    return torch.stack([lo.float(), hi.float(), x.sum(-1, dtype=torch.float32)], dim=-1)


def _store_stats(x: torch.Tensor, out: torch.Tensor, place: DocumentBatch | None) -> None:
    """Write `token_stats` of a layer output into its [B, T, 3] buffer (as `_store`)."""
    if place is None:
        out.copy_(token_stats(x))
    else:
        out[place.rows, place.cols] = place.take(token_stats(x))  # [N, 3]


def load_verifier(
    path: str | os.PathLike[str],
    *,
    device: str = "auto",
    dtype: DTypeName = "auto",
    **options: Any,
) -> Verifier:
    """Load an HF causal LM from a local directory (no network) for capture.

    Args:
        path: directory with config.json + weights (what `save_pretrained` writes).
        device: 'auto' (CUDA if available), 'cpu', 'cuda', 'cuda:N'.
        dtype: 'auto' (bf16 on CUDA, fp32 on CPU) or an explicit float dtype.
        options: other `VerifierConfig` fields (capture_layer_ids, num_draft_layers,
            storage_dtype, chunk_tokens, store_last_hidden_states, attn_implementation).
    Returns:
        A Verifier in eval mode with gradients off.
    Raises:
        ConfigError naming the path and what is missing or malformed.
    """
    try:
        cfg = VerifierConfig(path=str(path), device=device, dtype=dtype, **options)
    except ValueError as e:
        raise ConfigError(f"verifier options: {e}") from None
    return Verifier.from_config(cfg)
