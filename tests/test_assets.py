"""The project's own demo assets: corpus, BPE tokenizer with chat template, tiny trained Qwen3, cache.

.venv/bin/pytest tests/test_assets.py -x -q
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from fanout.bench.assets import (
    MASK_TOKEN,
    AssetSettings,
    DemoAssets,
    ensure_demo_assets,
    generate_corpus,
    render_chatml,
    tiny_qwen3_verifier,
)

# Small enough for 2 shared cores (~10 s), big enough that training visibly helps.
SMALL = AssetSettings(n_conversations=600, vocab_size=512, train_steps=30, seq_len=64)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return ensure_demo_assets(tmp_path_factory.mktemp("cache"), SMALL)


def test_corpus_is_deterministic_and_well_formed(tmp_path: Path) -> None:
    a = generate_corpus(50, seed=3, out_path=tmp_path / "c.jsonl")
    assert a == generate_corpus(50, seed=3)
    assert a != generate_corpus(50, seed=4)
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == a
    for conv in a:
        roles = [m["role"] for m in conv["messages"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(isinstance(m["content"], str) and m["content"] for m in conv["messages"])


def test_corpus_answers_are_correct() -> None:
    # The structure must be learnable: answers follow from questions (spot-check arithmetic).
    for conv in generate_corpus(200, seed=0):
        for q, a in zip(conv["messages"][-2::-2], conv["messages"][::-2]):
            if q["content"].startswith("What is ") and q["content"][8].isdigit():
                lhs, rhs = a["content"].rstrip(".").split(" = ")
                x, op, y = lhs.split(" ")
                want = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
                assert int(rhs) == want


def test_tokenizer_chat_template_renders_and_round_trips(assets: DemoAssets) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.tokenizer_dir), local_files_only=True)
    corpus = generate_corpus(40, seed=11)  # unseen conversations
    for conv in corpus:
        text = cast(str, tok.apply_chat_template(conv["messages"], tokenize=False))
        assert text == render_chatml(conv["messages"])
        ids = cast(
            list[int],
            tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False),
        )
        assert tok.decode(ids) == text
        for m in conv["messages"]:
            enc = tok.encode(m["content"], add_special_tokens=False)
            assert tok.decode(enc) == m["content"]
    gen = cast(
        str,
        tok.apply_chat_template(
            corpus[0]["messages"][:1], tokenize=False, add_generation_prompt=True
        ),
    )
    assert gen.endswith("<|im_start|>assistant\n")
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == assets.mask_token_id
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Assistant mask via the template's generation tags covers exactly the answers.
    out: Any = tok.apply_chat_template(
        corpus[0]["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    msgs = corpus[0]["messages"]
    answers = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
    assert tok.decode(masked) == answers


def _heldout_loss(model: torch.nn.Module, tokenizer_dir: Path) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids: list[int] = []
    for conv in generate_corpus(60, seed=123):
        ids += cast(
            list[int],
            tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False),
        )
    rows = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
    with torch.inference_mode():
        return float(model(input_ids=rows, labels=rows).loss)


def test_trained_verifier_loads_and_beats_untrained(assets: DemoAssets, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(assets.verifier_dir), local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    report = json.loads((assets.verifier_dir / "training.json").read_text())
    assert report["final_loss"] < report["first_loss"]
    vocab = model.config.vocab_size
    untrained_dir = tiny_qwen3_verifier(tmp_path / "u", vocab, intermediate_size=192)
    untrained = AutoModelForCausalLM.from_pretrained(str(untrained_dir), local_files_only=True)
    trained_loss = _heldout_loss(model, assets.tokenizer_dir)
    untrained_loss = _heldout_loss(untrained, assets.tokenizer_dir)
    assert untrained_loss == pytest.approx(math.log(vocab), rel=0.05)
    assert trained_loss < 0.7 * untrained_loss


def test_cache_reuses_and_keys_on_settings(assets: DemoAssets) -> None:
    marker = assets.root / "assets.json"
    before = marker.stat().st_mtime_ns
    weights = (assets.verifier_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    again = ensure_demo_assets(assets.root.parent, SMALL)
    assert time.monotonic() - t0 < 5.0  # generous: a rebuild trains for several seconds
    assert again == assets
    assert marker.stat().st_mtime_ns == before
    assert (assets.verifier_dir / "model.safetensors").stat().st_mtime_ns == weights
    other = AssetSettings(n_conversations=600, vocab_size=512, train_steps=31, seq_len=64)
    assert other.fingerprint() != SMALL.fingerprint()
    assert not any(p.name.startswith(".tmp-") for p in assets.root.parent.iterdir())
    manifest = json.loads(marker.read_text())
    assert manifest["settings"]["train_steps"] == SMALL.train_steps
    assert manifest["training"]["final_loss"] > 0


def test_incomplete_cache_dir_is_rebuilt(tmp_path: Path) -> None:
    tiny = AssetSettings(n_conversations=80, vocab_size=300, train_steps=2, seq_len=32)
    debris = tmp_path / f"demo-assets-{tiny.fingerprint()}"
    debris.mkdir()
    (debris / "half-written").write_text("x")  # no assets.json: a crashed build
    a = ensure_demo_assets(tmp_path, tiny)
    assert (a.root / "assets.json").is_file() and not (a.root / "half-written").exists()
    assert a.data_path.is_file() and (a.verifier_dir / "config.json").is_file()


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="train_steps"):
        AssetSettings(train_steps=0)
    with pytest.raises(ValueError, match="num_layers"):
        AssetSettings(num_layers=2)
