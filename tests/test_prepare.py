"""End to end: prepare → cache → reopen; online mode; bad rows; workers; CLI.

.venv/bin/pytest tests/test_prepare.py -x -q
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
from pydantic import ValidationError

from fanout.cli import main as cli_main
from fanout.data import masks
from fanout.data.chat import load_conversations
from fanout.data.masks import MaskPathName
from fanout.data.prepare import PrepareConfig, iter_packed_rows, open_packed, prepare
from fanout.data.template import ChatEncoder, load_chat_spec
from fanout.data.workers import WorkerPool, resolve_workers, start_method, usable_cpus
from fanout.errors import BadRow, ConfigError
from fanout.rows import PACKED_ROW
from test_packing import concat_batches

FASTCHAT = "chat/fastchat/dummy_conversation.json"
GLAIVE = "chat/llama-factory/glaive_toolcall_en_demo.json"
MTBENCH = "chat/mt-bench-101/mtbench101.jsonl"


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "fanout-cache"


@pytest.fixture
def base(
    shared_data: Path, qwen3_tokenizer_dir: Path, cache_root: Path, tmp_path: Path
) -> dict[str, Any]:
    return {
        "data": [str(shared_data / FASTCHAT), str(shared_data / GLAIVE)],
        "tokenizer": str(qwen3_tokenizer_dir),
        "seq_len": 1024,
        "cache_dir": str(cache_root),  # shared: the tokenizer build is cached there too
        "workers": 1,
        "progress": False,
    }


@pytest.fixture(autouse=True)
def _tokenizer_cache(monkeypatch: pytest.MonkeyPatch, cache_root: Path) -> None:
    # Share the built tokenizer between tests (the build runs transformers once).
    monkeypatch.setenv("FANOUT_CACHE", str(cache_root))


def all_rows(ds: Any) -> dict[str, np.ndarray]:
    return ds.rows(np.arange(ds.num_rows))


def test_prepare_rows_match_encoder_and_cache_hit(base: dict[str, Any], tmp_path: Path) -> None:
    cfg = PrepareConfig(**base, out=str(tmp_path / "out"))
    ds = prepare(cfg)
    rows = all_rows(ds)
    assert ds.seq_len == 1024 and rows["input_ids"].shape == (ds.num_rows, 1024)
    assert rows["input_ids"].dtype == np.int32 and rows["loss_mask"].dtype == np.uint8
    # Same tokens and masks as the encoder (verified against HF in test_template.py).
    enc = ChatEncoder(load_chat_spec(base["tokenizer"]))
    convs = [c for p in base["data"] for c in load_conversations(p)]
    ids, mask, lengths = enc.encode(convs)
    s = ds.summary
    assert s["input_rows"] == len(convs) == 800
    assert s["tokens"] == int(lengths.sum()) == int((rows["document_ids"] >= 0).sum())
    assert s["masked_tokens"] == int(mask.sum()) == int(rows["loss_mask"].sum())
    assert (
        np.bincount(ids, minlength=152000).tolist()
        == np.bincount(rows["input_ids"][rows["document_ids"] >= 0], minlength=152000).tolist()
    )
    assert s["fill"] > 0.9 and s["formats"][base["data"][0]].startswith("sharegpt")
    # Second run: loaded from the cache (shards not rewritten), same fingerprint and rows.
    entry = Path(base["cache_dir"]) / "prepared" / ds.fingerprint
    mtimes = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
    ds2 = prepare(cfg)
    assert {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == mtimes
    assert ds2.fingerprint == ds.fingerprint
    again = open_packed(tmp_path / "out")
    idx = np.array([3, 0, 3, ds.num_rows - 1])
    for k in PACKED_ROW:
        assert (again.rows(idx)[k] == rows[k][idx]).all()
    assert again.tokenizer_fingerprint == ds.tokenizer_fingerprint
    assert again.pad_token_id == 151643
    # The fingerprint follows every option that changes rows.
    assert prepare(PrepareConfig(**{**base, "seq_len": 2048})).fingerprint != ds.fingerprint


def test_workers_do_not_change_output_and_online_matches(
    base: dict[str, Any], tmp_path: Path
) -> None:
    base = {**base, "data": [base["data"][0], base["data"][0].replace(FASTCHAT, MTBENCH)]}
    one = all_rows(prepare(PrepareConfig(**base, no_cache=False)))
    cfg2 = PrepareConfig(
        **{
            **base,
            "workers": 2,
            "chunk_rows": 97,
            "no_cache": True,
            "out": str(tmp_path / "w2"),
        }
    )
    two = all_rows(prepare(cfg2))
    online = concat_batches(list(iter_packed_rows(cfg2)))
    for k in PACKED_ROW:
        assert (one[k] == two[k]).all() and (one[k] == online[k]).all()
    # Concurrent callers share the warm pool and still each get the exact rows.
    results: list[dict[str, np.ndarray]] = []

    def consume() -> None:
        results.append(concat_batches(list(iter_packed_rows(cfg2))))

    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    for r in results:
        assert all((r[k] == one[k]).all() for k in PACKED_ROW)


def bad_file(tmp_path: Path) -> Path:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps(
            {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]}
        ),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "<|im_end|>"},
                    {"role": "assistant", "content": "a"},
                ]
            }
        ),
        json.dumps(good),
    ]
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bad_rows_error_names_location_or_skip_counts(base: dict[str, Any], tmp_path: Path) -> None:
    p = bad_file(tmp_path)
    cfg = PrepareConfig(**{**base, "data": [str(p)], "no_cache": True, "out": str(tmp_path / "o")})
    with pytest.raises(BadRow) as ei:
        prepare(cfg)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(p), 2, "<json>")
    ds = prepare(cfg.model_copy(update={"on_bad_row": "skip"}))
    s = ds.summary
    assert s["input_rows"] == 6 and s["documents"] == 2 and s["skipped_bad_rows"] == 4
    assert s["skipped_by_reason"] == {
        "bad JSON": 1,
        "contains a ChatML control token": 1,
        "empty content": 1,
        "unknown role": 1,
    }


def test_over_length_policies(base: dict[str, Any], tmp_path: Path, shared_data: Path) -> None:
    cfg = PrepareConfig(
        **{
            **base,
            "data": [str(shared_data / GLAIVE)],
            "seq_len": 512,
            "no_cache": True,
            "out": str(tmp_path / "o"),
        }
    )
    split = prepare(cfg).summary
    drop = prepare(cfg.model_copy(update={"over_length": "drop"})).summary
    assert split["split_over_length"] == drop["dropped_over_length"] > 0
    assert split["masked_tokens"] > drop["masked_tokens"]
    with pytest.raises(BadRow, match=r"glaive_toolcall_en_demo.json:\d+: field '<tokens>'"):
        prepare(cfg.model_copy(update={"over_length": "error"}))


def test_config_validation(base: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        PrepareConfig(**{**base, "data": [str(tmp_path / "nope.jsonl")]})
    with pytest.raises(ValueError, match="seq_len"):
        PrepareConfig(**{**base, "seq_len": 1})
    with pytest.raises(ConfigError, match="--no-cache needs --out"):
        prepare(PrepareConfig(**base, no_cache=True))


def test_usable_cpus_reads_cgroup_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    n_aff = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == n_aff
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(tmp_path) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == 1
    monkeypatch.setenv("FANOUT_WORKERS", "3")
    assert resolve_workers(None) == 3 and resolve_workers(5) == 5
    monkeypatch.setenv("FANOUT_WORKERS", "x")
    with pytest.raises(ConfigError, match="FANOUT_WORKERS"):
        resolve_workers(None)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("prewarmed", [True, False])
def test_start_methods_give_identical_rows(
    base: dict[str, Any], tmp_path: Path, method: str, prewarmed: bool
) -> None:
    """Forked (warm, inherited tokenizer) and spawned workers, prewarmed or not, must
    produce exactly the in-process rows."""
    from fanout.data.prepare import _Run

    cfg = PrepareConfig(**{**base, "chunk_rows": 61})
    spec = load_chat_spec(cfg.tokenizer, cfg.cache_root())
    one = concat_batches(list(_Run(cfg, spec, WorkerPool(1)).batches()))
    pool = WorkerPool(2, method=method)
    try:
        if prewarmed:
            pool.prewarm(spec)
        two = concat_batches(list(_Run(cfg, spec, pool).batches()))
        again = concat_batches(list(_Run(cfg, spec, pool).batches()))  # the pool stays warm
    finally:
        pool.close()
    assert pool.method == method
    for k in PACKED_ROW:
        assert (one[k] == two[k]).all() and (one[k] == again[k]).all()


def test_start_method_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delenv("FANOUT_START_METHOD", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert start_method() == ("fork" if sys.platform.startswith("linux") else "spawn")
    monkeypatch.setitem(sys.modules, "torch", sys)  # any module object: "torch is loaded"
    assert start_method() == "spawn"
    monkeypatch.setenv("FANOUT_START_METHOD", "fork")
    assert start_method() == "fork"
    monkeypatch.setenv("FANOUT_START_METHOD", "thread")
    with pytest.raises(ConfigError, match="FANOUT_START_METHOD"):
        start_method()


def test_cli_prepare_json(
    base: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    rc = cli_main(
        [
            "prepare",
            "--data",
            base["data"][0],
            "--tokenizer",
            base["tokenizer"],
            "--seq-len",
            "2048",
            "--workers",
            "1",
            "--cache-dir",
            base["cache_dir"],
            "--out",
            str(out),
            "--no-progress",
            "--json",
        ]
    )
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["input_rows"] == 500 and rep["dir"] == str(out)
    assert open_packed(out).num_rows == rep["rows"]
    assert (
        cli_main(
            [
                "prepare",
                "--data",
                base["data"][0],
                "--tokenizer",
                base["tokenizer"],
                "--role-map",
                "x=narrator",
                "--no-progress",
            ]
        )
        == 1
    )


def test_parquet_input_gives_the_rows_of_the_same_jsonl(
    base: dict[str, Any], tmp_path: Path, shared_data: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = shared_data / MTBENCH
    records = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "mt.parquet", row_group_size=37)
    common = {**base, "no_cache": True}
    from_jsonl = prepare(
        PrepareConfig(**{**common, "data": [str(src)], "out": str(tmp_path / "j")})
    )
    parquet = str(tmp_path / "mt.parquet")
    from_pq = prepare(PrepareConfig(**{**common, "data": [parquet], "out": str(tmp_path / "p")}))
    assert from_pq.num_rows == from_jsonl.num_rows > 0
    a, b = all_rows(from_jsonl), all_rows(from_pq)
    for k in PACKED_ROW:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # A bad record is named by its row (1-based), like a JSONL line.
    records[40]["history"][0]["bot"] = ""  # empty content
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(records), bad, row_group_size=37)
    with pytest.raises(BadRow) as ei:
        prepare(PrepareConfig(**{**common, "data": [str(bad)], "out": str(tmp_path / "b")}))
    assert (ei.value.file, ei.value.line) == (str(bad), 41), ei.value
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(BadRow, match="not a readable Parquet file"):
        prepare(PrepareConfig(**{**common, "data": [str(junk)], "out": str(tmp_path / "x")}))


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def test_chat_template_flag_overrides_the_tokenizers_and_the_summary_says_the_path(
    base: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = prepare(PrepareConfig(**base, out=str(tmp_path / "d")))
    assert default.summary["mask_path"] == "chatml-scan"
    assert default.summary["mask_verified_rows"] == 16  # 8 per input file, checked vs the rule
    assert default.summary["chat_template"] == "tokenizer"
    tpl = TEMPLATES / "chatml-generation-tags.jinja"
    argv = ["prepare", "--data", *base["data"], "--tokenizer", base["tokenizer"]]
    argv += ["--chat-template", str(tpl), "--seq-len", "1024", "--workers", "1"]
    argv += ["--cache-dir", base["cache_dir"], "--out", str(tmp_path / "g"), "--no-progress"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert (
        "loss mask" in text
        and "generation-tags (checked against the prefix rule on 16 rows" in text
    )
    ds = open_packed(tmp_path / "g")
    s = ds.summary
    assert s["mask_path"] == "generation-tags" and s["chat_template"] == str(tpl)
    assert ds.fingerprint != default.fingerprint  # the template is part of the cache key
    # no system block, no empty think block: fewer tokens; a similar trained share
    assert s["tokens"] < default.summary["tokens"]
    assert 0.99 < s["masked_tokens"] / default.summary["masked_tokens"] < 1.01


def test_mask_path_flag_forces_the_rule_with_the_same_rows(
    base: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--mask-path (a DataOptions field, no environment variable) forces a path: the
    prefix rule gives the chatml scan's exact rows, under another cache key."""
    assert get_args(MaskPathName) == ("auto", *masks.PATHS)
    monkeypatch.setenv("FANOUT_MASK_PATH", "chatml-scan")  # the old variable: ignored
    default = prepare(PrepareConfig(**base, out=str(tmp_path / "d")))
    assert default.summary["mask_path"] == "chatml-scan"
    argv = ["prepare", "--data", *base["data"], "--tokenizer", base["tokenizer"],
            "--seq-len", "1024", "--workers", "1", "--cache-dir", base["cache_dir"],
            "--out", str(tmp_path / "r"), "--no-progress", "--mask-path", "prefix-rule"]  # fmt: skip
    assert cli_main(argv) == 0
    ruled = open_packed(tmp_path / "r")
    assert ruled.summary["mask_path"] == "prefix-rule"
    assert ruled.fingerprint != default.fingerprint  # the path is part of the cache key
    a, b = all_rows(default), all_rows(ruled)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with pytest.raises(ValidationError, match="mask_path"):
        PrepareConfig.model_validate(base | {"mask_path": "nonsense"})


def test_chat_template_that_cannot_be_masked_is_refused_by_row(
    base: dict[str, Any], tmp_path: Path
) -> None:
    tpl = tmp_path / "plain.json"  # chat_template.json layout; no end-of-turn token at all
    tpl.write_text(
        json.dumps(
            {
                "chat_template": "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n"
                "{% endfor %}{% if add_generation_prompt %}### assistant: {% endif %}"
            }
        )
    )
    cfg = PrepareConfig(
        **{**base, "chat_template": str(tpl), "no_cache": True, "out": str(tmp_path / "o")}
    )
    with pytest.raises(BadRow, match=r"dummy_conversation.json:1: field 'messages\[1\]'"):
        prepare(cfg)
    with pytest.raises(ValueError, match="no such file"):
        PrepareConfig(**{**base, "chat_template": str(tmp_path / "nope.jinja")})


_RACER = """
import json, logging, os, sys, time
from pathlib import Path
from fanout.data.prepare import PrepareConfig, prepare
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
cfg = PrepareConfig.model_validate_json(sys.argv[1])
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
time.sleep(float(sys.argv[3]))
ds = prepare(cfg, announce=True)
print(json.dumps({"dir": str(ds.dir), "fingerprint": ds.fingerprint, "rows": ds.num_rows}))
"""


@pytest.mark.parametrize("stagger", [0.0, 0.15, 0.4])
def test_processes_preparing_the_same_rows_build_them_once(
    base: dict[str, Any], tmp_path: Path, stagger: float
) -> None:
    """Three processes (M producer replicas started together on one host) prepare the
    same rows into one cache, released together by a go-file or staggered by `stagger`
    s: exactly one builds the entry, the others wait for it and use it (no race for
    the final rename, no second build on the same cores); one entry, no debris."""
    import shutil
    import subprocess
    import sys

    cache = tmp_path / "cache"
    # the tokenizer build (a transformers subprocess) done once, copied into this cache
    load_chat_spec(base["tokenizer"], Path(base["cache_dir"]))
    shutil.copytree(Path(base["cache_dir"]) / "tokenizers", cache / "tokenizers")
    cfg = PrepareConfig(**{**base, "data": base["data"][:1], "cache_dir": str(cache)})
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, cfg.model_dump_json(), str(go), str(i * stagger)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    time.sleep(1.0)  # past their imports, on most machines; the race holds either way
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert len({(r["dir"], r["fingerprint"], r["rows"]) for r in results}) == 1, results
    built = ["\npreparing " in f"\n{e}" for _, e in outs]  # prepare()'s announce line
    assert sum(built) == 1, [e[-600:] for _, e in outs]
    assert all("using prepared rows from" in e for (_, e), b in zip(outs, built) if not b)
    entries = sorted(p.name for p in (cache / "prepared").iterdir())
    assert entries == [results[0]["fingerprint"]]
