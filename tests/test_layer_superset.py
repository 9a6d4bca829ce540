"""One capture, many layer choices: a run captures a superset of layers, each trainer
trains on its own subset (issue 15).

    .venv/bin/pytest tests/test_layer_superset.py -x -q

A random tiny Qwen3 with 8 layers. One run captures layers 1..7; three trainers read
[1, 4, 7], [5, 2] (read as [2, 5]: a draft's layers are ascending, the order engines
serve them in; tests/test_layer_order.py) and [1..7] from it, and each matches a
trainer of a run that captured exactly its layers, loss for loss. Windows hold one tensor per
layer with a checksum each: a reader verifies only what it reads, a flipped byte in
a layer is caught by whoever reads that layer, and a layer that was not captured is
refused before anything starts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from fanout.bench.assets import (
    build_tokenizer,
    generate_corpus,
    tiny_verifier_for_tokenizer,
    write_jsonl,
)
from fanout.contract import CaptureContract, LayersNotCaptured
from fanout.coord.coordinator import Coordinator
from fanout.errors import AcquireTimeout, ConfigError, CorruptWindow
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.store.store import RunDir, Store, WindowReader, verify_file
from fanout.store.windowfile import WindowFormatError, hidden_name, scale_name
from fanout.train.config import TrainConfig
from fanout.train.consumer import ConsumerConfig, ConsumerStream, row_order
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log
from tiny_run import RECORDER, one_thread, run_recorder, tiny_producer_config  # noqa: F401 (one_thread: an autouse fixture)
from window_files import tensor_byte_range, window_names

REPO = Path(__file__).resolve().parents[1]
UNION = [1, 2, 3, 4, 5, 6, 7]
SETS = {"a": [1, 4, 7], "b": [5, 2], "c": UNION}  # b is asked unsorted: read ascending


@dataclass(frozen=True)
class Env:
    root: Path
    verifier: Path
    superset: Path  # captured UNION
    exact: dict[str, Path]  # captured exactly SETS[k]


def _producer_cfg(env_root: Path, run_dir: Path, **kw: Any) -> ProducerConfig:
    """tiny_producer_config, capturing only what each test names (capture_layer_ids)."""
    base: dict[str, Any] = dict(
        capture_layer_ids=None,
        max_windows=3,
        max_live_windows=1000,  # never evicts: every test reads every window
        expected_consumers=1000,
        cache_dir=str(env_root / "cache"),  # one data preparation, the same rows everywhere
        heartbeat_s=0.3,
    )
    return tiny_producer_config(env_root, run_dir, **(base | kw))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    root = tmp_path_factory.mktemp("superset")
    corpus = generate_corpus(80, seed=0)
    write_jsonl(root / "chat.jsonl", corpus)
    tok = build_tokenizer(root / "tok", corpus, 512)
    ver = tiny_verifier_for_tokenizer(
        root / "verifier", tok, hidden_size=32, num_layers=8, tie_word_embeddings=True
    )
    Producer(_producer_cfg(root, root / "superset", capture_layer_ids=UNION)).run()
    exact = {}
    for k, layers in SETS.items():
        exact[k] = root / f"exact-{k}"
        Producer(_producer_cfg(root, exact[k], capture_layer_ids=layers)).run()
    return Env(root, ver, root / "superset", exact)


def _train_cfg(env: Env, run_dir: Path, name: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        run_dir=str(run_dir),
        consumer_id=name,
        verifier_name_or_path=str(env.verifier),
        num_layers=1,
        block_size=4,
        max_anchors=16,
        rows_per_step=2,
        max_steps=4,  # two windows
        save_path=str(env.root / "drafts" / f"{run_dir.name}-{name}"),
        lr=1e-2,
        warmup_ratio=0.0,
        scheduler_type="constant",
        heartbeat_s=0.5,
        checkpoint_every=1000,
    )
    return TrainConfig(**(base | kw))


def _log(cfg: TrainConfig) -> list[dict[str, Any]]:
    return read_train_log(cfg.save_path)


def _layers_of(r: WindowReader, layers: list[int]) -> torch.Tensor:
    return torch.cat([r.get(hidden_name(i)) for i in layers], -1)  # [R, T, k·H]


# ---- the contract and the windows ---------------------------------------------------


def test_the_contract_records_the_captured_set_and_windows_one_tensor_per_layer(
    env: Env,
) -> None:
    c = CaptureContract.load(env.superset / "contract.json")
    assert list(c.target_layer_ids) == UNION and c.format_version == 2
    for k, layers in SETS.items():  # other layer sets: other contracts, same rows
        e = CaptureContract.load(env.exact[k] / "contract.json")
        assert set(c.diff(e)) <= {"target_layer_ids"} and list(e.target_layer_ids) == layers
    store, exact = Store(RunDir(env.superset)), Store(RunDir(env.exact["b"]))
    for name in window_names(store):
        with store.open(name) as r, exact.open(name) as x:
            hidden = [n for n in r.names() if n.startswith("hidden_states")]
            assert hidden == [hidden_name(i) for i in UNION]  # in layer order in the file
            assert all(r.get(n).shape == (4, 96, 32) for n in hidden)
            # the same forward: a layer's bytes do not depend on what else was captured
            for i in SETS["b"]:
                assert torch.equal(r.get(hidden_name(i)), x.get(hidden_name(i)))
            assert torch.equal(r.get("target_ids"), x.get("target_ids"))


def test_capture_layer_ids_all_and_its_older_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`capture_layer_ids` (one field, in ProducerConfig and VerifierConfig) takes ids or
    'all'; its older name `target_layer_ids` means the same; giving both is one line."""
    from fanout import cli
    from fanout.model.capture_layers import resolve_capture_layer_ids
    from fanout.model.verifier import VerifierConfig

    base = dict(run_dir="r", verifier_name_or_path="v", data=["d"])
    for key in ("capture_layer_ids", "target_layer_ids"):
        assert ProducerConfig(**base, **{key: "all"}).capture_layer_ids == ["all"]
        assert ProducerConfig(**base, **{key: ["3", "1"]}).capture_layer_ids == [3, 1]
        assert VerifierConfig(path="v", **{key: (2, 0)}).capture_layer_ids == [2, 0]
        assert VerifierConfig(path="v", **{key: "all"}).capture_layer_ids == ["all"]
        with pytest.raises(ValueError, match="stands alone"):
            ProducerConfig(**base, **{key: ["all", 1]})
    assert ProducerConfig(**base).capture_layer_ids is None  # the DFlash rule
    for both in ({"target_layer_ids": [1], "capture_layer_ids": [1, 2]},
                 {"target_layer_ids": None, "capture_layer_ids": [1]}):  # fmt: skip
        with pytest.raises(ValueError, match="older name --target-layer-ids, not both"):
            ProducerConfig(**base, **both)
        with pytest.raises(ValueError, match="not both"):
            VerifierConfig(path="v", **both)
    # the command line: one line naming the flag, exit 1, nothing created
    conf = tmp_path / "both.json"
    conf.write_text(json.dumps({"target_layer_ids": [1], "capture_layer_ids": [2]}))
    run = tmp_path / "run"
    argv = ["produce", "--run-dir", str(run), "--verifier-name-or-path", str(tmp_path),
            "--data", str(conf), "--config", str(conf)]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    want = f"--config {conf}: keys 'capture_layer_ids' and 'target_layer_ids' both set --capture-layer-ids"
    assert len(err.splitlines()) == 1 and want in err and "Traceback" not in err, err
    assert not run.exists()
    assert resolve_capture_layer_ids(8, "all", None) == list(range(8))
    assert resolve_capture_layer_ids(8, ["all"], None) == list(range(8))


# ---- trainers -------------------------------------------------------------------------


def test_three_layer_sets_on_one_run_train_exactly_as_on_their_own_runs(env: Env) -> None:
    summaries = {}
    for k, layers in SETS.items():
        shared = _train_cfg(env, env.superset, f"sweep-{k}", target_layer_ids=layers)
        alone = _train_cfg(env, env.exact[k], f"alone-{k}")  # default: the run's layers
        summaries[k] = (Trainer(shared).run(), Trainer(alone).run())
        a, b = _log(shared), _log(alone)
        assert [r["step"] for r in a] == [1, 2, 3, 4]
        # same seed, same rows, same context bytes in the same order: the same numbers
        assert [r["loss"] for r in a] == [r["loss"] for r in b], k
        assert [r["windows"] for r in a] == [r["windows"] for r in b] == [[0], [0], [1], [1]]
        assert summaries[k][0]["param_checksum"] == summaries[k][1]["param_checksum"]
        # the checkpoint records the layers the draft used, in serving numbering, ascending
        cfgs = sorted(Path(shared.save_path).glob("**/config.json"))
        spec = json.loads(cfgs[-1].read_text())
        assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in sorted(layers)], k
    # [5, 2] is [2, 5]; negative control: another layer is another context
    sweep_b = _log(_train_cfg(env, env.superset, "sweep-b"))
    for name, layers, same in (("sorted-b", [2, 5], True), ("other-b", [2, 6], False)):
        cfg = _train_cfg(env, env.superset, name, target_layer_ids=layers, max_steps=1)
        Trainer(cfg).run()
        assert (_log(cfg)[0]["loss"] == sweep_b[0]["loss"]) is same, name
    # fanout status shows each consumer's layer set
    with Coordinator.open(env.superset) as co:
        snap = snapshot(co)
        table = format_table(snap)
    got = {c["id"]: c["target_layer_ids"] for c in snap["consumers"]}
    for k, layers in SETS.items():
        assert got[f"sweep-{k}:dp0"] == sorted(layers)
    assert "layers" in table and "2,5" in table and "5,2" not in table and "1,4,7" in table


def test_an_uncaptured_layer_is_refused_at_once_naming_the_captured_ones(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    from fanout.train import trainer as train

    t0 = time.monotonic()
    with pytest.raises(
        LayersNotCaptured, match=r"\[0\] were not captured.*\[1, 2, 3, 4, 5, 6, 7\]"
    ):
        Trainer(_train_cfg(env, env.superset, "bad", target_layer_ids=[0, 1]))
    with pytest.raises(LayersNotCaptured, match=r"\[3\] were not captured.*it captured \[5, 2\]"):
        ConsumerStream(ConsumerConfig(run_dir=str(env.exact["b"]), consumer_id="bad",
                                      target_layer_ids=[2, 3])).open()  # fmt: skip
    with pytest.raises(ConfigError, match="distinct"):
        ConsumerStream(ConsumerConfig(run_dir=str(env.superset), consumer_id="bad",
                                      target_layer_ids=[2, 2])).open()  # fmt: skip
    with Coordinator.open(env.superset) as co:  # nothing was registered
        ids = [c for (c,) in co.conn.execute("SELECT id FROM consumers WHERE id LIKE 'bad%'")]
    assert ids == []
    save = env.root / "drafts" / "bad-cli"
    argv = ["--run-dir", str(env.superset), "--consumer-id", "bad", "--verifier-name-or-path",
            str(env.verifier), "--save-path", str(save), "--target-layer-ids", "8", "1"]  # fmt: skip
    assert train.main(argv) == 1
    err = capsys.readouterr().err
    assert "[8] were not captured" in err and "[1, 2, 3, 4, 5, 6, 7]" in err
    assert not save.exists()  # refused before the draft was built or anything written
    assert time.monotonic() - t0 < 60


# ---- verification of subset reads -------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_subset_reads_verify_only_their_tensors_and_a_flip_is_caught_by_its_reader(
    env: Env, tmp_path: Path
) -> None:
    store = Store(RunDir(env.superset))
    src = store.path(window_names(store)[0])
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    wanted = [hidden_name(1), hidden_name(4)]
    with WindowReader(path, tensors=wanted) as r:
        assert r.verified == set(wanted)  # the header, and only these tensors' bytes
        lo, hi = tensor_byte_range(path, hidden_name(3))
        r.get("input_ids")  # anything else is verified when first read
        assert r.verified == {*wanted, "input_ids"}
    _flip(path, (lo + hi) // 2)  # inside layer 3, which that reader never read
    with WindowReader(path, tensors=wanted) as r:  # a reader of other layers is unaffected
        good = _layers_of(r, [1, 4]).clone()
        with pytest.raises(CorruptWindow, match=r"checksum mismatch in tensor 'hidden_states\.3'"):
            r.get(hidden_name(3))  # ... and whoever reads layer 3 catches it
    with pytest.raises(CorruptWindow, match=r"hidden_states\.3"):
        WindowReader(path, tensors=[hidden_name(3)])
    with pytest.raises(CorruptWindow, match=r"hidden_states\.3"):
        verify_file(path)
    with store.open(src.name) as r:
        assert torch.equal(good, _layers_of(r, [1, 4]))
    _flip(path, (lo + hi) // 2)  # undo; now the header: every reader catches that
    assert verify_file(path).window == 0
    _flip(path, 40)
    with pytest.raises(CorruptWindow):
        WindowReader(path, tensors=[])


def test_a_consumer_of_other_layers_reads_past_a_flip_the_layers_reader_reports_it(
    env: Env, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _producer_cfg(env.root, run, capture_layer_ids=[1, 2, 3, 4], max_windows=2)
    Producer(cfg).run()
    store = Store(RunDir(run))
    name = window_names(store)[0]
    with store.open(name) as r:
        lo, _ = tensor_byte_range(store.path(name), hidden_name(3))
        want = _layers_of(r, [1, 4]).clone()  # asked [4, 1]: read ascending
    _flip(store.path(name), lo + 7)

    def ccfg(cid: str, layers: list[int], **kw: Any) -> ConsumerConfig:
        return ConsumerConfig(run_dir=str(run), consumer_id=cid, target_layer_ids=layers,
                              heartbeat_s=0.3, max_windows=1, prefetch=False, **kw)  # fmt: skip

    with ConsumerStream(ccfg("other", [4, 1])) as s:
        assert hidden_name(3) not in s.read_names
        for b in s.batches(4):
            order = row_order(0, 4, 0)
            assert torch.equal(b.tensors["hidden_states"], want[torch.from_numpy(order)])
            s.ack(b)
    # the reader of layer 3 reports it (quarantined, queued for recapture) and waits
    with (
        ConsumerStream(ccfg("three", [3], acquire_timeout_s=1.0)) as s,
        pytest.raises(AcquireTimeout),
    ):
        next(s.batches(4))
    with Coordinator.open(run) as co:
        assert int(co.meta("corrupt")) == 1
        state = co.conn.execute("SELECT state, demand FROM windows WHERE window=0").fetchone()
        assert tuple(state) == ("queued", 1)
    assert len(list(RunDir(run).quarantine.iterdir())) == 1
    Producer(cfg).run()  # recaptures it (demand first)
    with ConsumerStream(ccfg("three-again", [3])) as s:
        got = [b.rows for b in s.batches(4)]
    assert [w for rows in got for w, _ in rows] == [0, 0, 0, 0]


def test_fp8_subset_reads_their_scales(env: Env, tmp_path: Path) -> None:
    from fanout.ops.fp8 import FP8, dequantize

    run = tmp_path / "fp8"
    Producer(_producer_cfg(env.root, run, capture_layer_ids=[1, 2, 3], max_windows=1,
                           storage_dtype="float8_e4m3fn")).run()  # fmt: skip
    cfg = ConsumerConfig(run_dir=str(run), consumer_id="fp8", target_layer_ids=[3, 1],
                         max_windows=1, prefetch=False)  # fmt: skip
    store = Store(RunDir(run))
    with ConsumerStream(cfg) as s, store.open(window_names(store)[0]) as r:
        assert set(s.read_names) >= {hidden_name(3), scale_name(3), hidden_name(1), scale_name(1)}
        assert hidden_name(2) not in s.read_names and scale_name(2) not in s.read_names
        b = next(s.batches(4))
        idx = torch.from_numpy(row_order(0, 4, 0))
        q, scale = b.tensors["hidden_states"], b.tensors["hidden_states_scale"]
        assert q.dtype == FP8 and q.shape == (4, 96, 64) and scale.shape == (4, 96, 2)
        want = torch.cat(
            [dequantize(r.get(hidden_name(i)), r.get(scale_name(i))[..., None]) for i in (1, 3)],
            -1,
        )[idx]
        assert torch.equal(dequantize(q, scale), want)
        s.ack(b)


def test_old_window_format_and_old_runs_are_refused_clearly(env: Env, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    store = Store(RunDir(env.superset))
    with store.open(window_names(store)[0]) as r:
        meta = r.meta
        tensors = {"hidden_states": _layers_of(r, UNION).clone()}
    old = tmp_path / "00000000.g0.safetensors"
    save_file(tensors, str(old), metadata={**meta.to_metadata(), "format": "fanout-window-1"})
    with pytest.raises(WindowFormatError, match=r"fanout-window-1.*fanout-window-2"):
        WindowReader(old)
    assert not issubclass(WindowFormatError, CorruptWindow)  # never quarantined + recaptured
    c = CaptureContract.load(env.superset / "contract.json")
    with pytest.raises(ConfigError, match="window format 1"):
        c.model_copy(update={"format_version": 1}).require({})


# ---- kill -9 and resume of a subset consumer ------------------------------------------


def test_kill9_and_resume_of_a_subset_consumer(env: Env, tmp_path: Path) -> None:
    layers = [6, 3]  # asked unsorted; read as 3 then 6
    store = Store(RunDir(env.superset))
    want = []  # (window, row, hash of that row's layers 3 then 6), in consumption order
    for w, name in enumerate(window_names(store)):
        with store.open(name) as r:
            hidden = _layers_of(r, sorted(layers))
            for i in row_order(w, r.rows, 0):
                raw = hidden[int(i)].contiguous().view(torch.uint8).numpy().tobytes()
                want.append((w, int(i), xxhash.xxh3_64_hexdigest(raw)))
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    out, ckpt = tmp_path / "rows.jsonl", tmp_path / "ckpt.json"
    cfg = {
        "consumer_id": "sub",
        "target_layer_ids": layers,
        "max_windows": len(window_names(store)),
    }
    args = {"run_dir": str(env.superset), "out": str(out), "ckpt": str(ckpt), "cfg": cfg}

    def recorded() -> list[tuple[int, int, str]]:
        if not out.exists():
            return []
        return [(r["w"], r["i"], r["h"]) for r in map(json.loads, out.read_text().splitlines())]

    run_recorder(script, args, until=lambda: len(recorded()) >= 5)
    first = recorded()
    assert 0 < len(first) < len(want), "the kill came after the end; test is vacuous"
    assert first == want[: len(first)]
    state = json.loads(ckpt.read_text())
    run_recorder(script, args)  # to the end
    # every row after the checkpoint, in order, with its own layers' bytes
    assert recorded()[len(first) :] == want[state["seen"] :]
    with Coordinator.open(env.superset) as co:
        snap = snapshot(co)
    sub = [c for c in snap["consumers"] if c["id"] == "sub:dp0"]
    assert sub and sub[0]["target_layer_ids"] == [3, 6] and sub[0]["state"] == "finished"
