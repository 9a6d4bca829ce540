"""The chain drafters' family parts (EAGLE-3, P-EAGLE, MTP): what a family that drafts
a chain, not a block, provides beyond `fanout.families.base.Family`.

    class MyChain(ChainFamily):          # families/<name>/__init__.py
        config_class = MyChainConfig     # its `shared_rule` (fanout.model.draft_config.
                                         # SharedRule): its steps flag, the shared flags
                                         # it refuses
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from fanout.errors import ConfigError
from fanout.families.base import Family, drafts_with, imported
from fanout.families.speculators_config import eagle_layout
from fanout.model.draft_config import DraftConfig, DraftRecipe, SharedRule

if TYPE_CHECKING:
    from fanout.model.draft import Draft
    from fanout.model.draft_cache import DraftContext

# speculators' and vLLM's default draft vocabulary of an EAGLE draft
EAGLE_DRAFT_VOCAB_SIZE = 32000


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


class ChainFamily(Family):
    """A family that drafts a chain, not a block (EAGLE-3, P-EAGLE, MTP): its verify
    width is its steps + 1 (`steps_field`, its own flag), written as the draft's
    `block_size` by `chain_fields`; the shared flags that mean nothing to it are refused
    by its one rule, its config's `shared_rule` (`field_problem`); it reads its own
    layers, not every captured one; `fanout eval --num-speculative-tokens` sets the
    chain's length."""

    # its drafting step, "module:Class": a DraftContext taking (draft, k, *, cached)
    # (fanout.model.chain_cache), imported with torch on first use
    context_ref: ClassVar[str]

    @property
    def rule(self) -> SharedRule:
        """Its config's rule for the shared recipe fields (`DraftConfig.shared_rule`)."""
        rule = self.config_class.shared_rule
        if rule is None or rule.steps_field is None:
            raise TypeError(f"{self.config_class.__name__}'s shared_rule names no steps_field")
        return rule

    @property
    def steps_field(self) -> str:
        """Its own flag: the tokens one drafting step proposes (ttt_steps, ...)."""
        steps = self.rule.steps_field
        assert steps is not None  # `rule` checked it
        return steps

    def steps(self, recipe: Mapping[str, Any]) -> int:
        """`steps_field` of `recipe` (field -> value), its flag's default where absent."""
        default = self.recipe.model_fields[self.steps_field].default
        return int(recipe.get(self.steps_field, default))

    def field_problem(self, values: Mapping[str, Any], block_size: int | None) -> str | None:
        """Why the shared recipe values `values` do not apply to this family (None: they
        do): its config's rule, the steps its flag's default where not given;
        `block_size` None: not given (it follows the steps)."""
        return self.rule.problem({**values, self.steps_field: self.steps(values)}, block_size)

    def chain_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`build`'s `fields` with `block_size` mapped to the verify width; a value other
        than that or DraftRecipe's default is refused (ConfigError)."""
        steps = self.steps(fields)
        bs = fields.get("block_size")
        given = None if bs == DraftRecipe().block_size else bs  # the shared default: unset
        if problem := self.field_problem({self.steps_field: steps}, given):
            raise ConfigError(problem)
        return fields | {"block_size": steps + 1}

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        """The shared recipe flags that mean nothing to a chain draft (`field_problem`),
        refused when `fanout train` parses its flags."""
        bs = values["block_size"] if "block_size" in given else None
        if bs == DraftRecipe().block_size:
            bs = None  # a whole config written back carries the shared default
        return self.field_problem(values, bs)

    def draft_layers(self, captured: list[int], verifier_dir: Path) -> list[int]:
        """Its own layers (not every captured one): what serving feeds it."""
        from fanout.model.verifier_dir import read_verifier_config

        return self.default_layers(read_verifier_config(verifier_dir)["_num_hidden_layers"])

    def block_size_for(self, width: int) -> int:
        return self.verify_width({})  # its reference chain: its steps + the anchor

    def verify_width(self, recipe: dict[str, Any]) -> int:
        return self.steps(recipe) + 1

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        """Rows must hold the chain's last target: step K-1 of row 0 predicts token K+1."""
        need = self.verify_width(recipe) + 1
        if seq_len >= need:
            return None
        flag = "--" + self.steps_field.replace("_", "-")
        return (
            f"{flag} {need - 2} does not fit {where}'s rows of T = {seq_len} tokens: "
            f"its last step predicts token {self.steps_field} + 1, so T must be >= {need}"
        )

    def speculative_tokens(self, cfg: DraftConfig) -> int:
        """speculators writes its steps as the greedy proposal's tokens."""
        return int(getattr(cfg, self.steps_field))

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Its config has no block or mask token: the verify width follows its steps, the
        (unused) mask id is fanout's record."""
        return {"block_size": self.steps(saved) + 1, "mask_token_id": saved["mask_token_id"]}

    def context(self, draft: Draft, *, cached: bool = True) -> DraftContext:
        return self.drafting_context(draft, cached=cached)

    def drafting_context(
        self, draft: Draft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """Chain drafting of `num_speculative_tokens` (default: the draft's steps, what
        its checkpoint's proposal says)."""
        own = drafts_with(draft, self.draft_class, self.name)
        k = num_speculative_tokens or self.speculative_tokens(own.cfg)
        context: DraftContext = imported(self.context_ref)(own, k, cached=cached)
        return context


class EagleFamily(ChainFamily):
    """The EAGLE layout (EAGLE-3's; P-EAGLE's too, which vLLM serves under method
    `eagle3`): one layer over `[embedding ; fc(aux states)]` (speculators' recipe: KL
    against the verifier's distribution, so the capture holds its last hidden states),
    vLLM's default auxiliary layers, a 32,000-token draft vocabulary, the norm flags,
    speculators' `Eagle3SpeculatorConfig` layout (a Llama layer config)."""

    recipe_defaults: ClassVar[dict[str, Any]] = {"num_layers": 1, "loss_type": "kl"}
    serving_method = "eagle3"
    layer_ids_field = "eagle_aux_hidden_state_layer_ids"

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        return vllm_default_layers(num_verifier_layers)

    def default_draft_vocab_size(self, vocab_size: int) -> int | None:
        return EAGLE_DRAFT_VOCAB_SIZE if vocab_size > EAGLE_DRAFT_VOCAB_SIZE else None

    def build(self, verifier_dir: Any, **fields: Any) -> Draft:
        """A fresh draft; `block_size` is mapped to its verify width (`chain_fields`),
        the layers vLLM's default where not given."""
        fields = self.chain_fields(fields)
        if fields.get("target_layer_ids") is None:
            from fanout.model.verifier_dir import read_verifier_config

            n = read_verifier_config(Path(verifier_dir))["_num_hidden_layers"]
            fields["target_layer_ids"] = self.default_layers(n)
        return super().build(verifier_dir, **fields)

    def serving_fields(self) -> list[str]:
        return ["norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"]

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        return True  # the targets are the verifier's distribution

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        return eagle_layout(self, cfg, verifier)


__all__ = ["EAGLE_DRAFT_VOCAB_SIZE", "ChainFamily", "EagleFamily", "vllm_default_layers"]
