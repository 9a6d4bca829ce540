"""Every family's checkpoint against speculators 0.9.0, one test each, parametrised over
the registered families (skipped without speculators): each family's test module
declares its case (`PARITY`: tests/speculators_parity.py) with the assertions only it
makes; its loss parity against speculators stays in that module.

- speculators' `from_pretrained` loads fanout's checkpoint with no missing, unexpected or
  mismatched key and no warning from any channel, every tensor equal to the file and to
  the draft's own weights, every trainable parameter from the file;
- the config fields speculators' config class declares beyond its base (or whose
  default it changes) are written with fanout's value;
- speculators re-saves the loaded draft to the same config and tensors.

    pytest tests/test_speculators_parity.py -q
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fanout.families.registry import FAMILY_FOLDERS, family
from speculators_parity import Drafts, Parity, case_of, load, module_of
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # import-time deprecations of torch.compile & co.
    pytest.importorskip("speculators")
    import test_speculators as h  # its _notes, _flat and _WRITER_ONLY


@dataclass
class Built:
    """A family's case, its verifier, its saved drafts and speculators' loads of them."""

    case: Parity
    vdir: Path
    drafts: Drafts
    loaded: dict[str, tuple[Any, dict[str, Any], list[str]]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """family -> its Built, each made once in this module."""
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            case = case_of(name)
            if case is None:  # a family added without its tests against speculators
                pytest.fail(
                    f"{name}: tests/{module_of(name)}.py declares no PARITY case: add the "
                    "module with its Parity (tests/speculators_parity.py), as every family's"
                )
            vdir = case.verifier(tmp_path_factory.mktemp(f"parity-{name}"))
            drafts = case.drafts(vdir, tmp_path_factory)
            loaded = {k: load(case, path) for k, (_, path) in drafts.items()}
            cache[name] = Built(case, vdir, drafts, loaded)
        return cache[name]

    return get


def _cases(what: str) -> list[tuple[str, str]]:
    """(family, saved draft) pairs a test runs on: every registered family's `what`
    drafts (a family without a case: one pair, which fails naming what to add)."""
    cases = {f: case_of(f) for f in FAMILY_FOLDERS}
    return [(f, d) for f, c in cases.items() for d in (getattr(c, what) if c else ("<no case>",))]


@pytest.mark.parametrize(("name", "saved"), _cases("loads"))
def test_checkpoint_loads_in_speculators(
    name: str, saved: str, built: Callable[[str], Built]
) -> None:
    b = built(name)
    draft, path = b.drafts[saved]
    model, info, notes = b.loaded[saved]
    assert type(model).__name__ == b.case.model_class
    assert notes == []
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    file = load_file(str(path / "model.safetensors"))
    sd = model.state_dict()
    for k, v in file.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    mine = draft.trainable_state()
    for k, v in mine.items():  # and they are the draft's own weights
        assert torch.equal(sd[k], v), k
    if b.case.reloads_verifier:
        # every trainable parameter of speculators' model comes from the file (none left
        # at its init): the verifier-owned ones are the frozen ones it reloads itself
        model.load_verifier_weights()
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        frozen = family(name).frozen_tensors
        assert trainable == set(mine) - frozen == set(file) - frozen
    if b.case.check_loaded is not None:
        b.case.check_loaded(saved, draft, model, path, b.vdir)


@pytest.mark.parametrize(("name", "saved"), _cases("resaves"))
def test_config_matches_what_speculators_writes(
    name: str, saved: str, built: Callable[[str], Built], tmp_path: Path
) -> None:
    """speculators re-saves the loaded draft; both config.json files, read back through
    speculators' config class (so fields fanout leaves to their defaults compare as the
    defaults), must agree except for `_WRITER_ONLY`, and the re-saved weights must be
    fanout's file."""
    b = built(name)
    _, path = b.drafts[saved]
    model, _, _ = b.loaded[saved]
    resaved = tmp_path / "resaved"
    model.save_pretrained(resaved)
    read = getattr(b.case.speculators(), b.case.config_class).from_pretrained
    ours, theirs = h._flat(read(str(path)).to_dict()), h._flat(read(str(resaved)).to_dict())
    ignored = {k for k in ours.keys() | theirs.keys() if k.split(".")[0] in h._WRITER_ONLY}
    ignored |= {k for k in ours.keys() | theirs.keys() if k.endswith(".transformers_version")}
    diff = {
        k: (ours.get(k, "<absent>"), theirs.get(k, "<absent>"))
        for k in sorted((ours.keys() | theirs.keys()) - ignored)
        if ours.get(k, "<absent>") != theirs.get(k, "<absent>")
    }
    assert diff == {}, f"fanout vs speculators-written config.json (ours, theirs): {diff}"
    # the top-level fields a non-speculators reader (vLLM) sees without defaults
    raw_ours = json.loads((path / "config.json").read_text())
    raw_theirs = json.loads((resaved / "config.json").read_text())
    missing = sorted(set(raw_theirs) - set(raw_ours) - h._WRITER_ONLY)
    assert missing == [], f"speculators writes top-level {missing}, fanout does not"
    assert raw_theirs["architectures"] == raw_ours["architectures"]
    mine = load_file(str(path / "model.safetensors"))
    re = load_file(str(resaved / "model.safetensors"))
    assert set(mine) == set(re)
    for k in mine:
        assert torch.equal(mine[k].to(re[k].dtype), re[k]), k


def _default(cls: Any, k: str) -> Any:
    f = cls.model_fields[k]
    return f.default_factory() if f.default_factory is not None else f.default


@pytest.mark.parametrize(
    "name", [f for f in FAMILY_FOLDERS if getattr(case_of(f), "meant", None) is not None]
)
def test_config_fields_as_fanout_means_them(name: str, built: Callable[[str], Built]) -> None:
    """Every field speculators' config for the family declares beyond its base, or whose
    default it changes, is written top-level with fanout's value (a new one fails here)."""
    b = built(name)
    case, fam = b.case, family(name)
    assert case.meant is not None and case.config_base is not None
    draft, path = b.drafts[case.config_draft]
    model, _, _ = b.loaded[case.config_draft]
    cls = getattr(case.speculators(), case.config_class)
    base_module, base_name = case.config_base.split(":")
    base = getattr(pytest.importorskip(base_module), base_name)
    own = set(cls.model_fields) - set(base.model_fields)
    changed = {
        k
        for k in base.model_fields
        if k in cls.model_fields and _default(cls, k) != _default(base, k)
    }
    meant = case.meant(draft)
    assert own | changed == set(meant)
    if case.own_are_serving_fields:  # what its Family writes and reads back
        assert set(fam.serving_fields()) == own
    raw = json.loads((path / "config.json").read_text())
    for k, v in meant.items():
        if v is None:  # the family's own check below
            continue
        assert raw[k] == v, k
        if k != "architectures":  # save_pretrained writes the model class
            assert getattr(model.config, k) == v, k
    assert raw["fanout"]["family"] == name
    proposal = model.config.speculators_config.proposal_methods[0]
    assert proposal.speculative_tokens == fam.speculative_tokens(draft.cfg)
    assert model.config.speculators_config.algorithm == fam.speculators_model_type
    if case.check_config is not None:
        case.check_config(draft, model, raw, b.vdir)
