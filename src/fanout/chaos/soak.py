"""Chaos that lasts what it says: rounds of ChaosRun until the kill count or the duration.

    from fanout.chaos.soak import run_rounds
    rep = run_rounds(ChaosConfig(work_dir="runs/soak", minutes=10, conversations=4000))
    assert not rep.problems() and rep.killing_s >= 600

One ChaosRun ends when its stream does. How many kills fit before that depends on the
machine's speed: on an idle one the stream ended in under 4 of a soak's 10 minutes
(168 kills, every promise kept), so a soak sized for a loaded machine failed its own
floor on a fast one. Here the stream is looped instead: a round that ended short of
the goal (`kills` kills, or `minutes` of killing) is followed by another on a fresh
run (`work_dir/round-N`, same assets, its own coordinator database, another kill
seed) whose goal is what is left, until the goal is met. So a soak kills for its
whole duration on any machine, and every round is checked on its own
(`ChaosReport.problems`). The SoakReport adds up what was checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from fanout.chaos.checks import ChaosReport
from fanout.chaos.driver import ChaosConfig, ChaosRun, role_names
from fanout.chaos.procs import ChaosAssets, build_assets

# Between two kills the driver waits kill_every_s (0.5-1.5 s), plus 0.1 s for each role
# whose turn is skipped (not running, or younger than min_age_s, 1 s): a kill every 3 s
# at the least while roles run, on an idle machine or a loaded one.
MAX_KILL_GAP_S = 3.0


@dataclass
class SoakReport:
    """Every round's report, and the sums a caller checks."""

    rounds: list[ChaosReport] = field(default_factory=list)

    @property
    def killing_s(self) -> float:
        # each round's figure is rounded to 0.1 s: so is the sum (420.3 + 179.7 is
        # 599.999…, which would start a round of 1e-13 minutes and miss a 600 s goal)
        return round(sum(r.killing_s for r in self.rounds), 1)

    @property
    def elapsed_s(self) -> float:
        return sum(r.elapsed_s for r in self.rounds)

    @property
    def total_kills(self) -> int:
        return sum(r.total_kills for r in self.rounds)

    @property
    def kills(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rounds:
            for name, n in r.kills.items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def unexpected_exits(self) -> dict[str, list[int]]:
        return {f"round {i} {k}": v for i, r in enumerate(self.rounds) for k, v in r.unexpected_exits.items()}  # fmt: skip

    def total(self, name: str) -> int:
        """A count summed over rounds: total_windows, rows_checked, samples, cli_samples,
        files_verified."""
        return sum(int(getattr(r, name)) for r in self.rounds)

    @property
    def max_live(self) -> int:
        return max((r.max_live for r in self.rounds), default=0)

    def every_consumer_read_every_window(self) -> bool:
        return all(c["windows"] == r.total_windows for r in self.rounds for c in r.covers.values())

    def problems(self) -> list[str]:
        out = [f"round {i}: {p}" for i, r in enumerate(self.rounds) for p in r.problems()]
        return out or ([] if self.rounds else ["no round ran"])

    def summary(self) -> str:
        return (
            f"rounds={len(self.rounds)} kills={self.kills} (total {self.total_kills}) "
            f"killing={self.killing_s:.0f}s windows={self.total('total_windows')} "
            f"rows={self.total('rows_checked')} samples={self.total('samples')}+"
            f"{self.total('cli_samples')} files_verified={self.total('files_verified')} "
            f"max_live={self.max_live} elapsed={self.elapsed_s:.0f}s"
        )


def round_db(db_path: str | None, i: int) -> str | None:
    """Round i's coordinator database: round 0 uses `db_path`; later rounds a PostgreSQL
    schema (`schema` + `_r<i>`) or SQLite file (`.r<i>`) of their own."""
    if db_path is None or i == 0:
        return db_path
    if not db_path.startswith(("postgresql://", "postgres://")):
        return f"{db_path}.r{i}"
    u = urlsplit(db_path)
    q = dict(parse_qsl(u.query))
    q["schema"] = f"{q.get('schema', 'fanout')}_r{i}"
    return urlunsplit(u._replace(query=urlencode(q)))


def run_rounds(cfg: ChaosConfig, assets: ChaosAssets | None = None) -> SoakReport:
    """ChaosRun rounds until `cfg.kills` kills or `cfg.minutes` of killing (module
    docstring). A kill-count goal also holds every role to its share, `cfg.kills` // the
    number of roles: a round that ended while a role was restarting, or after a trainer
    finished, leaves that role short, and the next round owes it those kills (each
    round's victim choice counts the earlier rounds' kills). Round 0 runs in
    `cfg.work_dir`, round i > 0 in `work_dir/round-i`."""
    work = Path(cfg.work_dir)
    assets = assets or build_assets(work / "assets", cfg.conversations)
    rep = SoakReport()
    roles = role_names(cfg)
    share = 0 if cfg.minutes is not None else cfg.kills // len(roles)
    for i in range(1000):
        owed = sum(max(share - rep.kills.get(r, 0), 0) for r in roles)
        left_kills = max(cfg.kills - rep.total_kills, owed)
        left_s = None if cfg.minutes is None else cfg.minutes * 60 - rep.killing_s
        if rep.rounds and (left_kills <= 0 if left_s is None else left_s <= 0):
            break
        if rep.rounds and (rep.problems() or rep.rounds[-1].total_kills == 0):
            break  # a broken round ends the soak; so does one that could not kill at all
        rcfg = cfg.model_copy(
            update={
                "work_dir": str(work if i == 0 else work / f"round-{i}"),
                "kills": left_kills,
                "minutes": None if left_s is None else left_s / 60,
                "seed": cfg.seed + i,
                "db_path": round_db(cfg.db_path, i),
            }
        )
        rep.rounds.append(ChaosRun(rcfg, assets, prior_kills=rep.kills).run())
    return rep


__all__ = ["MAX_KILL_GAP_S", "SoakReport", "round_db", "run_rounds"]
