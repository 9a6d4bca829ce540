"""Every name README.md and docs/*.md give a reader to act on, checked against the code
(issue 54: a sentence-by-sentence reread found flags, defaults, messages and sections
that had drifted).

    .venv/bin/python -m pytest -q tests/test_docs_references.py

Each `--flag` is one a parser defines; the trainer's flag table gives each field's
real default, and so does a number given as a flag's default in prose; the resume section names what a resume refuses and what may change as
`fanout.train.config.RESUME_MAY_CHANGE` has it; README's documentation table lists
every page; each `FANOUT_*` variable is read somewhere; each test, benchmark and script
named exists; each section one page points another to is there.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re

from conftest import repo_module
from test_docs_match_code import DOCS, REPO, _section

# Flags the docs show for tools other than fanout's parsers (dev.sh's, pip's, torchrun's,
# Slurm's, kubectl's, vLLM's, speculators' trainer): each must still be in a page.
OTHER_TOOLS_FLAGS = {
    "--loaded": "./dev.sh test --loaded",
    "--extra-index-url": "pip", "--no-deps": "pip", "--local-dir": "huggingface-cli",
    "--standalone": "torchrun", "--nnodes": "torchrun", "--nproc-per-node": "torchrun",
    "--max-restarts": "torchrun", "--rdzv-endpoint": "torchrun",
    "--job-name": "sbatch", "--nodes": "sbatch/srun", "--ntasks-per-node": "sbatch",
    "--gpus-per-node": "sbatch", "--time": "sbatch", "--output": "sbatch",
    "--ntasks": "srun", "--nodelist": "srun", "--overlap": "srun",
    "--from-literal": "kubectl", "--speculative-config": "vllm serve",
    "--speculator-type": "speculators' trainer", "--ce-from-data": "speculators' trainer",
    "--dflash-decay-gamma": "speculators' trainer", "--loss-fn": "speculators' trainer",
}  # fmt: skip


def _subparser(name: str) -> argparse.ArgumentParser:
    from fanout import cli

    parser = cli.build_parser([name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _command_actions() -> list[argparse.Action]:
    """The options of every `fanout` command and of `python -m fanout.chaos`."""
    from fanout import cli
    from fanout.chaos.__main__ import build_parser

    actions = list(build_parser()._actions)
    for name in cli.COMMANDS:
        actions += _subparser(name)._actions
    return actions


def _parser_flags() -> set[str]:
    """Every option string fanout's own parsers define: each command's, the chaos
    driver's, and each `add_argument` of the scripts under benchmarks/ and scripts/."""
    flags = {s for a in _command_actions() for s in a.option_strings}
    for f in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {str(a.value) for a in node.args if isinstance(a, ast.Constant)}
    return {f for f in flags if f.startswith("--")}


def test_every_flag_the_docs_name_is_a_flag_of_what_they_run() -> None:
    """README.md and docs/*.md: each `--flag` is one a fanout command, `python -m
    fanout.chaos`, a benchmark or a script defines (a renamed or removed flag fails
    here), or one of OTHER_TOOLS_FLAGS, the tools a page shows beside fanout."""
    known = _parser_flags()
    assert {"--capture-layer-ids", "--draft-layer-ids", "--kills", "--repeats"} <= known
    bad, seen = [], set()
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*", text):
            flag = m.group(0)
            if flag in OTHER_TOOLS_FLAGS:
                seen.add(flag)
            elif flag not in known:
                bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {flag}")
    assert bad == [], "\n".join(bad)
    assert set(OTHER_TOOLS_FLAGS) - seen == set(), "entries no page mentions any more"
    assert '"${1:-}" = --loaded' in (REPO / "dev.sh").read_text()


def test_the_training_flag_table_has_every_trainer_flag_with_its_default() -> None:
    """docs/training.md "## Flags": a row per `fanout train` field (a family's own
    options are listed under "Draft families"), each row's default the field's."""
    from fanout.families.registry import FamilyOptions
    from fanout.flags import field_aliases, field_flag
    from fanout.train.config import TrainConfig

    fields = TrainConfig.model_fields
    field_of = {field_flag(n, f): n for n, f in fields.items()}
    field_of |= {a: n for n, f in fields.items() for a in field_aliases(f)}
    table = _section((REPO / "docs" / "training.md").read_text(), "## Flags")
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`[^|]*\| ([^|]+?) \|", table, re.M)
    bad, listed = [], set()
    for flag, default in rows:
        name = field_of.get(flag)
        if name is None:
            bad.append(f"{flag}: not a fanout train flag")
            continue
        listed.add(name)
        f = fields[name]
        real = "required" if f.is_required() else f"`{f.default!r}`"
        if default != real:
            bad.append(f"{flag}: the table says {default}, the field's default is {real}")
    own = set(FamilyOptions.model_fields) - {"draft_family"}
    missing = sorted(field_flag(n, fields[n]) for n in set(fields) - own - listed)
    assert bad == [] and missing == [], (bad, missing)
    assert len(rows) > 40  # the table was found


def test_the_resume_section_names_what_a_resume_refuses_and_what_may_change() -> None:
    """docs/training.md "## Resuming": every flag its refused list names is checked
    against the checkpoint (not in RESUME_MAY_CHANGE), every flag its may-change list
    names is in RESUME_MAY_CHANGE, and each field of RESUME_MAY_CHANGE is named there or
    belongs to the groups the sentence names (checkpointing, logging, eval flags)."""
    from fanout.flags import field_flag
    from fanout.train.config import RESUME_MAY_CHANGE, TrainConfig

    field_of = {field_flag(n, f): n for n, f in TrainConfig.model_fields.items()}
    text = " ".join(_section((REPO / "docs" / "training.md").read_text(), "## Resuming").split())
    refused = text.split("A flag that changes what the next step computes", 1)[1]
    refused = refused.split("is refused", 1)[0]
    may = text.split("These may change", 1)[1].split("A checkpoint written before", 1)[0]
    named_refused = {field_of[f] for f in re.findall(r"`(--[a-z0-9-]+)`", refused)}
    named_may = {field_of[f] for f in re.findall(r"`(--[a-z0-9-]+)`", may)}
    assert {"seed", "rows_per_step", "lr"} <= named_refused
    assert named_refused & RESUME_MAY_CHANGE == set()
    assert named_may - RESUME_MAY_CHANGE == set()
    groups = ("checkpoint", "keep_checkpoints", "log", "wandb", "progress", "eval", "resume")
    unnamed = {n for n in RESUME_MAY_CHANGE - named_may if not n.startswith(groups)}
    assert unnamed == set(), "name these in the may-change sentence"


def test_the_readme_documentation_table_lists_every_page() -> None:
    """README.md "## Documentation": one row per docs/*.md, and no row for a page that
    is gone."""
    table = _section((REPO / "README.md").read_text(), "## Documentation")
    listed = set(re.findall(r"^\| `(docs/[\w-]+\.md)` \|", table, re.M))
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert listed == pages, (sorted(pages - listed), sorted(listed - pages))


def test_every_environment_variable_the_docs_name_is_read_somewhere() -> None:
    """Each `FANOUT_*` variable README.md and docs/*.md name is read: a string constant
    of exactly that name in a Python file (`os.environ.get("FANOUT_WORKERS")`), or the
    name on a code line (not a comment) of one of the shell scripts."""
    names = {n for p in DOCS for n in re.findall(r"\bFANOUT_[A-Z0-9_]+\b", p.read_text())}
    assert {"FANOUT_CACHE", "FANOUT_STALE_VIEW_S"} <= names
    consts: set[str] = set()
    for d in ("src", "scripts", "benchmarks", "tests"):
        for f in (REPO / d).rglob("*.py"):
            consts |= {
                n.value
                for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
    scripts = [REPO / "dev.sh", REPO / ".ci" / "run", *(REPO / "scripts").glob("*.sh"),
               *(REPO / "benchmarks").rglob("*.sh")]  # fmt: skip
    code = "\n".join(
        line for s in scripts for line in s.read_text().splitlines()
        if not line.lstrip().startswith("#")
    )  # fmt: skip
    unread = sorted(n for n in names if n not in consts and not re.search(rf"\b{n}\b", code))
    assert unread == []


def test_every_test_benchmark_and_script_the_docs_name_exists() -> None:
    """README.md and docs/*.md: each `tests/…`, `benchmarks/…` or `scripts/…` file
    (`.py`, `.sh`; a `<placeholder>` part matches any name) exists, and each `test_…`
    they name is a test module (`test_contract`), a benchmark (`test_suite`) or a test
    function defined under tests/ (`test_a_killed_producer_leaves_no_template_build_running`)."""
    defined = {
        m for f in (REPO / "tests").glob("*.py")
        for m in re.findall(r"^(?:async )?def (test_\w+)\(", f.read_text(), re.M)
    }  # fmt: skip
    bad = []
    for path in DOCS:
        text = path.read_text()
        for p in re.findall(r"\b((?:tests|benchmarks|scripts)/[\w./<>-]+\.(?:py|sh))\b", text):
            if not any(REPO.glob(re.sub(r"<[^>/]+>", "*", p))):
                bad.append(f"{path.name}: {p}")
        for name in set(re.findall(r"\b(test_\w*[a-z0-9])\b", text)):
            found = [REPO / "tests" / f"{name}.py", REPO / "benchmarks" / f"{name}.py"]
            if name not in defined and not any(f.is_file() for f in found):
                bad.append(f"{path.name}: {name}")
    assert bad == [], "\n".join(sorted(bad))


def test_every_section_a_page_points_to_is_there() -> None:
    """`docs/x.md, "Section"` (or `(docs/x.md "Section")`) names a heading or a bold
    paragraph title of that page, and `docs/numbers.md, stage S` one of its stages: a
    renamed section fails here instead of sending the reader nowhere."""
    titles = {}
    for p in DOCS:
        text = p.read_text().replace("`", "")
        titles[p.name] = re.findall(r"^#+ (.+?)\s*$", text, re.M)
        titles[p.name] += re.findall(r"^(?:\s*- )?\*\*(.+?)\*\*", text, re.M)  # a bold lead
    stages = set(re.findall(r"^## (\S+)$", (REPO / "docs" / "numbers.md").read_text(), re.M))
    assert {"data", "fan-out", "start-up"} <= stages
    bad = []
    for p in DOCS:
        text = " ".join(p.read_text().split())
        refs = re.finditer(r"`?(?:docs/)?([\w-]+\.md)`?,? \(?\"([^\"]+)\"", text)
        for m in refs:
            page, section = m.group(1), m.group(2).replace("`", "").rstrip(".,")
            if page not in titles:
                continue  # a file of another kind (README.md of a test data folder)
            if not any(t == section or t.startswith(section) for t in titles[page]):
                bad.append(f"{p.name}: {page} {section!r}")
        for m in re.finditer(r"numbers\.md`?,? \(?stage ([\w-]+)", text):
            if m.group(1) not in stages:
                bad.append(f"{p.name}: numbers.md stage {m.group(1)}")
    assert bad == [], "\n".join(bad)


def test_a_number_the_docs_give_as_a_flags_default_is_its_default() -> None:
    """ "`--lookahead` open rows (default 64)", "`--follow-flush-s S` (default 15)": a
    number the docs give as a fanout flag's default is that flag's default in a command
    that takes it."""
    from fanout.decode.config import PromoteConfig
    from fanout.flags import field_aliases, field_flag

    models = [PromoteConfig]
    for ref in repo_module("scripts", "docs").CONFIGS.values():  # every command's config
        module, cls = ref.split(":")
        models.append(getattr(importlib.import_module(module), cls))
    defaults: dict[str, set[float]] = {}
    for model in models:
        for name, f in model.model_fields.items():
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                for flag in (field_flag(name, f), *field_aliases(f)):
                    defaults.setdefault(flag, set()).add(float(f.default))
    pattern = r"`(--[a-z0-9-]+)(?: [A-Z]+)?`[^.;`]{0,30}\(default:? ([0-9][0-9.]*)\b"
    seen, bad = 0, []
    for path in DOCS:
        for flag, value in re.findall(pattern, " ".join(path.read_text().split())):
            if flag in defaults:
                seen += 1
                if float(value) not in defaults[flag]:
                    bad.append(f"{path.name}: {flag} default {value}, code {defaults[flag]}")
    assert bad == [] and seen >= 4, (bad, seen)
