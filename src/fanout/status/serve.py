"""`fanout status --serve PORT`: the run's snapshot for dashboards, over HTTP.

    fanout status --run-dir runs/demo --serve 9464            # loopback only
    curl -s localhost:9464/metrics     # Prometheus text format (version 0.0.4)
    curl -s localhost:9464/status.json # what `fanout status --json` prints
    open http://localhost:9464/        # one page that refreshes itself, with plots

Every response is built from one fresh snapshot (fanout.status.snapshot.build), so the
page, /metrics and /status.json agree with `--json` at the instant they were asked.
The server also samples every --interval-s, and on every request, for the page's plots
(windows live vs K, each replica's rate, each draft's lag and EAL; the page is
fanout.status.page), kept in memory (the last MAX_SAMPLES). One thread serves and
samples (`serve_forever`'s idle hook), on the coordinator connection it was given:
open it in the thread that calls `run()`.

Metric names follow Prometheus' conventions: prefix `fanout_`, counters end in
`_total`, durations in seconds, rates `_per_second`; a state is a gauge of 1 on the
series whose `state` label is the current one.
"""

from __future__ import annotations

import http.server
import json
import time
from collections import deque
from typing import Any, get_args

from fanout.coord.coordinator import Coordinator
from fanout.errors import ConfigError
from fanout.status.page import Sample, page_html, sample_of
from fanout.status.schema import ConsumerState, ReplicaState, StatusSnapshot
from fanout.status.snapshot import STALLED_AFTER_S, build

MAX_SAMPLES = 720  # the plot's memory: an hour at the default 5 s ... 24 min at 2 s
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Metrics:
    """Collects one family at a time in the text format: HELP, TYPE, then samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: list[tuple[dict[str, Any], float | None]],
    ) -> None:
        """A family; samples whose value is None (not known) are left out, and a family
        with none left is not written."""
        known = [(labels, v) for labels, v in samples if v is not None]
        if not known:
            return
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in known:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {float(value)!r}" if inner else
                              f"{name} {float(value)!r}")  # fmt: skip

    def one(self, name: str, kind: str, help_text: str, value: float | None) -> None:
        self.add(name, kind, help_text, [({}, value)] if value is not None else [])


def metrics_text(s: StatusSnapshot) -> str:
    """The snapshot as Prometheus metrics (text exposition format 0.0.4)."""
    m = _Metrics()
    t = s.totals
    m.add("fanout_info", "gauge", "The run: 1, its ids as labels.",
          [({"run_dir": s.run_dir, "stream_id": s.stream_id,
             "schema_version": s.schema_version}, 1)])  # fmt: skip
    m.one("fanout_windows_made_total", "counter", "Windows the stream handed out.",
          t.windows_made)  # fmt: skip
    m.one("fanout_windows_live", "gauge", "Windows counting toward K now.", t.windows_live)
    m.one("fanout_windows_ready", "gauge", "Windows trainers can read now.", t.windows_ready)
    m.one("fanout_max_live_windows", "gauge", "K: the most live windows at once.",
          t.max_live_windows)  # fmt: skip
    m.add("fanout_windows", "gauge", "Window rows by state (not evicted: see evictions).",
          [({"state": k}, v) for k, v in s.windows.items() if k != "evicted"])  # fmt: skip
    m.one("fanout_ready_bytes", "gauge", "Bytes of the ready windows.", s.ready_bytes)
    m.one("fanout_high_water_bytes", "gauge", "Most ready bytes at once.", s.high_water.bytes)
    for key, what in (
        ("recaptures", "Windows published again."),
        ("evictions", "Window files evicted."),
        ("corrupt", "Window files that failed verification."),
        ("detaches", "Consumers detached."),
        ("reclaims", "Processes declared lost."),
        ("claims_reclaimed", "Claims of lost or replaced replicas, released."),
        ("capture_failures", "Captures that failed (the capture check's bad windows too)."),
    ):
        m.one(f"fanout_{key}_total", "counter", what, getattr(s, key))
    m.one("fanout_producer_windows_per_second", "gauge",
          "The active replicas' rates, summed.", t.producer_windows_per_s)  # fmt: skip
    m.one("fanout_stream_length_windows", "gauge", "Windows in the stream, when known.",
          s.stream.length_windows)  # fmt: skip
    m.one("fanout_stream_ended", "gauge", "1 once a producer recorded the stream's end.",
          int(s.stream.ended))  # fmt: skip
    m.one("fanout_blocked_seconds", "gauge", "How long the producer has been blocked at K.",
          None if s.blocked is None else s.blocked.for_s)  # fmt: skip
    last = s.drift[-1] if s.drift else None  # fanout promote --run-dir's newest look
    m.one("fanout_served_tau", "gauge", "The served draft's tau on the newest held-out slice.",
          None if last is None else last.tau)  # fmt: skip
    m.one("fanout_served_drift", "gauge", "1 when that tau fell below its promoted interval.",
          None if last is None else int(last.below))  # fmt: skip
    p = s.promote  # fanout promote --run-dir's newest decision
    m.one("fanout_promote_floor", "gauge",
          "1 when the newest candidate's tau was at the floor: refused, not served.",
          None if p is None or p.floor is None else int(p.floor))  # fmt: skip
    m.one("fanout_stalled", "gauge",
          "1 when a ready window waited longer than --stalled-after-s unread (nothing trained).",
          int(s.stalled is not None))  # fmt: skip
    f = s.follow  # a live run's source (produce --follow): what an operator alerts on
    for key, what in (
        ("chunks", "Chunks of the followed source committed."),
        ("records", "Chat records read from the followed source, held-out ones included."),
        ("heldout", "Of those, held out of every window."),
        ("skipped", "Source lines that were not a chat record."),
        ("split", "Records longer than --seq-len, split across rows."),
    ):
        m.one(f"fanout_follow_{key}_total", "counter", what,
              None if f is None else getattr(f, key))  # fmt: skip

    reps = s.replicas
    states = get_args(ReplicaState)  # the schema's: one home for the states
    m.add(
        "fanout_replica_state",
        "gauge",
        "1 on the replica's current state.",
        [({"rank": r.rank, "state": st}, int(r.state == st)) for r in reps for st in states],
    )
    m.add("fanout_replica_windows_total", "counter", "Windows this rank published.",
          [({"rank": r.rank}, r.windows) for r in reps])  # fmt: skip
    m.add("fanout_replica_windows_per_second", "gauge", "This incarnation's rate.",
          [({"rank": r.rank}, r.windows_per_s) for r in reps])  # fmt: skip
    m.add("fanout_replica_heartbeat_age_seconds", "gauge", "Since its last heartbeat or exit.",
          [({"rank": r.rank}, r.heartbeat_age_s) for r in reps])  # fmt: skip

    cons = s.consumers

    def who(c: Any) -> dict[str, Any]:
        return {"consumer": c.id, "family": c.family or "", "dp_rank": c.dp_rank}

    cstates = get_args(ConsumerState)
    m.add(
        "fanout_consumer_state",
        "gauge",
        "1 on the consumer's current state.",
        [({**who(c), "state": st}, int(c.state == st)) for c in cons for st in cstates],
    )
    for key, name, what in (
        ("cursor", "cursor", "The next window it needs."),
        ("lag_windows", "lag_windows", "Windows made that it has not consumed."),
        ("step", "step", "Its last logged optimizer step."),
        ("eal", "eal", "Its last logged expected acceptance length."),
        ("windows_per_s", "windows_per_second", "Windows it acknowledges per second."),
        ("rows_per_s", "rows_per_second", "Rows it passes per second."),
        ("eta_s", "eta_seconds", "Seconds to its end at its rate."),
        ("heartbeat_age_s", "heartbeat_age_seconds", "Since its last heartbeat or exit."),
        ("verifier_lag", "verifier_lag", "Verifier versions its window is behind the newest."),
    ):
        m.add(f"fanout_consumer_{name}", "gauge", what,
              [(who(c), getattr(c, key)) for c in cons])  # fmt: skip
    if s.verifier is not None:  # produce --follow-verifier
        m.one("fanout_verifier_version", "gauge", "The verifier version the run captures "
              "with now.", s.verifier.newest)  # fmt: skip
        m.add("fanout_consumer_lag_skipped_total", "counter", "Windows it acknowledged "
              "untrained, too many verifier versions old (--max-verifier-lag).",
              [(who(c), c.lag_skipped) for c in cons])  # fmt: skip
    return "\n".join(m.lines) + "\n"


class StatusServer:
    """The HTTP server of `fanout status --serve`: bound at construction (a port in use
    is a ConfigError, one line), serving until `shutdown()` or Ctrl-C."""

    def __init__(
        self,
        co: Coordinator,
        host: str,
        port: int,
        interval_s: float,
        stalled_after_s: float = STALLED_AFTER_S,
    ) -> None:
        self.co, self.interval_s, self.stalled_after_s = co, interval_s, stalled_after_s
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self._next_sample = 0.0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer._answer(self)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        try:
            self.httpd = http.server.HTTPServer((host, port), Handler)
        except OSError as e:
            raise ConfigError(
                f"--serve {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                "pick a free port (0: any)"
            ) from None
        bound_host, bound_port = (str(x) for x in self.httpd.server_address[:2])
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}/"
        self.port = int(bound_port)
        self.httpd.service_actions = self._sample  # type: ignore[method-assign]

    def snapshot(self) -> StatusSnapshot:
        s = build(self.co, self.stalled_after_s)
        self.samples.append(sample_of(s))
        return s

    def _sample(self) -> None:
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + self.interval_s
            self.snapshot()

    def _answer(self, req: http.server.BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        if path not in ("/", "/metrics", "/status.json"):
            req.send_error(404, "not found: try /, /metrics or /status.json")
            return
        s = self.snapshot()
        if path == "/metrics":
            body, kind = metrics_text(s), CONTENT_TYPE
        elif path == "/status.json":
            body, kind = json.dumps(s.model_dump(mode="json"), indent=2), "application/json"
        else:
            body, kind = page_html(s, list(self.samples), self.interval_s), "text/html"
        data = body.encode()
        req.send_response(200)
        req.send_header("Content-Type", kind if "charset" in kind else kind + "; charset=utf-8")
        req.send_header("Content-Length", str(len(data)))
        req.send_header("Cache-Control", "no-store")
        req.end_headers()
        req.wfile.write(data)

    def run(self) -> int:
        """Serve until `shutdown()` (returns 0) or Ctrl-C (0 too: the way to stop it)."""
        try:
            self.httpd.serve_forever(poll_interval=min(0.5, self.interval_s))
        except KeyboardInterrupt:
            pass
        finally:
            self.httpd.server_close()
        return 0

    def shutdown(self) -> None:
        """Stop `run()` from another thread."""
        self.httpd.shutdown()
