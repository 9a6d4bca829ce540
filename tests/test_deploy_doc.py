"""docs/deploy.md's recipes call scripts/launch.sh as it is: roles it knows, variables it
reads, configs whose keys are fields, and commands it builds without an error.

    .venv/bin/pytest tests/test_deploy_doc.py -q

The Slurm batch script is `bash -n`-checked and then run whole under a stand-in for
Slurm (`srun` runs its command once per task with SLURM_PROCID set, `scontrol` names
five nodes) with FANOUT_DRY_RUN=1, so every launcher call prints the command it would
start. The Kubernetes manifests are parsed as YAML; each container that calls the
launcher is run the same way with the environment its pod would have (the ConfigMap,
its `env`, an Indexed Job's JOB_COMPLETION_INDEX). The site's paths (the venv's
interpreter, the checkout) are replaced by this checkout's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fanout.produce.config import ProducerConfig
from fanout.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "deploy.md"
LAUNCH = REPO / "scripts" / "launch.sh"
SITE_PYTHON = ("/shared/fanout/.venv/bin/python", "/opt/fanout/.venv/bin/python")
SITE_LAUNCH = ("/shared/fanout/scripts/launch.sh", "/opt/fanout/scripts/launch.sh")
# what the test's own environment must not give the launcher
LAUNCH_VARS = ("FANOUT_", "SLURM_", "JOB_COMPLETION_INDEX")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _roles() -> set[str]:
    out = subprocess.run(["bash", str(LAUNCH), "--roles"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def _local(text: str) -> str:
    """`text` with the site's paths of the recipes made this checkout's."""
    for site in SITE_PYTHON:
        text = text.replace(site, sys.executable)
    for site in SITE_LAUNCH:
        text = text.replace(site, str(LAUNCH))
    return text


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    return env | {"FANOUT_DRY_RUN": "1"} | more


def _slurm() -> str:
    (script,) = [b for b in _blocks("bash") if b.startswith("#!/bin/bash\n#SBATCH")]
    return script


def _manifests() -> list[dict[str, Any]]:
    (block,) = _blocks("yaml")
    return [d for d in yaml.safe_load_all(block) if d]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] not in ("Job", "Deployment"):
        return []
    return list(doc["spec"]["template"]["spec"]["containers"])


# ---- every script of the doc --------------------------------------------------------------


def test_every_shell_block_parses_and_calls_the_launcher_with_a_role_it_knows(
    tmp_path: Path,
) -> None:
    roles = _roles()
    assert roles == {"producer", "follow-producer", "trainer", "dp-trainer", "status"}
    blocks = _blocks("bash")
    assert len(blocks) >= 3
    called = set()
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.sh"
        script.write_text(block)
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"block {i}: {r.stderr}\n{block}"
        for arg in re.findall(r"launch\.sh\s+(\S+)", block):
            assert arg in roles or arg in ("--help", "--roles"), (i, arg)
            called.add(arg)
    # the prose's calls too (`launch.sh follow-producer`, ...)
    for arg in re.findall(r"launch\.sh\s+([a-z][\w-]*)", DOC.read_text()):
        assert arg in roles, arg
    assert {"producer", "trainer", "dp-trainer", "status"} <= called


def test_every_variable_the_recipes_set_is_one_the_launcher_reads() -> None:
    launcher = LAUNCH.read_text()
    code = "\n".join(_blocks("bash") + _blocks("yaml"))
    names = set(re.findall(r"\bFANOUT_[A-Z_]+\b", code))
    assert {"FANOUT_RUN_DIR", "FANOUT_DB_URL", "FANOUT_CONFIG"} <= names
    unread = sorted(n for n in names if not re.search(rf"\b{n}\b", launcher))
    assert not unread, f"docs/deploy.md sets variables launch.sh never reads: {unread}"


def _config_keys(cfg: dict[str, Any]) -> None:
    model = ProducerConfig if "data" in cfg else TrainConfig
    unknown = sorted(set(cfg) - set(model.model_fields))
    assert not unknown, f"not fields of {model.__name__}: {unknown}"


def test_the_configs_in_the_doc_name_fields_of_their_commands() -> None:
    configs = [json.loads(b) for b in _blocks("json")]
    for doc in _manifests():
        if doc["kind"] == "ConfigMap":
            configs += [json.loads(v) for k, v in doc["data"].items() if k.endswith(".json")]
    assert len(configs) >= 4
    kinds = {"data" in c for c in configs}
    assert kinds == {True, False}  # producers' and trainers'
    for cfg in configs:
        _config_keys(cfg)


# ---- Slurm ----------------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# srun [--opt=value ...] CMD...: CMD once per task (--ntasks), SLURM_PROCID set
n=1
while [[ ${1:-} == --* ]]; do
  case $1 in --ntasks=*) n=${1#--ntasks=} ;; esac
  shift
done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" || exit $?; done
"""
FAKE_SCONTROL = "#!/bin/bash\nprintf 'node%d\\n' 0 1 2 3 4\n"


def test_the_slurm_batch_script_starts_every_role_through_the_launcher(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "fanout-r1.sbatch"
    script.write_text(_local(_slurm()))
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[0-4]",
               SLURM_JOB_ID="4242")  # fmt: skip
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    py = sys.executable
    produce = [x for x in lines if " -m fanout.cli produce " in x]
    assert len(produce) == 2  # one per replica, its rank from srun's task id
    for rank, line in enumerate(produce):
        assert line.startswith(f"{py} -m fanout.cli produce --run-dir /shared/runs/r1 --db-path ")
        assert line.endswith(f"--replicas 2 --replica-rank {rank}"), line
    (train,) = [x for x in lines if x.startswith(f"{py} -m fanout.cli train ")]
    assert "--consumer-id b16 --save-path /shared/drafts/b16" in train
    dp = [x for x in lines if "fanout.train.dplaunch" in x]
    assert len(dp) == 2  # one torchrun per node, both at the same rendezvous
    assert dp[0] == dp[1]
    assert dp[0].startswith(
        f"{py} -m fanout.train.dplaunch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
        "--rdzv-endpoint node3:29400 --rdzv-id 4242 -m fanout.cli train "
    ), dp[0]
    (status,) = [x for x in lines if " -m fanout.cli status " in x]
    assert status.endswith("--serve 9464 --host 0.0.0.0")


# ---- Kubernetes -----------------------------------------------------------------------------


def _pod_env(doc: dict[str, Any], container: dict[str, Any], maps: dict[str, Any]) -> dict:
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env |= {k: _local(str(v)) for k, v in maps[src["configMapRef"]["name"]].items()}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _local(str(var["value"]))
        else:  # the password: a Secret's key, never written in the manifest
            assert var["valueFrom"]["secretKeyRef"], var
            env[var["name"]] = "secret"
    return env


def test_the_kubernetes_manifests_start_every_role_through_the_launcher(tmp_path: Path) -> None:
    docs = _manifests()
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    roles, started = _roles(), set()
    for doc in docs:
        for c in _containers(doc):
            command = c["command"]
            assert command[0].endswith("/scripts/launch.sh") and command[1] in roles, command
            pod = doc["spec"]["template"]["spec"]
            claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
            assert {m["name"] for m in c["volumeMounts"]} >= claims == {"shared"}
            env = _pod_env(doc, c, maps)
            assert env["PGPASSWORD"] == "secret"  # from the Secret, into PGPASSWORD
            spec = doc["spec"]
            indexed = doc["kind"] == "Job" and spec.get("completionMode") == "Indexed"
            for index in range(spec["completions"]) if indexed else [None]:
                more = {} if index is None else {"JOB_COMPLETION_INDEX": str(index)}
                argv = ["bash", str(LAUNCH), *command[1:], *c.get("args", [])]
                r = subprocess.run(argv, capture_output=True, text=True, env=_env(**env, **more))
                assert r.returncode == 0, (doc["metadata"]["name"], r.stderr)
                if command[1] == "producer":
                    assert r.stdout.strip().endswith(f"--replica-rank {index}"), r.stdout
                if command[1] == "dp-trainer":
                    assert "--rdzv-endpoint fanout-r1-dp-0.fanout-r1-dp:29400" in r.stdout
            started.add(command[1])
    assert {"producer", "trainer", "dp-trainer", "status"} <= started


@pytest.mark.parametrize(
    ("env", "role", "says"),
    [
        ({}, "producer", "FANOUT_RUN_DIR is not set"),
        ({}, "", "no role given (roles: producer follow-producer"),
        ({"FANOUT_RUN_DIR": "/r"}, "producer", "producer: FANOUT_DB_URL is not set"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_DB_URL": "/r/c.sqlite3"}, "trainer",
         "FANOUT_DB_URL must be a postgresql:// URL"),
        ({"FANOUT_RUN_DIR": "/r"}, "consumer", "unknown role 'consumer' (roles: producer"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_NNODES": "2"}, "dp-trainer",
         "dp-trainer: FANOUT_RDZV_ENDPOINT is not set"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_NNODES": "2", "FANOUT_RDZV_ENDPOINT": "n0"},
         "dp-trainer", "FANOUT_RDZV_ENDPOINT must be HOST:PORT, got 'n0'"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_DB_URL": "postgresql://h/d", "SLURM_PROCID": "x"},
         "producer", "SLURM_PROCID must be a whole number >= 0, got 'x'"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_DB_URL": "postgresql://h/d"}, "follow-producer",
         "follow-producer: FANOUT_FOLLOW is not set"),
        ({"FANOUT_RUN_DIR": "/r", "FANOUT_PYTHON": "/no/python"}, "status",
         "FANOUT_PYTHON: '/no/python' is not an executable"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_and_exit_1(env: dict[str, str], role: str, says: str) -> None:
    env = {"FANOUT_PYTHON": sys.executable} | env
    argv = ["bash", str(LAUNCH), *([role] if role else [])]
    r = subprocess.run(argv, capture_output=True, text=True,
                       env=_env(**env) | {"FANOUT_DRY_RUN": "0"})  # fmt: skip
    assert r.returncode == 1 and not r.stdout
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"launch.sh: {says}"), r.stderr


def test_the_log_line_masks_a_password_in_the_url(tmp_path: Path) -> None:
    """Without FANOUT_DRY_RUN the command is logged, then exec'd (here: its --help)."""
    env = _env(FANOUT_PYTHON=sys.executable, FANOUT_RUN_DIR=str(tmp_path),
               FANOUT_DB_URL="postgresql://fanout:s3cret@db:5432/fanout?schema=r1",
               FANOUT_DRY_RUN="0")  # fmt: skip
    r = subprocess.run(["bash", str(LAUNCH), "status", "--help"], capture_output=True,
                       text=True, env=env)  # fmt: skip
    assert r.returncode == 0 and "usage: fanout status" in r.stdout
    first = r.stderr.splitlines()[0]
    assert first.startswith("launch.sh: status on ") and "fanout:***@db:5432" in first
    assert "s3cret" not in r.stderr
