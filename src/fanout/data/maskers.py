"""The maskers a ChatEncoder masks with: the per-family id scans, or the rule's marker.

    from fanout.data.maskers import build_masker
    masker, note = build_masker(encoder)   # note: why the planned scan was not usable
    mask = masker.mask(ids)                # a scan: uint8 [L] from the ids alone

`build_masker` takes the path `fanout.data.masks.plan_path` chose. The scans
(`chatml-scan`, `llama3-scan`, `gemma-scan`, `mistral-scan`, `harmony-scan`) find the
family's assistant header and end tokens in the ids with numpy: no offsets, no prefix
renders. A scan whose preconditions do not hold for the tokenizer (a header that
merges with the text after it, a marker that is not a special token) falls back to
the prefix rule (`RuleMasker`: the mask comes with the rendering, from
`fanout.data.masks.general_spans`), and the note says why; with `--mask-path` forcing
the scan, that is a ConfigError instead. Every scan is checked against the rule at run time
(see fanout.data.masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fanout.data.masks import (
    CHATML,
    GEMMA,
    GENERATION,
    HARMONY,
    LLAMA3,
    MISTRAL,
    RULE,
    Encoder,
    plan_path,
    template_text,
)
from fanout.errors import ConfigError


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
        src = template_text(spec)
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
            raise ConfigError(f"--mask-path {path}: not usable here: {e}") from None
        return RuleMasker(RULE), f"{path} not usable ({e}); using {RULE}"
