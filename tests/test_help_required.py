"""--help says a flag is required only where it is (#52: `produce --follow` and
`promote --run-dir` need no --data, but --help said "(required)").

    .venv/bin/pytest tests/test_help_required.py -q
"""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel

from fanout.decode.config import PromoteConfig
from fanout.flags import add_model_flags
from fanout.produce.config import ProducerConfig


def _help_of(model: type[BaseModel], flag: str) -> str:
    p = argparse.ArgumentParser()
    add_model_flags(p, model)
    (action,) = [a for a in p._actions if flag in a.option_strings]
    return str(action.help)


@pytest.mark.parametrize(
    ("model", "unless"), [(ProducerConfig, "--follow"), (PromoteConfig, "--run-dir")]
)
def test_data_is_required_unless_the_flag_that_fills_it(
    model: type[BaseModel], unless: str
) -> None:
    text = _help_of(model, "--data")
    assert text.endswith(f"(required unless {unless})"), text
    # and the flag really fills it: the config validates without --data
    assert unless.lstrip("-").replace("-", "_") in model.model_fields


def test_a_field_nothing_fills_stays_plainly_required() -> None:
    assert _help_of(ProducerConfig, "--run-dir").endswith("(required)")
