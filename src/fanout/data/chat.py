"""Chat input formats → canonical messages (`role`, `content`, `tool_calls`) plus tools.

    from fanout.data.chat import ChatFormat, read_records, to_conversation
    fmt = ChatFormat(format="sharegpt")
    for where, rec in read_records("data/chat.jsonl"):   # where = (file, line)
        conv = to_conversation(rec, fmt, *where)          # raises BadRow naming file:line:field

Formats (`--format`):
- `sharegpt`: `conversations: [{from, value}]` with roles `system`, `human`, `gpt`,
  `function_call` (a JSON `{"name", "arguments"}` string → an assistant tool call),
  `observation` (→ `tool`); optional `tools` (JSON string or list of function specs)
  and `system` columns.
- `openai`: `messages: [{role, content, tool_calls?, reasoning_content?}]`, optional `tools`;
  a tool call's `id` and a tool message's `tool_call_id` are kept (Mistral templates need them).
- `pairs`: a list of turn pairs, e.g. MT-Bench-101's `history: [{user, bot}]`
  (`--messages-field history --pair-keys user,bot`).
- `auto`: decided from the first rows by `detect_format`, which says what it chose.

Input files: JSON arrays, JSONL, Parquet (needs pyarrow, the `parquet` extra).
Records are parsed in the workers from raw bytes where possible (JSONL), so the
parent never touches each row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fanout.errors import BadRow, ConfigError

FormatName = Literal["auto", "sharegpt", "openai", "pairs"]

# Canonical roles the chat templates understand.
ROLES = ("system", "user", "assistant", "tool")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",  # value is a JSON tool call, see _tool_call_from_sharegpt
    "observation": "tool",
    "tool": "tool",
}
OPENAI_ROLES = {r: r for r in ROLES}


class ChatFormat(BaseModel):
    """How input records map to messages. Declared once here: `fanout prepare`, `produce`
    and `eval` inherit these fields, one flag each (`--role-map bot=assistant,human=user`,
    `--pair-keys user,bot`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: FormatName = Field("auto", description="input shape; auto = detect from first rows")
    messages_field: str | None = Field(
        None,
        description="field holding the turns (default: conversations / messages / history)",
    )
    role_map: dict[str, str] = Field(
        default_factory=dict,
        description="extra source role → canonical role (system|user|assistant|tool), "
        "e.g. bot=assistant,human=user",
    )
    pair_keys: tuple[str, str] = Field(
        ("user", "bot"), description="pairs format: keys of the user and assistant text"
    )
    tools_field: str = Field("tools", description="field holding tool specs (JSON or list)")
    system_field: str = Field("system", description="field holding a system prompt, if any")

    @field_validator("role_map")
    @classmethod
    def _roles_known(cls, v: dict[str, str]) -> dict[str, str]:
        bad = {k: r for k, r in v.items() if r not in ROLES}
        if bad:
            raise ValueError(f"role_map targets must be one of {ROLES}, got {bad}")
        return v

    def resolved_messages_field(self) -> str:
        default = {"sharegpt": "conversations", "openai": "messages", "pairs": "history"}
        return self.messages_field or default.get(self.format, "messages")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One chat: canonical messages (dicts for the template) and optional tool specs."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


# --------------------------------------------------------------------------- reading


class ReadOptions(BaseModel):
    """How a command that reads chat data treats a bad row and shows its progress.
    Declared once here: `fanout prepare` and `produce` (through DataOptions) and
    `fanout regenerate` inherit these fields, one flag each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="bad rows: stop naming file:line:field, or skip and count"
    )
    progress: bool = Field(True, description="show a progress bar on stderr")


def file_kind(path: Path) -> Literal["jsonl", "json", "parquet"]:
    """JSONL vs JSON array vs Parquet, by suffix, then by the first byte."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".jsonl":
        return "jsonl"
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return "json" if head.startswith(b"[") else "jsonl"


def read_records(path: str | Path) -> Iterator[tuple[tuple[str, int], Any]]:
    """Yield ((file, line-or-row), record) with records parsed; for tests and detection.

    The pipeline uses `iter_raw_chunks` instead, which hands JSONL lines out unparsed.
    """
    for (file, first), items, raw, _ in iter_raw_chunks(path, 256):
        for k, item in enumerate(items):
            line = first + k if not raw else item[0]
            try:
                rec = json.loads(item[1]) if raw else item
            except ValueError as e:
                raise BadRow(file, line, "<json>", f"bad JSON: {e}") from None
            yield (file, line), rec


def iter_raw_chunks(
    path: str | Path, chunk_rows: int | Iterator[int]
) -> Iterator[tuple[tuple[str, int], list[Any], bool, int]]:
    """Yield ((file, first line/row), items, raw, nbytes) chunks.

    `chunk_rows` is a size or an iterator of successive sizes (small first chunks
    make the first rows arrive sooner). raw=True: items are (line number, bytes)
    pairs straight from a JSONL file, parsed in the worker. raw=False: items are
    already-parsed records (JSON array: rows numbered from 1 as "line"; Parquet:
    row index from 1). nbytes: input bytes the chunk stands for (progress bars).
    """
    sizes = repeat(chunk_rows) if isinstance(chunk_rows, int) else chunk_rows
    p = Path(path)
    name = str(p)
    if not p.is_file():
        raise ConfigError(f"--data: {name} is not a file")
    kind = file_kind(p)
    if kind == "jsonl":
        buf: list[tuple[int, bytes]] = []
        want, nbytes = next(sizes), 0
        with p.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                nbytes += len(line)
                if not line.strip():
                    continue
                buf.append((lineno, line))
                if len(buf) >= want:
                    yield (name, buf[0][0]), buf, True, nbytes
                    buf, want, nbytes = [], next(sizes), 0
        if buf:
            yield (name, buf[0][0]), buf, True, nbytes
    elif kind == "json":
        with p.open("rb") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise BadRow(name, getattr(e, "lineno", 0), "<json>", f"bad JSON: {e}") from None
        if not isinstance(data, list):
            raise BadRow(name, 1, "<json>", "top level must be an array of records (or use JSONL)")
        size, i = p.stat().st_size, 0
        while i < len(data):
            n = next(sizes)
            yield (name, i + 1), data[i : i + n], False, size * min(n, len(data) - i) // len(data)
            i += n
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"{name}: Parquet input needs pyarrow (pip install 'fanout[parquet]')"
            ) from None
        import pyarrow as pa

        try:
            pf = pq.ParquetFile(name)
        except (pa.ArrowException, OSError) as e:
            raise BadRow(name, 0, "<parquet>", f"not a readable Parquet file: {e}") from None
        size, total, row = p.stat().st_size, max(1, pf.metadata.num_rows), 1
        for batch in pf.iter_batches(batch_size=next(sizes)):
            items = batch.to_pylist()
            yield (name, row), items, False, size * len(items) // total
            row += len(items)


# --------------------------------------------------------------------------- detection


def detect_format(records: list[Any], fmt: ChatFormat) -> ChatFormat:
    """Resolve `format="auto"` from a few records; returns a concrete ChatFormat."""
    if fmt.format != "auto":
        return fmt
    for rec in records:
        if not isinstance(rec, dict):
            continue
        field = fmt.messages_field
        cands = [field] if field else ["conversations", "messages", "history"]
        for name in cands:
            turns = rec.get(name)
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
                continue
            first = turns[0]
            if "from" in first and "value" in first:
                return fmt.model_copy(update={"format": "sharegpt", "messages_field": name})
            if "role" in first:
                return fmt.model_copy(update={"format": "openai", "messages_field": name})
            if all(k in first for k in fmt.pair_keys):
                return fmt.model_copy(update={"format": "pairs", "messages_field": name})
    raise ConfigError(
        "--format auto: could not recognise the records (expected conversations:[{from,value}], "
        "messages:[{role,content}] or history:[{user,bot}]); pass --format and --messages-field"
    )


# --------------------------------------------------------------------------- conversion


def _text(v: Any, file: str, line: int, field: str, allow_empty: bool = False) -> str:
    if not isinstance(v, str):
        raise BadRow(file, line, field, f"content must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRow(file, line, field, "empty content")
    return v


def _json(text: str, file: str, line: int, field: str, what: str) -> Any:
    """`text` parsed as JSON; BadRow naming `field` and `what` where it does not parse
    (a tool call, its arguments or the tools given as strings)."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadRow(file, line, field, f"{what} is not valid JSON: {e}") from None


def _tool_call(obj: Any, file: str, line: int, field: str) -> dict[str, Any]:
    """A tool call as {"type": "function", "function": {"name", "arguments"}}; arguments
    given as a JSON string must parse (the template pastes strings verbatim)."""
    if isinstance(obj, str):
        obj = _json(obj, file, line, field, "tool call")
    if not isinstance(obj, dict):
        raise BadRow(file, line, field, "tool call must be an object")
    fn = obj.get("function", obj)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRow(file, line, field, "tool call needs a non-empty string 'name'")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        _json(args, file, line, field + ".arguments", "arguments")  # kept as the string
    elif not isinstance(args, dict):
        raise BadRow(file, line, field + ".arguments", "must be an object or a JSON string")
    call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(obj.get("id"), str):  # some templates render or require it (Mistral)
        call["id"] = obj["id"]
    return call


def _tools(v: Any, file: str, line: int, field: str) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if isinstance(v, str):
        if not v.strip():
            return None
        v = _json(v, file, line, field, "tools")
    if not isinstance(v, list):
        raise BadRow(file, line, field, "tools must be a list of function specs")
    out = []
    for i, spec in enumerate(v):
        if not isinstance(spec, dict):
            raise BadRow(file, line, f"{field}[{i}]", "tool spec must be an object")
        out.append(spec if "type" in spec else {"type": "function", "function": spec})
    return out or None


def to_conversation(rec: Any, fmt: ChatFormat, file: str, line: int) -> Conversation:
    """Convert one parsed record into a Conversation; BadRow names file, line and field."""
    if fmt.format == "auto":
        raise ConfigError("to_conversation needs a resolved format; call detect_format first")
    if not isinstance(rec, dict):
        raise BadRow(file, line, "<record>", f"record must be an object, got {type(rec).__name__}")
    mf = fmt.resolved_messages_field()
    turns = rec.get(mf)
    if not isinstance(turns, list) or not turns:
        raise BadRow(file, line, mf, "missing or empty list of turns")
    msgs: list[dict[str, Any]] = []
    sys_prompt = rec.get(fmt.system_field)
    if isinstance(sys_prompt, str) and sys_prompt.strip():
        msgs.append({"role": "system", "content": sys_prompt})
    if fmt.format == "pairs":
        uk, ak = fmt.pair_keys
        for i, t in enumerate(turns):
            if not isinstance(t, dict):
                raise BadRow(file, line, f"{mf}[{i}]", "turn pair must be an object")
            for key, pair_role in ((uk, "user"), (ak, "assistant")):
                if key not in t:
                    raise BadRow(file, line, f"{mf}[{i}].{key}", "missing field")
                msgs.append(
                    {"role": pair_role, "content": _text(t[key], file, line, f"{mf}[{i}].{key}")}
                )
    else:
        sharegpt = fmt.format == "sharegpt"
        rk, ck = ("from", "value") if sharegpt else ("role", "content")
        roles = {**(SHAREGPT_ROLES if sharegpt else OPENAI_ROLES), **fmt.role_map}
        for i, t in enumerate(turns):
            where = f"{mf}[{i}]"
            if not isinstance(t, dict):
                raise BadRow(file, line, where, "turn must be an object")
            if rk not in t:
                raise BadRow(file, line, f"{where}.{rk}", "missing field")
            src = t[rk]
            mapped = roles.get(src) if isinstance(src, str) else None
            if mapped is None:
                raise BadRow(file, line, f"{where}.{rk}", f"unknown role {src!r}")
            role = mapped
            if ck not in t:
                raise BadRow(file, line, f"{where}.{ck}", "missing field")
            if sharegpt and src == "function_call":
                _text(t[ck], file, line, f"{where}.{ck}")
                call = _tool_call(t[ck], file, line, f"{where}.{ck}")
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            calls = t.get("tool_calls")
            has_calls = role == "assistant" and bool(calls)
            content = t[ck]
            if content is None and has_calls:
                content = ""
            m: dict[str, Any] = {
                "role": role,
                "content": _text(content, file, line, f"{where}.{ck}", allow_empty=has_calls),
            }
            if has_calls:
                if not isinstance(calls, list):
                    raise BadRow(file, line, f"{where}.tool_calls", "must be a list")
                m["tool_calls"] = [
                    _tool_call(c, file, line, f"{where}.tool_calls[{j}]")
                    for j, c in enumerate(calls)
                ]
            rc = t.get("reasoning_content")
            if isinstance(rc, str) and role == "assistant":
                m["reasoning_content"] = rc
            tcid = t.get("tool_call_id")
            if isinstance(tcid, str) and role == "tool":  # pairs a result with its call
                m["tool_call_id"] = tcid
            msgs.append(m)
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow(file, line, mf, "no assistant turn (nothing to train on)")
    tools = _tools(rec.get(fmt.tools_field), file, line, fmt.tools_field)
    return Conversation(msgs, tools)


def load_conversations(path: str | Path, fmt: ChatFormat | None = None) -> list[Conversation]:
    """Read a whole (small) file into Conversations, for tests and references.

    The pipeline streams instead (`fanout.data.prepare`); this raises on the first bad row.
    """
    recs = list(read_records(path))
    fmt = detect_format([r for _, r in recs[:8]], fmt or ChatFormat())
    return [to_conversation(r, fmt, f, line) for (f, line), r in recs]
