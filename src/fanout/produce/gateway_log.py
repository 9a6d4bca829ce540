"""A gateway's log as the source of `fanout produce --follow`: its files, its complete lines, its records.

    from fanout.produce.gateway_log import sources, lines, openai_pair, as_record
    for f in sources(Path("/var/log/gateway")):    # File(path, key "dev:ino"), name order
        ...
    lines(data, start)           # [(byte offset, line)]; data must end at a newline
    openai_pair({"request": {...}, "response": {...}})  # {"messages", "tools"} or None

A file of the source is PATH itself and its siblings named `PATH.*`, or every file of
the directory PATH (hidden ones aside); a file keeps its key across a rename, so a
rotated log is told apart from the new one (fanout.produce.follow reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanout.data.chat import Conversation


@dataclass
class File:
    path: Path
    key: str  # "dev:ino": a file keeps it across a rename (rotation)


def sources(root: Path) -> list[File]:
    """The files of the source now, in name order (see the module docstring)."""
    if root.is_dir():
        paths = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        paths = sorted(p for p in root.parent.glob(f"{root.name}*") if p.is_file())
        paths = [p for p in paths if p == root or p.name.startswith(f"{root.name}.")]
    out = []
    for p in paths:
        try:
            st = p.stat()
        except FileNotFoundError:  # rotated away between the listing and the stat
            continue
        out.append(File(p, f"{st.st_dev}:{st.st_ino}"))
    return out


def openai_pair(rec: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI chat-completions log pair as a chat record ({"messages", "tools"}), or
    None when `rec` is not one."""
    req = rec.get("request", rec)
    resp = rec.get("response", rec)
    msgs, choices = req.get("messages") if isinstance(req, dict) else None, None
    if isinstance(resp, dict):
        choices = resp.get("choices")
    if not isinstance(msgs, list) or not isinstance(choices, list) or not choices:
        return None
    answer = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(answer, dict):
        return None
    out: dict[str, Any] = {"messages": [*msgs, answer]}
    if isinstance(req, dict) and req.get("tools"):
        out["tools"] = req["tools"]
    return out


def lines(data: bytes, start: int) -> list[tuple[int, bytes]]:
    """(byte offset in the file, line) for each line of `data`, read from `start`."""
    out, pos = [], 0
    while pos < len(data):
        nl = data.index(b"\n", pos)
        out.append((start + pos, data[pos:nl]))
        pos = nl + 1
    return out


def as_record(conv: Conversation) -> dict[str, Any]:
    rec: dict[str, Any] = {"messages": conv.messages}
    if conv.tools:
        rec["tools"] = conv.tools
    return rec
