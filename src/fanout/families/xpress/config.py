"""XPress's own flags and its validated config.

    from fanout.families.xpress.config import XPressConfig, XPressRecipe
    XPressRecipe(xpress_rank=128)                      # the family's flags (fanout train)
    cfg = XPressConfig(**dflash_fields, xpress_rank=128)  # a draft's full config

`XPressRecipe` holds the fields speculators 0.9.0's XPress declares beyond DFlash
(`xpress_rank`, `xpress_mlp_ratio`, `num_jacobi_passes`: written top-level into
`config.json`, `XPressSpeculatorConfig`) and its trainer's loss knobs (training only,
`speculators/train/config/schema.py` `XPressArgs`: `consistency_weight`,
`consistency_passes`, `base_anchor_weight`, `base_anchor_full_weight`), with
speculators' defaults, plus the weights of its compound loss (speculators'
`--loss-fn '{"ce": 0.1, "tv": 0.9}'`, XPress's default). speculators' `ce_from_data` is
the shared `--label-source input_ids`. `XPressConfig` is `DraftConfig` plus those, frozen
and validated at construction.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from fanout.model.draft_config import DraftConfig, SharedRule


def _option(default: Any, what: str, **bounds: Any) -> Any:
    """A field of XPress's own: its flag's help says whose it is ("XPress: ...")."""
    return Field(default, description=f"XPress: {what}", **bounds)


def _weight(default: float, term: str) -> Any:
    """The field of one term's weight in XPress's loss: >= 0 (0: the term is off)."""
    return _option(default, f"weight of {term}", ge=0)


class XPressRecipe(BaseModel):
    """XPress's own options (speculators' XPress defaults: rank 256, MLP ratio 2, 6
    Jacobi passes, CE 0.1 + TV 0.9, 3 consistency rounds at weight 0.3, the base anchor
    at 0.6 with the decay)."""

    xpress_rank: int = _option(256, "low-rank width r of the causal refiner head", ge=1)
    xpress_mlp_ratio: int = _option(2, "refiner SwiGLU MLP width = rank x this ratio", ge=1)
    num_jacobi_passes: int = _option(
        6,
        "parallel refine passes K when drafting (fanout eval; stored in config.json, unused "
        "in training); 0: the backbone's own argmax",
        ge=0,
    )
    xpress_ce_weight: float = _weight(
        0.1, 'the CE term of each loss term (speculators\' --loss-fn {"ce": w, ...})'
    )
    xpress_tv_weight: float = _weight(
        0.9,
        "the total-variation term 1 - sum min(q, p) against the verifier's distribution "
        "(needs --store-last-hidden-states)",
    )
    consistency_weight: float = _weight(0.3, "the free-running Jacobi rounds' mean loss (0: off)")
    consistency_passes: int = _option(
        3,
        "free-running rounds in training, each fed the previous one's argmax (stop-grad "
        "between rounds)",
        ge=0,
    )
    base_anchor_weight: float = _weight(
        0.6, "the loss on the backbone's own logits (the Jacobi seed)"
    )
    base_anchor_full_weight: bool = _option(
        False, "the base-anchor term without the slot decay (every slot weight 1)"
    )

    @model_validator(mode="after")
    def _check_xpress(self) -> XPressRecipe:
        if self.xpress_ce_weight == 0 and self.xpress_tv_weight == 0:
            raise ValueError("xpress_ce_weight and xpress_tv_weight are both 0: no loss to train")
        return self


class XPressConfig(XPressRecipe, DraftConfig):
    """One XPress draft: the DFlash backbone's shape and recipe plus the refiner."""

    shared_rule: ClassVar[SharedRule] = SharedRule(
        "XPress",
        accepts={"loss_type": "ce", "loss_weighting": "exp"},
        why="XPress's loss is its own CE + TV compound (--xpress-ce-weight, "
        "--xpress-tv-weight) and XPress weighs slots with the exp decay (speculators "
        "refuses D-PACE with its CE + TV loss)",
    )


__all__ = ["XPressConfig", "XPressRecipe"]
