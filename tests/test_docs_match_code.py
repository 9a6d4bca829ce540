"""What the docs and docstrings claim, checked against the code (issue 24.4).

    .venv/bin/pytest tests/test_docs_match_code.py -x -q

Each test takes one claim a reader would act on and checks it against the code that
implements it, so the two cannot drift apart silently: the commands `fanout`'s
docstring lists, where typed errors live, the one content hash, store.py's opening
example, dotted references in module docstrings, and how cursors move.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import fanout
from fanout.errors import FanoutError

SRC = Path(fanout.__file__).parent


def _modules() -> list[ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(fanout.__path__, "fanout.")]
    return [importlib.import_module(n) for n in names if not n.endswith("__main__")]


def test_the_fanout_docstring_lists_every_command() -> None:
    from fanout import cli

    head = " ".join((cli.__doc__ or "").split("\n\n")[0].split())  # the summary sentence
    listed = set(re.findall(r"[a-z][a-z-]+", head.split("`fanout ", 1)[1].split("`", 1)[0]))
    assert listed == set(cli.COMMANDS), (listed ^ set(cli.COMMANDS), head)


def test_every_error_fanout_defines_is_a_fanout_error() -> None:
    from fanout.data.masks import MaskError
    from fanout.errors import WindowFormatError
    from fanout.store import store, windowfile

    errors = {
        (m.__name__, name): obj
        for m in _modules()
        for name, obj in vars(m).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.__name__
    }
    assert len(errors) > 20  # the walk found them
    # every public one outside errors.py is named in its docstring (where, and why there),
    # and is a FanoutError unless that docstring says why not
    doc = importlib.import_module("fanout.errors").__doc__ or ""
    outside = sorted(f"{m}.{n}" for (m, n) in errors if m != "fanout.errors" and n[0] != "_")
    assert [o for o in outside if f"`{o}`" not in doc] == [], doc
    exempt = doc.split("Not FanoutErrors, by design:", 1)[1]
    others = [f"{m}.{n}" for (m, n), e in errors.items() if not issubclass(e, FanoutError)]
    assert [o for o in others if f"`{o}`" not in exempt and o.rsplit(".")[-1][0] != "_"] == []
    assert issubclass(MaskError, ValueError)  # the data workers catch it as one too
    assert windowfile.WindowFormatError is store.WindowFormatError is WindowFormatError


def test_one_hash_and_its_outputs_are_unchanged(tmp_path: Path) -> None:
    from fanout.hashing import CHECKSUM_ALGO, hasher, hexdigest, labelled
    from fanout.store.store import RunDir, Store, WindowMeta

    # xxh3-128, seed 0, as before fanout.hashing: caches and fingerprints stay valid
    assert hexdigest(b"fanout") == "28a336e217e917579ea2fc0ab52f58b1"
    h = hasher(b"fan")
    h.update(b"out")
    assert labelled(h) == f"{CHECKSUM_ALGO}:28a336e217e917579ea2fc0ab52f58b1"
    # a window's checksums are that hash of its bytes, under that label
    t = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    store = Store(RunDir(tmp_path / "run").create())
    meta = WindowMeta(contract_hash="c" * 16, window=0, generation=0, epoch=0,
                      row_start=0, row_end=4)  # fmt: skip
    with store.open(store.publish({"input_ids": t}, meta).name) as r:
        assert r.checksums["input_ids"] == labelled(hasher(t.numpy().tobytes()))
    # and nothing else hashes content on its own
    own = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name != "hashing.py" and re.search(r"^\s*import xxhash", p.read_text(), re.M)
    ]
    assert own == [], f"use fanout.hashing instead of xxhash in {own}"


def test_the_store_docstring_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fanout.store import store

    example = textwrap.dedent((store.__doc__ or "").split("\n\n")[1])
    monkeypatch.chdir(tmp_path)

    class Contract:
        stream_id = "0123456789abcdef"

    h9, h17 = torch.randn(4, 8, 16).bfloat16(), torch.randn(4, 8, 16).bfloat16()
    ns: dict[str, Any] = {
        "h9": h9,
        "h17": h17,
        "ids": torch.zeros(4, 8, dtype=torch.int32),
        "c": Contract(),
    }
    exec(compile(example, "store.__doc__", "exec"), ns)
    assert torch.equal(ns["h0"], h9[0])
    assert "hidden_name(" in example and '"hidden_states"' not in example  # format 2


def _resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_references_in_module_docstrings_resolve() -> None:
    """`fanout.data.workers.verify_against_rule` and the like name something real."""
    bad = []
    for m in _modules():
        for ref in re.findall(r"`(fanout(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", m.__doc__ or ""):
            if not _resolves(ref):
                bad.append(f"{m.__name__}: {ref}")
    assert bad == []


def test_cursors_advance_on_ack_and_a_resume_moves_them_back(tmp_path: Path) -> None:
    """docs/architecture.md: an ack never moves a cursor back; a resume from a checkpoint
    sets it to the checkpoint's, which may be behind (those windows are read again)."""
    from test_coordinator import new_run, produce

    co, store, c = new_run(tmp_path, None, max_live_windows=4)
    p, r = co.register_producer(c), co.register_consumer("a")
    leases: list[Any] = []
    for _ in range(3):
        produce(co, p, store, c)
        lease = co.acquire(r, window=len(leases), timeout_s=1)
        assert lease is not None
        leases.append(lease)
    co.ack(leases[2])
    co.ack(leases[0])  # an older window acked later: the cursor stays
    cursor = lambda: co.conn.execute("SELECT cursor FROM consumers").fetchone()[0]  # noqa: E731
    assert cursor() == 3
    r = co.register_consumer(r.consumer_id.partition(":dp")[0], cursor=1)  # --resume
    assert cursor() == 1
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    assert "never backwards;" not in text and "resume" in text
