"""`fanout eval`: real speculative decoding with trained drafts — lossless, measured.

    fanout eval --verifier-name-or-path VERIFIER_DIR --tokenizer TOKENIZER_DIR \\
        --draft runs/r1/drafts/b8 --draft runs/r1/drafts/b16 \\
        --data heldout.jsonl --num-prompts 8 --max-new-tokens 128 --json eval.json

For each prompt (the conversation up to its last assistant turn, rendered with the
generation prompt by the tokenizer's chat template) it decodes greedily with the
verifier alone, then with DFlash speculative decoding for every draft
(`fanout.model.spec_decode`), and checks the outputs are identical token for token. It
reports per draft: acceptance length τ (tokens per verifier forward, bonus included),
acceptance at each block position, verifier forwards saved, tokens/s and speedup over
plain greedy, and the train-time EAL the checkpoint recorded (the train/serve gap).

A `--draft` is a checkpoint directory (`checkpoint-XXXXXXXX`) or a trainer's
`--save-path` (its newest committed checkpoint). Drafts are loaded from the
speculators files alone (`config.json` + `model.safetensors`), so a passing eval also
proves the checkpoint round-trips. See docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from fanout.data.chat import ChatFormat, Conversation, load_conversations
from fanout.errors import BadRow, CheckpointError, ConfigError
from fanout.flags import add_model_flags, flag_options, model_from_args
from fanout.model.dflash import DFlashDraft
from fanout.model.spec_decode import Decoder, DecodeResult, first_mismatch
from fanout.train.checkpoint import latest_checkpoint
from fanout.train.serving import load_draft, read_config


class EvalConfig(ChatFormat):
    """Every `fanout eval` flag (the chat-format fields are ChatFormat's, as in `fanout
    prepare` and `fanout produce`)."""

    verifier_name_or_path: str = Field(description="local verifier dir (the full model)")
    draft: list[str] = Field(
        default_factory=list,
        description="draft checkpoint dir or trainer --save-path (at least one)",
        json_schema_extra=flag_options(metavar="DIR", repeatable=True),
    )
    data: str = Field(description="chat data (JSON/JSONL/Parquet, any format prepare reads)")
    tokenizer: str = Field(description="tokenizer dir with the chat template")
    max_new_tokens: int = Field(128, gt=0, description="tokens to generate per prompt")
    num_prompts: int = Field(8, gt=0, description="prompts to decode (the file's first ones)")
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="verifier and draft dtype (lossless is exact in float32)"
    )
    eos_token_id: list[int] | None = Field(
        None, description="stop tokens; default: the verifier's config / generation_config"
    )
    json_out: str | None = Field(
        None,
        description="write the full report as JSON here",
        json_schema_extra=flag_options(flag="--json", metavar="OUT"),
    )

    @field_validator("data", "tokenizer", "verifier_name_or_path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).exists():
            raise ValueError(f"{v}: no such file or directory")
        return v


@dataclass
class Prompt:
    index: int  # conversation index in the file
    ids: list[int]


# ---- inputs --------------------------------------------------------------------------


def load_prompts(cfg: EvalConfig, max_positions: int) -> list[Prompt]:
    """The first `num_prompts` conversations' prompts (up to the last assistant turn,
    generation prompt appended), skipping those too long for the verifier."""
    from fanout.data.template import ChatEncoder, load_chat_spec

    fmt = ChatFormat(**{k: getattr(cfg, k) for k in ChatFormat.model_fields})
    convs = load_conversations(cfg.data, fmt)
    enc = ChatEncoder(load_chat_spec(cfg.tokenizer))
    out: list[Prompt] = []
    for i, conv in enumerate(convs):
        last = max(j for j, m in enumerate(conv.messages) if m["role"] == "assistant")
        if last == 0:
            continue  # nothing before the assistant turn to condition on
        text = enc.render(Conversation(conv.messages[:last], conv.tools), generation_prompt=True)
        ids, _ = enc.encode_texts([text])
        if len(ids) + cfg.max_new_tokens > max_positions:
            continue
        out.append(Prompt(i, ids.tolist()))
        if len(out) == cfg.num_prompts:
            break
    if not out:
        raise ConfigError(
            f"--data {cfg.data}: no usable prompt (each needs a turn before its last assistant "
            f"turn and at most {max_positions} - --max-new-tokens tokens)"
        )
    return out


def eos_ids(verifier_dir: Path, given: list[int] | None) -> set[int]:
    """Stop tokens: `given`, else config.json's and generation_config.json's eos_token_id."""
    if given:
        return set(given)
    found: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = verifier_dir / name
        if p.is_file():
            v = json.loads(p.read_text()).get("eos_token_id")
            found |= set(v) if isinstance(v, list) else ({v} if isinstance(v, int) else set())
    return found


def resolve_draft_dir(path: str) -> Path:
    """A checkpoint dir as given, or the newest committed checkpoint under a save path."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    newest = latest_checkpoint(p)
    if newest is None:
        raise CheckpointError(f"--draft {p}: neither a checkpoint dir nor a dir holding one")
    return newest


def draft_names(dirs: list[Path]) -> list[str]:
    """Short unique names: the save path's name for `.../b8/checkpoint-N`."""
    names = [d.parent.name if d.name.startswith("checkpoint-") else d.name for d in dirs]
    if len(set(names)) < len(names):
        names = [f"{n}@{d.name}" for n, d in zip(names, dirs)]
    return names


# ---- the run -------------------------------------------------------------------------


def _summary(
    results: list[DecodeResult], greedy: list[DecodeResult], train_eal: float | None
) -> dict[str, Any]:
    bs = results[0].block_size
    steps = sum(len(r.accepted) for r in results)
    per_pos = [sum(r.position_accepted()[k] for r in results) for k in range(bs - 1)]
    tokens = sum(len(r.tokens) for r in results)
    secs = sum(r.seconds for r in results)
    g_tokens = sum(len(g.tokens) for g in greedy)
    g_secs = sum(g.seconds for g in greedy)
    g_fw = sum(g.forwards for g in greedy)
    s_fw = sum(r.forwards for r in results)
    tau = sum(n + 1 for r in results for n in r.accepted) / max(steps, 1)
    tps = tokens / max(secs, 1e-9)
    g_tps = g_tokens / max(g_secs, 1e-9)
    return {
        "block_size": bs,
        "acceptance_length": round(tau, 4),
        "train_eal": train_eal,
        "train_serve_gap": None if train_eal is None else round(train_eal - tau, 4),
        "per_position_acceptance": [round(c / max(steps, 1), 4) for c in per_pos],
        "verify_steps": steps,
        "verifier_forwards": s_fw,
        "greedy_forwards": g_fw,
        "forwards_saved": g_fw - s_fw,
        "forwards_saved_fraction": round((g_fw - s_fw) / max(g_fw, 1), 4),
        "tokens": tokens,
        "tokens_per_s": round(tps, 2),
        "speedup_vs_greedy": round(tps / max(g_tps, 1e-9), 4),
    }


class EvalSession:
    """The verifier, its decoder and the prompts, loaded once; `run` evaluates drafts.
    The trainer's `--eval-every` keeps one for the whole run."""

    def __init__(self, cfg: EvalConfig, layer_ids: list[int]) -> None:
        from fanout.model.verifier import load_verifier

        self.cfg = cfg
        vdir = Path(cfg.verifier_name_or_path)
        self.verifier = load_verifier(
            vdir, device=cfg.device, dtype=cfg.dtype, target_layer_ids=layer_ids,
            num_draft_layers=None,
        )  # fmt: skip
        max_pos = int(getattr(self.verifier.model.config, "max_position_embeddings", 1 << 30))
        self.prompts = load_prompts(cfg, max_pos)
        self.decoder = Decoder(self.verifier, eos_ids(vdir, cfg.eos_token_id))
        self._warm = False

    def run(
        self, drafts: dict[str, DFlashDraft], train_eals: dict[str, float | None]
    ) -> dict[str, Any]:
        cfg, dec, prompts = self.cfg, self.decoder, self.prompts
        missing = {i for d in drafts.values() for i in d.cfg.target_layer_ids} - set(
            self.verifier.target_layer_ids
        )
        if missing:
            raise ConfigError(f"eval: verifier hooks lack layers {sorted(missing)}")
        if not self._warm:  # untimed: first-call allocations and kernel choices
            dec.greedy(prompts[0].ids, cfg.max_new_tokens)
            for draft in drafts.values():
                dec.speculative(prompts[0].ids, draft, cfg.max_new_tokens)
            self._warm = True
        # Interleaved per prompt (greedy, then each draft) so that load drifting on a
        # shared machine hits both sides of the speedup ratio alike.
        greedy: list[DecodeResult] = []
        runs: dict[str, list[DecodeResult]] = {name: [] for name in drafts}
        mismatches: list[dict[str, Any]] = []
        for p in prompts:
            g = dec.greedy(p.ids, cfg.max_new_tokens)
            greedy.append(g)
            for name, draft in drafts.items():
                r = dec.speculative(p.ids, draft, cfg.max_new_tokens)
                at = first_mismatch(g.tokens, r.tokens)
                if at is not None:
                    mismatches.append({"draft": name, "prompt": p.index, "position": at})
                runs[name].append(r)
        g_secs = max(sum(g.seconds for g in greedy), 1e-9)
        return {
            "lossless": not mismatches,
            "mismatches": mismatches,
            "drafts": {name: _summary(runs[name], greedy, train_eals[name]) for name in drafts},
            "prompts": len(prompts),
            "prompt_tokens": [len(p.ids) for p in prompts],
            "generated_tokens": [len(g.tokens) for g in greedy],
            "greedy_tokens_per_s": round(sum(len(g.tokens) for g in greedy) / g_secs, 2),
            "hardware": _hardware(cfg.device),
            "config": cfg.model_dump(),
        }


def evaluate(cfg: EvalConfig, echo: Any = print) -> dict[str, Any]:
    """Load every `--draft` from its checkpoint files, run them (EvalSession); return the
    report (what `--json` writes)."""
    if not cfg.draft:
        raise ConfigError("--draft: give at least one draft checkpoint or save path")
    vdir = Path(cfg.verifier_name_or_path)
    dirs = [resolve_draft_dir(d) for d in cfg.draft]
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    drafts: dict[str, DFlashDraft] = {}
    train_eals: dict[str, float | None] = {}
    for name, d in zip(draft_names(dirs), dirs):
        drafts[name] = load_draft(d, vdir, device=cfg.device, dtype=dtype)
        v = read_config(d)["fanout"].get("train_eal")
        train_eals[name] = float(v) if isinstance(v, int | float) else None
    layers = sorted({i for d in drafts.values() for i in d.cfg.target_layer_ids})
    session = EvalSession(cfg, layers)
    ps = session.prompts
    echo(
        f"fanout eval: {len(ps)} prompts ({min(len(p.ids) for p in ps)}–"
        f"{max(len(p.ids) for p in ps)} tokens), {cfg.max_new_tokens} new tokens each, "
        f"{len(drafts)} draft(s), {cfg.device} {cfg.dtype}"
    )
    return session.run(drafts, train_eals)


def _hardware(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def table(report: dict[str, Any]) -> list[str]:
    """The stdout table: τ beside train EAL, per-position acceptance, speed."""
    lines = [
        f"{'draft':<14} {'bs':>3} {'τ':>6} {'train EAL':>9} {'fwd saved':>10} "
        f"{'tok/s':>8} {'speedup':>8}  acceptance at block position 1, 2, …"
    ]
    for name, d in report["drafts"].items():
        eal = f"{d['train_eal']:.2f}" if d["train_eal"] is not None else "—"
        pos = " ".join(f"{a:.2f}" for a in d["per_position_acceptance"])
        lines.append(
            f"{name:<14} {d['block_size']:>3} {d['acceptance_length']:>6.2f} {eal:>9} "
            f"{100 * d['forwards_saved_fraction']:>9.1f}% {d['tokens_per_s']:>8.1f} "
            f"{d['speedup_vs_greedy']:>7.2f}×  {pos}"
        )
    lines.append(
        f"greedy alone: {report['greedy_tokens_per_s']:.1f} tok/s on {report['hardware']}; "
        + (
            "lossless: every speculative output equals greedy token for token"
            if report["lossless"]
            else f"NOT LOSSLESS: {len(report['mismatches'])} mismatch(es), first "
            f"{report['mismatches'][0]}"
        )
    )
    return lines


def add_arguments(p: argparse.ArgumentParser, name: str = "eval") -> None:
    add_model_flags(p, EvalConfig)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """EvalConfig from `--config FILE` and flags (flags win)."""
    return model_from_args(EvalConfig, args)


def run(args: argparse.Namespace, name: str = "eval") -> int:
    cfg = config_from_args(args)
    try:
        report = evaluate(cfg, echo=lambda s: print(s, flush=True))
    except BadRow as e:
        raise ConfigError(f"--data: {e}") from None
    print("\n".join(table(report)))
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if not report["lossless"]:
        where = "float32 must be exact" if cfg.dtype == "float32" else "bf16 numerics can do this"
        print(f"fanout eval: speculative output differs from greedy ({where})", file=sys.stderr)
        return 1 if cfg.dtype == "float32" else 0
    return 0
