"""`fanout eval`: real speculative decoding with trained drafts — lossless, measured.

    fanout eval --verifier-name-or-path VERIFIER_DIR --tokenizer TOKENIZER_DIR \\
        --draft runs/r1/drafts/b8 --draft runs/r1/drafts/b16 \\
        --data heldout.jsonl --num-prompts 8 --max-new-tokens 128 --json eval.json

For each prompt (the conversation up to its last assistant turn, rendered with the
generation prompt by the tokenizer's chat template) it decodes greedily with the
verifier alone, then with DFlash speculative decoding for every draft
(`fanout.decode.spec_decode`), and checks the outputs are identical token for token. It
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
from typing import Any

import torch

from fanout.checkpoints.format import read_config
from fanout.checkpoints.layout import latest_checkpoint
from fanout.checkpoints.load import load_draft
from fanout.data.chat import ChatFormat, Conversation, load_conversations
from fanout.decode.config import EvalConfig, temperature_key
from fanout.decode.eval_table import table
from fanout.decode.spec_decode import Decoder, DecodeResult, Rule, Tie, first_mismatch
from fanout.errors import BadRow, CheckpointError, ConfigError
from fanout.families.registry import family_of_draft
from fanout.flags import CommandFlags
from fanout.model.draft import Draft
from fanout.model.sampling import Sampling
from fanout.tracking import WandbRun, check_available


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
        if len(out) == cfg.prompt_limit():
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


def tau_interval(results: list[DecodeResult]) -> list[float] | None:
    """95% interval for τ = Σ(n+1) / Σ steps: normal approximation with the ratio's
    cluster-robust (per prompt) standard error — steps of one prompt are not independent.
    None with fewer than two prompts."""
    a = [sum(n + 1 for n in r.accepted) for r in results]
    s = [len(r.accepted) for r in results]
    m, total = len(results), sum(s)
    if m < 2 or total == 0:
        return None
    tau = sum(a) / total
    var = m / (m - 1) * sum((ai - tau * si) ** 2 for ai, si in zip(a, s))
    half = 1.96 * var**0.5 / total
    return [round(tau - half, 4), round(tau + half, 4)]


def widest_half_width(out: dict[Job, list[DecodeResult]]) -> float | None:
    """The widest half-width of τ's 95% interval over every draft and temperature (the
    served rule's τ, the one reported first), None while any is undefined."""
    widths = []
    for (_, _, rule), rs in out.items():
        if rule == "served":
            ci = tau_interval(rs)
            if ci is None:
                return None
            widths.append((ci[1] - ci[0]) / 2)
    return max(widths, default=None)


def _rates(results: list[DecodeResult]) -> tuple[int, float, float]:
    """(tokens, decode tok/s, prefill s): decode = the tokens after the prefill's one."""
    decoded = sum(len(r.tokens) - 1 for r in results)
    secs = sum(r.decode_seconds for r in results)
    return decoded, decoded / max(secs, 1e-9), sum(r.prefill_seconds for r in results)


def _figures(results: list[DecodeResult], greedy: list[DecodeResult]) -> dict[str, Any]:
    """τ, per-position acceptance, steps, CI and the decode speed-up of one (draft, T)."""
    steps = sum(len(r.accepted) for r in results)
    drafted = results[0].drafted_per_step  # the family decides
    per_pos = [sum(r.position_accepted()[k] for r in results) for k in range(drafted)]
    tau = sum(n + 1 for r in results for n in r.accepted) / max(steps, 1)
    _, tps, _ = _rates(results)
    _, g_tps, _ = _rates(greedy)
    speedup = tps / max(g_tps, 1e-9)
    return {
        "acceptance_length": round(tau, 4),
        "acceptance_length_ci95": tau_interval(results),
        "per_position_acceptance": [round(c / max(steps, 1), 4) for c in per_pos],
        "verify_steps": steps,
        "speedup_vs_greedy": round(speedup, 4),
        # a verify forward never costs less than a one-token one: speed-up > τ is a
        # measurement artefact (warm-up, load), not a result
        "speedup_exceeds_tau": speedup > tau,
    }


def _summary(
    runs: dict[tuple[float, str], list[DecodeResult]],
    greedy: list[DecodeResult],
    train_eal: float | None,
    family: str,
) -> dict[str, Any]:
    """One draft: T = 0 figures at the top level (as before), every T under
    `at_temperature`; the sampled-draft rule beside the served one, under its own name."""
    at0 = runs[(0.0, "served")]
    fig0 = _figures(at0, greedy)
    tokens, tps, prefill = _rates(at0)
    g_fw = sum(g.forwards for g in greedy)
    s_fw = sum(r.forwards for r in at0)
    at: dict[str, Any] = {}
    for (t, rule), results in runs.items():
        if rule != "served":
            continue
        entry = _figures(results, greedy)
        other = runs.get((t, "sampled_draft"))
        if other is not None:
            f = _figures(other, greedy)
            entry |= {f"{k}_sampled_draft": f[k] for k in
                      ("acceptance_length", "per_position_acceptance", "speedup_vs_greedy")}  # fmt: skip
        at[temperature_key(t)] = entry
    tau = fig0["acceptance_length"]
    proposed = [n for r in at0 for n in r.proposed]  # the family's own length rule, if any
    return {
        "family": family,
        "block_size": at0[0].block_size,  # the draft's, as trained
        "drafted_per_step": at0[0].drafted,
        "verify_width": at0[0].verify_width,  # tokens one verify forward checks
        "proposed_length": round(sum(proposed) / len(proposed), 4) if proposed else None,
        **fig0,
        "train_eal": train_eal,
        "train_serve_gap": None if train_eal is None else round(train_eal - tau, 4),
        "verifier_forwards": s_fw,
        "greedy_forwards": g_fw,
        "forwards_saved": g_fw - s_fw,
        "forwards_saved_fraction": round((g_fw - s_fw) / max(g_fw, 1), 4),
        "tokens": tokens,
        "tokens_per_s": round(tps, 2),
        "prefill_seconds": round(prefill, 4),
        "decode_seconds": round(sum(r.decode_seconds for r in at0), 4),
        "at_temperature": at,
    }


Job = tuple[str, float, str]  # (draft name, temperature, rule); ("", 0.0, "greedy")


class EvalSession:
    """The verifier, its decoder and the prompts, loaded once; `run` evaluates drafts.
    The trainer's `--eval-every` keeps one for the whole run."""

    def __init__(self, cfg: EvalConfig, layer_ids: list[int]) -> None:
        from fanout.model.verifier import load_verifier

        self.cfg = cfg
        vdir = Path(cfg.verifier_name_or_path)
        self.verifier = load_verifier(
            vdir, device=cfg.device, dtype=cfg.dtype, capture_layer_ids=layer_ids,
            num_draft_layers=None,
        )  # fmt: skip
        text_cfg = self.verifier.model.config.get_text_config()  # multimodal: its text model
        max_pos = int(getattr(text_cfg, "max_position_embeddings", 1 << 30))
        self.prompts = load_prompts(cfg, max_pos)
        self.decoder = Decoder(self.verifier, eos_ids(vdir, cfg.eos_token_id))
        self._warm = False

    def _jobs(self, drafts: dict[str, Draft]) -> list[Job]:
        jobs: list[Job] = [("", 0.0, "greedy")]
        for name in drafts:
            for t in self.cfg.temperature:
                jobs.append((name, t, "served"))
                if t > 0 and self.cfg.sampled_draft:
                    jobs.append((name, t, "sampled_draft"))
        return jobs

    def _decode(self, job: Job, p: Prompt, drafts: dict[str, Draft]) -> DecodeResult:
        cfg, dec = self.cfg, self.decoder
        name, t, rule = job
        if rule == "greedy":
            return dec.greedy(p.ids, cfg.max_new_tokens)
        s = Sampling(t, cfg.top_p, cfg.top_k)
        # the same draws for every draft and rule on a prompt (common random numbers)
        gen = torch.Generator(device=dec.device).manual_seed(cfg.seed * 1_000_003 + p.index)
        r: Rule = "sampled_draft" if rule == "sampled_draft" else "served"
        draft = drafts[name]
        context = family_of_draft(draft).drafting_context(
            draft, cached=cfg.cache_draft, num_speculative_tokens=cfg.num_speculative_tokens
        )
        return dec.speculative(p.ids, draft, cfg.max_new_tokens, s, gen, r, context=context)

    def _tie(self, p: Prompt, greedy: list[int], spec: list[int], at: int) -> Tie | None:
        """Where a speculative output first differs from greedy at `at`: the verifier's
        margin between the two tokens there; None when one output merely ends early
        (never a tie: both stop at the same EOS or length)."""
        if at >= len(greedy) or at >= len(spec):
            return None
        return self.decoder.tie([*p.ids, *greedy[:at]], greedy[at], spec[at])

    def warm(self, drafts: dict[str, Draft]) -> None:
        """Untimed: every mode once on the first prompt (first-call allocations, kernel
        choices); `run` does it at its first call."""
        for job in self._jobs(drafts):
            self._decode(job, self.prompts[0], drafts)
        self._warm = True

    def run(
        self,
        drafts: dict[str, Draft],
        train_eals: dict[str, float | None],
        *,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Decode every prompt with every draft (and plain greedy); the report.
        `progress`: a bar on stderr, one tick per prompt."""
        from tqdm import tqdm

        cfg, dec = self.cfg, self.decoder
        prompts = self.prompts[: cfg.prompt_limit()]  # loaded for this limit (or a larger one)
        missing = {i for d in drafts.values() for i in d.cfg.target_layer_ids} - set(
            self.verifier.capture_layer_ids
        )
        if missing:
            raise ConfigError(f"eval: verifier hooks lack layers {sorted(missing)}")
        jobs = self._jobs(drafts)
        if not self._warm:
            self.warm(drafts)
        # Interleaved per prompt, the order alternating, so that load drifting on a shared
        # machine and any first-call cost of a new prompt length hit every mode alike.
        out: dict[Job, list[DecodeResult]] = {job: [] for job in jobs}
        mismatches: list[dict[str, Any]] = []
        ties: list[dict[str, Any]] = []  # differences at a verifier tie (Decoder.tie)
        records: list[dict[str, Any]] = []
        # with --tau-half-width: checked every eighth of --num-prompts past it (each check
        # walks every result, so not after every prompt)
        every = max(1, cfg.num_prompts // 8)
        widest: float | None = None
        # --num-prompts first; past it (--tau-half-width) up to every prompt loaded
        bar = tqdm(total=min(cfg.num_prompts, len(prompts)), desc="eval", unit="prompt",
                   file=sys.stderr, dynamic_ncols=True, disable=not progress)  # fmt: skip
        for i, p in enumerate(prompts):
            past = i - cfg.num_prompts  # prompts decoded beyond --num-prompts
            if cfg.tau_half_width is not None and past >= 0 and past % every == 0:
                widest = widest_half_width(out)
                if widest is not None and widest <= cfg.tau_half_width:
                    break
                bar.total = len(prompts)  # τ's interval is wider than asked: go on
                bar.set_postfix_str(f"τ ±{widest:.2f} of ±{cfg.tau_half_width}" if widest else "")
            dec.greedy(p.ids, 1)  # untimed: this prompt length's prefill shapes
            done = {job: self._decode(job, p, drafts) for job in (jobs if i % 2 else jobs[::-1])}
            g = done[jobs[0]]
            rec: dict[str, Any] = {"conversation": p.index, "prompt_tokens": len(p.ids),
                                   "greedy": g.tokens, "drafts": {n: {} for n in drafts}}  # fmt: skip
            for job, r in done.items():
                out[job].append(r)
                name, t, rule = job
                if rule == "greedy":
                    continue
                slot = rec["drafts"][name].setdefault(temperature_key(t), {})
                entry = {"tokens": r.tokens, "accepted": r.accepted}
                slot.update(entry if rule == "served" else {"sampled_draft": entry})
                at = first_mismatch(g.tokens, r.tokens) if t == 0 else None
                if at is not None:
                    where = {"draft": name, "prompt": p.index, "position": at}
                    tie = self._tie(p, g.tokens, r.tokens, at)
                    if tie is None or not tie.is_tie:
                        mismatches.append(where)
                    else:
                        ties.append(where | {"margin": tie.margin, "tolerance": tie.tolerance})
            records.append(rec)
            bar.update()
        else:  # every prompt decoded: the width they reached (only when it is asked for)
            widest = widest_half_width(out) if cfg.tau_half_width is not None else None
        bar.close()
        greedy = out[jobs[0]]
        _, g_tps, _ = _rates(greedy)
        summaries = {
            name: _summary({(t, rule): rs for (n, t, rule), rs in out.items() if n == name},
                           greedy, train_eals[name], family_of_draft(drafts[name]).name)
            for name in drafts
        }  # fmt: skip
        used = prompts[: len(records)]
        precision = None
        if cfg.tau_half_width is not None:
            met = widest is not None and widest <= cfg.tau_half_width
            precision = {"target_half_width": cfg.tau_half_width, "met": met,
                         "widest_half_width": widest, "prompts_available": len(prompts)}  # fmt: skip
        return {
            "lossless": not mismatches,
            "mismatches": mismatches,
            "ties": ties,
            "drafts": summaries,
            "prompts": len(used),
            "precision": precision,
            "prompt_tokens": [len(p.ids) for p in used],
            "generated_tokens": [len(g.tokens) for g in greedy],
            "greedy_tokens_per_s": round(g_tps, 2),
            "temperatures": [temperature_key(t) for t in cfg.temperature],
            "prompt_records": records,
            "hardware": _hardware(cfg.device),
            "config": cfg.model_dump(),
        }


def load_drafts(cfg: EvalConfig) -> tuple[list[Path], dict[str, Draft], dict[str, Any]]:
    """Every `--draft` from its checkpoint files: (checkpoint dirs, drafts by name, their
    train-time EAL by name)."""
    if not cfg.draft:
        raise ConfigError("--draft: give at least one draft checkpoint or save path")
    vdir = Path(cfg.verifier_name_or_path)
    dirs = [resolve_draft_dir(d) for d in cfg.draft]
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    drafts: dict[str, Draft] = {}
    train_eals: dict[str, float | None] = {}
    for name, d in zip(draft_names(dirs), dirs):
        drafts[name] = load_draft(d, vdir, device=cfg.device, dtype=dtype)
        v = read_config(d)["fanout"].get("train_eal")
        train_eals[name] = float(v) if isinstance(v, int | float) else None
    return dirs, drafts, train_eals


def evaluate(cfg: EvalConfig, echo: Any = print, progress: bool | None = None) -> dict[str, Any]:
    """Load every `--draft` from its checkpoint files, run them (EvalSession); return the
    report (what `--json` writes); with `--model-card`, write each draft's README.md.
    `progress`: a per-prompt bar on stderr (None: when stderr is a terminal)."""
    dirs, drafts, train_eals = load_drafts(cfg)
    layers = sorted({i for d in drafts.values() for i in d.cfg.target_layer_ids})
    session = EvalSession(cfg, layers)
    ps = session.prompts
    count = f"{len(ps)}"
    if cfg.tau_half_width is not None:  # as many as τ's interval needs, from num_prompts
        count = f"{min(cfg.num_prompts, len(ps))} to {len(ps)} (until τ is ±{cfg.tau_half_width})"
    echo(
        f"fanout eval: {count} prompts ({min(len(p.ids) for p in ps)}–"
        f"{max(len(p.ids) for p in ps)} tokens), up to {cfg.max_new_tokens} new tokens each, "
        f"{len(drafts)} draft(s), {cfg.device} {cfg.dtype}, temperatures "
        f"{', '.join(temperature_key(t) for t in cfg.temperature)}"
    )
    report = session.run(
        drafts, train_eals, progress=sys.stderr.isatty() if progress is None else progress
    )
    if cfg.model_card:
        from fanout.decode.model_card import write_model_card

        for name, d in zip(report["drafts"], dirs):
            echo(f"model card: {write_model_card(d, name, report)}")
    return report


def _hardware(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


_FLAGS = CommandFlags(EvalConfig)  # `fanout eval`'s flags: EvalConfig's fields
add_arguments, config_from_args = _FLAGS.add_arguments, _FLAGS.config_from_args


def run(args: argparse.Namespace, name: str = "eval") -> int:
    cfg = config_from_args(args)
    if cfg.wandb_project:
        check_available("--wandb-project")
    try:
        report = evaluate(cfg, echo=lambda s: print(s, flush=True))
    except BadRow as e:
        raise ConfigError(f"--data: {e}") from None
    print("\n".join(table(report)))
    if cfg.wandb_project:  # τ and speed per draft, in a W&B run (fanout.tracking)
        flat = {"lossless": report["lossless"], "prompts": report["prompts"]}
        for name, s in report["drafts"].items():
            flat |= {f"{name}/{k}": v for k, v in s.items()}
        WandbRun.start(
            cfg, name="eval", group=cfg.wandb_group, job_type="eval",
            config=cfg.model_dump(mode="json"), dir=Path(cfg.json_out or ".").parent,
        ).finish(flat)  # fmt: skip
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if not report["lossless"]:
        where = "float32 must be exact" if cfg.dtype == "float32" else "bf16 numerics can do this"
        print(f"fanout eval: speculative output differs from greedy ({where})", file=sys.stderr)
        return 1 if cfg.dtype == "float32" else 0
    return 0
