"""What every draft model is, whatever its family: a validated config, the verifier's
frozen embedding / head / final norm (the verifier-head wrapper, with the draft
vocabulary's maps), construction from a local verifier directory, and one `loss` call.

    from fanout.families.registry import family
    draft = family("dspark").build("models/qwen3-8b", num_layers=1)  # a Draft subclass
    out = draft.loss(batch, torch.Generator().manual_seed(0))        # LossOutput
    out.loss.backward(); print(out.per_slot_acc, out.eal)

A family's model subclasses `Draft` (directly, or through a shared backbone:
fanout.model.block_draft for block drafters, fanout.model.chain_draft for chain
drafters) and builds its own modules in `__init__`; the trainer, checkpoint and decoding
code see only this class. Frozen buffers (not in `state_dict`): `embed_weight` [V, H],
`lm_head_weight` [V or draft V, H], `verifier_norm_weight` [H], and for a draft
vocabulary `d2t` / `t2d` / `t2d_index` (speculators' maps: draft id d -> verifier id
d + d2t[d]; t2d marks kept verifier ids). `teacher_softcap`: the verifier's logit soft
cap (Gemma-2's `final_logit_softcapping`; None: none), read with those tensors, that
every family's KL teacher is capped by (fanout.ops.linear_kl.teacher_logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from pydantic import ValidationError
from torch import nn

from fanout.errors import ConfigError
from fanout.model.draft_config import DraftConfig, DraftRecipe, default_target_layer_ids
from fanout.model.verifier_dir import read_text_tensors, read_verifier_config, text_tensors
from fanout.rows import HIDDEN_STATES, INPUT_IDS, LAST_HIDDEN_STATES, PACKED_ROW


@dataclass
class LossOutput:
    """What one `Draft.loss` call returns (tensors detached except `loss`)."""

    loss: torch.Tensor  # [] differentiable
    per_slot_acc: torch.Tensor  # [drafted slots] accuracy per slot / step (0 where no labels)
    per_slot_count: torch.Tensor  # [drafted slots] supervised slots per position
    eal: torch.Tensor  # [] expected acceptance length under greedy verification
    n_tokens: int  # supervised slots in the loss
    n_blocks: int  # blocks / chains drawn
    # a family's own metrics beside these (e.g. DFlash2's selector loss), logged as given
    extra: dict[str, float] = field(default_factory=dict)


class Draft(nn.Module):
    """A draft of any family (module docstring). Subclasses set `config_class`, build
    their modules after `super().__init__` and call `reset_parameters`, and define
    `loss`."""

    # the config a family's draft is built from (its family names its own)
    config_class: ClassVar[type[DraftConfig]] = DraftConfig
    # the first drafted slot of a verified block: 1 (slot 0 is the verifier's bonus
    # token); a family that drafts from the anchor too (DSpark) sets 0
    first_drafted_slot: ClassVar[int] = 1
    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    verifier_norm_weight: torch.Tensor
    t2d_index: torch.Tensor
    teacher_softcap: float | None = None  # set from the verifier (`with_verifier_tensors`)

    def __init__(
        self,
        cfg: DraftConfig,
        embed_weight: torch.Tensor,  # [V, H]
        lm_head_weight: torch.Tensor,  # [V, H]
        verifier_norm_weight: torch.Tensor,  # [H]
        draft_vocab_ids: torch.Tensor | None = None,  # [draft V] sorted verifier ids
    ) -> None:
        # every family's draft takes its own config (the one check each family's class shares)
        if not isinstance(cfg, want := type(self).config_class):
            name = want.__name__  # "an" before a letter read with a vowel sound (an MTP...)
            a = "an" if name[0] in "AEFHILMNORSX" else "a"
            raise ConfigError(f"{type(self).__name__} needs {a} {name}, got {type(cfg).__name__}")
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        if embed_weight.shape != (cfg.vocab_size, h) or lm_head_weight.shape != (cfg.vocab_size, h):
            raise ConfigError(
                f"verifier embed/lm_head shapes {tuple(embed_weight.shape)} / "
                f"{tuple(lm_head_weight.shape)} do not match vocab_size x hidden_size "
                f"({cfg.vocab_size}, {h})"
            )
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer(
            "verifier_norm_weight", verifier_norm_weight.detach(), persistent=False
        )
        head = lm_head_weight.detach()
        self.d2t: torch.Tensor | None
        self.t2d: torch.Tensor | None
        self.register_buffer("d2t", None, persistent=False)
        self.register_buffer("t2d", None, persistent=False)
        if cfg.draft_vocab_size is not None:
            if draft_vocab_ids is None or draft_vocab_ids.numel() != cfg.draft_vocab_size:
                raise ConfigError(
                    f"draft_vocab_size={cfg.draft_vocab_size} needs draft_vocab_ids with that "
                    "many verifier token ids (e.g. the most frequent tokens of the data)"
                )
            ids = draft_vocab_ids.long().sort().values
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            self.register_buffer("d2t", ids - torch.arange(ids.numel()), persistent=False)
            self.register_buffer("t2d", t2d, persistent=False)
            t2d_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
            t2d_index[ids] = torch.arange(ids.numel())
            self.register_buffer("t2d_index", t2d_index, persistent=False)
            head = head[ids]
        self.register_buffer("lm_head_weight", head, persistent=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: normal(0, std) linears, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """The family's training loss and metrics on a window batch (`batch`: rows as a
        window holds them, `[B, T, ..]`); `generator` draws what the family samples."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss")

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Weights under speculators' key names (what model.safetensors holds)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rope.")}

    # ---- construction from a local verifier directory -------------------------------

    @classmethod
    def from_verifier(
        cls,
        verifier_dir: str | Path,
        *,
        draft_vocab_ids: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ) -> Self:
        """Build a draft from a local HF verifier: shapes from its `config.json`, and only
        `embed_tokens`, `lm_head` (or the tied embedding) and the final norm read from its
        safetensors (`safe_open`, one tensor at a time). `overrides` are config fields
        (e.g. `num_layers`, `block_size`, `target_layer_ids`, `mask_token_id`)."""
        vdir = Path(verifier_dir)
        vcfg = read_verifier_config(vdir)
        fields = {**vcfg, **overrides}
        if fields.get("target_layer_ids") is None:  # the DFlash rule, as the producer's
            n_draft = fields.get("num_layers", DraftRecipe.model_fields["num_layers"].default)
            fields["target_layer_ids"] = default_target_layer_ids(
                vcfg["_num_hidden_layers"], n_draft
            )
        fields.setdefault("mask_token_id", vcfg["vocab_size"] - 1)
        fields.pop("_num_hidden_layers")
        try:
            cfg = cls.config_class(**fields)
        except ValidationError as e:  # one line: each field and why
            why = "; ".join(
                f"{'.'.join(map(str, err['loc'])) + ': ' if err['loc'] else ''}"
                f"{err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            where = vdir / "config.json"
            raise ConfigError(f"{cls.config_class.__name__} from {where} + overrides: {why}") from e
        return cls.with_verifier_tensors(cfg, vdir, draft_vocab_ids, dtype, device=device)

    @classmethod
    def with_verifier_tensors(
        cls,
        cfg: DraftConfig,
        verifier_dir: str | Path,
        draft_vocab_ids: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        device: str | torch.device = "cpu",
    ) -> Self:
        """A draft of shape `cfg` (freshly initialised weights, drawn on the CPU) with the
        verifier's frozen embedding, `lm_head` (or the tied embedding) and final norm (its
        gain: Gemma-style 1 + w), read by the names the checkpoint gives its text model
        (fanout.model.verifier_dir.text_tensors: a multimodal one's too), on `device` in
        `dtype`. The verifier's tensors move to `device` as stored (bf16 for
        most) and are cast there: half the copy, and a GPU casts in milliseconds what takes
        the CPU seconds (two 151,936 x 4,096 matrices for Qwen3-8B)."""
        names = text_tensors(Path(verifier_dir))  # the text model's
        embed, head, norm = read_text_tensors(Path(verifier_dir), names)
        embed = embed.to(device).to(dtype)
        head = embed if head is None else head.to(device).to(dtype)  # None: tied
        draft = cls(cfg, embed, head, norm.to(device).to(dtype), draft_vocab_ids)
        draft.teacher_softcap = names.logit_softcap
        return draft.to(dtype=dtype).to(device=device)

    @torch.no_grad()
    def load_verifier_tensors(self, verifier_dir: str | Path) -> None:
        """Replace the frozen embedding, `lm_head` (its draft-vocabulary rows) and final
        norm, in place, by those of `verifier_dir`: another version of the same verifier
        (a trainer following `produce --follow-verifier`'s versions). ConfigError when a
        shape differs (not a version of this verifier)."""
        names = text_tensors(Path(verifier_dir))  # the text model's
        embed, head, norm = read_text_tensors(Path(verifier_dir), names)
        head = embed if head is None else head  # None: tied
        if self.d2t is not None:  # the draft vocabulary's rows, as built
            head = head[self.d2t.cpu() + torch.arange(self.d2t.numel())]
        for name, new in (("embed_weight", embed), ("lm_head_weight", head),
                          ("verifier_norm_weight", norm)):  # fmt: skip
            mine = getattr(self, name)
            if tuple(new.shape) != tuple(mine.shape):
                raise ConfigError(
                    f"{verifier_dir}: {name} is {tuple(new.shape)}, the draft's "
                    f"{tuple(mine.shape)}: not a version of the verifier it was built from"
                )
            mine.copy_(new.to(mine.device))  # cast on the device, as built
        self.teacher_softcap = names.logit_softcap


def check_batch(
    batch: dict[str, torch.Tensor],
    width: int,
    *,
    kl: bool = False,
    family: str = "draft",
    capture_for: str = "the family",
) -> None:
    """ConfigError unless `batch` holds a window's rows with hidden states `[B, T, width]`
    (and `last_hidden_states` when `kl`: the loss reads the verifier's distribution; the
    refusal names `--capture-for capture_for`). Every draft's one batch check."""
    for k in (HIDDEN_STATES, *PACKED_ROW):
        if k not in batch:
            raise ConfigError(f"{family} batch is missing {k!r} (has {sorted(batch)})")
    if kl and LAST_HIDDEN_STATES not in batch:
        raise ConfigError(
            f"{family}'s loss reads the verifier's distribution: the batch needs "
            "last_hidden_states (capture the run with --store-last-hidden-states, or "
            f"--capture-for {capture_for})"
        )
    b, t = batch[INPUT_IDS].shape
    if batch[HIDDEN_STATES].shape != (b, t, width):
        raise ConfigError(
            f"hidden_states {tuple(batch[HIDDEN_STATES].shape)} != [B, T, n·H] = "
            f"{(b, t, width)}: target_layer_ids/hidden_size disagree with the capture"
        )


def count_parameters(model: nn.Module) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["Draft", "LossOutput", "check_batch", "count_parameters"]
