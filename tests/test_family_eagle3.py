"""The EAGLE-3 family (fanout.families.eagle3) against speculators 0.9.0's EAGLE-3, and its
chain drafting against plain greedy decoding.

speculators' `Eagle3DraftModel` is the oracle where it is installed (those tests skip
without it):

(a) (its `PARITY` case of tests/test_speculators_parity.py)
    a fanout checkpoint (`save_checkpoint`) loads with `Eagle3DraftModel.from_pretrained`
    with no missing/unexpected keys (read through `PreTrainedModel.from_pretrained`:
    speculators' own override breaks on `output_loading_info`), no warning from any
    channel, every tensor the file's and the draft's, and every config field
    speculators' EAGLE-3 config declares beyond its base written with fanout's meaning
    (`eagle_aux_hidden_state_layer_ids` = fanout's ids + 1);
(b) with the same weights (every one moved off its init) and rows, fanout's per-step
    logits, TTT loss (per step and summed, KL and CE, decay 1 and 0.7), full accuracy
    and every parameter gradient equal speculators' `forward` (eager attention, eager
    losses, fp32 on CPU, two rows packed into one for speculators). Tolerances: logits
    atol 2e-5; losses rtol 2e-5 after undoing speculators' 1e-5 denominators (fp32 KL
    sums in another order); gradients rtol 1e-4 with atol 1e-5 of the largest entry
    (chunked head backward vs autograd); argmax-based metrics exact;
(c) decoding at T = 0 is lossless against `Decoder.greedy`, drafts k tokens a step
    (`num_speculative_tokens`, default ttt_steps), and the cache gives the reference's
    tokens and rows;
(d) bad configurations are refused in one line each.

Semantic differences from speculators (fanout's choice; the model's docstring says why),
pinned in `test_supervision_difference`:
- Supervision: fanout reads `loss_mask` at the predicted token (t+s+2) and within the
  row's document; speculators at the fed token (t+s+1, after its shift) and across the
  packed documents. The equality rows give speculators fanout's step-0 supervision as
  its mask and keep every document's first tokens unsupervised, where the two agree.
- Last hidden states: fanout's are after the verifier's final norm, speculators' before
  it (it applies `verifier_norm`); speculators gets pre-norm states and fanout
  `verifier_norm` of them.
- Rows: speculators shifts each sample before packing; fanout shifts the packed window
  and makes the one row per document boundary padding (document -1 for speculators too).
- Normalisation: fanout divides each step by its supervised count, speculators by
  count + 1e-5 (undone per step).
- Layers: fanout writes full attention; speculators' trainer defaults to a 2048-token
  sliding window (identical below 2048 tokens; the test configs are full attention).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fanout.decode.spec_decode import Decoder, first_mismatch
from fanout.errors import ConfigError
from fanout.families.eagle3 import vllm_default_layers
from fanout.families.eagle3.model import Eagle3Draft
from fanout.families.eagle3.propose import Eagle3Context
from fanout.families.registry import family, family_of_draft
from fanout.model.chain_draft import ChainDraft
from fanout.model.verifier import load_verifier
from fanout.ops.teacher_head import teacher_head
from greedy_training import fit, greedy_batch
from speculators_parity import (
    Parity,
    perturbed,
    save_drafts,
    speculators_verifier,
)

# the parity fixtures (drafts, loaded, spec: they read PARITY and SPECULATORS)
from speculators_parity import drafts as drafts
from speculators_parity import loaded as loaded
from speculators_parity import spec as spec
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

VOCAB, H, V_LAYERS = 256, 32, 4
TARGET_LAYERS = [0, 1, 2]  # three auxiliary layers, as EAGLE-3 reads
ROPE_THETA, RMS_EPS = 1e6, 1e-5
T = 24
EPS_DEN = 1e-5  # speculators' loss_function adds this to the supervised count


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`eagle_verifier` (P-EAGLE's and MTP's tests import this fixture too)."""
    return eagle_verifier(tmp_path_factory.mktemp("eagle3"))


def eagle_verifier(root: Path) -> Path:
    """Tiny Qwen3 speculators loads without a warning (`speculators_verifier`; P-EAGLE's
    and MTP's tests use it too)."""
    return speculators_verifier(root, VOCAB, H, V_LAYERS, ROPE_THETA, RMS_EPS)


def _draft(vdir: Path, draft_vocab_ids: torch.Tensor | None = None, **kw: Any) -> Eagle3Draft:
    """A two-layer EAGLE-3 draft with every weight moved off its init, rounded to bf16."""
    torch.manual_seed(1)
    fields: dict[str, Any] = {"target_layer_ids": TARGET_LAYERS, "num_layers": 2, **kw}
    if draft_vocab_ids is not None:
        fields["draft_vocab_size"] = int(draft_vocab_ids.numel())
    d = family("eagle3").build(vdir, draft_vocab_ids=draft_vocab_ids, **fields)
    assert isinstance(d, Eagle3Draft)
    return perturbed(d, 0.1)


# speculators' EAGLE-3, its eager losses and config base (the `spec` fixture's modules);
# the saved drafts ('full' and 'reduced': 200 of 256 tokens) are PARITY's
SPECULATORS = {
    "eagle3": "speculators.models.eagle3", "eager": "speculators.losses.eager",
    "base": "speculators.config",
}  # fmt: skip


# ---- (a) speculators loads a fanout checkpoint: EAGLE-3's case of
# tests/test_speculators_parity.py


def _check_loaded(name: str, draft: Eagle3Draft, model: Any, path: Path, vdir: Path) -> None:
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert {"input_norm.weight", "layers.0.hidden_norm.weight", "fc.weight"} <= trainable
    assert torch.equal(model.lm_head.weight, draft.lm_head_weight)  # the verifier's rows
    assert torch.equal(model.embed_tokens.weight, draft.embed_weight)
    if name == "reduced":
        assert draft.d2t is not None and torch.equal(model.d2t, draft.d2t)
        assert draft.cfg.draft_vocab_size == 200
        assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == 200


def _meant(draft: Eagle3Draft) -> dict[str, Any]:
    """The fields speculators' EAGLE-3 config declares beyond its base, or whose default
    it changes, as fanout means them."""
    c = draft.cfg
    return {
        "transformer_layer_config": None,  # checked in _check_config
        "draft_vocab_size": VOCAB,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in TARGET_LAYERS],
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "embed_requires_grad": False,
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3DraftModel"],
    }


def _check_config(draft: Eagle3Draft, model: Any, raw: dict[str, Any], vdir: Path) -> None:
    c = draft.cfg
    assert (c.norm_before_fc, c.norm_output, c.norm_before_residual, c.fc_norm) == (
        True, True, True, False,
    )  # speculators' trainer recipe  # fmt: skip
    tl = model.config.transformer_layer_config
    assert (tl.model_type, tl.num_hidden_layers, tl.hidden_size) == ("llama", 2, H)
    assert tl.rope_parameters["rope_theta"] == ROPE_THETA and tl.rms_norm_eps == RMS_EPS
    assert model.sliding_window_indices == []  # full attention
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == c.ttt_steps
    assert model.config.speculators_config.verifier.name_or_path == str(vdir.resolve())
    assert raw["fanout"]["draft_config"]["ttt_steps"] == c.ttt_steps


PARITY = Parity(
    family="eagle3", module="speculators.models.eagle3", config_class="Eagle3SpeculatorConfig",
    model_class="Eagle3DraftModel", verifier=eagle_verifier,
    drafts=lambda vdir, tmp: save_drafts(_draft, vdir, tmp, "eagle3-ckpt"),
    loads=("full", "reduced"), info_past=1,  # its from_pretrained returns the model alone
    check_loaded=_check_loaded, config_base="speculators.config:SpeculatorModelConfig",
    meant=_meant, check_config=_check_config,
)  # fmt: skip


def test_default_layers_are_vllms() -> None:
    fam = family("eagle3")
    assert vllm_default_layers(36) == [1, 17, 32]  # HF (2, 18, 33) - 1
    assert fam.default_layers(32) == [1, 15, 28]
    assert fam.default_layers(4) == [0, 1]  # HF {2, 2, 1}: the distinct ones
    assert fam.needs_last_hidden_states(fam.reference_recipe()) and fam.serving_method == "eagle3"


# ---- (b) the same logits and TTT loss on the same rows ---------------------------------


def _rows(seed: int, draft: ChainDraft, norm: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Two rows [2, T]: row 0 one document, row 1 two (the second from 13); every
    document's first 5 tokens and a hole unsupervised. Returns fanout's batch and the
    pre-norm last states (speculators')."""
    g = torch.Generator().manual_seed(seed)
    b = 2
    ids = torch.randint(0, VOCAB, (b, T), generator=g)
    doc = torch.zeros(b, T, dtype=torch.long)
    doc[1, 13:] = 1
    pos = torch.arange(T).expand(b, T).clone()
    pos[1, 13:] = torch.arange(T - 13)
    lm = torch.ones(b, T, dtype=torch.uint8)
    lm[:, :5] = 0
    lm[1, 13:18] = 0
    lm[0, 15] = 0
    pre = 2.0 * torch.randn(b, T, H, generator=g)
    with torch.no_grad():
        last = norm(pre)
    batch = {
        "hidden_states": torch.randn(b, T, len(TARGET_LAYERS) * H, generator=g),
        "input_ids": ids,
        "target_ids": ids,
        "loss_mask": lm,
        "document_ids": doc,
        "position_ids": pos,
        "last_hidden_states": last,
    }
    return batch, pre


def _packed(batch: dict[str, torch.Tensor], pre: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows as speculators trains them: each shifted (its `shift_batch`), packed into
    one; the boundary row is padding (-1); the mask is fanout's step-0 supervision."""
    rows = Eagle3Draft.rows(batch)
    _, sup0, _ = Eagle3Draft.step_inputs(batch, rows["document_ids"], 0)
    b = batch["input_ids"].shape[0]
    doc = torch.where(
        rows["document_ids"] >= 0, rows["document_ids"] + 10 * torch.arange(b)[:, None], -1
    )
    return {
        "hidden_states": rows["hidden_states"].reshape(1, -1, rows["hidden_states"].shape[-1]),
        "input_ids": batch["input_ids"][:, 1:].reshape(1, -1),
        "document_ids": doc.reshape(1, -1),
        "position_ids": rows["position_ids"].reshape(1, -1),
        "loss_mask": sup0.reshape(1, -1),
        "verifier_last_hidden_states": pre[:, 1:].reshape(1, -1, H),
    }


def _with(draft: Eagle3Draft, vdir: Path, **update: Any) -> Eagle3Draft:
    """`draft` with config fields `update` (new modules fresh, the rest its weights)."""
    ids = None if draft.d2t is None else draft.d2t + torch.arange(draft.d2t.numel())
    cfg = type(draft.cfg)(**(draft.cfg.model_dump() | update))
    d = Eagle3Draft.with_verifier_tensors(cfg, vdir, ids)
    d.load_state_dict(draft.state_dict(), strict=False)
    return d


CASES: dict[str, dict[str, Any]] = {
    "kl": {"loss_type": "kl"},
    "kl-decay": {"loss_type": "kl", "ttt_step_loss_decay": 0.7},
    "ce": {"loss_type": "ce"},
    "no-norms": {
        "loss_type": "kl",
        "norm_before_fc": False,
        "norm_output": False,
        "norm_before_residual": False,
    },
    "fc-norm": {"loss_type": "kl", "fc_norm": True, "norm_before_fc": None},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", ["full", "reduced"])
def test_logits_loss_and_grads_equal_speculators(
    case: str,
    name: str,
    spec: SimpleNamespace,
    verifier_dir: Path,
    drafts: dict[str, tuple[Eagle3Draft, Path]],
    loaded: dict[str, tuple[Any, dict[str, Any], list[str]]],
) -> None:
    if name == "reduced" and case not in ("kl", "ce"):
        pytest.skip("the vocabulary is orthogonal to the norms and decay")
    opts = CASES[case]
    base, path = drafts[name]
    draft = _with(base, verifier_dir, **opts)
    raw = json.loads((path / "config.json").read_text())
    for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
        raw[k] = getattr(draft.cfg, k)
    cfg = spec.eagle3.Eagle3SpeculatorConfig(**{k: v for k, v in raw.items() if k != "fanout"})
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = spec.eagle3.Eagle3DraftModel(cfg)
    model.load_state_dict(loaded[name][0].state_dict(), strict=False)  # fc_norm, input_norm new
    with torch.no_grad():  # the modules one case adds take fanout's weights
        for k, v in draft.state_dict().items():
            if k in model.state_dict() and not k.startswith("rope"):
                model.state_dict()[k].copy_(v)
    model.load_verifier_weights()
    model.float()
    batch, pre = _rows(11, draft, model.verifier_norm)
    steps = draft.cfg.ttt_steps
    # fanout: per-step logits of every row, and the loss
    draft.zero_grad()
    out = draft.loss(batch, None)
    out.loss.backward()
    rows = Eagle3Draft.rows(batch)
    with torch.no_grad():
        u = draft.start(rows["hidden_states"], rows["position_ids"], rows["document_ids"])
        ours = [
            draft.step(u, Eagle3Draft.step_inputs(batch, rows["document_ids"], s)[0])
            @ draft.lm_head_weight.t()
            for s in range(steps)
        ]  # [B, R, Vd] per step
    # speculators: logits via a hook on its lm_head
    logits: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _a, o: logits.append(o.detach()))
    fn = spec.eager.kl_div_loss if opts["loss_type"] == "kl" else spec.eager.ce_loss
    packed = _packed(batch, pre)
    with warnings.catch_warnings():
        # transformers' deprecation of speculators' `past_key_values` keyword: theirs
        warnings.simplefilter("ignore", FutureWarning)
        model.zero_grad()
        _, loss, metrics = model(
            **packed, ttt_steps=steps, ttt_step_loss_decay=draft.cfg.ttt_step_loss_decay,
            loss_config={opts["loss_type"]: (fn, 1.0)},
        )  # fmt: skip
        loss.backward()
    handle.remove()
    r = T - 1
    for s in range(steps):
        theirs = logits[s][0].view(2, r, -1)
        keep = r - s  # rows fed the same tokens on both sides (the rest are never read)
        torch.testing.assert_close(ours[s][:, :keep], theirs[:, :keep], atol=2e-5, rtol=0)
    # losses per step, speculators' 1e-5 undone
    total = 0.0
    for s in range(steps):  # metrics: speculators' tensors
        n = int(out.per_slot_count[s])
        assert n > 0
        spec_s = float(metrics[f"loss_{s}_sum"]) * (n + EPS_DEN) / n
        mine = out.extra[f"loss_{s}"] * draft.cfg.ttt_step_loss_decay**s
        assert mine == pytest.approx(spec_s, rel=2e-5), s
        total += spec_s
        assert out.extra[f"full_acc_{s}"] == pytest.approx(
            float(metrics[f"full_acc_{s}_sum"]) / float(metrics[f"full_acc_{s}_total"]), abs=1e-7
        ), s
    assert float(out.loss.detach()) == pytest.approx(total, rel=2e-5)
    # gradients of every parameter
    theirs_p = dict(model.named_parameters())
    for k, p in draft.named_parameters():
        if k.startswith("rope"):
            continue
        assert p.grad is not None and theirs_p[k].grad is not None, k
        g = theirs_p[k].grad
        scale = float(g.abs().max())
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * max(scale, 1e-6), msg=k)


def test_supervision_difference(
    spec: SimpleNamespace, drafts: dict[str, tuple[Eagle3Draft, Path]], loaded: Any
) -> None:
    """fanout reads the mask at the predicted token t+s+2 within the row's document;
    speculators (after its shift) at t+s+1 of the packed row: fed the raw shifted mask,
    speculators supervises exactly the other positions."""
    draft, _ = drafts["full"]
    model = loaded["full"][0]
    model.load_verifier_weights()
    batch, pre = _rows(3, draft, model.verifier_norm)
    rows = Eagle3Draft.rows(batch)
    for s in range(draft.cfg.ttt_steps):
        _, sup, _ = Eagle3Draft.step_inputs(batch, rows["document_ids"], s)
        lm = batch["loss_mask"].bool()
        theirs = torch.cat([lm[:, 1 + s + 1 :], lm.new_zeros(2, s + 1)], 1)  # shifted mask [i+s]
        ours_expected = torch.cat([lm[:, s + 2 :], lm.new_zeros(2, s + 1)], 1)
        assert torch.equal(theirs, ours_expected)  # both read token t+s+2 of the raw row ...
        # ... once speculators' per-sample shift is applied to loss_mask (l[1:]) the index
        # it reads for row t is l[t+s+1]: one earlier, the fed token
        spec_reads = torch.cat([lm[:, 1 + s :], lm.new_zeros(2, s)], 1)[:, : T - 1]
        assert not torch.equal(spec_reads, sup)
        # and fanout never supervises a prediction in another document
        doc = batch["document_ids"]
        pred_doc = torch.cat([doc[:, s + 2 :], doc.new_full((2, s + 1), -2)], 1)
        assert not (sup & (pred_doc != rows["document_ids"])).any()
    _ = pre


def test_fused_head_equals_plain_autograd(verifier_dir: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, H, generator=g, requires_grad=True)
    teacher = torch.randn(37, H, generator=g)
    w = torch.randn(VOCAB, H, generator=g)
    wt = torch.rand(37, generator=g)
    for kl in (True, False):
        loss, pred, label = teacher_head(x, teacher, w, kl=kl, chunk_rows=5)
        (loss * wt).sum().backward()
        assert x.grad is not None
        gx = x.grad.clone()
        x.grad = None
        lq = torch.log_softmax(x @ w.t(), -1)
        lp = torch.log_softmax(teacher @ w.t(), -1)
        ref = (lp.exp() * (lp - lq)).sum(-1) if kl else -lq.gather(1, lp.argmax(-1)[:, None])[:, 0]
        (ref * wt).sum().backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)
        assert torch.equal(pred, lq.argmax(-1)) and torch.equal(label, lp.argmax(-1))
        x.grad = None


# ---- (c) the drafting step -------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(verifier_dir: Path) -> Decoder:
    """`eagle_decoder` (P-EAGLE's and MTP's tests import this fixture too)."""
    return eagle_decoder(verifier_dir)


def eagle_decoder(verifier_dir: Path) -> Decoder:
    """Decoding on `eagle_verifier`, its auxiliary layers and last states captured."""
    v = load_verifier(
        verifier_dir, device="cpu", capture_layer_ids=TARGET_LAYERS, num_draft_layers=None,
        store_last_hidden_states=True,
    )  # fmt: skip
    return Decoder(v, {VOCAB - 1})


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def trained(verifier_dir: Path, decoder: Decoder) -> Eagle3Draft:
    """An EAGLE-3 draft (reference recipe) trained briefly on the verifier's own greedy
    continuations, so decoding accepts drafts (and rolls back rejected ones)."""
    torch.manual_seed(0)
    draft = family("eagle3").build(verifier_dir, target_layer_ids=TARGET_LAYERS)
    assert isinstance(draft, Eagle3Draft) and draft.cfg.num_layers == 1
    fit(draft, greedy_batch(decoder), lr=3e-3, steps=60, generator=None)
    return draft


class _Recording:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.rows: list[torch.Tensor] = []

    def extend(self, hidden: torch.Tensor) -> None:
        self.inner.extend(hidden)

    def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
        tokens, rows = self.inner.propose(seq, choose)
        self.sizes.append(len(tokens))
        self.rows.append(rows)
        assert rows.shape == (len(tokens), VOCAB)
        return tokens, rows


@pytest.mark.parametrize("k", [None, 1, 5])
def test_greedy_lossless_k_tokens_a_step(
    k: int | None, trained: Eagle3Draft, decoder: Decoder
) -> None:
    assert family_of_draft(trained).name == "eagle3"
    taus = assert_greedy_lossless(trained, decoder, k, k or trained.cfg.ttt_steps)
    if k != 1:
        assert sum(taus[:2]) / 2 > 1.2  # trained prompts: drafts are accepted


def assert_greedy_lossless(draft: Any, decoder: Decoder, k: int | None, want: int) -> list[float]:
    """A chain family's cached drafting step, `k` tokens a step, decodes what greedy
    decoding does on four prompts (two of them trained on), drafting `want` tokens every
    step; the acceptance length of each prompt. P-EAGLE's and MTP's tests use it too."""
    fam = family_of_draft(draft)
    taus = []
    for n, seed in ((6, 100), (6, 101), (3, 0), (17, 1)):
        prompt = _prompt(n, seed)
        g = decoder.greedy(prompt, 30)
        rec = _Recording(fam.drafting_context(draft, cached=True, num_speculative_tokens=k))
        s = decoder.speculative(prompt, draft, 30, context=rec)
        assert first_mismatch(g.tokens, s.tokens) is None, (n, g.tokens, s.tokens)
        assert rec.sizes and set(rec.sizes) == {want} and s.drafted == want
        taus.append(s.acceptance_length)
    return taus


def assert_cached_equals_uncached(
    name: str, draft: Any, decoder: Decoder, context: type, k: int | None = None
) -> None:
    """A chain family's cached drafting step decodes what its uncached one does (the same
    tokens, acceptances and proposal rows) on three prompts, `k` tokens a step; its
    `context` is the class `context`. P-EAGLE's and MTP's tests use it too."""
    fam = family(name)
    for n, seed in ((5, 3), (21, 4), (6, 102)):
        prompt = _prompt(n, seed)
        a = _Recording(fam.drafting_context(draft, cached=True, num_speculative_tokens=k))
        b = _Recording(fam.drafting_context(draft, cached=False, num_speculative_tokens=k))
        sa = decoder.speculative(prompt, draft, 30, context=a)
        sb = decoder.speculative(prompt, draft, 30, context=b)
        assert sa.tokens == sb.tokens and sa.accepted == sb.accepted
        for x, y in zip(a.rows, b.rows):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-5)
    assert isinstance(fam.context(draft), context)


def test_cached_equals_uncached(trained: Eagle3Draft, decoder: Decoder) -> None:
    assert_cached_equals_uncached("eagle3", trained, decoder, Eagle3Context, k=4)


# ---- (d) bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"fc_norm": True, "norm_before_fc": True}, "fc_norm and norm_before_fc are exclusive"),
        ({"block_size": 8}, "EAGLE-3 drafts a chain"),
        ({"gamma": 4.0}, "ttt-step-loss-decay, not gamma"),
        (
            {"loss_weighting": "dpace", "loss_type": "ce"},
            "--per-position-loss-weight dpace: EAGLE-3 weighs",
        ),
        ({"label_source": "input_ids"}, "verifier's distribution"),
        ({"embed_requires_grad": True}, "frozen"),
        ({"ttt_steps": 0}, "ttt_steps"),
    ],
)
def test_bad_config_is_refused_in_one_line(
    fields: dict[str, Any], match: str, verifier_dir: Path
) -> None:
    assert_refused_in_one_line(
        "eagle3", verifier_dir, match, target_layer_ids=TARGET_LAYERS, **fields
    )


def assert_refused_in_one_line(name: str, vdir: Path, match: str, **fields: Any) -> None:
    """Building family `name`'s draft with `fields` raises a ConfigError matching `match`
    in one line (or pydantic's own validation report). P-EAGLE's tests use it too."""
    with pytest.raises(ConfigError, match=match) as e:
        family(name).build(vdir, **fields)
    assert "\n" not in str(e.value).strip() or "validation error" in str(e.value)


def test_a_batch_without_last_hidden_states_is_refused(drafts: Any) -> None:
    draft, _ = drafts["full"]
    batch, _ = _rows(1, draft, torch.nn.Identity())
    batch.pop("last_hidden_states")
    with pytest.raises(ConfigError, match="--capture-for eagle3"):
        draft.loss(batch, None)
