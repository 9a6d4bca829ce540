"""What a trainer checks and builds before its first step: the run against its family's
recipe, a resume against the checkpoint's training config, and the draft
(fanout.train.trainer calls all three).

    layers = check_run(cfg, contract, world=1)     # ConfigError naming the producer flag
    ckpt = check_resume(cfg)                       # ConfigError naming the differing flags
    draft = build_draft(cfg, contract, layers, torch.device("cpu"))

`check_run` refuses a run this trainer cannot train on (rows that do not split over the
data-parallel ranks, a capture without what the family needs, rows too short for the
recipe, layers the run did not capture) before anything is built or read; `build_draft`
builds the family's draft from the verifier and the flags, with the run's most used
tokens as its vocabulary under --draft-vocab-size.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fanout.checkpoints.layout import TRAINING_CONFIG, latest_checkpoint, read_training_config
from fanout.checkpoints.resume import check_family
from fanout.contract import CaptureContract, ascending_layer_ids
from fanout.data.draft_vocab import coverage, read_token_counts, select_draft_vocab
from fanout.errors import ConfigError
from fanout.families.registry import FamilyOptions, family
from fanout.flags import field_flag
from fanout.model.draft import Draft
from fanout.model.verifier_dir import read_verifier_config
from fanout.store.rundir import RunDir
from fanout.train.config import RESUME_MAY_CHANGE, TrainConfig
from fanout.train.progress import WaitNotice

log = logging.getLogger("fanout.train.trainer")


def check_run(cfg: TrainConfig, contract: CaptureContract, world: int) -> list[int]:
    """Refuse a run this trainer cannot train on, now rather than after the draft is
    built; return the verifier layers the draft reads (the consumer reads only these)."""
    run_dir = Path(cfg.run_dir)
    if contract.window_rows % world:
        raise ConfigError(
            f"{run_dir}: {contract.window_rows} rows per window do not split over "
            f"{world} data-parallel ranks; use a world size that divides it"
        )
    fam = family(cfg.draft_family)
    # what the capture must hold for this family's recipe: named with the producer
    # flags that capture it, before anything is built or read
    if fam.needs_last_hidden_states(cfg.draft_recipe()) and not contract.store_last_hidden_states:
        who = "--loss-type kl" if cfg.loss_type == "kl" else f"--draft-family {fam.name}"
        # --capture-for captures them only where the family's reference recipe needs them
        fix = "--store-last-hidden-states"
        if fam.needs_last_hidden_states(fam.reference_recipe()):
            fix = f"--capture-for {fam.name} (or {fix})"
        raise ConfigError(
            f"{who} trains on the verifier's final hidden states, but {run_dir} was "
            f"captured without them: produce the run with {fix}"
        )
    # rows too short for the recipe (DFlash families: the block; EAGLE-3: its TTT steps)
    why = fam.row_length_error(cfg.draft_recipe(), contract.seq_len, str(run_dir))
    if why is not None:
        raise ConfigError(why)
    # Any subset of the captured layers (naming the captured ones), in ascending order;
    # by default what the family reads of the capture (every layer; EAGLE-3: its own)
    captured = list(contract.target_layer_ids)
    layers = ascending_layer_ids(
        cfg.draft_layer_ids or fam.draft_layers(captured, Path(cfg.verifier_name_or_path))
    )
    missing = [i for i in layers if i not in captured]
    if missing and not cfg.draft_layer_ids:  # the family's own layers (EAGLE-3's three)
        raise ConfigError(
            f"--draft-family {fam.name} reads verifier layers {layers} (its reference "
            f"recipe), but {run_dir} captured {captured} ({missing} missing): produce the "
            f"run with --capture-for {fam.name}, or choose captured layers with "
            "--draft-layer-ids"
        )
    contract.require({"target_layer_ids": layers}, where=f"consumer {cfg.consumer_id}")
    return layers


def check_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to resume from (--resume: the newest in --save-path; None: start
    fresh), refused now, before anything is built, if this trainer's flags would not
    continue the run it checkpointed: one line naming each differing flag with both
    values. Flags a resume may change (RESUME_MAY_CHANGE: --max-steps, --epochs, where
    things are, ...) are named in a log line; a checkpoint written before checkpoints
    recorded their training config resumes unchecked, with a warning."""
    ckpt = latest_checkpoint(cfg.save_path) if cfg.resume else None
    if ckpt is None:
        return None
    fam = family(cfg.draft_family)
    check_family(ckpt, fam)  # another family's: named as such, not as differing flags
    saved = read_training_config(ckpt)
    if saved is None:
        log.warning(
            "%s records no training config (written before checkpoints did): resuming "
            "without checking --seed, --rows-per-step, --lr and the recipe against it; "
            "keep them as they were",
            ckpt,
        )
        return ckpt
    mine = cfg.recorded()
    # other families' options are not this draft's: only the chosen family's count
    others = set(FamilyOptions.model_fields) - {"draft_family"} - set(fam.options())
    fields = TrainConfig.model_fields
    differ = sorted(k for k in (mine.keys() & saved.keys()) - others if mine[k] != saved[k])
    refused = [k for k in differ if k not in RESUME_MAY_CHANGE]

    def named(keys: list[str]) -> str:
        return ", ".join(
            f"{field_flag(k, fields[k])} {_flag_value(mine[k])} (the checkpoint's: "
            f"{_flag_value(saved[k])})"
            for k in keys
        )

    if refused:
        raise ConfigError(
            f"{ckpt / TRAINING_CONFIG}: --resume with {named(refused)} would not continue "
            "the run this checkpoint is from: resume with the checkpoint's values, or "
            "train from step 0 into another --save-path"
        )
    changed = [k for k in differ if k not in ("resume", "takeover")]
    if changed:
        log.info("%s: resuming %s with %s", cfg.consumer_id, ckpt.name, named(changed))
    return ckpt


def _flag_value(v: Any) -> str:
    """A value as its flag takes it (`none`, `a b` for a list)."""
    if v is None:
        return "none"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def build_draft(
    cfg: TrainConfig, contract: CaptureContract, layers: list[int], device: torch.device
) -> Draft:
    """The draft on `device`: shapes and frozen embedding/head from the verifier,
    the rest from the flags; with --draft-vocab-size, the run's most used tokens."""
    overrides: dict[str, Any] = cfg.draft_recipe() | {"target_layer_ids": layers}
    if cfg.mask_token_id is not None:
        overrides["mask_token_id"] = cfg.mask_token_id
    vocab_ids = None
    fam = family(cfg.draft_family)
    # the family's reference vocabulary where none is given (EAGLE-3: 32,000 tokens)
    n_vocab = cfg.draft_vocab_size or fam.default_draft_vocab_size(
        read_verifier_config(Path(cfg.verifier_name_or_path))["vocab_size"]
    )
    overrides["draft_vocab_size"] = n_vocab
    if n_vocab is not None:
        # the producer writes the counts at its start: say so while they are missing
        waits = WaitNotice(cfg.acquire_timeout_s).start()
        where = RunDir(Path(cfg.run_dir)).token_counts
        waits.begin(lambda: f"the producer's token counts ({where.name} in the run dir)")
        try:
            counts = read_token_counts(where, contract.stream_id, timeout_s=cfg.acquire_timeout_s)
        finally:
            waits.stop()
        vocab_ids = select_draft_vocab(counts, n_vocab)
        log.info(
            "draft vocabulary: %d of %d tokens, covering %.2f%% of the data's loss-masked tokens",
            n_vocab,
            counts.shape[0],
            100 * coverage(counts, vocab_ids),
        )
    draft = fam.build(
        cfg.verifier_name_or_path, device=device, draft_vocab_ids=vocab_ids, **overrides
    )
    # the recipe check_run checked is the one the draft was built from
    assert not fam.needs_last_hidden_states(draft.cfg.model_dump()) or (
        contract.store_last_hidden_states
    )
    return draft
