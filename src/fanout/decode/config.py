"""The configs of `fanout eval` and `fanout promote`: every flag, validated, without torch.

    from fanout.decode.config import EvalConfig, PromoteConfig
    cfg = EvalConfig(verifier_name_or_path=V, tokenizer=TOK, data=D, draft=[DIR])

Kept apart from the decoding code (fanout.decode.eval, .promote) so that a flag error
comes back before torch is imported (fanout.cli.EARLY; benchmarks/startup.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from fanout.checkpoints.versions import CURRENT as CURRENT  # re-exported: promote
from fanout.checkpoints.versions import VERSIONS as VERSIONS
from fanout.checkpoints.versions import current_version
from fanout.data.chat import ChatFormat
from fanout.flags import flag_options
from fanout.tracking import TrackingOptions

HELDOUT = "heldout.jsonl"  # a live run's held-out traffic, in RUN_DIR/follow (produce/follow)
# a served directory's layout (fanout.decode.promote): DIR/current -> versions/vNNNN
# (fanout.checkpoints.versions, the layout's one reader), beside its decisions
DECISIONS = "promotions.jsonl"
DRIFT = "drift.jsonl"  # in RUN_DIR/follow, beside HELDOUT: promote --run-dir's looks
PROMOTE = "promote.json"  # in RUN_DIR/follow: promote --run-dir's newest decision


def served_version(served: str | Path) -> str | None:
    """The version a served directory serves now (`current`'s target, "v0003"); None
    when nothing is served there (or it is not one). No torch: status reads it."""
    v = current_version(served)
    return None if v is None else v.name


# (PromoteConfig field, stream.json key, flag) of what a run records of its capture
RECORDED = (
    ("verifier_name_or_path", "verifier", "--verifier-name-or-path"),
    ("tokenizer", "tokenizer", "--tokenizer"),
)


def _recorded(run: Path, key: str, flag: str) -> str:
    """What RUN_DIR/stream.json records under `key` (fanout.store.streaminfo.StreamInfo,
    read here as JSON: decode sits below store in the layers)."""
    path = run / "stream.json"
    try:
        got = json.loads(path.read_text()).get(key)
    except FileNotFoundError:
        got = None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e}); give {flag}") from None
    if not got:
        raise ValueError(
            f"--run-dir {run}: the run records no {key} (no producer started it yet, or "
            f"an older fanout did); give {flag}"
        )
    return str(got)


def temperature_key(t: float) -> str:
    """`at_temperature` key: the temperature as a decimal string ("0.0", "1.0", "0.8")."""
    return str(float(t))


class EvalConfig(ChatFormat, TrackingOptions):
    """Every `fanout eval` flag (the chat-format fields are ChatFormat's, as in `fanout
    prepare` and `fanout produce`)."""

    verifier_name_or_path: str = Field(description="local verifier dir (the full model)")
    draft: list[str] = Field(
        default_factory=list,
        description="draft checkpoint dir or trainer --save-path (at least one)",
        json_schema_extra=flag_options(metavar="DIR", repeatable=True),
    )
    data: str = Field(description="chat data (JSON/JSONL/Parquet, any format prepare reads)")
    tokenizer: str = Field(description="tokenizer dir with the chat template")
    max_new_tokens: int = Field(128, gt=0, description="tokens to generate per prompt")
    num_prompts: int = Field(8, gt=0, description="prompts to decode (the file's first ones)")
    tau_half_width: float | None = Field(
        None,
        gt=0,
        description="past --num-prompts, keep decoding the file's next prompts until every "
        "draft's τ 95% interval is at most ± this at every temperature (or --max-prompts)",
    )
    max_prompts: int | None = Field(
        None,
        gt=0,
        description="with --tau-half-width: the most prompts to decode (default 4 × --num-prompts)",
    )
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="verifier and draft dtype (lossless is exact in float32)"
    )
    eos_token_id: list[int] | None = Field(
        None, description="stop tokens; default: the verifier's config / generation_config"
    )
    temperature: list[float] = Field(
        default_factory=lambda: [0.0],
        description="sampling temperatures to evaluate (0 = greedy, always evaluated: the "
        "lossless check)",
        json_schema_extra=flag_options(metavar="T"),
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass kept at T > 0 (p and q)")
    top_k: int = Field(0, ge=0, description="most likely tokens kept at T > 0 (0: all)")
    seed: int = Field(0, description="sampling seed (per prompt: seed, prompt index)")
    sampled_draft: bool = Field(
        True,
        description="at T > 0 also report τ under the min(1, p/q) rule with sampled draft "
        "tokens (acceptance_length_sampled_draft) beside the served greedy-draft rule",
    )
    cache_draft: bool = Field(
        True, description="cache the draft's context k/v as engines do (off: the slow reference)"
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens a chain-drafting draft (EAGLE-3) proposes per verify step, as "
        "vLLM's num_speculative_tokens; default: its checkpoint's (its --ttt-steps). Block "
        "drafts (DFlash families) draft their block whatever this says",
    )
    model_card: bool = Field(
        False, description="write README.md (τ per temperature) into each draft's checkpoint"
    )
    json_out: str | None = Field(
        None,
        description="write the full report as JSON here",
        json_schema_extra=flag_options(flag="--json", metavar="OUT"),
    )

    @field_validator("temperature")
    @classmethod
    def _temps(cls, v: list[float]) -> list[float]:
        if any(t < 0 for t in v):
            raise ValueError(f"{v}: temperatures must be >= 0")
        return sorted({0.0, *(float(t) for t in v)})

    @model_validator(mode="after")
    def _prompt_cap(self) -> EvalConfig:
        if self.max_prompts is not None and self.max_prompts < self.num_prompts:
            raise ValueError(
                f"--max-prompts {self.max_prompts} is below --num-prompts {self.num_prompts}"
            )
        return self

    def prompt_limit(self) -> int:
        """How many prompts to load: --num-prompts, or the cap with --tau-half-width."""
        if self.tau_half_width is None:
            return self.num_prompts
        return self.max_prompts or 4 * self.num_prompts

    @field_validator("data", "tokenizer", "verifier_name_or_path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).exists():
            raise ValueError(f"{v}: no such file or directory")
        return v


class PromoteConfig(EvalConfig):
    """Every `fanout promote` flag: `fanout eval`'s (the held-out prompts, temperatures,
    device; `--draft` is the one candidate) and these."""

    served: str = Field(
        description="served directory: current -> versions/vNNNN (point the engine at "
        "DIR/current), promotions.jsonl; created on the first promotion"
    )
    margin: float | None = Field(
        None,
        ge=0,
        description="promote when the candidate's τ beats the served one's by at least this "
        "(point estimates); default: only when their 95% intervals are apart",
    )
    decide_temperature: float = Field(
        0.0, ge=0, description="the temperature whose τ decides (one of --temperature)"
    )
    keep_versions: int = Field(3, ge=2, description="promoted versions kept in DIR/versions")
    once: bool = Field(False, description="decide on the newest checkpoint once, then exit")
    rollback: bool = Field(False, description="point DIR/current at the version before it")
    poll_s: float = Field(60.0, gt=0, description="without --once: seconds between looks")
    run_dir: str | None = Field(
        None,
        description="a live run (fanout produce --follow): its held-out traffic is the "
        "default --data, the verifier and tokenizer it was captured with (RUN_DIR/stream.json) "
        "the default --verifier-name-or-path and --tokenizer, and the served draft's τ on its "
        "newest slice is recorded in RUN_DIR/follow/drift.jsonl at each look",
    )
    floor_epsilon: float = Field(
        0.01,
        description="a candidate whose τ is at most 1 + this accepts (next to) no draft "
        "token: it is never served, said loudly (--once exits 3); negative: no floor",
    )

    # fields a before-validator fills from another flag: --help says so (fanout.flags)
    required_unless: ClassVar[dict[str, str]] = {
        "data": "--run-dir",
        "verifier_name_or_path": "--run-dir",
        "tokenizer": "--run-dir",
    }

    @model_validator(mode="before")
    @classmethod
    def _heldout_is_the_data(cls, v: Any) -> Any:
        """--run-dir R: R/follow/heldout.jsonl is --data, and the verifier and tokenizer
        R's producer recorded in R/stream.json are --verifier-name-or-path and
        --tokenizer, unless given (flags win)."""
        if not (isinstance(v, dict) and v.get("run_dir")):
            return v
        run = Path(v["run_dir"])
        if not v.get("data"):
            v = v | {"data": str(run / "follow" / HELDOUT)}
        for field, key, flag in RECORDED:
            if not v.get(field):
                v = v | {field: _recorded(run, key, flag)}
        return v

    @model_validator(mode="after")
    def _one_candidate(self) -> PromoteConfig:
        if len(self.draft) != 1:
            raise ValueError(f"--draft: give exactly one candidate (got {len(self.draft)})")
        if temperature_key(self.decide_temperature) not in map(temperature_key, self.temperature):
            raise ValueError(
                f"--decide-temperature {self.decide_temperature:g} is not among --temperature"
            )
        return self


__all__ = ["HELDOUT", "EvalConfig", "PromoteConfig", "temperature_key"]
