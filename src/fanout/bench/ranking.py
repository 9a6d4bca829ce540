"""Drafts of several families trained on one stream, ranked side by side (`fanout demo`,
benchmarks/families.py).

    from fanout.bench.ranking import rank_drafts, ranking_lines, plot_tau
    rows = rank_drafts(eval_report, {"dflash": ckpt_dir, ...}, {"dflash": save_path})
    print("\\n".join(ranking_lines(rows))); plot_tau(rows, out / "tau.png")

One row per draft, best τ at T = 0 first: its family, τ with its 95% interval at each
evaluated temperature (`fanout eval`'s figures), the train-time estimate its checkpoint
recorded (EAL), the median train step (fetch excluded: forward + backward + optimizer,
from train_log.jsonl), its trainable parameters and the size of the checkpoint a server
loads (`model.safetensors`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from safetensors import safe_open

from fanout.train.trainlog import read_train_log


def checkpoint_params(ckpt: Path) -> tuple[int, int]:
    """(trainable parameters, bytes) of a checkpoint's `model.safetensors`: every tensor
    but those its family declares frozen (`Family.frozen_tensors`: the verifier's head,
    vocabulary maps, EAGLE-3's embedding), the family read from its `config.json`."""
    import json

    from fanout.families.registry import family_of_model_type

    f = ckpt / "model.safetensors"
    cfg = json.loads((ckpt / "config.json").read_text())
    frozen = family_of_model_type(
        cfg.get("speculators_model_type"), where=str(ckpt / "config.json")
    ).frozen_tensors
    n = 0
    with safe_open(str(f), "pt") as st:
        for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if k not in frozen:
                n += _numel(st.get_slice(k).get_shape())
    return n, f.stat().st_size


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def step_ms(save_path: Path, skip: int = 2) -> float | None:
    """Median forward + backward + optimizer milliseconds of a trainer's steps (the
    first `skip` left out: first-call allocations)."""
    recs = read_train_log(save_path)[skip:]
    if not recs:
        return None
    return statistics.median(r["fwd_ms"] + r["bwd_ms"] + r["opt_ms"] for r in recs)


def rank_drafts(
    report: dict[str, Any], ckpts: dict[str, Path], save_paths: dict[str, Path]
) -> list[dict[str, Any]]:
    """The rows (module docstring), best τ at T = 0 first."""
    rows = []
    for name, d in report["drafts"].items():
        params, size = checkpoint_params(ckpts[name])
        taus = {
            t: {"tau": f["acceptance_length"], "ci95": f["acceptance_length_ci95"]}
            for t, f in d["at_temperature"].items()
        }
        rows.append({
            "draft": name,
            "family": d.get("family", "dflash"),
            "block_size": d["block_size"],
            "tau": taus,
            "train_eal": d["train_eal"],
            "proposed_length": d.get("proposed_length"),
            "step_ms": step_ms(save_paths[name]),
            "parameters": params,
            "checkpoint_bytes": size,
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["tau"].get("0.0", {"tau": 0.0})["tau"])


def _tau(r: dict[str, Any], t: str) -> str:
    f = r["tau"].get(t)
    if f is None:
        return "—"
    ci = f["ci95"]
    return f"{f['tau']:.2f} ({ci[0]:.2f}–{ci[1]:.2f})" if ci else f"{f['tau']:.2f}"


def ranking_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The ranking as a text table (one line per draft, best first)."""
    temps = sorted({t for r in rows for t in r["tau"]}, key=float)
    head = f"{'#':>2} {'draft':<12} {'family':<8} {'bs':>3} " + " ".join(
        f"{'τ T=' + t + ' (95% CI)':>20}" for t in temps
    )
    head += f" {'train EAL':>9} {'step ms':>8} {'params':>9} {'ckpt MiB':>8}"
    lines = [head]
    for i, r in enumerate(rows, 1):
        eal = f"{r['train_eal']:.2f}" if r["train_eal"] is not None else "—"
        ms = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "—"
        lines.append(
            f"{i:>2} {r['draft']:<12} {r['family']:<8} {r['block_size']:>3} "
            + " ".join(f"{_tau(r, t):>20}" for t in temps)
            + f" {eal:>9} {ms:>8} {r['parameters']:>9,} {r['checkpoint_bytes'] / 2**20:>8.2f}"
        )
    return lines


def draft_label(row: dict[str, Any]) -> str:
    """A draft's name, and its family under it when the name does not say it already
    (`dflash2`, not `dflash2 / dflash2`)."""
    draft, fam = str(row["draft"]), str(row["family"])
    return draft if fam in (draft, "") else f"{draft}\n{fam}"


def plot_tau(rows: list[dict[str, Any]], out: Path) -> Path:
    """One bar per draft and temperature: τ with its 95% interval (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({t for r in rows for t in r["tau"]}, key=float)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(rows), 3.6))
    width = 0.8 / max(len(temps), 1)
    for j, t in enumerate(temps):
        xs, ys, err = [], [], []
        for i, r in enumerate(rows):
            f = r["tau"].get(t)
            if f is None:
                continue
            lo, hi = f["ci95"] or (f["tau"], f["tau"])
            xs.append(i + j * width)
            ys.append(f["tau"])
            err.append((f["tau"] - lo, hi - f["tau"]))
        ax.bar(xs, ys, width, yerr=list(zip(*err)) if err else None, capsize=3, label=f"T={t}")
    ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([draft_label(r) for r in rows], fontsize=8)
    ax.set(ylabel="τ (tokens per verifier forward)", title="acceptance length per draft")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = [
    "checkpoint_params",
    "draft_label",
    "plot_tau",
    "rank_drafts",
    "ranking_lines",
    "step_ms",
]
