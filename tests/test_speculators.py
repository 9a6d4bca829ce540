"""Conformance with the real speculators 0.9.0 library (skipped when it is not installed).

`scripts/install_speculators.sh` installs it (`--no-deps`, never a torch resolve; CI and
`FANOUT_SPECULATORS=1 ./dev.sh ...` run it). speculators' own `DFlashDraftModel` is the
oracle here:

1. (DFlash's `PARITY` case of tests/test_speculators_parity.py: loading and re-saving;
   the tensor and config checks here) a fanout checkpoint (`save_checkpoint`) loads
   with `DFlashDraftModel.from_pretrained` with no missing/unexpected keys, no warning from
   any channel (Python warnings, stdlib logging incl. transformers' load report,
   loguru), every tensor equal to `model.safetensors`, and the config fields it
   reads (`aux_hidden_state_layer_ids` = fanout's target_layer_ids + 1, RoPE theta,
   RMSNorm eps, verifier path and architectures) as fanout meant them; the config
   equals the one speculators writes itself for the same model (`save_pretrained`),
   up to the fields listed in `_WRITER_ONLY`;
2. with the same weights, rows and anchors (both `select_anchors` are patched), fanout's
   `DFlashDraft.loss` and speculators' `forward` give the same loss, per-slot
   accuracy counts, EAL and parameter gradients, for CE with exp decay, CE with
   D-PACE and KL, and for two rows against the same rows packed into one;
3. where the two differ on purpose, the differences are pinned exactly.

Semantic differences found (fanout's choice, and how the tests account for it):

- Which slots carry a loss. speculators supervises slot k of the block at anchor a
  when `loss_mask[a+k]` is on; fanout also requires `document_ids[a+k] ==
  document_ids[a]`. A block that runs past its document's end is trained by
  speculators on the next document's tokens, whose labels are the verifier's
  predictions given a context the block never sees (it only sees its own document):
  noise. fanout drops those slots (`anchors.slot_supervision`). The conformance rows
  keep blocks inside their documents; `test_supervision_differences` pins the extra
  slots speculators trains and shows that with fanout's mask speculators' loss is
  fanout's.
- Reduced draft vocabulary. speculators' label is the argmax of the verifier logits
  restricted to the draft vocabulary, so a slot whose verifier token is not in the
  draft vocabulary is trained toward some other token (one the verifier would reject
  under greedy verification). fanout drops such slots (`label >= 0`). Pinned in
  `test_supervision_differences`.
- Anchor candidates. speculators draws anchors from every supervised position
  `p < T - block_size`; fanout also requires slot 1 to be supervised and in the same
  document (an anchor at a document's last supervised token would give a block with
  zero or only cross-document loss). fanout's candidates are a subset
  (`test_anchor_candidates`); both draw uniformly without replacement and sort.
- Loss normalisation. Both divide the weighted CE sum by the number of supervised
  slots; speculators adds 1e-5 to the count (the tests undo that) and averages per
  packed row, which it always has one of. fanout's `[B, T]` batch is normalised over
  all its rows' slots, i.e. as speculators does the rows packed into one
  (`test_two_rows_equal_one_packed_row`).
- Decay weights. Same formula `exp(-(k-1)/gamma)`, slot 0 weight 0; speculators'
  training default is gamma = 4 for every block size, fanout's is by block size
  (`default_gamma`: 4 for 8, 7 for 16, the DFlash paper's values). The tests pass
  fanout's gamma to both. D-PACE is the same formula on both sides.
- Label source. Both label slot k at position p with the verifier's greedy token at
  p-1. fanout stores it (`target_ids`) at capture time; speculators recomputes it as
  `argmax(lm_head(verifier_norm(verifier_last_hidden_states[p-1])))`. fanout's
  `label_source="input_ids"` has no speculators counterpart.
- Last hidden states (KL loss only). fanout captures HF `last_hidden_state`, which is
  after the verifier's final norm; speculators' `verifier_last_hidden_states` are
  before it (it applies `verifier_norm` itself). The tests feed speculators the
  pre-norm states and fanout their normed version; the two trainers' data files are
  therefore not interchangeable, the checkpoints are.
- Context each block sees: identical (same document, strictly before the anchor; own
  block bidirectional; padding blocks see only themselves). speculators also excludes
  document id -1 (padding), which fanout's anchors never point into.
- Hidden-state layer numbering: fanout's target layer i is decoder layer i's output =
  HF `hidden_states[i + 1]`; speculators' (and vLLM's) `aux_hidden_state_layer_ids`
  index HF `hidden_states`, so the checkpoint must hold fanout's ids + 1. The loss
  tests feed both models the same context tensor, so only the config check sees it.
- Metrics. speculators' EAL counts every block with any supervised slot; fanout's
  counts blocks whose slot 1 is loss-supervised in the anchor's document. With fanout's
  anchor rule every valid block has that, so they agree (the conformance anchors keep
  the rule). With a reduced vocabulary, a block whose slot-1 verifier token is outside
  it can never be accepted: it must count with length 1, not be left out
  (`test_eal_counts_blocks_whose_first_token_is_outside_the_draft_vocab`).

Attention runs with speculators' "eager" implementation (its default, flex attention,
compiles its block mask); everything is float32 on CPU. The weights are rounded to
bf16 before saving, so the bf16 `model.safetensors` is exact and both models hold the
same numbers.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import block_parity as block
from fanout.families.dflash.model import DFlashDraft
from fanout.model.anchors import select_anchors, slot_supervision
from fanout.model.verifier_dir import read_verifier_tensors
from speculators_parity import (
    Drafts,
    Parity,
    perturbed,
    save_drafts,
    speculators_verifier,
    with_fields,
)

with warnings.catch_warnings():
    # import-time DeprecationWarnings from torch.compile's first import and friends
    # (speculators compiles create_block_mask at import); not about our checkpoints
    warnings.simplefilter("ignore")
    spec_dflash: Any = pytest.importorskip("speculators.models.dflash")
    spec_core: Any = pytest.importorskip("speculators.models.dflash.core")
    spec_utils: Any = pytest.importorskip("speculators.models.dflash.utils")
    spec_eager: Any = pytest.importorskip("speculators.losses.eager")
    spec_metrics: Any = pytest.importorskip("speculators.models.dflash.metrics")
    loguru: Any = pytest.importorskip("loguru")

SPECULATORS_VERSION = "0.9.0"
VOCAB, H, V_LAYERS, BS, MASK = 256, 32, 4, 4, 255
TARGET_LAYERS = [1, 2]
ROPE_THETA, RMS_EPS = 1e6, 1e-5  # not Qwen3Config's defaults: a field it ignored would show
T = 40
EPS_DEN = 1e-5  # speculators' loss_function adds this to the supervised-slot count

# Fields speculators' own writer (`save_pretrained` of the loaded model) sets that
# fanout's config does not match on purpose:
# - transformers_version: the writer's transformers, metadata;
# - dtype: the in-memory dtype at save time (float32 here); fanout writes the stored one;
# - auto_map: transformers' registration of the custom config class, no reader needs it.
_WRITER_ONLY = {"transformers_version", "dtype", "torch_dtype", "auto_map"}


# ---- fixtures: a tiny verifier, two fanout drafts and their checkpoints -------------


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 speculators loads without a warning (`speculators_verifier`)."""
    return _verifier(tmp_path_factory.mktemp("speculators"))


def _verifier(root: Path) -> Path:
    return speculators_verifier(root, VOCAB, H, V_LAYERS, ROPE_THETA, RMS_EPS)


def _draft(vdir: Path, draft_vocab_ids: torch.Tensor | None = None) -> DFlashDraft:
    torch.manual_seed(1)
    kw: dict[str, Any] = {
        "target_layer_ids": TARGET_LAYERS,
        "block_size": BS,
        "max_anchors": 8,
        "mask_token_id": MASK,
        "num_layers": 2,
    }
    if draft_vocab_ids is not None:
        kw["draft_vocab_size"] = int(draft_vocab_ids.numel())
    d = DFlashDraft.from_verifier(vdir, draft_vocab_ids=draft_vocab_ids, **kw)
    return perturbed(d, 0.05)


@pytest.fixture(scope="module")
def drafts(verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Drafts:
    """'full' (verifier vocabulary) and 'reduced' (200 of 256 tokens) drafts, each saved
    with save_checkpoint; name -> (draft, checkpoint dir)."""
    return save_drafts(_draft, verifier_dir, tmp_path_factory, "ckpt")


# DFlash's case of tests/test_speculators_parity.py (loading, re-saving)
PARITY = Parity(
    family="dflash", module="speculators.models.dflash", config_class="DFlashSpeculatorConfig",
    model_class="DFlashDraftModel", verifier=_verifier,
    drafts=lambda vdir, tmp: save_drafts(_draft, vdir, tmp, "dflash-ckpt"),
    loads=("full", "reduced"), resaves=("full", "reduced"),
)  # fmt: skip


@contextmanager
def _notes() -> Iterator[list[str]]:
    """Collect everything said at WARNING or above: Python warnings, stdlib logging
    (transformers' library logger does not propagate to the root, so it gets its own
    handler; its load report of missing/unexpected keys is a WARNING) and loguru
    (speculators.utils.loading)."""
    notes: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(f"logging {record.name} {record.levelname}: {record.getMessage()}")

    handler = _Collect(level=logging.WARNING)
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    for lg in loggers:
        lg.addHandler(handler)
    sink = loguru.logger.add(
        lambda m: notes.append(f"loguru {m.record['level'].name}: {m.record['message']}"),
        level="WARNING",
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
        notes.extend(f"warning {w.category.__name__}: {w.message}" for w in caught)
    finally:
        loguru.logger.remove(sink)
        for lg in loggers:
            lg.removeHandler(handler)


def _speculators_config(path: Path) -> Any:
    cfg = spec_dflash.DFlashSpeculatorConfig.from_pretrained(str(path))
    # speculators' default is flex attention with a compiled block mask; eager is its
    # plain-PyTorch path (float mask) and runs on CPU
    cfg.transformer_layer_config._attn_implementation = "eager"
    return cfg


def _load(path: Path) -> Any:
    """speculators' own loading path: config, weights, then the verifier's embedding,
    lm_head and final norm (load_verifier_weights, from speculators_config.verifier)."""
    return spec_dflash.DFlashDraftModel.from_pretrained(
        str(path), config=_speculators_config(path), dtype=torch.float32
    )


@pytest.fixture(scope="module")
def loaded(drafts: dict[str, tuple[DFlashDraft, Path]]) -> dict[str, tuple[Any, list[str]]]:
    """name -> (speculators DFlashDraftModel loaded from fanout's checkpoint, notes)."""
    out = {}
    for name, (_, path) in drafts.items():
        with _notes() as notes:
            model = _load(path)
        out[name] = (model, notes)
    return out


# ---- 1. loading --------------------------------------------------------------------


def test_the_capture_sees_a_bad_checkpoint(
    drafts: dict[str, tuple[DFlashDraft, Path]], tmp_path: Path
) -> None:
    """Control for tests/test_speculators_parity.py's loading test: a file with a
    missing and an unexpected tensor is reported both by the loading info and by
    transformers' load report (a WARNING the capture must see)."""
    _, path = drafts["full"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bad / f).write_bytes((path / f).read_bytes())
    t = load_file(str(bad / "model.safetensors"))
    t.pop("norm.weight")
    t["extra.weight"] = torch.zeros(2)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with _notes() as notes:
        _, info = spec_dflash.DFlashDraftModel.from_pretrained(
            str(bad),
            config=_speculators_config(bad),
            dtype=torch.float32,
            output_loading_info=True,
        )
    assert info["missing_keys"] == {"norm.weight"}
    assert info["unexpected_keys"] == {"extra.weight"}
    assert any("norm.weight" in n and "extra.weight" in n for n in notes), notes


@pytest.mark.parametrize("name", ["full", "reduced"])
def test_loaded_tensors_equal_the_checkpoint(
    name: str,
    drafts: dict[str, tuple[DFlashDraft, Path]],
    loaded: dict[str, tuple[Any, list[str]]],
    verifier_dir: Path,
) -> None:
    draft, path = drafts[name]
    model, _ = loaded[name]
    sd = model.state_dict()
    saved = load_file(str(path / "model.safetensors"))
    for k, v in saved.items():
        assert sd[k].dtype == (v.dtype if k in ("d2t", "t2d") else torch.float32), k
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    for k, v in draft.trainable_state().items():  # and they are the draft's own weights
        assert torch.equal(sd[k], v), k
    vt = read_verifier_tensors(
        verifier_dir, ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    )
    assert torch.equal(sd["embed_tokens.weight"], vt["model.embed_tokens.weight"])
    assert torch.equal(sd["verifier_norm.weight"], vt["model.norm.weight"])
    head = vt["lm_head.weight"]
    if draft.t2d is not None and draft.d2t is not None:
        head = head[draft.t2d]
        assert torch.equal(model.t2d, draft.t2d)
        assert torch.equal(model.d2t, draft.d2t)
    assert torch.equal(sd["lm_head.weight"], head)
    assert torch.equal(sd["lm_head.weight"], draft.lm_head_weight)
    assert torch.equal(sd["verifier_lm_head.weight"], head)


def test_config_as_fanout_means_it(
    drafts: dict[str, tuple[DFlashDraft, Path]],
    loaded: dict[str, tuple[Any, list[str]]],
    verifier_dir: Path,
) -> None:
    draft, path = drafts["full"]
    model, _ = loaded["full"]
    raw = json.loads((path / "config.json").read_text())
    assert raw["speculators_version"] == SPECULATORS_VERSION == version("speculators")
    # HF hidden_states numbering: fanout's decoder layer i is hidden_states[i + 1]
    want_ids = [i + 1 for i in draft.cfg.target_layer_ids]
    assert raw["aux_hidden_state_layer_ids"] == want_ids
    assert model.config.aux_hidden_state_layer_ids == want_ids
    assert model.target_layer_ids == want_ids
    tl = model.config.transformer_layer_config
    assert tl.model_type == "qwen3"
    assert tl.num_hidden_layers == draft.cfg.num_layers == len(model.layers)
    assert tl.rope_parameters["rope_theta"] == ROPE_THETA
    assert tl.rms_norm_eps == RMS_EPS
    assert (tl.hidden_size, tl.head_dim, tl.vocab_size) == (H, 8, VOCAB)
    assert model.config.block_size == BS
    assert model.mask_token_id == MASK
    assert model.config.draft_vocab_size == VOCAB
    assert model.config.sample_from_anchor is False
    proposal = model.config.speculators_config.proposal_methods[0]
    assert proposal.speculative_tokens == BS - 1
    verifier = model.config.speculators_config.verifier
    assert verifier.name_or_path == str(verifier_dir.resolve())
    assert verifier.architectures == ["Qwen3ForCausalLM"]
    torch.testing.assert_close(
        model.rotary_emb.inv_freq, draft.rope.inv_freq, rtol=1e-6, atol=0
    )  # the draft's RoPE, from rope_parameters


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- 2. the same loss on the same rows -----------------------------------------------


def _rows(
    draft: DFlashDraft, vdir: Path, layout: block.Row, anchors: torch.Tensor, valid: torch.Tensor,
    seed: int,
) -> block.Rows:  # fmt: skip
    """A fanout batch row and the matching pre-norm verifier states for speculators
    (`block.rows`): about half the block slots get a verifier state whose greedy token
    is the draft's own prediction."""

    def plant(batch: block.Row, pre: torch.Tensor, head: Any, w: Any, g: Any) -> None:
        hid = draft.block_hidden(batch, anchors, valid)  # [1, A, bs, H]
        for j in range(anchors.shape[1]):
            if not valid[0, j]:
                continue
            for k in range(1, BS):
                if torch.rand((), generator=g) < 0.5:
                    # norm(h / w) = c·h (c > 0), so the verifier's argmax is the draft's
                    pre[0, int(anchors[0, j]) + k - 1] = hid[0, j, k] / w

    return block.rows(vdir, layout, seed, len(TARGET_LAYERS) * H, plant, MASK, RMS_EPS)


def _compare(
    fan: Any, spec_loss: torch.Tensor, spec_metrics: dict[str, torch.Tensor], eal: bool = True
) -> None:
    n = fan.n_tokens
    assert n > 0
    assert int(spec_metrics["full_acc_total"]) == n
    torch.testing.assert_close(
        spec_loss.detach() * (n + EPS_DEN) / n, fan.loss.detach(), rtol=2e-6, atol=1e-7
    )  # atol: a KL near 0 is a sum of cancelling fp32 terms
    block.assert_slot_counts(fan, spec_metrics, BS, first=1)
    if eal:
        spec_eal = spec_metrics["eal_sum"] / spec_metrics["eal_total"]
        torch.testing.assert_close(spec_eal, fan.eal.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", sorted(block.LOSS_CASES))
def test_loss_metrics_and_grads_equal_speculators(
    case: str, drafts: Drafts, loaded: dict[str, tuple[Any, list[str]]], verifier_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    update, spec_kw = block.loss_case(case, spec_eager)
    draft = with_fields(drafts["full"][0], gamma=2.5, dpace_alpha=0.3, **update)
    model, _ = loaded["full"]
    model.zero_grad(set_to_none=True)
    layout = block.packed_row()
    # blocks inside their documents; slot 2 of the block at 8 hits the hole at 10;
    # the block at 35 is the last the row allows (anchors < T - block_size); 1 padding
    anchors, valid = block.anchor_rows(3, 8, 13, 17, 25, 30, 35)
    rows = _rows(draft, verifier_dir, layout, anchors, valid, seed=11)
    sup = slot_supervision(layout["loss_mask"], layout["document_ids"], anchors, valid, BS)
    fan, spec_loss, metrics = block.losses(
        draft, model, rows, anchors, valid, monkeypatch, gamma=2.5, dpace_alpha=0.3, **spec_kw
    )

    assert fan.n_tokens == int(sup.sum())
    assert float(fan.per_slot_acc.min()) > 0 and float(fan.per_slot_acc.max()) < 1
    _compare(fan, spec_loss, metrics)
    block.assert_grads_equal(draft, model, (fan.n_tokens + EPS_DEN) / fan.n_tokens)
    model.zero_grad(set_to_none=True)


def test_two_rows_equal_one_packed_row(
    drafts: Drafts, loaded: dict[str, tuple[Any, list[str]]], verifier_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """fanout normalises a [B, T] batch over all its rows' supervised slots: exactly
    speculators on the rows packed into one [1, 2T] row (documents renumbered)."""
    draft = copy.deepcopy(drafts["full"][0])
    model, _ = loaded["full"]
    la, lb = block.packed_row(), block.packed_row(first_doc=18, prompt=2, hole=None)
    a0, v0 = block.anchor_rows(3, 8, 14, 25, 31)  # 5 valid + 1 padding
    a1, v1 = block.anchor_rows(2, 6, 12, 20, 26, 34, pad=0)  # 6 valid
    r0, p0 = _rows(draft, verifier_dir, la, a0, v0, seed=21)
    r1, p1 = _rows(draft, verifier_dir, lb, a1, v1, seed=22)
    two = {k: torch.cat([r0[k], r1[k]]) for k in r0}  # [2, T]
    anchors, valid = torch.cat([a0, a1]), torch.cat([v0, v1])  # [2, 6]
    block.patch_anchors(monkeypatch, anchors, valid)
    fan = draft.loss(two, None)

    packed = {k: torch.cat([r0[k], r1[k]], dim=1) for k in r0}  # [1, 2T]
    packed["document_ids"] = torch.cat([r0["document_ids"], r1["document_ids"] + 2], dim=1)
    pre = torch.cat([p0, p1], dim=1)
    flat_a = torch.cat([a0, a1 + T], dim=1)
    flat_v = torch.cat([v0, v1], dim=1)
    block.patch_anchors(monkeypatch, flat_a, flat_v)
    with torch.no_grad():
        spec_loss, metrics = block.forward(
            model, packed, pre, flat_a.shape[1], loss_config={"ce": (spec_eager.ce_loss, 1.0)},
            gamma=draft.cfg.resolved_gamma,
        )  # fmt: skip
    _compare(fan, spec_loss, metrics)


# ---- 3. the differences, pinned ------------------------------------------------------


def _reduced_crossing(
    drafts: dict[str, tuple[DFlashDraft, Path]],
    loaded: dict[str, tuple[Any, list[str]]],
    verifier_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """The reduced-vocabulary draft on a row whose documents' first tokens are
    supervised, with blocks that cross into the next document (19: slot 3; 21, document
    0's last token, which fanout's anchor rule never draws: slots 1-3); fanout's loss and
    speculators' pieces (`_backbone_forward`) on it, same anchors."""
    draft = copy.deepcopy(drafts["reduced"][0])
    model, _ = loaded["reduced"]
    assert draft.t2d is not None and draft.d2t is not None
    layout = block.packed_row(prompt=0, hole=None)
    anchors, valid = block.anchor_rows(2, 7, 12, 19, 21, 26, 31)
    batch, pre = _rows(draft, verifier_dir, layout, anchors, valid, seed=31)
    block.patch_anchors(monkeypatch, anchors, valid)
    fan = draft.loss(batch, None)
    with torch.no_grad():
        _, logits, targets, spec_mask, idx = block.backbone(model, batch, pre, anchors.shape[1])
    lm, doc = layout["loss_mask"], layout["document_ids"]
    pos = idx.view(1, -1, BS)  # [1, A, bs] row positions of the slots
    label = batch["target_ids"][0, (pos - 1).clamp(min=0)]  # the verifier's greedy token
    return {
        "draft": draft,
        "fan": fan,
        "logits": logits,
        "targets": targets,
        "spec_mask": spec_mask,
        "anchors": anchors,
        "valid": valid,
        "pos": pos,
        "label": label,
        "loss_sup": slot_supervision(lm, doc, anchors, valid, BS),  # fanout, before vocab
        "oov": ~draft.t2d[label],  # verifier token outside the draft vocabulary
        "cross": (doc[0, pos] != doc[0, anchors][:, :, None]) & valid[:, :, None],
    }


def test_supervision_differences(
    drafts: Drafts, loaded: dict[str, tuple[Any, list[str]]], verifier_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """speculators supervises exactly fanout's slots plus the cross-document ones plus
    those whose verifier token is outside the draft vocabulary; given fanout's slot mask,
    its loss and per-slot accuracies are fanout's."""
    r = _reduced_crossing(drafts, loaded, verifier_dir, monkeypatch)
    fan, draft = r["fan"], r["draft"]
    spec_sup = r["spec_mask"].bool().view(1, -1, BS)  # [1, A, bs]
    cross, oov = r["cross"].clone(), r["oov"]
    cross[:, :, 0] = False
    fan_sup = r["loss_sup"] & ~oov
    assert int(cross.sum()) == 4
    assert (oov & spec_sup & ~cross).any()
    assert fan.n_tokens == int(fan_sup.sum())
    assert not (fan_sup & ~spec_sup).any()  # fanout's slots are a subset of speculators'
    assert torch.equal(spec_sup & ~fan_sup, spec_sup & (cross | oov))

    flat = fan_sup.flatten()[None].to(r["spec_mask"].dtype)
    spec_loss, metrics = spec_metrics.compute_metrics(
        r["logits"],
        r["targets"],
        flat,
        BS,
        gamma=draft.cfg.resolved_gamma,
        loss_config={"ce": (spec_eager.ce_loss, 1.0)},
    )
    # EAL: see test_eal_counts_blocks_whose_first_token_is_outside_the_draft_vocab
    _compare(fan, spec_loss, metrics, eal=False)


def test_eal_counts_blocks_whose_first_token_is_outside_the_draft_vocab(
    drafts: Drafts, loaded: dict[str, tuple[Any, list[str]]], verifier_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """EAL under greedy verification, from speculators' draft logits: every block whose
    slot 1 is a loss-supervised, same-document slot counts, with 1 + the run of slots
    whose greedy draft token (mapped to the verifier vocabulary by d2t) is the verifier's
    token. A block whose slot-1 verifier token is outside the draft vocabulary can never
    be accepted there: it still counts, with length 1 (the bonus token)."""
    r = _reduced_crossing(drafts, loaded, verifier_dir, monkeypatch)
    draft, fan = r["draft"], r["fan"]
    pred = r["logits"].argmax(-1).view(1, -1, BS)  # [1, A, bs] draft ids
    pred = pred + draft.d2t[pred]  # -> verifier ids
    ok = (pred == r["label"]) & r["loss_sup"]  # an OOV label is never matched
    run = torch.cumprod(ok[:, :, 1:].long(), dim=2).sum(dim=2)  # [1, A]
    counted = r["loss_sup"][:, :, 1]
    assert (counted & r["oov"][:, :, 1]).any(), "the row must have such a block"
    want = (1.0 + run[counted].float()).mean()
    torch.testing.assert_close(fan.eal.float(), want, rtol=1e-6, atol=0)


def test_anchor_candidates(verifier_dir: Path) -> None:
    """fanout's anchor candidates are speculators' minus the positions whose next slot
    is unsupervised or in another document."""
    layout = block.packed_row(hole=10)
    lm, doc = layout["loss_mask"], layout["document_ids"]
    fa, fv = select_anchors(lm, doc, T, BS, None)
    ours = set(fa[fv].tolist())
    sa, sv = spec_utils.select_anchors(lm, T, BS)
    theirs = set(sa[sv].tolist())
    assert ours <= theirs
    extra = {p for p in theirs if not lm[0, p + 1] or doc[0, p + 1] != doc[0, p]}
    assert theirs - ours == extra
    assert extra == {9, 21}  # before the hole; document 0's last token
