"""The run directory's layout: every path a fanout process reads or writes in a run dir.

    from fanout.store.rundir import RunDir
    rd = RunDir("runs/demo").create()      # windows/, tmp/, quarantine/, telemetry/, logs/
    rd.windows / name; rd.stream_info; rd.database; rd.start_lock(rank=1)

One home for the layout (DESIGN.md "Run directory"): the producer, the coordinator,
the trainers, the chaos driver and the benchmarks name a run dir's files through
these properties, never by spelling a name again. Free of torch (fanout status,
the coordinator and the data workers import it).

    windows/<w>.g<gen>.safetensors   window files (fanout.store.store)
    tmp/ quarantine/                 publish temp files; corrupt files kept for a look
    telemetry/ logs/                 samplers' and roles' output (benchmarks, chaos)
    contract.json                    the capture contract (fanout.contract)
    stream.json                      the stream's plan (fanout.store.streaminfo.StreamInfo)
    token_counts.safetensors         loss-masked token counts (fanout.data.draft_vocab)
    coordinator.sqlite3[-wal|-shm]   the coordinator database (SQLite, the default)
    coordinator.dbpath               where it is instead (--db-path)
    producer.lock, producer.r<i>.lock   a producer (replica i) starting up
    producer.join.lock               a replica creating or joining the run's database
    cache/ regen/                    the data stage's cache; --regenerate's output
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fanout.filesystem import FileSystem

DB_NAME = "coordinator.sqlite3"
DB_POINTER = "coordinator.dbpath"  # written when --db-path puts the database elsewhere


@dataclass(frozen=True)
class RunDir:
    """Layout of a run directory (see the module docstring and DESIGN.md)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def contract(self) -> Path:
        return self.root / "contract.json"

    @property
    def windows(self) -> Path:
        return self.root / "windows"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def telemetry(self) -> Path:
        return self.root / "telemetry"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def cache(self) -> Path:
        """The data stage's cache when no --cache-dir is given."""
        return self.root / "cache"

    @property
    def regen(self) -> Path:
        """`fanout produce --regenerate`'s regeneration directory."""
        return self.root / "regen"

    @property
    def follow(self) -> Path:
        """`fanout produce --follow`'s chunks, held-out set and drift records."""
        return self.root / "follow"

    @property
    def heldout(self) -> Path:
        """The newest held-out conversations of a followed source (fanout.produce.follow)."""
        return self.follow / "heldout.jsonl"

    @property
    def drift(self) -> Path:
        """The served draft's τ on recent held-out slices (`fanout promote --run-dir`;
        fanout.decode.promote spells the same path, from below this layer)."""
        return self.follow / "drift.jsonl"

    @property
    def stream_info(self) -> Path:
        return self.root / "stream.json"

    @property
    def token_counts(self) -> Path:
        return self.root / "token_counts.safetensors"

    @property
    def database(self) -> Path:
        """The SQLite database when no --db-path is given."""
        return self.root / DB_NAME

    @property
    def db_pointer(self) -> Path:
        """Where the database is, when --db-path put it elsewhere (written at create)."""
        return self.root / DB_POINTER

    def start_lock(self, rank: int = 0) -> Path:
        """Held by a producer (replica `rank`) from its first look at the run dir until it
        has registered (fanout.produce.run_start). Rank 0's keeps the name of the
        one-producer runs."""
        return self.root / ("producer.lock" if rank == 0 else f"producer.r{rank}.lock")

    @property
    def join_lock(self) -> Path:
        """Held briefly by a replica that creates or joins the run's database (and by a
        failed start that removes what it made), so that replicas started together find
        one run (fanout.produce.run_start)."""
        return self.root / "producer.join.lock"

    def producer_names(self) -> tuple[str, ...]:
        """The names a producer may create here: the only ones a producer that failed
        before its first window removes, and only those that were not there before (its
        lock files aside: fanout.produce.run_start removes those itself; regen/ is kept, a
        regeneration costs verifier time)."""
        return tuple(
            p.name
            for p in (
                self.windows, self.tmp, self.quarantine, self.telemetry, self.logs, self.cache,
                self.contract, self.stream_info, self.token_counts, self.database,
                self.root / f"{DB_NAME}-wal", self.root / f"{DB_NAME}-shm", self.db_pointer,
            )
        )  # fmt: skip

    def create(self, fs: FileSystem | None = None) -> RunDir:
        """mkdir -p the root and every subdirectory; returns self."""
        fs = fs or FileSystem()
        for d in (self.windows, self.tmp, self.quarantine, self.telemetry, self.logs):
            fs.makedirs(d)
        return self
