"""A verifier that changes (RL co-training): the versioned directory's one reader
(fanout.checkpoints.versions), `fanout produce --follow-verifier`
(fanout.produce.verifier_follow) and a trainer following the versions
(fanout.train.verifier_versions), with what `fanout status` shows of them.

One run (module fixture): a tiny verifier saved twice with different weights as
versions v0001 and v0002 of a versioned directory. The producer starts on v0001; after
its first window a writer makes v0002 and flips `current` to it *before* its commit
marker (half-written: never loaded), after the second window the marker lands, and every
later window is v0002's. Windows are checked against each version's own forward.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.bench.assets import generate_corpus
from fanout.checkpoints.layout import MARKER
from fanout.checkpoints.versions import (
    CURRENT,
    VERSIONS,
    committed_versions,
    current_version,
    is_versioned,
    version_dir,
)
from fanout.coord import reads, schema
from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import Claim, ProducerReg
from fanout.decode.promote import Served
from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.model.verifier import load_verifier
from fanout.model.verifier_dir import read_text_tensors
from fanout.produce.producer import Producer
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.store.store import RunDir, Store
from fanout.store.windowfile import WindowMeta, hidden_name
from fanout.train.config import TrainConfig
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    build_tiny_assets,
    one_thread,
    tiny_producer_config,
)

WINDOWS = 6


def _version(root: Path, n: int, source: Path, *, seed: int | None, commit: bool) -> Path:
    """versions/v000n: `source`'s files, its weights moved by noise drawn from `seed`
    (None: as they are), committed (its marker written last) when `commit`."""
    d = root / VERSIONS / f"v{n:04d}"
    d.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        w = load_file(d / "model.safetensors")
        moved = {
            k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in w.items()
        }
        save_file(moved, d / "model.safetensors", metadata={"format": "pt"})
    if commit:
        (d / MARKER).write_text("")
    return d


def _point(root: Path, n: int) -> None:
    FileSystem().point(root / CURRENT, f"{VERSIONS}/v{n:04d}")


@dataclass
class World:
    root: Path
    policy: Path  # the versioned verifier directory
    run_dir: Path


class _Committing(Producer):
    """A producer whose RL trainer acts right after given windows are published (the
    writer's steps run between two windows, as a real writer's may)."""

    after: ClassVar[dict[int, Callable[[], None]]] = {}

    def produce_one(self, preg: ProducerReg, claim: Claim) -> None:
        super().produce_one(preg, claim)
        self.publisher.finish_inflight()
        if (act := self.after.pop(claim.window, None)) is not None:
            act()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("rl")
    _, _, ver = build_tiny_assets(root, generate_corpus(60, seed=0))
    policy = root / "policy"
    _version(policy, 1, ver, seed=None, commit=True)
    _point(policy, 1)
    v2: list[Path] = []

    def half_written() -> None:
        # v0002 named by `current` before its marker: never loaded
        v2.append(_version(policy, 2, ver, seed=1, commit=False))
        _point(policy, 2)

    def committed() -> None:
        (v2[0] / MARKER).write_text("")  # the next window is v0002's

    _Committing.after = {0: half_written, 1: committed}
    cfg = tiny_producer_config(
        root, root / "run", verifier_name_or_path=str(policy), follow_verifier=True,
        max_windows=WINDOWS, max_live_windows=1000, expected_consumers=1000,
    )  # fmt: skip
    summary = _Committing(cfg).run()
    assert summary["windows"] == WINDOWS
    assert (summary["verifier_version"], summary["verifier_swaps"]) == (2, 1)
    return World(root, policy, root / "run")


# ---- the layout's one reader --------------------------------------------------------


def test_the_live_version_is_never_a_half_written_one(tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    root = tmp_path / "dir"
    assert not is_versioned(root) and current_version(root) is None
    _version(root, 1, src, seed=None, commit=True)
    _version(root, 2, src, seed=None, commit=False)  # being written
    assert is_versioned(root)
    assert current_version(root).name == "v0001"  # type: ignore[union-attr]  # no link: newest committed
    _point(root, 2)  # a writer that flips the link before the marker
    assert current_version(root).name == "v0001"  # type: ignore[union-attr]
    assert version_dir(root, 2) is None and version_dir(root, 1) == root / VERSIONS / "v0001"
    # promote's served directory reads the same layout through the same function
    assert [p.name for p in Served(root).versions()] == ["v0001"]
    assert Served(root).current() == (root / VERSIONS / "v0001").resolve()
    (root / VERSIONS / "v0002" / MARKER).write_text("")
    assert current_version(root).number == 2  # type: ignore[union-attr]
    _point(root, 1)  # a rollback is followed too
    assert current_version(root).number == 1  # type: ignore[union-attr]
    assert [v.number for v in committed_versions(root)] == [1, 2]


def test_window_metadata_carries_the_version_and_reads_it_back() -> None:
    meta = WindowMeta("abc", 3, 0, 0, 12, 16, verifier_version=7)
    assert meta.to_metadata()["verifier_version"] == "7"
    assert WindowMeta.from_metadata(meta.to_metadata()).verifier_version == 7
    plain = WindowMeta("abc", 3, 0, 0, 12, 16)
    assert "verifier_version" not in plain.to_metadata()  # files of a fixed verifier: as before
    with pytest.raises(ValueError, match="verifier_version"):
        WindowMeta.from_metadata(plain.to_metadata() | {"verifier_version": "-1"})


def test_follow_verifier_refuses_a_directory_without_versions(tmp_path: Path) -> None:
    _, _, ver = build_tiny_assets(tmp_path, generate_corpus(8, seed=0))
    cfg = tiny_producer_config(
        tmp_path, tmp_path / "run", verifier_name_or_path=str(ver), follow_verifier=True
    )
    with pytest.raises(ConfigError, match=r"--follow-verifier: .* has no versions/"):
        Producer(cfg)
    assert not (tmp_path / "run" / "coordinator.sqlite3").exists()


def test_the_cli_refuses_it_in_one_line(tmp_path: Path) -> None:
    """`fanout produce --follow-verifier` on a directory with versions but none committed
    yet (its only version has no marker): one line naming the flag, exit 1."""
    from test_cli_errors import error_line, fanout

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _version(tmp_path / "policy", 1, model, seed=None, commit=False)
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    r = fanout("produce", "--run-dir", tmp_path / "run", "--data", data, "--follow-verifier",
               "--verifier-name-or-path", tmp_path / "policy")  # fmt: skip
    error_line(r, "--follow-verifier", "no committed version yet")


# ---- the producer -----------------------------------------------------------------------


def test_each_window_is_captured_whole_by_the_version_it_records(world: World) -> None:
    store = Store(RunDir(world.run_dir))
    co = Coordinator.open(world.run_dir)
    verifiers = {
        n: load_verifier(world.policy / VERSIONS / f"v{n:04d}", capture_layer_ids=[1, 2],
                         device="cpu")
        for n in (1, 2)
    }  # fmt: skip
    got = []
    try:
        for w in range(WINDOWS):
            name = next(p.name for p in (world.run_dir / "windows").glob(f"{w:08d}.g*"))
            with store.open(name) as r:
                version = r.meta.verifier_version
                got.append(version)
                assert reads.window_verifier_version(co.conn, w) == version  # the coordinator's
                ids = [r.get(k).long() for k in ("input_ids", "position_ids", "document_ids")]
                stored = r.get(hidden_name(2))
                for n, v in verifiers.items():  # its own version's forward, and only that
                    same = torch.equal(v.capture(*ids).layers[1], stored)
                    assert same == (n == version), (w, n, version)
    finally:
        co.close()
    # window 0: v0001; window 1: v0002 named by `current` but not committed; then v0002
    assert got == [1, 1] + [2] * (WINDOWS - 2)


# ---- the trainer ------------------------------------------------------------------------


def _train_cfg(world: World, name: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        run_dir=str(world.run_dir), consumer_id=name, verifier_name_or_path=str(world.policy),
        num_layers=1, block_size=4, max_anchors=16, rows_per_step=2,
        save_path=str(world.root / "drafts" / name), lr=1e-2, warmup_ratio=0.0,
        scheduler_type="constant", heartbeat_s=0.5,
    )  # fmt: skip
    return TrainConfig(**(base | kw))


def test_the_drafts_verifier_tensors_follow_each_windows_version(world: World) -> None:
    cfg = _train_cfg(world, "follows")
    trainer = Trainer(cfg)
    assert trainer.versions is not None and trainer.versions.loaded == 2  # built from the live one
    trainer.run()
    steps = read_train_log(cfg.save_path)
    # 2 steps per window (4 rows, 2 per step); no step mixes versions
    assert [r["verifier_version"] for r in steps] == [1] * 4 + [2] * (2 * WINDOWS - 4)
    assert [r["verifier_lag"] for r in steps] == [0] * len(steps)  # no lag bound, no decay: unread
    assert trainer.versions.reloads == 2  # v0002 (built) -> v0001 -> v0002
    embed2 = read_text_tensors(world.policy / VERSIONS / "v0002")[0].float()
    embed1 = read_text_tensors(world.policy / VERSIONS / "v0001")[0].float()
    assert not torch.equal(embed1, embed2)
    assert torch.equal(trainer.draft.embed_weight.float(), embed2)
    assert torch.equal(trainer.draft.lm_head_weight.float(), embed2)  # tied: the head too


def test_eval_every_decodes_with_the_version_the_draft_trains_with_now(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#52: `--eval-every` measured τ against the version the trainer started from
    (v0002, the live one) for the whole run, even while the draft trained on v0001's
    rows with v0001's head: each eval decodes with the version of the draft's tensors."""
    import fanout.decode.eval as decode_eval

    built: list[str] = []

    class Spy(decode_eval.EvalSession):
        def __init__(self, cfg: Any, layer_ids: list[int]) -> None:
            built.append(Path(cfg.verifier_name_or_path).name)
            super().__init__(cfg, layer_ids)

    monkeypatch.setattr(decode_eval, "EvalSession", Spy)
    cfg = _train_cfg(
        world, "evals", eval_every=2, eval_data=str(world.root / "chat.jsonl"),
        eval_prompts=1, eval_max_new_tokens=4, eval_tokenizer=str(world.root / "tok"),
    )  # fmt: skip
    Trainer(cfg).run()
    evals = [r for r in read_train_log(cfg.save_path) if "eval_tau" in r]
    assert [r["verifier_version"] for r in evals] == [1, 1] + [2] * (WINDOWS - 2)
    assert built == ["v0001", "v0002"]  # one session per version, rebuilt when it moved
    assert [r["eval_verifier_version"] for r in evals] == [r["verifier_version"] for r in evals]


def test_windows_too_many_versions_old_are_acked_untrained_and_counted(world: World) -> None:
    cfg = _train_cfg(world, "fresh", max_verifier_lag=0, verifier_age_decay=0.5)
    trainer = Trainer(cfg)
    out = trainer.run()
    steps = read_train_log(cfg.save_path)
    assert [r["verifier_version"] for r in steps] == [2] * (2 * WINDOWS - 4)
    assert all(r["lag_skipped_windows"] == 2 for r in steps)
    assert out["cursor"] == WINDOWS  # every window acknowledged, the skipped ones too
    with Coordinator.open(world.run_dir) as co:
        snap = snapshot(co)
        assert reads.lag_skipped(co.conn)["fresh:dp0"] == 2
        from fanout.status.page import page_html
        from fanout.status.snapshot import build

        page = page_html(build(co), [], 5)  # the --serve page: the same versions
    assert 'data-key="verifier.newest">2<' in page
    assert "<tr><td>fresh:dp0</td><td>2</td><td>0</td><td>2</td></tr>" in page
    assert snap["verifier"] == {"newest": 2, "live": {"1": 2, "2": WINDOWS - 2}}
    me = next(c for c in snap["consumers"] if c["id"] == "fresh:dp0")
    assert (me["verifier_version"], me["verifier_lag"], me["lag_skipped"]) == (2, 0, 2)
    text = format_table(snap)
    assert "verifier newest version 2" in text and "2 windows skipped as too old" in text


def test_age_decay_weighs_older_rows_less(world: World) -> None:
    from fanout.train.verifier_versions import VersionFollower, VersionOptions, live_version

    start = live_version(str(world.policy))
    assert start is not None
    f = VersionFollower(str(world.policy), start, VersionOptions(verifier_age_decay=0.5))
    assert [f.weight(k) for k in (0, 1, 3)] == [1.0, 0.5, 0.125]
    assert not f.too_old(5)  # no --max-verifier-lag: nothing is skipped
    off = VersionFollower(str(world.policy), start, VersionOptions())
    assert off.weight(4) == 1.0 and not off.reads_newest


# ---- the coordinator's schema -----------------------------------------------------------


def test_a_schema_5_run_gains_the_version_columns(db: str | None, tmp_path: Path) -> None:
    from test_coordinator import new_run, produce

    co, store, c = new_run(tmp_path, db)
    p = co.register_producer(c)
    produce(co, p, store, c)
    with co.conn.write() as cur:  # back to version 5: no version columns
        cur.execute("ALTER TABLE windows DROP COLUMN verifier_version")
        cur.execute("ALTER TABLE consumers DROP COLUMN lag_skipped")
        cur.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
    co.close()
    with Coordinator.open(tmp_path / "run", db_path=db) as again:
        assert again.meta("schema_version") == str(schema.SCHEMA_VERSION) == "6"
        assert again.newest_verifier_version() is None  # a fixed verifier: none recorded
        reg = again.register_consumer("a")
        again.count_lag_skipped(reg, 3)
        assert reads.lag_skipped(again.conn) == {"a:dp0": 3}
