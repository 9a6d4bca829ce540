"""Chaos driver: a producer and N trainers as real processes, killed -9 at random, restarted.

    python -m fanout.chaos --work-dir runs/chaos --kills 30 --conversations 700   # ~1 min
    python -m fanout.chaos --work-dir runs/soak --minutes 10 --conversations 700 --epochs 2

Builds tiny assets once (BPE tokenizer, untrained 4-layer Qwen3 with H=32, synthetic
chat JSONL), starts `fanout produce` and `fanout train --resume` ×N on one run
directory, and every `kill_every_s` seconds SIGKILLs one running role that is at
least `min_age_s` old; a killed (or crashed) role is restarted at once from its
checkpoint / the coordinator's state. While it runs it samples the coordinator
(`fanout status --json`'s snapshot) and every final-named file in windows/ (fully
verified at first sight: a partial file under a final name fails the run). At the
end it checks what the system promises (`ChaosReport.problems()`): each consumer's
train_log.jsonl is an in-order cover of the stream with repeats only right after
its own crash (`check_cover`), every capture of a window holds the same bytes,
the database's own integrity check is ok and every lease names a ready window
(`Coordinator.audit`), no lease is left and windows/ + tmp/ end empty.

Roles run from a forkserver that has already imported torch and transformers
(`launcher="fork"`): a restart then costs ~1 s instead of ~8 s of imports on a
loaded 2-core box, which is what makes 30+ kills fit a test. They still are real
processes running the same entry point as the `fanout` command (fanout.cli.main),
killed with a real SIGKILL. `launcher="exec"` starts `python -m fanout.cli` instead.

Modules: fanout.chaos.procs (assets, forkserver, role processes),
fanout.chaos.checks (cover check, sampler, end-of-run state, report),
fanout.chaos.driver (ChaosConfig, ChaosRun), fanout.chaos.soak (rounds of runs until a
kill count or a duration is met, so a soak lasts its duration on any machine),
`python -m fanout.chaos` (__main__).

May import: every layer below it (it drives the whole system as real processes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real names for type checkers; at run time they load on first use
    from fanout.chaos.checks import (
        ChaosReport,
        Cover,
        Sampler,
        check_cover,
        window_digest,
    )
    from fanout.chaos.driver import ChaosConfig, ChaosRun
    from fanout.chaos.procs import ChaosAssets, Proc, Role, build_assets, run_cli, warm_forkserver

# Names re-exported from the modules above, imported on first use (PEP 562): importing
# the folder stays free of torch, which the driver pulls in through the trainer's config.
_EXPORTS = {
    "ChaosAssets": "procs",
    "ChaosConfig": "driver",
    "ChaosReport": "checks",
    "ChaosRun": "driver",
    "Cover": "checks",
    "Proc": "procs",
    "Role": "procs",
    "Sampler": "checks",
    "build_assets": "procs",
    "check_cover": "checks",
    "run_cli": "procs",
    "warm_forkserver": "procs",
    "window_digest": "checks",
}
__all__ = [
    "ChaosAssets",
    "ChaosConfig",
    "ChaosReport",
    "ChaosRun",
    "Cover",
    "Proc",
    "Role",
    "Sampler",
    "build_assets",
    "check_cover",
    "run_cli",
    "warm_forkserver",
    "window_digest",
]
assert sorted(_EXPORTS) == __all__


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
