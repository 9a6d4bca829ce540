"""P-EAGLE: EAGLE-3's draft drafting all its depths in parallel, in one forward
(fanout.families.peagle.model: the model, COD sampling and loss; .propose: the drafting
step; .config: its flags).

    fanout produce --capture-for peagle ...                  # 3 aux layers + last states
    fanout train --draft-family peagle --num-depths 8 ...    # reference recipe by default
    fanout eval --draft out/peagle/checkpoint-... --num-speculative-tokens 8

Reference recipe (speculators 0.9.0's trainer for `--speculator-type peagle`): 1 layer
(Qwen3: `--draft-arch qwen3`), KL against the verifier's distribution, 8 depths, COD
ratio 0.7 with floor 0.2 over at most 512 seed positions a row, `norm_before_residual`
on, `norm_before_fc`/`norm_output`/`fc_norm` off, the embedding trained, a 32,000-token
draft vocabulary (or the verifier's whole one when smaller; EAGLE-3's), auxiliary
layers vLLM's default (2, n//2, n-3) in HF numbering. Its checkpoint is speculators'
`peagle` (`PEagleDraftModel`, with `mask_hidden` and `mask_token_id`); vLLM serves it
under method `eagle3` with parallel drafting (all depths in one forward), which is
how `fanout eval` decodes it.
"""

from __future__ import annotations

from typing import Any

from fanout.families.chain import EagleFamily
from fanout.families.peagle.config import PEagleConfig, PEagleRecipe
from fanout.families.speculators_config import transformer_layer_config
from fanout.model.draft_config import DraftConfig


class PEagle(EagleFamily):
    """The EAGLE layout (fanout.families.chain.EagleFamily: layers, capture, vocabulary,
    config layout) with P-EAGLE's depths as its chain, its embedding trained."""

    name = "peagle"
    model_ref = "fanout.families.peagle.model:PEagleDraft"
    context_ref = "fanout.families.peagle.propose:PEagleContext"
    config_class = PEagleConfig
    recipe = PEagleRecipe
    speculators_model_type = "peagle"
    architectures = ("PEagleDraftModel",)
    serving_method = "eagle3"  # with parallel drafting

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        if seq_len >= 3:  # row 0 predicts token 2; deeper positions are sampled where they fit
            return None
        return f"P-EAGLE needs rows of at least 3 tokens; {where}'s are T = {seq_len}"

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """speculators 0.9.0's `PEagleSpeculatorConfig`: the EAGLE layout, the layer a
        Qwen3 one with `--draft-arch qwen3`, and `mask_token_id`."""
        assert isinstance(cfg, PEagleConfig)
        out = super().speculators_fields(cfg, verifier)
        if cfg.draft_arch == "qwen3":
            out["transformer_layer_config"] = transformer_layer_config(cfg)
        return out | {"mask_token_id": cfg.mask_token_id}

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Its config has its mask token (speculators' `PEagleSpeculatorConfig`)."""
        return {"block_size": self.steps(saved) + 1, "mask_token_id": cfg["mask_token_id"]}


FAMILY = PEagle()

__all__ = ["FAMILY", "PEagle", "PEagleConfig"]
