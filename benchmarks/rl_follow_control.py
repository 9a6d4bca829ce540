"""The same-steps control of benchmarks/rl_follow.py: the draft trained as long as the followed one, on the first version's traffic alone.

    .venv/bin/python benchmarks/rl_follow.py --json benchmarks/results/rl_follow.json   # runs it
    from rl_follow_control import same_steps   # benchmarks/ on sys.path, as rl_follow.py has it
    ckpt, info = same_steps(work, v0001_dir, first_records, steps, rows_a_pass, pcfg, tcfg, 600)

The frozen draft (rl_follow.py, step 4) stops training at the freeze; the followed one
goes on for as many steps again as the later versions' traffic gives. Their τ ratio
mixes what following the versions taught with what more steps teach. This control
separates the two: the same draft (the same recipe, seed and flags), trained from its
start on the first version's traffic alone, captured offline with that version (`fanout
produce --data FIRST --epochs E`: as many passes as the steps need), for exactly the
followed draft's steps (`fanout train --max-steps`). τ followed ÷ τ control, both against
the newest version, is the gain of following the verifier at equal steps.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Any

from drift import latest, start, step_of, stop, wait_for
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.train.config import TrainConfig
from record import Row

# the live run's producer fields that only a followed source has
FOLLOW_ONLY = ("follow", "follow_verifier", "follow_flush_s", "follow_chunk_records",
               "follow_keep_windows")  # fmt: skip


def same_steps(work: Path, version: Path, records: list[str], steps: int, rows_a_pass: int,
               pcfg: dict[str, Any], tcfg: dict[str, Any],
               timeout_s: float) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """Train the control in `work` (emptied first): `records` (the first version's
    traffic, JSONL lines) captured with `version`, the live run's producer and trainer
    flags (`pcfg`, `tcfg`) less what only following has, for `steps` optimizer steps.
    `rows_a_pass`: about the rows one pass gives (the steps the live trainer made on the
    same traffic by the freeze), so the passes are enough twice over. Its final
    checkpoint and {steps (its step), asked (`steps`), passes}."""
    shutil.rmtree(work, ignore_errors=True)
    run, save, logs = work / "run", work / "drafts" / "d", work / "logs"
    logs.mkdir(parents=True)
    data = work / "first.jsonl"
    data.write_text("".join(r + "\n" for r in records))
    passes = math.ceil(2 * steps / max(1, rows_a_pass)) + 1  # the producer waits at K
    p = {k: v for k, v in pcfg.items() if k not in FOLLOW_ONLY}
    p |= {"run_dir": str(run), "verifier_name_or_path": str(version), "data": [str(data)],
          "epochs": passes}  # fmt: skip
    t = {k: v for k, v in tcfg.items() if k != "max_verifier_lag"}  # one version: no lag
    t |= {"run_dir": str(run), "verifier_name_or_path": str(version), "save_path": str(save),
          "max_steps": steps}  # fmt: skip
    cli = [sys.executable, "-m", "fanout.cli"]
    procs: dict[str, Any] = {}
    try:
        prod = start([*cli, "produce", *to_flags(ProducerConfig, p)], logs / "producer.log")
        procs["control producer"] = (prod, logs / "producer.log")
        trainer = start([*cli, "train", *to_flags(TrainConfig, t)], logs / "trainer.log")
        procs["control trainer"] = (trainer, logs / "trainer.log")
        wait_for(lambda: trainer.poll() == 0, timeout_s, "the same-steps control", procs)
    finally:
        for proc, _ in procs.values():
            stop(proc)
    ck = latest(save)
    if ck is None:
        raise SystemExit("rl_follow: the same-steps control saved no checkpoint:\n"
                         + (logs / "trainer.log").read_text()[-3000:])  # fmt: skip
    return ck, {"steps": step_of(ck), "asked": steps, "passes": passes}


def control_row(ev: dict[str, Any], control: dict[str, Any], goal: float, size: str) -> Row:
    """The record's row: τ of the followed draft ÷ the control's, against the newest
    version (`ev`: rl_follow.tau's, both drafts in it), with the bounds both 95% CIs give."""
    f, s = ev["followed"], ev["same_steps"]
    ratio = f["tau"] / s["tau"]
    b = (
        (f["ci95"][0] / s["ci95"][1], f["ci95"][1] / s["ci95"][0])
        if f["ci95"] and s["ci95"]
        else None
    )
    return Row(stage="eval", name="tau_ratio_rl_follow_same_steps",
               what="RL co-training: τ against the newest verifier version, draft trained with "
               "--follow-verifier ÷ the same draft trained as many steps on the first "
               "version's traffic alone",
               result=round(ratio, 4), unit="×", spread=(round(b[0], 4), round(b[1], 4)) if b else None,
               spread_kind="bounds from both 95% CIs", n=ev["prompts"], n_of="prompts",
               goal=f">= {goal}", met=ratio >= goal,
               conditions=f"{size}; the control: {control['steps']} steps over "
               f"{control['passes']} passes of v0001's traffic")  # fmt: skip
