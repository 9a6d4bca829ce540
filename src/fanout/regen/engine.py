"""What a regeneration engine is asked and answers, and the options every engine shares.

    from fanout.regen.engine import RegenOptions, Request, record_seed
    opts = RegenOptions(temperature=0.8, top_p=0.95, max_new_tokens=256)
    req = Request(key=(7, 3), messages=msgs[:3], tools=None, seed=record_seed(0, 7, 3))
    [answer] = engine.generate([req])     # answer.text, .finish_reason, .error, token counts

An engine turns a conversation prefix (ending before an assistant turn) into the
verifier's answer for that turn. `hf` (fanout.regen.hf) runs the verifier in this
process; `openai` (fanout.regen.openai) asks an OpenAI-compatible server. Each request
carries its own seed, derived from the run seed, the record's index and the turn, so
a record's text does not depend on which other records share its batch or on where
a resumed run starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

EngineName = Literal["hf", "openai"]
FinishReason = Literal["stop", "length", "error"]


class RegenOptions(BaseModel):
    """How answers are generated. Declared once here: `fanout regenerate` inherits these
    fields (one flag each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineName = Field(
        "hf", description="hf = the verifier in this process; openai = an OpenAI-compatible server"
    )
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1 = off")
    top_k: int = Field(0, ge=0, description="sample from the k likeliest tokens; 0 = off")
    max_new_tokens: int = Field(512, ge=1, description="longest answer, in tokens")
    turns: Literal["last", "all"] = Field(
        "last",
        description="regenerate the last assistant turn, or all of them (each given the "
        "regenerated history before it)",
    )
    chat_template_kwargs: str | None = Field(
        None,
        description="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    keep_truncated: bool = Field(
        False, description="keep answers cut at --max-new-tokens (counted either way)"
    )
    regen_batch_size: int = Field(
        16, ge=1, description="hf engine: prompts per generate call (bucketed by prompt length)"
    )
    base_url: str | None = Field(
        None, description="openai engine: the server's base URL, e.g. http://127.0.0.1:8000/v1"
    )
    model: str | None = Field(None, description="openai engine: the served model's name")
    concurrency: int = Field(8, ge=1, description="openai engine: requests in flight at once")
    request_timeout_s: float = Field(
        300.0, gt=0, description="openai engine: one request's timeout (seconds)"
    )
    answer_attempts: int = Field(
        4, ge=1, description="tries per answer before its record is skipped (with its reason)"
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _json_object(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            obj = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        return v

    def template_kwargs(self) -> dict[str, Any]:
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def regen_options(self) -> dict[str, Any]:
        """This config's RegenOptions fields, by name."""
        return {k: getattr(self, k) for k in RegenOptions.model_fields}

    def sampling(self) -> dict[str, Any]:
        """The settings that decide the text (each record's provenance)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "chat_template_kwargs": self.template_kwargs(),
        }


def record_seed(seed: int, record: int, message: int) -> int:
    """The sampling seed of one answer: a hash of (run seed, record index, message index),
    so it is the same whatever batch or resume point the record lands in."""
    digest = hashlib.sha256(f"fanout-regen:{seed}:{record}:{message}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: torch.Generator takes it


@dataclass(frozen=True, slots=True)
class Request:
    """One answer to write: the conversation before assistant message `key[1]` of record
    `key[0]`."""

    key: tuple[int, int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    seed: int


@dataclass(frozen=True, slots=True)
class Answer:
    """The engine's answer; `error` set (and text empty) when it could not be had."""

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    answer_tokens: int
    error: str | None = None

    @classmethod
    def failed(cls, reason: str, prompt_tokens: int = 0) -> Answer:
        return cls("", "error", prompt_tokens, 0, reason)


class Engine(Protocol):
    name: str

    def describe(self) -> dict[str, Any]:
        """What generated the text (the manifest's and each record's `engine`)."""
        ...

    def generate(self, requests: list[Request]) -> list[Answer]:
        """One answer per request, in order. Never raises for one bad request: that
        request's answer carries the error."""
        ...


def assistant_message(text: str) -> dict[str, Any]:
    """The regenerated assistant message: a reasoning verifier's `<think>…</think>` part
    goes to `reasoning_content` (what the chat templates render it from), the rest to
    `content`."""
    if "</think>" in text:
        thought, _, answer = text.partition("</think>")
        return {
            "role": "assistant",
            "content": answer.strip(),
            "reasoning_content": thought.replace("<think>", "", 1).strip(),
        }
    return {"role": "assistant", "content": text.strip()}
