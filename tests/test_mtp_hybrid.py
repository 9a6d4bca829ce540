"""The MTP family on hybrid verifiers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against
speculators 0.9.0, whose MTP layer for them is the verifier architecture's own
full-attention decoder layer (fanout.families.mtp.layers).

.venv/bin/python -m pytest tests/test_mtp_hybrid.py -x -q

Verifiers: tests/verifier_zoo.py's tiny qwen3_next (MoE MTP layer) and qwen3_5_text
(dense), and a tiny Qwen3.5-MoE text model built here from the zoo's sizes; each also
with its own `mtp.*` tensors written as the real checkpoints name them
(`verifier_zoo.add_mtp`: per-expert tensors, zero-centred norms). speculators'
`MTPDraftModel` is the oracle (those tests skip without it):

(a) started from the verifier's `mtp.*` weights, the draft's tensors equal those of
    speculators' own `MTPDraftModel.from_training_args` (its MTPConverter: renames,
    fused experts) on the same verifier, and the start line says so; without them,
    speculators' initialisation (the same keys and shapes as `MTPDraftModel(config)`);
(b) a fanout checkpoint loads in `MTPDraftModel.from_pretrained` with no missing /
    unexpected keys, every tensor in place, and the same layer config (the verifier's
    text config) and top-level fields as speculators' own config for that verifier;
(c) with the same weights and rows, every step's logits and the loss equal
    speculators' `forward` in fp32 (eager attention), loss mask with holes;
(d) a draft trained a few steps decodes as `fanout eval` does (a chain, vLLM's `mtp`)
    losslessly at T = 0 against greedy decoding, cached equal to uncached, and after a
    checkpoint round trip;
(e) DeepSeek-V3 style MTP weights are refused in one line (speculators 0.9.0 has no MTP
    layer for them); a gap in the per-expert tensors too.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.checkpoints.load import load_draft
from fanout.checkpoints.save import save_checkpoint
from fanout.decode.spec_decode import Decoder, first_mismatch
from fanout.errors import ConfigError
from fanout.families.mtp.layers import HybridMTPLayer
from fanout.families.mtp.model import MTPDraft
from fanout.families.registry import family
from fanout.model.verifier import load_verifier
from test_family_mtp import assert_matches_speculators, fit
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import _COMMON, _LINEAR, _MOE, VOCAB, add_mtp, build

ARCHS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
STEPS = 3
T = 20
LOG = "fanout.families.mtp"


def _build(arch: str, path: Path) -> Path:
    if arch != "qwen3_5_moe_text":
        return build(arch, path)
    import transformers  # not in the zoo: the zoo's sizes, Qwen3.5-MoE's text model

    kw = {"num_hidden_layers": 4, "shared_expert_intermediate_size": 16, **_LINEAR, **_MOE}
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5MoeTextConfig(**(_COMMON | kw))
    transformers.Qwen3_5MoeForCausalLM(cfg).save_pretrained(path)
    return path


_DIRS: dict[tuple[str, bool], Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mtp-hybrid")


def _vdir(root: Path, arch: str, own: bool) -> Path:
    """The arch's tiny verifier (built once), with its own `mtp.*` tensors if `own`."""
    if (arch, own) not in _DIRS:
        plain = _DIRS.get((arch, False)) or _build(arch, root / arch)
        _DIRS[(arch, False)] = plain
        if own:
            dst = root / f"{arch}-mtp"
            shutil.copytree(plain, dst)
            add_mtp(dst)
            _DIRS[(arch, True)] = dst
    return _DIRS[(arch, own)]


@pytest.fixture(scope="module")
def spec() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("speculators.models.mtp")


def _text_config(vdir: Path) -> Any:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(vdir)
    return getattr(cfg, "text_config", None) or cfg


def _speculators_start(spec: Any, vdir: Path) -> Any:
    """speculators' own MTP draft for the verifier (`from_training_args`: its config,
    its MTPConverter's weights), fp32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spec.MTPDraftModel.from_training_args(
            _text_config(vdir), num_speculative_steps=STEPS, verifier_name_or_path=str(vdir)
        )
    return model.float()


def _bf16(d: MTPDraft) -> MTPDraft:
    """Every weight rounded to bf16 (what the checkpoint holds)."""
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    return d


# ---- (a) the start ------------------------------------------------------------------


def _started(
    root: Path, arch: str, own: bool, caplog: pytest.LogCaptureFixture
) -> tuple[Path, MTPDraft]:
    """`arch`'s verifier (with its own MTP weights or without) and the MTP draft built
    on it, what the build logged in `caplog`."""
    vdir = _vdir(root, arch, own=own)
    with caplog.at_level(logging.INFO, logger=LOG):
        d = family("mtp").build(vdir, mtp_steps=STEPS)
    assert isinstance(d, MTPDraft)
    return vdir, d


@pytest.mark.parametrize("arch", ARCHS)
def test_starts_from_the_verifiers_mtp_weights_as_speculators(
    arch: str, root: Path, spec: Any, caplog: pytest.LogCaptureFixture
) -> None:
    vdir, d = _started(root, arch, True, caplog)
    assert f"a {arch} MTP layer, starting from" in caplog.text and "own MTP weights" in caplog.text
    assert isinstance(d.mtp_layers[0], HybridMTPLayer)
    theirs = {
        k: v for k, v in _speculators_start(spec, vdir).state_dict().items() if "mtp_layers" in k
    }
    mine = d.trainable_state()
    assert set(mine) == set(theirs)
    for k, v in mine.items():
        assert torch.equal(v, theirs[k]), k  # renamed, experts fused, norms as stored
    # the checkpoint's own norm (zero-centred) and fc, as shipped
    own = load_file(str(sorted(vdir.glob("*.safetensors"))[0]))
    assert torch.equal(mine["mtp_layers.0.final_layernorm.weight"], own["mtp.norm.weight"].float())
    assert torch.equal(mine["mtp_layers.0.input_proj.weight"], own["mtp.fc.weight"].float())


@pytest.mark.parametrize("arch", ARCHS)
def test_speculators_initialisation_without_mtp_weights(
    arch: str, root: Path, spec: Any, caplog: pytest.LogCaptureFixture
) -> None:
    vdir, d = _started(root, arch, False, caplog)
    assert f"a {arch} MTP layer; {vdir} ships no mtp.* weights" in caplog.text
    theirs = spec.MTPDraftModel(_load_config(spec, _saved(d, vdir, root / f"{arch}-init")))
    want = {k: v for k, v in theirs.state_dict().items() if k.startswith("mtp_layers.")}
    mine = d.trainable_state()
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in want.items()}
    for k, v in mine.items():
        if k.endswith("norm.weight"):  # speculators' init: ones (gain 2 in a (1 + w) norm)
            assert torch.equal(v, torch.ones_like(v)) and torch.equal(want[k], v), k
        elif k.endswith("mlp.gate.weight"):  # the router: zeros, as speculators keeps it
            assert torch.equal(v, torch.zeros_like(v)) and torch.equal(want[k], v), k
        else:  # normal(0, 0.02) (speculators' experts are torch.empty: fanout draws these)
            assert 0.012 < float(v.std()) < 0.028 and abs(float(v.mean())) < 0.01, k


# ---- (b) the checkpoint ---------------------------------------------------------------


def _saved(d: MTPDraft, vdir: Path, where: Path) -> Path:
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    return save_checkpoint(where, d, opt, {"step": 0}, verifier_name_or_path=str(vdir))


def _load_config(spec: Any, path: Path) -> Any:
    cfg = spec.MTPSpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"
    return cfg


def _load(spec: Any, path: Path) -> tuple[Any, dict[str, Any]]:
    """speculators' model from a fanout checkpoint (eager, fp32) and its loading report."""
    cls = spec.MTPDraftModel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls.from_pretrained(str(path), config=_load_config(spec, path), dtype=torch.float32)
        _, info = super(cls.__mro__[1], cls).from_pretrained(  # past both overrides
            str(path), config=_load_config(spec, path), dtype=torch.float32,
            output_loading_info=True,
        )  # fmt: skip
    return model, info


@pytest.fixture(scope="module")
def saved(root: Path) -> dict[str, tuple[MTPDraft, Path, Path]]:
    """Per arch: a draft started from the verifier's MTP weights (bf16-rounded), its
    checkpoint and the verifier."""
    out = {}
    for arch in ARCHS:
        vdir = _vdir(root, arch, own=True)
        torch.manual_seed(0)
        d = family("mtp").build(vdir, mtp_steps=STEPS)
        assert isinstance(d, MTPDraft)
        out[arch] = (_bf16(d), _saved(d, vdir, root / f"{arch}-ckpt"), vdir)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_in_speculators(
    arch: str, saved: dict[str, tuple[MTPDraft, Path, Path]], spec: Any
) -> None:
    d, path, vdir = saved[arch]
    model, info = _load(spec, path)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert type(model.mtp_layers[0]).__name__ == {
        "qwen3_next": "Qwen3NextMTPLayer", "qwen3_5_text": "Qwen35MTPLayer",
        "qwen3_5_moe_text": "Qwen35MoeMTPLayer",
    }[arch]  # fmt: skip
    file = load_file(str(path / "model.safetensors"))
    assert set(file) == set(d.trainable_state())
    sd = model.state_dict()
    for k, v in d.trainable_state().items():
        assert torch.equal(sd[k], v) and torch.equal(file[k].float(), v), k
    assert torch.equal(sd["embed_tokens.weight"], d.embed_weight)
    assert torch.equal(sd["lm_head.weight"], d.lm_head_weight)
    # the config speculators would write for this verifier (from_training_args)
    c, ref = model.config, _speculators_start(spec, vdir).config
    for k in ("speculators_model_type", "architectures", "num_nextn_predict_layers"):
        assert getattr(c, k) == getattr(ref, k), k
    assert c.num_speculative_steps == ref.num_speculative_steps == STEPS
    assert model.target_layer_ids == [4]  # speculators' numbering: the last layer
    # the layer config: the same object once loaded (the in-memory one of speculators'
    # knows the directory it came from, which neither file holds)
    mine, want = c.transformer_layer_config.to_dict(), ref.transformer_layer_config.to_dict()
    for k in ("_attn_implementation_internal", "_attn_implementation", "_name_or_path"):
        mine.pop(k, None), want.pop(k, None)
    assert mine == want
    # in the file: every field speculators writes (its to_diff_dict), plus the shapes
    # fanout reads back where they equal the class defaults
    raw = json.loads((path / "config.json").read_text())["transformer_layer_config"]
    written = ref.model_dump(mode="json")["transformer_layer_config"]
    assert {k: raw.get(k) for k in written} == written and raw["model_type"] == arch
    full = ref.transformer_layer_config.to_dict()
    assert {k: full.get(k) for k in raw} == raw
    v, rv = c.speculators_config.verifier, ref.speculators_config.verifier
    assert v.name_or_path == str(vdir) and v.architectures == rv.architectures


# ---- (c) logits and loss ----------------------------------------------------------------


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    lm = torch.ones(1, T, dtype=torch.uint8)
    lm[0, :4] = 0
    lm[0, 11] = 0
    return {
        "hidden_states": 2.0 * torch.randn(1, T, 32, generator=g), "input_ids": ids,
        "target_ids": ids, "loss_mask": lm, "document_ids": torch.zeros(1, T, dtype=torch.long),
        "position_ids": torch.arange(T)[None],
    }  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_and_loss_match_speculators(
    arch: str, seed: int, saved: dict[str, tuple[MTPDraft, Path, Path]], spec: Any
) -> None:
    d, path, _ = saved[arch]
    model, _ = _load(spec, path)
    assert_matches_speculators(model, d, _batch(seed))


# ---- (d) decoding ------------------------------------------------------------------------


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_draft_decodes_losslessly(arch: str, root: Path, tmp_path: Path) -> None:
    vdir = _vdir(root, arch, own=True)
    torch.manual_seed(0)
    draft = family("mtp").build(vdir)
    assert isinstance(draft, MTPDraft)
    last = draft.cfg.target_layer_ids
    v = load_verifier(vdir, device="cpu", capture_layer_ids=last, num_draft_layers=None)
    dec = Decoder(v, set())
    rows = [p + dec.greedy(p, 36).tokens for p in (_prompt(6, 100 + s) for s in range(6))]
    ids = torch.tensor(rows)  # [6, 42]
    b, t = ids.shape
    pos, doc = torch.arange(t).expand(b, t), torch.zeros(b, t, dtype=torch.long)
    cap = v.capture(ids, pos, doc)
    batch = {
        "hidden_states": cap.layers[0].float(), "input_ids": ids,
        "target_ids": cap.target_ids.long(), "loss_mask": torch.ones(b, t, dtype=torch.uint8),
        "document_ids": doc, "position_ids": pos,
    }  # fmt: skip
    fit(draft, batch, steps=30)
    fam = family("mtp")
    taus = []
    for n, seed in ((6, 100), (3, 0), (11, 1)):
        prompt = _prompt(n, seed)
        g = dec.greedy(prompt, 20)
        s = dec.speculative(prompt, draft, 20, context=fam.drafting_context(draft, cached=True))
        u = dec.speculative(prompt, draft, 20, context=fam.drafting_context(draft, cached=False))
        assert first_mismatch(g.tokens, s.tokens) is None, (arch, n, g.tokens, s.tokens)
        assert s.tokens == u.tokens and s.accepted == u.accepted
        taus.append(s.acceptance_length)
    assert taus[0] > 1.2, taus  # a prompt it trained on: its drafts are accepted
    path = _saved(draft, vdir, tmp_path)
    back = load_draft(path, vdir)
    assert isinstance(back, MTPDraft) and back.cfg == draft.cfg
    prompt = _prompt(6, 100)
    assert dec.speculative(prompt, back, 16).tokens == dec.greedy(prompt, 16).tokens


# ---- (e) refused --------------------------------------------------------------------------


def _add(vdir: Path, tensors: dict[str, torch.Tensor]) -> None:
    first = sorted(vdir.glob("*.safetensors"))[0]
    save_file({**load_file(str(first)), **tensors}, str(first), metadata={"format": "pt"})


def test_deepseek_v3_mtp_layer_refused(root: Path) -> None:
    vdir = build("deepseek_v3", root / "deepseek_v3")
    fam = family("mtp")
    assert isinstance(fam.build(vdir), MTPDraft)  # no MTP weights: a dense MTP layer
    mtp = root / "deepseek_v3-mtp"
    shutil.copytree(vdir, mtp)
    _add(mtp, {"model.layers.3.eh_proj.weight": torch.zeros(32, 64)})  # DeepSeek's names
    with pytest.raises(ConfigError) as e:
        fam.build(mtp)
    msg = str(e.value)
    assert "\n" not in msg and "--draft-family mtp" in msg and "deepseek_v3" in msg
    assert "speculators 0.9.0 has no MTP layer for it" in msg


def test_expert_gap_and_wrong_shape_refused(root: Path, tmp_path: Path) -> None:
    src = _vdir(root, "qwen3_next", own=True)
    fam = family("mtp")
    gap = tmp_path / "gap"
    shutil.copytree(src, gap)
    first = sorted(gap.glob("*.safetensors"))[0]
    t = load_file(str(first))
    del t["mtp.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(t, str(first), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"miss 2\.up_proj") as e:
        fam.build(gap)
    assert "\n" not in str(e.value)
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    _add(wrong, {"mtp.layers.0.self_attn.q_proj.weight": torch.zeros(33, 32)})
    with pytest.raises(ConfigError, match=r"mtp\.layers\.0\.self_attn\.q_proj\.weight is") as e:
        fam.build(wrong)
    assert "\n" not in str(e.value)
