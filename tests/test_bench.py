"""fanout.bench.bench, .config, .metrics and .report: config validation, the role
specs against the commands' configs and flags, a 3-scenario smoke run, a 1p1c run on
PostgreSQL, failure handling.

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
    Assets,
    Role,
    ScenarioRun,
    _coordinator_probe,
    plan,
    run_bench,
)
from fanout.bench.config import BenchConfig, ConsumerSpec, ProducerSpec, schema_name
from fanout.bench.metrics import scenario_metrics
from fanout.cli import build_parser
from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.postgresdb import parse_url
from fanout.errors import ConfigError
from fanout.produce import producer
from fanout.produce.config import ProducerConfig
from fanout.status.snapshot import snapshot
from fanout.store.store import Published, RunDir, window_name
from fanout.train import trainer
from fanout.train.config import TrainConfig
from fanout.train.trainlog import MetricsLog
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


def test_role_specs_are_the_commands_fields() -> None:
    """Every ProducerSpec / ConsumerSpec field is the command's field (annotation,
    constraints, description), only its default the bench's: a changed constraint or
    description in ProducerConfig / TrainConfig reaches the bench spec, and a changed
    type fails here."""
    bench_only = {ProducerSpec: {"threads", "extra_args"}, ConsumerSpec: {"id", "extra_args"}}
    for spec, config in ((ProducerSpec, ProducerConfig), (ConsumerSpec, TrainConfig)):  # fmt: skip
        shared = set(spec.model_fields) - bench_only[spec]
        assert shared, spec
        for name in sorted(shared):
            mine, theirs = spec.model_fields[name], config.model_fields.get(name)
            assert theirs is not None, f"{spec.__name__}.{name} is no {config.__name__} field"
            assert mine.annotation == theirs.annotation, f"{spec.__name__}.{name}"
            assert mine.metadata == theirs.metadata, f"{spec.__name__}.{name}"
            assert mine.description == theirs.description, f"{spec.__name__}.{name}"
    assert TrainConfig.model_fields["consumer_id"].annotation is str  # ConsumerSpec.id
    # Bench defaults stay the bench's.
    assert ProducerSpec().seq_len == 256 and ConsumerSpec(id="b").max_anchors == 16
    with pytest.raises(ValueError, match="greater than or equal to 8"):
        ProducerSpec(seq_len=4)  # ProducerConfig's constraint


def _parse(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def test_role_commands_parse_back_to_the_specs(tmp_path: Path) -> None:
    """The generated `produce` / `train` argv, parsed by the commands themselves, gives
    each spec field's value; with `database` set every run dir gets its own schema."""
    raw = json.loads(CPU_TINY.read_text())
    raw["producer"].update(workers=None, num_draft_layers=2, lag_policy="detach")
    raw["database"] = "postgresql://bench@db-host/fanout?connect_timeout=5"
    cfg = BenchConfig.model_validate(raw)
    a = Assets(tmp_path / "ver", tmp_path / "tok", [str(tmp_path / "d.jsonl")], 7)
    run = plan(cfg, "unshared", a, tmp_path / "out")
    schemas = []
    for role in run.roles:
        args = _parse(role.cmd[3:])
        if role.kind == "producer":
            pc = producer.config_from_args(args)
            for k, v in cfg.producer.model_dump(exclude={"threads", "extra_args"}).items():
                assert getattr(pc, k) == v, k
            assert (pc.run_dir, pc.progress) == (str(role.run_dir), False)
            assert pc.db_path is not None
            conninfo, schema, _ = parse_url(pc.db_path)
            assert conninfo == "postgresql://bench@db-host/fanout?connect_timeout=5"
            schemas.append(schema)
        else:
            tc = trainer.config_from_args(args)
            assert role.spec is not None
            for k, v in role.spec.model_dump(exclude={"id", "extra_args"}).items():
                assert getattr(tc, k) == v, k
            assert (tc.consumer_id, tc.mask_token_id, tc.db_path) == (role.spec.id, 7, None)
    assert len(set(schemas)) == 3 and all(s.startswith("cpu_tiny_unshared_") for s in schemas)
    # A new plan (the next bench run in the same --out) never reuses a schema name.
    again = plan(cfg, "unshared", a, tmp_path / "out")
    producers = [r for r in again.roles if r.kind == "producer"]
    dbs = [producer.config_from_args(_parse(r.cmd[3:])).db_path for r in producers]
    assert not {parse_url(d)[1] for d in dbs if d} & set(schemas)
    # Without `database`: SQLite in the run dir (no --db-path).
    cfg = cfg.model_copy(update={"database": None})
    assert all("--db-path" not in r.cmd for r in plan(cfg, "1p1c", a, tmp_path / "out").roles)


def test_schema_names_and_database_urls() -> None:
    for bench in ("cpu-tiny", "Qwen3 8B / 1p3c!", "8b" * 40, "---"):
        name = schema_name(bench, "unshared", 12, "0123abcd")
        assert parse_url(f"postgresql://h/db?schema={name}")[1] == name  # allowed there
        assert name.endswith("_unshared_12_0123abcd") and name == name.lower()
    raw = json.loads(CPU_TINY.read_text())
    for bad, why in (
        ("postgresql://h/db?schema=x", "leave out"),
        ("/var/lib/coordinator.sqlite3", "postgresql://"),
    ):
        with pytest.raises(ValueError, match=why):
            BenchConfig.model_validate(raw | {"database": bad})


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
    metrics = MetricsLog(drafts)
    for r in log:
        metrics.write(r)
    metrics.close()


def test_metrics_and_probe_read_the_coordinator_on_either_database(
    db: str | None, tmp_path: Path
) -> None:
    """The report and the telemetry probe find the run's database the way every other
    fanout command does (the run dir records it): a run on PostgreSQL counts too."""
    root = tmp_path / "1p1c" / "run"
    probe = _coordinator_probe([root])
    assert probe() == {}  # not created yet
    _shared_run(root, db, windows=3)
    assert probe() == {str(root): {"ready_windows": 0, "ready_bytes": 0, "produced": 3}}
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
    assert m["peak_ready_windows"] >= 1 and m["peak_ready_bytes"] >= 100
    assert m["consumers"]["b4"]["windows_acked"] == 3 and m["consumers"]["b4"]["steps"] == 3
    assert m["aggregate"]["rows_per_s"] > 0


def test_a_run_with_replicas_reports_a_row_per_replica_and_their_total(tmp_path: Path) -> None:
    """Two producer replicas on one run (published alternately): the report has a row
    per replica (its own windows and windows/s, from its summary) and one for both
    (windows/s summed, the stream's windows, captures per window)."""
    from fanout.bench.report import producers_markdown
    from fanout.coord.grants import ProducerPlan

    root = tmp_path / "1p1c" / "run"
    rd = RunDir(root).create()
    cfg_run = RunConfig(total_windows=5, max_live_windows=6)
    logs = tmp_path / "logs"
    logs.mkdir()
    with Coordinator.create(rd.root, make_contract(), cfg_run) as co:
        regs = [co.register_producer(make_contract(), rank=r, plan=ProducerPlan(2)) for r in (0, 1)]
        for w in range(5):
            cl = co.claim(regs[w % 2])
            assert cl is not None and cl.window == w
            name = window_name(cl.window, cl.generation)
            co.publish_ready(cl, Published(name, rd.windows / name, 100, "xxh3_128:0"))
    made = {0: 3, 1: 2}
    roles = []
    for r in (0, 1):
        summary = logs / f"producer-r{r}.summary.json"
        summary.write_text(json.dumps({"windows": made[r], "elapsed_s": 2.0, "replica": r}))
        roles.append(Role(f"producer-r{r}", "producer", [], logs / f"p{r}.log", root, "cpu",
                          rc=0, summary_path=summary))  # fmt: skip
    run = ScenarioRun("1p1c", tmp_path / "1p1c", roles, [root], 999.0, 1002.0)
    m = scenario_metrics(BenchConfig(name="t", consumers=[ConsumerSpec(id="b4")]), run,
                         tmp_path / "no-telemetry.jsonl")  # fmt: skip
    assert (m["unique_windows"], m["captures"], m["captures_per_window"]) == (5, 5, 1.0)
    assert [m["producers"][f"producer-r{r}"]["windows_made"] for r in (0, 1)] == [3, 2]
    agg = m["producer_runs"][str(root)]
    assert (agg["replicas"], agg["windows_per_s"], agg["produced_windows"]) == (2, 2.5, 5)
    assert (agg["captures_per_window"], agg["claims_reclaimed"]) == (1.0, 0)
    table = producers_markdown({"1p1c": m})
    assert table[2:] == [
        "| 1p1c | producer-r0 (replica 0) | 1.500 | 3 | - | - | - |",
        "| 1p1c | producer-r1 (replica 1) | 1.000 | 2 | - | - | - |",
        "| 1p1c | all 2 replicas | 2.500 | 5 | 1.00 | 0 | 0 |",
    ]


def test_plots_tell_the_drafts_and_the_ready_lines_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """steps.png: drafts that step at one pace keep apart (a marker and dash each);
    ready.png: ready windows solid on the left axis, MiB dashed on the right, one legend;
    titles say what the scenario runs, not its key (issue #45)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fanout.bench.plots import write_plots

    figs: list[Any] = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at
    root = tmp_path / "1p3c" / "run"
    tel = tmp_path / "telemetry.jsonl"
    tel.write_text("".join(
        json.dumps({"t_wall": 1000.0 + t, "host_cpu_pct": 50, "gpus": [],
                    "extra": {str(root): {"ready_windows": t % 3}},
                    "run_dirs": {str(root): {"bytes": 2**20 * t}}}) + "\n"
        for t in range(5)
    ))  # fmt: skip
    timeline = [(float(t), t) for t in range(20)]  # both drafts: the same line
    sc = {"consumers": {c: {"timeline": timeline} for c in ("dflash", "eagle3")}}
    run = ScenarioRun("1p3c", tmp_path / "1p3c", [], [root], 1000.0, 1005.0)
    assert write_plots({"scenarios": {"1p3c": sc}}, [(run, tel)], tmp_path)[:2] == [
        "steps.png",
        "ready.png",
    ]
    steps, ready_axes = (f.axes for f in figs[:2])
    a, b = steps[0].get_lines()
    assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker())
    assert steps[0].get_title() == "1 producer → 2 drafts: steps"
    ready, mib = ready_axes[0].get_lines()[0], ready_axes[1].get_lines()[0]
    assert ready.get_linestyle() == "-" and mib.get_linestyle() == "--"
    assert "solid" in ready_axes[0].get_ylabel() and "dashed" in ready_axes[1].get_ylabel()
    legend = ready_axes[0].get_legend()
    assert legend is not None and len(legend.get_texts()) == 2


def test_scenario_titles_and_draft_labels() -> None:
    from fanout.bench.config import scenario_title
    from fanout.bench.ranking import draft_label

    assert scenario_title("1p3c", 6) == "1 producer → 6 drafts"
    assert scenario_title("1p1c", 1) == "1 producer → 1 draft"
    assert scenario_title("unshared", 3) == "3 unshared producer → draft pairs"
    assert draft_label({"draft": "dflash2", "family": "dflash2"}) == "dflash2"
    assert draft_label({"draft": "b8", "family": "dspark"}) == "b8\ndspark"


def test_the_report_explains_each_acceptance_figure_once() -> None:
    from fanout.bench.report import EAL_NOTE

    for figure in ("*EAL first→last*", "*train EAL*", "*τ*", "`fanout demo`"):
        assert EAL_NOTE.count(figure) == 1, figure


def _check_valid_report(rep: dict[str, Any], out: Path) -> None:
    assert rep["valid"], rep["reasons"]
    assert rep["captures_per_window_1p3c"] == 1.0
    assert rep["captures_per_window_unshared"] == 3.0
    assert rep["scenarios"]["1p1c"]["captures_per_window"] == 1.0
    assert rep["peak_ready_windows"] <= rep["max_live_windows"]
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
    for png in ("steps.png", "ready.png", "util.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    tel = sc["telemetry"]
    assert tel["host_only"] or tel["gpu"]["available"]
    assert tel["samples"] >= 2 or any("telemetry" in f for f in rep["flags"])


# slow (≈40 s): the default run keeps the early-stop, failure and PostgreSQL bench runs
@pytest.mark.slow
def test_smoke_three_scenarios_end_to_end(assets_cache: Path, tmp_path: Path) -> None:
    cfg = smoke_config(assets_cache)
    rep = run_bench(cfg, tmp_path / "out", echo=lambda s: None)
    _check_valid_report(rep, tmp_path / "out")
    # Logs of every role were captured.
    logs = sorted(p.name for p in (tmp_path / "out" / "unshared" / "logs").glob("*.log"))
    assert logs == sorted(
        [f"producer-{c}.log" for c in ("b4", "b8", "b16")] + ["b4.log", "b8.log", "b16.log"]
    )


def test_a_draft_that_stops_early_leaves_the_others_to_finish(
    assets_cache: Path, tmp_path: Path
) -> None:
    """1p3c with b4 at --max-steps 3 (cpu-tiny-mixed's shape): b4 ends on its own,
    recorded finished, and no longer holds the producer back; b8 and b16 read the
    whole stream; the report is valid and says so per draft."""
    cfg = smoke_config(assets_cache, scenarios=["1p3c"])
    raw = cfg.model_dump()
    raw["consumers"][0]["max_steps"] = 3
    rep = run_bench(BenchConfig.model_validate(raw), tmp_path / "out", echo=lambda s: None)
    assert rep["valid"], rep["reasons"]
    sc = rep["scenarios"]["1p3c"]
    assert sc["consumers"]["b4"]["steps"] == 3
    for c in ("b8", "b16"):
        assert sc["consumers"][c]["windows_acked"] == sc["unique_windows"] > 3
    with Coordinator.open(tmp_path / "out" / "1p3c" / "run") as co:
        states = {c["id"]: c["recorded_state"] for c in snapshot(co)["consumers"]}
    assert states == {"b4:dp0": "finished", "b8:dp0": "finished", "b16:dp0": "finished"}


def test_role_failure_makes_run_invalid_and_exit_nonzero(
    assets_cache: Path, tmp_path: Path
) -> None:
    cfg = smoke_config(assets_cache, scenarios=["1p1c"])
    raw = cfg.model_dump()
    raw["consumers"][0]["extra_args"] = ["--no-such-flag"]  # refused: one line, exit 1
    p = tmp_path / "failing.json"
    p.write_text(json.dumps(raw))
    rc = cli_main(["bench", str(p), "--out", str(tmp_path / "out")])
    assert rc == 1
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not rep["valid"]
    assert any("b4 exited 1" in r for r in rep["reasons"]), rep["reasons"]
    # The producer, held by a consumer that never came, was stopped: not blamed.
    assert not any("producer exited" in r for r in rep["reasons"]), rep["reasons"]


def test_1p1c_on_postgresql(assets_cache: Path, tmp_path: Path, postgres_server: str) -> None:
    """A real `fanout bench` run (1p1c) with the coordinator on PostgreSQL: the producer
    creates the run dir's own schema, the trainer finds it through the run dir, and the
    report reads it. A password never reaches the report."""
    url = postgres_server.replace("postgresql://postgres@", "postgresql://postgres:secret@")
    cfg = smoke_config(assets_cache, scenarios=["1p1c"], database=url)
    out = tmp_path / "out"
    rep = run_bench(cfg, out, echo=lambda s: None)
    assert rep["valid"], rep["reasons"]
    sc = rep["scenarios"]["1p1c"]
    c = sc["consumers"]["b4"]
    assert c["windows_acked"] == sc["unique_windows"] >= 4
    assert c["rows_per_s"] > 0 and c["steps"] >= 3
    assert sc["captures_per_window"] == 1.0
    (p,) = sc["producers"].values()
    assert p["database"].startswith("postgresql://postgres@127.0.0.1:")
    assert "schema=smoke_1p1c_0_" in (out / "1p1c" / "run" / "coordinator.dbpath").read_text()
    assert not (out / "1p1c" / "run" / "coordinator.sqlite3").exists()
    assert rep["database"]["kind"] == "postgresql"
    assert rep["database"]["version"].startswith("PostgreSQL ")
    assert "secret" not in (out / "report.json").read_text() + (out / "report.md").read_text()


@pytest.mark.slow
def test_cpu_tiny_end_to_end(tmp_path: Path) -> None:
    cfg = BenchConfig.load(CPU_TINY)
    cfg = cfg.model_copy(
        update={"assets": cfg.assets.model_copy(update={"cache_dir": str(tmp_path / "assets")})}
    )
    rep = run_bench(cfg, tmp_path / "out", echo=lambda s: None)
    _check_valid_report(rep, tmp_path / "out")
