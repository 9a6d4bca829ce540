"""The plots of a bench report: steps.png, ready.png, util.png, curves.png.

    from fanout.bench.plots import write_plots
    names = write_plots(report, runs, out_dir)   # runs: [(ScenarioRun, telemetry.jsonl)]

Per scenario: each consumer's steps over time, the ready windows (and MiB on disk)
per run dir, host CPU and GPU utilization (from the telemetry JSONL), and the
drafts' learning curves (loss and train-time EAL against step, from train_log.jsonl).
matplotlib with the Agg backend: no display needed; imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fanout.bench.config import scenario_title
from fanout.bench.scenario import ScenarioRun
from fanout.bench.telemetry import read_samples
from fanout.train.trainlog import read_train_log


def write_plots(
    rep: dict[str, Any], runs: Sequence[tuple[ScenarioRun, Path]], out: Path
) -> list[str]:
    """steps.png, ready.png, util.png, curves.png (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    figs: dict[str, Any] = {k: plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False) for k in ("steps", "ready", "util")}  # fmt: skip
    for i, (run, tel) in enumerate(runs):
        sc = rep["scenarios"][run.name]
        title = scenario_title(run.name, len(sc["consumers"]))
        ax = figs["steps"][1][0][i]
        for j, (cid, c) in enumerate(sc["consumers"].items()):
            if c["timeline"]:  # drafts step at one pace: marker and dash tell them apart
                ts, steps = zip(*c["timeline"])
                ax.plot(ts, steps, label=cid, **line_style(j, len(ts)))
        ax.set(title=f"{title}: steps", xlabel="s since start", ylabel="step")
        if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            ax.legend(fontsize=7)
        samples = read_samples(tel) if tel.is_file() else []
        t = [x["t_wall"] - run.started_wall for x in samples]
        ax = figs["ready"][1][0][i]
        ax2 = ax.twinx()
        for c, r in enumerate(run.run_dirs):  # a colour per run dir; windows solid, MiB dashed
            ready = [x.get("extra", {}).get(str(r), {}).get("ready_windows", 0) for x in samples]
            mib = [x.get("run_dirs", {}).get(str(r), {}).get("bytes", 0) / 2**20 for x in samples]
            ax.step(t, ready, where="post", color=f"C{c}", label=f"{r.name}: ready windows")
            ax2.plot(t, mib, "--", color=f"C{c}", alpha=0.7, label=f"{r.name}: MiB on disk")
        ax.set(title=f"{title}: ready windows", xlabel="s", ylabel="ready windows (solid)")
        ax2.set_ylabel("MiB on disk (dashed)")
        lines = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
        if lines:  # one legend for both axes
            ax.legend(lines, [h.get_label() for h in lines], fontsize=7, loc="upper left")
        ax = figs["util"][1][0][i]
        ax.plot(t, [x.get("host_cpu_pct") for x in samples], label="host CPU %")
        for g in range(max((len(x.get("gpus", [])) for x in samples), default=0)):
            ax.plot(t, [(x.get("gpus") or [{}] * (g + 1))[g].get("util_pct") for x in samples], label=f"GPU {g} %")  # fmt: skip
        ax.set(title=f"{title}: utilization", xlabel="s", ylabel="%", ylim=(0, 105))
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


LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "x", "P", "*")


def line_style(i: int, points: int) -> dict[str, Any]:
    """The i-th line's look: its own marker and dash (lines that lie on top of each other
    stay apart), about ten markers along it."""
    return {
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "marker": MARKERS[i % len(MARKERS)],
        "markevery": max(1, points // 10),
        "markersize": 4,
    }


def _learning_curves(plt: Any, runs: Sequence[tuple[ScenarioRun, Path]]) -> Any:
    """curves.png: loss and EAL against step, one line per draft, one row per scenario
    (the drafts step at the same pace, so a steps-over-time plot cannot tell them apart)."""
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.6 * len(runs)), squeeze=False)
    for i, (run, _) in enumerate(runs):
        drafts = [r for r in run.roles if r.kind == "consumer" and r.save_path is not None]
        title = scenario_title(run.name, len(drafts))
        for d, role in enumerate(drafts):
            assert role.save_path is not None
            recs = read_train_log(role.save_path)
            if not recs:
                continue
            k = max(1, len(recs) // 50)  # moving mean over ~2% of the run: single steps are noisy
            for j, key in enumerate(("loss", "eal")):
                ys = [float(r[key]) for r in recs]
                smooth = [sum(ys[max(0, n - k + 1) : n + 1]) / len(ys[max(0, n - k + 1) : n + 1]) for n in range(len(ys))]  # fmt: skip
                axes[i][j].plot([r["step"] for r in recs], smooth, label=role.name, **line_style(d, len(recs)))  # fmt: skip
        for j, key in enumerate(("loss", "EAL (train-time)")):
            ax = axes[i][j]
            ax.set(title=f"{title}: {key}", xlabel="step", ylabel=key)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return fig, axes
