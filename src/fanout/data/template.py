"""Chat template rendering and the exact assistant loss mask, from ONE rendering.

    from fanout.data.template import load_chat_spec, ChatEncoder
    spec = load_chat_spec("../shared/data/tokenizers/qwen3", cache_root)  # builds once, cached
    enc = ChatEncoder(spec)                    # tokenizers + jinja2 only: no torch, no transformers
    ids, mask, lengths = enc.encode([conv])    # flat int32 ids, uint8 mask, int64 lengths

    python -m fanout.data.template build TOKENIZER_DIR OUT_DIR   # what load_chat_spec runs once

`load_chat_spec` runs transformers' `AutoTokenizer` once per tokenizer (in a
subprocess, so the caller never imports torch) to write `tokenizer.json`, the chat
template(s) and the special-token map into a cache entry keyed by the tokenizer
fingerprint. Workers then need only `tokenizers` and `jinja2`.

Rendering reproduces `transformers.utils.chat_template_utils` (same sandboxed Jinja
environment: trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
`strftime_now`, non-escaping `tojson`, the special tokens passed as variables), so
the text is byte-identical to `apply_chat_template(..., tokenize=False)`; tests
assert it on every conversation of the four datasets.

Loss mask: `fanout.data.masks` decides it (the prefix rule for any template, HF's
`{% generation %}` blocks, or an exact id scan per family from `fanout.data.maskers`:
ChatML, Llama 3, Gemma, Mistral, harmony); the ChatEncoder renders, tokenizes and
applies it. See docs/data.md.

Template source: the tokenizer directory's chat template (tokenizer_config.json or
chat_template.jinja, as transformers reads them; else chat_template.json), or a file
given as `load_chat_spec(..., chat_template=FILE)` (`fanout prepare --chat-template`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from itertools import chain
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from fanout.data import maskers, masks
from fanout.data.chat import Conversation
from fanout.data.chatspec import ChatSpec
from fanout.errors import ConfigError, StorageError
from fanout.filesystem import FileSystem
from fanout.hashing import hasher
from fanout.netfs import host_build_lock, temp_tag

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
SPEC_VERSION = 2  # chat.json layout; older cache entries are rebuilt


def tokenizer_fingerprint(tok_dir: str | Path) -> str:
    """xxh3-128 (fanout.hashing) over the tokenizer files present (names and bytes)."""
    h = hasher()
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


# The --tokenizer of a command that defaults it to the verifier directory (`fanout
# produce`, `fanout regenerate`): one declaration, resolved by tokenizer_dir.
VerifierTokenizer = Annotated[
    str | None, Field(description="tokenizer dir (default: the verifier dir)")
]


def tokenizer_dir(tokenizer: str | None, verifier_dir: str) -> str:
    """The tokenizer directory of a command whose `--tokenizer` defaults to the verifier
    directory, checked to hold tokenizer files: a check that reads no model, so a
    command can refuse it before it loads or creates anything. ConfigError naming the
    flag the directory came from."""
    d = tokenizer or verifier_dir
    if any((Path(d) / name).is_file() for name in TOKENIZER_FILES):
        return d
    where = f"--tokenizer {d}" if tokenizer else f"--verifier-name-or-path {d} (no --tokenizer)"
    raise ConfigError(
        f"{where}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...); "
        "pass --tokenizer DIR"
    )


def default_cache_root() -> Path:
    return Path(os.environ.get("FANOUT_CACHE", Path.home() / ".cache" / "fanout"))


def read_chat_template(path: str | Path) -> dict[str, str]:
    """A template file: Jinja text, or JSON (`{"chat_template": str | [{name, template}]}`,
    a JSON string, or such a list) as HF's chat_template.json / tokenizer_config.json."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--chat-template: {p} is not a file")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() != ".json":
        return {"default": text}
    try:
        obj: Any = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--chat-template {p}: not valid JSON: {e}") from None
    if isinstance(obj, dict):
        obj = obj.get("chat_template")
    if isinstance(obj, str):
        return {"default": obj}
    if isinstance(obj, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in obj
    ):
        return {t["name"]: t["template"] for t in obj}
    raise ConfigError(
        f"--chat-template {p}: expected a chat_template string or a list of {{name, template}}"
    )


def _generation_eos(tok_dir: Path, added: dict[str, int]) -> tuple[str, ...]:
    """generation_config.json's eos_token_id(s) as token texts (the ones that are added
    tokens; generation stops at any of them)."""
    p = tok_dir / "generation_config.json"
    if not p.is_file():
        return ()
    try:
        eos = json.loads(p.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    by_id = {v: k for k, v in added.items()}
    return tuple(sorted({by_id[i] for i in ids if isinstance(i, int) and i in by_id}))


def load_chat_spec(
    tok_dir: str | Path,
    cache_root: str | Path | None = None,
    chat_template: str | Path | None = None,
    mask_path: str = "auto",
) -> ChatSpec:
    """Load (building once, in a subprocess) the cached tokenizer.json + chat metadata.

    `chat_template`: a template file that replaces the tokenizer's (`--chat-template`);
    `mask_path`: "auto" (chosen from the template) or a path of masks.PATHS to force
    (`--mask-path`).
    """
    tok_dir = Path(tok_dir)
    fp = tokenizer_fingerprint(tok_dir)
    entry = Path(cache_root or default_cache_root()) / "tokenizers" / fp
    meta_path = entry / "chat.json"

    def current(where: Path = entry) -> bool:
        try:
            return bool(json.loads((where / "chat.json").read_text()).get("v") == SPEC_VERSION)
        except (OSError, ValueError):
            return False

    if not current():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with host_build_lock(entry):
            if not current():
                _build_entry(tok_dir, entry, current)
    meta = json.loads(meta_path.read_text())
    templates = meta["templates"]
    source = "tokenizer"
    if chat_template is not None:
        templates, source = read_chat_template(chat_template), str(chat_template)
    elif not templates and (tok_dir / "chat_template.json").is_file():
        # HF's processor-style file, which AutoTokenizer does not read for tokenizers
        templates = read_chat_template(tok_dir / "chat_template.json")
        source = str(tok_dir / "chat_template.json")
    if not templates:
        raise ConfigError(f"--tokenizer {tok_dir}: has no chat template; pass --chat-template FILE")
    return ChatSpec(
        tokenizer_json=str(entry / "tokenizer.json"),
        fingerprint=fp,
        templates=templates,
        special_tokens=meta["special_tokens"],
        added_tokens=meta["added_tokens"],
        pad_token_id=meta["pad_token_id"],
        special_added=tuple(meta["special_added"]),
        generation_eos=_generation_eos(tok_dir, meta["added_tokens"]),
        mask_path=mask_path,
        template_source=source,
    )


def _build_entry(tok_dir: Path, entry: Path, current: Callable[[Path], bool]) -> None:
    """Build the tokenizer cache entry in a subprocess, into a temp dir of this process
    alone, and commit it unless another process (on this host or another sharing the
    cache) committed one first: then that one is used and ours dropped
    (`FileSystem.commit_dir_once`), so a reader never sees a half-built entry or loses
    the one it read. An entry of an older layout is set aside and replaced."""
    tmp = entry.with_name(f"{entry.name}.tmp{temp_tag()}")
    cmd = [sys.executable, "-m", "fanout.data.template", "build", str(tok_dir), str(tmp)]
    env = os.environ | {_PARENT_ENV: str(os.getpid())}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise ConfigError(f"--tokenizer {tok_dir}: cannot load it: {_last_line(r.stderr)}")
        FileSystem().commit_dir_once(tmp, entry, current)
    except OSError as e:
        raise StorageError(f"--tokenizer {tok_dir}: cannot cache it under {entry}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _last_line(stderr: str) -> str:
    """The error a failed build printed: its last non-empty line (a traceback's
    `Error: message`), never the traceback, so the caller's error stays one line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else "it exited with no message"


def _build(tok_dir: str, out: str) -> None:
    """Subprocess body: the only place transformers is imported on the fast path."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(Path(out) / "tokenizer.json"))
    ct = tok.chat_template
    # No template is fine here (--chat-template may supply one); load_chat_spec says so.
    templates = ct if isinstance(ct, dict) else ({"default": ct} if ct else {})
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    special = sorted(str(t.content) for t in tok.added_tokens_decoder.values() if t.special)
    meta = {
        "v": SPEC_VERSION,
        "special_added": special,
        "templates": templates,
        "special_tokens": {k: str(v) for k, v in tok.special_tokens_map.items()},
        "added_tokens": {str(k): int(v) for k, v in tok.added_tokens_encoder.items()},
        "pad_token_id": int(pad if pad is not None else 0),
    }
    (Path(out) / "chat.json").write_text(json.dumps(meta, indent=1))


# (rendered blocks so far, generation indices) while render_tracked runs, per thread.
_TRACK: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "fanout_generation_track", default=None
)


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
        # return_assistant_tokens_mask. Built as transformers' AssistantTracker: the
        # block renders unchanged; while `_TRACK` is set (render_tracked) it records
        # (start, end) of the block's text in the output, start = length rendered so far.
        tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation_support(self, caller: Any) -> str:
            rv: str = caller()
            track = _TRACK.get()
            if track is not None:
                blocks, indices = track
                start = sum(len(b) for b in blocks)
                indices.append((start, start + len(rv)))
            return rv

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
    """Per-worker: tokenizer loaded once, template compiled once; encodes whole chunks.

    The mask path (`mask_path`) is chosen from the template by `fanout.data.masks`:
    id scans mask the flat ids of a whole chunk at once; the prefix rule and
    `{% generation %}` give character spans with the rendering (`render_for_mask`).
    """

    def __init__(self, spec: ChatSpec) -> None:
        from tokenizers import Tokenizer

        self.spec = spec
        self.tokenizer = Tokenizer.from_file(spec.tokenizer_json)
        self._compiled = {name: compile_template(src) for name, src in spec.templates.items()}
        self._by_src = {spec.templates[n]: c for n, c in self._compiled.items()}
        self.turn_text = masks.turn_text_for(spec)
        self.template_family = masks.template_family(spec)
        self.masker, self.mask_note = maskers.build_masker(self)
        self.mask_path: str = self.masker.name
        self._spans = isinstance(self.masker, maskers.RuleMasker)
        ctl = masks.control_tokens(spec)
        # Two tokens (ChatML): plain `in` tests, the cheapest per message; more: one regex.
        self._ctl_a, self._ctl_b = (ctl[0], ctl[-1]) if 0 < len(ctl) <= 2 else ("", "")
        self._ctl_re = re.compile("|".join(map(re.escape, ctl))) if len(ctl) > 2 else None
        label = masks.FAMILY_LABEL.get(self.template_family, "chat template")
        self._ctl_reason = f"contains a {label} control token"

    def check(self, conv: Conversation) -> tuple[str, str] | None:
        """(field, reason) if the conversation would break the mask, else None.

        Text that contains one of the template's control tokens is encoded as that token
        (HF does the same by default), which would forge a turn boundary; such rows are
        bad input.
        """
        a, b, rx = self._ctl_a, self._ctl_b, self._ctl_re
        if rx is None and not a:
            return None
        for i, m in enumerate(conv.messages):
            c = m.get("content")
            if isinstance(c, str) and (
                (a in c or b in c) if rx is None else rx.search(c) is not None
            ):
                return f"messages[{i}].content", self._ctl_reason
        return None

    def template_messages(self, conv: Conversation) -> list[dict[str, Any]]:
        return _template_messages(conv)

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        """Render already-aliased messages (`template_messages`), e.g. a prefix."""
        src = self.spec.template_for(bool(tools))
        text: str = self._by_src[src].render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **self.spec.special_tokens,
        )
        return text

    def render(self, conv: Conversation, generation_prompt: bool = False) -> str:
        """The template's text for `conv`; with `generation_prompt`, followed by the
        assistant-turn opening a model continues from (`fanout eval`'s prompts)."""
        return self.render_messages(_template_messages(conv), conv.tools, generation_prompt)

    def render_tracked(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """Rendering plus the `{% generation %}` blocks' (start, end) character indices."""
        src = self.spec.template_for(bool(conv.tools))
        blocks: list[str] = []
        indices: list[tuple[int, int]] = []
        token = _TRACK.set((blocks, indices))
        try:
            for b in self._by_src[src].generate(
                messages=_template_messages(conv),
                tools=conv.tools,
                documents=None,
                add_generation_prompt=False,
                **self.spec.special_tokens,
            ):
                blocks.append(b)
        finally:
            _TRACK.reset(token)
        return "".join(blocks), indices

    def render_for_mask(self, conv: Conversation) -> tuple[str, list[tuple[int, int]] | None, bool]:
        """(rendering, trained character spans or None for the id scans, aligned).

        Raises masks.MaskError when the prefix rule cannot place an assistant turn.
        """
        if not self._spans:
            return self.render(conv), None, False
        if self.mask_path == masks.GENERATION:
            text, blocks = self.render_tracked(conv)
            return text, masks.cut_blocks(text, blocks, self.turn_text), False
        return masks.general_spans(self, conv)

    def rule_spans(self, conv: Conversation) -> tuple[str, list[tuple[int, int]], bool]:
        """The prefix rule's rendering and spans, whatever path this encoder uses."""
        return masks.general_spans(self, conv)

    def encode_texts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Rendered texts → (flat int32 ids, int64 lengths). No offsets are computed."""
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
        # One pass straight into the int32 buffer: no per-document arrays to concatenate.
        ids = np.fromiter(
            chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lengths.sum())
        )  # [sum L]
        return ids, lengths

    def encode_spans(
        self, texts: list[str], spans: list[list[tuple[int, int]]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Texts with trained character spans → (ids int32, mask uint8, lengths int64)."""
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=total)
        mask = np.zeros(total, np.uint8)
        o = 0
        for e, sp in zip(encs, spans):
            n = len(e)
            offs = np.asarray(e.offsets, dtype=np.int64).reshape(n, 2)  # [L, 2] char offsets
            mask[o : o + n] = masks.spans_to_mask(offs, sp)
            o += n
        return ids, mask, lengths

    def encode_rendered(
        self, texts: list[str], spans: list[list[tuple[int, int]] | None]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What `render_for_mask` gave, for a chunk → (ids int32, mask uint8, lengths int64)."""
        if not self._spans:
            ids, lengths = self.encode_texts(texts)
            return ids, self.assistant_mask(ids), lengths
        return self.encode_spans(texts, [s or [] for s in spans])

    def encode(self, convs: list[Conversation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Render + tokenize + mask a chunk. Returns ids int32 [N], mask uint8 [N], lengths int64 [n]."""
        out = [self.render_for_mask(c) for c in convs]
        return self.encode_rendered([t for t, _, _ in out], [s for _, s, _ in out])

    def assistant_mask(self, ids: np.ndarray) -> np.ndarray:
        """Loss mask for a flat id array (concatenated conversations): id-scan paths only."""
        if isinstance(self.masker, maskers.RuleMasker):
            raise ConfigError(f"mask path {self.mask_path} needs the rendering, not just ids")
        return self.masker.mask(ids)


_PARENT_ENV = "FANOUT_TEMPLATE_BUILD_PARENT"


def _exit_with_parent() -> None:
    """Exit when the process that started this build dies (its parent pid changes): a
    SIGKILLed producer must not leave its template build running on, importing
    transformers for nobody (the chaos soak found them piling up on a loaded machine)."""
    import threading

    # named by the parent: one that died while this process was still importing would
    # otherwise be missed (getppid() would already be the reaper's)
    parent = int(os.environ.get(_PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build":
        _exit_with_parent()
        _build(argv[1], argv[2])
        return 0
    print(__doc__.split("\n\n")[0], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
