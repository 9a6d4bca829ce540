"""Model cards: `README.md` beside a draft's `config.json`, from a `fanout eval` report.

    fanout eval ... --draft runs/r1/drafts/b8 --temperature 0 1 --model-card

writes `runs/r1/drafts/b8/checkpoint-XXXXXXXX/README.md`: the verifier, the layers the
draft reads (HF numbering, `aux_hidden_state_layer_ids`, as vLLM/speculators count
them), block size, training data and steps when the checkpoint records them, and τ with
its acceptance per block position at every evaluated temperature — the layout of
published speculator model cards, so the checkpoint dir is ready to upload as is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fanout.checkpoints.format import checkpoint_family, read_config, saved_config
from fanout.families.numbering import to_serving_layer_ids
from fanout.filesystem import FileSystem


def _row(t: str, f: dict[str, Any], suffix: str = "") -> str:
    tau = f[f"acceptance_length{suffix}"]
    pos = " / ".join(f"{a:.2f}" for a in f[f"per_position_acceptance{suffix}"])
    ci = f.get("acceptance_length_ci95") if not suffix else None
    ci_s = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "—"
    steps = f["verify_steps"] if not suffix else "—"
    rule = "served (greedy draft)" if not suffix else "sampled draft, min(1, p/q)"
    return f"| {t} | {rule} | {tau:.2f} | {ci_s} | {steps} | {pos} |"


def _training_state(ckpt: Path) -> dict[str, Any]:
    try:
        state = json.loads((ckpt / "training_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def model_card(ckpt: Path, name: str, report: dict[str, Any]) -> str:
    """The card's markdown for draft `name` of `report` (checkpoint dir `ckpt`)."""
    cfg = read_config(ckpt)
    fam = checkpoint_family(ckpt, cfg)
    fan = cfg.get("fanout", {})
    dcfg = saved_config(fan)
    verifier = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "?")
    layers = to_serving_layer_ids(dcfg.get("target_layer_ids", []))
    d = report["drafts"][name]
    ec = report["config"]
    data = fan.get("train_data") or fan.get("data") or "not recorded in the checkpoint"
    steps = fan.get("step", _training_state(ckpt).get("step", "not recorded"))
    eal = fan.get("train_eal")
    lines = [
        "---",
        f"base_model: {verifier}",
        f"tags: [speculative-decoding, {fam.name}, speculators, fanout]",
        "---",
        "",
        f"# {fam.name} draft `{name}` for {verifier}",
        "",
        "| | |",
        "|---|---|",
        f"| verifier | {verifier} |",
        f"| verifier layers read (HF numbering, `aux_hidden_state_layer_ids`) | {layers} |",
        f"| block size | {cfg.get('block_size', dcfg.get('block_size'))} |",
        f"| draft layers | {dcfg.get('num_layers', '?')} |",
        f"| draft vocabulary | {cfg.get('draft_vocab_size', '?')} tokens |",
        f"| training data | {data} |",
        f"| training steps | {steps} |",
        f"| train-time EAL | {eal if eal is not None else 'not recorded'} |",
        "",
        "## Acceptance length τ (`fanout eval`)",
        "",
        f"{report['prompts']} prompts of `{ec['data']}`, up to {ec['max_new_tokens']} new "
        f"tokens each, {ec['dtype']} on {report['hardware']}; top-p {ec['top_p']}, top-k "
        f"{ec['top_k'] or 'off'}, seed {ec['seed']}. τ = tokens per verifier forward (bonus "
        "token included); 95% interval: normal approximation, per-prompt cluster SE. "
        "Lossless at T = 0 (every output equal to greedy token for token): "
        f"{'yes' if report['lossless'] else 'NO'}.",
        "",
        "| T | rule | τ | 95% CI | verify steps | acceptance at block position 1 / 2 / … |",
        "|---|---|---|---|---|---|",
    ]
    for t, f in d["at_temperature"].items():
        lines.append(_row(t, f))
        if "acceptance_length_sampled_draft" in f:
            lines.append(_row(t, f, "_sampled_draft"))
    lines += [
        "",
        "The served rule is what vLLM's DFlash/EAGLE proposers run: the draft proposes its "
        "argmax tokens; at T > 0 the verifier accepts token d with probability p(d) and "
        "otherwise samples from p without d. Load with speculators "
        f"(`speculators_model_type: {fam.speculators_model_type}` in config.json) "
        + (
            f"or serve with vLLM's speculative method `{fam.serving_method}`."
            if fam.served_by_vllm
            else "; vLLM has no proposer for this family yet: the figures above are "
            "speculators' reference decoding."
        ),
        "",
    ]
    return "\n".join(lines)


def write_model_card(ckpt: Path, name: str, report: dict[str, Any]) -> Path:
    out = Path(ckpt) / "README.md"
    # the card sits in a served checkpoint: a reader never sees half of it
    FileSystem().write_atomic(out, model_card(Path(ckpt), name, report).encode())
    return out


__all__ = ["model_card", "write_model_card"]
