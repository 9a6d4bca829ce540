"""The plots of a bench report: steps.png, live.png, util.png, curves.png.

    from fanout.bench.plots import write_plots
    names = write_plots(report, runs, out_dir)   # runs: [(ScenarioRun, telemetry.jsonl)]

Per scenario: each consumer's steps over time, the live windows (ready, and MiB on
disk) per run dir, host CPU and GPU utilization (from the telemetry JSONL), and the
drafts' learning curves (loss and train-time EAL against step, from train_log.jsonl).
matplotlib with the Agg backend: no display needed; imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fanout.bench.metrics import RunLike
from fanout.bench.telemetry import read_samples
from fanout.train.trainlog import read_train_log


def write_plots(rep: dict[str, Any], runs: Sequence[tuple[RunLike, Path]], out: Path) -> list[str]:
    """steps.png, live.png, util.png, curves.png (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    figs: dict[str, Any] = {k: plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False) for k in ("steps", "live", "util")}  # fmt: skip
    for i, (run, tel) in enumerate(runs):
        sc = rep["scenarios"][run.name]
        ax = figs["steps"][1][0][i]
        for cid, c in sc["consumers"].items():
            if c["timeline"]:
                ts, steps = zip(*c["timeline"])
                ax.plot(ts, steps, label=cid)
        ax.set(title=f"{run.name}: steps", xlabel="s since start", ylabel="step")
        if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            ax.legend(fontsize=7)
        samples = read_samples(tel) if tel.is_file() else []
        t = [x["t_wall"] - run.started_wall for x in samples]
        ax = figs["live"][1][0][i]
        ax2 = ax.twinx()
        for r in run.run_dirs:
            ready = [x.get("extra", {}).get(str(r), {}).get("ready_windows", 0) for x in samples]
            live = [x.get("run_dirs", {}).get(str(r), {}).get("bytes", 0) / 2**20 for x in samples]
            ax.step(t, ready, where="post", label=f"{r.name} windows")
            ax2.plot(t, live, ":", alpha=0.6)
        ax.set(title=f"{run.name}: live windows (— ready, ·· MiB)", xlabel="s", ylabel="windows")
        ax2.set_ylabel("MiB on disk")
        ax = figs["util"][1][0][i]
        ax.plot(t, [x.get("host_cpu_pct") for x in samples], label="host CPU %")
        for g in range(max((len(x.get("gpus", [])) for x in samples), default=0)):
            ax.plot(t, [(x.get("gpus") or [{}] * (g + 1))[g].get("util_pct") for x in samples], label=f"GPU {g} %")  # fmt: skip
        ax.set(title=f"{run.name}: utilization", xlabel="s", ylabel="%", ylim=(0, 105))
        if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            ax.legend(fontsize=7)
    figs["curves"] = _learning_curves(plt, runs)
    names = []
    for k, (fig, _) in figs.items():
        fig.tight_layout()
        fig.savefig(out / f"{k}.png", dpi=80)
        plt.close(fig)
        names.append(f"{k}.png")
    return names


def _learning_curves(plt: Any, runs: Sequence[tuple[RunLike, Path]]) -> Any:
    """curves.png: loss and EAL against step, one line per draft, one row per scenario
    (the drafts step at the same pace, so a steps-over-time plot cannot tell them apart)."""
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.6 * len(runs)), squeeze=False)
    for i, (run, _) in enumerate(runs):
        for role in run.roles:
            if role.kind != "consumer" or role.save_path is None:
                continue
            recs = read_train_log(role.save_path)
            if not recs:
                continue
            k = max(1, len(recs) // 50)  # moving mean over ~2% of the run: single steps are noisy
            for j, key in enumerate(("loss", "eal")):
                ys = [float(r[key]) for r in recs]
                smooth = [sum(ys[max(0, n - k + 1) : n + 1]) / len(ys[max(0, n - k + 1) : n + 1]) for n in range(len(ys))]  # fmt: skip
                axes[i][j].plot([r["step"] for r in recs], smooth, label=role.name)
        for j, key in enumerate(("loss", "EAL (train-time)")):
            ax = axes[i][j]
            ax.set(title=f"{run.name}: {key}", xlabel="step", ylabel=key)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return fig, axes
