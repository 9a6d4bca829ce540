"""Input formats, detection and bad-row errors.

.venv/bin/pytest tests/test_chat.py -x -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fanout.data.chat import (
    ChatFormat,
    detect_format,
    iter_raw_chunks,
    load_conversations,
    read_records,
    to_conversation,
)
from fanout.errors import BadRow, ConfigError

SHAREGPT = ChatFormat(format="sharegpt")
OPENAI = ChatFormat(format="openai")


def conv(rec: dict[str, Any], fmt: ChatFormat = SHAREGPT) -> list[dict[str, Any]]:
    return to_conversation(rec, fmt, "f.jsonl", 7).messages


def test_real_datasets_load_with_auto_detection(shared_data: Path) -> None:
    expect = {
        "chat/fastchat/dummy_conversation.json": ("sharegpt", 500, 2000),
        "chat/llama-factory/glaive_toolcall_en_demo.json": ("sharegpt", 300, 1914),
        "chat/llama-factory/kto_en_demo.json": ("openai", 300, 974),
        "chat/mt-bench-101/mtbench101.jsonl": ("pairs", 1388, 8416),
    }
    for rel, (fmt, n_conv, n_msg) in expect.items():
        recs = [r for _, r in read_records(shared_data / rel)]
        assert detect_format(recs[:8], ChatFormat()).format == fmt
        convs = load_conversations(shared_data / rel)
        assert len(convs) == n_conv
        assert sum(len(c.messages) for c in convs) == n_msg, rel


def test_glaive_tool_calls_and_tools(shared_data: Path) -> None:
    convs = load_conversations(shared_data / "chat/llama-factory/glaive_toolcall_en_demo.json")
    calls = [m for c in convs for m in c.messages if m.get("tool_calls")]
    assert len(calls) == 211  # README: 211 function_call turns
    assert sum(m["role"] == "tool" for c in convs for m in c.messages) == 211
    assert sum(c.tools is not None for c in convs) == 191  # 109 rows have "[]"
    call = calls[0]["tool_calls"][0]
    assert call["type"] == "function" and isinstance(call["function"]["arguments"], dict)
    spec = next(c.tools for c in convs if c.tools)[0]
    assert spec["type"] == "function" and "name" in spec["function"]


def test_sharegpt_mapping() -> None:
    msgs = conv(
        {
            "system": "be nice",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "function_call", "value": '{"name": "f", "arguments": "{\\"a\\": 1}"}'},
                {"from": "observation", "value": "42"},
                {"from": "gpt", "value": "done"},
            ],
        }
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_openai_and_role_map_and_pairs() -> None:
    msgs = conv(
        {"messages": [{"role": "human", "content": "q"}, {"role": "bot", "content": "a"}]},
        ChatFormat(format="openai", role_map={"human": "user", "bot": "assistant"}),
    )
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    msgs = conv(
        {"dialog": [{"q": "1", "a": "2"}, {"q": "3", "a": "4"}]},
        ChatFormat(format="pairs", messages_field="dialog", pair_keys=("q", "a")),
    )
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("user", "1"),
        ("assistant", "2"),
        ("user", "3"),
        ("assistant", "4"),
    ]
    with pytest.raises(ValueError, match="role_map"):
        ChatFormat(role_map={"x": "narrator"})


@pytest.mark.parametrize(
    ("rec", "fmt", "field", "reason"),
    [
        ({"messages": []}, OPENAI, "messages", "missing or empty"),
        ({"other": 1}, OPENAI, "messages", "missing or empty"),
        ({"messages": [{"role": "user"}]}, OPENAI, "messages[0].content", "missing field"),
        ({"messages": [{"content": "x"}]}, OPENAI, "messages[0].role", "missing field"),
        (
            {"messages": [{"role": "wizard", "content": "x"}]},
            OPENAI,
            "messages[0].role",
            "unknown role",
        ),
        ({"messages": [{"role": "user", "content": "  "}]}, OPENAI, "messages[0].content", "empty"),
        ({"messages": [{"role": "user", "content": 3}]}, OPENAI, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": "q"}]}, OPENAI, "messages", "no assistant"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": "{nope"},
                ]
            },
            SHAREGPT,
            "conversations[1].value",
            "not valid JSON",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                    },
                ]
            },
            OPENAI,
            "messages[1].tool_calls[0].arguments",
            "not valid JSON",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                "tools": "[oops",
            },
            SHAREGPT,
            "tools",
            "not valid JSON",
        ),
    ],
)
def test_bad_rows_name_file_line_field(rec: Any, fmt: ChatFormat, field: str, reason: str) -> None:
    with pytest.raises(BadRow) as ei:
        to_conversation(rec, fmt, "f.jsonl", 7)
    e = ei.value
    assert (e.file, e.line, e.field) == ("f.jsonl", 7, field)
    assert reason in e.reason
    assert str(e).startswith(f"f.jsonl:7: field {field!r}")


def test_tool_call_turn_may_have_empty_content() -> None:
    msgs = conv(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"name": "f", "arguments": {}}],
                },
            ]
        },
        OPENAI,
    )
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "f"


def test_jsonl_chunks_keep_line_numbers_and_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    rows = [json.dumps({"messages": [{"role": "user", "content": str(i)}]}) for i in range(5)]
    p.write_text(rows[0] + "\n\n" + "\n".join(rows[1:]) + "\n{broken\n")
    chunks = list(iter_raw_chunks(p, iter([2, 2, 2, 2])))
    lines = [ln for _, items, raw, _ in chunks for ln, _ in items]
    assert all(raw for _, _, raw, _ in chunks)
    assert lines == [1, 3, 4, 5, 6, 7]  # blank line 2 skipped, numbering kept
    assert sum(n for *_, n in chunks) == p.stat().st_size
    with pytest.raises(BadRow, match=r"x.jsonl:7: field '<json>': bad JSON"):
        list(read_records(p))


def test_json_array_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"messages": []}] * 5))
    chunks = list(iter_raw_chunks(p, 2))
    assert [c[0][1] for c in chunks] == [1, 3, 5] and not chunks[0][2]
    bad = tmp_path / "b.json"
    bad.write_text('[{"a": 1},\n {"a": ]')
    with pytest.raises(BadRow, match=r"b.json:2: field '<json>'"):
        list(iter_raw_chunks(bad, 2))
    with pytest.raises(ConfigError, match="not a file"):
        list(iter_raw_chunks(tmp_path / "missing.jsonl", 2))
    with pytest.raises(ConfigError, match="could not recognise"):
        detect_format([{"text": "plain"}], ChatFormat())


def test_openai_tool_call_ids_are_kept() -> None:
    # Mistral's templates render the call id and pair each result with it.
    call = {"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = conv(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "r", "tool_call_id": "abc123XYZ"},
                {"role": "assistant", "content": "a"},
            ]
        },
        OPENAI,
    )
    assert msgs[1]["tool_calls"][0]["id"] == "abc123XYZ"
    assert msgs[2]["tool_call_id"] == "abc123XYZ"
    assert (
        "id"
        not in conv(
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
                ]
            }
        )[1]["tool_calls"][0]
    )
