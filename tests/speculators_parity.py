"""The per-family checks against speculators 0.9.0, written once: each family's test
module declares its `Parity` case (speculators' classes for it, its verifier, its saved
drafts and the assertions only it makes) and tests/test_speculators_parity.py runs the
shared tests over every case; the family modules load their drafts with `load` too
and import their `drafts`, `spec` and `loaded` fixtures from here.

    pytest tests/test_speculators_parity.py -q       # skipped without speculators
"""

from __future__ import annotations

import copy
import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.checkpoints.save import save_checkpoint

# A family's saved drafts: name -> (draft, checkpoint dir).
Drafts = dict[str, tuple[Any, Path]]


@dataclass(frozen=True)
class Parity:
    """One family's case of the shared speculators tests."""

    family: str
    module: str  # speculators' module of the family ("speculators.models.dspark")
    config_class: str  # its config class there ("DSparkSpeculatorConfig")
    model_class: str  # its model class there ("DSparkDraftModel")
    verifier: Callable[[Path], Path]  # builds the family's tiny verifier under a folder
    drafts: Callable[[Path, pytest.TempPathFactory], Drafts]  # (verifier dir, tmp) -> saved
    loads: tuple[str, ...]  # the saved drafts speculators must load (the loading test)
    # speculators' `from_pretrained` overrides that return the model alone, to step past
    # for the loading report (0: the first returns it)
    info_past: int = 0
    # after loading: what the family's model needs before it is compared (None: nothing)
    after_load: Callable[[Any], None] | None = None
    # the loading test reloads the verifier-owned tensors (load_verifier_weights)
    reloads_verifier: bool = True
    # the family's own assertions on a loaded draft: (name, draft, model, checkpoint
    # dir, verifier dir)
    check_loaded: Callable[[str, Any, Any, Path, Path], None] | None = None
    # the saved drafts speculators re-saves to the same config.json and tensors
    resaves: tuple[str, ...] = ()
    # the config fields test: the speculators config class its own fields are counted
    # against ("module:Class"), the draft it reads, and the fields as fanout means them
    # (field -> value; None: the family's `check_config` checks that one)
    config_base: str | None = None
    config_draft: str = "full"
    meant: Callable[[Any], dict[str, Any]] | None = None
    # its own fields are its Family's `serving_fields` (a block family's: all it adds)
    own_are_serving_fields: bool = False
    # the family's own config assertions: (draft, model, raw config.json, verifier dir)
    check_config: Callable[[Any, Any, dict[str, Any], Path], None] | None = None

    def speculators(self) -> Any:
        """speculators' module of the family (skips the test without speculators)."""
        return pytest.importorskip(self.module)


# name -> (speculators' model of a saved draft, its loading report, what was said loading it)
Loaded = dict[str, tuple[Any, dict[str, Any], list[str]]]


def speculators_modules(**modules: str) -> SimpleNamespace:
    """speculators' modules by the names given (`dspark="speculators.models.dspark"`),
    with test_speculators' helpers as `h`; the test is skipped without speculators."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations of torch.compile & co.
        found = {k: pytest.importorskip(m) for k, m in modules.items()}
        import test_speculators as helpers  # needs speculators and loguru itself
    return SimpleNamespace(**found, h=helpers)


# ---- the fixtures a family's test module imports (`from speculators_parity import
# drafts, loaded, spec`): they read its `PARITY` case and its `SPECULATORS`, the
# speculators modules its tests use by name; `drafts` needs its `verifier_dir` fixture.


@pytest.fixture(scope="module")
def drafts(
    verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Drafts:
    """The module's family's saved drafts (`PARITY.drafts`): name -> (draft, checkpoint)."""
    case: Parity = request.module.PARITY
    return case.drafts(verifier_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def spec(request: pytest.FixtureRequest) -> SimpleNamespace:
    """The speculators modules the module's `SPECULATORS` names, with test_speculators'
    helpers as `h` (`speculators_modules`: the test is skipped without speculators)."""
    return speculators_modules(**request.module.SPECULATORS)


@pytest.fixture(scope="module")
def loaded(spec: SimpleNamespace, drafts: Drafts, request: pytest.FixtureRequest) -> Loaded:
    """speculators' model of every saved draft, as `load_all` loads it."""
    return load_all(request.module.PARITY, drafts)


def load_all(case: Parity, drafts: Drafts) -> Loaded:
    """`load` of every saved draft of `drafts`."""
    return {name: load(case, path) for name, (_, path) in drafts.items()}


def load(case: Parity, path: Path) -> tuple[Any, dict[str, Any], list[str]]:
    """speculators' model of `case` from fanout's checkpoint at `path` (eager attention,
    fp32), its loading report and every warning said while loading."""
    import test_speculators as h  # needs speculators and loguru itself

    mod = case.speculators()
    cfg_cls, cls = getattr(mod, case.config_class), getattr(mod, case.model_class)

    def config() -> Any:
        cfg = cfg_cls.from_pretrained(str(path))
        cfg.transformer_layer_config._attn_implementation = "eager"  # CPU, no compiled mask
        return cfg

    kw: dict[str, Any] = {"config": config(), "dtype": torch.float32}
    with h._notes() as notes:
        if case.info_past == 0:
            model, info = cls.from_pretrained(str(path), output_loading_info=True, **kw)
        else:
            model = cls.from_pretrained(str(path), **kw)
    if case.info_past:  # past the overrides that return the model alone
        past: Any = super(cls.__mro__[case.info_past - 1], cls)
        _, info = past.from_pretrained(
            str(path), config=config(), dtype=torch.float32, output_loading_info=True
        )
    if case.after_load is not None:
        case.after_load(model)
    return model, info, notes


def save_drafts(
    build: Callable[[Path, torch.Tensor | None], Any],
    vdir: Path,
    tmp: pytest.TempPathFactory,
    prefix: str,
    vocab: int = 256,
) -> Drafts:
    """'full' and 'reduced' (200 of `vocab` tokens) drafts of `build`, each saved with
    save_checkpoint."""
    g = torch.Generator().manual_seed(5)
    reduced_ids = torch.randperm(vocab, generator=g)[:200].sort().values
    out: Drafts = {}
    for name, ids in (("full", None), ("reduced", reduced_ids)):
        out[name] = save_draft(build(vdir, ids), vdir, tmp.mktemp(f"{prefix}-{name}"))
    return out


def saved_and_loaded(case: Parity, draft: Any, vdir: Path, root: Path) -> tuple[Path, Any]:
    """`draft` saved with save_checkpoint (step 60) under `root`, and speculators' model
    of it, loaded with no missing or unexpected key and nothing said: (checkpoint, model)."""
    opt = torch.optim.SGD(draft.parameters(), lr=0.1)
    path = save_checkpoint(root, draft, opt, {"step": 60}, verifier_name_or_path=str(vdir))
    model, info, notes = load(case, path)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and notes == []
    return path, model


def save_draft(draft: Any, vdir: Path, root: Path) -> tuple[Any, Path]:
    """(draft, its checkpoint under `root`), saved with save_checkpoint at step 0."""
    opt = torch.optim.SGD(draft.parameters(), lr=0.1)
    return draft, save_checkpoint(root, draft, opt, {"step": 0}, verifier_name_or_path=str(vdir))


def perturbed(
    draft: Any, scale: float | Callable[[str], float], *, norm: Callable[[str], bool] = lambda n: True,
    skip: frozenset[str] = frozenset(),
) -> Any:  # fmt: skip
    """`draft` with every weight moved off its init (so a swapped or forgotten tensor
    shows), each value rounded to bf16 (exact in the bf16 model.safetensors): a 1-d
    parameter `norm` accepts becomes 1 + 0.3·N(0, 1) (norms away from their 1s), any
    other gets `scale` (or `scale(name)`)·N(0, 1) added; `skip`: left as built. One
    generator seeded 2, one draw a parameter in `named_parameters` order."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name in skip:
                continue
            if p.ndim == 1 and norm(name):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                s = scale(name) if callable(scale) else scale
                p.add_(s * torch.randn(p.shape, generator=g))
            p.copy_(p.bfloat16().float())
    return draft


def with_fields(draft: Any, **update: Any) -> Any:
    """A deep copy of `draft` whose config has the fields `update` (its weights kept)."""
    d = copy.deepcopy(draft)
    d.cfg = draft.cfg.model_copy(update=update)
    return d


def speculators_verifier(
    root: Path, vocab: int = 256, hidden: int = 32, layers: int = 4, theta: float = 1e6,
    eps: float = 1e-5,
) -> Path:  # fmt: skip
    """Tiny Qwen3 under `root` that speculators loads without a warning: a non-unit final
    norm (so a forgotten verifier_norm shows), RoPE theta and RMS eps under
    rope_parameters (not Qwen3Config's defaults: a field it ignored would show),
    bf16-representable weights (the reduced head fanout saves in bf16 is exact), and a
    safetensors index like a real sharded one (speculators' loader warns on single-file
    verifiers, whoever wrote the draft)."""
    vdir = tiny_qwen3_verifier(
        root / "verifier", vocab, hidden_size=hidden, num_layers=layers, head_dim=8,
        intermediate_size=64,
    )  # fmt: skip
    cfg = json.loads((vdir / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    cfg["rms_norm_eps"] = eps
    (vdir / "config.json").write_text(json.dumps(cfg, indent=2))
    t = load_file(str(vdir / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    t["model.norm.weight"] = 1.0 + 0.5 * torch.rand(hidden, generator=g)  # positive, non-unit
    t = {k: v.bfloat16().float() for k, v in t.items()}
    save_file(t, str(vdir / "model.safetensors"), metadata={"format": "pt"})
    size = sum(v.numel() * v.element_size() for v in t.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(t, "model.safetensors")}
    (vdir / "model.safetensors.index.json").write_text(json.dumps(index))
    return vdir


def module_of(family: str) -> str:
    """The test module that holds family `family`'s speculators tests and its case."""
    return "test_speculators" if family == "dflash" else f"test_family_{family}"


def case_of(family: str) -> Parity | None:
    """The `PARITY` case family `family`'s test module declares (None: it has none yet:
    tests/test_speculators_parity.py fails naming what to add)."""
    try:
        module = importlib.import_module(module_of(family))
    except ModuleNotFoundError as e:
        if e.name != module_of(family):
            raise
        return None
    case: Parity | None = getattr(module, "PARITY", None)
    return case


__all__ = [
    "Drafts", "Loaded", "Parity", "case_of", "drafts", "load", "load_all", "loaded", "module_of", "perturbed",
    "save_draft", "save_drafts", "saved_and_loaded", "spec", "speculators_modules", "speculators_verifier",
    "with_fields",
]  # fmt: skip
