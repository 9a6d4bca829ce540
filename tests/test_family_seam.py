"""The family seam holds: outside `src/fanout/families/`, no code names a family other
than the default one, and no family's folder imports another's, so adding a family is
its folder and its registry line (the demo, benchmarks/families.py, --capture-for and
--draft-family read the registry; tests/test_family_newcomer.py counts it)."""

from __future__ import annotations

import ast
from pathlib import Path

from fanout.families.registry import FAMILIES

SRC = Path(__file__).resolve().parents[1] / "src" / "fanout"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_no_code_outside_families_names_a_family() -> None:
    # "dflash" is the default family (--draft-family's default, the speculators model
    # type a checkpoint without one has), so it is expected; the others are not.
    others = set(FAMILIES) - {"dflash"}
    assert others, "the registry lists the other families"
    hits = [
        f"{p.relative_to(SRC)}:{line}: {value!r}"
        for p in sorted(SRC.rglob("*.py"))
        if "families" not in p.relative_to(SRC).parts
        for line, value in _string_constants(p)
        if value in others
    ]
    assert hits == [], "a family named outside its folder:\n" + "\n".join(hits)


def test_every_family_folder_is_registered() -> None:
    folders = {p.parent.name for p in (SRC / "families").glob("*/__init__.py") if p.parent.name}
    assert folders == set(FAMILIES)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            found += [(n.lineno, n.module)] + [(n.lineno, f"{n.module}.{a.name}") for a in n.names]
        elif isinstance(n, ast.Import):
            found += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and ":" in n.value:
            found.append((n.lineno, n.value.split(":")[0]))  # a model_ref "module:Class"
    return found


def test_no_family_imports_another_familys_folder() -> None:
    """A family's parts need no other family's class: each is built on the shared parts
    (fanout.model, fanout.ops, families/base, serving, numbering)."""
    hits = []
    for name in FAMILIES:
        for p in sorted((SRC / "families" / name).rglob("*.py")):
            for line, mod in _imported_modules(p):
                parts = mod.split(".")
                if parts[:2] == ["fanout", "families"] and len(parts) > 2:
                    other = parts[2]
                    if other in FAMILIES and other != name:
                        hits.append(f"{p.relative_to(SRC)}:{line}: {mod}")
    assert hits == [], "a family imports another's folder:\n" + "\n".join(hits)
