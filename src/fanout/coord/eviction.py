"""Eviction's file side and the sweep: the coordinator's part that removes window files.

    ev = Eviction(run)                 # a part of fanout.coord.coordinator.Coordinator
    with run.write() as cur:
        doomed = ev.mark(cur)           # rows marked 'evicting' (fanout.coord.retention's rules)
    ev.finish(doomed)                    # unlink each file, then mark its row 'evicted'

Which windows may go is fanout.coord.retention's (pure rules over the tables);
this part applies them and touches the files, through the run's store
(fanout.store.store.Store, imported lazily: `fanout status` pays no torch).
"""

from __future__ import annotations

from typing import Any

from fanout.coord.core import RunDb
from fanout.coord.retention import (
    Doomed,
    file_wanted,
    finish_evicted_statements,
    mark_evictable,
)
from fanout.coord.schema import Sql


class Eviction:
    """The coordinator's eviction: the file side of the rules above, and the sweep."""

    def __init__(self, run: RunDb) -> None:
        self.run = run

    def finish(self, doomed: Doomed) -> None:
        """File first (unlink), then row (evicted): a row never names a missing ready file."""
        if not doomed:
            return
        for _, name in doomed:
            if name:
                self.run.store.remove(name)
        self.run.batch(finish_evicted_statements([w for w, _ in doomed]))

    def mark(self, cur: Sql, recover: bool = False) -> Doomed:
        """Mark what is evictable now, inside the caller's transaction; pass the result
        to `finish` after it commits. `recover`: also the rows a crashed process left
        'evicting'."""
        return mark_evictable(cur, self.run.config.expected_consumers, recover)

    def evict(self) -> int:
        """Evict every evictable window now (also done by ack and the producer's wait),
        and finish evictions a crashed process left half done."""
        with self.run.write() as cur:
            doomed = self.mark(cur, recover=True)
        self.finish(doomed)
        return len(doomed)

    def wants_file(self, window: int, generation: int) -> bool:
        """For the sweeper: is window `window` generation `generation` ready or being
        captured (retention.file_wanted), so that its file must stay?"""
        return file_wanted(self.run.conn, window, generation)

    def sweep(self) -> Any:
        """Finish interrupted evictions, then let the store remove debris and orphans."""
        self.evict()
        return self.run.store.sweep(self.wants_file)
