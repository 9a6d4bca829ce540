"""`fanout regenerate` with the hf engine: what is replaced and kept, provenance, batched
generation against a one-prompt-at-a-time reference, truncation counts, bad input, and
kill -9 + rerun giving every record exactly once with the same text.

.venv/bin/pytest tests/test_regenerate.py -q -p no:randomly
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout import cli
from fanout.bench.assets import generate_corpus
from fanout.data.chat import load_conversations
from fanout.errors import ConfigError
from fanout.model.verifier import load_verifier
from fanout.regen.engine import RegenOptions, Request, assistant_message, record_seed
from fanout.regen.hf import HFEngine, load_tokenizer
from fanout.regen.regenerate import RegenerateConfig, regenerate
from fanout.regen.shards import OutDir
from tiny_run import build_tiny_assets, config_flags, one_thread, wait_for  # noqa: F401

N_RECORDS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("regen")
    build_tiny_assets(root, generate_corpus(N_RECORDS, 3))
    return root


@pytest.fixture(scope="module")
def loaded(assets: Path) -> tuple[Any, Any]:
    return load_verifier(
        assets / "verifier", device="cpu", capture_layer_ids="all"
    ), load_tokenizer(str(assets / "tok"))


def config(assets: Path, out: Path, **kw: Any) -> RegenerateConfig:
    base: dict[str, Any] = dict(
        verifier_name_or_path=str(assets / "verifier"),
        tokenizer=str(assets / "tok"),
        data=[str(assets / "chat.jsonl")],
        out=str(out),
        device="cpu",
        temperature=1.0,
        max_new_tokens=6,
        keep_truncated=True,
        records_per_shard=4,
        regen_batch_size=3,
        progress=False,
    )
    return RegenerateConfig(**(base | kw))


def reference(engine: HFEngine, req: Request) -> str:
    """The slow reference: one prompt, no padding, no KV cache, the full forward each step,
    greedy or sampled (temperature, top-k) with the request's own generator."""
    ids = torch.tensor([engine.render(req)])
    g = torch.Generator().manual_seed(req.seed)
    o, new = engine.opts, []
    for _ in range(o.max_new_tokens):
        logits = engine.model(input_ids=ids).logits[0, -1].float()  # [V]
        if o.temperature == 0:
            t = int(logits.argmax())
        else:
            logits = logits / o.temperature
            if o.top_k:
                logits[logits < logits.topk(o.top_k).values[-1]] = float("-inf")
            t = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if t in engine.eos:
            break
        new.append(t)
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return str(engine.tok.decode(new, skip_special_tokens=True))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40)])
def test_batched_engine_matches_reference(
    assets: Path, loaded: tuple[Any, Any], sampling: dict[str, Any]
) -> None:
    convs = load_conversations(assets / "chat.jsonl")
    opts = RegenOptions(max_new_tokens=8, regen_batch_size=4, **sampling)
    engine = HFEngine(*loaded, opts)
    reqs = []
    for k, c in enumerate(convs):
        m = max(i for i, msg in enumerate(c.messages) if msg["role"] == "assistant")
        reqs.append(Request((k, m), c.messages[:m], None, record_seed(5, k, m)))
    lengths = {len(engine.render(r)) for r in reqs}
    assert len(lengths) > 3  # batches really mix prompt lengths (left padding)
    batched = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs[:4]]
    for r, a in zip(reqs, batched, strict=True):
        assert a.error is None
        assert a.text == reference(engine, r), r.key
        assert a.prompt_tokens == len(engine.render(r))
        assert a.finish_reason in ("stop", "length") and a.answer_tokens <= 8
    assert [a.text for a in alone] == [a.text for a in batched[:4]]
    # a prompt that cannot fit is that request's error, not the batch's
    huge = Request((99, 1), [{"role": "user", "content": "7 " * 5000}], None, 1)
    answers = engine.generate([reqs[0], huge])
    assert answers[0] == batched[0] and answers[1].finish_reason == "error"
    assert "exceeds the verifier's max_position_embeddings 4096" in str(answers[1].error)


def test_turns_replaced_kept_and_provenance(
    assets: Path, loaded: tuple[Any, Any], tmp_path: Path
) -> None:
    src = load_conversations(assets / "chat.jsonl")
    for turns in ("last", "all"):
        cfg = config(assets, tmp_path / turns, turns=turns)
        summary = regenerate(cfg, HFEngine(*loaded, cfg))
        out_recs = [
            json.loads(x) for x in (tmp_path / turns / "regenerated.jsonl").read_text().splitlines()
        ]
        out = load_conversations(tmp_path / turns / "regenerated.jsonl")  # what prepare reads
        assert summary["records"] == N_RECORDS and summary["kept"] == len(out) > N_RECORDS // 2
        engine = HFEngine(*loaded, cfg)
        for rec, conv in zip(out_recs, out, strict=True):
            p = rec["fanout_regen"]
            orig = src[p["index"]].messages
            assert p["source"].endswith(f"chat.jsonl:{p['index'] + 1}")
            assert p["sampling"]["temperature"] == 1.0 and p["turns"] == turns
            assistant = [i for i, m in enumerate(orig) if m["role"] == "assistant"]
            chosen = assistant[-1:] if turns == "last" else assistant
            assert [a["message"] for a in p["answers"]] == chosen
            assert len(conv.messages) == len(orig)
            for i, (m, o) in enumerate(zip(conv.messages, orig, strict=True)):
                assert m["role"] == o["role"]
                if i not in chosen:
                    assert m == o  # system, user and unchosen assistant turns as they were
            for a in p["answers"]:  # each answer saw the regenerated history before it
                req = Request(
                    (p["index"], a["message"]), conv.messages[: a["message"]], None, a["seed"]
                )
                assert a["seed"] == record_seed(0, p["index"], a["message"])
                assert a["prompt_tokens"] == len(engine.render(req))
                assert conv.messages[a["message"]] == assistant_message(reference(engine, req))


def test_truncation_counted_and_settings_refused(
    assets: Path, loaded: tuple[Any, Any], tmp_path: Path
) -> None:
    kept_cfg = config(assets, tmp_path / "keep", max_new_tokens=3)
    kept = regenerate(kept_cfg, HFEngine(*loaded, kept_cfg))
    recs = [
        json.loads(x) for x in (tmp_path / "keep" / "regenerated.jsonl").read_text().splitlines()
    ]
    lengths = sum(
        a["finish_reason"] == "length" for r in recs for a in r["fanout_regen"]["answers"]
    )
    assert kept["truncated_kept"] == lengths > 0 and kept["truncated_dropped"] == 0
    drop_cfg = config(assets, tmp_path / "drop", max_new_tokens=3, keep_truncated=False)
    dropped = regenerate(drop_cfg, HFEngine(*loaded, drop_cfg))
    reasons = [
        s["reason"]
        for f in sorted((tmp_path / "drop" / "shards").glob("*.json"))
        for s in json.loads(f.read_text())["skipped_records"]
    ]
    assert (
        dropped["truncated_dropped"]
        == sum(r.startswith("truncated at --max-new-tokens 3") for r in reasons)
        > 0
    )
    assert dropped["kept"] + dropped["skipped"] == N_RECORDS == len(reasons) + dropped["kept"]
    other = config(assets, tmp_path / "keep", max_new_tokens=3, temperature=0.5)
    with pytest.raises(
        ConfigError, match=r"holds a regeneration made with other settings \(sampling"
    ):
        regenerate(other, HFEngine(*loaded, other))
    again = regenerate(kept_cfg, HFEngine(*loaded, kept_cfg))  # all shards done: nothing redone
    assert again == kept


def test_bad_input_is_one_line(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text((assets / "chat.jsonl").read_text().splitlines()[0] + "\n{not json\n")
    base = [
        "regenerate",
        "--verifier-name-or-path",
        str(assets / "verifier"),
        "--tokenizer",
        str(assets / "tok"),
    ]
    cases = [
        (["--data", str(bad), "--out", str(tmp_path / "o1"), "--max-new-tokens", "2"], f"{bad}:2"),
        (["--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o2")], "no such file"),
        (
            ["--data", str(bad), "--out", str(tmp_path / "o3"), "--chat-template-kwargs", "[1]"],
            "JSON object",
        ),
        (
            [
                "--data",
                str(assets / "chat.jsonl"),
                "--out",
                str(tmp_path / "o4"),
                "--verifier-name-or-path",
                str(tmp_path),
            ],
            "config.json",
        ),
    ]
    for extra, needle in cases:
        assert cli.main([*base, *extra]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and needle in err[0] and err[0].startswith("fanout regenerate: error:")
        ), err
    cfg = RegenerateConfig(
        data=[str(bad)], out=str(tmp_path / "o5"), on_bad_row="skip", max_new_tokens=2
    )
    with pytest.raises(ConfigError, match="needs --verifier-name-or-path"):
        regenerate(cfg)


def test_kill9_and_rerun_give_every_record_once(assets: Path, tmp_path: Path) -> None:
    """Real kills of a real `fanout regenerate`: after a seeded random delay, and just as
    shards land; then a rerun to the end. The output equals an uninterrupted run's."""
    ref_cfg = config(assets, tmp_path / "ref", records_per_shard=2)
    regenerate(ref_cfg)
    cfg = ref_cfg.model_copy(update={"out": str(tmp_path / "killed")})
    argv = [sys.executable, "-m", "fanout.cli", "regenerate", *config_flags(cfg)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    shards = Path(cfg.out) / "shards"
    rng = random.Random(21)
    kills = 0

    def landed(proc: subprocess.Popen[bytes], n: int) -> bool:
        return proc.poll() is not None or len(list(shards.glob("*.json"))) >= n

    for target in (None, 3):
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if target is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=rng.uniform(0.5, 4.0))
            else:
                wait_for(partial(landed, proc, target), 120, f"shard {target} or an exit")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
    assert kills >= 1
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = (Path(cfg.out) / "regenerated.jsonl").read_text().splitlines()
    want = (tmp_path / "ref" / "regenerated.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in got] == [json.loads(x) for x in want]
    idx = [json.loads(x)["fanout_regen"]["index"] for x in got]
    assert idx == sorted(set(idx))
    assert not list(Path(cfg.out).glob("**/.*.tmp"))  # killed writers' temp files removed
    m = OutDir(cfg.out).manifest()
    assert m is not None and m["complete"] and m["totals"]["records"] == N_RECORDS


def test_real_data_with_tool_calls_and_the_qwen3_template(
    shared_data: Path, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Real sharegpt data with function calls and observations (LLaMA-Factory's glaive
    demo), the real Qwen3 tokenizer and template: tool turns and tool-call turns kept,
    tools kept, plain assistant turns regenerated, and `fanout prepare`'s reader takes
    the output."""
    from fanout.bench.assets import tiny_qwen3_verifier
    from fanout.data.chat import read_records

    data = shared_data / "chat" / "llama-factory" / "glaive_toolcall_en_demo.json"
    ver = tiny_qwen3_verifier(tmp_path / "v", 151_669, hidden_size=16, num_layers=2, head_dim=8)
    cfg = RegenerateConfig(
        verifier_name_or_path=str(ver), tokenizer=str(qwen3_tokenizer_dir), data=[str(data)],
        out=str(tmp_path / "o"), device="cpu", temperature=1.0, max_new_tokens=4,
        keep_truncated=True, turns="all", max_records=6, progress=False,
        chat_template_kwargs='{"enable_thinking": false}',
    )  # fmt: skip
    summary = regenerate(cfg)
    assert summary["records"] == 6 and summary["kept"] >= 3
    src = load_conversations(data)
    out = load_conversations(tmp_path / "o" / "regenerated.jsonl")
    raw = [r for _, r in read_records(tmp_path / "o" / "regenerated.jsonl")]
    for conv, rec in zip(out, raw, strict=True):
        orig = src[rec["fanout_regen"]["index"]]
        assert conv.tools == orig.tools
        changed = {a["message"] for a in rec["fanout_regen"]["answers"]}
        for i, (m, o) in enumerate(zip(conv.messages, orig.messages, strict=True)):
            if o["role"] != "assistant" or o.get("tool_calls"):
                assert m == o and i not in changed  # user, tool results, tool calls kept
            else:
                assert i in changed
    assert any(c.tools for c in out) and any(m["role"] == "tool" for c in out for m in c.messages)


def test_out_dir_states_a_kill_can_leave(tmp_path: Path) -> None:
    """Killed before its manifest (an empty shards/), between a shard's data file and its
    summary, or mid-write (a dead writer's temp file): a rerun carries on; a directory
    with anything else is refused."""
    ident = {"seed": 0}
    root = tmp_path / "o"
    (root / "shards").mkdir(parents=True)
    (root / ".manifest.json.999999999-ab.tmp").write_text("partial")
    out = OutDir(root).open(ident)
    assert out.manifest() == {"layout": "fanout-regen-1", "identity": ident, "complete": False}
    out.write_shard(0, [{"a": 1}], {"records": 1})
    out.data_path(1).write_text('{"half": 1}\n')  # data written, summary not: not done
    (out.shards / ".00001.jsonl.999999999-cd.tmp").write_text("x")
    out = OutDir(root).open(ident)
    assert out.done(0) == {"records": 1} and out.done(1) is None
    assert not list(out.shards.glob(".*.tmp"))  # the dead writer's temp file is gone
    out.write_shard(1, [{"b": 2}], {"records": 1})
    joined = out.finish(2, {"records": 2})
    assert joined.read_text() == '{"a": 1}\n{"b": 2}\n'
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"not empty and has no manifest\.json"):
        OutDir(tmp_path / "other").open(ident)


def _garbage_verifier(assets: Path, root: Path, tokenizer: bool = False) -> Path:
    """The tiny verifier's config beside weights that do not load: a command that loads
    it fails with "cannot load", so an error other than that came before the load."""
    ver = root / "garbage-verifier"
    ver.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        (ver / name).write_bytes((assets / "verifier" / name).read_bytes())
    (ver / "model.safetensors").write_bytes(b"not safetensors")
    if tokenizer:
        for f in (assets / "tok").iterdir():
            (ver / f.name).write_bytes(f.read_bytes())
    return ver


def _cli(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fanout.cli", "regenerate", *map(str, argv), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _one_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("fanout regenerate: error:") and "cannot load" not in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_checks_come_before_the_verifier_loads(assets: Path, tmp_path: Path) -> None:
    """Real `fanout regenerate` runs against a verifier whose weights do not load: an
    --out made with other settings, a verifier directory without a tokenizer and a
    tokenizer without a chat template are each refused in one line naming the flag — so
    before the load — and the same flags with a new --out do reach the load."""
    made = config(assets, tmp_path / "out", max_records=2, records_per_shard=2)
    regenerate(made)
    ver = _garbage_verifier(assets, tmp_path, tokenizer=True)
    flags: list[str | Path] = [*config_flags(made), "--verifier-name-or-path", ver]
    flags += ["--tokenizer", assets / "tok"]
    line = _one_line(_cli(*flags, "--temperature", "0.5"), f"--out {made.out}", "other settings")
    assert "sampling" in line and "0.5" in line  # the first setting that differs, both values
    reached = _cli(*flags, "--out", tmp_path / "new")  # the control: this one loads, and fails
    assert reached.returncode == 1 and "cannot load" in reached.stderr, reached.stderr
    bare = _garbage_verifier(assets, tmp_path / "bare")
    no_tok: list[str | Path] = [*config_flags(made.model_copy(update={"tokenizer": None}))]
    no_tok += ["--out", tmp_path / "o2"]
    _one_line(
        _cli(*no_tok, "--verifier-name-or-path", bare),
        f"--verifier-name-or-path {bare}", "no tokenizer files", "pass --tokenizer",
    )  # fmt: skip
    tok = tmp_path / "no-template"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((assets / "tok" / "tokenizer.json").read_bytes())
    tc = json.loads((assets / "tok" / "tokenizer_config.json").read_text())
    assert tc.pop("chat_template")
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    _one_line(
        _cli(*flags, "--out", tmp_path / "o3", "--tokenizer", tok),
        f"--tokenizer {tok}", "no chat template",
    )  # fmt: skip
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_records_carry_the_software_that_wrote_them(assets: Path, tmp_path: Path) -> None:
    """Each record's provenance names fanout's version and commit, torch's and
    transformers' versions: the commit is this checkout's HEAD when git tracks the
    package, else null."""
    import importlib.metadata as md
    import shutil

    import transformers

    import fanout

    cfg = config(assets, tmp_path / "o", max_records=2, records_per_shard=2)
    regenerate(cfg)
    recs = [json.loads(x) for x in (tmp_path / "o" / "regenerated.jsonl").read_text().splitlines()]
    assert recs
    pkg = Path(fanout.__file__).parent
    git = shutil.which("git")
    head = None
    if git is not None:  # this checkout's HEAD, if git tracks the package
        ask = partial(subprocess.run, capture_output=True, text=True)
        if ask([git, "-C", pkg, "ls-files", "--error-unmatch", "__init__.py"]).returncode == 0:
            head = ask([git, "-C", pkg, "rev-parse", "HEAD"]).stdout.strip()
    for r in recs:
        sw = r["fanout_regen"]["software"]
        assert sw["fanout"] == md.version("fanout") == fanout.__version__
        assert sw["torch"] == torch.__version__ and sw["transformers"] == transformers.__version__
        assert sw["fanout_commit"] == head and (head is None or len(head) == 40)
        assert isinstance(sw["fanout_modified"], bool) == (head is not None)


def test_source_commit_without_a_checkout_or_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a git checkout, or with no git program, the commit is null: no failure."""
    import fanout
    from fanout.regen.regenerate import software, source_commit

    (tmp_path / "mod.py").write_text("")
    assert source_commit(tmp_path / "mod.py") == (None, None)  # not in any checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to run
    assert source_commit(Path(fanout.__file__)) == (None, None)
    sw = software()
    assert sw["fanout_commit"] is None and sw["fanout"] == fanout.__version__
