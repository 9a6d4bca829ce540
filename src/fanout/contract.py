"""Capture contract: everything that lets several consumers share one capture.

    from fanout.contract import CaptureContract
    c = CaptureContract.load("runs/demo/contract.json"); print(c.stream_id)

Two consumers can share a producer's windows iff they agree on every field
here, except the layers: `target_layer_ids` is the set the producer captured,
and a consumer may train on any subset of it (`require`). A draft reads its subset in
ascending layer order, whatever order it was asked in (`ascending_layer_ids`, the one
place that order is decided; `DraftLayerIds` refuses any other order).
Consumer-side choices (block size, loss, lr, seed, layer subset) are deliberately
not in it. The hash of the contract names the stream; a window file carries it in
its metadata so a file from another contract is never served.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from fanout.errors import ConfigError, ContractMismatch
from fanout.filesystem import FileSystem
from fanout.hashing import identity_digest

# 2: one tensor per captured layer, a checksum per tensor (fanout-window-2); 1 is refused.
CONTRACT_FORMAT_VERSION = 2

log = logging.getLogger(__name__)


def ascending_layer_ids(ids: Iterable[int], where: str = "target_layer_ids") -> list[int]:
    """The layers a draft reads, in the one order they are ever used: ascending.

    Serving engines gather a draft's auxiliary hidden states in layer order whatever
    order its config lists them in (vLLM's model loop appends layer `idx`'s state when
    `idx` is in the set; `fanout eval`'s hooks fire in layer order too), so the context
    a draft trains on, its `fc` columns and `aux_hidden_state_layer_ids` are ascending.
    Another order is normalised here, at the config boundary, and said at info.

    >>> ascending_layer_ids([5, 2])
    [2, 5]
    """
    asked = [int(i) for i in ids]
    out = sorted(asked)
    if out != asked:
        log.info(
            "%s %s: a draft reads its layers in ascending order (the order serving engines "
            "feed them), so it reads %s",
            where,
            asked,
            out,
        )
    return out


def _strictly_ascending(v: list[int]) -> list[int]:
    if list(v) != sorted(set(v)):
        raise ValueError(
            f"target_layer_ids {list(v)} are not distinct and ascending; a draft's context "
            "and fc columns are in ascending layer order (fanout.contract.ascending_layer_ids)"
        )
    return v


# A draft's layers (DraftConfig.target_layer_ids): refused unless strictly ascending,
# so an order that reached a draft without passing `ascending_layer_ids` fails loudly.
DraftLayerIds = Annotated[list[int], AfterValidator(_strictly_ascending)]


class LayersNotCaptured(ContractMismatch):
    """A consumer asked for layers the run did not capture; the message lists the captured ones."""

    def __init__(
        self, missing: list[int], captured: list[int], asked: list[int], where: str
    ) -> None:
        super().__init__({"target_layer_ids": (captured, asked)}, where)
        loc = f" ({where})" if where else ""
        self.args = (
            f"capture contract mismatch{loc}: target layers {missing} were not captured by "
            f"this run: it captured {captured}. --draft-layer-ids (draft_layer_ids) may be "
            "any subset of those (read in ascending order); for other layers produce a run with "
            "--capture-layer-ids",
        )


class CaptureContract(BaseModel):
    """What a window means. Frozen; unknown fields are rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = Field(CONTRACT_FORMAT_VERSION, description="Window format version.")
    verifier_config_hash: str = Field(
        description="sha256 of the verifier's config.json (canonical)."
    )
    verifier_weights_fingerprint: str = Field(
        description="Fingerprint of the verifier weights (headers + sizes + sampled bytes)."
    )
    verifier_num_layers: int = Field(gt=0, description="Decoder layers in the verifier.")
    hidden_size: int = Field(gt=0, description="Verifier hidden size H.")
    vocab_size: int = Field(gt=0, description="Verifier vocabulary size (lm_head rows).")
    # the capture set (--capture-layer-ids); contract.json's name for it, kept on purpose
    target_layer_ids: tuple[int, ...] = Field(
        description="Decoder layers whose outputs are captured, in capture order; each "
        "window holds hidden_states.<layer> [R, T, H] for each, and a consumer may read "
        "any subset of them."
    )
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="dtype of hidden_states on disk; float8_e4m3fn windows also carry "
        "hidden_states_scale.<layer> [R, T] (fanout.ops.fp8).",
    )
    target_kind: Literal["greedy_ids"] = Field(
        "greedy_ids", description="What target_ids holds: the verifier's argmax next token."
    )
    store_last_hidden_states: bool = Field(
        False, description="Whether windows also carry last_hidden_states [R, T, H]."
    )
    dataset_fingerprint: str = Field(description="Fingerprint of the packed-row source.")
    tokenizer_fingerprint: str = Field(description="Fingerprint of tokenizer files + template.")
    seq_len: int = Field(gt=0, description="Tokens per packed row (T).")
    window_rows: int = Field(gt=0, description="Rows per window (R).")
    shuffle_seed: int = Field(description="Seed of the per-epoch row shuffle.")

    @field_validator("target_layer_ids")
    @classmethod
    def _layers_valid(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("target_layer_ids must not be empty")
        if len(set(v)) != len(v):
            raise ValueError(f"target_layer_ids has duplicates: {v}")
        if any(i < 0 for i in v):
            raise ValueError(f"target_layer_ids must be >= 0: {v}")
        return v

    @property
    def stream_id(self) -> str:
        """Short hash naming the stream (16 hex chars of sha256 of the canonical JSON)."""
        return identity_digest(self.model_dump(mode="json"))[:16]

    def diff(self, other: CaptureContract) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ: {field: (self's value, other's value)}."""
        a, b = self.model_dump(mode="json"), other.model_dump(mode="json")
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def require(self, expected: dict[str, Any], where: str = "") -> None:
        """Raise ContractMismatch naming every field of `expected` that differs.

        Consumers pass only what their flags imply (e.g. target_layer_ids, seq_len);
        unknown field names are a ConfigError, not a silent pass. `target_layer_ids`
        must be a subset of the captured layers (no duplicates), not equal
        to them: LayersNotCaptured lists the captured ones. A run written in an older
        window format is a ConfigError (its windows cannot be read).
        """
        loc = f" ({where})" if where else ""
        if self.format_version != CONTRACT_FORMAT_VERSION:
            raise ConfigError(
                f"this run{loc} was produced with window format {self.format_version}; this "
                f"fanout reads format {CONTRACT_FORMAT_VERSION} (one tensor per captured "
                "layer, a checksum per tensor). Produce it again, in a new --run-dir"
            )
        mine = self.model_dump(mode="json")
        unknown = sorted(set(expected) - set(mine))
        if unknown:
            raise ConfigError(f"unknown contract fields {unknown}; known: {sorted(mine)}")
        normalized = {
            k: list(v) if isinstance(v, tuple) else v for k, v in expected.items() if v is not None
        }
        asked = normalized.pop("target_layer_ids", None)
        bad = {k: (mine[k], v) for k, v in normalized.items() if mine[k] != v}
        missing: list[int] = []
        if asked is not None:
            asked = [int(i) for i in asked]
            if not asked or len(set(asked)) != len(asked):
                raise ConfigError(f"target_layer_ids{loc}: want distinct layers, got {asked}")
            missing = [i for i in asked if i not in mine["target_layer_ids"]]
            if missing:
                bad["target_layer_ids"] = (mine["target_layer_ids"], asked)
        if missing and len(bad) == 1:
            raise LayersNotCaptured(missing, mine["target_layer_ids"], asked or [], where)
        if bad:
            raise ContractMismatch(bad, where)

    def save(self, path: str | os.PathLike[str], fs: FileSystem | None = None) -> None:
        """Write atomically and durably, 0644 (`FileSystem.write_atomic`; `fs` injects
        faults in tests)."""
        data = json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        (fs or FileSystem()).write_atomic(path, data.encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CaptureContract:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no contract.json (has a producer run here yet?)") from None
        except ValueError as e:
            raise ConfigError(f"{path}: invalid contract: {e}") from None
