"""How to load and run a verifier: its options (one `fanout produce` flag each), dtypes, device.

    from fanout.model.verifier_config import VerifierConfig, resolve_device, resolve_dtype
    cfg = VerifierConfig(path="/models/Qwen3-8B", storage_dtype="float8_e4m3fn")
    dev = resolve_device(cfg.device); dtype = resolve_dtype(cfg.dtype, dev)

No torch model is built here: fanout.model.verifier_load loads one per these fields,
fanout.model.verifier captures with it (and re-exports these names).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fanout.model.capture_layers import CaptureLayers
from fanout.ops.fp8 import FP8

DTypeName = Literal["auto", "bfloat16", "float16", "float32"]
StorageDType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": FP8,  # storage only: per-token scales (fanout.ops.fp8)
}


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
    strict_layer_types: bool = Field(
        False,
        description="refuse a verifier with a layer type fanout has no packing rule for "
        "(compressed_sparse_attention, ...) instead of running each document of a row "
        "alone (exact, slower; docs/producer.md)",
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


def resolve_device(device: str) -> torch.device:
    """The device `--device` names: auto = CUDA if present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: DTypeName, device: torch.device) -> torch.dtype:
    """The compute dtype `--dtype` names on `device`: auto = bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]
