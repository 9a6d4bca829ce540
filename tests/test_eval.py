"""`fanout eval` and the speculative decoder: lossless against plain greedy, τ measured.

The decoder's bookkeeping (acceptance, KV-cache roll-back, context growth) is checked
with scripted drafts whose proposals are known to be right for exactly m slots, so
the acceptance lengths are known in advance; real drafts (untrained and trained) are
checked for the defining property: output identical to greedy, token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus, tiny_qwen3_verifier, write_jsonl
from fanout.checkpoints.save import save_checkpoint
from fanout.decode.eval import tau_interval
from fanout.decode.eval_table import table
from fanout.decode.spec_decode import Decoder, DecodeResult, first_mismatch
from fanout.errors import CheckpointError
from fanout.families.dflash.model import DFlashDraft
from fanout.model.draft_cache import DraftCache, IndependentSlots, UncachedDraft
from fanout.model.draft_config import DraftConfig
from fanout.model.sampling import Sampling
from fanout.model.verifier import load_verifier
from fanout.ops.adamw import make_optimizer
from forked_cli import ForkedPopen
from greedy_training import EOS
from greedy_training import decoder as decoder
from greedy_training import vdir as vdir
from tiny_run import build_tiny_assets, one_thread  # noqa: F401 (one_thread: autouse)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ScriptedDraft(IndependentSlots):
    """Proposes the verifier's own greedy continuation with slot `right + 1` wrong, so
    every verify step must accept exactly `right` drafts (fewer only near the end). It is
    its own draft context (`context=`): it records the context length at every block."""

    def __init__(self, greedy: list[int], prompt_len: int, block_size: int, right: int) -> None:
        self.cfg = DraftConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=256, mask_token_id=EOS,
            target_layer_ids=[1, 3], block_size=block_size,
        )  # fmt: skip
        self.seq, self.p0, self.right = greedy, prompt_len, right
        self.contexts: list[int] = []
        self.length = 0

    def extend(self, hidden: torch.Tensor) -> None:
        assert hidden.shape[1] == 2 * 32
        self.length += hidden.shape[0]

    def logits(self, seq: list[int]) -> torch.Tensor:
        p = self.length  # context covers positions 0..p-1
        assert p == len(seq) - 1
        self.contexts.append(p)
        j = p - self.p0 + 1  # index in `greedy` of the token after the anchor
        out = []
        for k in range(self.cfg.block_size - 1):
            t = self.seq[j + k] if j + k < len(self.seq) else 0
            out.append(t if k < self.right else (t + 1) % 250)
        return torch.nn.functional.one_hot(torch.tensor(out), 256).float()


@pytest.mark.parametrize(("block_size", "right"), [(4, 0), (4, 3), (8, 2), (16, 5), (16, 15)])
def test_scripted_acceptance_and_rollback(decoder: Decoder, block_size: int, right: int) -> None:
    prompt = _prompt(11, seed=block_size + right)
    dec = Decoder(decoder.verifier, set())  # no EOS: the full length is decoded
    greedy = dec.greedy(prompt, 60)
    draft = ScriptedDraft(greedy.tokens, len(prompt), block_size, right)
    spec = dec.speculative(prompt, draft, 60, context=draft)  # type: ignore[arg-type]
    assert first_mismatch(greedy.tokens, spec.tokens) is None
    assert all(n == right for n in spec.accepted[:-1])  # the last may be cut by the end
    assert spec.acceptance_length == pytest.approx(
        sum(n + 1 for n in spec.accepted) / len(spec.accepted)
    )
    assert spec.forwards == len(spec.accepted) < greedy.forwards or right == 0
    # the context grows by exactly the accepted tokens + the anchor each step
    steps = [b - a for a, b in zip(draft.contexts, draft.contexts[1:])]
    assert steps == [n + 1 for n in spec.accepted[:-1]]
    pos = spec.position_accepted()
    assert len(pos) == block_size - 1 and pos[0] == sum(1 for n in spec.accepted if n >= 1)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_untrained_drafts_lossless_and_tau_near_one(
    decoder: Decoder, vdir: Path, block_size: int
) -> None:
    torch.manual_seed(block_size)
    draft = DFlashDraft.from_verifier(
        vdir, target_layer_ids=[1, 3], block_size=block_size, mask_token_id=EOS
    )
    taus = []
    for n, seed in ((3, 0), (17, 1), (64, 2)):
        prompt = _prompt(n, seed)
        g = decoder.greedy(prompt, 40)
        s = decoder.speculative(prompt, draft, 40)
        assert first_mismatch(g.tokens, s.tokens) is None, (n, g.tokens, s.tokens)
        taus.append(s.acceptance_length)
    assert 1.0 <= sum(taus) / len(taus) < 1.3


def test_eos_stops_both_at_the_same_token(vdir: Path, decoder: Decoder) -> None:
    prompt = _prompt(9, 5)
    free = Decoder(decoder.verifier, set()).greedy(prompt, 30).tokens
    eos = free[4]  # a token greedy emits early: treat it as EOS
    dec = Decoder(decoder.verifier, {eos})
    g = dec.greedy(prompt, 30)
    draft = ScriptedDraft(free, len(prompt), 8, 7)  # proposes right through the EOS
    s = dec.speculative(prompt, draft, 30, context=draft)  # type: ignore[arg-type]
    assert g.tokens == s.tokens == free[: free.index(eos) + 1]


def _train_on_greedy(vdir: Path, decoder: Decoder, block_size: int) -> DFlashDraft:
    """A draft trained on the verifier's own greedy continuations of random prompts."""
    torch.manual_seed(0)
    draft = DFlashDraft.from_verifier(
        vdir, target_layer_ids=[1, 3], block_size=block_size, mask_token_id=EOS, max_anchors=32
    )
    v = decoder.verifier
    rows = []
    for seed in range(12):
        prompt = _prompt(6, 100 + seed)
        rows.append(prompt + Decoder(v, set()).greedy(prompt, 58).tokens)
    ids = torch.tensor(rows)  # [12, 64]
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    cap = v.capture(ids, pos, doc)
    hs = cap.hidden_states.float()  # [B, T, 3·H] for layers 1, 2, 3
    h = 32
    batch = {
        "hidden_states": torch.cat([hs[..., 0:h], hs[..., 2 * h : 3 * h]], dim=-1),
        "input_ids": ids,
        "target_ids": cap.target_ids.long(),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8),
        "document_ids": doc,
        "position_ids": pos,
    }
    opt, _ = make_optimizer(draft.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        out = draft.loss(batch, gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return draft.eval()


def test_trained_draft_is_lossless_and_accepts(vdir: Path, decoder: Decoder) -> None:
    draft = _train_on_greedy(vdir, decoder, 4)
    dec = Decoder(decoder.verifier, set())
    taus = []
    for seed in range(3):
        prompt = _prompt(6, 100 + seed)  # prompts it trained on: acceptance must show
        g = dec.greedy(prompt, 40)
        s = dec.speculative(prompt, draft, 40)
        assert first_mismatch(g.tokens, s.tokens) is None
        taus.append(s.acceptance_length)
        # the cached draft loop against the uncached reference: same tokens, same steps
        ref = dec.speculative(prompt, draft, 40, cache_draft=False)
        assert (ref.tokens, ref.accepted) == (s.tokens, s.accepted)
        for rule in ("served", "sampled_draft"):
            hot = [
                dec.speculative(prompt, draft, 40, Sampling(1.0, top_k=8),
                                torch.Generator().manual_seed(seed), rule, cache_draft=c)
                for c in (True, False)
            ]  # fmt: skip
            assert (hot[0].tokens, hot[0].accepted) == (hot[1].tokens, hot[1].accepted)
    assert sum(taus) / len(taus) > 1.3, taus


def test_cached_draft_with_a_draft_vocabulary(decoder: Decoder, vdir: Path) -> None:
    torch.manual_seed(3)
    keep = torch.randperm(256)[:64]
    draft = DFlashDraft.from_verifier(
        vdir, target_layer_ids=[1, 3], block_size=8, mask_token_id=EOS,
        draft_vocab_size=64, draft_vocab_ids=keep,
    )  # fmt: skip
    ctx = DraftCache(draft)
    ref = UncachedDraft(draft)
    hidden = torch.randn(9, 64)
    for c in (ctx, ref):
        c.extend(hidden[:5])
        c.extend(hidden[5:])  # two appends = one context of 9 positions
    a, b = ctx.logits(list(range(10))), ref.logits(list(range(10)))  # [7, 256]
    assert torch.allclose(a, b, atol=1e-5)
    outside = torch.ones(256, dtype=torch.bool)
    outside[keep] = False
    assert torch.isinf(a[:, outside]).all() and torch.isfinite(a[:, keep]).all()
    prompt = _prompt(12, 4)
    g = decoder.greedy(prompt, 30)
    s = decoder.speculative(prompt, draft, 30)
    assert first_mismatch(g.tokens, s.tokens) is None


def test_cached_draft_grows_its_buffers_and_its_scratch_never_leaks(vdir: Path) -> None:
    """Capacity 4, a block of 8: every block's scratch rows and most extends cross the
    buffer's end, and every step's logits must still equal the reference's — a scratch row
    left in the context, or rows lost in a growth, would change them."""
    torch.manual_seed(5)
    draft = DFlashDraft.from_verifier(vdir, target_layer_ids=[1, 3], block_size=8,
                                      mask_token_id=EOS)  # fmt: skip
    ctx, ref = DraftCache(draft, capacity=4), UncachedDraft(draft)
    hidden = torch.randn(40, draft.fc.in_features)  # [p, k·H]
    at = 0
    for n in (3, 1, 5, 2, 8, 1, 7, 4, 6, 3):  # accepted positions per step, as a decode
        for c in (ctx, ref):
            c.extend(hidden[at : at + n])
        at += n
        a, b = ctx.logits(list(range(at + 1))), ref.logits(list(range(at + 1)))
        assert torch.allclose(a, b, atol=1e-5), at
    assert ctx.length == at and ctx.k[0].shape[2] >= at


# ---- the command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evalcli")
    corpus = generate_corpus(60, seed=3)
    _, tok, ver = build_tiny_assets(root, corpus)
    held = write_jsonl(root / "held.jsonl", generate_corpus(6, seed=99))
    torch.manual_seed(0)
    drafts = {}
    for bs in (4, 8):
        d = DFlashDraft.from_verifier(ver, target_layer_ids=[1, 2], block_size=bs)
        opt, _ = make_optimizer(d.parameters(), lr=1e-3)
        drafts[f"b{bs}"] = save_checkpoint(
            root / "drafts" / f"b{bs}", d, opt, {"step": 1}, verifier_name_or_path=str(ver),
            config_extra={"train_eal": 1.5},
        )  # fmt: skip
    return {"root": root, "data": held, "tok": tok, "ver": ver, **drafts}


def _eval(chat_run: dict[str, Path], *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "fanout.cli", "eval",
        "--verifier-name-or-path", str(chat_run["ver"]), "--tokenizer", str(chat_run["tok"]),
        "--data", str(chat_run["data"]), "--num-prompts", "3", "--max-new-tokens", "24",
        *extra,
    ]  # fmt: skip
    # one intra-op thread, as `one_thread` gives the in-process tests: on 2 shared cores
    # a second thread only stalls on the other's load
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def test_cli_reports_tau_and_lossless(chat_run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    r = _eval(
        chat_run,
        "--draft", str(chat_run["b4"]),
        "--draft", str(chat_run["root"] / "drafts" / "b8"),  # a save path: newest checkpoint
        "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["lossless"] is True and rep["prompts"] == 3
    for name, bs in (("b4", 4), ("b8", 8)):
        d = rep["drafts"][name]
        assert d["block_size"] == bs, rep["drafts"]
        assert d["train_eal"] == 1.5
        assert 1.0 <= d["acceptance_length"] <= bs
        assert len(d["per_position_acceptance"]) == bs - 1
        assert d["speedup_vs_greedy"] > 0
    assert "lossless" in r.stdout and "b8" in r.stdout
    assert rep["temperatures"] == ["0.0"]  # the default: greedy only
    # the header gives the cap; the table what was generated, and a verdict on τ
    lines = r.stdout.splitlines()
    assert "3 prompts" in lines[0] and "up to 24 new tokens each" in lines[0], lines[0]
    g = rep["generated_tokens"]
    assert len(g) == 3 and all(1 <= n <= 24 for n in g)
    early = sum(n < 24 for n in g)
    assert (
        f"generated: mean {sum(g) / 3:.1f} ({min(g)}–{max(g)}) new tokens per prompt "
        f"(greedy; {early} of 3 stopped" in r.stdout
    ), r.stdout
    [verdict] = [x for x in lines if x.startswith("verdict at T=0.0: ")]
    (lo4, hi4), (lo8, hi8) = (rep["drafts"][n]["acceptance_length_ci95"] for n in ("b4", "b8"))
    if lo4 <= hi8 and lo8 <= hi4:
        assert verdict.endswith("intervals overlap, no difference shown"), verdict
    else:
        assert ("b4 wins" if lo4 > hi8 else "b8 wins") in verdict, verdict
    assert (
        rep["drafts"]["b4"]["at_temperature"]["0.0"]["acceptance_length"]
        == (rep["drafts"]["b4"]["acceptance_length"])
    )


def test_cli_temperatures_records_and_model_card(chat_run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    r = _eval(
        chat_run, "--draft", str(chat_run["b4"]), "--temperature", "1", "0.5",
        "--top-k", "20", "--model-card", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["temperatures"] == ["0.0", "0.5", "1.0"]  # 0 always: the lossless check
    d = rep["drafts"]["b4"]
    for t in rep["temperatures"]:
        f = d["at_temperature"][t]
        assert 1.0 <= f["acceptance_length"] <= 4 and len(f["per_position_acceptance"]) == 3
        assert f["speedup_vs_greedy"] > 0 and f["verify_steps"] > 0
        ci = f["acceptance_length_ci95"]
        assert ci[0] <= f["acceptance_length"] <= ci[1]
        assert ("acceptance_length_sampled_draft" in f) == (t != "0.0")
    # records: an outside decoder can replay every verify step
    recs = rep["prompt_records"]
    assert [x["prompt_tokens"] for x in recs] == rep["prompt_tokens"]
    for x in recs:
        for t, e in x["drafts"]["b4"].items():
            runs = [e, e["sampled_draft"]] if t != "0.0" else [e]
            for run in runs:
                # the prefill's token, then n + 1 per verify step (the last may be cut)
                assert 1 + sum(n + 1 for n in run["accepted"]) >= len(run["tokens"])
        assert x["drafts"]["b4"]["0.0"]["tokens"] == x["greedy"]
    steps = sum(len(x["drafts"]["b4"]["1.0"]["accepted"]) for x in recs)
    assert steps == d["at_temperature"]["1.0"]["verify_steps"]
    card = (chat_run["b4"] / "README.md").read_text()
    assert "[2, 3]" in card  # layers 1, 2 in HF numbering
    assert "| 1.0 | served (greedy draft) |" in card and "sampled draft" in card
    assert "training steps | 1 |" in card
    (chat_run["b4"] / "README.md").unlink()


def test_tau_half_width_decodes_until_every_interval_is_that_narrow(
    chat_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tau-half-width W: past --num-prompts the eval goes on (--num-prompts 2: a check
    after every prompt) and stops at the first count where every draft's τ interval at
    every temperature is at most ±W, checked against widths recomputed from the records
    of a run over every prompt. The stopping rule is what is tested, so the decodes are
    replaced by seeded accepted counts (the tiny untrained drafts accept nothing: τ = 1
    exactly, an interval of width 0)."""
    import random

    from fanout.decode.config import EvalConfig
    from fanout.decode.eval import EvalSession, Job, load_drafts

    def fake(self: EvalSession, job: Job, p: Any, drafts: dict) -> DecodeResult:
        name, t, rule = job
        rng = random.Random(f"{p.index} {name} {t} {rule}")
        accepted = [rng.choice([0, 0, 1, 3]) for _ in range(rng.randint(2, 6))]
        tokens = list(range(1 + sum(n + 1 for n in accepted)))
        if rule == "greedy":
            return DecodeResult(tokens, len(tokens) - 1, 0.01)
        return DecodeResult(tokens, len(accepted), 0.01, accepted, 4)

    monkeypatch.setattr(EvalSession, "_decode", fake)
    cfg = EvalConfig(
        verifier_name_or_path=str(chat_run["ver"]), tokenizer=str(chat_run["tok"]),
        data=str(chat_run["data"]), draft=[str(chat_run["b4"]), str(chat_run["b8"])],
        num_prompts=2, max_prompts=6, tau_half_width=1e-9, temperature=[0, 1],
    )  # fmt: skip
    _, drafts, eals = load_drafts(cfg)
    session = EvalSession(cfg, [1, 2])
    rep = session.run(drafts, eals)
    n = rep["prompts"]
    assert n == rep["precision"]["prompts_available"] >= 4, rep["precision"]
    assert rep["precision"]["met"] is False
    assert any("NOT met" in line for line in table(rep))

    def widest(k: int) -> float:  # every draft and temperature, the first k prompts
        hw = []
        for name in drafts:
            for t in ("0.0", "1.0"):
                rs = [DecodeResult(x["drafts"][name][t]["tokens"], 0, 0.0,
                                   x["drafts"][name][t]["accepted"])
                      for x in rep["prompt_records"][:k]]  # fmt: skip
                lo, hi = tau_interval(rs) or (0.0, float("inf"))
                hw.append((hi - lo) / 2)
        return max(hw)

    widths = {k: widest(k) for k in range(2, n + 1)}
    assert widths[n] == pytest.approx(rep["precision"]["widest_half_width"])
    assert len(set(widths.values())) > 1, widths  # the counts do vary: a real choice
    for target in sorted(set(widths.values())):
        session.cfg = cfg.model_copy(update={"tau_half_width": target})
        got = session.run(drafts, eals)
        expected = next(k for k in range(2, n + 1) if widths[k] <= target)
        assert got["prompts"] == expected and got["precision"]["met"] is True, (widths, target)
        assert got["prompt_records"] == rep["prompt_records"][:expected]  # same prompts, in order
        assert any("met" in line for line in table(got))
    session.cfg = cfg.model_copy(update={"tau_half_width": None})
    capsys.readouterr()
    assert session.run(drafts, eals)["prompts"] == 2  # without it: exactly --num-prompts
    assert capsys.readouterr().err == ""  # no bar unless asked (a trainer's periodic eval)
    # progress=True (fanout demo, `fanout eval` on a terminal): a bar, a tick per prompt
    session.cfg = cfg.model_copy(update={"tau_half_width": 1e-9})
    assert session.run(drafts, eals, progress=True)["prompts"] == n
    err = capsys.readouterr().err
    assert "eval: " in err and f"{n}/{n} " in err, err


def _failed_eval(chat_run: dict[str, Path], *extra: str) -> tuple[int, str]:
    """`fanout eval` forked from the warm forkserver (forked_cli: a real process without
    its own seven-fold interpreter start-up and imports); (exit code, its stdout and
    stderr, both written to one log)."""
    logs = chat_run["root"] / "failed-evals"
    logs.mkdir(exist_ok=True)
    log = logs / f"{len(list(logs.iterdir()))}.log"
    argv = [
        "eval", "--verifier-name-or-path", str(chat_run["ver"]), "--tokenizer",
        str(chat_run["tok"]), "--data", str(chat_run["data"]), "--num-prompts", "3",
        "--max-new-tokens", "24", *extra,
    ]  # fmt: skip
    return ForkedPopen(argv, log).wait(600), log.read_text()


def _one_line_error(r: tuple[int, str], *needles: str) -> None:
    code, out = r
    assert code == 1, out
    assert "Traceback" not in out
    err = [x for x in out.splitlines() if "error" in x]
    assert len(err) == 1 and all(n in err[0] for n in needles), out


def test_cli_named_errors(chat_run: dict[str, Path], tmp_path: Path) -> None:
    other = tiny_qwen3_verifier(tmp_path / "v48", 512, hidden_size=48, num_layers=4, head_dim=8)
    cfg = json.loads((chat_run["b4"] / "config.json").read_text())
    r = _failed_eval(
        chat_run, "--draft", str(chat_run["b4"]), "--verifier-name-or-path", str(other)
    )
    _one_line_error(r, "hidden_size = 32 but verifier")
    r = _failed_eval(chat_run, "--draft", str(tmp_path / "nothing"))
    _one_line_error(r, "--draft", "neither a checkpoint dir")
    old = tmp_path / "old"
    old.mkdir()
    for f in chat_run["b4"].iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg["fanout"]["format_version"] = 1
    (old / "config.json").write_text(json.dumps(cfg))
    r = _failed_eval(chat_run, "--draft", str(old))
    _one_line_error(r, "format 1")
    (old / "config.json").write_text(
        json.dumps(cfg | {"fanout": cfg["fanout"] | {"format_version": 2}})
    )
    (old / "model.safetensors").unlink()
    r = _failed_eval(chat_run, "--draft", str(old))
    _one_line_error(r, "model.safetensors: missing")
    r = _failed_eval(
        chat_run, "--draft", str(chat_run["b4"]), "--data", str(tmp_path / "none.jsonl")
    )
    _one_line_error(r, "--data")
    r = _failed_eval(chat_run, "--draft", str(chat_run["b4"]), "--temperature", "-1")
    _one_line_error(r, "--temperature", "must be >= 0")
    r = _failed_eval(chat_run, "--draft", str(chat_run["b4"]), "--tau-half-width", "0.1",
                     "--max-prompts", "2")  # fmt: skip
    _one_line_error(r, "--max-prompts 2 is below --num-prompts 3")


def test_layer_mismatch_is_named(chat_run: dict[str, Path], tmp_path: Path) -> None:
    from fanout.checkpoints.load import load_draft

    shallow = tiny_qwen3_verifier(tmp_path / "v2", 512, hidden_size=32, num_layers=2, head_dim=8)
    with pytest.raises(CheckpointError, match=r"decoder layers \[1, 2\]\) do not exist"):
        load_draft(chat_run["b4"], shallow)


def test_every_eval_field_has_a_flag(tmp_path: Path) -> None:
    import argparse

    from fanout.decode.config import EvalConfig
    from fanout.decode.eval import add_arguments
    from fanout.flags import flag_name, model_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = {s for a in p._actions for s in a.option_strings}
    renamed = {"json_out": "--json"}
    for field in EvalConfig.model_fields:
        assert renamed.get(field, flag_name(field)) in opts, field
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"role_map": {"bot": "assistant"}, "num_prompts": 2}))
    args = p.parse_args(
        ["--config", str(conf), "--verifier-name-or-path", str(tmp_path), "--tokenizer",
         str(tmp_path), "--data", str(conf), "--draft", "a", "b", "--draft", "c", "--json", "o"]
    )  # fmt: skip
    cfg = model_from_args(EvalConfig, args)
    assert cfg.draft == ["a", "b", "c"] and cfg.json_out == "o"
    assert cfg.role_map == {"bot": "assistant"} and cfg.num_prompts == 2
    args = p.parse_args(
        ["--config", str(conf), "--verifier-name-or-path", str(tmp_path), "--tokenizer",
         str(tmp_path), "--data", str(conf), "--draft", "a", "--role-map", "gpt=assistant"]
    )  # fmt: skip
    assert model_from_args(EvalConfig, args).role_map == {"gpt": "assistant"}  # flag wins


def _result(accepted: list[int], decode_s: float, bs: int = 4) -> DecodeResult:
    tokens = 1 + sum(n + 1 for n in accepted)
    return DecodeResult(
        list(range(tokens)), len(accepted), decode_s + 0.5, accepted, bs, prefill_seconds=0.5
    )


def test_tau_interval_by_hand() -> None:

    assert tau_interval([_result([1, 2], 1.0)]) is None  # one prompt: no interval
    same = tau_interval([_result([1, 2], 1.0)] * 3)
    assert same == [2.5, 2.5]  # no spread between prompts
    rs = [_result([3, 3], 1.0), _result([0, 0, 0, 0], 1.0)]  # τ = (8 + 4) / 6 = 2
    # residuals a_i - τ s_i = 4, -4; var = 2/1 · 32 = 64; half = 1.96 · 8 / 6
    half = 1.96 * 8 / 6
    assert tau_interval(rs) == [round(2 - half, 4), round(2 + half, 4)]


def test_speedup_beyond_tau_is_flagged() -> None:
    from fanout.decode.eval import _summary

    greedy = [_result([], 10.0, bs=0)]
    greedy[0].tokens = list(range(9))  # 8 decoded tokens in 10 s
    fast = [_result([1, 1, 1, 1], 1.0)]  # τ 2, 8 tokens in 1 s: 10x "faster"
    d = _summary({(0.0, "served"): fast}, greedy, None, "dflash")
    assert d["acceptance_length"] == 2.0 and d["speedup_vs_greedy"] == pytest.approx(10.0)
    assert d["speedup_exceeds_tau"] is True
    rep = {"drafts": {"b4": d}, "greedy_tokens_per_s": 0.8, "hardware": "cpu",
           "lossless": True, "mismatches": [], "generated_tokens": [9],
           "config": {"max_new_tokens": 32}}  # fmt: skip
    lines = table(rep)
    assert any("exceeds τ" in line for line in lines)
    assert "generated: mean 9.0 (9–9) new tokens per prompt (greedy; 1 of 1 stopped" in lines[-2]
    assert not any(line.startswith("verdict") for line in lines)  # one draft: nothing to compare
    honest = _summary({(0.0, "served"): [_result([1, 1, 1, 1], 6.0)]}, greedy, None, "dflash")
    assert honest["speedup_exceeds_tau"] is False


def test_table_says_why_a_draft_decodes_slower_than_greedy() -> None:
    """Issue 45 (demo): at T = 1 every demo draft decoded slower than greedy and nothing
    said why; the table now says it once per temperature where any speed-up is below 1,
    and not where none is."""
    from fanout.decode.eval import _summary

    greedy = [_result([], 10.0, bs=0)]
    greedy[0].tokens = list(range(9))  # 8 decoded tokens in 10 s
    rep = {"drafts": {}, "greedy_tokens_per_s": 0.8, "hardware": "cpu", "lossless": True,
           "mismatches": [], "generated_tokens": [9], "config": {"max_new_tokens": 32}}  # fmt: skip
    fast, slow_run = _result([1, 1], 2.0), _result([1, 1, 1, 1], 20.0)
    slow = _summary({(0.0, "served"): [fast], (1.0, "served"): [slow_run]}, greedy, None,
                    "dflash")  # fmt: skip
    assert slow["at_temperature"]["1.0"]["speedup_vs_greedy"] < 1
    rep["drafts"] = {"b4": slow}
    notes = [x for x in table(rep) if "speed-up below 1" in x]
    assert len(notes) == 1 and "T=1.0" in notes[0] and "T=0.0" not in notes[0]
    assert "verify step" in notes[0]
    rep["drafts"] = {"b4": _summary({(0.0, "served"): [fast], (1.0, "served"): [fast]},
                                    greedy, None, "dflash")}  # fmt: skip
    assert not any("speed-up below 1" in x for x in table(rep))


def test_table_bs_is_the_trained_block_and_verify_the_verify_width() -> None:
    """Issue 45.7: `bs` is the block size the draft was trained with, as the JSON's
    `block_size`; `verify` is the tokens one verify forward checks (JSON `verify_width`),
    which the family decides, explained under the table where the two differ. An EAGLE-3
    chain trained with 3 TTT steps (block_size 4) and served with
    --num-speculative-tokens 5 verifies 6; a DSpark draft of block 4 drafts 4, verifies 5;
    a DFlash draft of block 4 drafts 3, verifies 4."""
    from fanout.decode.eval import _summary

    greedy = [_result([], 10.0, bs=0)]
    chain = _result([1, 5, 0], 1.0)
    chain.drafted = 5
    spark = _result([1, 3], 1.0)
    spark.drafted = 4
    drafts = {
        "e3": _summary({(0.0, "served"): [chain]}, greedy, None, "eagle3"),
        "ds": _summary({(0.0, "served"): [spark]}, greedy, None, "dspark"),
        "b4": _summary({(0.0, "served"): [_result([1, 3], 1.0)]}, greedy, None, "dflash"),
    }
    rep = {"drafts": drafts, "greedy_tokens_per_s": 0.8, "hardware": "cpu",
           "lossless": True, "mismatches": [], "generated_tokens": [9],
           "config": {"max_new_tokens": 32}}  # fmt: skip
    lines = table(rep)
    assert lines[0].split()[:4] == ["draft", "family", "bs", "verify"]
    want = {"e3": ("eagle3", 4, 6), "ds": ("dspark", 4, 5), "b4": ("dflash", 4, 4)}
    for name, (family, bs, width) in want.items():
        row = next(x for x in lines if x.startswith(name + " "))
        assert row.split()[1:4] == [family, str(bs), str(width)], row
        assert (drafts[name]["block_size"], drafts[name]["verify_width"]) == (bs, width)
    assert len(drafts["e3"]["per_position_acceptance"]) == 5  # one figure per drafted token
    assert any(x.startswith("bs: the block size each draft was trained with") for x in lines)
    rep["drafts"] = {"b4": drafts["b4"]}  # bs = verify everywhere: no explanation
    assert not any(x.startswith("bs: ") for x in table(rep))


def test_tau_verdict_by_hand() -> None:
    """The verdict rule on hand-built intervals: apart (either order), overlapping,
    touching (counts as overlap), undefined; and one line per pair and temperature."""
    from fanout.decode.eval_table import tau_verdict, verdicts

    def fig(tau: float, ci: list[float] | None) -> dict[str, Any]:
        return {"acceptance_length": tau, "acceptance_length_ci95": ci}

    low, high = fig(2.0, [1.8, 2.2]), fig(3.0, [2.7, 3.3])
    assert tau_verdict("a", low, "b", high) == (
        "b", "b wins: b τ 3.00 (2.70–3.30) vs a τ 2.00 (1.80–2.20), intervals apart"
    )  # fmt: skip
    assert tau_verdict("a", high, "b", low)[0] == "a"
    winner, why = tau_verdict("a", low, "b", fig(2.3, [2.1, 2.5]))
    assert winner is None and why.endswith("intervals overlap, no difference shown")
    assert tau_verdict("a", low, "b", fig(2.4, [2.2, 2.6]))[0] is None  # touching at 2.2
    assert tau_verdict("a", low, "b", fig(2.4, [2.2001, 2.6]))[0] == "b"  # just apart
    winner, why = tau_verdict("a", fig(2.0, None), "b", high)
    assert winner is None and "no verdict" in why
    at = {"0.0": low, "1.0": low}
    rep = {"drafts": {n: {"at_temperature": at | {"1.0": f}}
                      for n, f in (("a", low), ("b", high), ("c", low))}}  # fmt: skip
    got = verdicts(rep)
    assert [x.split(":")[0] for x in got] == ["verdict at T=0.0"] * 3 + ["verdict at T=1.0"] * 3
    assert sum("wins" in x for x in got) == 2  # at T=1.0: b beats a and c; a and c tie


def test_a_verifier_tie_is_told_from_a_mismatch(vdir: Path) -> None:
    """`Decoder.tie` measures the verifier's own margin between two next tokens: two
    tokens with the same output row tie exactly (margin 0, a tie whichever forward shape
    breaks it), while greedy's choice against any other token is a real mismatch (a
    margin far beyond the rounding of the verifier's dtype)."""
    from fanout.decode.eval_table import lossless_line

    v = load_verifier(vdir, device="cpu", capture_layer_ids=[1], num_draft_layers=None)
    head = v.model.get_output_embeddings().weight  # [V, H]
    with torch.no_grad():
        head[9] = head[7]  # tokens 7 and 9: identical logits after any prefix
    dec = Decoder(v, set())
    prefix = _prompt(12, seed=3)
    same = dec.tie(prefix, 7, 9)
    assert same.margin == 0.0 and same.is_tie
    assert 0 < same.tolerance < 1e-3  # fp32: a few epsilons of the logit, no more
    chosen = dec.greedy(prefix, 1).tokens[0]
    logits = v.model(torch.tensor([prefix])).logits[0, -1]
    other = int(logits.argsort()[-5])  # the fifth choice: clearly not a tie
    apart = dec.tie(prefix, chosen, other)
    assert not apart.is_tie
    assert apart.margin == pytest.approx(float(logits[chosen] - logits[other]), abs=1e-4)

    rep: dict[str, Any] = {"lossless": True, "mismatches": [], "ties": []}
    assert lossless_line(rep).startswith("lossless: every")
    rep["ties"] = [{"draft": "d", "prompt": 4, "position": 9, "margin": 1e-6, "tolerance": 2e-5}]
    assert "1 verifier tie(s)" in lossless_line(rep) and "prompt 4" in lossless_line(rep)
    rep.update(lossless=False, mismatches=[{"draft": "d", "prompt": 1, "position": 2}])
    assert lossless_line(rep).startswith("NOT LOSSLESS: 1 mismatch(es)")
