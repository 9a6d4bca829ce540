"""Chat template rendering and the exact assistant loss mask, from ONE rendering.

    from fanout.template import load_chat_spec, ChatEncoder
    spec = load_chat_spec("../shared/data/tokenizers/qwen3", cache_root)  # builds once, cached
    enc = ChatEncoder(spec)                    # tokenizers + jinja2 only: no torch, no transformers
    ids, mask, lengths = enc.encode([conv])    # flat int32 ids, uint8 mask, int64 lengths

    python -m fanout.template build TOKENIZER_DIR OUT_DIR   # what load_chat_spec runs once

`load_chat_spec` runs transformers' `AutoTokenizer` once per tokenizer (in a
subprocess, so the caller never imports torch) to write `tokenizer.json`, the chat
template(s) and the special-token map into a cache entry keyed by the tokenizer
fingerprint. Workers then need only `tokenizers` and `jinja2`.

Rendering reproduces `transformers.utils.chat_template_utils` (same sandboxed Jinja
environment: trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
`strftime_now`, non-escaping `tojson`, the special tokens passed as variables), so
the text is byte-identical to `apply_chat_template(..., tokenize=False)`; tests
assert it on every conversation of the four datasets.

Loss mask (ChatML templates: Qwen2/2.5/3 and others using `<|im_start|>`/`<|im_end|>`),
derived by a numpy scan of the ids of the single rendering — see docs/data.md:
- 1 from the first token after the assistant header `<|im_start|>assistant\\n`
  through the turn's closing `<|im_end|>` (the model must learn to stop);
- 0 on the header, on the `\\n` after `<|im_end|>`, on system/user/tool turns, and
  on Qwen3's template-inserted EMPTY think block `<think>\\n\\n</think>\\n\\n`
  (scaffolding the template adds to the final turn only; a think block with real
  reasoning is generated text and is masked 1);
- a token that straddles the header and the content (content starting with a
  newline merges with the header's `\\n`) counts as content, the rule HF's
  `assistant_masks` uses (any overlap with the span).
Added tokens split the text before BPE, so no token can straddle `<|im_start|>`,
`<|im_end|>`, `<think>` or `</think>`; that is what makes the id scan exact.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from fanout.chat import Conversation
from fanout.errors import ConfigError

# Files in an HF tokenizer directory that can change ids or the rendering.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def tokenizer_fingerprint(tok_dir: str | Path) -> str:
    """xxh3-128 over the tokenizer files present (names and bytes)."""
    h = xxhash.xxh3_128()
    d = Path(tok_dir)
    found = False
    for name in TOKENIZER_FILES:
        p = d / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0")
            h.update(p.read_bytes())
    if not found:
        raise ConfigError(f"--tokenizer: no tokenizer files in {d}")
    return h.hexdigest()


@dataclass(frozen=True)
class ChatSpec:
    """Everything a worker needs to render + tokenize + mask; small and picklable."""

    tokenizer_json: str
    fingerprint: str  # tokenizer fingerprint
    templates: dict[str, str]  # name -> Jinja source ("default", maybe "tool_use")
    special_tokens: dict[str, str]  # passed to the template like transformers does
    added_tokens: dict[str, int] = field(default_factory=dict)
    pad_token_id: int = 0

    def template_fingerprint(self) -> str:
        blob = json.dumps([self.templates, self.special_tokens], sort_keys=True)
        return xxhash.xxh3_128_hexdigest(blob.encode())

    def template_for(self, has_tools: bool) -> str:
        # Same choice as PreTrainedTokenizerBase.get_chat_template for a dict of templates.
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ConfigError(f"tokenizer has no default chat template (has {sorted(self.templates)})")


def default_cache_root() -> Path:
    return Path(os.environ.get("FANOUT_CACHE", Path.home() / ".cache" / "fanout"))


def load_chat_spec(tok_dir: str | Path, cache_root: str | Path | None = None) -> ChatSpec:
    """Load (building once, in a subprocess) the cached tokenizer.json + chat metadata."""
    from filelock import FileLock

    tok_dir = Path(tok_dir)
    fp = tokenizer_fingerprint(tok_dir)
    entry = Path(cache_root or default_cache_root()) / "tokenizers" / fp
    meta_path = entry / "chat.json"
    if not meta_path.is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(entry) + ".lock"):
            if not meta_path.is_file():
                tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
                cmd = [sys.executable, "-m", "fanout.template", "build", str(tok_dir), str(tmp)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise ConfigError(f"--tokenizer {tok_dir}: cannot load it: {r.stderr[-2000:]}")
                os.replace(tmp, entry)  # atomic: the entry appears whole or not at all
    meta = json.loads(meta_path.read_text())
    return ChatSpec(
        tokenizer_json=str(entry / "tokenizer.json"),
        fingerprint=fp,
        templates=meta["templates"],
        special_tokens=meta["special_tokens"],
        added_tokens=meta["added_tokens"],
        pad_token_id=meta["pad_token_id"],
    )


def _build(tok_dir: str, out: str) -> None:
    """Subprocess body: the only place transformers is imported on the fast path."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(Path(out) / "tokenizer.json"))
    ct = tok.chat_template
    if ct is None:
        raise SystemExit(f"{tok_dir}: tokenizer has no chat_template")
    templates = ct if isinstance(ct, dict) else {"default": ct}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    meta = {
        "templates": templates,
        "special_tokens": {k: str(v) for k, v in tok.special_tokens_map.items()},
        "added_tokens": {str(k): int(v) for k, v in tok.added_tokens_encoder.items()},
        "pad_token_id": int(pad if pad is not None else 0),
    }
    (Path(out) / "chat.json").write_text(json.dumps(meta, indent=1))


@functools.cache
def _sandbox_class() -> Any:
    """transformers' ImmutableSandboxedEnvironment, with two exact shortcuts.

    Profiled, ~half of a render went to the sandbox's per-access checks. For plain
    builtin values the safety answer depends only on (type, name), so it is memoised;
    and `message.role` on a plain dict, which the sandbox answers by first raising
    AttributeError, goes straight to the key when `dict` has no such attribute.
    Anything else takes the sandbox's own path.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = (str, dict, list, tuple, int, float, bool, type(None))
    dict_attrs = frozenset(dir(dict))
    safe: dict[tuple[type, str], bool] = {}

    class Sandbox(ImmutableSandboxedEnvironment):
        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            key = (type(obj), attr)
            if key[0] not in plain:
                return bool(super().is_safe_attribute(obj, attr, value))
            ok = safe.get(key)
            if ok is None:
                ok = safe[key] = bool(super().is_safe_attribute(obj, attr, value))
            return ok

        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is dict and attribute not in dict_attrs:
                try:
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    return Sandbox


def compile_template(source: str) -> Any:
    """Compile a chat template in the same Jinja environment transformers uses."""
    import jinja2
    import jinja2.ext

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; transformers overrides it exactly like this.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}…{% endgeneration %}` marks assistant text for HF's
        # return_assistant_tokens_mask; rendering ignores it (as transformers does).
        tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = _sandbox_class()(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationTag],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)


def _template_messages(conv: Conversation) -> list[dict[str, Any]]:
    # transformers aliases reasoning under `thinking` too (gpt-oss templates read it).
    out = []
    for m in conv.messages:
        r = m.get("reasoning_content")
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else m)
    return out


class ChatEncoder:
    """Per-worker: tokenizer loaded once, template compiled once; encodes whole chunks."""

    def __init__(self, spec: ChatSpec) -> None:
        from tokenizers import Tokenizer

        self.spec = spec
        self.tokenizer = Tokenizer.from_file(spec.tokenizer_json)
        self._compiled = {name: compile_template(src) for name, src in spec.templates.items()}
        self._by_src = {spec.templates[n]: c for n, c in self._compiled.items()}
        tok = self.tokenizer.token_to_id
        need = {"<|im_start|>", "<|im_end|>"}
        if not all(tok(t) is not None for t in need) or not any(
            "<|im_start|>" in s for s in spec.templates.values()
        ):
            raise ConfigError(
                "loss mask: only ChatML templates (<|im_start|>/<|im_end|>) are supported; "
                "this tokenizer's template is not one"
            )
        self.im_start = tok("<|im_start|>")
        self.im_end = tok("<|im_end|>")
        asst = self.tokenizer.encode("assistant", add_special_tokens=False).ids
        nl = self.tokenizer.encode("\n", add_special_tokens=False).ids
        nn = self.tokenizer.encode("\n\n", add_special_tokens=False).ids
        self.think = tok("<think>")
        self.end_think = tok("</think>")
        # "\n\n" only matters inside empty think blocks: needed single only with think tokens.
        has_think = self.think is not None and self.end_think is not None
        if len(asst) != 1 or len(nl) != 1 or (has_think and len(nn) != 1):
            raise ConfigError("loss mask: 'assistant' / newline are not single tokens")
        self.assistant, self.nl, self.nn = asst[0], nl[0], nn[0] if len(nn) == 1 else -1

    def check(self, conv: Conversation) -> tuple[str, str] | None:
        """(field, reason) if the conversation would break the id scan, else None.

        Text that contains a ChatML marker is encoded as the marker token (HF does the
        same by default), which would forge a turn boundary; such rows are bad input.
        """
        for i, m in enumerate(conv.messages):
            c = m.get("content")
            if isinstance(c, str) and ("<|im_start|>" in c or "<|im_end|>" in c):
                return f"messages[{i}].content", "contains a ChatML control token"
        return None

    def render(self, conv: Conversation) -> str:
        src = self.spec.template_for(bool(conv.tools))
        text: str = self._by_src[src].render(
            messages=_template_messages(conv),
            tools=conv.tools,
            documents=None,
            add_generation_prompt=False,
            **self.spec.special_tokens,
        )
        return text

    def encode_texts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Rendered texts → (flat int32 ids, int64 lengths). No offsets are computed."""
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
        # One pass straight into the int32 buffer: no per-document arrays to concatenate.
        ids = np.fromiter(
            chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lengths.sum())
        )  # [sum L]
        return ids, lengths

    def encode(self, convs: list[Conversation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Render + tokenize + mask a chunk. Returns ids int32 [N], mask uint8 [N], lengths int64 [n]."""
        ids, lengths = self.encode_texts([self.render(c) for c in convs])
        return ids, self.assistant_mask(ids), lengths

    def assistant_mask(self, ids: np.ndarray) -> np.ndarray:
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


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build":
        _build(argv[1], argv[2])
        return 0
    print(__doc__.split("\n\n")[0], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
