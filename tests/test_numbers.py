"""Numbers generated from runs, never typed (issue 35.1).

    .venv/bin/pytest tests/test_numbers.py -q

Every JSON in benchmarks/results/ is a complete record (benchmarks/record.py: benchmark,
commit, date, hardware, load before and after, rows with sample size and spread);
docs/numbers.md and the README's headline table are exactly what benchmarks/report.py
makes of them; the plots they show exist; and no numbers section of the README or of a
docs page holds a figure that the generated tables do not have (a hand-typed or stale
number fails here, naming the file and the figure).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

from conftest import repo_module

REPO = Path(__file__).resolve().parents[1]
# A measured figure: a decimal, a ratio (2×) or a percentage. Plain integers (sizes,
# counts, K = 4) and dimensions (512 × 8) are configuration as often as results, and code
# (`--lr 3e-4`, a JSON key "0.0") is not prose, so none of those is read as a figure.
FIGURE = re.compile(r"(?<![\w.\-])\d+(?:,\d{3})*\.\d+(?![\w.])|\b\d+(?:\.\d+)?[×%]")
CODE = re.compile(r"```.*?```|`[^`\n]*`|^    .*$", re.S | re.M)
# Headings of the sections that report measurements.
NUMBERS_HEADING = re.compile(r"^(#{2,6}) .*\b(numbers|results?|measured|benchmarks?)\b", re.I)


def _report() -> ModuleType:
    return repo_module("benchmarks", "report")


def test_every_result_is_a_complete_record() -> None:
    report = _report()
    records = report.load()
    assert records, "benchmarks/results/ holds no JSON"
    assert report.problems(records) == []
    for fname, rec in records:  # the commit is a real one of this repository's form
        assert re.fullmatch(r"[0-9a-f]{40}", rec["commit"]), fname
        for row in rec["rows"]:
            assert row["n"] is None or row["n"] >= 1, (fname, row["name"])


def test_numbers_md_and_the_readme_table_are_generated_from_the_results() -> None:
    report = _report()
    records = report.load()
    assert report.NUMBERS.read_text() == report.numbers_md(records), (
        "docs/numbers.md is not what the results make: run python benchmarks/report.py"
    )
    readme = report.README.read_text()
    assert report.readme_with(readme, report.headline(records)) == readme, (
        "README's headline table is stale: run python benchmarks/report.py"
    )
    rows = re.findall(r"^\| (?!what|---)", report.headline(records), re.M)
    assert 1 <= len(rows) <= len(report.HEADLINE)
    for _, rec in records:
        for plot in rec.get("plots") or []:
            assert (report.PLOTS / report.plot_name(rec, plot)).is_file(), plot["name"]


def _numbers_sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each numbers section (its subsections included)."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = NUMBERS_HEADING.match(line)
        if not m:
            continue
        body = []
        for nxt in lines[i + 1 :]:
            h = re.match(r"^(#{1,6}) ", nxt)
            if h and len(h.group(1)) <= len(m.group(1)):
                break
            body.append(nxt)
        out.append((line, "\n".join(body)))
    return out


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_numbers_sections_hold_only_generated_figures() -> None:
    """A figure in a numbers section of the README or a docs page (docs/numbers.md
    included) must be one the generated tables print: a JSON is behind it."""
    report = _report()
    generated = report.numbers_md(report.load())
    known = set(FIGURE.findall(generated))
    bad = []
    for page in _pages():
        for heading, body in _numbers_sections(page.read_text()):
            for fig in FIGURE.findall(CODE.sub("", body)):
                if fig not in known:
                    bad.append(f"{page.relative_to(REPO)} {heading!r}: {fig}")
    assert bad == [], "figures with no JSON behind them (rerun the benchmark, or drop them)"


def test_the_figure_rule_catches_a_typed_number(tmp_path: Path) -> None:
    """The check above can fail: a typed ratio in a numbers section is found, a version
    number or a plain count is not."""
    page = (
        "# P\n\n## Numbers\n\npublish vs raw 1.47, 2× faster, 95% of it; Python 3.11.7, "
        "30 kills, h 512 × 8 layers, `--lr 0.5`\n"
    )
    ((heading, body),) = _numbers_sections(page)
    assert heading == "## Numbers"
    assert FIGURE.findall(CODE.sub("", body)) == ["1.47", "2×", "95%"]
    assert _numbers_sections("## Layer numbering\n\n1.5\n") == []


def test_a_record_without_a_commit_is_refused(tmp_path: Path) -> None:
    report = _report()
    good = next(p for p in sorted(report.RESULTS.rglob("*.json")))
    rec = json.loads(good.read_text())
    (tmp_path / "x.json").write_text(json.dumps({k: v for k, v in rec.items() if k != "commit"}))
    (tmp_path / "y.json").write_text(json.dumps({"benchmark": "y", "speedup": 2.0}))
    problems = report.problems(report.load(tmp_path))
    assert any("x.json: no 'commit'" in p for p in problems), problems
    assert any("y.json: not written by record.Recorder" in p for p in problems), problems
    y = dict(report.load(tmp_path))["y.json"]  # the fallback still shows it, flagged
    assert y["not_a_record"] and [(r["name"], r["result"]) for r in y["rows"]] == [("speedup", 2.0)]


def test_every_figure_names_the_cpu_it_came_from() -> None:
    """Each row of docs/numbers.md names its run's CPU (issue #56: a ratio measured on a
    Xeon did not hold on an EPYC, so no figure may read as another CPU kind's)."""
    report = _report()
    records = report.load()
    table = [
        line
        for line in report.numbers_md(records).splitlines()
        if line.startswith("| ") and not line.startswith(("| what", "|---"))
    ]
    assert table
    for line in table:
        run = line.rstrip(" |").rsplit(" | ", 1)[1]
        assert re.fullmatch(r"\[\d+\] .+", run), line
        assert any(run.endswith(report.machine(rec)) for _, rec in records), line


def test_a_record_names_the_cpu_its_vector_extensions_and_the_torch_build() -> None:
    from fanout.bench.report import hardware

    hw = hardware()
    assert hw["cpu"] and isinstance(hw["cpu_vector_extensions"], list)
    assert hw["torch"] and hw["torch_cpu_capability"]
    report = _report()
    assert "vector extensions not recorded" in report._hardware({"hardware": {"cpu": "X"}})
    full = {"cpu": "X", "cpu_vector_extensions": ["avx2", "avx512f", "amx_tile"],
            "torch": "2.13.0", "torch_cpu_capability": "AVX512"}  # fmt: skip
    assert "X (AVX-512, AMX; torch 2.13.0 kernels AVX512)" in report._hardware({"hardware": full})
