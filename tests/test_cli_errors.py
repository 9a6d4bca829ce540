"""Bad input to the `fanout` CLI: one line naming the flag or file, exit 1, no traceback.

.venv/bin/pytest tests/test_cli_errors.py -q

Each CLI case runs the real `fanout` entry point in a subprocess (`python -m fanout.cli`).
The producer cases need no model: the checks they hit run before anything is loaded
(a verifier directory with a config.json, a tokenizer file and a weights file that is
not one: a case that loaded it would fail with that instead). The start-that-fails
cases (what a producer leaves behind) run in-process over the tiny assets.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fanout.bench.assets import generate_corpus
from fanout.errors import ConfigError, NotACoordinatorDatabase
from fanout.filesystem import FaultyFileSystem
from fanout.model.verifier import max_position_embeddings
from fanout.produce.config import ProducerConfig, check_inputs
from fanout.produce.producer import Producer
from tiny_run import build_tiny_assets, tiny_producer_config


def fanout(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fanout.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1, no traceback, exactly one non-empty line on stderr holding every needle."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.returncode == 1, r
    return lines[0]


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    """A chat file and a verifier directory that passes every check made before loading
    but cannot load: config.json (limit 4096), a tokenizer file, garbage weights."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    ver = tmp_path / "verifier"
    ver.mkdir()
    (ver / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (ver / "tokenizer_config.json").write_text("{}")
    (ver / "model.safetensors").write_bytes(b"not safetensors")
    return {"data": data, "verifier": ver}


def produce_argv(run_dir: Path, inputs: dict[str, Path], *more: str) -> list[str | Path]:
    return [
        "produce", "--run-dir", run_dir, "--verifier-name-or-path", inputs["verifier"],
        "--data", inputs["data"], "--seq-len", "512", "--no-progress", *more,
    ]  # fmt: skip


# ---- producer: flags refused before anything is created ------------------------------


def test_produce_missing_data_file_names_the_flag(tmp_path: Path, inputs: dict[str, Path]) -> None:
    argv = produce_argv(tmp_path / "run", inputs)
    argv[argv.index(inputs["data"])] = "/nonexistent.jsonl"
    error_line(fanout(*argv), "--data", "/nonexistent.jsonl")
    assert not (tmp_path / "run").exists()


def test_produce_seq_len_over_max_positions_is_refused(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    line = error_line(
        fanout(*produce_argv(tmp_path / "run", inputs), "--seq-len", "5514"),
        "--seq-len 5514",
        "max_position_embeddings 4096",
        "--allow-seq-len-over-max-positions",
    )
    assert "5513" in line  # the highest position the rows would carry
    assert not (tmp_path / "run").exists()


def test_seq_len_over_max_positions_is_allowed_behind_the_flag(
    tmp_path: Path, inputs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = dict(
        run_dir=str(tmp_path / "run"),
        verifier_name_or_path=str(inputs["verifier"]),
        data=[str(inputs["data"])],
        seq_len=8192,
    )
    with pytest.raises(ConfigError, match="--seq-len 8192"):
        check_inputs(ProducerConfig(**cfg))
    check_inputs(ProducerConfig(**cfg, allow_seq_len_over_max_positions=True))
    assert "positions up to 8191" in caplog.text
    check_inputs(ProducerConfig(**(cfg | {"seq_len": 4096})))  # = the limit: fine


def test_max_position_embeddings_reads_a_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 32}})
    )
    assert max_position_embeddings(tmp_path) == 32
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert max_position_embeddings(tmp_path) is None  # declares none: nothing to check


def test_produce_missing_verifier_names_the_flag(tmp_path: Path, inputs: dict[str, Path]) -> None:
    argv = produce_argv(tmp_path / "run", inputs)
    argv[argv.index(inputs["verifier"])] = tmp_path / "nope"
    error_line(fanout(*argv), "--verifier-name-or-path", "nope")


def test_produce_refuses_a_missing_tokenizer_before_creating_or_loading(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    """A verifier directory without tokenizer files and no --tokenizer (plain and
    --regenerate), or a --tokenizer without them: one line naming the flag, before
    anything is created or loaded. Observable without timing: a run dir under a file
    cannot be created (a later check would give the --run-dir error), and the weights
    are garbage (a check after loading would give the load error)."""
    (inputs["verifier"] / "tokenizer_config.json").unlink()
    ver = inputs["verifier"]
    error_line(
        fanout(*produce_argv(tmp_path / "run", inputs)),
        f"--verifier-name-or-path {ver}", "no tokenizer files", "pass --tokenizer",
    )  # fmt: skip
    assert not (tmp_path / "run").exists()
    (tmp_path / "file").write_text("")
    uncreatable = tmp_path / "file" / "run"
    error_line(
        fanout(*produce_argv(uncreatable, inputs, "--regenerate")),
        f"--verifier-name-or-path {ver}", "no tokenizer files",
    )  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    error_line(
        fanout(*produce_argv(uncreatable, inputs, "--tokenizer", str(empty))),
        f"--tokenizer {empty}", "no tokenizer files",
    )  # fmt: skip


def test_produce_regenerate_refuses_a_tokenizer_without_a_chat_template_first(
    tmp_path: Path, inputs: dict[str, Path], tiny: Path
) -> None:
    """--regenerate (hf engine) answers through the tokenizer's chat template: one without
    it is refused before the run dir is created (here it cannot be) or the (garbage)
    verifier is loaded."""
    tok = tmp_path / "tok"
    shutil.copytree(tiny / "tok", tok)
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    assert tc.pop("chat_template")  # the tiny tokenizer has one: this removes it
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    (tmp_path / "file").write_text("")
    argv = produce_argv(tmp_path / "file" / "run", inputs, "--regenerate", "--tokenizer", str(tok))
    error_line(fanout(*argv), f"--tokenizer {tok}", "no chat template")


def test_produce_run_dir_that_cannot_be_created(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """A file where a folder of the run dir should be: ENOTDIR, whoever runs the test."""
    (tmp_path / "file").write_text("")
    error_line(fanout(*produce_argv(tmp_path / "file" / "run", inputs)), "--run-dir", "file/run")


def _readonly_runner(d: Path) -> list[str] | None:
    """An argv prefix that runs a command with `d` a read-only tmpfs (a user and mount
    namespace: no root needed, nothing mounted outside the command), or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    script = f'mount -t tmpfs -o ro,size=64k tmpfs "{d}" && exec "$@"'
    prefix = [unshare, "-rm", "sh", "-c", script, "sh"]
    probe = subprocess.run([*prefix, "sh", "-c", f'! mkdir "{d}/x"'], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_produce_run_dir_on_a_read_only_filesystem(tmp_path: Path, inputs: dict[str, Path]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = _readonly_runner(ro)
    if prefix is None:
        if os.geteuid() == 0:
            pytest.skip(
                "no user+mount namespace for a read-only tmpfs, and as root chmod 0555 does "
                "not stop writes; test_run_dir_create_failure_through_the_seam covers EROFS"
            )
        ro.chmod(0o555)  # not root: permissions do stop writes
        prefix = []
    argv = [sys.executable, "-m", "fanout.cli", *map(str, produce_argv(ro / "run", inputs))]
    r = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=300)
    line = error_line(r, "--run-dir", "ro/run")
    assert "Read-only file system" in line or "Permission denied" in line


def test_run_dir_create_failure_through_the_seam(tmp_path: Path, inputs: dict[str, Path]) -> None:
    fs = FaultyFileSystem(1, errno.EROFS, persistent=True, ops={"makedirs"})
    cfg = ProducerConfig(
        run_dir=str(tmp_path / "run"),
        verifier_name_or_path=str(inputs["verifier"]),
        data=[str(inputs["data"])],
        seq_len=512,
    )
    with pytest.raises(
        ConfigError, match=r"--run-dir .*run: cannot create .*Read-only file system"
    ):
        Producer(cfg, fs=fs)
    assert not (tmp_path / "run").exists()


# ---- status / sweep on something that is not a coordinator database -----------------


@pytest.mark.parametrize("command", ["status", "sweep"])
def test_status_and_sweep_on_a_file_that_is_not_a_database(tmp_path: Path, command: str) -> None:
    (tmp_path / "coordinator.sqlite3").write_bytes(b"this is not an SQLite file\n" * 100)
    error_line(
        fanout(command, "--run-dir", tmp_path),
        f"fanout {command}: error:",
        "coordinator.sqlite3",
        "not a fanout coordinator database",
        "--run-dir",
    )


def test_status_on_a_foreign_sqlite_database(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    conn.execute("CREATE TABLE t(a)")
    conn.commit()
    conn.close()
    error_line(fanout("status", "--run-dir", tmp_path), "not a fanout coordinator database")


def test_status_without_a_run(tmp_path: Path) -> None:
    """Before a producer created the run nothing says which database it will use (a
    PostgreSQL run's pointer is written at create): the line names no SQLite file."""
    line = error_line(
        fanout("status", "--run-dir", tmp_path / "none"),
        "no coordinator database",
        "no producer has created this run",
        "--db-path",
    )
    assert ".sqlite3:" not in line, line  # not "RUN/coordinator.sqlite3: ..."
    # A --db-path given: that database is named
    error_line(
        fanout("status", "--run-dir", tmp_path, "--db-path", tmp_path / "c.sqlite3"),
        f"{tmp_path / 'c.sqlite3'}: no coordinator database",
    )


@pytest.mark.parametrize("command", ["status", "sweep", "demo"])
def test_status_sweep_demo_bad_config_file(tmp_path: Path, command: str) -> None:
    error_line(fanout(command, "--config", tmp_path / "nope.json"), "--config", "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run_dir": str(tmp_path), "no_such_field": 1}))
    error_line(fanout(command, "--config", bad), "bad.json", "--no-such-field")


def test_demo_nonpositive_minutes_names_the_flag(tmp_path: Path) -> None:
    error_line(fanout("demo", "--minutes", "0", "--run-dir", tmp_path), "--minutes", "greater")
    assert not (tmp_path / "last").exists()


def test_prepare_missing_data_file_names_the_flag(tmp_path: Path) -> None:
    error_line(
        fanout("prepare", "--data", "/nonexistent.jsonl", "--tokenizer", tmp_path),
        "--data",
        "/nonexistent.jsonl",
    )


# ---- trainer: a run that never comes, a database that is not one ----------------------


def test_train_waits_visibly_then_names_the_timeout_flag(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    r = fanout(
        "train", "--run-dir", tmp_path / "run", "--consumer-id", "c",
        "--verifier-name-or-path", inputs["verifier"], "--save-path", tmp_path / "s",
        "--acquire-timeout-s", "0.5",
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    waiting = [x for x in lines if x.startswith("waiting for a producer to create")]
    assert waiting and f"{tmp_path / 'run' / 'coordinator.sqlite3'}" in waiting[0]
    assert "of 0.5 s; --acquire-timeout-s" in waiting[0]
    errors = [x for x in lines if "error:" in x]
    assert len(errors) == 1 and errors == lines[-1:]
    assert "--acquire-timeout-s" in errors[0] and "no run after waiting 0.5 s" in errors[0]


def test_train_on_a_file_that_is_not_a_database_fails_at_once(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    """Waiting cannot fix a file that is not a database: no waiting line, even with the
    default 600 s timeout."""
    (tmp_path / "coordinator.sqlite3").write_bytes(b"garbage" * 1000)
    r = fanout(
        "train", "--run-dir", tmp_path, "--consumer-id", "c",
        "--verifier-name-or-path", inputs["verifier"], "--save-path", tmp_path / "s",
    )  # fmt: skip
    error_line(r, "fanout train: error:", "not a fanout coordinator database")


def test_wait_for_run_raises_the_type_at_once(tmp_path: Path) -> None:
    from fanout.train.progress import WaitNotice, wait_for_run

    (tmp_path / "coordinator.sqlite3").write_bytes(b"garbage" * 1000)
    said: list[str] = []
    with pytest.raises(NotACoordinatorDatabase):
        wait_for_run(tmp_path, None, 600.0, WaitNotice(600.0, write=said.append))
    assert said == []


# ---- a producer start that fails leaves nothing behind ----------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_assets(root, generate_corpus(40, seed=0))
    (root / "bad.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    return root


def _cfg(tiny: Path, run_dir: Path, **kw: object) -> ProducerConfig:
    return tiny_producer_config(tiny, run_dir, cache_dir=None, **kw)


def test_failed_start_removes_the_run_dir_it_created(tiny: Path, tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    with pytest.raises(ConfigError, match="--format"):
        Producer(_cfg(tiny, run, data=[str(tiny / "bad.jsonl")]))
    assert not run.exists()
    assert (tmp_path / "new").is_dir()  # its parent was not the producer's to remove


def test_failed_start_keeps_what_was_there(tiny: Path, tmp_path: Path) -> None:
    """A pre-existing run dir keeps its contents (and itself); a verifier that fails to
    load after data preparation also takes the data cache and token counts with it."""
    run = tmp_path / "run"
    (run / "notes").mkdir(parents=True)
    (run / "notes" / "keep.txt").write_text("mine")
    broken = tmp_path / "verifier"
    shutil.copytree(tiny / "verifier", broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="cannot load"):
        Producer(_cfg(tiny, run, verifier_name_or_path=str(broken)))
    assert sorted(os.listdir(run)) == ["notes"]
    assert (run / "notes" / "keep.txt").read_text() == "mine"


def test_failed_start_never_touches_an_existing_run(tiny: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    Producer(_cfg(tiny, run, max_windows=1)).run()
    before = sorted(os.listdir(run))
    assert "coordinator.sqlite3" in before
    with pytest.raises(ConfigError, match="--format"):  # a restart that fails: run kept
        Producer(_cfg(tiny, run, data=[str(tiny / "bad.jsonl")]))
    assert sorted(os.listdir(run)) == before


def test_failed_start_after_the_database_drops_it_and_a_retry_starts_clean(
    db: str | None, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that fails after it created the coordinator database (here: building the
    capturer) removes that database too — on PostgreSQL its tables and the schema it
    made — so the same command run again creates the run instead of being refused with
    'a coordinator database already exists there'."""
    from fanout.coord import postgresdb

    run = tmp_path / "run"
    cfg = _cfg(tiny, run, db_path=db, max_windows=1)

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("capturer failed")

    with monkeypatch.context() as m:
        m.setattr("fanout.produce.producer.WindowCapturer", broken)
        with pytest.raises(RuntimeError, match="capturer failed"):
            Producer(cfg)
    assert not run.exists()
    if db is not None:
        assert not postgresdb.exists(db)
        probe = postgresdb.PostgresDatabase(db)
        try:
            schemas = probe.execute(
                "SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name=?",
                (probe.schema,),
            ).fetchone()[0]
        finally:
            probe.close()
        assert schemas == 0
    summary = Producer(cfg).run()  # the retry: a clean create
    assert summary["windows"] == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train", "--run-dir", "r", "--consumer-id", "c", "--verifier-name-or-path", "v",
          "--save-path", "s", "--block-size", "1"], "--block-size: Input should be greater"),
        (["train", "--draft-family", "dflash", "--markov-rank", "4"],
         "--markov-rank: dspark option(s), but --draft-family is dflash"),
        (["train", "--draft-family", "nope"], "--draft-family: Input should be 'dflash'"),
        (["eval", "--verifier-name-or-path", "v", "--data", "d", "--tokenizer", "t",
          "--temperature", "-1"], "temperatures must be >= 0"),
        (["promote", "--margin", "-1"], "--margin: Input should be greater than or equal to 0"),
    ],
    ids=["train-bound", "train-other-family", "train-unknown-family", "eval", "promote"],
)  # fmt: skip
def test_flag_errors_of_train_eval_promote_come_back_before_torch(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    """Issue 45.5 for the other commands: their configs (fanout.model.draft_config,
    fanout.families.registry with each family's model imported on first use,
    fanout.decode.config) load without torch, so fanout.cli.EARLY checks them first: one
    line, exit 1, and neither torch nor transformers imported."""
    code = (
        "import sys\nfrom fanout.cli import main\n"
        f"rc = main({argv!r})\n"
        "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.stdout.split("\n")[0] == "1 []", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"fanout {argv[0]}: error:" in r.stderr and says in r.stderr, r.stderr


def test_a_flag_only_error_comes_back_before_torch_is_imported(tmp_path: Path) -> None:
    """Issue 45.5: `--replica-rank 2 --replicas 2` is refused by fanout.cli.early_check,
    one line and exit 1, before the producer's module (and torch) is imported (its time:
    benchmarks/startup.py's flag-error row). The full config says the same, for a caller
    that builds it without the CLI."""
    code = (
        "import sys\nfrom fanout.cli import main\n"
        "rc = main(['produce', '--replica-rank', '2', '--replicas', '2', '--run-dir', 'r',"
        " '--verifier-name-or-path', 'v', '--data', 'd'])\n"
        "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.stdout.split("\n")[0] == "1 []", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    assert "fanout produce: error:" in r.stderr
    assert "--replica-rank 2 must be below --replicas 2 (ranks 0 .. 1)" in r.stderr
    from pydantic import ValidationError

    from fanout.produce.replicas import ReplicaOptions

    with pytest.raises(ValidationError, match="--replica-rank 3 must be below --replicas 2"):
        ReplicaOptions(replicas=2, replica_rank=3)


# ---- flags argparse refuses: the same one line and exit 1 -----------------------------


@pytest.mark.parametrize(
    ("argv", "prog", "says"),
    [
        (["nosuch"], "fanout", "invalid choice: 'nosuch'"),
        (["produce", "--no-such-flag", "x"], "fanout produce", "unrecognized arguments: --no-such-flag x"),
        (["train", "--max-steps", "abc"], "fanout train", "argument --max-steps: invalid int value: 'abc'"),
        (["train", "--lr", "fast"], "fanout train", "argument --lr: invalid float value: 'fast'"),
        (["status", "--log-level", "loud"], "fanout status", "argument --log-level: invalid choice: 'loud'"),
    ],
    ids=["command", "unknown-flag", "optional-int", "float", "choice"],
)  # fmt: skip
def test_flags_argparse_refuses_are_one_line_and_exit_1(
    argv: list[str], prog: str, says: str
) -> None:
    """Not argparse's usage block and exit 2: the command's own line (naming the command
    whose flags they are, though the top parser finds the unknown ones) and a pointer to
    its --help."""
    line = error_line(fanout(*argv), says)
    assert line.startswith(f"{prog}: error: ") and line.endswith(f"(see `{prog} --help`)"), line


def test_python_dash_m_fanout_is_the_command() -> None:
    """`python -m fanout …` (fanout/__main__.py) runs fanout.cli, its errors included."""
    r = subprocess.run([sys.executable, "-m", "fanout", "train", "--lr", "fast"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    error_line(r, "fanout train: error: argument --lr: invalid float value: 'fast'")


def test_scripts_train_refuses_a_flag_in_one_line() -> None:
    """scripts/train.py (what torchrun starts) parses with the same parser."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    r = subprocess.run([sys.executable, str(script), "--rows-per-step", "many"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    error_line(r, "fanout train: error: argument --rows-per-step: invalid int value: 'many'")
