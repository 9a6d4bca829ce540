"""fanout.bench.bench + fanout.bench.report: config validation, a 3-scenario smoke run, failure handling.

The smoke config is cpu-tiny.json shrunk (tiny verifier, ~10 windows) so the whole
three-scenario run stays well under a minute or two on 2 cores; cpu-tiny.json itself
runs end to end under `-m slow`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.bench import (
    BenchConfig,
    ConsumerSpec,
    Role,
    ScenarioRun,
    _coordinator_probe,
    run_bench,
)
from fanout.bench.report import scenario_metrics
from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.errors import ConfigError
from fanout.store.store import Published, RunDir, window_name
from test_coordinator import make_contract

REPO = Path(__file__).resolve().parents[1]
CPU_TINY = REPO / "benchmarks" / "fanout" / "cpu-tiny.json"


@pytest.fixture(scope="module")
def assets_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("assets")


def smoke_config(cache: Path, **over: Any) -> BenchConfig:
    raw = json.loads(CPU_TINY.read_text())
    raw["name"] = "smoke"
    raw["assets"].update(
        cache_dir=str(cache),
        demo_conversations=300,
        conversations=60,
        verifier_hidden_size=32,
        verifier_num_layers=4,
        verifier_intermediate_size=64,
    )
    raw["producer"].update(seq_len=128, window_rows=2, max_live_windows=2)
    for c in raw["consumers"]:
        c.update(max_anchors=4, rows_per_step=2)
    raw["warmup_steps"] = 1
    raw["scenario_timeout_s"] = 300
    raw.update(over)
    return BenchConfig.model_validate(raw)


def test_configs_in_repo_validate() -> None:
    for path in sorted((REPO / "benchmarks" / "fanout").glob("*.json")):
        cfg = BenchConfig.load(path)
        assert cfg.consumers and cfg.scenarios, path


def test_unknown_and_bad_fields_are_rejected(tmp_path: Path) -> None:
    raw = json.loads(CPU_TINY.read_text())
    raw["producer"]["windows_rows"] = 4  # typo
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"bad.json: producer.windows_rows"):
        BenchConfig.load(p)
    raw = json.loads(CPU_TINY.read_text())
    raw["consumers"][1]["id"] = raw["consumers"][0]["id"]
    with pytest.raises(ConfigError, match="unique"):
        BenchConfig.model_validate(raw)
    raw = json.loads(CPU_TINY.read_text())
    raw["scenarios"] = ["1p2c"]
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"scenarios\.0"):
        BenchConfig.load(p)


def _shared_run(root: Path, db: str | None, windows: int) -> None:
    """A finished 1p1c run without processes: `windows` metadata-only windows
    published, and consumer b4 that read them all (and its train_log.jsonl)."""
    rd = RunDir(root).create()
    cfg = RunConfig(total_windows=windows, max_live_windows=windows + 1)
    with Coordinator.create(rd.root, make_contract(), cfg, db_path=db) as co:
        p = co.register_producer(make_contract())
        reg = co.register_consumer("b4")
        log, t = [], 1000.0
        for step in range(windows):
            cl = co.claim(p)
            assert cl is not None
            name = window_name(cl.window, cl.generation)
            co.publish_ready(cl, Published(name, rd.windows / name, 100, "xxh3_128:0"))
            lease = co.acquire(reg, timeout_s=10)
            assert lease is not None
            co.ack(lease)
            t += 0.5
            log.append(
                {"step": step + 1, "time": t, "acked": [lease.window], "loss": 1.0, "eal": 1.0,
                 "window_wait_ms": 1.0, "tokens": 16}
            )  # fmt: skip
        co.finish(reg)
        co.finish_producer(p)
    drafts = root.parent / "drafts" / "b4"
    drafts.mkdir(parents=True)
    (drafts / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))


def test_metrics_and_probe_read_the_coordinator_on_either_database(
    db: str | None, tmp_path: Path
) -> None:
    """The report and the telemetry probe find the run's database the way every other
    fanout command does (the run dir records it): a run on PostgreSQL counts too."""
    root = tmp_path / "1p1c" / "run"
    probe = _coordinator_probe([root])
    assert probe() == {}  # not created yet
    _shared_run(root, db, windows=3)
    assert probe() == {str(root): {"ready_windows": 0, "live_bytes": 0, "produced": 3}}
    spec = ConsumerSpec(id="b4")
    roles = [
        Role("producer", "producer", [], tmp_path / "p.log", root, "cpu", rc=0),
        Role("b4", "consumer", [], tmp_path / "b4.log", root, "cpu", rc=0, spec=spec,
             save_path=tmp_path / "1p1c" / "drafts" / "b4"),
    ]  # fmt: skip
    run = ScenarioRun("1p1c", tmp_path / "1p1c", roles, [root], 999.0, 1002.0)
    cfg = BenchConfig(name="t", consumers=[spec], warmup_steps=1)
    m = scenario_metrics(cfg, run, tmp_path / "no-telemetry.jsonl")
    assert m["valid"], m["reasons"]
    assert (m["unique_windows"], m["captures"], m["captures_per_window"]) == (3, 3, 1.0)
    assert m["producers"]["producer"]["produced_windows"] == 3
    assert m["peak_live_windows"] >= 1 and m["peak_live_bytes"] >= 100
    assert m["consumers"]["b4"]["windows_acked"] == 3 and m["consumers"]["b4"]["steps"] == 3
    assert m["aggregate"]["rows_per_s"] > 0


def _check_valid_report(rep: dict[str, Any], out: Path) -> None:
    assert rep["valid"], rep["reasons"]
    assert rep["captures_per_window_1p3c"] == 1.0
    assert rep["captures_per_window_unshared"] == 3.0
    assert rep["scenarios"]["1p1c"]["captures_per_window"] == 1.0
    assert rep["peak_live_windows"] <= rep["max_live_windows"]
    assert rep["aggregate_speedup_vs_unshared"] and rep["aggregate_speedup_vs_unshared"] > 0
    sc = rep["scenarios"]["1p3c"]
    windows = sc["unique_windows"]
    assert windows >= 4
    for c in sc["consumers"].values():
        assert c["windows_acked"] == windows  # every window, once (order checked by the rule)
        assert c["rows_per_s"] > 0 and c["step_ms_p95"] >= c["step_ms_p50"]
    # Unshared: three run dirs, each capturing the same stream once.
    assert len(rep["scenarios"]["unshared"]["producers"]) == 3
    assert rep["scenarios"]["unshared"]["captures"] == 3 * windows
    assert rep["disk"]["high_water_bytes"] <= rep["disk"]["all_windows_bytes"]
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["aggregate_speedup_vs_unshared"] == rep["aggregate_speedup_vs_unshared"]
    md = (out / "report.md").read_text()
    assert ("Validity rules" in md and "AMD" in md) or "hardware" in md
    for png in ("steps.png", "live.png", "util.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    tel = sc["telemetry"]
    assert tel["host_only"] or tel["gpu"]["available"]
    assert tel["samples"] >= 2 or any("telemetry" in f for f in rep["flags"])


def test_smoke_three_scenarios_end_to_end(assets_cache: Path, tmp_path: Path) -> None:
    cfg = smoke_config(assets_cache)
    rep = run_bench(cfg, tmp_path / "out", echo=lambda s: None)
    _check_valid_report(rep, tmp_path / "out")
    # Logs of every role were captured.
    logs = sorted(p.name for p in (tmp_path / "out" / "unshared" / "logs").glob("*.log"))
    assert logs == sorted(
        [f"producer-{c}.log" for c in ("b4", "b8", "b16")] + ["b4.log", "b8.log", "b16.log"]
    )


def test_role_failure_makes_run_invalid_and_exit_nonzero(
    assets_cache: Path, tmp_path: Path
) -> None:
    cfg = smoke_config(assets_cache, scenarios=["1p1c"])
    raw = cfg.model_dump()
    raw["consumers"][0]["extra_args"] = ["--no-such-flag"]  # argparse exits 2
    p = tmp_path / "failing.json"
    p.write_text(json.dumps(raw))
    rc = cli_main(["bench", str(p), "--out", str(tmp_path / "out")])
    assert rc == 1
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not rep["valid"]
    assert any("b4 exited 2" in r for r in rep["reasons"]), rep["reasons"]
    # The producer, held by a consumer that never came, was stopped: not blamed.
    assert not any("producer exited" in r for r in rep["reasons"]), rep["reasons"]


@pytest.mark.slow
def test_cpu_tiny_end_to_end(tmp_path: Path) -> None:
    cfg = BenchConfig.load(CPU_TINY)
    cfg = cfg.model_copy(
        update={"assets": cfg.assets.model_copy(update={"cache_dir": str(tmp_path / "assets")})}
    )
    rep = run_bench(cfg, tmp_path / "out", echo=lambda s: None)
    _check_valid_report(rep, tmp_path / "out")
