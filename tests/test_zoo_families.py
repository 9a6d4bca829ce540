"""Every draft family on every verifier of the zoo: a draft built from the verifier,
trained a few steps on hidden states the verifier captured, its checkpoint loaded back
in speculators 0.9.0's own class for the family and by fanout's `load_draft`.

.venv/bin/python -m pytest tests/test_zoo_families.py -x -q -m "not slow"  # default subset
.venv/bin/python -m pytest tests/test_zoo_families.py -x -q               # 20 x 7 matrix

Per (architecture, family) of tests/verifier_zoo.py (ZOO and HYBRID_AND_SPARSE) x
fanout.families.registry:
- the draft's frozen tensors are the verifier's text model's, found by the names the
  checkpoint gives them (`fanout.model.verifier_dir.text_tensors`: multimodal layouts,
  a head tied at the top level only, Mamba-style `backbone.*`, Falcon-H1's and LFM2's
  final norms): embedding and head equal the oracle model's, and the draft's
  final-norm gain and epsilon reproduce the oracle's final norm (Gemma-style `1 + w`);
- one capture of packed rows (3 documents, longer than the sliding window) holds the
  union of every family's reference layers (what `fanout produce --capture-for` takes);
  each family trains `STEPS` steps on its own layers of it (finite loss, weights move);
- the checkpoint (`save_checkpoint`) loads in speculators' class for the family (the
  registry's `architectures`), every saved tensor in place, no trainable parameter
  left out; its config has the text model's hidden size and vocabulary and the
  family's layers + 1 (serving numbering, fanout.families.numbering);
- fanout's `load_draft` reads it back with the verifier: same weights, same head.

The default run takes each family on one sliding-window, one linear-attention, one
multimodal verifier (the last also sliding, with a head tied at the top level only) and
Nemotron-H (Mamba-2, a `backbone.*` checkpoint whose config has no
`num_hidden_layers`); the whole matrix is marked slow. Without speculators the loading
half is skipped.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fanout.checkpoints.load import load_draft
from fanout.checkpoints.save import save_checkpoint
from fanout.families.numbering import to_serving_layer_ids
from fanout.families.registry import FAMILIES
from fanout.model.draft import Draft
from fanout.model.verifier import Verifier, load_verifier, text_model
from fanout.model.verifier_dir import text_tensors
from fanout.ops.adamw import make_optimizer
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import HYBRID_AND_SPARSE, VOCAB, WINDOW, ZOO, build, load_oracle

STEPS = 5
DOCS = (13, 20, 15)  # one packed row of 48 tokens: 3 documents, each past the window
DEFAULT_ARCHS = ("mistral_sliding", "qwen3_next", "gemma3_multimodal", "nemotron_h")
assert min(DOCS) > WINDOW


def _cells() -> list[Any]:
    slow = pytest.mark.slow
    return [
        pytest.param(a, f, id=f"{a}-{f}", marks=() if a in DEFAULT_ARCHS else slow)
        for a in [*ZOO, *HYBRID_AND_SPARSE]
        for f in FAMILIES
    ]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-families")


_LOADED: dict[str, tuple[Path, Verifier, Any]] = {}


def _verifier(arch: str, root: Path) -> tuple[Path, Verifier, Any]:
    """The zoo verifier (built once per module), fanout's Verifier capturing the union of
    every family's reference layers, and the capture of one packed row."""
    if arch not in _LOADED:
        path = build(arch, root / arch)
        n = load_verifier(path, device="cpu", capture_layer_ids=[0], num_draft_layers=None)
        layers = sorted({i for f in FAMILIES.values() for i in f.default_layers(n.num_layers)})
        v = load_verifier(
            path, device="cpu", capture_layer_ids=layers, num_draft_layers=None,
            store_last_hidden_states=True,
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, VOCAB, (1, sum(DOCS)), generator=g)  # [1, T]
        pos = torch.cat([torch.arange(d) for d in DOCS])[None]  # [1, T]
        doc = torch.cat([torch.full((d,), i) for i, d in enumerate(DOCS)])[None]  # [1, T]
        cap = v.capture(ids, pos, doc)
        batch = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "cap": cap}
        _LOADED[arch] = (path, v, batch)
    return _LOADED[arch]


def _build(fam_name: str, path: Path, v: Verifier) -> Draft:
    """A small fresh draft of the family for `v`, on the family's own layers."""
    fam = FAMILIES[fam_name]
    layers = fam.draft_layers(fam.default_layers(v.num_layers), path)
    torch.manual_seed(0)
    return fam.build(
        path, target_layer_ids=layers, block_size=fam.block_size_for(4), max_anchors=8,
        num_layers=1, mask_token_id=VOCAB - 1,
    )  # fmt: skip


def _train(draft: Draft, v: Verifier, rows: dict[str, Any]) -> None:
    """Train `draft` STEPS steps on its own layers of the capture."""
    layers = draft.cfg.target_layer_ids
    cap = rows["cap"]
    cols = [v.capture_layer_ids.index(i) for i in layers]
    ids = rows["input_ids"]
    batch = {
        "hidden_states": torch.cat([cap.layers[j] for j in cols], dim=-1).float(),
        "input_ids": ids,
        "target_ids": cap.target_ids.long(),
        "last_hidden_states": cap.last_hidden_states.float(),
        "loss_mask": torch.ones(ids.shape, dtype=torch.uint8),
        "document_ids": rows["document_ids"],
        "position_ids": rows["position_ids"],
    }
    before = {k: p.detach().clone() for k, p in draft.named_parameters()}
    opt, _ = make_optimizer(draft.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        out = draft.loss(batch, gen)
        assert torch.isfinite(out.loss), (step, out.loss)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    moved = [k for k, p in draft.named_parameters() if not torch.equal(p, before[k])]
    assert moved, f"{STEPS} steps changed no weight"


def _final_norm(oracle: Any, path: Path) -> Any:
    """The oracle's module holding the final norm `text_tensors` names (its text
    model's `norm`, `final_layernorm`, `embedding_norm` or `norm_f`; its `norm` where
    that has no weight: NanoChat's)."""
    name = text_tensors(path).norm or "norm"
    attr = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return getattr(text_model(oracle), attr)


def _last_layer_and_logits(oracle: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's last decoder layer's output [T, H] and its logits [T, V] on a few
    tokens: what the final norm and the head map one to the other in the model itself."""
    out: list[torch.Tensor] = []

    def hook(_m: Any, _a: Any, o: Any) -> None:
        out.append(o[0] if isinstance(o, tuple) else o)

    h = text_model(oracle).layers[-1].register_forward_hook(hook)
    try:
        ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
        logits = oracle(input_ids=ids, use_cache=False).logits[0]  # [T, V]
    finally:
        h.remove()
    return out[-1][0], logits


def _speculators() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations of torch.compile & co.
        return pytest.importorskip("speculators")


def _speculators_load(path: Path) -> Any:
    """speculators' own loading path for whichever family the config names (its
    registry dispatches on `speculators_model_type`), eager attention, fp32."""
    spec = _speculators()
    cfg = spec.SpeculatorModelConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"  # CPU, no compiled mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg, spec.SpeculatorModel.from_pretrained(str(path), config=cfg, dtype=torch.float32)


@pytest.mark.parametrize(("arch", "fam_name"), _cells())
def test_family_trains_on_the_zoo_verifier_and_loads_in_speculators(
    arch: str, fam_name: str, zoo_dir: Path, tmp_path: Path
) -> None:
    path, v, rows = _verifier(arch, zoo_dir)
    fam = FAMILIES[fam_name]

    draft = _build(fam_name, path, v)
    # the draft's frozen tensors are the verifier's text model's
    oracle = load_oracle(arch, path)
    embed = oracle.get_input_embeddings().weight
    assert draft.cfg.hidden_size == v.hidden_size == embed.shape[1]
    assert draft.cfg.vocab_size == v.vocab_size == embed.shape[0]
    assert torch.equal(draft.embed_weight, embed)
    if draft.cfg.draft_vocab_size is None:
        assert torch.equal(draft.lm_head_weight, oracle.get_output_embeddings().weight)
    # small states (mean square ~1e-6), so a wrong epsilon shows as well as a wrong gain
    x = 1e-3 * torch.randn(3, v.hidden_size, generator=torch.Generator().manual_seed(1))
    final = _final_norm(oracle, path)
    gain, eps = draft.verifier_norm_weight, draft.cfg.rms_norm_eps
    mine = torch.nn.functional.rms_norm(x, (v.hidden_size,), gain, eps)  # [3, H]
    torch.testing.assert_close(mine, final(x), rtol=1e-5, atol=1e-6)
    # and that norm is the one between the last layer and the head: the draft's norm
    # and head map the oracle's last layer output to its logits
    last, logits = _last_layer_and_logits(oracle)  # [T, H], [T, V]
    kept = torch.arange(draft.lm_head_weight.shape[0])  # the draft vocabulary's ids
    if draft.d2t is not None:
        kept = kept + draft.d2t
    normed = torch.nn.functional.rms_norm(last, (v.hidden_size,), gain, eps)  # [T, H]
    mine = normed @ draft.lm_head_weight.T  # [T, draft V]
    if cap := getattr(oracle.config.get_text_config(), "final_logit_softcapping", None):
        mine = cap * torch.tanh(mine / cap)  # Gemma-2's soft-capping (argmax-invariant)
    torch.testing.assert_close(mine, logits[:, kept])

    _train(draft, v, rows)
    opt = torch.optim.SGD(draft.parameters(), lr=0.1)
    ckpt = save_checkpoint(tmp_path, draft, opt, {"step": STEPS}, verifier_name_or_path=str(path))
    saved = load_file(str(ckpt / "model.safetensors"))

    # fanout reads it back beside the verifier (what `fanout eval` does)
    back = load_draft(ckpt, path)
    assert type(back) is type(draft)
    for k, t in draft.trainable_state().items():
        assert torch.equal(back.trainable_state()[k], t.to(torch.bfloat16).float()), k
    head = draft.lm_head_weight.bfloat16()  # bf16 where the checkpoint holds a copy
    assert torch.equal(back.lm_head_weight.bfloat16(), head)

    # speculators 0.9.0 loads it in its own class for the family
    cfg, model = _speculators_load(ckpt)
    assert type(model).__name__ in fam.architectures
    tl = cfg.transformer_layer_config
    assert (tl.hidden_size, tl.vocab_size) == (v.hidden_size, v.vocab_size)
    assert getattr(cfg, "target_hidden_size", v.hidden_size) == v.hidden_size
    assert getattr(cfg, fam.layer_ids_field) == to_serving_layer_ids(draft.cfg.target_layer_ids)
    assert getattr(cfg, fam.layer_ids_field) == [i + 1 for i in draft.cfg.target_layer_ids]
    sd = model.state_dict()
    for k, t in saved.items():
        assert torch.equal(sd[k], t.to(sd[k].dtype)), k
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable <= set(saved), sorted(trainable - set(saved))
    # its loader found the verifier's text embedding (by suffix), or took the
    # checkpoint's bf16 copy (EAGLE-3 writes its embedding whole; P-EAGLE trains it)
    got = model.embed_tokens.weight.bfloat16()
    assert torch.equal(got, draft.embed_weight.bfloat16()), text_tensors(path)
    if hasattr(model, "verifier_norm"):  # and the text model's final norm
        # (NanoChat's has no weight: speculators, finding none, keeps its gain of ones)
        norm = getattr(final, "weight", None)
        norm = torch.ones(v.hidden_size) if norm is None else norm
        assert torch.equal(model.verifier_norm.weight, norm), text_tensors(path)


def test_text_tensors_refuses_what_it_cannot_find(tmp_path: Path) -> None:
    """One line naming the directory: no text model under any known prefix; an untied
    head declared but absent. Undeclared, a missing head is the tied embedding."""
    from safetensors.torch import save_file

    from fanout.errors import ConfigError

    def vdir(name: str, tensors: list[str], config: dict[str, Any]) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file({k: torch.zeros(2) for k in tensors}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config))
        return d

    mm = ["model.language_model.embed_tokens.weight", "model.language_model.norm.weight"]
    with pytest.raises(ConfigError, match=r"no text model's embedding and final norm"):
        text_tensors(vdir("renamed", ["transformer.wte.weight", "lm_head.weight"], {}))
    with pytest.raises(ConfigError, match=r"tie_word_embeddings false.*no head"):
        text_tensors(vdir("untied", mm, {"text_config": {"tie_word_embeddings": False}}))
    got = text_tensors(vdir("undeclared", mm, {"text_config": {"model_type": "qwen3_5_text"}}))
    assert (got.embed, got.head, got.norm_offset) == (mm[0], None, 1.0)
    top = {"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}
    assert text_tensors(vdir("tied-top", [*mm, "lm_head.weight"], top)).tied  # Gemma-3


def test_layer_count_and_norm_epsilon_from_whichever_field_the_config_uses(
    tmp_path: Path,
) -> None:
    """The per-layer list makes the stack (Nemotron-H: `layers_block_type`, or an older
    checkpoint's `hybrid_override_pattern`, one character per layer, over a stale
    `num_hidden_layers`, as transformers builds it); no count at all is one line naming
    the file. The epsilon is read under the name the config gives it."""
    from fanout.errors import ConfigError
    from fanout.model.verifier_dir import read_verifier_config

    base = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
            "vocab_size": 10}  # fmt: skip

    def read(name: str, **fields: Any) -> dict[str, Any]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(base | fields))
        return read_verifier_config(d)

    got = read("pattern", hybrid_override_pattern="M-*E", num_hidden_layers=7, norm_eps=1e-5)
    assert (got["_num_hidden_layers"], got["rms_norm_eps"]) == (4, 1e-5)
    got = read("list", layers_block_type=["mamba", "attention"], layer_norm_epsilon=3e-5)
    assert (got["_num_hidden_layers"], got["rms_norm_eps"]) == (2, 3e-5)
    assert read("plain", num_hidden_layers=3)["_num_hidden_layers"] == 3
    with pytest.raises(ConfigError, match=r"none/config.json: no decoder-layer count") as e:
        read("none")
    assert "\n" not in str(e.value)
