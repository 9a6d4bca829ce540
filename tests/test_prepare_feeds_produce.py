"""README's steps 1-2 chain: `fanout prepare` feeds `fanout produce`, never a second preparation.

    .venv/bin/pytest tests/test_prepare_feeds_produce.py -q

Run as a user runs them (issue 32, defect 3): `fanout prepare --out prepared/` as a
process, then `fanout produce --data prepared/` (its rows, as they are) or `fanout
produce --data chats.jsonl` (the rows prepare cached under $FANOUT_CACHE), each a
process, over the tiny assets (tiny_run.py). Neither prepares again: the producer says
which rows it used, writes nothing into any cache, and leaves prepare's files as they
were; its windows equal those of a producer that prepared the same data itself. A
prepared directory made with other settings than the producer's is refused in one line
naming the setting, before anything is created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import build_tokenizer, generate_corpus
from fanout.data.draft_vocab import TOKEN_COUNTS
from fanout.errors import ConfigError
from fanout.produce.config import ProducerConfig, check_inputs, prepared_data
from fanout.store.store import RunDir, Store, parse_window_name
from tiny_run import build_tiny_assets
from window_files import window_names


def _fanout(env: dict[str, str], *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fanout.cli", *map(str, argv)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root`: (size, mtime_ns), to see that nothing was rewritten. The
    token counts a producer keeps beside a dataset's shards (fanout.data.draft_vocab) aside."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != TOKEN_COUNTS
    }


class Assets:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data, self.tok, self.ver = build_tiny_assets(root, generate_corpus(40, seed=0))
        self.prepared = root / "prepared"
        self.home_cache = root / "home-cache"  # $FANOUT_CACHE: where prepare writes
        self.fingerprint = ""  # of the prepared rows, from prepare's --json summary
        self.env = os.environ | {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FANOUT_CACHE": str(self.home_cache),
        }

    def produce(self, run: Path, *more: str | Path) -> subprocess.CompletedProcess[str]:
        """README step 2 with the tiny run's sizes; `more` gives --data and the rest."""
        return _fanout(
            self.env, "produce", "--run-dir", run, "--verifier-name-or-path", self.ver,
            "--seq-len", "96", "--window-rows", "4", "--max-live-windows", "64",
            "--capture-layer-ids", "1", "2", "--max-windows", "3", "--workers", "1",
            "--no-progress", "--exit-when-idle-s", "0", *more,
        )  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    """The tiny assets and README step 1: `fanout prepare ... --out prepared/`."""
    a = Assets(tmp_path_factory.mktemp("feeds"))
    r = _fanout(
        a.env, "prepare", "--data", a.data, "--tokenizer", a.tok, "--seq-len", "96",
        "--out", a.prepared, "--workers", "1", "--no-progress", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    a.fingerprint = json.loads(r.stdout)["fingerprint"]
    return a


def _windows(run: Path) -> dict[int, dict[str, torch.Tensor]]:
    store = Store(RunDir(run))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name in window_names(store):
        parsed = parse_window_name(name)
        assert parsed is not None
        with store.open(name) as r:
            out[parsed[0]] = {n: r.get(n).clone() for n in r.names()}
    return out


def _stream_id(run: Path) -> Any:
    return json.loads((run / "stream.json").read_text())["stream_id"]


def test_produce_uses_the_prepared_directory_and_prepares_nothing(
    assets: Assets, tmp_path: Path
) -> None:
    before = _files(assets.root)
    run = tmp_path / "run1"
    r = assets.produce(run, "--data", assets.prepared)  # no --tokenizer: the prepared one's
    assert r.returncode == 0, r.stderr[-3000:]
    fp = assets.fingerprint
    assert f"using prepared rows from {assets.prepared} (fingerprint {fp})" in r.stderr, r.stderr
    assert "preparing" not in r.stderr, r.stderr
    assert not (run / "cache").exists()  # no second preparation, not even a tokenizer build
    assert _files(assets.root) == before  # prepare's entry and --out untouched
    assert json.loads(r.stdout)["windows"] == 3

    # the same windows as a producer that prepares chat.jsonl itself (another cache)
    fresh = tmp_path / "run-without-prepare"
    r = assets.produce(
        fresh, "--data", assets.data, "--tokenizer", assets.tok,
        "--cache-dir", tmp_path / "other-cache",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"preparing {assets.data} into {tmp_path / 'other-cache' / 'prepared' / fp}" in r.stderr
    assert _stream_id(run) == _stream_id(fresh)  # same dataset fingerprint, same contract
    got, want = _windows(run), _windows(fresh)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for w in want:
        assert sorted(got[w]) == sorted(want[w])
        for name, t in want[w].items():
            assert torch.equal(got[w][name], t), (w, name)


def test_produce_finds_the_rows_prepare_cached(assets: Assets, tmp_path: Path) -> None:
    """`--data chats.jsonl` (README's first form): the rows prepare put in $FANOUT_CACHE."""
    before = _files(assets.root)
    run = tmp_path / "run2"
    r = assets.produce(run, "--data", assets.data, "--tokenizer", assets.tok)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = assets.home_cache / "prepared" / assets.fingerprint
    assert f"using prepared rows from {entry}" in r.stderr, r.stderr
    assert "preparing" not in r.stderr, r.stderr
    assert not (run / "cache").exists()
    assert _files(assets.root) == before


def test_rows_prepare_did_not_make_are_prepared_into_the_run(
    assets: Assets, tmp_path: Path
) -> None:
    """Settings prepare never used (another --lookahead): prepared, into RUN_DIR/cache."""
    before = _files(assets.home_cache)
    run = tmp_path / "run3"
    r = assets.produce(run, "--data", assets.data, "--tokenizer", assets.tok, "--lookahead", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"preparing {assets.data} into {run / 'cache' / 'prepared'}" in r.stderr, r.stderr
    assert "using prepared rows" not in r.stderr
    assert len(list((run / "cache" / "prepared").iterdir())) == 1
    assert _files(assets.home_cache) == before  # only looked there


def _error_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and r.returncode == 1, (r.returncode, r.stderr)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_a_prepared_directory_with_another_seq_len_is_refused(
    assets: Assets, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    r = assets.produce(run, "--data", assets.prepared, "--seq-len", "128")
    _error_line(r, f"--data {assets.prepared}", "--seq-len 96", "--seq-len 128")
    assert not run.exists()


def test_a_prepared_directory_of_another_tokenizer_is_refused(
    assets: Assets, tmp_path: Path
) -> None:
    other = build_tokenizer(tmp_path / "tok2", generate_corpus(40, seed=1), 400)
    run = tmp_path / "run"
    r = assets.produce(run, "--data", assets.prepared, "--tokenizer", other)
    _error_line(r, f"--data {assets.prepared}", "another tokenizer", str(other))
    assert not run.exists()


def _cfg(assets: Assets, tmp_path: Path, **kw: Any) -> ProducerConfig:
    base: dict[str, Any] = dict(
        run_dir=str(tmp_path / "run"), verifier_name_or_path=str(assets.ver),
        data=[str(assets.prepared)], seq_len=96, capture_layer_ids=[1, 2],
    )  # fmt: skip
    return ProducerConfig(**(base | kw))


def test_given_row_options_must_match_the_prepared_ones(assets: Assets, tmp_path: Path) -> None:
    # given as prepare used them (the tokenizer too): accepted
    ds = prepared_data(_cfg(assets, tmp_path, over_length="split", tokenizer=str(assets.tok)))
    assert ds is not None and ds.dir == assets.prepared
    # given otherwise: the row option is named, with both values
    with pytest.raises(ConfigError, match=r"--over-length split, .* given --over-length drop"):
        check_inputs(_cfg(assets, tmp_path, over_length="drop"))
    with pytest.raises(ConfigError, match=r"--role-map \{\}, .* --role-map \{\"bot\""):
        check_inputs(_cfg(assets, tmp_path, role_map={"bot": "assistant"}))
    with pytest.raises(ConfigError, match=r"--lookahead 64, .* --lookahead 8"):
        check_inputs(_cfg(assets, tmp_path, lookahead=8))
    assert not (tmp_path / "run").exists()


def test_what_a_prepared_directory_cannot_be_given_with(assets: Assets, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="give it as the only --data"):
        check_inputs(_cfg(assets, tmp_path, data=[str(assets.prepared), str(assets.data)]))
    with pytest.raises(ConfigError, match="--regenerate rewrites conversations"):
        check_inputs(_cfg(assets, tmp_path, regenerate=True))
    (tmp_path / "not-prepared").mkdir()
    with pytest.raises(ConfigError, match="not one `fanout prepare --out` wrote"):
        check_inputs(_cfg(assets, tmp_path, data=[str(tmp_path / "not-prepared")]))
