"""The `openai` engine: answers from any OpenAI-compatible server (vLLM, SGLang, TGI,
`transformers serve`), `concurrency` requests in flight, retried with backoff.

    fanout regenerate --engine openai --base-url http://127.0.0.1:8000/v1 --model NAME \\
        --concurrency 32 --data chats.jsonl --out regen/

`connect` asks `GET {base_url}/models` first: an unreachable server or a model name
the server does not list is one clear error, before any record is sent. Each answer
is one `POST {base_url}/chat/completions` (stdlib HTTP, no client library), with the
sampling settings, `seed` (the request's own, fanout.regen.engine.record_seed; vLLM
and SGLang honour it per request), `top_k` and `chat_template_kwargs` only when set
(both are vLLM/SGLang extensions). A 429, a 5xx, a timeout or a dropped connection
is retried after 0.5 · 2^attempt s (capped at 30 s) up to `answer_attempts` tries; any
other HTTP error, or running out of tries, is that answer's error (its record is
skipped, with the reason). Token counts are the server's `usage`.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fanout.errors import ConfigError
from fanout.regen.engine import Answer, RegenOptions, Request

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


def description(model: str | None) -> dict[str, Any]:
    """The openai engine's `describe()` for `--model` (known before it connects)."""
    return {"name": "openai", "model": model}


class Transient(Exception):
    """A failure worth another try (429, 5xx, timeout, connection)."""


class OpenAIEngine:
    name = "openai"

    def __init__(self, base_url: str, model: str, opts: RegenOptions) -> None:
        self.base_url, self.model, self.opts = base_url.rstrip("/"), model, opts
        self.template_kwargs = opts.template_kwargs()

    @classmethod
    def connect(cls, opts: RegenOptions) -> OpenAIEngine:
        """Check the server is up and serves `opts.model`; ConfigError in one line if not."""
        if not opts.base_url or not opts.model:
            raise ConfigError("--engine openai needs --base-url URL and --model NAME")
        engine = cls(opts.base_url, opts.model, opts)
        url = f"{engine.base_url}/models"
        try:
            listed = engine._call("GET", url, None, timeout=min(opts.request_timeout_s, 30.0))
        except (Transient, OSError, ValueError) as e:
            raise ConfigError(
                f"--base-url {opts.base_url}: cannot reach the server ({e})"
            ) from None
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        if opts.model not in ids:
            raise ConfigError(
                f"--model {opts.model}: the server at {opts.base_url} does not serve it "
                f"(it lists: {', '.join(map(str, ids)) or 'nothing'})"
            )
        return engine

    def describe(self) -> dict[str, Any]:
        return description(self.model)

    def generate(self, requests: list[Request]) -> list[Answer]:
        with ThreadPoolExecutor(max_workers=self.opts.concurrency) as pool:
            return list(pool.map(self._answer, requests))

    def body(self, req: Request) -> dict[str, Any]:
        o = self.opts
        body: dict[str, Any] = {
            "model": self.model,
            "messages": req.messages,
            "max_tokens": o.max_new_tokens,
            "temperature": o.temperature,
            "top_p": o.top_p,
            "seed": req.seed,
        }
        if req.tools:
            body["tools"] = req.tools
        if o.top_k:
            body["top_k"] = o.top_k
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        return body

    def _answer(self, req: Request) -> Answer:
        url, body = f"{self.base_url}/chat/completions", self.body(req)
        last = ""
        for attempt in range(self.opts.answer_attempts):
            if attempt:
                time.sleep(min(30.0, 0.5 * 2**attempt))
            try:
                return parse_completion(self._call("POST", url, body, self.opts.request_timeout_s))
            except Transient as e:
                last = str(e)
                log.info("record %d message %d: %s (try %d)", *req.key, last, attempt + 1)
            except (ValueError, KeyError, TypeError, OSError) as e:
                return Answer.failed(f"{type(e).__name__}: {e}")
        return Answer.failed(f"{self.opts.answer_attempts} tries: {last}")

    def _call(self, method: str, url: str, body: Any, timeout: float) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            if e.code in RETRY_STATUS:
                raise Transient(f"HTTP {e.code}: {detail}") from None
            raise ValueError(f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None


def parse_completion(resp: dict[str, Any]) -> Answer:
    """A chat completion → Answer (reasoning servers' `reasoning_content` kept as a
    `<think>` part, which fanout.regen.engine.assistant_message splits off again)."""
    choice = resp["choices"][0]
    msg = choice.get("message") or {}
    text = msg.get("content") or ""
    thought = msg.get("reasoning_content") or msg.get("reasoning")
    if thought:
        text = f"<think>{thought}</think>{text}"
    usage = resp.get("usage") or {}
    reason = choice.get("finish_reason")
    return Answer(
        text,
        "length" if reason == "length" else "stop",
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )
