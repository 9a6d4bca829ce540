"""Verifier capture: layer convention, packed rows, chunked greedy ids, identity hashes, load errors.

.venv/bin/pytest tests/test_verifier.py -x -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.contract import CaptureContract
from fanout.errors import ConfigError
from fanout.model.capture_layers import resolve_capture_layer_ids
from fanout.model.draft_config import default_target_layer_ids
from fanout.model.layer_types import FULL, PackingRule
from fanout.model.verifier import Verifier, config_hash, load_verifier, weights_fingerprint

VOCAB = 1000
H = 64
L = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_verifier(tmp_path_factory.mktemp("tiny") / "v", VOCAB, seed=1)


@pytest.fixture(scope="module")
def verifier(tiny_dir: Path) -> Verifier:
    return load_verifier(
        tiny_dir, capture_layer_ids=[0, 2, 5], storage_dtype="float32", chunk_tokens=7
    )


def _single_doc(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    return ids, torch.arange(t).expand(b, t), torch.zeros(b, t, dtype=torch.long)


# --------------------------------------------------------------------------- layer rule


def test_dflash_layer_rule_matches_reference_values() -> None:
    # Values from the DFlash reference rule (evenly over [1, L-3], middle for one layer).
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(32, 3) == [1, 15, 29]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(6, 2) == [1, 3]


def test_dflash_layer_rule_rejects_too_shallow_verifier() -> None:
    with pytest.raises(ConfigError, match="not distinct"):
        default_target_layer_ids(4, 2)
    with pytest.raises(ConfigError, match="not distinct"):
        default_target_layer_ids(6, 5)
    with pytest.raises(ConfigError, match="num_draft_layers"):
        default_target_layer_ids(36, 0)


def test_explicit_ids_override_and_are_validated() -> None:
    assert resolve_capture_layer_ids(36, [3, 7], 5) == [3, 7]
    assert resolve_capture_layer_ids(36, None, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(ConfigError, match=r"\[36\] out of range"):
        resolve_capture_layer_ids(36, [1, 36], None)
    with pytest.raises(ConfigError, match="out of range"):
        resolve_capture_layer_ids(36, [-1], None)
    with pytest.raises(ConfigError, match="duplicates"):
        resolve_capture_layer_ids(36, [2, 2], None)
    with pytest.raises(ConfigError, match="num_draft_layers"):
        resolve_capture_layer_ids(36, None, None)


# --------------------------------------------------------------------------- capture


def test_capture_equals_output_hidden_states(verifier: Verifier) -> None:
    ids, pos, doc = _single_doc(2, 24)
    cap = verifier.capture(ids, pos, doc)
    assert cap.hidden_states.shape == (2, 24, 3 * H)
    with torch.inference_mode():
        ref = verifier.model(input_ids=ids, output_hidden_states=True)
    for j, layer in enumerate(verifier.capture_layer_ids):
        got = cap.hidden_states[..., j * H : (j + 1) * H]  # [B, T, H]
        if layer < L - 1:
            # "layer i" = output of decoder layer i = HF hidden_states[i + 1]
            torch.testing.assert_close(got, ref.hidden_states[layer + 1], rtol=0, atol=1e-5)
        else:
            # HF replaces its last entry with the final-normed state; we keep the raw output.
            assert not torch.allclose(got, ref.hidden_states[layer + 1], atol=1e-3)
            normed = verifier.base.norm(got)
            torch.testing.assert_close(normed, ref.hidden_states[layer + 1], rtol=0, atol=1e-5)


def test_target_ids_equal_argmax_of_full_logits(verifier: Verifier) -> None:
    ids, pos, doc = _single_doc(3, 29, seed=3)  # 87 tokens: chunks of 7 leave a ragged tail
    cap = verifier.capture(ids, pos, doc)
    assert cap.target_ids.dtype == torch.int32
    with torch.inference_mode():
        logits = verifier.model(input_ids=ids).logits  # [B, T, vocab]
    full = logits.argmax(-1).to(torch.int32)
    diff = cap.target_ids != full
    if diff.any():  # only a float near-tie may flip between GEMM shapes
        top2 = logits[diff].topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).abs().max() < 1e-5
    assert diff.float().mean() < 0.02


def test_last_hidden_states_and_storage_dtype(tiny_dir: Path) -> None:
    v = load_verifier(tiny_dir, num_draft_layers=2, store_last_hidden_states=True)
    assert v.capture_layer_ids == [1, 3]
    ids, pos, doc = _single_doc(1, 16, seed=4)
    cap = v.capture(ids, pos, doc)
    assert cap.hidden_states.dtype == torch.bfloat16
    assert cap.last_hidden_states is not None and cap.last_hidden_states.dtype == torch.bfloat16
    with torch.inference_mode():
        ref = v.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(cap.last_hidden_states, ref.hidden_states[-1].to(torch.bfloat16))
    torch.testing.assert_close(
        cap.hidden_states[..., :H], ref.hidden_states[2].to(torch.bfloat16), rtol=0, atol=0
    )


def _packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """One row: three documents (10, 17, 14 tokens) then 7 padding tokens."""
    lens = [10, 17, 14]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (1, 48), generator=g)
    pos = torch.zeros(1, 48, dtype=torch.long)
    doc = torch.full((1, 48), -1, dtype=torch.long)
    spans, s = [], 0
    for d, n in enumerate(lens):
        pos[0, s : s + n] = torch.arange(n)
        doc[0, s : s + n] = d
        spans.append((s, s + n))
        s += n
    pos[0, s:] = torch.arange(48 - s)  # padding positions: arbitrary, tokens are isolated
    return ids, pos, doc, spans


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_each_document_alone(tiny_dir: Path, attn: str) -> None:
    v = load_verifier(
        tiny_dir, capture_layer_ids=[0, 3], storage_dtype="float32", attn_implementation=attn
    )
    ids, pos, doc, spans = _packed_row()
    packed = v.capture(ids, pos, doc)
    assert torch.isfinite(packed.hidden_states).all()  # padding rows are not NaN
    for s, e in spans:
        n = e - s
        alone = v.capture(ids[:, s:e], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))
        # Tolerance: fp32, same kernels, different batch shapes → ≤ 1e-4 absolute.
        torch.testing.assert_close(
            packed.hidden_states[:, s:e], alone.hidden_states, rtol=0, atol=1e-4
        )
        assert torch.equal(packed.target_ids[:, s:e], alone.target_ids)


def test_packed_check_can_fail_without_document_mask(verifier: Verifier) -> None:
    # Negative control: same positions but one document id for the whole row lets
    # documents 2 and 3 see earlier documents, which must change their states.
    ids, pos, _doc, spans = _packed_row()
    leaky = verifier.capture(ids, pos, torch.zeros_like(ids))
    s, e = spans[1]
    alone = verifier.capture(
        ids[:, s:e], torch.arange(e - s)[None], torch.zeros(1, e - s, dtype=torch.long)
    )
    assert (leaky.hidden_states[:, s:e] - alone.hidden_states).abs().max() > 1e-3


def test_full_attention_packed_mask_against_loop_reference() -> None:
    """The full-attention rule's mask keeps attention causal inside each document; −1
    (padding) attends only to itself, so no query row is empty (NaN in softmax)."""
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(-1, 3, (2, 12), generator=g).sort(dim=1).values.flip(1)  # runs + padding
    mask = PackingRule((FULL,)).masks(doc, doc)
    assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 12, 12)
    for b in range(2):
        for q in range(12):
            for k in range(12):
                want = q == k or (k < q and doc[b, q] == doc[b, k] and doc[b, q] >= 0)
                assert bool(mask[b, 0, q, k]) == want, (b, q, k)


def test_capture_rejects_mismatched_shapes(verifier: Verifier) -> None:
    ids, pos, doc = _single_doc(1, 8)
    with pytest.raises(ValueError, match="position_ids shape"):
        verifier.capture(ids, pos[:, :4], doc)


def test_real_qwen3_vocab(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir), local_files_only=True)
    d = tiny_qwen3_verifier(tmp_path / "v", len(tok), num_layers=4, tie_word_embeddings=True)
    v = load_verifier(d, capture_layer_ids=[1, 2], chunk_tokens=16)
    assert v.vocab_size == len(tok) == 151669
    msgs = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello there."}]
    row = torch.tensor([tok.apply_chat_template(msgs, tokenize=True, return_dict=False)])
    t = row.shape[1]
    cap = v.capture(row, torch.arange(t)[None], torch.zeros(1, t, dtype=torch.long))
    with torch.inference_mode():
        full = v.model(input_ids=row).logits.argmax(-1).to(torch.int32)
    assert torch.equal(cap.target_ids, full)


def test_contract_fields_build_a_contract(verifier: Verifier) -> None:
    c = CaptureContract(
        **verifier.contract_fields(),
        dataset_fingerprint="d",
        tokenizer_fingerprint="t",
        seq_len=64,
        window_rows=4,
        shuffle_seed=0,
    )
    assert c.target_layer_ids == (0, 2, 5) and c.hidden_size == H and c.vocab_size == VOCAB


# --------------------------------------------------------------------------- identity


def test_fingerprint_stable_across_copies_and_changes_with_one_weight(
    tiny_dir: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "copy"))
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_dir)
    assert config_hash(copy) == config_hash(tiny_dir)
    f = copy / "model.safetensors"
    tensors = load_file(f)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name].view(-1)[3] += 1e-3  # one weight
    save_file(tensors, f, metadata={"format": "pt"})
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_dir)


def test_sampled_fingerprint_sees_header_and_retraining(tiny_dir: Path, tmp_path: Path) -> None:
    # full_hash_bytes=0 forces the large-file path (header + sampled ranges).
    def fp(d: Path) -> str:
        return weights_fingerprint(d, full_hash_bytes=0, samples_per_file=4, sample_bytes=4096)

    base = fp(tiny_dir)
    assert base != weights_fingerprint(tiny_dir)  # settings are part of the fingerprint
    retrained = Path(shutil.copytree(tiny_dir, tmp_path / "retrained"))
    tensors = load_file(retrained / "model.safetensors")
    save_file({k: v * 1.01 for k, v in tensors.items()}, retrained / "model.safetensors")
    assert fp(retrained) != base
    half = Path(shutil.copytree(tiny_dir, tmp_path / "half"))
    save_file({k: v.half() for k, v in tensors.items()}, half / "model.safetensors")
    assert fp(half) != base


def test_config_hash_ignores_writer_fields_and_sees_model_fields(
    tiny_dir: Path, tmp_path: Path
) -> None:
    d = Path(shutil.copytree(tiny_dir, tmp_path / "c"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["transformers_version"] = "0.0.1"
    (d / "config.json").write_text(json.dumps(cfg, indent=4))
    assert config_hash(d) == config_hash(tiny_dir)
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg))
    assert config_hash(d) != config_hash(tiny_dir)


# --------------------------------------------------------------------------- load errors


def test_load_errors_name_the_path_and_the_problem(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_verifier(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        load_verifier(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"empty: config.json is missing"):
        load_verifier(empty)
    bad = Path(shutil.copytree(tiny_dir, tmp_path / "bad"))
    (bad / "config.json").write_text('{\n  "model_type": "qwen3",\n  oops\n}')
    with pytest.raises(ConfigError, match=r"config.json:3: invalid JSON"):
        load_verifier(bad)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(tiny_dir / "config.json", noweights / "config.json")
    with pytest.raises(ConfigError, match="no weight files"):
        load_verifier(noweights)
    unknown = Path(shutil.copytree(tiny_dir, tmp_path / "unknown"))
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_type"] = "not_a_real_model"
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="cannot load"):
        load_verifier(unknown)
    with pytest.raises(ConfigError, match="out of range"):
        load_verifier(tiny_dir, capture_layer_ids=[0, 6])
    with pytest.raises(ConfigError, match="chunk_tokens"):
        load_verifier(tiny_dir, chunk_tokens=0)
