"""What `fanout eval` prints from its report: the table, the verdict per pair of drafts
and the lossless line.

    fanout eval --draft runs/demo/drafts/b8 --draft runs/demo/drafts/b4 ...
    from fanout.decode.eval_table import table
    print("\\n".join(table(report)))   # report: fanout.decode.eval.evaluate's

Only formatting and the one rule deciding which of two drafts' τ is higher
(`tau_verdict`); the report's figures are fanout.decode.eval's.
"""

from __future__ import annotations

from typing import Any


def tau_verdict(
    a: str, a_fig: dict[str, Any], b: str, b_fig: dict[str, Any]
) -> tuple[str | None, str]:
    """Which of two drafts has the higher τ, from their figures at one temperature
    (`acceptance_length`, `acceptance_length_ci95`): (winner, why) when their 95%
    intervals are apart, (None, why) when they overlap (touching counts: no difference
    shown) or either is undefined (fewer than two prompts). The one rule the table's
    verdict lines print."""

    def shown(name: str, f: dict[str, Any]) -> str:
        lo, hi = f["acceptance_length_ci95"]
        return f"{name} τ {f['acceptance_length']:.2f} ({lo:.2f}–{hi:.2f})"

    ca, cb = a_fig["acceptance_length_ci95"], b_fig["acceptance_length_ci95"]
    if ca is None or cb is None:
        return None, f"{a} vs {b}: no τ interval (fewer than 2 prompts), no verdict"
    if ca[0] <= cb[1] and cb[0] <= ca[1]:
        return None, (
            f"{shown(a, a_fig)} vs {shown(b, b_fig)}: intervals overlap, no difference shown"
        )
    win, lose = ((a, a_fig), (b, b_fig)) if ca[0] > cb[1] else ((b, b_fig), (a, a_fig))
    return win[0], f"{win[0]} wins: {shown(*win)} vs {shown(*lose)}, intervals apart"


def verdicts(report: dict[str, Any]) -> list[str]:
    """One line per pair of drafts and temperature (`tau_verdict`); none for one draft."""
    names = list(report["drafts"])
    lines = []
    for t in report["drafts"][names[0]]["at_temperature"] if names else []:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                fa, fb = (report["drafts"][n]["at_temperature"][t] for n in (a, b))
                lines.append(f"verdict at T={t}: {tau_verdict(a, fa, b, fb)[1]}")
    return lines


def generated_line(report: dict[str, Any]) -> str:
    """What greedy decoding generated per prompt: mean (min–max), and how many stopped
    at a stop token before --max-new-tokens (the header gives only the cap)."""
    g = report["generated_tokens"]
    cap = report["config"]["max_new_tokens"]
    early = sum(n < cap for n in g)
    return (
        f"generated: mean {sum(g) / len(g):.1f} ({min(g)}–{max(g)}) new tokens per prompt "
        f"(greedy; {early} of {len(g)} stopped at a stop token before --max-new-tokens {cap})"
    )


def table(report: dict[str, Any]) -> list[str]:
    """The stdout table: per draft and temperature τ (95% interval, verify steps) beside
    train EAL, per-position acceptance and the decode speed-up; then what was
    generated, the verdict per pair of drafts (`tau_verdict`) and the notes.

    `bs` is the draft's block size as trained (the report's `block_size`); `verify` the
    tokens one verify forward checks (`verify_width`: drafted per step + 1), which the
    family decides: bs for DFlash, bs + 1 for DSpark (its anchor slot drafts too),
    k + 1 for an EAGLE-3 chain of --num-speculative-tokens k. A line under the table
    says so where the two differ."""
    lines = [
        f"{'draft':<14} {'family':<8} {'bs':>3} {'verify':>6} {'T':>4} {'τ':>6} {'95% CI':>13} "
        f"{'steps':>6} {'train EAL':>9} {'speedup':>8}  acceptance at drafted token 1, 2, …"
    ]
    notes = []
    slow: list[str] = []  # temperatures where some draft decoded slower than greedy
    differ = False
    for name, d in report["drafts"].items():
        eal = f"{d['train_eal']:.2f}" if d["train_eal"] is not None else "—"
        bs, width = d["block_size"], verify_width(d)
        differ |= width != bs
        if d.get("proposed_length") is not None:
            notes.append(
                f"{name} ({d['family']}): its confidence head proposes "
                f"{d['proposed_length']:.2f} tokens per step on average at T=0 (of "
                f"{d['drafted_per_step']} drafted and verified; τ above verifies them all)"
            )
        for t, f in d["at_temperature"].items():
            ci = f["acceptance_length_ci95"]
            ci_s = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "—"
            pos = " ".join(f"{a:.2f}" for a in f["per_position_acceptance"])
            lines.append(
                f"{name:<14} {d.get('family', 'dflash'):<8} {bs:>3} {width:>6} {t:>4} "
                f"{f['acceptance_length']:>6.2f} "
                f"{ci_s:>13} {f['verify_steps']:>6} {eal:>9} "
                f"{f['speedup_vs_greedy']:>7.2f}×  {pos}"
            )
            if "acceptance_length_sampled_draft" in f:
                lines.append(
                    f"{'  sampled draft':<14} {'':<8} {'':>3} {'':>6} {t:>4} "
                    f"{f['acceptance_length_sampled_draft']:>6.2f} {'':>13} {'':>6} {'':>9} "
                    f"{f['speedup_vs_greedy_sampled_draft']:>7.2f}×  (min(1, p/q) rule)"
                )
            if f["speedup_vs_greedy"] < 1 and t not in slow:
                slow.append(t)
            if f["speedup_exceeds_tau"]:
                notes.append(
                    f"note: {name} at T={t}: speed-up {f['speedup_vs_greedy']:.2f}× exceeds "
                    f"τ {f['acceptance_length']:.2f} — impossible for a real gain (a verify "
                    "forward costs at least a one-token one): a timing artefact"
                )
    if slow:
        notes.append(
            f"note: speed-up below 1 at T={', '.join(slow)}: each verify step here costs about "
            "what a draft step does (a tiny verifier on a CPU), so drafting cannot pay; on a "
            "real verifier on a GPU a verify forward over a block costs about one over a single "
            "token and the speed-up follows τ (docs/eval.md, Speed)"
        )
    if differ:
        lines.append(
            "bs: the block size each draft was trained with; verify: the tokens one verify "
            "forward checks (drafted per step + 1: DSpark drafts its whole block, an EAGLE-3 "
            "chain --num-speculative-tokens)"
        )
    lines.append(
        f"greedy alone: {report['greedy_tokens_per_s']:.1f} tok/s decode on "
        f"{report['hardware']}; speed-ups are decode time (prefill excluded); τ interval: "
        "normal approx., per-prompt cluster SE; " + lossless_line(report)
    )
    prec = report.get("precision")
    if prec:
        w = prec["widest_half_width"]
        got = f"±{w:.3f}" if w is not None else "undefined"
        lines.append(
            f"τ precision: widest 95% half-width {got} after {report['prompts']} prompts "
            + (
                f"(target ±{prec['target_half_width']}: met)"
                if prec["met"]
                else f"— target ±{prec['target_half_width']} NOT met with all "
                f"{prec['prompts_available']} prompts available (raise --max-prompts)"
            )
        )
    return [*lines, generated_line(report), *verdicts(report), *notes]


def verify_width(d: dict[str, Any]) -> int:
    """One draft's tokens per verify forward, from its report entry (`verify_width`;
    a report from before it was recorded: drafted per step + 1, else its block size)."""
    if d.get("verify_width") is not None:
        return int(d["verify_width"])
    drafted = d.get("drafted_per_step")
    return drafted + 1 if drafted else int(d["block_size"])


def lossless_line(report: dict[str, Any]) -> str:
    """The T = 0 verdict in words: lossless, lossless apart from verifier ties (each
    difference where the verifier's top two logits are within rounding of each other,
    `Decoder.tie`), or not lossless with the first real mismatch."""
    if not report["lossless"]:
        m = report["mismatches"]
        return f"NOT LOSSLESS: {len(m)} mismatch(es), first {m[0]}"
    ties = report.get("ties") or []
    if not ties:
        return "lossless: every speculative output equals greedy token for token (T = 0)"
    worst = max(ties, key=lambda x: x["margin"])
    return (
        f"lossless: every speculative output equals greedy token for token (T = 0) but at "
        f"{len(ties)} verifier tie(s), where the two tokens' logits differ by at most "
        f"{worst['margin']:.1e} (rounding allows {worst['tolerance']:.1e}): a one-token and a "
        f"multi-token forward may break such a tie either way (first: {ties[0]['draft']}, "
        f"prompt {ties[0]['prompt']}, token {ties[0]['position']})"
    )
