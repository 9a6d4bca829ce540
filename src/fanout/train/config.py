"""`fanout train`'s config (scripts/train.py): every flag, composed from the parts that
declare them.

    cfg = TrainConfig(run_dir="runs/r1", consumer_id="draft-b8", save_path="runs/r1/drafts/b8",
                      verifier_name_or_path=VERIFIER_DIR, block_size=8)
    Trainer(cfg).run()         # fanout.train.trainer

Flags are generated from its fields (fanout.flags).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from fanout.coord.postgresdb import redact
from fanout.families.registry import FamilyOptions
from fanout.flags import limit_flag
from fanout.model.draft_config import DraftRecipe
from fanout.tracking import TrackingOptions, wandb_missing
from fanout.train.consumer import ConsumerConfig, ConsumerOptions
from fanout.train.verifier_versions import VersionOptions

# The flags a resume may change (a changed one is named in a log line): where the run,
# the verifier and the checkpoints are, how long it trains (the schedule follows them:
# docs/training.md "The learning-rate schedule"), what it logs and evaluates, the weight
# average it serves, and what runs it (--device, --adamw-backend: the same arithmetic,
# to the last bits of their kernels). Every other field decides what the next step
# computes (--seed, --rows-per-step, --lr, the draft's recipe, ...): a resume with
# another value is refused, naming it (fanout.train.setup.check_resume). A new field is
# checked unless it is added here.
RESUME_MAY_CHANGE = frozenset(
    {
        "run_dir", "db_path", "consumer_id", "dp_rank", "save_path", "verifier_name_or_path",
        "checkpoint_verifier_name", "acquire_timeout_s", "heartbeat_s", "prefetch", "takeover",
        "resume", "max_steps", "epochs", "scheduler_type", "checkpoint_every",
        "checkpoint_every_s", "keep_checkpoints", "ema_decay", "eval_every", "eval_data",
        "eval_tokenizer", "eval_prompts", "eval_max_new_tokens", "log_every", "logger",
        "wandb_project", "wandb_group", "progress", "device", "adamw_backend",
        "max_nonfinite_steps", "max_verifier_lag", "dp_timeout_s",
    }
)  # fmt: skip


class TrainConfig(ConsumerOptions, DraftRecipe, FamilyOptions, VersionOptions, TrackingOptions):
    """Every `fanout train` (scripts/train.py) flag; speculators trainer names where the
    meaning is the same. How the trainer reads the run (run_dir, consumer_id, dp_rank,
    db_path, draft_layer_ids, acquire_timeout_s, heartbeat_s, prefetch, takeover) is
    ConsumerOptions', declared once in fanout.train.consumer; the draft's recipe
    (num_layers, block_size, max_anchors, draft_vocab_size, gamma, loss weighting,
    dpace_alpha, label_source, loss_type) is DraftRecipe's, declared once in
    fanout.model.draft_config with the defaults that work on a real verifier; the family
    (--draft-family) and each family's own options are FamilyOptions'
    (fanout.families.registry); where --logger wandb logs TrackingOptions'
    (fanout.tracking); a verifier that changes (--max-verifier-lag, --verifier-age-decay)
    VersionOptions' (fanout.train.verifier_versions); these are the trainer's."""

    verifier_name_or_path: str = Field(description="local verifier dir (embedding, lm_head, norm)")
    checkpoint_verifier_name: str | None = Field(
        None,
        description="verifier name written into checkpoints for serving (e.g. Qwen/Qwen3-8B); "
        "default: the absolute path of --verifier-name-or-path",
    )
    # Not DraftConfig's: a choice here (None: the verifier's last id); the draft's is the
    # id it resolved to.
    mask_token_id: int | None = Field(None, description="mask token id; default: vocab_size - 1")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    warmup_ratio: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="fraction of the schedule's total steps spent warming up (linearly to "
        "--lr); where the total is not known at start, the first 100 steps (0: none)",
    )
    scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="lr after warm-up: cosine or linear decay to 0 at the total steps, or "
        "constant. The total: --max-steps, or the steps the stream (--epochs of it) makes, "
        "from the producer's stream.json, whichever is less; an on-policy stream still "
        "regenerating is estimated from its plan and corrected, without a jump in lr, once "
        "its length is recorded (the start log line says which)",
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip global grad norm; none = off")
    adamw_backend: Literal["auto", "fused", "foreach"] = Field(
        "auto", description="AdamW implementation (auto: fused where supported)"
    )
    epochs: float | None = Field(
        None,
        gt=0,
        description="passes over the data to read (its rows from stream.json; on an "
        "on-policy stream still regenerating, decided once its rows are recorded); "
        "default: the whole stream",
    )
    max_steps: int | None = limit_flag(
        "stop after this many optimizer steps (the schedule's total, unless the stream ends sooner)"
    )
    eval_every: int | None = Field(
        None,
        ge=1,
        description="every N steps, speculative-decode --eval-prompts held-out prompts with the "
        "draft and log eval_tau (loads the whole verifier into this trainer; docs/eval.md)",
    )
    eval_data: str | None = Field(None, description="held-out chat data for --eval-every")
    eval_tokenizer: str | None = Field(
        None, description="tokenizer dir for --eval-data; default: --verifier-name-or-path"
    )
    eval_prompts: int = Field(4, ge=1, description="prompts per --eval-every evaluation")
    eval_max_new_tokens: int = Field(32, ge=1, description="tokens generated per eval prompt")

    @model_validator(mode="after")
    def _eval_needs_data(self) -> TrainConfig:
        if self.logger == "wandb" and (why := wandb_missing("--logger wandb")):
            raise ValueError(why)
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data (held-out chat data)")
        if self.eval_data and not Path(self.eval_data).is_file():
            raise ValueError(f"--eval-data {self.eval_data}: no such file")
        return self

    rows_per_step: int = Field(2, ge=1, description="window rows per optimizer step")
    save_path: str = Field(
        description="checkpoint directory; one that holds checkpoints is resumed from "
        "(--resume) or refused, never trained over from step 0"
    )
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints")
    checkpoint_every_s: float | None = Field(
        None,
        gt=0,
        description="also checkpoint once this many seconds passed since the last one (a "
        "trainer on a live, open-ended stream: fanout produce --follow)",
    )
    keep_checkpoints: int = Field(
        2,
        ge=2,
        description="committed checkpoints kept in --save-path (older steps pruned; the one "
        "just written always stays)",
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="keep an exponential moving average of the weights (e.g. 0.999) and "
        "save it as the checkpoint's served weights (model.safetensors); training resumes "
        "from the raw weights (fanout.train.ema)",
    )
    resume: bool = Field(
        False,
        description="continue from the newest checkpoint in --save-path (none yet: start "
        "fresh), refused if a flag differs that changes what the next step computes (its "
        "training_config.json). Without it, a --save-path that holds checkpoints is refused",
    )
    log_every: int = Field(1, ge=1, description="steps between log records")
    max_nonfinite_steps: int = Field(
        10,
        ge=1,
        description="stop (NonFiniteLoss) after this many steps in a row whose loss is not "
        "finite; each is skipped (no update) and counted",
    )
    logger: Literal["jsonl", "tensorboard", "wandb"] = Field(
        "jsonl",
        description="metrics sink beside the JSONL log: tensorboard (<save-path>/tb) or "
        "wandb (rank 0; --wandb-project, --wandb-group; fanout.tracking)",
    )
    device: str = Field(
        "cpu",
        description="training device: cpu | cuda | cuda:N (under torchrun, cuda = LOCAL_RANK)",
    )
    dp_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="under torchrun, how long a rank waits in one collective for the other "
        "ranks (the process group's timeout): a rank silent that long (its host cut off or "
        "frozen) is taken as lost and the others stop in one line (RankLost), saving a "
        "checkpoint. Keep it above the longest one rank works while the others wait "
        "(rank 0 saving a checkpoint or running --eval-every)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype (bf16 autocast on CUDA)"
    )
    seed: int = Field(0, description="seeds init, anchors and row order within windows")
    progress: bool | None = Field(
        None,
        description="per-step progress bar on stderr (step, loss, EAL, rows/s, time waiting "
        "for windows, window, cursor); default: when stderr is a terminal",
    )

    def recorded(self) -> dict[str, Any]:
        """This config as a checkpoint records it (training_config.json, JSON values; a
        PostgreSQL --db-path without its password): what a resume is checked against."""
        out = self.model_dump(mode="json")
        if self.db_path is not None:
            out["db_path"] = redact(self.db_path)
        return out

    def draft_recipe(self) -> dict[str, Any]:
        """This config's draft fields: the DraftRecipe fields (the family's reference
        values where not given) and the family's own options — what the trainer passes
        on to the family's config (with the run's layers and the verifier's shapes)."""
        return self.family_recipe({k: getattr(self, k) for k in DraftRecipe.model_fields})

    def consumer_config(
        self, *, dp_rank: int, dp_world_size: int, max_windows: int | None
    ) -> ConsumerConfig:
        """The ConsumerStream's config: this config's ConsumerOptions, the rank and world
        size the trainer runs with, `seed` as the row seed, and the windows to read."""
        options = {k: getattr(self, k) for k in ConsumerOptions.model_fields}
        return ConsumerConfig(
            **(options | {"dp_rank": dp_rank}),
            dp_world_size=dp_world_size,
            row_shuffle_seed=self.seed,
            max_windows=max_windows,
        )
