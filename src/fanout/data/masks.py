"""Assistant loss masks for any chat template: the prefix rule, `{% generation %}`, id scans.

    from fanout.data.masks import plan_path, build_masker, general_spans, spans_to_mask
    plan_path(spec)                      # "chatml-scan" | "llama3-scan" | … | "prefix-rule"
    masker = build_masker(encoder)       # what a ChatEncoder masks with (see docs/data.md)

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
  of the ids for the family's header and end tokens (no offsets, no prefix renders);
- `prefix-rule`: the rule itself (any template; O(turns) renders per conversation).
Every non-rule path is checked against the rule on the first conversations of each
input file at run time (`verify_against_rule`): a disagreement is a ConfigError, never
a silently different mask. `FANOUT_MASK_PATH=prefix-rule` forces the rule.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fanout.data.chatspec import ChatSpec
from fanout.errors import ConfigError

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


class MaskError(ValueError):
    """The rule cannot place an assistant turn of this conversation: a bad row."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


# --------------------------------------------------------------------------- choosing


def _template_text(spec: ChatSpec) -> str:
    return "\n".join(spec.templates.values())


def family_of(spec: ChatSpec) -> str:
    """The template family by its markers (text + the tokenizer's special tokens)."""
    src, special = _template_text(spec), set(spec.special_added)

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
    """The mask path a ChatEncoder for `spec` will use (FANOUT_MASK_PATH overrides)."""
    forced = spec.mask_path
    if forced != "auto":
        if forced not in PATHS:
            raise ConfigError(f"FANOUT_MASK_PATH={forced!r}: expected auto or one of {PATHS}")
        return forced
    if _GENERATION_TAG.search(_template_text(spec)):
        return GENERATION
    return family_of(spec)


def stop_tokens(spec: ChatSpec) -> tuple[str, ...]:
    """End-of-turn token texts: eos_token, generation_config eos ids, known end tokens
    the template uses (longest first, so matching never stops at a shorter one)."""
    src, special = _template_text(spec), set(spec.special_added)
    stops = set(spec.generation_eos)
    eos = spec.special_tokens.get("eos_token")
    if eos:
        stops.add(eos)
    stops.update(t for t in KNOWN_END_TOKENS if t in special and t in src)
    return tuple(sorted(stops, key=lambda s: (-len(s), s)))


def control_tokens(spec: ChatSpec) -> tuple[str, ...]:
    """Special tokens the template writes: message text containing one is a bad row
    (HF encodes it as the control token, which would forge a turn boundary)."""
    if family_of(spec) == CHATML:
        return ("<|im_start|>", "<|im_end|>")  # what the ChatML scan relies on
    src = _template_text(spec)
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
    src = _template_text(spec)
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


# --------------------------------------------------------------------------- id scans


def _seq_starts(ids: np.ndarray, seq: list[int]) -> np.ndarray:
    """Positions where the token sequence `seq` starts in ids."""
    n, h = ids.shape[0], len(seq)
    if n < h:
        return np.zeros(0, np.int64)
    hit = ids[: n - h + 1] == seq[0]
    for j in range(1, h):
        hit &= ids[j : n - h + 1 + j] == seq[j]
    return np.flatnonzero(hit)


def _first_at_or_after(sorted_pos: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    k = np.searchsorted(sorted_pos, x)
    return np.where(k < sorted_pos.size, sorted_pos[np.minimum(k, max(sorted_pos.size - 1, 0))], n)


def _fill(n: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """uint8 [n]: 1 on every [start, end) interval."""
    mask = np.zeros(n, np.uint8)
    if starts.size:
        delta = np.zeros(n + 1, np.int32)
        np.add.at(delta, starts, 1)
        np.add.at(delta, ends, -1)
        mask[:] = np.cumsum(delta[:n]) > 0
    return mask


@dataclass
class MarkerScan:
    """Spans from the end of an assistant header (token sequence) through the first end
    token after it; a header followed by an opener (a new turn) before any end token
    trains nothing. Exact when the header's tokens never merge with what follows
    (checked at construction: `stable_header`)."""

    name: str
    headers: list[list[int]]
    ends: list[int]
    openers: list[int]
    merge_after: list[int] | None = None  # harmony: a header right after such a span joins it

    def mask(self, ids: np.ndarray) -> np.ndarray:
        n = ids.shape[0]
        hs, cs = [], []
        for h in self.headers:
            s = _seq_starts(ids, h)
            hs.append(s)
            cs.append(s + len(h))
        if not hs:
            return np.zeros(n, np.uint8)
        order = np.argsort(np.concatenate(hs), kind="stable")
        head = np.concatenate(hs)[order]  # [A] header positions
        start = np.concatenate(cs)[order]  # [A] content starts
        if start.size == 0:
            return np.zeros(n, np.uint8)
        endpos = np.flatnonzero(np.isin(ids, self.ends))
        e = _first_at_or_after(endpos, start, n)
        valid = e < n
        if self.openers:
            opos = np.flatnonzero(np.isin(ids, self.openers))
            o = _first_at_or_after(opos, start, n)
            valid &= o > e
        head, start, e = head[valid], start[valid], e[valid] + 1
        if self.merge_after is not None and start.size > 1:
            # the previous span ends right before this header and opened with merge_after
            m = self.merge_after
            prev_open = np.ones(start.size - 1, bool)
            for j, t in enumerate(m):
                at = start[:-1] + j
                prev_open &= ids[np.minimum(at, n - 1)] == t
            join = (e[:-1] == head[1:]) & prev_open
            start[1:] = np.where(join, head[1:], start[1:])
        return _fill(n, start, e)


class ChatMLScan:
    """The ChatML id scan (Qwen2/2.5/3 and others), unchanged: see docs/data.md."""

    name = CHATML

    def __init__(self, enc: Encoder) -> None:
        tok = enc.tokenizer.token_to_id
        self.im_start = tok("<|im_start|>")
        self.im_end = tok("<|im_end|>")
        asst = enc.tokenizer.encode("assistant", add_special_tokens=False).ids
        nl = enc.tokenizer.encode("\n", add_special_tokens=False).ids
        nn = enc.tokenizer.encode("\n\n", add_special_tokens=False).ids
        self.think = tok("<think>")
        self.end_think = tok("</think>")
        # "\n\n" only matters inside empty think blocks: needed single only with think tokens.
        has_think = self.think is not None and self.end_think is not None
        if len(asst) != 1 or len(nl) != 1 or (has_think and len(nn) != 1):
            raise _Unavailable("'assistant' / newline are not single tokens")
        self.assistant, self.nl, self.nn = asst[0], nl[0], nn[0] if len(nn) == 1 else -1

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Loss mask for a flat id array (any number of concatenated ChatML conversations)."""
        n = ids.shape[0]
        mask = np.zeros(n, np.uint8)
        if n < 2:
            return mask
        nxt = np.empty_like(ids)  # [N] ids shifted left by one, -1 padded
        nxt[:-1], nxt[-1] = ids[1:], -1
        starts = np.flatnonzero((ids == self.im_start) & (nxt == self.assistant))  # [A]
        if starts.size == 0:
            return mask

        def at(pos: np.ndarray) -> np.ndarray:  # ids[pos] with -1 past the end
            ok = pos < n
            return np.where(ok, ids[np.minimum(pos, n - 1)], -1)

        h = starts + 2
        h = h + (at(h) == self.nl)  # the header's own "\n" is not trained
        if self.think is not None and self.end_think is not None:
            # Template-inserted empty think block: <think> "\n\n" </think> then "\n\n".
            empty = (at(h) == self.think) & (at(h + 1) == self.nn) & (at(h + 2) == self.end_think)
            h = h + 3 * empty
            h = h + (empty & (at(h) == self.nn))
        ends = np.flatnonzero(ids == self.im_end)  # [E]
        k = np.searchsorted(ends, h)  # first <|im_end|> at/after the content start
        e = np.where(
            k < ends.size, ends[np.minimum(k, ends.size - 1)] + 1, n
        )  # exclusive, keeps <|im_end|>
        delta = np.zeros(n + 1, np.int32)  # +1 at span starts, -1 after span ends
        np.add.at(delta, h, 1)
        np.add.at(delta, e, -1)
        mask[:] = np.cumsum(delta[:n]) > 0
        return mask


class _Unavailable(Exception):
    """A fast path's preconditions do not hold for this tokenizer: use the rule."""


_PROBES = ("Hello", "1", "你好", "(x)", '"q"', "-", "x\ny", "\u00e9t\u00e9")


def _ids(enc: Encoder, text: str) -> list[int]:
    return list(enc.tokenizer.encode(text, add_special_tokens=False).ids)


def _special_id(enc: Encoder, tok: str) -> int:
    i = enc.tokenizer.token_to_id(tok)
    if i is None or tok not in enc.spec.special_added:
        raise _Unavailable(f"{tok!r} is not a special token of this tokenizer")
    return int(i)


def stable_header(enc: Encoder, text: str) -> list[int]:
    """Ids of a header, provided they do not depend on the text that follows it."""
    h = _ids(enc, text)
    for probe in _PROBES:
        if _ids(enc, text + probe)[: len(h)] != h:
            raise _Unavailable(f"header {text!r} merges with the text after it")
    return h


def _scan_for(path: str, enc: Encoder) -> MarkerScan:
    spec = enc.spec
    if path == LLAMA3:
        hdr = stable_header(enc, "<|start_header_id|>assistant<|end_header_id|>\n\n")
        ends = [
            _special_id(enc, t) for t in ("<|eot_id|>", "<|eom_id|>") if t in spec.special_added
        ]
        return MarkerScan(path, [hdr], ends, [])
    if path == GEMMA:
        hdr = stable_header(enc, "<start_of_turn>model\n")
        return MarkerScan(path, [hdr], [_special_id(enc, "<end_of_turn>")], [])
    if path == MISTRAL:
        src = _template_text(spec)
        heads = [[_special_id(enc, t)] for t in ("[/INST]", "[/TOOL_RESULTS]") if t in src]
        openers = [
            _special_id(enc, t)
            for t in ("[INST]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]")
            if t in src and t in spec.special_added
        ]
        eos = spec.special_tokens.get("eos_token", "</s>")
        return MarkerScan(path, heads, [_special_id(enc, eos)], openers)
    if path == HARMONY:
        hdr = stable_header(enc, "<|start|>assistant")
        ends = [_special_id(enc, t) for t in ("<|end|>", "<|return|>", "<|call|>")]
        analysis = [_special_id(enc, "<|channel|>"), *_ids(enc, "analysis")]
        return MarkerScan(path, [hdr], ends, [], merge_after=analysis)
    raise _Unavailable(path)


class RuleMasker:
    """Marker for the span paths (the rule, generation tags): masks come with the
    rendering (`ChatEncoder.render_for_mask`), not from the ids."""

    def __init__(self, name: str) -> None:
        self.name = name


Masker = ChatMLScan | MarkerScan | RuleMasker


def build_masker(enc: Encoder) -> tuple[Masker, str | None]:
    """(masker, why the planned fast path was not usable, if it was not)."""
    path = plan_path(enc.spec)
    if path in (RULE, GENERATION):
        return RuleMasker(path), None
    try:
        if path == CHATML:
            return ChatMLScan(enc), None
        return _scan_for(path, enc), None
    except _Unavailable as e:
        if enc.spec.mask_path != "auto":
            raise ConfigError(f"FANOUT_MASK_PATH={path}: not usable here: {e}") from None
        return RuleMasker(RULE), f"{path} not usable ({e}); using {RULE}"


def forced_path_from_env() -> str:
    return os.environ.get("FANOUT_MASK_PATH", "auto") or "auto"
