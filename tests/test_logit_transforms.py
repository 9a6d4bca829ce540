"""Verifiers whose forward transforms its logits after the head: a scale (Granite's
`logits_scaling`, a divisor; Cohere's `logit_scale` and HyperCLOVAX's `logits_scaling`,
factors; Inkling's and MiniCPM3's divisors of the states the head reads) or a soft cap
(Gemma-2's `final_logit_softcapping`: `tanh(z / cap) · cap`; Gemma-3/4, VaultGemma,
Beam, RecurrentGemma). What fanout trains a draft against is the verifier's own output
logits; and every transform transformers' causal LMs apply is either handled or listed
as not handled, with why.

.venv/bin/python -m pytest tests/test_logit_transforms.py -x -q

The oracle is transformers' own `…ForCausalLM`, built tiny and random from its config
class with every multiplier away from 1, each document run alone: `model(ids).logits`.
Checked:
- a scale: the teacher every family reads, the captured `last_hidden_states` through the
  draft's frozen head (`last · Wᵀ`), is the model's logits; the control, the model's
  final-normed states through the head without the scale, is not;
- a soft cap: the teacher logits fanout trains against
  (`fanout.ops.linear_kl.teacher_logits`: `last · Wᵀ`, capped by the cap the draft took
  from the verifier) are the model's logits; uncapped they are not;
- the fused ops with a cap (the KL of `fanout.ops.linear_kl` and `teacher_head`, the
  two-head KL and TV of `fanout.ops.two_head_ce`) against plain torch on
  `softmax(cap · tanh(teacher · Wᵀ / cap))`, forward and backward;
- every family's loss reads the draft's cap (a KL loss with it differs from one without);
- other model_types (a field of that name included) and a multimodal Gemma-3 have no
  cap, and a scale or a cap that is not a positive number is refused in one line;
- the scan: each causal LM's forward source (AutoModelForCausalLM's table and every
  `…ForCausalLM`) that shows a transform (a known field, a tanh, `logits` or
  `hidden_states` multiplied or divided) is in fanout's tables or `KNOWN_UNHANDLED`;
  each table entry is found by the scan and has its test here.
Falcon-H1's `lm_head_multiplier` is tests/test_logit_scale.py's.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.families.registry import FAMILIES
from fanout.model.verifier import load_verifier
from fanout.model.verifier_dir import (
    _LOGIT_SCALE_FIELDS,
    _LOGIT_SOFTCAP_FIELDS,
    _WIDTH_RATIO_SCALES,
    text_tensors,
)
from fanout.ops.linear_kl import linear_kl_div_and_argmax, teacher_logits
from fanout.ops.teacher_head import teacher_head
from fanout.ops.two_head_ce import (
    TwoHeadTerms,
    two_head_ce_tv_and_argmax,
    two_head_kl_div_and_argmax,
)
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import _COMMON, VOCAB, WINDOW, build, doc_spans, load_oracle, packed_row

DOCS = (12, 19)  # one packed row of two documents, each past the sliding window
_MUP = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.125}
_GMOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
# model_type: (config class, model class, config fields, the logit scale fanout reads)
SCALED: dict[str, tuple[str, str, dict[str, Any], float]] = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0, **_MUP}, 1 / 8),
    "granite_swa": (
        "GraniteSWAConfig", "GraniteSWAForCausalLM",
        {"logits_scaling": 8.0, "sliding_window": WINDOW, **_MUP}, 1 / 8,
    ),
    "granitemoe": (
        "GraniteMoeConfig", "GraniteMoeForCausalLM",
        {"logits_scaling": 6.0, **_MUP, **_GMOE}, 1 / 6,
    ),
    "granitemoe_swa": (
        "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
        {"logits_scaling": 6.0, "sliding_window": WINDOW, **_MUP, **_GMOE}, 1 / 6,
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
        {"logits_scaling": 5.0, "shared_intermediate_size": 16, **_MUP, **_GMOE}, 1 / 5,
    ),
    "granitemoehybrid": (  # Mamba-2 beside attention (Granite-4.0)
        "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        {
            "logits_scaling": 4.0, "shared_intermediate_size": 16, **_MUP, **_GMOE,
            "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
            "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 8,
        },
        1 / 4,
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.0625}, 0.0625),
    "cohere2": (
        "Cohere2Config", "Cohere2ForCausalLM",
        {"logit_scale": 0.0625, "sliding_window": WINDOW, "num_hidden_layers": 4}, 0.0625,
    ),
    "cohere2_moe": (
        "Cohere2MoeConfig", "Cohere2MoeForCausalLM",
        {"logit_scale": 0.0625, "sliding_window": WINDOW, "num_hidden_layers": 4,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, 0.0625,
    ),
    "cohere_compass_text": (
        "CohereCompassTextConfig", "CohereCompassForCausalLM",
        {"logit_scale": 0.0625, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {t: {"rope_type": "default", "rope_theta": 1e4}
                             for t in ("sliding_attention", "full_attention")}}, 0.0625,
    ),
    "hyperclovax": (
        "HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {"logits_scaling": 0.25, **_MUP}, 0.25,
    ),
    # divides the final states, not the logits, by a config field: the same linear scale
    "inkling_text": (
        "InklingTextConfig", "InklingForCausalLM", {"logits_mup_width_multiplier": 4.0}, 0.25,
    ),
    # divides them by hidden_size / dim_model_base (32 / 8), computed, not in config.json
    "minicpm3": (
        "MiniCPM3Config", "MiniCPM3ForCausalLM",
        {"dim_model_base": 8, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}, 0.25,
    ),
}  # fmt: skip


def _build_scaled(model_type: str, out: Path) -> tuple[Path, Any]:
    """The tiny random model of `SCALED[model_type]` saved to `out`, and itself (eval)."""
    return _build_from(*SCALED[model_type][:3], out)


def _build_from(
    cfg_cls: str, model_cls: str, fields: dict[str, Any], out: Path, *, common: bool = True
) -> tuple[Path, Any]:
    """A tiny random `model_cls` of config `cfg_cls` (`_COMMON` and 2 layers unless not
    `common`: a multimodal config takes them in its `text_config`; then `fields`) saved
    to `out`, and itself (eval)."""
    import transformers

    base = _COMMON | {"num_hidden_layers": 2} if common else {}
    cfg = getattr(transformers, cfg_cls)(**(base | fields))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).float().eval().requires_grad_(False)
    model.save_pretrained(out)
    return out, model


def _last_states(path: Path) -> torch.Tensor:
    """fanout's captured `last_hidden_states` [T, H] (fp32) of the packed row."""
    v = load_verifier(
        path, device="cpu", dtype="float32", storage_dtype="float32",
        capture_layer_ids=[0], store_last_hidden_states=True,
    )  # fmt: skip
    cap = v.capture(*packed_row(DOCS))
    assert cap.last_hidden_states is not None
    return cap.last_hidden_states[0].float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want).abs().max().item() / want.abs().max().item()


@pytest.mark.parametrize("model_type", list(SCALED))
def test_a_scaled_verifiers_teacher_is_its_logits(model_type: str, tmp_path: Path) -> None:
    path, model = _build_scaled(model_type, tmp_path / model_type)
    assert text_tensors(path).logit_scale == pytest.approx(SCALED[model_type][3], rel=1e-12)
    last = _last_states(path)
    head = DFlashDraft.from_verifier(path, target_layer_ids=[0], block_size=4).lm_head_weight
    ids = packed_row(DOCS)[0][0]
    for k, (s, e) in enumerate(doc_spans(DOCS)):
        with torch.inference_mode():
            want = model(input_ids=ids[None, s:e], use_cache=False).logits[0]  # [n, V]
            unscaled = model.model(input_ids=ids[None, s:e], use_cache=False).last_hidden_state[0]
        got = last[s:e] @ head.t()
        assert _rel(got, want) < 1e-5, f"{model_type} document {k}: last · Wᵀ vs logits"
        # the control: the final-normed states through the head, the scale left out
        assert _rel(unscaled @ head.t(), want) > 0.1, f"{model_type}: the scale is 1"


@pytest.mark.parametrize("bad", [0, -2.0, "big", float("nan")])
@pytest.mark.parametrize(
    ("model_type", "field"), [("granite", "logits_scaling"), ("minicpm3", "dim_model_base")]
)
def test_a_scaling_that_is_not_a_positive_number_is_refused(
    tmp_path: Path, model_type: str, field: str, bad: Any
) -> None:
    path, _ = _build_scaled(model_type, tmp_path / "g")
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = bad
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        text_tensors(path)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and str(path) in msg


# ---- the soft cap: Gemma-2's final_logit_softcapping ------------------------------------

CAP = 1.0  # the tiny models' logits reach about ±1 to ±2.3: into tanh's bend
_CAPS = {"final_logit_softcapping": CAP}


def _multimodal(text: dict[str, Any]) -> dict[str, Any]:
    """A tiny Gemma-4 multimodal config's fields: `text` over the zoo's text model, one
    vision layer, no audio."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "patch_size": 4}  # fmt: skip
    return {"text_config": _COMMON | {"num_hidden_layers": 2} | text,
            "vision_config": vision, "audio_config": None}  # fmt: skip


# model_type: (config class, model class, config fields), or None: the zoo's verifier
CAPPED: dict[str, tuple[str, str, dict[str, Any]] | None] = {
    "gemma2": None,
    "gemma3_text": None,
    "vaultgemma": (
        "VaultGemmaConfig", "VaultGemmaForCausalLM", {"sliding_window": WINDOW, **_CAPS},
    ),
    "beam": ("BeamConfig", "BeamForCausalLM", _CAPS),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", _CAPS),
    # its final norm has no weight (the draft's gain: ones), and is also applied to the
    # embeddings before the first layer
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", _CAPS),
    "recurrent_gemma": (  # its own field, always set (30 by default)
        "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {"logits_soft_cap": CAP},
    ),
    # causal only where its default bidirectional attention among image tokens is off
    # (fanout refuses a verifier that sets use_bidirectional_attention)
    "gemma4_unified_text": (
        "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
        {**_CAPS, "use_bidirectional_attention": None},
    ),
    # multimodal: Gemma4ForConditionalGeneration caps by its text config's field
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", _multimodal(_CAPS)),
    "gemma4_unified": (
        "Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration",
        _multimodal({**_CAPS, "use_bidirectional_attention": None}),
    ),
}  # fmt: skip


def _build_capped(model_type: str, out: Path) -> tuple[Path, Any]:
    """A tiny random model whose forward soft-caps its logits at `CAP`, and itself."""
    spec = CAPPED[model_type]
    if spec is None:
        path = build(model_type, out, final_logit_softcapping=CAP)
        return path, load_oracle(model_type, path)
    return _build_from(*spec, out, common="text_config" not in spec[2])


@pytest.mark.parametrize("model_type", list(CAPPED))
def test_a_capped_verifiers_teacher_logits_are_its_logits(model_type: str, tmp_path: Path) -> None:
    path, model = _build_capped(model_type, tmp_path / model_type)
    assert text_tensors(path).logit_softcap == CAP
    draft = DFlashDraft.from_verifier(path, target_layer_ids=[0], block_size=4)
    assert draft.teacher_softcap == CAP
    last = _last_states(path)
    ids = packed_row(DOCS)[0][0]
    for k, (s, e) in enumerate(doc_spans(DOCS)):
        with torch.inference_mode():
            want = model(input_ids=ids[None, s:e], use_cache=False).logits[0]  # [n, V]
        got = teacher_logits(last[s:e], draft.lm_head_weight, draft.teacher_softcap)
        assert _rel(got, want) < 1e-5, f"{model_type} document {k}: capped teacher vs logits"
        # the control: the same states through the head, uncapped
        assert _rel(teacher_logits(last[s:e], draft.lm_head_weight), want) > 0.1


def test_a_verifier_without_a_cap_has_none(tmp_path: Path) -> None:
    # gemma3_text's default is null; a multimodal Gemma-3 (its forward caps nothing) and a
    # field of that name on another model_type are not caps
    assert text_tensors(build("gemma3_text", tmp_path / "g3")).logit_softcap is None
    path = build("qwen3", tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"final_logit_softcapping": 2.0}))
    assert text_tensors(path).logit_softcap is None
    path = build("gemma3_multimodal", tmp_path / "g3m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["final_logit_softcapping"] = 2.0
    (path / "config.json").write_text(json.dumps(cfg))
    assert text_tensors(path).logit_softcap is None


@pytest.mark.parametrize("bad", [0, -30.0, "30", float("inf")])
def test_a_cap_that_is_not_a_positive_number_is_refused(tmp_path: Path, bad: Any) -> None:
    path = build("gemma2", tmp_path / "g")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"final_logit_softcapping": bad}))
    with pytest.raises(ConfigError) as e:
        text_tensors(path)
    msg = str(e.value)
    assert "\n" not in msg and "final_logit_softcapping" in msg and str(path) in msg


# ---- every causal LM of transformers that transforms its logits: handled or listed -------

# The model_types whose causal-LM forward transforms its logits (or the states its head
# reads) that fanout's tables leave out, each with why. A transform the scan below finds
# goes into fanout's tables (fanout.model.verifier_dir, with a test above) or here.
KNOWN_UNHANDLED: dict[str, str] = {
    # AltUp: each layer outputs 4 states per token; the capture refuses it in one line
    "gemma3n_text": "Gemma-3n: AltUp layers, not capturable",
    "gemma3n": "Gemma-3n's multimodal model: the same AltUp text model",
    # saved as `model.llm.embed` / `unembed` with attention-residual queries: text_tensors
    # finds no embedding and final norm, and refuses the checkpoint
    "inkling2_text": "Inkling-2: a checkpoint layout fanout does not read",
    "inkling2_loop_text": "Inkling-2 Loop: the same layout",
    # xLSTM blocks, no decoder `layers`: load_verifier refuses it
    "xlstm": "xLSTM: no decoder layers to capture",
}
# What the forward's source shows of a transform: the fields the known ones read, a tanh or
# a soft-cap call, `logits` / `hidden_states` multiplied or divided (by anything: a new
# config field too)
_TRANSFORM = re.compile(
    r"final_logit_softcapping|logits?_soft_?cap|soft_?cap\(|logit_scale|logits_scaling"
    r"|lm_head_multiplier|logits_mup|\btanh\("
    r"|\b(?:logits|hidden_states|last_hidden_state)\s*[*/]|[*/]\s*(?:logits|hidden_states)\b"
)


def _causal_lms() -> dict[str, str]:
    """model_type: class name of every causal LM transformers builds from a config class:
    AutoModelForCausalLM's table (multimodal models' `…ForConditionalGeneration` included)
    and every `…ForCausalLM` it leaves out."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    names |= {
        n for n in dir(transformers) if n.endswith("ForCausalLM") and n != "AutoModelForCausalLM"
    }
    out = {}
    for n in sorted(names):
        config_class: Any = getattr(getattr(transformers, n), "config_class", None)
        model_type = None if config_class is None else getattr(config_class, "model_type", None)
        if model_type:
            out[str(model_type)] = n
    return out


def _forward_code(cls: Any) -> str:
    """The code of `cls.forward`, its docstring and comments left out."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    assert isinstance(fn, ast.FunctionDef)
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    return "\n".join(ast.unparse(stmt) for stmt in body)


def test_every_logit_transform_in_transformers_is_handled_or_listed() -> None:
    import transformers

    lms = _causal_lms()
    assert len(lms) > 150, len(lms)  # the scan sees transformers' causal LMs
    found = {
        mt: sorted(
            {m.group(0) for m in _TRANSFORM.finditer(_forward_code(getattr(transformers, n)))}
        )
        for mt, n in lms.items()
    }
    found = {mt: hits for mt, hits in found.items() if hits}
    handled = set(_LOGIT_SCALE_FIELDS) | set(_WIDTH_RATIO_SCALES) | set(_LOGIT_SOFTCAP_FIELDS)
    new = [f"{mt} ({lms[mt]}): {hits}" for mt, hits in found.items()
           if mt not in handled and mt not in KNOWN_UNHANDLED]  # fmt: skip
    assert not new, f"forwards that transform their logits, neither handled nor listed: {new}"
    # and the scan finds every one it should: a table entry or a listed model_type that it
    # does not see is stale (or the scan blind)
    missed = (handled | set(KNOWN_UNHANDLED)) - set(found)
    assert not missed, f"no transform found in the forwards of {sorted(missed)}"
    assert not handled & set(KNOWN_UNHANDLED)
    # every handled model_type is checked against transformers' logits above
    # (Falcon-H1 in tests/test_logit_scale.py)
    assert set(SCALED) | set(CAPPED) | {"falcon_h1"} == handled


def _op_inputs(n: int = 11, h: int = 8, r: int = 3, v: int = 37) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "x": torch.randn(n, h, generator=g),
        "e": torch.randn(n, r, generator=g),
        "a": 0.8 * torch.randn(v, h, generator=g),  # frozen
        "b": 0.8 * torch.randn(v, r, generator=g),
        "teacher": 0.7 * torch.randn(n, h, generator=g),  # logits of ±4: far into the bend
        "target": torch.randint(0, v, (n,), generator=g),
        "w": torch.rand(n, generator=g) + 0.1,  # row weights / output gradient
    }


def _p(d: dict[str, torch.Tensor], cap: float | None) -> torch.Tensor:
    """The teacher's distribution, plain torch: softmax(cap · tanh(t · Aᵀ / cap))."""
    z = d["teacher"].double() @ d["a"].double().t()
    return torch.softmax(z if cap is None else cap * torch.tanh(z / cap), dim=-1)


def _reference(
    d: dict[str, torch.Tensor], kind: str, two: bool, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Per-row values, accept and the grads of sum_i w_i l_i of x (and e, b), in fp64."""
    x, e, b = (d[k].double().requires_grad_(True) for k in ("x", "e", "b"))
    z = x @ d["a"].double().t() + (e @ b.t() if two else 0)
    log_q = torch.log_softmax(z, dim=-1)
    p = _p(d, cap)
    accept = torch.minimum(p, log_q.exp()).sum(-1)
    if kind == "kl":
        val = (p * (p.log() - log_q)).sum(-1)
    else:  # cetv: 0.3 CE + 0.7 TV
        ce = -log_q.gather(1, d["target"][:, None]).squeeze(1)
        val = 0.3 * ce + 0.7 * (1.0 - accept)
    (val * d["w"].double()).sum().backward()
    leaves = [x, e, b] if two else [x]
    return val.detach(), accept.detach(), [t.grad for t in leaves if t.grad is not None]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=what)


def test_the_fused_kl_with_a_cap_is_plain_torch_on_capped_logits() -> None:
    d = _op_inputs()
    want, _, (gx,) = _reference(d, "kl", False, CAP)
    no_cap, _, _ = _reference(d, "kl", False, None)
    assert (want - no_cap).abs().max() > 0.1  # the cap moves the loss: the check can fail
    for name in ("linear_kl", "teacher_head"):
        x = d["x"].clone().requires_grad_(True)
        if name == "linear_kl":
            kl, _ = linear_kl_div_and_argmax(x, d["teacher"], d["a"], chunk_rows=4, softcap=CAP)
        else:
            kl, _, label = teacher_head(x, d["teacher"], d["a"], chunk_rows=4, softcap=CAP)
            assert torch.equal(label, _p(d, CAP).argmax(-1))
        _close(kl, want, f"{name}: KL")
        (kl * d["w"]).sum().backward()
        assert x.grad is not None
        _close(x.grad, gx, f"{name}: d/dx")


@pytest.mark.parametrize(
    ("kind", "folded"),
    [("kl", True), ("kl", False), ("cetv", True), ("cetv", False), ("terms", True)],
    ids=["kl-row_weight", "kl-per_row", "cetv-row_weight", "cetv-per_row", "terms"],
)  # folded: gradients made in forward (row_weight given; TwoHeadTerms always)
def test_the_two_head_ops_with_a_cap_are_plain_torch_on_capped_logits(
    kind: str, folded: bool
) -> None:
    d = _op_inputs()
    want, want_acc, grads = _reference(d, "kl" if kind == "kl" else "cetv", True, CAP)
    no_cap, _, _ = _reference(d, "kl" if kind == "kl" else "cetv", True, None)
    assert (want - no_cap).abs().max() > 0.01  # the cap moves the loss: the check can fail
    x, e, b = (d[k].clone().requires_grad_(True) for k in ("x", "e", "b"))
    w = d["w"] if folded else None
    common: dict[str, Any] = {"row_weight": w, "chunk_rows": 4, "softcap": CAP}
    if kind == "kl":
        out = two_head_kl_div_and_argmax(x, e, d["a"], b, d["teacher"], **common)
    elif kind == "cetv":
        out = two_head_ce_tv_and_argmax(
            x, e, d["a"], b, d["target"], d["teacher"], ce_weight=0.3, tv_weight=0.7, **common
        )
    else:
        terms = TwoHeadTerms(
            x, d["a"], b, d["target"], d["teacher"], ce_weight=0.3, tv_weight=0.7, softcap=CAP
        )
        out = terms.add(e, row_weight=d["w"])
    _close(out.rows, want, f"{kind}: values")
    assert out.accept is not None
    _close(out.accept, want_acc, f"{kind}: accept")
    loss = terms.loss() if kind == "terms" else out.loss if folded else (out.loss * d["w"]).sum()
    loss.backward()
    for name, leaf, g in zip("xeb", (x, e, b), grads, strict=True):
        assert leaf.grad is not None
        _close(leaf.grad, g, f"{kind}: d/d{name}")


def test_every_familys_teacher_is_capped(tmp_path: Path) -> None:
    # Each family trained against the verifier's distribution reads the draft's cap: its
    # loss with the cap differs from the same loss with the cap taken away.
    path, _ = _build_capped("gemma2", tmp_path / "g2")
    v = load_verifier(
        path, device="cpu", dtype="float32", storage_dtype="float32",
        capture_layer_ids=list(range(4)), store_last_hidden_states=True,
    )  # fmt: skip
    ids, pos, doc = packed_row(DOCS)
    cap = v.capture(ids, pos, doc)
    assert cap.last_hidden_states is not None
    read = []
    for name, fam in FAMILIES.items():
        fields: dict[str, Any] = {"block_size": fam.block_size_for(4), "max_anchors": 8}
        layers = fam.draft_layers(fam.default_layers(v.num_layers), path)
        fields |= {"target_layer_ids": layers, "num_layers": 1, "mask_token_id": VOCAB - 1}
        torch.manual_seed(0)
        try:
            draft = fam.build(path, **fields, loss_type="kl")
        except ConfigError:  # a family whose loss is not a KL (XPress: CE + TV; MTP: CE)
            draft = fam.build(path, **fields)
        if not fam.needs_last_hidden_states(draft.cfg.model_dump()):
            continue
        assert draft.teacher_softcap == CAP, name
        batch = {
            "hidden_states": torch.cat([cap.layers[i] for i in layers], dim=-1).float(),
            "input_ids": ids, "target_ids": cap.target_ids.long(),
            "last_hidden_states": cap.last_hidden_states.float(),
            "loss_mask": torch.ones(ids.shape, dtype=torch.uint8),
            "document_ids": doc, "position_ids": pos,
        }  # fmt: skip
        with torch.no_grad():
            capped = draft.loss(batch, torch.Generator().manual_seed(0)).loss
            draft.teacher_softcap = None
            uncapped = draft.loss(batch, torch.Generator().manual_seed(0)).loss
        assert torch.isfinite(capped), name
        assert (capped - uncapped).abs() > 1e-3 * uncapped.abs(), f"{name} ignores the cap"
        read.append(name)
    assert {"dflash", "dflash2", "dspark", "eagle3", "peagle", "xpress"} <= set(read), read
