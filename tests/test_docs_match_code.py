"""What the docs and docstrings claim, checked against the code (issue 24.4).

    .venv/bin/pytest tests/test_docs_match_code.py -x -q

Each test takes one claim a reader would act on and checks it against the code that
implements it, so the two cannot drift apart silently: the commands `fanout`'s
docstring lists, where typed errors live, the one content hash, store.py's opening
example, dotted references in module docstrings, and how cursors move; then (issue 35.2)
which folders import torch, what each folder's docstring says it may import, the config
make-up the docs list, the commands that take --config, the run-dir layouts of store.md
and operations.md, durability, the sealed coordinator, how dev.sh installs torch, and
that a window's tensor names and train_log.jsonl are each spelled in one module; then
(issue 54) the reading guide's answer paths, the family tables, every `Class.attr`
and `module.name` the pages give, the extras they install, the modules they run with
`python -m` and the flags they say a component config declares. What the docs name
(flags, defaults, variables, files, sections) is tests/test_docs_references.py's.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import fanout
from conftest import repo_module
from fanout.errors import FanoutError

SRC = Path(fanout.__file__).parent
REPO = Path(__file__).resolve().parents[1]
# the core: modules at the bottom of the layers (pyproject's import-linter contract)
CORE = {
    "contract",
    "flags",
    "rows",
    "tracking",
    "filesystem",
    "netfs",
    "hashing",
    "errors",
    "ticker",
    "cli",
}


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


# ---- issue 35.2: docs that match the code ----------------------------------------------


def _packages() -> list[str]:
    return sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())


def _section(text: str, heading: str) -> str:
    """The body of a markdown section, up to the next heading of its level or higher."""
    level = heading.split(" ", 1)[0]
    body = text.split(heading + "\n", 1)[1]
    stop = re.search(rf"^#{{1,{len(level)}}} ", body, re.M)
    return body[: stop.start()] if stop else body


def _folders_whose_import_pulls_torch() -> list[str]:
    """Every package under fanout, each imported alone in a fresh interpreter: the ones
    after whose import `torch` is in `sys.modules`, as folder paths (`ops/`)."""
    names = ["fanout"] + [
        m.name for m in pkgutil.walk_packages(fanout.__path__, "fanout.") if m.ispkg
    ]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n"
    code += "    importlib.import_module(n)\n    print(n, 'torch' in sys.modules)\n"
    pulled = []
    for name in names:
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
        if out[-1] == "True":
            pulled.append(name.removeprefix("fanout.").replace(".", "/") + "/")
    return sorted(pulled)


def test_the_folders_whose_import_pulls_torch_are_the_ones_the_architecture_page_names() -> None:
    """docs/architecture.md: importing a folder is free but for the folders it names;
    `fanout status` and the data workers never pay for torch. The claim is read from the
    page and compared with a real import of every package, so a folder that starts (or
    stops) importing torch fails here until the page says so."""
    text = (REPO / "docs" / "architecture.md").read_text()
    claim = re.search(r"no `__init__` imports torch except ((?:`[a-z_/]+`(?:, | and )?)+)", text)
    assert claim, "docs/architecture.md lost its sentence on which folders import torch"
    named = sorted(re.findall(r"`([a-z_/]+)`", claim.group(1)))
    assert _folders_whose_import_pulls_torch() == named


def test_each_folder_docstring_says_what_it_may_import_and_it_imports_no_more() -> None:
    """Each folder's `__init__` docstring has a `May import:` line naming the folders below
    it that its modules import (or "every layer below it"); no module imports another."""
    pkgs = _packages()
    bad = []
    for pkg in pkgs:
        doc = ast.get_docstring(ast.parse((SRC / pkg / "__init__.py").read_text())) or ""
        m = re.search(r"May import:(.*?)(?:\.\s|\.$|;)", doc, re.S)
        if m is None:
            bad.append(f"{pkg}: no 'May import:' in its __init__ docstring")
            continue
        said = " ".join(m.group(1).split())
        allowed = set(re.findall(r"\b(" + "|".join(pkgs) + r")\b", said)) | {pkg, ""}
        if "core" in said:
            allowed |= CORE - {"cli"}
        if "every layer below" in said:
            allowed |= set(pkgs) | CORE
        used = set()
        for f in (SRC / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                mods = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                used |= {[*mod.split("."), ""][1] for mod in mods if mod.split(".")[0] == "fanout"}
        if used - allowed:
            bad.append(f"{pkg}: imports {sorted(used - allowed)}, its docstring says {said!r}")
    assert bad == []


def _scripts_docs() -> Any:
    """scripts/docs.py, the docs' block generator, as a module."""
    return repo_module("scripts", "docs")


def test_the_docs_list_each_command_configs_make_up_as_the_classes_have_it() -> None:
    """README and docs/architecture.md carry the block scripts/docs.py generates from the
    config classes' bases (ProducerConfig's components, ...)."""
    docs = _scripts_docs()
    block = docs.block()
    assert "`ProducerConfig` = `DataOptions` (with `ChatFormat`, `ReadOptions`)" in block
    for path in docs.DOCS:
        assert block in path.read_text(), f"{path}: stale; run python scripts/docs.py"


def test_each_document_lists_the_families_once_from_the_registry() -> None:
    """#54: families were listed in 15 places across 9 files, 3 of them stale. README and
    docs/training.md carry the block scripts/docs.py generates from the registry, with a
    row per registered family; a family added to FAMILY_FOLDERS makes it stale."""
    from fanout.families.registry import FAMILY_FOLDERS

    docs = _scripts_docs()
    block = docs.families_block()
    assert [f"| `{f}` |" in block for f in FAMILY_FOLDERS] == [True] * len(FAMILY_FOLDERS)
    for path in (REPO / "README.md", REPO / "docs" / "training.md"):
        assert block in path.read_text(), f"{path}: stale; run python scripts/docs.py"


def test_the_readme_names_every_command_that_takes_config() -> None:
    from fanout import cli

    takes = set()
    for name in cli.COMMANDS:
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "--config" in {s for a in sub.choices[name]._actions for s in a.option_strings}:
            takes.add(name)
    text = " ".join((REPO / "README.md").read_text().split())
    listed = text.split("and `fanout ", 1)[1].split("`", 1)[0]
    assert set(re.findall(r"[a-z][a-z-]*", listed)) == takes, (listed, takes)


def test_store_md_says_what_rundir_create_makes(tmp_path: Path) -> None:
    from fanout.store.store import RunDir

    made = {p.name + "/" for p in RunDir(tmp_path / "run").create().root.iterdir()}
    text = (REPO / "docs" / "store.md").read_text()
    line = " ".join(text.split("`RunDir(root)`", 1)[1].split("\n\n", 1)[0].split())
    assert set(re.findall(r"`([a-z_]+/)`", line)) == made, line
    assert "coordinator.sqlite3" not in line and f"its {len(made)} folders" in line


def test_operations_md_lists_everything_a_producer_makes_in_a_run_dir() -> None:
    from fanout.store.rundir import RunDir

    rd = RunDir(Path("run"))
    made = (*rd.producer_names(), rd.start_lock(0).name, rd.join_lock.name)
    text = _section((REPO / "docs" / "operations.md").read_text(), "## Where things live")
    names = {n for n in made if not n.endswith(("-wal", "-shm"))}
    folders = {"windows", "tmp", "quarantine", "telemetry", "logs", "cache"}
    missing = [n for n in names if f"`{n}/`" not in text and f"`{n}`" not in text]
    assert missing == [] and all(f"`{n}/`" in text for n in folders & names), missing


def test_operations_md_says_which_durability_sqlite_has_and_why() -> None:
    src = (SRC / "coord" / "sqlitedb.py").read_text()
    (mode,) = re.findall(r"PRAGMA synchronous=(\w+)", src)
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"synchronous={mode}" in text
    assert "durable by default" not in text
    if mode == "NORMAL":  # survives a process crash, not a power loss: the doc says which
        assert "survive a process crash" in text and "power loss" in text


def test_only_coord_speaks_sql() -> None:
    """docs/architecture.md: the coordinator is sealed. Outside coord/ nothing uses a
    database driver (a report may print SQLite's version)."""
    bad = []
    for f in SRC.rglob("*.py"):
        if f.is_relative_to(SRC / "coord"):
            continue
        text = f.read_text()
        used = set(re.findall(r"\bsqlite3\.(\w+)", text)) - {"sqlite_version"}
        if used or re.search(r"^\s*(import|from) psycopg", text, re.M):
            bad.append(f"{f.relative_to(SRC)}: {sorted(used) or 'psycopg'}")
    assert bad == []


def test_dev_sh_installs_the_cpu_build_of_torch_as_the_readme_says() -> None:
    dev = (REPO / "dev.sh").read_text()
    readme = " ".join((REPO / "README.md").read_text().split())
    index = "https://download.pytorch.org/whl/cpu"
    assert f"--extra-index-url {index}" in dev and index in readme
    assert '--dry-run --no-index --no-deps "torch==2.13.0"' in dev  # a local wheel first
    assert "`torch==2.13.0`" in readme and "torch==2.13.0" in dev


WINDOW_NAMES = {"input_ids", "loss_mask", "document_ids", "position_ids", "target_ids",
                "last_hidden_states", "hidden_states", "hidden_states_scale"}  # fmt: skip


def test_a_windows_tensor_names_are_spelled_in_one_module() -> None:
    """fanout.rows (the window format's vocabulary) spells them; every other module uses
    its constants. Allowed elsewhere: docstrings, `label_source`'s values (a config
    choice that names a tensor), and a tokenizer's own output keys."""
    bad = []
    for f in SRC.rglob("*.py"):
        if f == SRC / "rows.py":
            continue
        tree = ast.parse(f.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)
        }  # fmt: skip
        ok = set(docs)
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and (
                isinstance(n.value, ast.Call)  # tokenizer(...)["input_ids"]
                or (isinstance(n.value, ast.Name) and n.value.id == "Literal")
            ):
                ok |= {id(c) for c in ast.walk(n.slice)}
            if (isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute)
                    and n.left.attr == "label_source"):  # fmt: skip
                ok |= {id(c) for c in n.comparators}
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "label_source":
                ok |= {id(c) for c in ast.walk(n.value)} if n.value else set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in WINDOW_NAMES and id(n) not in ok:
                bad.append(f"{f.relative_to(SRC)}:{n.lineno}: {n.value!r}")
    assert bad == [], "use fanout.rows' constants"


def test_train_log_is_named_written_and_read_in_one_module() -> None:
    own = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name != "trainlog.py" and '"train_log' in p.read_text()
    ]
    assert own == [], "fanout.train.trainlog names, writes and reads train_log.jsonl"


# ---- issue 45: names, paths and the module map the docs give ----------------------------

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Dotted names the docs mention on purpose although nothing imports by them; each entry
# must still be in its page and must still not resolve (else it is stale).
NOT_IMPORTABLE = {
    # the "before" column of "Renamed in the 2026-12 layout": module paths that are gone
    ("architecture.md", "fanout.producer"): "module path before the 2026-12 layout",
    ("architecture.md", "fanout.coordinator"): "module path before the 2026-12 layout",
    ("architecture.md", "fanout.checkpoint"): "module path before the 2026-12 layout",
    ("architecture.md", "fanout.assets"): "module path before the 2026-12 layout",
    ("architecture.md", "fanout.telemetry"): "module path before the 2026-12 layout",
}


def _lookup(ref: str) -> tuple[object, object] | None:
    """(what holds the last part, the object) for a dotted name, importing the longest
    module prefix and getattr-ing the rest; None if any part is missing."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        owner = obj
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None
            owner, obj = obj, getattr(obj, attr)
        return owner, obj
    return None


def _named_refs(text: str) -> list[tuple[str, int]]:
    """(dotted name, offset) for each `fanout.x.y...` in `text`, and for each module
    path followed by a name (`store/rundir.py` `RunDir`: fanout.store.rundir.RunDir)."""
    refs = [(m.group(0), m.start()) for m in
            re.finditer(r"(?<![\w./-])fanout(?:\.[A-Za-z_]\w*)+", text)]  # fmt: skip
    for m in re.finditer(r"`((?:\w+/)+\w+)\.py`\s+`([A-Za-z_]\w*)`", text):
        refs.append((f"fanout.{m.group(1).replace('/', '.')}.{m.group(2)}", m.start()))
    return refs


def test_every_dotted_fanout_name_in_the_docs_resolves_where_it_lives() -> None:
    """README.md and docs/*.md: each `fanout.x.y[.Z[.attr]]` (or `x/y.py` `Z`) imports and
    getattrs, and a function or class is named in the module that defines it, not one
    re-exporting it."""
    bad, seen = [], set()
    for path in DOCS:
        text = path.read_text()
        for ref, at in _named_refs(text):
            where = f"{path.name}:{text.count(chr(10), 0, at) + 1}"
            if (path.name, ref) in NOT_IMPORTABLE:
                seen.add((path.name, ref))
                assert _lookup(ref) is None, f"{where}: {ref} resolves; drop its exemption"
                continue
            found = _lookup(ref)
            if found is None:
                bad.append(f"{where}: {ref} does not exist")
                continue
            owner, obj = found
            home = getattr(obj, "__module__", None)
            defined = inspect.isclass(obj) or inspect.isfunction(obj)
            if inspect.ismodule(owner) and defined and home != owner.__name__:
                bad.append(f"{where}: {ref} is defined in {home}")
    assert bad == [], "\n".join(bad)
    assert set(NOT_IMPORTABLE) - seen == set(), "exemptions no page mentions any more"


def test_every_source_path_in_the_docs_exists() -> None:
    """`src/...` paths (a `<placeholder>` part matches any name), and `.py` paths given
    relative to the package (`coord/reads.py`, `fanout/flags.py`)."""
    pkgs = _packages()
    bad = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"(?<![\w./-])src/[\w./<>-]*[\w/>]", text):
            pattern = re.sub(r"<[^>/]+>", "*", m.group(0)).rstrip("/")
            if not any(REPO.glob(pattern)):
                bad.append(f"{path.name}: {m.group(0)}")
        for p in re.findall(r"`((?:\w+/)+\w+\.py)`", text):
            ours = p.split("/")[0] in {*pkgs, "fanout"}
            if ours and not ((SRC / p).is_file() or (SRC.parent / p).is_file()):
                bad.append(f"{path.name}: {p}")
    assert bad == [], "\n".join(bad)


def _map_sections(block: str, pkgs: list[str]) -> dict[str, str]:
    """The module map's text per folder: a line whose `folder/` label is followed by two
    spaces starts that folder's part, and the lines below it continue it."""
    sections: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        label = re.search(r"(?<![\w/])(" + "|".join(pkgs) + r")/ {2,}", line)
        if label:
            current = label.group(1)
            line = line[label.end() :]
        sections[current] = sections.get(current, "") + line + "\n"
    return sections


def test_the_architecture_map_lists_every_module() -> None:
    """docs/architecture.md's map names each module under src/fanout: a top-level one as
    `name.py`; one in a folder in that folder's part of the map (or as `folder/name`
    anywhere); a family's subfolder as `name/` in families' part, with its modules."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("```\n", 2)[1]
    pkgs = _packages()
    sections = _map_sections(block, pkgs)
    word = lambda w: rf"(?<![\w/.]){re.escape(w)}(?![\w/])"  # noqa: E731
    missing = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC)
        if f.stem in {"__init__", "__main__"} and len(rel.parts) < 3:
            continue
        if len(rel.parts) == 1:
            if not re.search(word(f.name), block):
                missing.append(str(rel))
            continue
        pkg, *subs = rel.parts[:-1]
        part = sections.get(pkg, "")
        for sub in subs:  # families/<family>/: the subfolder is named `<family>/`
            if not re.search(rf"(?<![\w/]){re.escape(sub)}/(?!\w)", part):
                missing.append(f"{pkg}/{sub}/")
        if f.stem == "__init__":
            continue
        if not (re.search(word(f.stem), part) or re.search(word(f"{pkg}/{f.stem}"), block)):
            missing.append(str(rel))
    assert sorted(set(missing)) == [], "not in the map: " + ", ".join(sorted(set(missing)))


def _families_named(text: str) -> set[str]:
    """The family names a sentence gives (`EAGLE-3` is eagle3, `P-EAGLE` peagle)."""
    words = re.findall(r"[A-Z]-[A-Z]{2,}|[A-Za-z]+(?:-?\d+)?", text)
    return {w.lower().replace("-", "") for w in words}


def test_the_readme_and_pyproject_name_every_draft_family() -> None:
    """The README's opening paragraph, pyproject's description, docs/training.md's title
    and what docs/architecture.md says fanout trains ("What fanout will not do") name
    every registered family; the families that page says vLLM does not serve are the
    ones whose `Family.served_by_vllm` is False."""
    import tomllib

    from fanout.families.registry import FAMILIES, family

    readme = (REPO / "README.md").read_text().split("\n\n")
    opening = next(p for p in readme if p.startswith("fanout trains"))
    desc = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["description"]
    title = (REPO / "docs" / "training.md").read_text().split("\n", 1)[0]
    arch = (REPO / "docs" / "architecture.md").read_text()
    scope = _section(arch, "## What fanout will not do").split("\n- ")[1]
    for text in (opening, desc, title, scope):
        assert set(FAMILIES) - _families_named(text) == set(), text
    served = re.search(r"vLLM serves all but ([^,;)]+)", " ".join(scope.split()))
    assert served, scope
    unserved = {n for n in FAMILIES if not family(n).served_by_vllm}
    assert _families_named(served.group(1)) & set(FAMILIES) == unserved, served.group(0)


# ---- issue 54: the reading guide ----------------------------------------------------------

GUIDE_MAX_FILES = 6  # source files per question (issue 54: "answered from <= 6 source files")
_FILE_SUFFIXES = {"py", "json", "jsonl", "md", "safetensors", "toml", "sqlite3", "lock"}


def _guide() -> dict[str, str]:
    """docs/architecture.md's "## Reading guide": question heading -> its text."""
    text = (REPO / "docs" / "architecture.md").read_text()
    parts = re.split(r"^### (.+)\n", _section(text, "## Reading guide"), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _guide_paths(body: str) -> tuple[list[str], list[str]]:
    """(source files under src/fanout, other repository files) a question names, in
    order, once each: `coord/claims.py` is a source file, `tests/...` one of the others."""
    src: list[str] = []
    other: list[str] = []
    for p in re.findall(r"`((?:[\w<>.-]+/)*[\w<>-]+\.py)`", body):
        ours = p.split("/")[0] in {*_packages(), "fanout"} or "/" not in p
        (src if ours else other).append(p)
    return list(dict.fromkeys(src)), list(dict.fromkeys(other))


def _module_of(path: str) -> str:
    """`families/dflash/__init__.py` -> fanout.families.dflash."""
    parts = path.removesuffix(".py").split("/")
    if parts[0] == "fanout":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["fanout", *parts])


def _pydantic_field(ref: str) -> tuple[object, object] | None:
    """(the model class, the field) for `Model.field` naming a pydantic field (not a
    class attribute, so `_lookup` misses it); None otherwise."""
    owner, _, name = ref.rpartition(".")
    found = _lookup(owner)
    fields = getattr(found[1], "model_fields", None) if found else None
    return (found[1], fields[name]) if found and fields and name in fields else None


def _guide_name_resolves(ref: str, modules: list[str]) -> str | None:
    """Where dotted name `ref` (`Claims.claim`, `retention.claimable`) lives among
    `modules`, checked to be defined in the module that names it; None if nowhere."""
    for mod in modules:
        head, _, rest = ref.partition(".")
        tries = [f"{mod}.{ref}"] + ([f"{mod}.{rest}"] if head == mod.rsplit(".", 1)[1] else [])
        for full in tries:
            found = _lookup(full) or _pydantic_field(full)
            if found is None:
                continue
            owner, obj = found
            defined = inspect.isclass(obj) or inspect.isfunction(obj)
            if inspect.ismodule(owner) and defined and obj.__module__ != owner.__name__:
                continue  # re-exported: named in the module that does not define it
            return full
    return None


def test_the_reading_guide_answers_each_question_from_six_files_that_hold_its_names() -> None:
    """#54: docs/architecture.md's reading guide: six questions, each naming at most six
    source files that exist, and every `module.name` / `Class.method` it gives in
    backticks resolves in one of the files its question names (so the files do hold the
    answer, and a rename or move that breaks the guide fails here)."""
    guide = _guide()
    assert len(guide) == 6, list(guide)
    bad = []
    for question, body in guide.items():
        src, other = _guide_paths(body)
        assert 1 <= len(src) <= GUIDE_MAX_FILES, f"{question}: {len(src)} source files: {src}"
        for p in src:
            if not (SRC / p).is_file() and not (SRC.parent / p).is_file():
                bad.append(f"{question}: {p} does not exist")
        for p in other:
            if not any(REPO.glob(re.sub(r"<[^>/]+>", "*", p))):
                bad.append(f"{question}: {p} does not exist")
        modules = [_module_of(p) for p in src]
        for ref in dict.fromkeys(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", body)):
            if ref.rsplit(".", 1)[1] in _FILE_SUFFIXES:
                continue  # a file name (`config.json`), not a Python name
            if _guide_name_resolves(ref, modules) is None:
                bad.append(f"{question}: `{ref}` is in none of {src}")
        assert "Read: " in body, f"{question}: no reading order"
    assert bad == [], "\n".join(bad)


# ---- issue 54: `Class.attr` and `module.name` anywhere in the docs ------------------------

# Classes the docs name by `Class.attr` that belong to other libraries: each must still be
# in a page and must not be a fanout class (else its attribute is checked like ours).
OTHER_LIBRARIES_CLASSES = {
    "EagleProposer": "vLLM's EAGLE proposer (docs/eval.md)",
    "MTPDraftModel": "speculators' MTP draft (docs/training.md)",
    "DFlashDraftModel": "speculators' DFlash draft (docs/training.md)",
    "AutoModelForCausalLM": "transformers (docs/producer.md)",
    "F": "torch.nn.functional (docs/model.md)",
}
# `module.name` spellings whose first part is a fanout module's name but which name no
# Python object: each must still be in its page and still not resolve (else it is stale).
NOT_PYTHON_NAMES = {
    ("operations.md", "coordinator.dbpath"): "a run dir's file",
    ("benchmarks.md", "coordinator.dbpath"): "a run dir's file",
    ("benchmarks.md", "assets.verifier_dir"): "a key of the benchmark's config file",
    ("benchmarks.md", "assets.data"): "a key of the benchmark's config file",
    ("eval.md", "model.final_layernorm"): "a verifier checkpoint's tensor name",
    ("eval.md", "model.embedding_norm"): "a verifier checkpoint's tensor name",
    ("producer.md", "model.final_layernorm"): "a verifier checkpoint's tensor name",
    ("producer.md", "model.embedding_norm"): "a verifier checkpoint's tensor name",
    ("training.md", "mtp.fc"): "a verifier checkpoint's tensor name",
    ("training.md", "mtp.norm"): "a verifier checkpoint's tensor name",
    ("training.md", "speculators_config.verifier"): "a key of a checkpoint's config.json",
    ("operations.md", "promote.floor"): "a status page cell's data-key",
}


def _fanout_classes() -> dict[str, list[type]]:
    """Every class fanout defines, by name (a name two modules define maps to both)."""
    found: dict[str, list[type]] = {}
    for m in _modules():
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and obj.__module__ == m.__name__:
                found.setdefault(name, []).append(obj)
    return found


def _has(cls: type, attr: str) -> bool:
    """`cls.attr` names something real: a class attribute or method, a pydantic or
    dataclass field, an annotated attribute, or one its methods assign (`self.attr =`)."""
    if hasattr(cls, attr) or attr in (getattr(cls, "model_fields", None) or {}):
        return True
    for k in cls.__mro__:
        if attr in getattr(k, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(k)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=", source):
            return True
    return False


def _page_refs(pattern: str) -> list[tuple[str, int, str, str]]:
    """(page, line, first part, attribute) of each backticked `A.b` (or `A.b(...)`)
    README.md and docs/*.md give, file names (`config.json`) left out."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(rf"`({pattern})\.([A-Za-z_]\w*)(?:\([^`]*\))?`", text):
            if m.group(2) not in _FILE_SUFFIXES:
                line = text.count("\n", 0, m.start()) + 1
                out.append((path.name, line, m.group(1), m.group(2)))
    return out


def test_every_class_attribute_the_docs_name_exists() -> None:
    """README.md and docs/*.md: each `Class.attr` (`Claims.publish_ready`,
    `SoakReport.summary()`, `W.READY`, `RunOptions.max_live_windows`) names a fanout class
    that has that attribute; a renamed class or method fails here. Other libraries'
    classes are OTHER_LIBRARIES_CLASSES."""
    classes = _fanout_classes()
    assert {"Claims", "Coordinator", "W"} <= set(classes)
    bad, seen = [], set()
    refs = _page_refs(r"[A-Z][A-Za-z0-9]*")
    for page, line, cls, attr in refs:
        if cls in OTHER_LIBRARIES_CLASSES:
            seen.add(cls)
            assert cls not in classes, f"{cls} is a fanout class now: drop its exemption"
        elif cls not in classes:
            bad.append(f"{page}:{line}: {cls}.{attr}: fanout defines no class {cls}")
        elif not any(_has(k, attr) for k in classes[cls]):
            bad.append(f"{page}:{line}: {cls}.{attr}: {cls} has no {attr}")
    assert bad == [], "\n".join(bad)
    assert set(OTHER_LIBRARIES_CLASSES) - seen == set(), "exemptions no page mentions any more"
    assert len(refs) > 100  # the pages were read


def test_every_module_name_the_docs_name_exists() -> None:
    """README.md and docs/*.md: each `module.name` whose first part is the name of a
    fanout module or package (`retention.claimable`, `states.LIVE`, `numbering.to_serving_layer_ids`)
    is defined in a module of that name; a renamed or moved function fails here.
    Spellings that are not Python names are NOT_PYTHON_NAMES."""
    stems: dict[str, list[ModuleType]] = {}
    for m in _modules():  # `fanout.x.y` is the dotted-name test's
        stems.setdefault(m.__name__.rsplit(".", 1)[-1], []).append(m)
    bad, seen = [], set()
    refs = [r for r in _page_refs(r"[a-z_][a-z0-9_]*") if r[2] in stems]
    for page, line, stem, name in refs:
        ref = f"{stem}.{name}"
        found = any(hasattr(m, name) for m in stems[stem])
        if (page, ref) in NOT_PYTHON_NAMES:
            seen.add((page, ref))
            assert not found, f"{page}:{line}: {ref} resolves; drop its exemption"
        elif not found:
            bad.append(f"{page}:{line}: {ref}: no module named {stem} defines {name}")
    assert bad == [], "\n".join(bad)
    assert set(NOT_PYTHON_NAMES) - seen == set(), "exemptions no page mentions any more"
    assert len(refs) > 50  # the pages were read


def test_every_extra_the_docs_install_is_one_pyproject_defines() -> None:
    """`pip install 'fanout[tp]'` (or `'.[postgres]'`) in README.md and docs/*.md names an
    optional dependency group of pyproject.toml."""
    import tomllib

    extras = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named = {(p.name, e) for p in DOCS for group in
             re.findall(r"(?:fanout|\.)\[([a-z0-9_,-]+)\]", p.read_text())
             for e in group.split(",")}  # fmt: skip
    assert {e for _, e in named} >= {"postgres", "tp"}  # the pages were read
    assert sorted(f"{page}: [{e}]" for page, e in named if e not in extras) == []


def test_the_flags_a_page_says_a_component_declares_are_its_fields() -> None:
    """docs/training.md: "How the trainer reads the run (`--run-dir`, ...) is declared
    once, in `fanout.train.consumer.ConsumerOptions`", and the same of the draft's recipe
    and `DraftRecipe`: the flags listed are exactly that class's fields (by flag name or
    alias), so a field added to the component or moved out of it fails here."""
    from fanout.flags import field_aliases, field_flag

    text = " ".join((REPO / "docs" / "training.md").read_text().split())
    claims = re.findall(
        r"\(((?:`--[a-z0-9-]+`,? ?)+)\) is declared once, in `(fanout[\w.]+)`", text
    )
    assert {c for _, c in claims} >= {
        "fanout.train.consumer.ConsumerOptions",
        "fanout.model.draft_config.DraftRecipe",
    }, claims
    for listed, ref in claims:
        found = _lookup(ref)
        assert found is not None, ref
        model: Any = found[1]
        flags = {
            name: {field_flag(name, f), *field_aliases(f)} for name, f in model.model_fields.items()
        }
        named = set(re.findall(r"`(--[a-z0-9-]+)`", listed))
        covered = {name for name, fl in flags.items() if fl & named}
        unknown = sorted(f for f in named if not any(f in fl for fl in flags.values()))
        assert (sorted(set(flags) - covered), unknown) == ([], []), ref


def test_every_python_dash_m_the_docs_run_is_a_module_that_runs() -> None:
    """`python -m fanout.chaos`, `-m fanout.train.dplaunch`, `torchrun ... -m fanout.cli`:
    each module README.md and docs/*.md run with `-m` has a `__main__.py` or an
    `if __name__ == "__main__":` block (the names the 2026-12 layout retired aside)."""
    gone = {ref for _, ref in NOT_IMPORTABLE}
    bad, seen = [], set()
    for path in DOCS:
        for ref in re.findall(r"-m (fanout(?:\.\w+)*)", path.read_text()):
            seen.add(ref)
            if ref in gone:
                continue
            rel = Path(*ref.split(".")[1:])
            main = SRC / rel / "__main__.py"
            module = (SRC / rel).with_suffix(".py")
            runs = main.is_file() or (
                module.is_file()
                and re.search(r"^if __name__ == .__main__.:", module.read_text(), re.M)
            )
            if not runs:
                bad.append(f"{path.name}: python -m {ref}")
    assert {"fanout.chaos", "fanout.cli", "fanout.train.dplaunch"} <= seen
    assert bad == [], "\n".join(bad)


def test_the_readme_gpu_command_runs_every_test_file_marked_gpu() -> None:
    """README.md's `pytest -m gpu ...` names every test module that holds a test marked
    `gpu`, so a GPU check run from it misses none."""
    text = " ".join((REPO / "README.md").read_text().split())
    command = re.search(r"`pytest -m gpu ((?:tests/\w+\.py ?)+)`", text)
    assert command, "README.md lost its `pytest -m gpu ...` command"
    marked = {
        f"tests/{f.name}"
        for f in (REPO / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", f.read_text())
    }
    assert marked and set(command.group(1).split()) == marked, (command.group(1), marked)
