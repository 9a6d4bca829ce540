"""Tensor-parallel capture (`fanout produce --tp 2` under torchrun, gloo on CPU).

    .venv/bin/pytest tests/test_tp.py -x -q -p no:randomly

The tiny Qwen3 of tests/tiny_run.py (4 heads, 2 kv heads, intermediate 128: all
split 2 ways) in real torchrun process groups: every rank's decoder-layer outputs
are whole and equal, and equal a 1-process capture; a TP producer's windows equal a
1-process producer's; a follower outlives a hold at K longer than the collective
timeout; kill -9 of either rank stops the other with one line; a restarted TP
producer finishes the run. Refusals are checked in-process, before any weight loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout import cli
from fanout.coord.coordinator import Coordinator
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.store.store import RunDir, Store, parse_window_name
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    ENV,
    TinyAssets,
    config_flags,
    one_thread,
    tiny_assets,
    tiny_producer_config,
    wait_for,
)
from window_files import window_names

pytest.importorskip("accelerate")  # transformers' TP loading needs it (the `tp` extra)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]

# Every rank captures the same packed batch with its shard, then all-gathers what it
# captured; rank 0 compares the ranks with each other and with an unsharded capture.
REPLICAS = """
import json, sys, torch, torch.distributed as dist
from fanout.model.verifier import load_verifier
from fanout.produce.tp_capture import start_process_group


def main():
    torch.set_num_threads(1)
    ver, out = sys.argv[1], sys.argv[2]
    vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 500
    rank, _ = start_process_group("cpu", 120)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 48), generator=g)
    docs = torch.tensor([[0] * 20 + [1] * 28, [0] * 40 + [-1] * 8])
    pos = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, 48).clone()
    pos[1] = torch.cat([torch.arange(40), torch.zeros(8, dtype=torch.long)])
    opts = dict(capture_layer_ids="all", storage_dtype="float32", store_last_hidden_states=True)
    def flat(c):
        return torch.stack([*c.layers, c.last_hidden_states]), c.target_ids  # [L+1, B, T, H]
    tpv = load_verifier(ver, tp=2, **opts)
    hid, tgt = flat(tpv.capture(ids, pos, docs))
    # the per-shard argmax against argmax of the gathered logits (transformers' own path),
    # and a tie across shards (all-zero rows: every logit 0) -> the first index, 0
    x = torch.randn(64, tpv.hidden_size, generator=g)
    x[:3] = 0
    with torch.inference_mode():
        fast = tpv._sharded_head.argmax(x)
        slow = tpv.lm_head(x).argmax(-1)
    head_ok = bool(torch.equal(fast, slow)) and fast[:3].tolist() == [0, 0, 0]
    hs = [torch.empty_like(hid) for _ in range(2)]
    ts = [torch.empty_like(tgt) for _ in range(2)]
    dist.all_gather(hs, hid)
    dist.all_gather(ts, tgt)
    if rank == 0:
        ref_h, ref_t = flat(load_verifier(ver, **opts).capture(ids, pos, docs))
        out_json = {
            "replica_diff": [(hs[0][i] - hs[1][i]).abs().max().item() for i in range(len(hid))],
            "vs_one_process": [(hs[0][i] - ref_h[i]).abs().max().item() for i in range(len(hid))],
            "scale": ref_h.abs().max().item(),
            "targets_equal_ranks": bool(torch.equal(ts[0], ts[1])),
            "targets_equal_one_process": bool(torch.equal(ts[0], ref_t)),
            "sharded_head_ok": head_ok,
        }
        with open(out, "w") as f:
            json.dump(out_json, f)


# Everything that holds a process group (the sharded model, DTensors) dies with main(),
# before interpreter shutdown: a group freed during finalization can abort in gloo's
# teardown ("terminate called without an active exception"; it did once in CI, where
# the model was a module global). The ranks also end together, as the producer's STOP
# does.
main()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory.mktemp("tp"))


def _cfg(tiny: TinyAssets, run_dir: Path, **kw: Any) -> ProducerConfig:
    own = {"cache_dir": str(tiny.root / "cache"), "heartbeat_s": 0.3, "max_live_windows": 64}
    own |= {"storage_dtype": "float32", "store_last_hidden_states": True}
    return tiny_producer_config(tiny.root, run_dir, **(own | kw))


def _torchrun(cfg: ProducerConfig, log: Path) -> subprocess.Popen[bytes]:
    argv = [*TORCHRUN, str(cfg.tp), "-m", "fanout.cli", "produce", *config_flags(cfg)]
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def _ranks(launcher: subprocess.Popen[bytes]) -> dict[int, int]:
    """{rank: pid} of a torchrun launcher's worker processes (from their environment)."""
    out: dict[int, int] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != launcher.pid:  # field 4: ppid
            continue
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            out[int(rank)] = pid
    return out


def _windows(run_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every published window's tensors, by window index."""
    store = Store(RunDir(run_dir))
    got = {}
    for name in window_names(store):
        with store.open(name) as r:
            got[r.meta.window] = {k: r.get(k).clone() for k in r.names()}
    return got


# ---- refusals, before anything is loaded or created ------------------------------------


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["produce", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_refuses_what_cannot_work_before_loading(
    tiny: TinyAssets,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers import GPT2Config, Qwen3Config

    run = tmp_path / "run"
    flags = config_flags(_cfg(tiny, run, tp=2))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert "torchrun --nproc-per-node 2 -m fanout.cli produce --tp 2" in _refused(flags, capsys)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "torchrun started 3 processes" in _refused(flags, capsys)
    monkeypatch.setenv("WORLD_SIZE", "2")
    kv1 = tmp_path / "kv1"
    Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=8).save_pretrained(kv1)
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_positions=512).save_pretrained(gpt2)
    for d in (kv1, gpt2):  # weights present (never read): the shape checks come first
        (d / "model.safetensors").write_bytes(b"")
    for ver, want in ((kv1, "num_key_value_heads = 1, not divisible by 2"), (gpt2, "no tensor")):
        cfg = _cfg(tiny, run, tp=2, verifier_name_or_path=str(ver))
        assert want in _refused(config_flags(cfg), capsys)
    assert not run.exists()  # nothing was created


# ---- what each rank captures --------------------------------------------------------


def _replicas(verifier: Path, tmp_path: Path, vocab: int = 500) -> dict[str, Any]:
    """REPLICAS run by a 2-rank torchrun on `verifier`: what rank 0 measured."""
    script, out = tmp_path / "replicas.py", tmp_path / "replicas.json"
    script.write_text(REPLICAS)
    argv = [*TORCHRUN, "2", str(script), str(verifier), str(out), str(vocab)]
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r: dict[str, Any] = json.loads(out.read_text())
    return r


def test_every_rank_captures_whole_layers_equal_to_one_process(
    tiny: TinyAssets, tmp_path: Path
) -> None:
    r = _replicas(tiny.verifier, tmp_path)
    assert len(r["replica_diff"]) == 4 + 1  # every layer, then the final-normed state
    assert max(r["replica_diff"]) == 0.0  # replicated after the all-reduce: bit-identical
    # fp32, only the reduction order differs (measured ≤ 1.5e-6 on states of scale ~5)
    assert max(r["vs_one_process"]) <= 1e-5 * max(1.0, r["scale"]), r
    assert r["targets_equal_ranks"] and r["targets_equal_one_process"]
    assert r["sharded_head_ok"]


# ---- the verifier zoo ------------------------------------------------------------------


def test_a_plan_that_splits_no_decoder_layer_is_refused(tmp_path: Path) -> None:
    """From config.json alone: gpt-oss's plan splits only its embedding (attention with
    sinks and the experts are outside it), refused in one line naming it; every other
    zoo architecture (MLA, linear attention, sliding, chunked, multimodal) passes."""
    from fanout.errors import ConfigError
    from fanout.model.tp_shard import check_tp_model
    from verifier_zoo import ZOO

    for arch, a in ZOO.items():
        d = tmp_path / arch
        a.config().save_pretrained(d)
        if arch != "gpt_oss":
            check_tp_model(d, 2)
    with pytest.raises(ConfigError) as e:
        check_tp_model(tmp_path / "gpt_oss", 2)
    msg = str(e.value)
    assert "gpt_oss" in msg and "splits no decoder-layer weight (only embed_tokens)" in msg
    assert "--tp 1" in msg and "\n" not in msg


# every zoo architecture --tp accepts; one in the default run (linear attention + a
# multimodal checkpoint's text tower), the rest slow (~15 s of torchrun each)
_TP_ZOO = ["qwen3_5_multimodal"]


def _tp_cases() -> list[Any]:
    from verifier_zoo import ZOO

    return [
        pytest.param(a, marks=() if a in _TP_ZOO else pytest.mark.slow)
        for a in ZOO
        if a != "gpt_oss"
    ]


@pytest.mark.parametrize("arch", _tp_cases())
def test_zoo_verifier_is_exact_at_tp_2(arch: str, tmp_path: Path) -> None:
    """Every layer type under transformers' plan, 2 ranks against one process: layers
    bit-identical across ranks, within reduction-order noise of one process."""
    from verifier_zoo import VOCAB, build

    r = _replicas(build(arch, tmp_path / arch), tmp_path, VOCAB)
    assert max(r["replica_diff"]) == 0.0
    assert max(r["vs_one_process"]) <= 1e-5 * max(1.0, r["scale"]), r
    assert r["targets_equal_ranks"] and r["targets_equal_one_process"]


# ---- the producer under torchrun -------------------------------------------------------


# slow (≈40 s): the default run keeps TP capture equal to one process; this is the crash path
@pytest.mark.slow
def test_kill9_of_either_rank_stops_the_other_and_a_restart_finishes_the_run(
    tiny: TinyAssets, tmp_path: Path
) -> None:
    """Held at K = 3 with nobody reading, rank 0 keeps its follower alive past several
    --tp-timeout-s (keepalives). kill -9 of the follower stops rank 0 with one line;
    after a restart, kill -9 of rank 0 stops the follower with one line; no claim is
    left in flight. A third TP producer, read by a consumer, finishes the stream, and
    every window equals a 1-process producer's."""
    ref = tmp_path / "ref"
    Producer(_cfg(tiny, ref, epochs=2)).run()
    want = _windows(ref)
    run, log = tmp_path / "run", tmp_path / "tp.log"
    timeout = 4.0
    cfg = _cfg(tiny, run, epochs=2, max_live_windows=3, tp=2, tp_timeout_s=timeout)

    def kill(rank: int, hold_s: float) -> str:
        start = len(log.read_text()) if log.exists() else 0
        p = _torchrun(cfg, log)

        def held() -> bool:  # rank 0 registered, rank 1 follows, K windows are out
            text = log.read_text()[start:]
            up = "registered (token" in text and "following rank 0" in text
            return up and len(_window_names(run)) >= 2

        try:
            wait_for(lambda: held() or p.poll() is not None, 300, "a hold at K")
            time.sleep(hold_s)  # held at K: without keepalives rank 1's wait would time out
            assert p.poll() is None, log.read_text()[-3000:]
            ranks = _ranks(p)
            assert sorted(ranks) == [0, 1], ranks
            with Coordinator.open(run) as co:  # rank 0 holds the producer role, rank 1 none
                assert co.conn.execute("SELECT pid FROM producers").fetchall() == [(ranks[0],)]
            assert not _open_under(ranks[1], run)  # the follower has nothing of the run open
            os.kill(ranks[rank], signal.SIGKILL)
            assert p.wait(120) != 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        text = log.read_text()[start:]
        lost = [x for x in text.splitlines() if x.startswith("fanout produce: error:")]
        assert len(lost) == 1, text[-3000:]
        with Coordinator.open(run) as co:
            assert (
                co.conn.execute("SELECT 1 FROM windows WHERE state = 'capturing'").fetchall() == []
            )
        return lost[0]

    assert "a tensor-parallel follower rank is gone" in kill(1, hold_s=3 * timeout)
    assert "tensor-parallel rank 0 (the producer) is gone" in kill(0, hold_s=0)

    total = json.loads((run / "stream.json").read_text())["total_windows"]
    last = _torchrun(cfg, log)
    try:
        _consume_and_compare(run, want, total)
        assert last.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if last.poll() is None:
            last.kill()
            last.wait()
    with Coordinator.open(run) as co:
        rows = co.conn.execute("SELECT window, state FROM windows ORDER BY window").fetchall()
    assert [w for w, _ in rows] == list(range(total)) and total == len(want)


# slow (4 processes on 2 cores): the composition of --tp with --replicas
@pytest.mark.slow
def test_two_tp_groups_are_two_replicas_of_one_run(tiny: TinyAssets, tmp_path: Path) -> None:
    """Two torchrun launches of `--tp 2 --replicas 2` (each takes a free rank; rank 0 of
    each group registers it): they make the stream together, each window once, and a
    consumer reads every window equal to a 1-process producer's. One torchrun of 4
    processes for the two groups is refused with one line saying how to start them."""
    ref = tmp_path / "ref"
    Producer(_cfg(tiny, ref, epochs=2)).run()
    want = _windows(ref)
    run = tmp_path / "run"
    cfg = _cfg(tiny, run, epochs=2, tp=2, replicas=2)
    groups = [_torchrun(cfg, tmp_path / f"group-{i}.log") for i in range(2)]

    def created() -> bool:
        co = Coordinator.open_if_created(run)
        if co is not None:
            co.close()
        return co is not None or any(g.poll() is not None for g in groups)

    try:
        total = len(want)
        wait_for(created, 300, "the run created")
        _consume_and_compare(run, want, total)
        for i, g in enumerate(groups):
            assert g.wait(300) == 0, (tmp_path / f"group-{i}.log").read_text()[-3000:]
    finally:
        for g in groups:
            if g.poll() is None:
                g.kill()
                g.wait()
    with Coordinator.open(run) as co:
        made = co.conn.execute("SELECT rank, made FROM producers ORDER BY rank").fetchall()
    assert [r for r, _ in made] == [0, 1] and sum(m for _, m in made) == total
    argv = [*TORCHRUN, "4", "-m", "fanout.cli", "produce", *config_flags(cfg)]
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode != 0
    assert "each replica is its own torchrun launch of 2 processes" in done.stdout + done.stderr


def _open_under(pid: int, root: Path) -> list[str]:
    """Paths under `root` that process `pid` has open."""
    fds = Path(f"/proc/{pid}/fd")
    paths = [os.readlink(fds / fd) for fd in os.listdir(fds)]
    return [x for x in paths if x.startswith(str(root.resolve()))]


def _consume_and_compare(run: Path, want: dict[int, dict[str, Any]], total: int) -> None:
    """Read every window of `run` as a consumer and compare it with `want` (fp32: the
    floats within 1e-5, ids and rows exactly)."""
    from fanout.train.consumer import ConsumerConfig, ConsumerStream

    cfg = ConsumerConfig(run_dir=str(run), consumer_id="reader", acquire_timeout_s=300)
    seen = []
    with ConsumerStream(cfg) as s:
        for ow in s.windows():
            r = ow.reader
            for k in r.names():
                x, y = r.get(k), want[ow.window][k]
                if x.is_floating_point():
                    assert (x - y).abs().max().item() <= 1e-5, (ow.window, k)
                else:
                    assert torch.equal(x, y), (ow.window, k)
            seen.append(ow.window)
            s.coord.ack(ow.lease)
            s._held.pop(ow.window, None)
            if ow.window == total - 1:
                break
    assert seen == list(range(total))


def _window_names(run: Path) -> list[str]:
    d = run / "windows"
    return [n for n in os.listdir(d) if parse_window_name(n)] if d.is_dir() else []
