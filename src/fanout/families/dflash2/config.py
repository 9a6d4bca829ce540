"""DFlash2's own flags and its validated draft config.

    from fanout.families.dflash2.config import DFlash2Config, DFlash2Recipe
    DFlash2Recipe().selector_top_k            # 16: the reference recipe's defaults
    cfg = DFlash2Config(**dflash_fields, conv_group_size=16)  # ValueError when they disagree

`DFlash2Recipe` holds what a user chooses beyond the shared DraftRecipe (mixed into
`fanout train`'s flags); `DFlash2Config` is a whole DFlash2 draft: DraftConfig plus
those fields, checked against each other. Field names, defaults and bounds are
speculators 0.9.0's (`DFlash2SpeculatorConfig`, and its trainer's `DFlash2Args` for
`selector_loss_alpha`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from fanout.model.draft_config import DraftConfig, between


class DFlash2Recipe(BaseModel):
    """DFlash2's flags: the two block-local convolutions in every layer and the
    candidate selector that reranks the unary top-k given the previous token."""

    conv_kernel_size: int = Field(
        2, ge=1, description="DFlash2: causal taps of each in-block dynamic convolution"
    )
    conv_group_size: int = Field(
        16, ge=1, description="DFlash2: hidden channels sharing one dynamic kernel"
    )
    selector_rank: int = Field(256, ge=1, description="DFlash2: rank of the candidate selector")
    selector_top_k: int = Field(
        16, ge=1, description="DFlash2: unary candidates the selector reranks per slot"
    )
    selector_loss_alpha: float = Field(
        1.0, ge=0.0, description="DFlash2: weight of the selector's K-way CE beside the unary loss"
    )


class DFlash2Config(DFlash2Recipe, DraftConfig):
    """A DFlash2 draft's shape and training semantics. Validated at construction: the
    group size divides the hidden size, the kernel fits in a block, the selector's k fits
    in the vocabulary, and the vocabulary is the verifier's own (speculators' DFlash2 and
    vLLM's selector index their codebooks and top-k by verifier token id)."""

    @model_validator(mode="after")
    def _check_dflash2(self) -> DFlash2Config:
        if self.hidden_size % self.conv_group_size:
            raise ValueError(between(self, "conv_group_size", "must divide", "hidden_size"))
        if self.conv_kernel_size > self.block_size:
            raise ValueError(between(self, "conv_kernel_size", "cannot exceed", "block_size"))
        if self.selector_top_k > self.vocab_size:
            raise ValueError(between(self, "selector_top_k", "cannot exceed", "vocab_size"))
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size}: DFlash2 needs the verifier's full "
                f"vocabulary ({self.vocab_size} tokens; speculators and vLLM index the "
                "selector by verifier token id); drop --draft-vocab-size"
            )
        return self


__all__ = ["DFlash2Config", "DFlash2Recipe"]
