"""EAGLE-3: one decoder layer over the verifier's fused auxiliary states, trained with
training-time test (fanout.families.eagle3.model), drafting a chain of k tokens
(.propose), its flags in .config.

    fanout produce --capture-for eagle3 ...                 # 3 aux layers + last states
    fanout train --draft-family eagle3 --ttt-steps 3 ...    # reference recipe by default
    fanout eval --draft out/eagle3/checkpoint-... --num-speculative-tokens 3

Reference recipe (speculators 0.9.0's trainer for `--speculator-type eagle3`): 1 layer
(Llama), KL against the verifier's distribution, 3 TTT steps with decay 1.0,
`norm_before_fc`, `norm_output` and `norm_before_residual` on, the embedding frozen, a
32,000-token draft vocabulary (or the verifier's whole one when smaller), auxiliary
layers vLLM's default (2, n//2, n-3) in HF numbering. Its checkpoint is speculators'
`eagle3` (`Eagle3DraftModel`); vLLM serves it under method `eagle3`.
"""

from __future__ import annotations

from fanout.families.base import Family
from fanout.families.chain import EagleFamily, vllm_default_layers
from fanout.families.eagle3.config import Eagle3Config, Eagle3Recipe


class Eagle3(EagleFamily):
    """The EAGLE layout (fanout.families.chain.EagleFamily) with training-time test: its
    chain is `--ttt-steps` long, its embedding the verifier's, frozen."""

    name = "eagle3"
    model_ref = "fanout.families.eagle3.model:Eagle3Draft"
    context_ref = "fanout.families.eagle3.propose:Eagle3Context"
    config_class = Eagle3Config
    recipe = Eagle3Recipe
    speculators_model_type = "eagle3"
    # what speculators' save_pretrained of an Eagle3DraftModel writes
    architectures = ("Eagle3DraftModel",)
    # speculators' EAGLE-3 checkpoint carries the verifier's embedding too (frozen)
    frozen_tensors = Family.frozen_tensors | {"embed_tokens.weight"}


FAMILY = Eagle3()

__all__ = [
    "FAMILY",
    "Eagle3",
    "Eagle3Config",
    "vllm_default_layers",
]
