"""How full a followed stream's rows are at a trickle of traffic, before and after #52's carry.

    .venv/bin/python benchmarks/follow_packing.py --json benchmarks/results/follow_packing.json
    .venv/bin/python benchmarks/follow_packing.py --records 120 --flush-s 5 60

Run from the repository root; ≈ 3 minutes at the defaults on two loaded cores. One run,
both rules, on the real follower (fanout.produce.follow.FollowStream: its reader, chunk
files, data stage and packer) over a log that gains one chat every `--every-s` seconds
of a simulated clock (the stream's clock seam), polled every half second of it:
- `before`: each chunk packed alone, cut once its oldest record waited
  `--follow-flush-s` (the rule before #52; made here by setting the module's FULL_FILL
  to 0 and CUT_SHARE to 1);
- `after`: the follower as it is: chunks cut at a quarter of the bound, rows under 95 %
  real tokens carried into the next chunk until their oldest record waited three
  quarters of it.

Per bound and rule: real tokens per row slot over every row committed (goal at 1
record/s: >= 90 % after, at the default bound of 15 s and above), and how long a record
waited from its arrival to the chunk that kept its row (max and mean, simulated
seconds; the bound holds it). The chats are
fanout.bench.assets' corpus (~40 tokens each under its 512-token tokenizer) packed into
`--seq-len` 256-token rows: ~6 chats per row, as ~700-token chats in 4096-token rows.
Records still waiting at the end (no flush) are left out of both rules.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from fanout.bench.assets import build_tokenizer, generate_corpus  # noqa: E402
from fanout.data.prepare import PrepareConfig  # noqa: E402
from fanout.produce import follow  # noqa: E402
from fanout.produce.config import ProducerConfig  # noqa: E402
from fanout.produce.follow import FollowStream  # noqa: E402
from fanout.store.rundir import RunDir  # noqa: E402
from record import Recorder, Row  # noqa: E402 (benchmarks/ on the path first)

POLL_S = 0.5  # simulated seconds between polls, as the producer's claim loop
DEFAULT_FLUSH_S = 15.0  # --follow-flush-s's default: the >= 90 % goal holds from there


class Clock:
    """The stream's clock seam: simulated seconds."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _one(rule: str, flush_s: float, recs: list[dict[str, Any]], a: Any, tmp: Path) -> dict:
    """One simulated stream; returns its fill and waits."""
    src, run = tmp / f"{rule}-{flush_s:g}.jsonl", tmp / f"run-{rule}-{flush_s:g}"
    src.write_text("")
    opts = ProducerConfig(
        run_dir=str(run), verifier_name_or_path="unused", tokenizer=str(a.tok), data=[],
        follow=str(src), seq_len=a.seq_len, window_rows=4, follow_flush_s=flush_s,
        follow_chunk_records=10_000, workers=1, progress=False,
    )  # fmt: skip

    def make_prep(chunk: str) -> PrepareConfig:
        return opts.prepare_config(str(tmp / "cache"), data=[chunk])

    saved = follow.FULL_FILL, follow.CUT_SHARE
    if rule == "before":
        follow.FULL_FILL, follow.CUT_SHARE = 0.0, 1.0
    try:
        clock = Clock()
        s = FollowStream(make_prep, opts, RunDir(run).create())
        s.clock = clock
        s.fs.makedirs(s.dir)
        arrived: dict[str, float] = {}
        waits: list[float] = []
        nxt, parts = clock.t, 0
        with open(src, "a") as f:
            for r in recs:
                while clock.t < nxt:  # poll until this record is due
                    clock.t = min(nxt, clock.t + POLL_S)
                    s.poll()
                    while parts < len(s.rows.parts):  # a chunk was cut: who is in its rows
                        kept = s.files[parts].read_text().splitlines()
                        carried = {json.dumps(d) for d in s.carry}
                        for line in kept:
                            if line not in carried:
                                waits.append(clock.t - arrived.pop(line))
                        parts += 1
                f.write(json.dumps(r) + "\n")
                f.flush()
                arrived[json.dumps(r)] = clock.t
                nxt = clock.t + a.every_s
        rows = s.rows.num_rows
        fill = s.summary()["row_fill"]
    finally:
        follow.FULL_FILL, follow.CUT_SHARE = saved
    return {"rule": rule, "flush_s": flush_s, "rows": rows, "fill": fill,
            "chunks": len(s.rows.parts), "records_packed": len(waits),
            "wait_max_s": max(waits, default=0.0),
            "wait_mean_s": statistics.fmean(waits) if waits else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=300, help="chats appended to the log")
    p.add_argument("--every-s", type=float, default=1.0, help="simulated seconds between chats")
    p.add_argument("--flush-s", type=float, nargs="+", default=[5.0, 15.0, 30.0, 60.0],
                   help="--follow-flush-s values (simulated seconds)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--json", default=None, help="write the record here")
    a = p.parse_args(argv)
    rec = Recorder("follow_packing", argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        corpus = generate_corpus(a.records, seed=7)
        a.tok = build_tokenizer(tmp / "tok", corpus, 512)
        recs = []
        for i, c in enumerate(corpus):  # every chat distinct: a log line names one record
            msgs = [dict(m) for m in c["messages"]]
            msgs[0]["content"] += f" [{i}]"
            recs.append({"messages": msgs})
        runs = [_one(rule, f, recs, a, tmp) for f in a.flush_s for rule in ("before", "after")]
    print(f"{'flush s':>8} {'rule':>7} {'rows':>5} {'real tokens %':>14} "
          f"{'wait max s':>11} {'wait mean s':>12}")  # fmt: skip
    for r in runs:
        print(f"{r['flush_s']:>8g} {r['rule']:>7} {r['rows']:>5} {100 * r['fill']:>14.1f} "
              f"{r['wait_max_s']:>11.1f} {r['wait_mean_s']:>12.1f}")  # fmt: skip
    cond = (f"{a.records} chats, one every {a.every_s:g} s (simulated), {a.seq_len}-token rows, "
            "~40 tokens a chat")  # fmt: skip
    rows = []
    for r in runs:
        after = r["rule"] == "after"
        rows.append(Row(
            stage="producer", name=f"follow_fill_{r['rule']}_{r['flush_s']:g}s",
            what=f"real tokens per row slot, --follow-flush-s {r['flush_s']:g} ({r['rule']} #52)",
            result=round(100 * r["fill"], 1), unit="%", n=r["rows"], n_of="rows",
            goal=">= 90" if after and r["flush_s"] >= DEFAULT_FLUSH_S else None,
            met=(100 * r["fill"] >= 90) if after and r["flush_s"] >= DEFAULT_FLUSH_S else None,
            conditions=cond,
        ))  # fmt: skip
        rows.append(Row(
            stage="producer", name=f"follow_wait_{r['rule']}_{r['flush_s']:g}s",
            what=f"longest wait of a record for its row, --follow-flush-s {r['flush_s']:g} "
            f"({r['rule']} #52)", result=round(r["wait_max_s"], 1), unit="s",
            n=r["records_packed"], n_of="records",
            goal=f"<= {r['flush_s']:g} + a poll" if after else None,
            met=(r["wait_max_s"] <= r["flush_s"] + POLL_S) if after else None,
            conditions=cond,
        ))  # fmt: skip
    rec.write(a.json, rows, raw={"runs": runs, "args": {k: str(v) for k, v in vars(a).items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
