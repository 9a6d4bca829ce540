"""One rule per family for the shared recipe flags it refuses (`DraftConfig.shared_rule`,
fanout.model.draft_config.SharedRule): a draft's config and `fanout train`'s flag check
(`Family.shared_conflict`) refuse the same values with the same line.

.venv/bin/pytest tests/test_shared_rule.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fanout.families.base import Family
from fanout.families.registry import FAMILIES

# a value each shared field a family may refuse takes where it is refused
REFUSED = {
    "gamma": 4.0,
    "loss_weighting": "dpace",
    "label_source": "input_ids",
    "loss_type": "kl",
    "draft_vocab_size": 100,
}
SHAPES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 256,
    "mask_token_id": 255,
    "target_layer_ids": [1],
}


def _recipe(fam: Family, **change: Any) -> dict[str, Any]:
    """The family's reference recipe with `change`, its block its verify width."""
    recipe = fam.reference_recipe() | change
    if change.get("loss_weighting") == "dpace":
        recipe["loss_type"] = "ce"  # D-PACE needs CE (DraftRecipe's own check)
    return recipe | {"block_size": fam.verify_width(recipe)}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_config_and_the_flag_check_refuse_the_same_shared_values(name: str) -> None:
    fam = FAMILIES[name]
    rule = fam.config_class.shared_rule
    fam.config_class(**SHAPES, **_recipe(fam))  # the reference recipe is a valid config
    if rule is None:  # a block family reads every shared field
        for field, value in REFUSED.items():
            assert fam.shared_conflict(_recipe(fam, **{field: value}), {field}) is None
        return
    assert rule.accepts and set(rule.accepts) <= set(REFUSED)
    for field in rule.accepts:
        values = _recipe(fam, **{field: REFUSED[field]})
        line = fam.shared_conflict(values, {field})
        assert line is not None and "\n" not in line and rule.name in line, (field, line)
        with pytest.raises(ValidationError) as e:
            fam.config_class(**SHAPES, **values)
        assert line in str(e.value), (field, line, str(e.value))


@pytest.mark.parametrize(
    "name", sorted(n for n, f in FAMILIES.items() if hasattr(f, "steps_field"))
)
def test_a_chain_block_size_other_than_its_verify_width_is_refused_by_both(name: str) -> None:
    fam = FAMILIES[name]
    recipe = _recipe(fam)
    wrong = recipe["block_size"] + 1
    line = fam.shared_conflict(recipe | {"block_size": wrong}, {"block_size"})
    assert line is not None and line.startswith(f"--block-size {wrong}: "), line
    with pytest.raises(ValidationError) as e:
        fam.config_class(**SHAPES, **(recipe | {"block_size": wrong}))
    assert line in str(e.value)
