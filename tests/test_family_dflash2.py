"""The DFlash2 family: conformance with speculators 0.9.0's `DFlash2DraftModel` (skipped
without speculators), its drafting step, and its refusals.

1. Loading (DFlash2's `PARITY` case of tests/test_speculators_parity.py): a fanout
   checkpoint (`save_checkpoint`) loads with speculators'
   `DFlash2DraftModel.from_pretrained` with no missing/unexpected keys and no warning,
   every tensor equal, every field `DFlash2SpeculatorConfig` adds to DFlash's present at
   the top of `config.json` with fanout's value, and the config equal to the one
   speculators writes itself (`save_pretrained`) up to test_speculators' `_WRITER_ONLY`.
2. Loss: with the same weights (convolutions and selector perturbed away from their
   init, the selector strong enough to overturn unary picks), rows and anchors, fanout's
   `DFlash2Draft.loss` equals speculators' `forward` for CE exp decay, CE D-PACE and
   KL: the loss, the unary and selector losses, unary accuracy, the selector's per-slot
   teacher-forced hits (from speculators' own selector pieces), EAL, candidate recall,
   and every parameter gradient. Tolerances: losses rtol 1e-5 (fp32 sums in another
   order: fanout gathers the k candidate logits from the head, speculators gathers them
   from full `[slots, V]` logits); counts within 1e-3; gradients as test_speculators
   (rtol 1e-4, atol 1e-5 of the largest entry).
3. Drafting: at T = 0 `Decoder.speculative` with a DFlash2 draft equals
   `Decoder.greedy`; the cached context proposes what the uncached reference does (also
   at T > 0); the proposed tokens are the selector's greedy walk computed here by hand,
   which differs from the unary argmax at some slot; `choose`'s token is the next slot's
   predecessor.
4. A reduced vocabulary and other bad shapes are refused in one ConfigError line.

Semantic differences from speculators (besides test_speculators' DFlash ones, which
hold here unchanged: slot supervision, anchors, normalisation, decay gamma, label
source, pre/post-norm last hidden states):
- The selector's label is fanout's label (`target_ids`, the verifier's greedy token,
  or `input_ids` with `label_source="input_ids"`); speculators' is the argmax of the
  verifier logits it recomputes — the same token under `target_ids`.
- `per_slot_acc` is the selector path's (selector argmax right and the label in the
  unary top-k), which is what DFlash2 serves; speculators' `position_k_acc` is the
  unary argmax's. fanout reports the unary accuracy as `extra["unary_acc"]`.
- speculators' DFlash2 trainer defaults to the KL loss; fanout keeps CE as for every
  family (KL needs `--store-last-hidden-states`); `--loss-type kl` gives speculators'.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

import block_parity as block
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.save import save_checkpoint
from fanout.decode.spec_decode import Decoder, first_mismatch
from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.families.dflash2 import FAMILY, DFlash2Config
from fanout.families.dflash2.model import DFlash2Draft, DFlash2Layer
from fanout.families.dflash2.propose import SelectorContext
from fanout.families.registry import family, family_of_draft
from fanout.model.anchors import slot_supervision
from fanout.model.draft_cache import DraftCache, UncachedDraft, head_logits
from fanout.model.sampling import Sampling
from greedy_training import EOS
from greedy_training import decoder as decoder
from greedy_training import vdir as vdir
from speculators_parity import Parity, save_draft, speculators_verifier
from tiny_run import one_thread  # noqa: F401 (autouse)

# test_speculators' row layout: vocab 256, H 32, block 4, mask 255, target layers [1, 2]
KW: dict[str, Any] = {
    "target_layer_ids": [1, 2],
    "block_size": 4,
    "max_anchors": 8,
    "mask_token_id": 255,
    "num_layers": 2,
    "conv_kernel_size": 3,  # more than the default 2 taps: the shifted taps show
    "conv_group_size": 8,
    "selector_rank": 8,
    "selector_top_k": 4,
}
SERVING_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _layer(draft: DFlash2Draft, i: int) -> DFlash2Layer:
    return cast("DFlash2Layer", draft.layers[i])


def _perturbed(draft: DFlash2Draft, seed: int, selector_std: float = 0.1) -> DFlash2Draft:
    """Every weight moved off its init (norms around 1, convolutions away from the
    identity, the selector's transitions about the unary logit gaps: it overturns some
    unary picks, right and wrong ones), each value
    bf16-representable so a bf16 checkpoint holds exactly these numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.startswith("candidate_selector."):
                p.copy_(selector_std * noise)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.add_(0.05 * noise)
            p.copy_(p.bfloat16().float())
    return draft


# ---- speculators: a verifier it loads without a warning, the draft, its checkpoint ---------


@pytest.fixture(scope="module")
def ts() -> Any:
    """test_speculators' helpers (rows, anchors, warning capture); importing it skips
    when speculators is not installed."""
    return pytest.importorskip("test_speculators")


@pytest.fixture(scope="module")
def spec(ts: Any) -> Any:
    """speculators' DFlash2 modules."""
    import speculators.models.dflash2 as dflash2
    import speculators.models.dflash2.metrics as metrics

    return type("Spec", (), {"dflash2": dflash2, "metrics": metrics})


@pytest.fixture(scope="module")
def spec_vdir(ts: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_speculators' verifier (`speculators_verifier`, its shapes)."""
    assert (ts.VOCAB, ts.H, ts.V_LAYERS, ts.ROPE_THETA, ts.RMS_EPS) == (256, 32, 4, 1e6, 1e-5)
    return speculators_verifier(tmp_path_factory.mktemp("dflash2"))


def _built(vdir: Path) -> DFlash2Draft:
    torch.manual_seed(1)
    d = family("dflash2").build(vdir, **KW)
    assert isinstance(d, DFlash2Draft)
    return _perturbed(d, seed=2)


@pytest.fixture(scope="module")
def draft(ts: Any, spec_vdir: Path) -> DFlash2Draft:
    assert (KW["block_size"], KW["mask_token_id"], [1, 2]) == (ts.BS, ts.MASK, ts.TARGET_LAYERS)
    return _built(spec_vdir)


@pytest.fixture(scope="module")
def checkpoint(
    draft: DFlash2Draft, spec_vdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return save_draft(draft, spec_vdir, tmp_path_factory.mktemp("ckpt-dflash2"))[1]


@pytest.fixture(scope="module")
def spec_model(spec: Any, draft: DFlash2Draft, spec_vdir: Path) -> Any:
    """speculators' DFlash2DraftModel of the draft's shape, built from its own config
    class (not from fanout's writer), holding the draft's weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    c = draft.cfg
    layer = Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        layer_types=["full_attention"] * c.num_layers,
    )
    layer._attn_implementation = "eager"
    cfg = spec.dflash2.DFlash2SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=c.vocab_size,
        block_size=c.block_size,
        aux_hidden_state_layer_ids=[i + 1 for i in c.target_layer_ids],
        mask_token_id=c.mask_token_id,
        **{k: getattr(c, k) for k in SERVING_FIELDS},
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(spec_vdir)),
        ),
    )
    model = spec.dflash2.DFlash2DraftModel(cfg)
    res = model.load_state_dict(draft.trainable_state(), strict=False)
    assert res.unexpected_keys == []
    verifier_owned = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}
    assert set(res.missing_keys) == verifier_owned | {"verifier_norm.weight"}
    model.load_verifier_weights()  # embedding, head and final norm from the verifier
    return model.float()


# ---- 1. loading: DFlash2's case of tests/test_speculators_parity.py ---------------------


def _check_loaded(name: str, draft: DFlash2Draft, model: Any, path: Path, vdir: Path) -> None:
    saved = load_file(str(path / "model.safetensors"))
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(saved) == set(draft.trainable_state())
    for k, v in draft.trainable_state().items():
        assert torch.equal(saved[k].float(), v), k
    assert not torch.equal(
        model.state_dict()["layers.0.attention_conv.base_kernel"][:, 1:], torch.zeros(2, 2, 32)
    )
    assert model.config.aux_hidden_state_layer_ids == [2, 3]
    assert model.layers[0].attention_conv.kernel_size == KW["conv_kernel_size"]
    assert model.candidate_selector.top_k == KW["selector_top_k"]


def _meant(draft: DFlash2Draft) -> dict[str, Any]:
    """The config as fanout means it: the fields DFlash2 adds to DFlash, and the ones it
    sets differently."""
    return {
        **{k: getattr(draft.cfg, k) for k in SERVING_FIELDS},
        "speculators_model_type": "dflash2",
        "architectures": ["DFlash2DraftModel"],
        "sliding_window_non_causal": True,
    }


def _check_config(draft: DFlash2Draft, model: Any, raw: dict[str, Any], vdir: Path) -> None:
    assert set(FAMILY.serving_fields()) == set(SERVING_FIELDS)
    assert raw["sample_from_anchor"] is False and raw["draft_vocab_size"] == 256
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == 3


PARITY = Parity(
    family="dflash2", module="speculators.models.dflash2",
    config_class="DFlash2SpeculatorConfig", model_class="DFlash2DraftModel",
    verifier=speculators_verifier,
    drafts=lambda vdir, tmp: {"default": save_draft(_built(vdir), vdir, tmp.mktemp("ckpt"))},
    loads=("default",), check_loaded=_check_loaded, resaves=("default",),
    config_base="speculators.models.dflash:DFlashSpeculatorConfig", config_draft="default",
    meant=_meant, own_are_serving_fields=True, check_config=_check_config,
)  # fmt: skip


# ---- 2. the same loss, metrics and gradients -------------------------------------------


def _spec_selector_hits(
    spec: Any, model: Any, batch: dict[str, torch.Tensor], pre: torch.Tensor, n_anchors: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From speculators' own pieces (`_backbone_forward`, `_predecessor_ids`,
    `selector_training_candidates`, `score_candidates`): per slot, the supervised slots
    whose teacher-forced selector pick is the label with the label in the unary top-k
    `[bs]`, and how many supervised slots' picks differ from the unary argmax."""
    with torch.no_grad():
        hidden, unary, targets, mask, idx = block.backbone(model, batch, pre, n_anchors)
        prev = model._predecessor_ids(batch["input_ids"], idx)
        label = targets.argmax(-1)  # [1, A·bs]
        top = unary.topk(model.candidate_selector.top_k, dim=-1).indices
        cand, _, present = spec.metrics.selector_training_candidates(top, label)
        scores = model.candidate_selector.score_candidates(unary, hidden, prev.reshape(1, -1), cand)
        pick = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]  # [1, A·bs]
        on = mask.bool()
        hits = (pick == label) & present & on
        overturned = int(((pick != unary.argmax(-1)) & on).sum())
    return hits.view(-1, model.block_size).sum(0), torch.tensor(overturned)


@pytest.mark.parametrize("case", sorted(block.LOSS_CASES))
def test_loss_metrics_and_grads_equal_speculators(
    case: str,
    ts: Any,
    spec: Any,
    draft: DFlash2Draft,
    spec_model: Any,
    spec_vdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    update, spec_kw = block.loss_case(case, ts.spec_eager)
    alpha = 0.7
    d = copy.deepcopy(draft)
    d.cfg = draft.cfg.model_copy(
        update={"gamma": 2.5, "dpace_alpha": 0.3, "selector_loss_alpha": alpha, **update}
    )
    model = spec_model
    model.zero_grad(set_to_none=True)
    layout = block.packed_row()
    anchors, valid = block.anchor_rows(3, 8, 13, 17, 25, 30, 35)  # inside their documents, 1 pad
    batch, pre = rows = ts._rows(d, spec_vdir, layout, anchors, valid, seed=11)
    sup = slot_supervision(layout["loss_mask"], layout["document_ids"], anchors, valid, ts.BS)
    fan, spec_loss, m = block.losses(
        d, model, rows, anchors, valid, monkeypatch, **spec_kw,
        tv_loss_fn=ts.spec_eager.tv_loss, gamma=2.5, dpace_alpha=0.3, selector_loss_alpha=alpha,
    )  # fmt: skip

    n = fan.n_tokens
    assert n == int(sup.sum()) > 0
    scale = (n + ts.EPS_DEN) / n  # speculators adds 1e-5 to the slot count

    def close(theirs: torch.Tensor | float, ours: float | torch.Tensor) -> None:
        torch.testing.assert_close(
            torch.as_tensor(theirs, dtype=torch.float32) * scale,
            torch.as_tensor(ours, dtype=torch.float32),
            rtol=1e-5,
            atol=1e-6,
        )

    close(spec_loss.detach(), fan.loss.detach())
    close(m["unary_loss_sum"], fan.extra["unary_loss"])
    close(m["selector_loss_sum"], fan.extra["selector_loss"])
    assert fan.extra["selector_loss"] > 0.05  # the selector term is there to compare
    # unary accuracy: speculators' per-position accuracy is the unary argmax's
    assert int(m["full_acc_total"]) == n
    assert abs(float(m["full_acc_sum"]) - fan.extra["unary_acc"] * n) < 1e-3
    # the selector path, per slot, against speculators' own selector pieces
    hits, overturned = _spec_selector_hits(spec, model, batch, pre, anchors.shape[1])
    for k in range(1, ts.BS):
        count = int(fan.per_slot_count[k - 1])
        assert int(m[f"position_{k}_acc_total"]) == count, k
        assert abs(float(fan.per_slot_acc[k - 1]) * count - float(hits[k])) < 1e-3, k
    assert abs(float(m["teacher_forced_selector_acc_sum"]) - fan.extra["selector_acc"] * n) < 1e-3
    assert 0 < fan.extra["selector_acc"] < 1
    assert int(overturned) > 0, "the selector must overturn some unary pick here"
    torch.testing.assert_close(m["eal_sum"] / m["eal_total"], fan.eal.float(), rtol=1e-6, atol=0)
    k_ = KW["selector_top_k"]
    recall = m[f"unary_candidate_recall_at_{k_}_sum"] / m[f"unary_candidate_recall_at_{k_}_total"]
    assert abs(float(recall) - fan.extra["candidate_recall"]) < 1e-6
    assert 0 < fan.extra["candidate_recall"] < 1  # both training-candidate paths are used
    block.assert_grads_equal(d, model, scale)
    assert d.candidate_selector.predecessor_codebook.grad is not None
    conv_grad = _layer(d, 0).attention_conv.kernel_projection.weight.grad
    assert conv_grad is not None and float(conv_grad.abs().max()) > 0
    model.zero_grad(set_to_none=True)


def test_unary_logits_equal_speculators(
    ts: Any,
    draft: DFlash2Draft,
    spec_model: Any,
    spec_vdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The distribution itself, not only the loss: on the same rows and anchors, fanout's
    block states (local dynamic convolutions in every layer) through the frozen head equal
    speculators' `_backbone_forward` unary logits, every slot of every real block (fp32:
    atol 2e-5, observed ~1e-6). The selector's scores are compared through its
    teacher-forced picks in test_loss_metrics_and_grads_equal_speculators."""
    from fanout.model.draft_cache import head_logits

    layout = block.packed_row()
    anchors, valid = block.anchor_rows(3, 8, 13, 17, 25, 30, 35)
    batch, pre = ts._rows(draft, spec_vdir, layout, anchors, valid, seed=11)
    block.patch_anchors(monkeypatch, anchors, valid)
    with torch.no_grad():
        _, unary, _, _, _ = block.backbone(spec_model, batch, pre, anchors.shape[1])
        b = draft.blocks(batch, None)
        hid = b.hid[b.valid].reshape(-1, b.hid.shape[-1])  # [A·bs, H] real blocks only
        ours = head_logits(draft, hid)  # [A·bs, V]
    v = ours.shape[-1]
    theirs = unary[0].view(-1, ts.BS, v)[valid[0]].reshape(-1, v).float()
    assert ours.shape == theirs.shape and float(ours.std()) > 0.1
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5)


# ---- 3. the drafting step ----------------------------------------------------------------


def _serving_draft(vdir: Path, block_size: int = 8, seed: int = 0) -> DFlash2Draft:
    torch.manual_seed(seed)
    d = family("dflash2").build(
        vdir,
        target_layer_ids=[1, 3],
        block_size=block_size,
        mask_token_id=EOS,
        num_layers=1,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=6,
    )
    assert isinstance(d, DFlash2Draft)
    return _perturbed(d, seed=seed + 10, selector_std=1.0).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_family_is_registered(vdir: Path) -> None:
    d = _serving_draft(vdir, 4)
    assert family_of_draft(d) is FAMILY and FAMILY.name == "dflash2"
    assert isinstance(FAMILY.context(d, cached=True), SelectorContext)
    assert FAMILY.speculative_tokens(d.cfg) == 3
    assert (FAMILY.serving_method, FAMILY.sliding_window_non_causal) == ("dflash", True)


@pytest.mark.parametrize("block_size", [4, 8])
def test_lossless_at_t0_and_cached_equals_uncached(
    decoder: Decoder, vdir: Path, block_size: int
) -> None:
    draft = _serving_draft(vdir, block_size, seed=block_size)
    for n, seed in ((3, 0), (17, 1), (40, 2)):
        prompt = _prompt(n, seed)
        g = decoder.greedy(prompt, 32)
        s = decoder.speculative(prompt, draft, 32)
        assert first_mismatch(g.tokens, s.tokens) is None, (n, g.tokens, s.tokens)
        ref = decoder.speculative(prompt, draft, 32, cache_draft=False)
        assert (ref.tokens, ref.accepted) == (s.tokens, s.accepted)
    prompt = _prompt(9, 3)
    for rule in ("served", "sampled_draft"):
        hot = [
            decoder.speculative(
                prompt, draft, 24, Sampling(1.0), torch.Generator().manual_seed(5), rule,
                cache_draft=c,
            )
            for c in (True, False)
        ]  # fmt: skip
        assert (hot[0].tokens, hot[0].accepted) == (hot[1].tokens, hot[1].accepted), rule


def _walk_by_hand(
    draft: DFlash2Draft, hid: torch.Tensor, anchor: int, choose: Any
) -> tuple[list[int], list[torch.Tensor]]:
    """The selector's walk from its raw weights: slot states `hid` [bs-1, H]."""
    sel = draft.candidate_selector
    unary = hid @ draft.lm_head_weight.t()  # [bs-1, V]
    prev, tokens, scores = anchor, [], []
    for k in range(hid.shape[0]):
        cand = unary[k].topk(draft.cfg.selector_top_k).indices  # [K]
        ctx = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hid[k])  # [r]
        s = unary[k, cand] + sel.successor_codebook[cand] @ ctx  # [K]
        row = torch.full((unary.shape[1],), float("-inf"))
        row[cand] = s
        prev = choose(row)
        tokens.append(prev)
        scores.append(row)
    return tokens, scores


def test_proposal_is_the_selector_walk(vdir: Path) -> None:
    draft = _serving_draft(vdir, 8, seed=3)
    hidden = torch.randn(11, draft.fc.in_features, generator=torch.Generator().manual_seed(0))
    seq = _prompt(12, 7)  # anchor seq[-1] at position 11
    cached = SelectorContext(draft, DraftCache(draft))
    uncached = SelectorContext(draft, UncachedDraft(draft))
    for c in (cached, uncached):
        c.extend(hidden[:4])
        c.extend(hidden[4:])
    hid = uncached.states.block_states(seq)[1:]  # [bs-1, H]

    def argmax(row: torch.Tensor) -> int:
        return int(row.argmax())

    with torch.no_grad():
        want, want_rows = _walk_by_hand(draft, hid, seq[-1], argmax)
        unary_path = head_logits(draft, hid).argmax(-1).tolist()
    tokens, rows = cached.propose(seq, argmax)
    ref_tokens, ref_rows = uncached.propose(seq, argmax)
    assert tokens == ref_tokens == want
    torch.testing.assert_close(rows, ref_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, torch.stack(want_rows), rtol=1e-5, atol=1e-5)
    assert (torch.isfinite(rows).sum(-1) == draft.cfg.selector_top_k).all()
    assert tokens != unary_path, "the selector must change a pick (else it is ignored)"

    # the token `choose` returns is the next slot's predecessor
    def second(row: torch.Tensor) -> int:
        return int(row.topk(2).indices[1])

    with torch.no_grad():
        want2, want2_rows = _walk_by_hand(draft, hid, seq[-1], second)
    tokens2, rows2 = cached.propose(seq, second)
    assert tokens2 == want2
    torch.testing.assert_close(rows2, torch.stack(want2_rows), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rows2[1:], rows[1:]), "slot k > 1 must follow slot k-1's token"


def test_checkpoint_round_trip_through_fanouts_reader(
    decoder: Decoder, vdir: Path, tmp_path: Path
) -> None:
    """`load_draft` (what `fanout eval` reads) gives back the same DFlash2 draft: config
    (serving fields from the speculators config, selector_loss_alpha from fanout's
    section), weights, and proposals."""
    draft = _serving_draft(vdir, 4, seed=4)
    draft.cfg = draft.cfg.model_copy(update={"selector_loss_alpha": 0.25})
    opt = torch.optim.SGD(draft.parameters(), lr=0.1)
    path = save_checkpoint(tmp_path, draft, opt, {"step": 0}, verifier_name_or_path=str(vdir))
    back = load_draft(path, vdir)
    assert type(back) is DFlash2Draft and back.cfg == draft.cfg
    mine, theirs = draft.trainable_state(), back.trainable_state()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    prompt = _prompt(10, 6)
    assert (
        decoder.speculative(prompt, back, 16).tokens
        == decoder.speculative(prompt, draft, 16).tokens
    )


def test_fresh_draft_is_a_dflash_draft(vdir: Path) -> None:
    """Identity convolutions at init: the block states are DFlash's for the same weights;
    the selector starts as speculators' normal(0, 0.02)."""
    torch.manual_seed(0)
    d2 = DFlash2Draft.from_verifier(vdir, target_layer_ids=[1, 3], block_size=4,
                                    mask_token_id=EOS, num_layers=2, conv_group_size=8,
                                    selector_rank=64)  # fmt: skip
    d1 = DFlashDraft.from_verifier(vdir, target_layer_ids=[1, 3], block_size=4,
                                   mask_token_id=EOS, num_layers=2)  # fmt: skip
    missing = d1.load_state_dict(d2.trainable_state(), strict=False)
    assert missing.missing_keys == []
    assert all(
        k.startswith("candidate_selector.") or "_conv." in k for k in missing.unexpected_keys
    )
    g = torch.Generator().manual_seed(1)
    t = 20
    batch = {
        "hidden_states": torch.randn(1, t, d2.fc.in_features, generator=g),
        "input_ids": torch.randint(0, 250, (1, t), generator=g),
        "position_ids": torch.arange(t)[None],
        "document_ids": torch.zeros(1, t, dtype=torch.long),
    }
    anchors, valid = torch.tensor([[2, 9, 14]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(
            d2.block_hidden(batch, anchors, valid), d1.block_hidden(batch, anchors, valid),
            rtol=0, atol=0,
        )  # fmt: skip
    std = float(d2.candidate_selector.predecessor_codebook.detach().std())
    assert 0.015 < std < 0.025
    proj = _layer(d2, 0).mlp_conv.kernel_projection.weight
    assert torch.equal(proj, torch.zeros_like(proj))


def test_selector_loss_trains(vdir: Path) -> None:
    """A few steps on one batch lower the selector's loss (its gradient is the right sign
    through the codebooks, the projection and the gathered unary logits)."""
    torch.manual_seed(0)
    d = family("dflash2").build(vdir, target_layer_ids=[1, 3], block_size=4, mask_token_id=EOS,
                                num_layers=1, conv_group_size=8, selector_rank=8,
                                selector_top_k=4, max_anchors=8)  # fmt: skip
    assert isinstance(d, DFlash2Draft)
    g = torch.Generator().manual_seed(2)
    t = 32
    batch = {
        "hidden_states": torch.randn(1, t, d.fc.in_features, generator=g),
        "input_ids": torch.randint(0, 250, (1, t), generator=g),
        "target_ids": torch.randint(0, 250, (1, t), generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "document_ids": torch.zeros(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
    }
    opt = torch.optim.Adam(d.parameters(), lr=3e-2)
    losses = []
    for _ in range(15):
        out = d.loss(batch, torch.Generator().manual_seed(0))
        losses.append(out.extra["selector_loss"])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < 0.8 * losses[0], losses


# ---- 4. refusals ---------------------------------------------------------------------------


def test_reduced_vocabulary_is_refused_in_one_line(vdir: Path) -> None:
    with pytest.raises(ConfigError) as e:
        family("dflash2").build(
            vdir, target_layer_ids=[1, 3], mask_token_id=EOS,
            draft_vocab_size=64, draft_vocab_ids=torch.arange(64),
        )  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg
    assert "draft_vocab_size=64" in msg and "full vocabulary" in msg and "config.json" in msg


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("conv_group_size", 12, "must divide hidden_size (32)"),
        ("conv_kernel_size", 9, "cannot exceed block_size (8)"),
        ("selector_top_k", 300, "cannot exceed vocab_size (256)"),
        ("selector_rank", 0, "selector_rank"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(
    vdir: Path, field: str, value: int, needle: str
) -> None:
    with pytest.raises(ConfigError) as e:
        family("dflash2").build(
            vdir, target_layer_ids=[1, 3], mask_token_id=EOS, **({"block_size": 8} | {field: value})
        )
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def test_config_refuses_a_reduced_vocabulary_directly() -> None:
    base = {
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "mask_token_id": 255,
        "target_layer_ids": [1],
    }  # fmt: skip
    assert DFlash2Config(**base).block_size == 16  # the shared default; the family sets 8
    assert DFlash2Config(**base, draft_vocab_size=256).draft_vocab_size == 256
    with pytest.raises(ValueError, match="full vocabulary"):
        DFlash2Config(**base, draft_vocab_size=128)
    assert FAMILY.recipe_defaults == {"block_size": 8}
