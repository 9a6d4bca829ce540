"""fanout.ticker.Ticker: the one periodic background thread (the trainer's and the
producer's notices, the benchmarks' sampler).

.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_ticker.py

No test depends on timing: the period is an hour where a test needs no tick, and a
tick sets an Event where a test needs several (the wait on it only bounds a hang).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fanout.ticker import Ticker

HOUR = 3600.0


def test_at_once_ticks_first_even_when_stop_comes_first_and_at_stop_closes() -> None:
    calls: list[str] = []
    t = Ticker(
        lambda: calls.append("tick"),
        HOUR,
        name="t",
        at_once=True,
        at_stop=lambda: calls.append("stop"),
    )
    t.stop()  # before the thread runs at all (a stop() racing its start, made certain)
    t.start()
    t.stop()  # joins: both calls are in by the time it returns
    assert calls == ["tick", "stop"]


def test_the_first_tick_waits_a_period_and_stop_wakes_the_wait() -> None:
    calls: list[str] = []
    with Ticker(
        lambda: calls.append("tick"), HOUR, name="t", at_stop=lambda: calls.append("stop")
    ) as t:
        thread = t._thread
        assert thread is not None and thread.name == "t" and thread.daemon
    assert calls == ["stop"]  # an hour's wait, cut short by the exit
    assert not thread.is_alive()


def test_it_ticks_every_period_until_stopped() -> None:
    n, enough = [0], threading.Event()

    def tick() -> None:
        n[0] += 1
        if n[0] == 3:
            enough.set()

    t = Ticker(tick, 0.001, name="t").start()
    assert enough.wait(60), "three ticks never came"
    t.stop()
    after = n[0]
    assert after >= 3
    t.stop()  # a second stop is a no-op, and no tick comes after the first
    assert n[0] == after


def test_an_exception_ends_the_thread_and_stop_still_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: reported.append(a.exc_value))
    closed: list[bool] = []

    def boom() -> None:
        raise OSError("disk gone")

    t = Ticker(boom, HOUR, name="t", at_once=True, at_stop=lambda: closed.append(True))
    t.start()
    t.stop()
    assert [type(e) for e in reported] == [OSError]  # reported as threading reports it
    assert closed == []  # the loop ended: no closing call


@pytest.mark.parametrize("every_s", [0.0, -1.0])
def test_a_period_that_is_not_positive_is_refused(every_s: Any) -> None:
    with pytest.raises(ValueError, match="every_s must be > 0"):
        Ticker(lambda: None, every_s, name="t")


def test_stop_before_start_returns() -> None:
    Ticker(lambda: None, HOUR, name="t").stop()
