"""Packed capture is exact for every verifier architecture: each document of a packed
row, every captured layer and its greedy ids, equals that document run alone through
plain transformers.

.venv/bin/python -m pytest tests/test_verifier_zoo.py -x -q

The oracle runs each document alone (batch 1, no mask, positions 0..n-1) through the
model class it was saved with, reading decoder-layer outputs with forward hooks: it
uses nothing of fanout's. Architectures come from tests/verifier_zoo.py (tiny, random,
sliding windows and attention chunks of 8 tokens; documents of 10-30 tokens): ZOO's
and HYBRID_AND_SPARSE's (recurrent layers packed with their state reset per document,
DeepSeek-V3.2's indexer under the document mask; a layer type without a packing rule
is captured by running each document alone).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.errors import ConfigError
from fanout.model.verifier import DENSE_MASK_MAX_BYTES, Verifier, load_verifier
from verifier_zoo import HYBRID_AND_SPARSE, VOCAB, WINDOW, ZOO, build, load_oracle

T = 64
# two rows of documents (lengths), then padding (document id -1) to T
ROWS = [[12, 25, 18], [30, 10, 20, 1]]


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """input_ids, position_ids, document_ids [2, T] and the (row, start, end) spans."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (len(ROWS), T), generator=g)
    pos = torch.zeros(len(ROWS), T, dtype=torch.long)
    doc = torch.full((len(ROWS), T), -1, dtype=torch.long)
    spans = []
    for b, lens in enumerate(ROWS):
        s = 0
        for d, n in enumerate(lens):
            pos[b, s : s + n] = torch.arange(n)
            doc[b, s : s + n] = d
            spans.append((b, s, s + n))
            s += n
        pos[b, s:] = torch.arange(T - s)  # padding: arbitrary positions, isolated tokens
    assert max(e - s for _, s, e in spans) > WINDOW
    return ids, pos, doc, spans


def _text_layers(model: Any) -> Any:
    """The decoder layers of the text tower (a multimodal model's language_model)."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers


@torch.inference_mode()
def _alone(model: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One document [n] run alone: every decoder layer's output [n, H] and the logits
    [n, vocab]. Hooks, so the last layer is its raw output (no final norm), as fanout's."""
    layers = _text_layers(model)
    outs: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    handles = []
    for i, layer in enumerate(layers):

        def hook(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            outs[i] = (out[0] if isinstance(out, tuple) else out)[0].clone()

        handles.append(layer.register_forward_hook(hook))
    try:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]  # [n, vocab]
    finally:
        for h in handles:
            h.remove()
    return outs, logits


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {a: build(a, root / a) for a in [*ZOO, *HYBRID_AND_SPARSE]}


_ORACLES: dict[str, tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = {}


def _oracle(
    arch: str, path: Path, attn: str
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per span of `_rows()`: the layer outputs and logits of the document alone."""
    key = f"{arch}:{attn}"
    if key not in _ORACLES:
        model = load_oracle(arch, path, attn_implementation=attn)
        ids, _pos, _doc, spans = _rows()
        res = [_alone(model, ids[b, s:e]) for b, s, e in spans]
        _ORACLES[key] = ([r[0] for r in res], [r[1] for r in res])
    return _ORACLES[key]


# storage dtype -> (rtol, atol relative to the layer's largest magnitude): fp32 only
# sees kernel-order noise; bf16 storage rounds each value once (half an ulp, eps/2).
_TOL = {
    "float32": (1e-4, 1e-5),
    "bfloat16": (torch.finfo(torch.bfloat16).eps, torch.finfo(torch.bfloat16).eps / 2),
}
CASES = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "alone")]


@pytest.mark.parametrize(("storage", "path"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
@pytest.mark.parametrize("arch", [*ZOO, *HYBRID_AND_SPARSE])
def test_packed_capture_equals_each_document_alone(
    zoo_dirs: dict[str, Path], arch: str, storage: str, path: str
) -> None:
    v = load_verifier(
        zoo_dirs[arch],
        device="cpu",
        dtype="float32",
        storage_dtype=storage,
        capture_layer_ids=["all"],
        chunk_tokens=40,
    )
    if path == "alone":
        v.dense_mask_max_bytes = 0  # every row through the per-document path
    ids, pos, doc, spans = _rows()
    cap = v.capture(ids, pos, doc)
    layers, logits = _oracle(
        arch, zoo_dirs[arch], v.model.config.get_text_config()._attn_implementation
    )
    assert v.num_layers == len(layers[0]) and v.capture_layer_ids == list(range(v.num_layers))
    assert all(torch.isfinite(x.float()).all() for x in cap.layers)  # padding included
    rtol, atol = _TOL[storage]
    worst = 0.0
    for k, (b, s, e) in enumerate(spans):
        for j, ref in enumerate(layers[k]):
            got = cap.layers[j][b, s:e].float()  # [n, H]
            scale = ref.abs().max().item()
            rel = (got - ref).abs().max().item() / scale
            worst = max(worst, rel)
            ok = ((got - ref).abs() <= rtol * ref.abs() + atol * scale).all()
            assert ok, f"{arch} doc {k} layer {j}: max |diff| / max |ref| = {rel:.2e}"
        want = logits[k].argmax(-1).to(torch.int32)  # [n]
        diff = cap.target_ids[b, s:e] != want
        if diff.any():  # only a float near-tie may flip between batch shapes
            top2 = logits[k][diff].topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).abs().max() < 1e-4, f"doc {k}: target_ids differ"
    print(f"{arch} {storage} {path}: max |diff| / max |ref| = {worst:.2e}")


def _with_layer_types(src: Path, dst: Path, types: list[str]) -> Path:
    d = Path(shutil.copytree(src, dst))
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = types
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unknown_layer_type_is_refused_in_one_line_under_strict(
    zoo_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # a type transformers' own config allows, that fanout has no rule for
    kind = "compressed_sparse_attention"  # DeepSeek-V4's
    d = _with_layer_types(
        zoo_dirs["qwen3"], tmp_path / "v", ["full_attention", kind, "full_attention"]
    )
    with pytest.raises(ConfigError) as e:
        load_verifier(d, device="cpu", capture_layer_ids=[0], strict_layer_types=True)
    msg = str(e.value)
    assert "\n" not in msg and kind in msg and str(d) in msg
    assert "--strict-layer-types" in msg


@pytest.mark.parametrize("arch", list(HYBRID_AND_SPARSE))
def test_hybrid_and_sparse_layer_types_have_a_rule(
    zoo_dirs: dict[str, Path], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each of these types has a rule now: Nemotron-H's (`mlp`, `moe`: token-wise;
    # Mamba-2: linear, packed with resets), LFM2's (`conv`: its short convolutions, the
    # same), Falcon-H1's (`hybrid`: full attention beside Mamba-2) and DeepSeek-V3.2's
    # (`indexed_attention`: the full mask, which its indexer's top-k takes). So: no
    # warning, packed rows, and --strict-layer-types takes them. The path of a type
    # without one: test_an_indexer_fanout_has_not_read_runs_each_document_alone.
    with caplog.at_level(logging.WARNING, logger="fanout.model.verifier"):
        v = load_verifier(zoo_dirs[arch], device="cpu", capture_layer_ids=[0])
    warned = [r.getMessage() for r in caplog.records if "no packing rule" in r.getMessage()]
    assert not v.rule.unruled and not warned
    assert {"mlp", "moe"} <= set(v.rule.layer_types) or {
        "conv", "hybrid", "indexed_attention"} & set(v.rule.layer_types)  # fmt: skip
    # fanout's own attention, except under an indexer's top-k (transformers' applies it)
    assert v.local_attention == ("indexed_attention" not in v.rule.layer_types)
    load_verifier(zoo_dirs[arch], device="cpu", capture_layer_ids=[0], strict_layer_types=True)
    assert not v.runs_alone(1, 8)  # packed: state reset per document, or under the mask


def test_an_indexer_fanout_has_not_read_runs_each_document_alone(
    zoo_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An `indexed_attention` layer whose indexer is not one fanout read (Qwen4-Exp's
    # block-compressed one, say; here DeepSeek-V3.2's with the table emptied): a type
    # without a rule, one warning, every row alone and exact; refused under strict.
    from fanout.model import layer_types

    monkeypatch.setattr(layer_types, "MASK_AWARE_INDEXERS", frozenset())
    arch = "deepseek_v32"
    with caplog.at_level(logging.WARNING, logger="fanout.model.verifier"):
        v = load_verifier(zoo_dirs[arch], device="cpu", dtype="float32",
                          storage_dtype="float32", capture_layer_ids=["all"])  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "no packing rule" in r.getMessage()]
    assert v.runs_alone(1, 8)
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert v.rule.unruled and all(t in warned[0] for t in v.rule.unruled)
    assert "alone" in warned[0] and "--strict-layer-types" in warned[0]
    assert v.rule.unruled == ("indexed_attention",) and not v.local_attention
    ids, pos, doc, spans = _rows()
    cap = v.capture(ids, pos, doc)
    layers, _logits = _oracle(arch, zoo_dirs[arch], v.attn_implementation)
    for k, (b, s, e) in enumerate(spans):
        ref = layers[k][-1]  # [n, H]
        assert (cap.layers[-1][b, s:e].float() - ref).abs().max() <= 1e-4 * ref.abs().max(), k
    with pytest.raises(ConfigError, match=r"layer 0 \(indexed_attention\) holds no indexer"):
        load_verifier(zoo_dirs[arch], device="cpu", capture_layer_ids=[0], strict_layer_types=True)


def test_an_indexer_blind_to_documents_would_choose_across_them(
    zoo_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control of DeepSeek-V3.2's rule: its rows are exact packed because the indexer
    # adds the block-diagonal mask to its scores before the top-k. Given a causal mask
    # instead (documents not told apart), its top-k takes keys of earlier documents,
    # which the attention then drops: the row differs from each document alone.
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    arch = "deepseek_v32"
    v = load_verifier(zoo_dirs[arch], device="cpu", dtype="float32", storage_dtype="float32",
                      capture_layer_ids=["all"])  # fmt: skip
    assert not v.rule.unruled and not v.runs_alone(2, T)
    forward = m.DeepseekV32Indexer.forward

    def causal_only(self: Any, h: Any, q: Any, pe: Any, mask: torch.Tensor, *a: Any,
                    **kw: Any) -> Any:  # fmt: skip
        t = mask.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
        if mask.dtype == torch.bool:
            blind = causal.expand(mask.shape)
        else:
            blind = torch.zeros_like(mask).masked_fill(~causal, torch.finfo(mask.dtype).min)
        return forward(self, h, q, pe, blind, *a, **kw)

    ids, pos, doc, spans = _rows()
    layers, _logits = _oracle(arch, zoo_dirs[arch], v.attn_implementation)
    worst = {}
    for name, fn in (("masked", forward), ("blind", causal_only)):
        monkeypatch.setattr(m.DeepseekV32Indexer, "forward", fn)
        cap = v.capture(ids, pos, doc)
        worst[name] = max(
            ((cap.layers[-1][b, s:e].float() - layers[k][-1]).abs().max()
             / layers[k][-1].abs().max()).item()
            for k, (b, s, e) in enumerate(spans)
        )  # fmt: skip
    assert worst["masked"] < 1e-4 and worst["blind"] > 1e-3, worst


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1", "lfm2"])
def test_unruled_archs_are_wrong_packed_under_one_mask(
    zoo_dirs: dict[str, Path], arch: str
) -> None:
    # The control of the exactness test above: these architectures' rows, forced through
    # one forward under the block-diagonal masks (what a rule-less packing would do),
    # differ from each document alone: their Mamba or convolution state crosses
    # document boundaries. So running each document alone is what makes them exact.
    v = load_verifier(zoo_dirs[arch], device="cpu", dtype="float32", storage_dtype="float32",
                      capture_layer_ids=["all"])  # fmt: skip
    assert v.rule.needs_alone(8) or v.rule.varlen  # alone, or packed with resets (LFM2)
    v.rule = dataclasses.replace(
        v.rule,
        unruled=(),
        layer_types=tuple("full_attention" for _ in v.rule.layer_types),
        varlen=False,
    )
    v.mixers = None  # transformers' own forwards (LFM2's convolutions have a varlen one)
    ids, pos, doc, spans = _rows()
    cap = v.capture(ids, pos, doc)
    layers, _logits = _oracle(arch, zoo_dirs[arch], v.attn_implementation)
    worst = 0.0
    for k, (b, s, e) in enumerate(spans):
        ref = layers[k][-1]  # [n, H] the last layer
        got = cap.layers[-1][b, s:e].float()
        worst = max(worst, (got - ref).abs().max().item() / ref.abs().max().item())
    assert worst > 1e-3, f"{arch}: packed under one mask equals alone ({worst:.1e})"


def test_config_transformers_cannot_build_is_a_config_error(
    zoo_dirs: dict[str, Path], tmp_path: Path
) -> None:
    d = Path(shutil.copytree(zoo_dirs["gemma3_text"], tmp_path / "v"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 5  # hidden 32 is not a multiple: the config refuses
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="cannot load"):
        load_verifier(d, device="cpu")
    empty = Path(shutil.copytree(zoo_dirs["qwen3_next"], tmp_path / "noweights"))
    for f in empty.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="no weight files"):
        load_verifier(empty, device="cpu")


@pytest.mark.parametrize("arch", ["qwen3_5_multimodal", "gemma3_multimodal"])
def test_multimodal_checkpoint_captures_its_text_model(
    zoo_dirs: dict[str, Path], arch: str
) -> None:
    v: Verifier = load_verifier(zoo_dirs[arch], device="cpu", num_draft_layers=1)
    text = v.model.config.get_text_config()
    assert (v.num_layers, v.hidden_size, v.vocab_size) == (
        text.num_hidden_layers,
        text.hidden_size,
        text.vocab_size,
    )


def _largest_allocation(v: Verifier, t: int, lens: list[int]) -> int:
    """Bytes of the largest allocation any one op makes while capturing one [1, t] row
    of documents `lens` (then padding), per torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, VOCAB, (1, t), generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(1, t, dtype=torch.long)
    doc = torch.full((1, t), -1, dtype=torch.long)
    s = 0
    for k, n in enumerate(lens):
        pos[0, s : s + n] = torch.arange(n)
        doc[0, s : s + n] = k
        s += n
    pos[0, s:] = torch.arange(t - s)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.capture(ids, pos, doc)
    return max(e.self_cpu_memory_usage for e in prof.events())


def test_long_rows_never_build_a_t_by_t_tensor(zoo_dirs: dict[str, Path]) -> None:
    v = load_verifier(zoo_dirs["qwen3"], device="cpu", dtype="float32", capture_layer_ids=[1])
    # Control: forced through the dense mask, a 2048-token row allocates >= T² bytes
    # (the boolean mask itself, 4 MiB), so the measurement does see such a tensor.
    v.dense_mask_max_bytes = 1 << 40
    assert _largest_allocation(v, 2048, [1000, 700, 300]) >= 2048 * 2048
    # At T = 16384 a T×T boolean mask is 256 MiB (and a float one 1 GiB): with the
    # default budget the row runs each document alone, SDPA is_causal, no mask at all.
    v.dense_mask_max_bytes = DENSE_MASK_MAX_BYTES
    t = 16384
    assert v.runs_alone(1, t)
    assert _largest_allocation(v, t, [8000, 6000, 2000]) < t * t // 16


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_fp8_storage_on_both_paths(zoo_dirs: dict[str, Path], arch: str) -> None:
    # fp8 rows are written through the per-document scatter too: same values and
    # scales as the float32 capture, up to e4m3 rounding (half an ulp: 2^-4 relative).
    from fanout.ops.fp8 import dequantize

    ids, pos, doc, _spans = _rows()
    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "capture_layer_ids": [0, 2]}
    ref = load_verifier(zoo_dirs[arch], storage_dtype="float32", **kw).capture(ids, pos, doc)
    v = load_verifier(zoo_dirs[arch], storage_dtype="float8_e4m3fn", **kw)
    for budget in (DENSE_MASK_MAX_BYTES, 0):
        v.dense_mask_max_bytes = budget
        cap = v.capture(ids, pos, doc)
        assert cap.hidden_scales is not None
        got = dequantize(cap.hidden_states, cap.hidden_scales)  # [B, T, 2H] float32
        want = ref.hidden_states  # [B, T, 2H]
        per_token = want.unflatten(-1, (2, -1)).abs().amax(-1, keepdim=True)  # [B, T, 2, 1]
        err = (got - want).unflatten(-1, (2, -1)).abs()  # [B, T, 2, H]
        assert (err <= 2**-4 * per_token + 1e-6).all()
        assert torch.equal(cap.target_ids, ref.target_ids)


def _local_archs() -> list[str]:
    """Zoo architectures with sliding-window or chunked attention layers."""
    from fanout.model.layer_types import CHUNKED, SLIDING, PackingRule

    out = []
    for a, arch in ZOO.items():
        types = PackingRule.from_config(arch.config(), a).layer_types
        if SLIDING in types or CHUNKED in types:
            out.append(a)
    return out


@pytest.mark.parametrize("arch", _local_archs())
def test_documents_many_windows_long_run_blocked_local_attention(
    zoo_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Documents alone: every attention layer runs fanout.model.local_attention, with no
    # mask from transformers, and equals the document alone in plain transformers.
    # 75 tokens = 9 windows + 3; 20 = 2 windows + 4; then one padding token.
    from transformers import AttentionInterface

    from fanout.model import local_attention as la

    seen: list[tuple[int, bool, int]] = []

    def spy(module: Any, q: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.append((int(module.layer_idx), a[2] is None, q.shape[2]))
        return la.attend(module, q, *a, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, la.NAME, spy)
    v = load_verifier(zoo_dirs[arch], device="cpu", dtype="float32", storage_dtype="float32",
                      capture_layer_ids=["all"])  # fmt: skip
    v.dense_mask_max_bytes = 0
    lens, t = [75, 20], 96
    ids = torch.randint(1, VOCAB, (1, t), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in [*lens, 1]])[None]  # [1, T]
    doc = torch.tensor([k for k, n in enumerate(lens) for _ in range(n)] + [-1])[None]
    cap = v.capture(ids, pos, doc)
    attention = {i for i, k in enumerate(v.rule.layer_types) if k != "linear_attention"}
    assert {i for i, _, _ in seen} == attention and all(none for _, none, _ in seen)
    assert max(n for *_, n in seen) == lens[0]
    oracle = load_oracle(arch, zoo_dirs[arch], attn_implementation=v.attn_implementation)
    s = 0
    for n in lens:
        layers, _logits = _alone(oracle, ids[0, s : s + n])
        for j, ref in enumerate(layers):
            got = cap.layers[j][0, s : s + n]  # [n, H]
            scale = ref.abs().max().item()
            rel = (got - ref).abs().max().item() / scale
            assert rel < 1e-4, f"{arch} document of {n} tokens, layer {j}: {rel:.2e}"
        s += n


def test_long_document_on_a_sliding_arch_never_builds_a_t_by_t_tensor(
    zoo_dirs: dict[str, Path],
) -> None:
    v = load_verifier(zoo_dirs["mistral_sliding"], device="cpu", dtype="float32",
                      capture_layer_ids=[1])  # fmt: skip
    v.dense_mask_max_bytes = 0  # documents alone (what long rows take)
    t = 8192
    # Control: transformers' own sliding mask for an 8192-token document is T² bytes
    # (64 MiB); the blocked path's largest tensors are O(T·H) and O(T·w).
    v.local_attention = False
    assert _largest_allocation(v, t, [t]) >= t * t
    v.local_attention = True
    assert _largest_allocation(v, t, [t]) < t * t // 16


RECURRENT = ["qwen3_next", "qwen3_5_text", "qwen3_5_multimodal", "lfm2", "nemotron_h", "falcon_h1"]


@pytest.mark.parametrize("arch", RECURRENT)
def test_recurrent_layers_run_packed_with_a_reset_at_each_document(
    zoo_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linear attention and short convolutions take the packed path (one forward over
    # the rows: test_packed_capture_equals_each_document_alone checks it is exact). The
    # control: the same path with the resets taken out (one segment per row, what
    # transformers' torch fallback computes over a packed row) is wrong after the first
    # document of a row, so the resets are what makes it exact.
    from fanout.model import verifier as verifier_mod
    from fanout.ops.varlen_scan import SegmentLayout

    v = load_verifier(zoo_dirs[arch], device="cpu", dtype="float32", storage_dtype="float32",
                      capture_layer_ids=["all"])  # fmt: skip
    assert v.mixers and v.rule.varlen and not v.runs_alone(len(ROWS), T)
    ids, pos, doc, spans = _rows()
    layers, _logits = _oracle(arch, zoo_dirs[arch], v.attn_implementation)

    def worst(cap: Any) -> float:
        out = 0.0
        for k, (b, s, e) in enumerate(spans):
            ref = layers[k][-1]  # [n, H] the last layer
            got = cap.layers[-1][b, s:e].float()
            out = max(out, (got - ref).abs().max().item() / ref.abs().max().item())
        return out

    assert worst(v.capture(ids, pos, doc)) < 1e-4
    real = verifier_mod.packed_mixers

    def without_resets(mixers: Any, lay: SegmentLayout) -> Any:
        # the mixers see one segment per row; attention still its documents
        b, t = lay.segment.shape
        one = torch.arange(t).expand(b, t)
        lay = dataclasses.replace(
            lay, segment=torch.zeros_like(lay.segment), offset=one, host_offset=one
        )
        return real(mixers, lay)

    monkeypatch.setattr(verifier_mod, "packed_mixers", without_resets)
    assert worst(v.capture(ids, pos, doc)) > 1e-3
