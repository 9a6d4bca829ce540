"""The window state machine (fanout.coord.states) on both databases, and its one home.

pytest tests/test_states.py -q
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from fanout.coord import schema, states
from fanout.coord.states import TRANSITIONS, W
from fanout.errors import IllegalTransition
from test_coordinator import new_run

SRC = Path(__file__).parents[1] / "src" / "fanout"


def test_every_move_on_both_databases(tmp_path: Path, db: str | None) -> None:
    """Each of the 36 (from, to) pairs: a move in TRANSITIONS happens; any other raises
    IllegalTransition and leaves the row as it was, on SQLite and PostgreSQL."""
    co, _, _ = new_run(tmp_path, db)
    pairs = list(itertools.product(W, W))
    with co.conn.write() as cur:
        for i, (src, _) in enumerate(pairs):
            states.insert_queued(cur, i, demand=False)
            cur.execute("UPDATE windows SET state=? WHERE window=?", (src.value, i))  # setup
    for i, (src, dst) in enumerate(pairs):
        legal = (src, dst) in TRANSITIONS
        with co.conn.write() as cur:
            if legal:
                assert states.move(cur, src, dst, "window=?", (i,)) == 1
            else:
                with pytest.raises(IllegalTransition, match=f"{src.value} → {dst.value}"):
                    states.move(cur, src, dst, "window=?", (i,))
        got = co.conn.execute("SELECT state FROM windows WHERE window=?", (i,)).fetchone()[0]
        assert got == (dst if legal else src).value, (src, dst)
    co.close()


def test_a_move_that_lost_a_race_changes_nothing(tmp_path: Path, db: str | None) -> None:
    """`move` touches only rows in its source states: publishing a window another call
    already requeued moves nothing (the caller sees 0 rows)."""
    co, _, _ = new_run(tmp_path, db)
    with co.conn.write() as cur:
        states.insert_queued(cur, 0, demand=True)
        assert states.move(cur, W.CAPTURING, W.READY, "window=?", (0,)) == 0
    assert co.conn.execute("SELECT state, demand FROM windows").fetchall() == [("queued", 1)]
    co.close()


def test_the_table_and_the_named_sets_agree() -> None:
    assert states.check([W.READY, W.EVICTED], W.QUEUED) == (W.READY, W.EVICTED)
    with pytest.raises(IllegalTransition):
        states.check((), W.QUEUED)  # a move from nothing is a bug too
    # no move leaves a terminal state; every state but 'failed' can be left
    sources = {s for s, _ in TRANSITIONS}
    assert set(W) - sources == set(states.TERMINAL)
    # every state is reachable from queued, the only state a row is born in
    reach, todo = {W.QUEUED}, [W.QUEUED]
    while todo:
        s = todo.pop()
        for a, b in TRANSITIONS:
            if a == s and b not in reach:
                reach.add(b)
                todo.append(b)
    assert reach == set(W)
    assert set(states.READABLE) <= set(states.WANTED_FILE) <= set(states.LIVE)
    assert set(states.ON_DISK) <= set(states.LIVE) and W.QUEUED not in states.LIVE


def test_schema_check_lists_exactly_the_states(tmp_path: Path, db: str | None) -> None:
    co, _, _ = new_run(tmp_path, db)
    ddl = next(s for s in schema.statements(co.conn.dialect) if "TABLE windows(" in s)
    listed = re.search(r"state\s+TEXT NOT NULL CHECK \(state IN \(([^)]*)\)\)", ddl)
    assert listed is not None and listed.group(1).replace("'", "").split(",") == list(W)
    with co.conn.write() as cur:
        states.insert_queued(cur, 0, demand=False)
    with pytest.raises(Exception, match=r"(?i)check"), co.conn.write() as cur:
        cur.execute("UPDATE windows SET state='gone' WHERE window=0")  # a 7th state: refused
    assert co.conn.execute("SELECT state FROM windows").fetchall() == [("queued",)]
    co.close()


def test_only_states_writes_the_state_column() -> None:
    """One home for the rule: no statement outside coord/states.py sets windows.state,
    inserts a window row or deletes one, and no module spells a window state in SQL."""
    writes = re.compile(
        r"UPDATE windows SET[^\"']*\bstate\s*=|INSERT INTO windows\b|DELETE FROM windows\b"
    )
    literal = re.compile(r"state\s*(=|IN)\s*\(?'(" + "|".join(W) + r")'")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "states.py" or path.name == "schema.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(SRC)}: {m.group(0)}" for m in writes.finditer(text)]
        found += [f"{path.relative_to(SRC)}: {m.group(0)}" for m in literal.finditer(text)]
    assert found == []


def test_role_states_have_one_home() -> None:
    """The consumers' and producer replicas' states (RoleState) are spelled in coord/
    states.py alone: no module outside it writes one as a literal, in SQL or as a
    Python string compared or stored (issue #34); the schema's CHECKs list them from
    there."""
    names = "|".join(s.value for s in states.RoleState)
    sql = re.compile(r"state\s*(=|IN|<>)\s*\(?'(" + names + r")'")
    py = re.compile(r"(==|!=|\bin|return|=)\s*[(\[{]?\s*\"(" + names + r")\"")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "states.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(SRC)}: {m.group(0)}" for m in sql.finditer(text)]
        found += [f"{path.relative_to(SRC)}: {m.group(0)}" for m in py.finditer(text)]
    assert found == []
    for dialect in ("sqlite", "postgres"):
        ddl = " ".join(schema.statements(dialect))
        assert states.sql_in(states.CONSUMER_STATES) in ddl
        assert states.sql_in(states.PRODUCER_STATES) in ddl
