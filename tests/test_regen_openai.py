"""`fanout regenerate --engine openai` against a real OpenAI-compatible server on this CPU:
`transformers serve` (the `transformers[serving]` extra) serving the tiny verifier on
loopback, for a bounded lifetime. Retries are checked through a small HTTP proxy in front
of it that answers 429/503 (or always 500) before passing requests on.

.venv/bin/pytest tests/test_regen_openai.py -q -p no:randomly
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fanout import cli
from fanout.bench.assets import generate_corpus
from fanout.data.chat import load_conversations
from fanout.regen.engine import RegenOptions, Request
from fanout.regen.hf import HFEngine
from fanout.regen.regenerate import RegenerateConfig, regenerate
from tiny_run import build_tiny_assets, one_thread, wait_for  # noqa: F401

SERVE = Path(sys.executable).with_name("transformers")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fastapi") is None
    or importlib.util.find_spec("uvicorn") is None
    or not SERVE.is_file(),
    reason="`transformers serve` needs transformers[serving] (fastapi, uvicorn): "
    "pip install 'transformers[serving]'",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """(assets root, base URL): the tiny verifier with its tokenizer, served on loopback."""
    root = tmp_path_factory.mktemp("served")
    _, tok, ver = build_tiny_assets(root, generate_corpus(8, 4))
    model = root / "model"
    model.mkdir()
    for f in [*ver.iterdir(), *tok.iterdir()]:
        shutil.copy(f, model / f.name)
    # Like a real chat model's: `transformers serve` samples only when the model's own
    # generation config says do_sample (a request's temperature > 0 alone does not).
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(gen | {"do_sample": True}))
    port = free_port()
    log = (root / "serve.log").open("wb")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = ["timeout", "600", str(SERVE), "serve", str(model), "--host", "127.0.0.1"]
    # its own process group: the kill below reaches `timeout` and the server under it
    proc = subprocess.Popen(
        [*argv, "--port", str(port), "--device", "cpu"],
        env=env, stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for(lambda: up(url) or proc.poll() is not None, 240, "transformers serve to start")
        assert proc.poll() is None, (root / "serve.log").read_text()[-2000:]
        yield root, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def config(root: Path, url: str, out: Path, **kw: Any) -> RegenerateConfig:
    base: dict[str, Any] = dict(
        engine="openai",
        base_url=url,
        model=str(root / "model"),
        data=[str(root / "chat.jsonl")],
        out=str(out),
        temperature=1.0,
        max_new_tokens=8,
        keep_truncated=True,
        concurrency=3,
        records_per_shard=3,
        progress=False,
    )
    return RegenerateConfig(**(base | kw))


def test_answers_from_a_real_server(served: tuple[Path, str], tmp_path: Path) -> None:
    root, url = served
    summary = regenerate(
        config(root, url, tmp_path / "o", verifier_name_or_path=str(root / "model"))
    )
    src = load_conversations(root / "chat.jsonl")
    recs = [json.loads(x) for x in (tmp_path / "o" / "regenerated.jsonl").read_text().splitlines()]
    assert summary["records"] == 8 and summary["kept"] == len(recs) >= 1
    assert summary["kept"] + summary["skipped"] == 8
    hf = HFEngine.load(str(root / "verifier"), str(root / "tok"), RegenOptions(), device="cpu")
    for rec in recs:
        p = rec["fanout_regen"]
        assert p["engine"] == {"name": "openai", "model": str(root / "model")}
        assert p["verifier"]["config_sha256"] and p["sampling"]["max_new_tokens"] == 8
        orig = src[p["index"]].messages
        m = p["answers"][0]["message"]
        assert rec["messages"][:m] == orig[:m] and rec["messages"][m]["content"]
        # the server rendered the same prompt the hf engine renders
        req = Request((p["index"], m), orig[:m], None, 0)
        assert p["answers"][0]["prompt_tokens"] == len(hf.render(req))
        assert 1 <= p["answers"][0]["answer_tokens"] <= 8


def test_wrong_model_and_unreachable_server_are_one_line(
    served: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, url = served
    base = ["regenerate", "--engine", "openai", "--data", str(root / "chat.jsonl")]
    cases = [
        (["--base-url", url, "--model", "no-such-model"], "--model no-such-model: the server at"),
        (
            ["--base-url", f"http://127.0.0.1:{free_port()}/v1", "--model", "m"],
            "cannot reach the server",
        ),
        (["--base-url", url], "needs --base-url URL and --model NAME"),
    ]
    for i, (extra, needle) in enumerate(cases):
        assert cli.main([*base, *extra, "--out", str(tmp_path / str(i))]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and needle in err[0] and err[0].startswith("fanout regenerate: error:")
        ), err


class Flaky(BaseHTTPRequestHandler):
    """Passes requests to the real server after `fail` 429/503 answers to POSTs (all
    of them with fail < 0: 500)."""

    target = ""
    fail = 0
    posts = 0
    lock = threading.Lock()

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with Flaky.lock:
            Flaky.posts += 1
            n, failing = Flaky.posts, Flaky.fail < 0 or Flaky.posts <= Flaky.fail
        if failing:
            code = 500 if Flaky.fail < 0 else (429 if n % 2 else 503)
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"no")
            return
        self._forward(body)

    def _forward(self, body: bytes | None) -> None:
        req = urllib.request.Request(Flaky.target + self.path, data=body, method=self.command)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_retries_on_429_503_then_skips_what_keeps_failing(
    served: tuple[Path, str], tmp_path: Path
) -> None:
    root, url = served
    Flaky.target = url.removesuffix("/v1")
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    purl = f"http://127.0.0.1:{proxy.server_address[1]}/v1"
    try:
        Flaky.fail, Flaky.posts = 2, 0
        ok = regenerate(config(root, purl, tmp_path / "ok", max_records=2, concurrency=1))
        assert Flaky.posts == 4 and ok["records"] == 2
        reasons = json.loads((tmp_path / "ok" / "shards" / "00000.json").read_text())[
            "skipped_records"
        ]
        assert not any(r["reason"].startswith("failed") for r in reasons)
        Flaky.fail, Flaky.posts = -1, 0
        bad = regenerate(config(root, purl, tmp_path / "bad", max_records=2, answer_attempts=2))
        reasons = json.loads((tmp_path / "bad" / "shards" / "00000.json").read_text())[
            "skipped_records"
        ]
        assert bad["skipped"] == 2 and Flaky.posts == 4
        assert all(r["reason"].startswith("failed: 2 tries: HTTP 500") for r in reasons), reasons
    finally:
        proxy.shutdown()
        proxy.server_close()
