"""`fanout eval`'s speculative decoder with the zoo's verifiers whose layer types are
not all ruled (tests/verifier_zoo.py UNRULED): lossless at T = 0, rejected draft tokens
undone in every state — the same test as tests/test_eval_zoo.py.

.venv/bin/python -m pytest tests/test_eval_unruled.py -x -q

Expected failures are named: they fail before decoding, where a draft is built for the
verifier (fanout.model.verifier_dir finds no embedding / final norm under the names
these checkpoints use, or a config without `num_hidden_layers`); strict, so a fix
shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import test_eval_zoo
from fanout.errors import ConfigError
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import UNRULED, ZOO

_DRAFT_NOT_BUILT = {
    "nemotron_h": "its config.json has no num_hidden_layers (layers_block_type gives them)",
    "falcon_h1": "its final norm is model.final_layernorm",
    "lfm2": "its final norm is model.embedding_norm",
}


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(
            a,
            marks=pytest.mark.xfail(strict=True, raises=ConfigError, reason=_DRAFT_NOT_BUILT[a]),
        )
        if a in _DRAFT_NOT_BUILT
        else a
        for a in UNRULED
    ],
)
def test_unruled_speculative_decoding_is_lossless(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ZOO, arch, UNRULED[arch])  # test_eval_zoo builds through ZOO's names
    test_eval_zoo.test_zoo_speculative_decoding_is_lossless(arch, tmp_path)
