"""Assistant loss masks for any chat template: the prefix rule, `{% generation %}`, path choice.

    from fanout.data.masks import plan_path, general_spans, spans_to_mask
    plan_path(spec)                      # "chatml-scan" | "llama3-scan" | … | "prefix-rule"
    text, spans, aligned = general_spans(encoder, conv)   # the rule (see docs/data.md)
    mask = spans_to_mask(offsets, spans)                  # uint8 [L]

The id scans (the `*-scan` paths) and `build_masker`, which gives a ChatEncoder the
masker of its path, are in fanout.data.maskers.

THE RULE (every path computes it; docs/data.md has the policy table per family).
The trained text of assistant message i is what the template adds for that message
when the conversation so far is rendered with the generation prompt:

    P = render(messages[:i], add_generation_prompt=True)     # the prompt
    Q = render(messages[:i+1])                                # message i as the final turn
    gen = Q[len(P):]

cut after the turn's end token (the first stop token, see `stop_tokens`, in the run
of whitespace and special tokens that ends `gen`: separators after it such as
ChatML's "\\n" are not generated), minus a leading EMPTY reasoning block
(`<think>\\n\\n</think>\\n\\n`, scaffolding some templates put into the final turn only).
It is located in the full rendering F = render(messages) at len(P). Tokens of F that
overlap a trained span are 1 (HF's `assistant_masks` overlap rule).

Templates where P is not a prefix of F, or F renders message i differently from the
final-turn rendering Q (reasoning dropped from past turns, `<|return|>` rewritten to
`<|end|>`, a system prompt or tool list moved to the last user turn) are detected per
conversation and ALIGNED: the span of message i in F starts after the assistant
header (P's text from its last special token on, searched from the end of the previous
assistant span when P is not a prefix of F); if F's text there differs from the
trained text, the span runs to the first stop token after their common prefix and
must contain the message's content, else the row is refused (`MaskError`, a bad row
"assistant message i cannot be located in the rendering"). Never a silently wrong mask.

PATHS, chosen from the template (`plan_path`), the summary says which ran:
- `generation-tags`: the template marks assistant text with `{% generation %}` (HF's
  `return_assistant_tokens_mask` semantics: tokens overlapping a block are 1), then the
  same end-of-turn cut as the rule;
- `chatml-scan`, `llama3-scan`, `gemma-scan`, `mistral-scan`, `harmony-scan`: numpy scans
  of the ids for the family's header and end tokens (no offsets, no prefix renders;
  fanout.data.maskers);
- `prefix-rule`: the rule itself (any template; O(turns) renders per conversation).
Every non-rule path is checked against the rule on the first conversations of each
input file at run time (`fanout.data.workers.verify_against_rule`): a disagreement is a
ConfigError, never a silently different mask. `--mask-path prefix-rule` (DataOptions'
`mask_path`) forces the rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from fanout.data.chatspec import ChatSpec
from fanout.errors import ConfigError, FanoutError

if TYPE_CHECKING:
    from fanout.data.chat import Conversation

# Bump when a policy or path changes the masks: it is part of the prepared-rows cache key.
RULES_VERSION = 2

RULE = "prefix-rule"
GENERATION = "generation-tags"
CHATML, LLAMA3, GEMMA, MISTRAL, HARMONY = (
    "chatml-scan",
    "llama3-scan",
    "gemma-scan",
    "mistral-scan",
    "harmony-scan",
)
PATHS = (RULE, GENERATION, CHATML, LLAMA3, GEMMA, MISTRAL, HARMONY)
# `--mask-path` (DataOptions.mask_path): "auto" or one of PATHS, forced
MaskPathName = Literal[
    "auto",
    "prefix-rule",
    "generation-tags",
    "chatml-scan",
    "llama3-scan",
    "gemma-scan",
    "mistral-scan",
    "harmony-scan",
]

# Tokens at which generation stops for the families we know (HF generation_config
# eos lists); only those the tokenizer has as special tokens and the template uses
# count, plus the tokenizer's eos_token and its generation_config.json eos ids.
KNOWN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "</s>",
    "<｜end▁of▁sentence｜>",
    "<|endoftext|>",
)
EMPTY_REASONING = re.compile(r"<think>\s*</think>\s*")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Conversations checked against the rule at the start of each input file.
VERIFY_ROWS = 8


class MaskError(FanoutError, ValueError):
    """The rule cannot place an assistant turn of this conversation: a bad row (the
    workers count and skip it; a FanoutError like every typed error, and a ValueError for
    callers that catch that)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


# --------------------------------------------------------------------------- choosing


def template_text(spec: ChatSpec) -> str:
    """Every template of the tokenizer as one text (what markers are looked for in)."""
    return "\n".join(spec.templates.values())


def template_family(spec: ChatSpec) -> str:
    """The template family by its markers (text + the tokenizer's special tokens)."""
    src, special = template_text(spec), set(spec.special_added)

    def has(*toks: str) -> bool:
        return all(t in src for t in toks) and all(t in special for t in toks)

    if has("<|im_start|>", "<|im_end|>"):
        return CHATML
    if has("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        return LLAMA3
    if has("<start_of_turn>", "<end_of_turn>"):
        return GEMMA
    if has("[INST]", "[/INST]") and spec.special_tokens.get("eos_token") in special:
        return MISTRAL
    if has("<|start|>", "<|message|>", "<|channel|>") and "<|end|>" in special:
        return HARMONY
    return RULE


def plan_path(spec: ChatSpec) -> str:
    """The mask path a ChatEncoder for `spec` will use (`--mask-path` forces one)."""
    forced = spec.mask_path
    if forced != "auto":
        if forced not in PATHS:
            raise ConfigError(f"--mask-path {forced!r}: expected auto or one of {PATHS}")
        return forced
    if _GENERATION_TAG.search(template_text(spec)):
        return GENERATION
    return template_family(spec)


def stop_tokens(spec: ChatSpec) -> tuple[str, ...]:
    """End-of-turn token texts: eos_token, generation_config eos ids, known end tokens
    the template uses (longest first, so matching never stops at a shorter one)."""
    src, special = template_text(spec), set(spec.special_added)
    stops = set(spec.generation_eos)
    eos = spec.special_tokens.get("eos_token")
    if eos:
        stops.add(eos)
    stops.update(t for t in KNOWN_END_TOKENS if t in special and t in src)
    return tuple(sorted(stops, key=lambda s: (-len(s), s)))


def control_tokens(spec: ChatSpec) -> tuple[str, ...]:
    """Special tokens the template writes: message text containing one is a bad row
    (HF encodes it as the control token, which would forge a turn boundary)."""
    if template_family(spec) == CHATML:
        return ("<|im_start|>", "<|im_end|>")  # what the ChatML scan relies on
    src = template_text(spec)
    toks = {t for t in spec.special_added if t in src}
    for key in ("eos_token", "bos_token"):
        v = spec.special_tokens.get(key)
        if v and v in spec.special_added:
            toks.add(v)
    return tuple(sorted(toks, key=lambda s: (-len(s), s)))


FAMILY_LABEL = {
    CHATML: "ChatML",
    LLAMA3: "Llama 3",
    GEMMA: "Gemma",
    MISTRAL: "Mistral",
    HARMONY: "harmony",
    RULE: "chat template",
}


# --------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class TurnText:
    """How turn text is cut: stop tokens and every special token (longest first)."""

    stops: tuple[str, ...]
    specials: tuple[str, ...]

    def trailing_start(self, text: str, end: int | None = None) -> int:
        """Start of the run of whitespace and special tokens that ends text[:end]."""
        i = len(text) if end is None else end
        while i > 0:
            if text[i - 1].isspace():
                i -= 1
                continue
            for s in self.specials:
                if text.endswith(s, 0, i):
                    i -= len(s)
                    break
            else:
                return i
        return i

    def end_of_turn(self, gen: str) -> int | None:
        """Index just past the turn's end token: the first stop token in the trailing
        run of `gen` (None when the run has none)."""
        j, n = self.trailing_start(gen), len(gen)
        while j < n:
            if gen[j].isspace():
                j += 1
                continue
            for s in self.stops:
                if gen.startswith(s, j):
                    return j + len(s)
            for s in self.specials:
                if gen.startswith(s, j):
                    j += len(s)
                    break
            else:
                return None
        return None

    def anchor(self, prompt: str) -> str | None:
        """The assistant header: the prompt's text from its last special token on."""
        best = -1
        for s in self.specials:
            k = prompt.rfind(s)
            best = max(best, k)
        return prompt[best:] if best >= 0 else None

    def unsplit(self, text: str, pos: int) -> int:
        """Move `pos` back to the start of a special token it would cut in two."""
        for s in self.specials:
            j = text.find(s, max(0, pos - len(s) + 1), pos + len(s) - 1)
            if 0 <= j < pos < j + len(s):
                return j
        return pos

    def first_stop(self, text: str, start: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for s in self.stops:
            k = text.find(s, start)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, k + len(s))
        return best


class Encoder(Protocol):
    """What the maskers read from their encoder (a fanout.data.template.ChatEncoder,
    which builds its masker from itself: typed here so this module never imports it)."""

    spec: ChatSpec
    tokenizer: Any  # a tokenizers.Tokenizer
    turn_text: TurnText

    def template_messages(self, conv: Conversation) -> list[dict[str, Any]]: ...

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
    ) -> str: ...


def turn_text_for(spec: ChatSpec) -> TurnText:
    """The special tokens the template writes (plus bos/eos and the stops): the only
    ones a rendering's structure is made of (a vocabulary's hundreds of reserved
    tokens are not, and would only slow every search down)."""
    src = template_text(spec)
    stops = stop_tokens(spec)
    toks = {t for t in spec.special_added if t in src} | set(stops)
    for key in ("eos_token", "bos_token"):
        v = spec.special_tokens.get(key)
        if v and v in spec.special_added:
            toks.add(v)
    return TurnText(stops, tuple(sorted(toks, key=lambda s: (-len(s), s))))


def _leading_policy(gen: str, end: int) -> int:
    """Chars at the start of `gen` that are template scaffolding, not generated."""
    m = EMPTY_REASONING.match(gen, 0, end)
    return m.end() if m else 0


def _common_prefix(a: str, b: str, b0: int) -> int:
    n = min(len(a), len(b) - b0)
    lo = 0
    while lo < n and a[lo] == b[b0 + lo]:
        lo += 1
    return lo


def _content_core(m: dict[str, Any]) -> list[str]:
    """Strings that must appear inside an aligned span of message m."""
    c = m.get("content")
    out = []
    if isinstance(c, str):
        core = c.split("</think>")[-1].strip()
        if core:
            out.append(core)
    if not out:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                out.append(fn["name"])
    return out


def general_spans(enc: Encoder, conv: Conversation) -> tuple[str, list[tuple[int, int]], bool]:
    """The rule: (full rendering, trained char spans in it, whether alignment was needed).

    Raises MaskError when an assistant turn cannot be placed (a bad row).
    """
    tt = enc.turn_text
    msgs = enc.template_messages(conv)
    full = enc.render_messages(msgs, conv.tools, False)
    spans: list[tuple[int, int]] = []
    cursor, aligned = 0, False
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        where = f"messages[{i}]"
        try:
            p = enc.render_messages(msgs[:i], conv.tools, True)
            q = enc.render_messages(msgs[: i + 1], conv.tools, False)
        except Exception as e:  # the template refuses this prefix
            raise MaskError(
                where, f"chat template failed on the conversation prefix: {e}"
            ) from None
        anchor: str | None = None
        if q.startswith(p):
            gen = q[len(p) :]
        else:  # the template moved or rewrote earlier text once message i followed
            anchor = tt.anchor(p)
            k = q.rfind(anchor) if anchor else -1
            if k < 0:
                raise MaskError(where, "assistant message cannot be located in the rendering")
            gen = q[k + len(anchor or "") :]
        end = tt.end_of_turn(gen)
        if end is None:
            raise MaskError(where, "assistant turn has no end-of-turn token")
        lead = _leading_policy(gen, end)
        if full.startswith(p) and p:
            pos = len(p)
        else:
            aligned = True
            anchor = anchor or tt.anchor(p)
            k = full.find(anchor, cursor) if anchor else -1
            if k < 0:
                raise MaskError(where, "assistant message cannot be located in the rendering")
            pos = k + len(anchor or "")
        if full.startswith(gen[:end], pos):  # exactly as the final-turn rendering
            span = (pos + lead, pos + end)
        elif full.startswith(gen[lead:end], pos):  # without the scaffolding
            span = (pos, pos + end - lead)
        else:  # rendered differently as a past turn: align on the content
            aligned = True
            t = gen[lead:end]
            start = pos + lead if lead and full.startswith(gen[:lead], pos) else pos
            c = tt.unsplit(full, start + _common_prefix(t, full, start))
            stop = tt.first_stop(full, max(c, start))
            if stop is None:
                raise MaskError(where, "assistant message cannot be located in the rendering")
            span = (start, stop[1])
            body = full[span[0] : span[1]]
            if not all(s in body for s in _content_core(m)):
                raise MaskError(where, "assistant message cannot be located in the rendering")
        if span[0] < cursor:
            raise MaskError(where, "assistant message cannot be located in the rendering")
        spans.append(span)
        cursor = span[1]
    return full, spans, aligned


def cut_blocks(text: str, blocks: list[tuple[int, int]], tt: TurnText) -> list[tuple[int, int]]:
    """`{% generation %}` blocks with the rule's end-of-turn cut applied (a separator
    after the end token, inside the block, is not trained)."""
    out = []
    for a, b in blocks:
        if b <= a:
            continue
        end = tt.end_of_turn(text[a:b])
        out.append((a, a + end) if end is not None else (a, b))
    return out


def spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [L]: 1 for tokens (offsets [L, 2]) overlapping any span (sorted, disjoint)."""
    mask = np.zeros(offsets.shape[0], np.uint8)
    if not spans or offsets.shape[0] == 0:
        return mask
    sp = np.asarray(spans, dtype=np.int64)  # [S, 2]
    k = np.searchsorted(sp[:, 1], offsets[:, 0], side="right")  # first span ending after start
    ok = k < sp.shape[0]
    kk = np.minimum(k, sp.shape[0] - 1)
    mask[:] = ok & (offsets[:, 1] > sp[kk, 0])
    return mask
