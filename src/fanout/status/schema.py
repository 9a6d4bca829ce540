"""What `fanout status --json` prints: one versioned pydantic model, the one source for
dashboards (`--watch`, `--serve`'s page and `/metrics` read the same snapshot).

    from fanout.status.schema import StatusSnapshot
    snap = StatusSnapshot.model_validate_json(text)     # a `fanout status --json` output
    snap.totals.producer_windows_per_s                  # every active replica's rate, summed
    StatusSnapshot.model_json_schema()                  # docs/operations.md prints it

`schema_version` changes whenever a field is removed, renamed or changes meaning; a field
added keeps it. Rates are each process's current incarnation's: what it did since it
registered, over the time since then (up to now while it is active, else up to its
last heartbeat), so one status call gives them, no second sample. Every age and rate
is for people and dashboards; liveness decisions never use wall clocks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# 2: live_bytes (of the ready windows only) renamed ready_bytes: "live" is what K
# bounds (totals.windows_live), everywhere.
STATUS_SCHEMA_VERSION = 2

ReplicaState = Literal["active", "stopped", "finished", "lost"]
ConsumerState = Literal["active", "lost", "finished", "stopped", "detached"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Capture(_Model):
    """What every window holds (the capture contract)."""

    target_layer_ids: list[int] = Field(description="verifier layers captured (fanout's ids)")
    storage_dtype: str = Field(description="dtype of the stored hidden states")
    seq_len: int = Field(description="tokens per row T")
    window_rows: int = Field(description="rows per window R")


class Totals(_Model):
    """The run at a glance: what dashboards plot first."""

    windows_made: int = Field(description="windows the stream has handed out (its frontier)")
    windows_live: int = Field(
        description="windows that count toward K now: ready, being captured or being evicted"
    )
    windows_ready: int = Field(description="windows on disk that trainers can read now")
    max_live_windows: int = Field(description="K: the most live windows at once")
    producer_windows_per_s: float = Field(
        description="the active replicas' rates (windows/s), summed; 0 while none is active"
    )
    replicas: int = Field(description="producer replica ranks that ever registered")
    replicas_active: int = Field(description="of them, active now")
    consumers: int = Field(description="consumers (name:dp<rank>) that ever registered")
    consumers_active: int = Field(description="of them, active now")


class Stream(_Model):
    """The stream the producer makes (stream.json and the recorded end)."""

    stream_id: str = Field(description="the capture contract's hash")
    length_windows: int | None = Field(
        description="windows in the stream: where a producer ended it once recorded, else "
        "the run's total_windows; null: not known (open-ended, e.g. still regenerating)"
    )
    ended: bool = Field(description="a producer recorded the stream's end (stream_end)")
    rows: int | None = Field(description="rows of one epoch; null: not known yet")
    epochs: int | None = Field(description="passes over the data; null: no stream.json yet")
    window_rows: int = Field(description="rows per window R")


class Replica(_Model):
    """One producer replica rank (its latest incarnation)."""

    rank: int
    state: ReplicaState = Field(
        description="active; finished (a clean exit that ended the stream by design); "
        "stopped (a clean exit by a signal: the stream is open, restart it to continue); "
        "lost (vanished without a clean exit)"
    )
    recorded_state: str = Field(description="the state the database records (no 'stopped')")
    owner: str = Field(description="its role id in the database")
    host: str | None
    pid: int | None
    heartbeats: int = Field(description="its heartbeat counter")
    heartbeat_age_s: float = Field(description="since its last heartbeat (or exit), wall clock")
    windows: int = Field(description="windows this rank published, every incarnation")
    windows_per_s: float | None = Field(
        description="this incarnation's windows over its time registered; null: no time yet"
    )
    waiting: str | None = Field(
        description="why it is not making windows now, in words; null while it captures"
    )


class Producer(_Model):
    """The producer side as one line: active if any replica is, else lost, else stopped,
    else finished; then the details of the first replica in that state."""

    state: Literal["active", "stopped", "finished", "lost", "none"]
    replicas: int = Field(0, description="replica ranks that ever registered")
    rank: int | None = None
    recorded_state: str | None = None
    owner: str | None = None
    host: str | None = None
    pid: int | None = None
    heartbeats: int | None = None
    heartbeat_age_s: float | None = None
    windows: int | None = None
    windows_per_s: float | None = None
    waiting: str | None = None


class Consumer(_Model):
    """One consumer: a draft trainer's data-parallel rank (`name:dp<rank>`)."""

    id: str = Field(description="name:dp<rank>")
    name: str = Field(description="the trainer's --consumer-id")
    dp_rank: int = Field(description="its data-parallel rank")
    dp_world: int | None = Field(description="ranks of its data-parallel group; null: not said")
    family: str | None = Field(description="its draft family (dflash, ...); null: not said")
    target_layer_ids: list[int] = Field(description="the captured layers it trains on")
    state: ConsumerState
    recorded_state: str = Field(description="the state the database records")
    host: str | None
    pid: int | None
    cursor: int = Field(description="the next window it needs")
    lag_windows: int = Field(description="windows made that it has not consumed")
    heartbeats: int
    heartbeat_age_s: float
    note: str | None = Field(description="why it was detached, when, at which cursor")
    step: int | None = Field(
        description="its last logged optimizer step (its train log, when this host can read "
        "it); null: not readable or none yet"
    )
    eal: float | None = Field(description="its last logged expected acceptance length")
    windows_per_s: float | None = Field(
        description="windows acknowledged by this incarnation over its time registered"
    )
    rows_per_s: float | None = Field(description="windows_per_s × rows per window (R)")
    end_window: int | None = Field(
        description="the window it stops before: its own budget (--epochs, --max-steps) or "
        "the stream's length, whichever is first; null: not known"
    )
    eta_s: float | None = Field(
        description="seconds to end_window at windows_per_s; null: not known or not moving"
    )
    waiting: str | None = Field(
        description="why its next window is not ready, in words; null: it is not waiting"
    )
    verifier_version: int | None = Field(
        None,
        description="`produce --follow-verifier`: the verifier version of the window at its "
        "cursor (else of the one before it); null: none recorded",
    )
    verifier_lag: int | None = Field(
        None,
        description="versions between that one and the newest the run captures with (its "
        "version lag); null: none recorded",
    )
    lag_skipped: int = Field(
        0,
        description="windows it acknowledged without training, captured more than "
        "--max-verifier-lag versions before the newest",
    )


class Lease(_Model):
    consumer: str
    window: int
    generation: int
    token: int
    age_s: float


class HighWater(_Model):
    """The most ready windows (and bytes) the run had on disk at once."""

    windows: int = Field(description="most ready windows at once")
    bytes: int = Field(description="most bytes of ready windows at once")


class Blocked(_Model):
    """While an active producer is blocked at K: by whom, since when, the ways out."""

    since_wall: float
    for_s: float
    by: list[str]
    missing_consumers: int
    text: str
    ways_out: str


class DriftPoint(_Model):
    """The served draft's τ on one recent held-out slice (`fanout promote --run-dir`)."""

    time: str
    version: str = Field(description="the served version it measured (DIR/versions/<version>)")
    served: str | None = Field(
        None, description="the served directory DIR it measured (null: a record older than this)"
    )
    serving_now: str | None = Field(
        None,
        description="the version DIR/current points at when the snapshot was taken (null: "
        "unknown, the record names no served dir or it serves nothing)",
    )
    tau: float
    ci95: list[float] | None
    prompts: int
    heldout_seen: int = Field(description="held-out conversations the run had then")
    baseline_ci95: list[float] | None = Field(description="the interval it is held to")
    below: bool = Field(description="its interval lies wholly below the baseline: drift")


class FollowPosition(_Model):
    """Where `fanout produce --follow` is in its source: its newest committed chunk
    (fanout.coord.follow_log)."""

    chunks: int = Field(description="chunks committed (in the stream)")
    records: int = Field(description="chat records read up to them, held-out ones included")
    heldout: int = Field(description="of those, held out of every window")
    skipped: int = Field(description="lines that were not a chat record")
    split: int = Field(
        0, description="records longer than --seq-len, split across rows (0 before it was counted)"
    )
    committed_wall: float = Field(description="when the newest chunk was committed (Unix s)")


class PromoteLook(_Model):
    """`fanout promote --run-dir`'s newest decision (RUN_DIR/follow/promote.json)."""

    time: str
    candidate: str = Field(description="the checkpoint it decided on")
    candidate_step: int | None = None
    candidate_tau: float | None = Field(None, description="its τ (null: not measured)")
    candidate_ci95: list[float] | None = None
    served: str | None = Field(None, description="the version served when it decided")
    served_dir: str = Field(description="the served directory (--served)")
    promoted: bool
    floor: bool | None = Field(
        None,
        description="its τ was at the floor (<= 1 + --floor-epsilon): refused, not served "
        "(null: a decision that measured nothing)",
    )
    why: str
    version: str | None = Field(None, description="the version it was promoted as")


class Stalled(_Model):
    """Nothing trained for longer than --stalled-after-s: the oldest readable window some
    trainer has not read past was published that long ago (#52)."""

    window: int
    waited_s: float = Field(description="since that window was published")
    after_s: float = Field(description="the bound (--stalled-after-s)")
    behind: list[str] = Field(description="consumers at or below it (empty: none registered)")
    text: str


class VerifierVersions(_Model):
    """A run whose verifier changes (`fanout produce --follow-verifier`): the versions
    its windows were captured with."""

    newest: int = Field(
        description="the version the run captures with now (its furthest window's; "
        "DIR/versions/v0003 is 3)"
    )
    live: dict[str, int] = Field(description='readable windows per version, e.g. {"2": 1, "3": 3}')


class StatusSnapshot(_Model):
    """Everything `fanout status --json` prints."""

    schema_version: Literal[2] = Field(description="changes when a field's meaning does")
    taken_wall: float = Field(description="when this snapshot was taken (Unix seconds)")
    run_dir: str
    db_path: str
    stream_id: str
    totals: Totals
    stream: Stream
    stream_end: int | None = Field(description="where a producer ended the stream; null: open")
    blocked: Blocked | None
    config: dict[str, Any] = Field(description="the run's RunConfig (K, lag policy, ttl, ...)")
    capture: Capture
    windows: dict[str, int] = Field(description="windows by state (evicted: files, cumulative)")
    produced_windows: int = Field(description="= totals.windows_made")
    ready_bytes: int = Field(
        description="bytes of the ready windows (those being captured or evicted, which "
        "count toward K too, are not in it)"
    )
    high_water: HighWater
    recaptures: int
    evictions: int
    corrupt: int
    detaches: int
    reclaims: int
    claims_reclaimed: int
    capture_failures: int = Field(
        0,
        description="captures that failed and were retried or failed the window (the "
        "capture check's bad windows among them: the windows' last_error says which)",
    )
    producer: Producer
    replicas: list[Replica]
    consumers: list[Consumer]
    leases: list[Lease]
    drift: list[DriftPoint] = Field(
        default_factory=list,
        description="the served draft's τ on the newest held-out slices of a live run "
        "(RUN_DIR/follow/drift.jsonl), oldest first, at most the last 20",
    )
    follow: FollowPosition | None = Field(
        None, description="a live run's position in its source (`produce --follow`); null: none"
    )
    verifier: VerifierVersions | None = Field(
        None,
        description="the verifier versions of a run whose verifier changes (`produce "
        "--follow-verifier`); null: its windows record none",
    )
    promote: PromoteLook | None = Field(
        None, description="`fanout promote --run-dir`'s newest decision; null: none recorded"
    )
    stalled: Stalled | None = Field(
        None, description="nothing trained for longer than --stalled-after-s; null: healthy"
    )


BEGIN = "<!-- status:schema (generated by scripts/docs.py) -->"
END = "<!-- /status:schema -->"


def _compact(value: Any, indent: str = "") -> str:
    """JSON with one line per property (a line holds anything up to 100 characters)."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) <= 100 or not isinstance(value, dict | list) or not value:
        return flat
    inner = indent + "  "
    if isinstance(value, list):
        items = [inner + _compact(v, inner) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    items = [f"{inner}{json.dumps(k)}: {_compact(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def schema_block() -> str:
    """The block docs/operations.md carries: StatusSnapshot's JSON Schema."""
    schema = _compact(StatusSnapshot.model_json_schema())
    return "\n".join(
        [BEGIN, "<details><summary>JSON Schema</summary>", "", "```json", schema, "```", "",
         "</details>", END]
    )  # fmt: skip
