"""fanout.train.optim: AdamW + LR schedule without torch.optim, against torch.optim.

.venv/bin/pytest tests/test_optim.py -q

The reference is `torch.optim.AdamW` with the same backend + `LambdaLR` (the trainer's
optimizer and schedule before 2026-12): updates, learning rates and state_dicts must be
identical, bit for bit, and a checkpoint written with the reference (an old checkpoint)
must resume into the fast path and continue exactly as the reference would.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.checkpoints.layout import latest_checkpoint
from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.save import save_checkpoint
from fanout.families.dflash.model import DFlashDraft
from fanout.ops.adamw import ClippedAdamW
from fanout.train.optim import (
    WARMUP_STEPS_WITHOUT_TOTAL,
    LRCurve,
    LRSchedule,
    build_optimizer,
    lr_lambda,
)

Backend = Literal["fused", "foreach"]
STEPS = 8


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (5,), (3, 2, 4)]]


def _reference(
    params: list[torch.nn.Parameter], backend: Backend, kind: Any, total: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(
        params, lr=0.05, weight_decay=0.1, fused=backend == "fused", foreach=backend == "foreach"
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(0.25, kind, total))


def _fast(
    params: list[torch.nn.Parameter], backend: Backend, kind: Any, total: int
) -> tuple[ClippedAdamW, LRSchedule]:
    opt, chosen, sched = build_optimizer(
        params,
        lr=0.05,
        weight_decay=0.1,
        backend=backend,
        max_grad_norm=None,
        warmup_ratio=0.25,
        scheduler_type=kind,
        total_steps=total,
    )
    assert chosen == backend
    return opt, sched


def _grads(params: list[list[torch.nn.Parameter]], g: torch.Generator, step: int) -> None:
    scale = 5.0 if step % 2 else 0.01
    for ps in zip(*params):
        grad = torch.randn(ps[0].shape, generator=g) * scale
        for p in ps:
            p.grad = grad.clone()


def _step(opt: Any, sched: Any) -> float:
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(sched.get_last_lr()[0])


def _assert_same_state(fast: ClippedAdamW, ref: torch.optim.Optimizer) -> None:
    a, b = fast.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys()
        for name, v in st.items():
            ref_v = b["state"][k][name]
            assert v.dtype == ref_v.dtype and v.device == ref_v.device, (k, name)
            assert torch.equal(v, ref_v), (k, name)


@pytest.mark.parametrize("backend", ["fused", "foreach"])
@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_step_and_schedule_equal_torch_adamw_and_lambdalr(backend: Backend, kind: str) -> None:
    mine, ref = _params(0), _params(0)
    opt, sched = _fast(mine, backend, kind, STEPS)
    ref_opt, ref_sched = _reference(ref, backend, kind, STEPS)
    assert sched.state_dict() == ref_sched.state_dict()
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        _grads([mine, ref], g, step)
        assert _step(opt, sched) == _step(ref_opt, ref_sched)
        for a, b in zip(mine, ref):
            assert torch.equal(a, b), (backend, kind, step)
    assert sched.state_dict() == ref_sched.state_dict()
    _assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_state_dicts_load_both_ways(backend: Backend) -> None:
    """Half the steps on one, load its state into the other, finish: both orders equal
    the reference run throughout."""
    g = torch.Generator().manual_seed(2)
    ref = _params(0)
    ref_opt, ref_sched = _reference(ref, backend, "cosine", STEPS)
    mine = _params(0)
    opt, sched = _fast(mine, backend, "cosine", STEPS)
    for step in range(STEPS // 2):
        _grads([ref, mine], g, step)
        _step(ref_opt, ref_sched)
        _step(opt, sched)
    # torch → fanout (deep copies: load_state_dict, torch's too, keeps the tensors it gets)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt2, sched2 = _fast(resumed, backend, "cosine", STEPS)
    opt2.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    sched2.load_state_dict(ref_sched.state_dict())
    # fanout → torch
    back = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    ref_opt3, ref_sched3 = _reference(back, backend, "cosine", STEPS)
    ref_opt3.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref_sched3.load_state_dict(sched.state_dict())
    for step in range(STEPS // 2, STEPS):
        _grads([ref, resumed, back], g, step)
        lrs = {_step(ref_opt, ref_sched), _step(opt2, sched2), _step(ref_opt3, ref_sched3)}
        assert len(lrs) == 1
        for a, b, c in zip(ref, resumed, back):
            assert torch.equal(a, b) and torch.equal(a, c), step


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    b, t = 2, 32
    return {
        "hidden_states": torch.randn(b, t, 2 * 32, generator=g),
        "target_ids": torch.randint(0, 128, (b, t), generator=g),
        "input_ids": torch.randint(0, 128, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
        "document_ids": torch.zeros(b, t, dtype=torch.long),
        "position_ids": torch.arange(t).expand(b, t),
    }


def _draft(vdir: Path) -> DFlashDraft:
    torch.manual_seed(0)
    return DFlashDraft.from_verifier(vdir, block_size=4, max_anchors=8, target_layer_ids=[0, 1])


def _train(d: DFlashDraft, opt: Any, sched: Any, gen: torch.Generator, steps: range) -> None:
    for i in steps:
        d.loss(_batch(i), gen).loss.backward()
        _step(opt, sched)


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_checkpoint_written_with_torch_optim_resumes(tmp_path: Path, backend: Backend) -> None:
    """An old checkpoint (torch.optim.AdamW + LambdaLR, as the trainer wrote them) loads
    into the fast path, which then trains on exactly as the old code does."""
    vdir = tiny_qwen3_verifier(tmp_path / "v", 128, hidden_size=32, num_layers=3)
    old = _draft(vdir)
    params = [p for p in old.parameters() if p.requires_grad]
    ref_opt, ref_sched = _reference(params, backend, "linear", 6)
    gen = torch.Generator().manual_seed(5)
    _train(old, ref_opt, ref_sched, gen, range(3))
    state = {"step": 3, "cursor": 1, "scheduler": ref_sched.state_dict()}
    save_checkpoint(tmp_path / "ck", old, ref_opt, state, generators={"anchors": gen})

    new = _draft(vdir)
    opt, sched = _fast([p for p in new.parameters() if p.requires_grad], backend, "linear", 6)
    gen2 = torch.Generator()
    ckpt = latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None
    loaded = load_checkpoint(ckpt, new, opt, generators={"anchors": gen2})
    sched.load_state_dict(loaded.pop("scheduler"))
    _assert_same_state(opt, ref_opt)
    _train(old, ref_opt, ref_sched, gen, range(3, 6))
    _train(new, opt, sched, gen2, range(3, 6))
    for a, b in zip(old.state_dict().values(), new.state_dict().values()):
        assert torch.equal(a, b)
    assert sched.get_last_lr() == ref_sched.get_last_lr()


def test_trainer_path_never_imports_dynamo(tmp_path: Path) -> None:
    """torch.optim imports torch._dynamo (~0.8 s) at its first use; the trainer's
    optimizer, schedule and checkpoints must not (docs/operations.md, Trainer start-up)."""
    vdir = tiny_qwen3_verifier(tmp_path / "v", 128, hidden_size=32, num_layers=3)
    code = f"""
import sys, torch
import fanout.train.trainer
from fanout.families.dflash.model import DFlashDraft
from fanout.train.optim import build_optimizer
from fanout.checkpoints.layout import latest_checkpoint
from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.save import save_checkpoint
d = DFlashDraft.from_verifier({str(vdir)!r}, block_size=4, max_anchors=8, target_layer_ids=[0, 1])
opt, _, sched = build_optimizer(d.parameters(), lr=1e-3, weight_decay=0.0, backend="auto",
    max_grad_norm=1.0, warmup_ratio=0.1, scheduler_type="cosine", total_steps=10)
for p in d.parameters():
    p.grad = torch.ones_like(p)
opt.step(); sched.step(); opt.zero_grad()
save_checkpoint({str(tmp_path / "ck")!r}, d, opt, {{"step": 1, "scheduler": sched.state_dict()}})
load_checkpoint(latest_checkpoint({str(tmp_path / "ck")!r}), d, opt)
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "sympy"))))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- the schedule's total learned during the run (fanout.train.optim.LRCurve) ----------


def _factors(curve: LRCurve, steps: range) -> list[float]:
    return [curve(k) for k in steps]


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize(
    ("total", "at", "new_total"),
    [
        (None, 30, 80),  # no total: warm-up, the peak held, then the end is recorded
        (None, 3, 80),  # ... recorded during warm-up: warm-up first, then the decay
        (None, 3, 6),  # ... the stream ends before warm-up would: it stops at once
        (40, 25, 90),  # an estimate, too short: decaying already, now over longer
        (90, 25, 40),  # an estimate, too long
    ],
)
def test_retarget_is_continuous_and_decays_to_zero_at_the_new_total(
    kind: Any, total: int | None, at: int, new_total: int
) -> None:
    curve = lr_lambda(0.1, kind, total, settled=False)
    if total is None:
        assert curve.warmup == WARMUP_STEPS_WITHOUT_TOTAL
        curve.warmup = 10  # a warm-up the tests' steps can pass
        curve.decay_start = 10
    before = _factors(curve, range(at + 1))
    curve.retarget(new_total, at, settled=True)
    after = _factors(curve, range(new_total + 1))
    assert after[at] == before[at]  # the step in use now: unchanged (no jump)
    ahead = after[at:]  # only steps from here on are ever asked for again
    peak = ahead.index(max(ahead))
    assert ahead[:peak] == sorted(ahead[:peak]) and peak <= max(0, curve.warmup - at)
    assert ahead[peak:] == sorted(ahead[peak:], reverse=True)  # from there only down
    assert ahead[-1] == 0.0 and ahead[-2] > 0.0  # 0 at the new total, not before
    # no jump: neighbouring steps differ by no more than a warm-up step or the steepest
    # slope of the decay over what is left
    steep = max(1 / curve.warmup if curve.warmup else 0, 2 / (new_total - at))
    assert max(abs(a - b) for a, b in itertools.pairwise(ahead)) <= steep + 1e-12
    assert curve.settled and curve.total == new_total


def test_retargeted_schedule_resumes_from_its_state_dict() -> None:
    """A checkpoint's schedule state (JSON, as training_state.json holds it) carries the
    retargeted curve: a schedule built without a total continues the same curve, and
    so does torch's LambdaLR given the same state."""
    params = _params(0)
    opt, sched = _fast(params, "foreach", "cosine", 0)  # total 0: none known
    for _ in range(12):
        _step(opt, sched)
    curve = sched.factor
    assert isinstance(curve, LRCurve)
    curve.retarget(30, sched.last_epoch, settled=True)
    state = json.loads(json.dumps(sched.state_dict()))
    rest = [_step(opt, sched) for _ in range(18)]
    assert rest[-1] == 0.0
    fresh_opt, fresh = _fast(_params(0), "foreach", "cosine", 0)
    ref_opt = torch.optim.AdamW(_params(0), lr=0.05)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda(0.25, "cosine", None))
    resumed: list[tuple[Any, Any]] = [(fresh_opt, fresh), (ref_opt, ref)]
    for o, s in resumed:
        s.load_state_dict(copy.deepcopy(state))
        assert [_step(o, s) for _ in range(18)] == rest


def test_a_checkpoint_from_before_lrcurve_keeps_the_curve_as_built() -> None:
    """Older checkpoints saved `lr_lambdas: [None]` (a plain function): loading one keeps
    the schedule the trainer built, as it did before."""
    _, sched = _fast(_params(0), "foreach", "cosine", STEPS)
    built = dict(vars(sched.factor))
    old = sched.state_dict() | {"lr_lambdas": [None], "last_epoch": 3, "_step_count": 4}
    sched.load_state_dict(old)
    assert vars(sched.factor) == built and sched.last_epoch == 3


def test_without_a_total_warm_up_is_a_fixed_number_of_steps_then_the_peak_holds() -> None:
    curve = lr_lambda(0.05, "cosine", None)
    w = WARMUP_STEPS_WITHOUT_TOTAL
    assert (curve.total, curve.settled, curve.warmup) == (None, False, w)
    assert curve(0) == 1 / w and curve(w - 1) == 1.0 and curve(10 * w) == 1.0
    assert lr_lambda(0.0, "cosine", None).warmup == 0  # --warmup-ratio 0: none at all
