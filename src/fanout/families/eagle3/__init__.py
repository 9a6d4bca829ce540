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

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from fanout.errors import ConfigError
from fanout.families.base import Family
from fanout.families.eagle3.config import Eagle3Config, Eagle3Recipe, shared_field_problem
from fanout.model.draft_config import DFlashConfig, DraftRecipe
from fanout.rows import TARGET_IDS

if TYPE_CHECKING:
    from fanout.model.dflash import DFlashDraft
    from fanout.model.draft_cache import DraftContext

# speculators' and vLLM's default draft vocabulary
DRAFT_VOCAB_SIZE = 32000


def vllm_default_layers(num_verifier_layers: int) -> list[int]:
    """vLLM's (and speculators') default EAGLE-3 auxiliary layers, (2, n//2, n-3) in HF
    `hidden_states` numbering, as fanout decoder-layer ids (HF - 1), distinct and
    ascending (a verifier of fewer than 8 layers repeats some).

    >>> vllm_default_layers(36)
    [1, 17, 32]
    """
    from fanout.families.numbering import from_serving_layer_ids

    n = num_verifier_layers
    hf = sorted({2, n // 2, n - 3} & set(range(1, n + 1)))
    if not hf:
        raise ConfigError(f"a {n}-layer verifier has none of EAGLE-3's default layers")
    return from_serving_layer_ids(hf)


class Eagle3(Family):
    name: ClassVar[str] = "eagle3"
    model_ref: ClassVar[str] = "fanout.families.eagle3.model:Eagle3Draft"
    config_class: ClassVar[type[DFlashConfig]] = Eagle3Config
    recipe: ClassVar[type[BaseModel]] = Eagle3Recipe
    # speculators' eagle3 trainer: one layer, kl_div
    recipe_defaults: ClassVar[dict[str, Any]] = {"num_layers": 1, "loss_type": "kl"}
    speculators_model_type: ClassVar[str] = "eagle3"
    # what speculators' save_pretrained of an Eagle3DraftModel writes
    architectures: ClassVar[tuple[str, ...]] = ("Eagle3DraftModel",)
    serving_method: ClassVar[str] = "eagle3"
    captures_last_hidden_states: ClassVar[bool] = True  # its targets
    layer_ids_field: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"
    # speculators' EAGLE-3 checkpoint carries the verifier's embedding too (frozen)
    frozen_tensors: ClassVar[frozenset[str]] = Family.frozen_tensors | {"embed_tokens.weight"}

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        return vllm_default_layers(num_verifier_layers)

    def draft_layers(self, captured: list[int], verifier_dir: Path) -> list[int]:
        """Its own three layers (not every captured one): what serving feeds it."""
        from fanout.model.verifier_dir import read_verifier_config

        return self.default_layers(read_verifier_config(verifier_dir)["_num_hidden_layers"])

    def default_draft_vocab_size(self, vocab_size: int) -> int | None:
        return DRAFT_VOCAB_SIZE if vocab_size > DRAFT_VOCAB_SIZE else None

    def block_size_for(self, width: int) -> int:
        return self.verify_width({})  # its reference chain: --ttt-steps 3 + the anchor

    def verify_width(self, recipe: dict[str, Any]) -> int:
        return int(recipe.get("ttt_steps", Eagle3Recipe().ttt_steps)) + 1

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        need = self.verify_width(recipe) + 1  # step ttt_steps-1 of row 0 predicts token ttt+1
        if seq_len >= need:
            return None
        return (
            f"--ttt-steps {need - 2} does not fit {where}'s rows of T = {seq_len} tokens: "
            f"its last step predicts token ttt_steps + 1, so T must be >= {need}"
        )

    def build(self, verifier_dir: Any, **fields: Any) -> DFlashDraft:
        """A fresh draft; `block_size` is mapped to `ttt_steps + 1` (EAGLE-3 has no block;
        a value other than that or DraftRecipe's default is refused)."""
        ttt = int(fields.get("ttt_steps", Eagle3Recipe().ttt_steps))
        bs = fields.get("block_size")
        given = None if bs == DraftRecipe().block_size else bs  # the shared default: unset
        if problem := shared_field_problem(ttt, given, None, "exp", TARGET_IDS):
            raise ConfigError(problem)
        if fields.get("target_layer_ids") is None:
            from fanout.model.verifier_dir import read_verifier_config

            n = read_verifier_config(Path(verifier_dir))["_num_hidden_layers"]
            fields["target_layer_ids"] = self.default_layers(n)
        return super().build(verifier_dir, **(fields | {"block_size": ttt + 1}))

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        """The shared recipe flags that mean nothing to a chain draft (one rule:
        `shared_field_problem`), refused when `fanout train` parses its flags."""
        bs = values["block_size"] if "block_size" in given else None
        if bs == DraftRecipe().block_size:
            bs = None  # a whole config written back carries the shared default
        return shared_field_problem(
            int(values.get("ttt_steps", Eagle3Recipe().ttt_steps)), bs, values.get("gamma"),
            values.get("loss_weighting", "exp"), values.get("label_source", TARGET_IDS),
        )  # fmt: skip

    def speculative_tokens(self, cfg: DFlashConfig) -> int:
        """speculators writes its TTT steps as the greedy proposal's tokens."""
        assert isinstance(cfg, Eagle3Config)
        return cfg.ttt_steps

    def serving_fields(self) -> list[str]:
        return ["norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"]

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        return True  # the targets are the verifier's distribution

    def speculators_fields(self, cfg: DFlashConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """speculators 0.9.0's `Eagle3SpeculatorConfig` layout: a Llama layer config, the
        aux layers under `eagle_aux_hidden_state_layer_ids`, the norm flags."""
        from fanout.families.numbering import SPECULATORS_VERSION, to_serving_layer_ids

        assert isinstance(cfg, Eagle3Config)
        c = cfg
        layer_cfg = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            # full attention: speculators' trainer defaults to a 2048-token sliding window
            "layer_types": ["full_attention"] * c.num_layers,
            "tie_word_embeddings": c.tie_word_embeddings,
        }
        return {
            "speculators_model_type": self.speculators_model_type,
            "architectures": list(self.architectures),
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "target_hidden_size": c.hidden_size,
            self.layer_ids_field: to_serving_layer_ids(c.target_layer_ids),
            "embed_requires_grad": c.embed_requires_grad,
            **self.config_fields(c),
            "speculators_config": self.proposal_config(c, verifier),
            "dtype": "bfloat16",
            "tie_word_embeddings": False,
        }

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Its config has no block or mask token: the verify width follows ttt_steps, the
        (unused) mask id is fanout's record."""
        ttt = int(saved.get("ttt_steps", Eagle3Recipe().ttt_steps))
        return {"block_size": ttt + 1, "mask_token_id": saved["mask_token_id"]}

    def context(self, draft: DFlashDraft, *, cached: bool = True) -> DraftContext:
        return self.drafting_context(draft, cached=cached)

    def drafting_context(
        self, draft: DFlashDraft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """Chain drafting of `num_speculative_tokens` (default: the draft's ttt_steps)."""
        from fanout.families.eagle3.model import Eagle3Draft
        from fanout.families.eagle3.propose import Eagle3Context

        if not isinstance(draft, Eagle3Draft):
            raise ConfigError(
                f"the eagle3 family drafts with an Eagle3Draft, got {type(draft).__name__}"
            )
        return Eagle3Context(draft, num_speculative_tokens=num_speculative_tokens, cached=cached)


FAMILY = Eagle3()

__all__ = [
    "DRAFT_VOCAB_SIZE",
    "FAMILY",
    "Eagle3",
    "Eagle3Config",
    "vllm_default_layers",
]
