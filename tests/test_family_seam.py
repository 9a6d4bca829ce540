"""The family seam holds: outside `src/fanout/families/`, no code names a family other
than the default one, so adding a family is its folder and its registry line (the demo,
benchmarks/families.py, --capture-for and --draft-family read the registry)."""

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
    # "dflash" is the default family and the name of the shared backbone module
    # (fanout.model.dflash), so it is expected everywhere; the others are not.
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
