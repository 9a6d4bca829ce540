"""The verifier: load an HF causal LM from a local directory and capture what DFlash drafts need.

    from fanout.model.verifier import load_verifier
    v = load_verifier("/models/Qwen3-8B", num_draft_layers=5)        # CUDA + bf16 if present
    cap = v.capture(input_ids, position_ids, document_ids)            # each [B, T]
    cap.layers         # n × [B, T, H] storage dtype — outputs of decoder layers v.capture_layer_ids
    cap.layer_scales   # n × [B, T] float32 per-token scales with fp8 storage (fanout.ops.fp8), else None
    cap.target_ids     # [B, T] int32 — argmax of the verifier's logits at every position
    cap.hidden_states  # [B, T, n·H]: the layers side by side (a copy; what a draft's fc takes)

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

**Packed rows.** A row holds several documents. We pass a 4D block-diagonal causal mask
built from `document_ids` (a token attends to earlier tokens of its own document
only; padding, document id −1, attends only to itself), and the caller's
`position_ids` restart at 0 per document, so each document is computed exactly as if
it ran alone (tested: max abs diff ≤ 1e-4 in fp32). Supported attention
implementations: `sdpa` (boolean mask) and `eager` (additive mask); both accept a
prepared 4D mask unchanged (transformers 5.x; tested with 5.24).

**Tensor parallel** (`tp` > 1, one process per rank under torchrun): each rank loads
its shard with transformers' TP plan (fanout.model.tp) and `capture` runs unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fanout.errors import ConfigError
from fanout.hashing import hasher, labelled
from fanout.model.capture_layers import CaptureLayers, resolve_capture_layer_ids
from fanout.model.tp import ShardedHead, check_tp_model, model_device, tp_load_kwargs
from fanout.ops.argmax import row_argmax
from fanout.ops.fp8 import FP8, quantize_into
from fanout.rows import DOCUMENT_IDS, POSITION_IDS

DTypeName = Literal["auto", "bfloat16", "float16", "float32"]
StorageDType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": FP8,  # storage only: per-token scales (fanout.ops.fp8)
}
# Files whose bytes are model weights (top level of the directory, like from_pretrained).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# --------------------------------------------------------------------------- identity


def config_hash(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of the verifier's `config.json`, canonicalised.

    Canonical = parsed and re-dumped with sorted keys, without the fields that name
    the writer rather than the model (`transformers_version`, `_name_or_path`), so
    re-saving the same model with another transformers version keeps the hash.
    """
    cfg = _read_config(Path(path))
    for k in ("transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    blob = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def max_position_embeddings(path: str | os.PathLike[str]) -> int | None:
    """The verifier's `max_position_embeddings` from its config.json (a multimodal
    model's `text_config` when the top level has none); None if it declares none.
    Read from the file, without loading the model, so a producer can refuse a
    `--seq-len` above it before it creates anything."""
    cfg = _read_config(Path(path))
    for section in (cfg, cfg.get("text_config")):
        v = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def weights_fingerprint(
    path: str | os.PathLike[str],
    *,
    full_hash_bytes: int = 64 << 20,
    samples_per_file: int = 16,
    sample_bytes: int = 256 << 10,
) -> str:
    """A cheap fingerprint of the weight files: changes when the weights change.

    Per weight file (sorted by name): its name and size; for files up to
    `full_hash_bytes` every byte; for larger ones the whole safetensors header
    (tensor names, dtypes, shapes, offsets) plus `samples_per_file` ranges of
    `sample_bytes` spread evenly over the data (first and last included). Index
    files are hashed whole. All through xxh3-128 (fanout.hashing).

    Why: hashing all of a 16 GB checkpoint takes a minute or more on a network
    filesystem, every producer start. Headers catch any change of architecture,
    dtype or layout; sizes catch truncation; sampled bytes catch re-trained or
    fine-tuned weights (which change essentially every tensor), for ~4 MiB of
    reads per file. What it cannot see: an edit confined to bytes outside the
    samples of a large file (say, one flipped weight) — small files, like the tiny
    test verifiers, are hashed in full so such edits are caught there.
    """
    root = Path(path)
    files = _weight_files(root)
    h = hasher()
    h.update(f"fanout-weights-v1:{full_hash_bytes}:{samples_per_file}:{sample_bytes};".encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            if size <= full_hash_bytes or f.name in _WEIGHT_INDEXES:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
                continue
            data_start = 0
            if f.suffix == ".safetensors":
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(n))
                data_start = 8 + n
            last = max(data_start, size - sample_bytes)
            k = max(samples_per_file, 2)
            for j in range(k):
                fh.seek(data_start + (last - data_start) * j // (k - 1))
                h.update(fh.read(sample_bytes))
    return labelled(h)


def _weight_files(root: Path) -> list[Path]:
    files = sorted(
        p
        for p in root.iterdir()
        if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name in _WEIGHT_INDEXES)
    )
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise ConfigError(
            f"verifier directory {root}: no weight files (*.safetensors or pytorch_model*.bin)"
        )
    return files


def _read_config(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise ConfigError(f"verifier directory {root} does not exist")
    if not root.is_dir():
        raise ConfigError(f"verifier path {root} is not a directory (want a from_pretrained dir)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"verifier directory {root}: config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


# --------------------------------------------------------------------------- config


class VerifierOptions(BaseModel):
    """How to run the verifier, whatever it is and whichever layers it captures. Declared
    once here; `fanout produce` inherits these fields (one flag each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(
        "auto", description="verifier device: auto (CUDA if present) | cpu | cuda | cuda:N"
    )
    dtype: DTypeName = Field(
        "auto", description="verifier compute dtype; auto = bf16 on CUDA, fp32 on CPU"
    )
    storage_dtype: StorageDType = Field(
        "bfloat16",
        description="dtype of captured hidden states, what windows store (contract); "
        "float8_e4m3fn halves the bytes of bf16 with one float32 scale per token and layer "
        "(docs/producer.md)",
    )
    num_draft_layers: int | None = Field(
        5, gt=0, description="draft layers for the DFlash layer rule (when no layers are given)"
    )
    chunk_tokens: int = Field(
        1024, gt=0, description="tokens per lm_head chunk for target_ids (bounds logits memory)"
    )
    store_last_hidden_states: bool = Field(
        False, description="also capture the final-normed hidden states [R, T, H] (contract)"
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="HF attention backend; both take our 4D packed-document mask"
    )
    tp: int = Field(
        1,
        ge=1,
        description="tensor-parallel ranks the verifier is split over; > 1 runs under "
        "torchrun --nproc-per-node TP, rank 0 publishes (docs/producer.md)",
    )
    tp_timeout_s: float = Field(
        300.0,
        gt=0,
        description="with --tp: how long a rank waits on the others before it stops "
        "(a dead or hung rank stops every rank within this)",
    )

    def verifier_options(self) -> dict[str, Any]:
        """This config's VerifierOptions fields, by name (`load_verifier(path, **these)`)."""
        return {k: getattr(self, k) for k in VerifierOptions.model_fields}

    @field_validator("device")
    @classmethod
    def _device_ok(cls, v: str) -> str:
        if v != "auto":
            try:
                torch.device(v)
            except RuntimeError as e:
                raise ValueError(f"device {v!r}: {e}") from None
        return v


class VerifierConfig(VerifierOptions, CaptureLayers):
    """How to load and run the verifier: which one, which layers (CaptureLayers), and
    VerifierOptions."""

    path: str = Field(description="Local HF model directory (config.json + weights).")


@dataclass(frozen=True, slots=True)
class Capture:
    """What one verifier forward yields for a batch of packed rows (on the model's device)."""

    layers: tuple[torch.Tensor, ...]  # n × [B, T, H] storage dtype, in capture_layer_ids order
    target_ids: torch.Tensor  # [B, T] int32 — argmax of logits at t (prediction of token t+1)
    last_hidden_states: torch.Tensor | None  # [B, T, H] storage dtype (bf16 for fp8), or None
    layer_scales: tuple[torch.Tensor, ...] | None = None  # n × [B, T] float32 with fp8 storage

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


def packed_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean 4D mask (True = may attend) keeping attention inside each document.

    document_ids [B, T] int; −1 marks padding, which attends only to itself (so no
    query row is empty, which would give NaN in softmax).
    """
    t = document_ids.shape[1]
    d = document_ids
    causal = torch.ones(t, t, dtype=torch.bool, device=d.device).tril()  # [T, T]
    same = (d[:, :, None] == d[:, None, :]) & (d >= 0)[:, :, None]  # [B, T, T]
    allowed = (same & causal) | torch.eye(t, dtype=torch.bool, device=d.device)  # [B, T, T]
    return allowed[:, None]  # [B, 1, T, T]


class Verifier:
    """A loaded verifier in eval mode, ready to `capture` packed rows. Build with `load_verifier`."""

    def __init__(self, model: Any, config: VerifierConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.storage_dtype = _DTYPES[config.storage_dtype]
        # last_hidden_states are stored as bf16 under fp8 storage (they feed a KL loss
        # through the frozen head, where per-token scales would only add error).
        self.last_hidden_dtype = torch.bfloat16 if self.storage_dtype == FP8 else self.storage_dtype
        base = getattr(model, model.base_model_prefix, None)
        layers = getattr(base, "layers", None)
        head = model.get_output_embeddings()
        if base is None or layers is None or head is None:
            raise ConfigError(
                f"verifier {config.path}: {type(model).__name__} has no base_model.layers / "
                "lm_head; only decoder-only causal LMs (Llama/Qwen-style) are supported"
            )
        if getattr(base, "has_sliding_layers", False):
            # Our one 4D mask would silently turn sliding-window layers into full attention.
            raise ConfigError(
                f"verifier {config.path}: sliding-window attention layers are not supported "
                "by the packed-document mask yet"
            )
        self.base = base
        self.layers = layers
        self.lm_head = head
        text_cfg = model.config.get_text_config()
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
        model, dev = _load_model(config)
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
    ) -> Capture:
        """Run the verifier once over packed rows; return captured-layer states and greedy ids.

        input_ids, position_ids, document_ids: [B, T] integer tensors (any device);
        position_ids restart at 0 for each document, document_ids are −1 on padding.
        hidden_out: optional n [B, T, H] storage-dtype tensors on the model's device,
        one per captured layer, for the hooks to write into (the CPU producer passes its
        window buffers, which saves a copy of every batch); fresh device buffers otherwise.
        scale_out: the same for the n [B, T] float32 scales of fp8 storage.

        Nothing here waits for the device: CPU inputs are staged through pinned memory
        and copied asynchronously on CUDA, so a caller that also copies the results
        back asynchronously (the producer does) keeps the GPU queue full across batches.
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
        mask = packed_attention_mask(self._to_device(document_ids))  # [B, 1, T, T] bool
        if self.config.attn_implementation == "eager":
            # eager adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=dev).masked_fill_(
                ~mask, torch.finfo(self.dtype).min
            )

        hidden = _out_buffers(hidden_out, n, (b, t, h), self.storage_dtype, dev, "hidden_out")
        fp8 = self.storage_dtype == FP8
        scales = (
            _out_buffers(scale_out, n, (b, t), torch.float32, dev, "scale_out") if fp8 else None
        )
        handles = []
        for j, layer_id in enumerate(self.capture_layer_ids):
            sl = hidden[j]  # [B, T, H]: this layer's buffer
            sc = scales[j] if scales is not None else None  # [B, T]

            def hook(
                _m: Any, _a: Any, out: Any, sl: torch.Tensor = sl, sc: torch.Tensor | None = sc
            ) -> None:
                x = out[0] if isinstance(out, tuple) else out  # [B, T, H]
                if sc is None:
                    sl.copy_(x)
                else:
                    quantize_into(x, sl, sc)

            handles.append(self.layers[layer_id].register_forward_hook(hook))
        try:
            out = self.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        finally:
            for hd in handles:
                hd.remove()
        last = out.last_hidden_state  # [B, T, H], after the final norm
        target = self._greedy_ids(last)  # [B, T] int32
        last_store = None
        if self.config.store_last_hidden_states:
            last_store = last.to(self.last_hidden_dtype)
        return Capture(
            layers=hidden,
            target_ids=target,
            last_hidden_states=last_store,
            layer_scales=scales,
        )

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
        parallelism: its vocabulary shard, fanout.model.tp.ShardedHead); any other
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


def check_verifier_dir(path: str | os.PathLike[str]) -> None:
    """What a verifier directory must hold, checked without loading it: a readable
    config.json (a JSON object) and weight files. ConfigError naming what is missing, so
    a command refuses the directory before it creates or loads anything."""
    root = Path(path)
    _read_config(root)
    _weight_files(root)


def resolve_device(device: str) -> torch.device:
    """The device `--device` names: auto = CUDA if present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: DTypeName, device: torch.device) -> torch.dtype:
    """The compute dtype `--dtype` names on `device`: auto = bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _load_model(cfg: VerifierConfig) -> tuple[Any, torch.device]:
    from safetensors import SafetensorError  # a damaged weight file
    from transformers import AutoModelForCausalLM

    root = Path(cfg.path)
    check_verifier_dir(root)  # clear errors for missing dir / config / weights before HF's
    if cfg.tp > 1:
        check_tp_model(root, cfg.tp)  # before any weight is read
    dev = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            root,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=cfg.attn_implementation,
            **(tp_load_kwargs(cfg.tp) if cfg.tp > 1 else {}),
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ConfigError(f"verifier directory {root}: cannot load: {e}") from None
    if cfg.tp > 1:
        dev = model_device(model)  # transformers put this rank's shard on its device
    else:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return model, dev
