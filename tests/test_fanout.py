"""Tests for torpor.statemachine.log.fanout: one subscriber fan-out, a failing subscriber isolated."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
from support import raw_event

from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.fanout import Fanout

log = logging.getLogger("torpor.test.fanout")
Callback = Callable[[Event], object]


def _event(seq: int, kind: EventKind = EventKind.USAGE_OBSERVED) -> Event:
    data = {"usage": {"weights": 1}} if kind is EventKind.USAGE_OBSERVED else {}
    return raw_event(kind, seq, "e", 0, data)


def test_every_subscriber_gets_every_event_in_order() -> None:
    """Subscribers are called in subscription order, each with every event."""
    fan: Fanout[Callback] = Fanout(log)
    calls: list[tuple[str, int]] = []
    fan.subscribe(lambda e: calls.append(("a", e.seq)))
    fan.subscribe(lambda e: calls.append(("b", e.seq)))
    for seq in (1, 2):
        fan.publish(_event(seq))
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_kinds_filter_what_a_subscriber_gets() -> None:
    """A subscriber that names kinds gets only events of those kinds."""
    fan: Fanout[Callback] = Fanout(log)
    got: list[str] = []
    fan.subscribe(lambda e: got.append(e.kind.value), kinds=["closed", EventKind.OPENED])
    for seq, kind in enumerate([EventKind.OPENED, EventKind.USAGE_OBSERVED, EventKind.CLOSED], 1):
        fan.publish(_event(seq, kind))
    assert got == ["opened", "closed"]


def test_a_failing_subscriber_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    """A subscriber that raises is logged with the event; the subscribers after it still get the event."""
    fan: Fanout[Callback] = Fanout(log, "probe")
    got: list[int] = []

    def broken(event: Event) -> None:
        msg = "boom"
        raise RuntimeError(msg)

    fan.subscribe(broken)
    fan.subscribe(lambda e: got.append(e.seq))
    with caplog.at_level(logging.ERROR, log.name):
        fan.publish(_event(7))
    assert got == [7]
    (record,) = caplog.records
    assert "probe" in record.getMessage() and "failed on event #7 usage_observed" in record.getMessage()
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])


def test_base_exceptions_are_not_swallowed() -> None:
    """KeyboardInterrupt from a subscriber reaches the publisher (only Exception is isolated)."""
    fan: Fanout[Callback] = Fanout(log)

    def interrupted(event: Event) -> None:
        raise KeyboardInterrupt

    fan.subscribe(interrupted)
    with pytest.raises(KeyboardInterrupt):
        fan.publish(_event(1))


def test_unsubscribe_removes_only_that_subscription() -> None:
    """The function subscribe returns removes that subscription, once; others of the same callback stay."""
    fan: Fanout[Callback] = Fanout(log)
    got: list[int] = []
    first = fan.subscribe(got.append)
    fan.subscribe(got.append)
    first()
    first()
    fan.publish(_event(3))
    assert len(got) == 1 and len(fan) == 1


def test_changes_from_inside_a_subscriber_apply_to_the_next_event() -> None:
    """A subscriber that unsubscribes itself and subscribes another: the event being published is not affected."""
    fan: Fanout[Callback] = Fanout(log)
    got: list[tuple[str, int]] = []
    remove: list[Callable[[], None]] = []

    def once(event: Event) -> None:
        got.append(("once", event.seq))
        remove[0]()
        fan.subscribe(lambda e: got.append(("late", e.seq)))

    remove.append(fan.subscribe(once))
    fan.subscribe(lambda e: got.append(("steady", e.seq)))
    fan.publish(_event(1))
    fan.publish(_event(2))
    assert got == [("once", 1), ("steady", 1), ("steady", 2), ("late", 2)]


def test_deliver_calls_any_kind_of_subscriber() -> None:
    """deliver() hands each subscriber to a call (a sink with its own method), isolating failures alike."""

    class Sink:
        def __init__(self) -> None:
            self.seen: list[tuple[int, str]] = []

        def handle(self, event: Event, note: str) -> None:
            if note == "bad" and not self.seen:
                msg = "first call fails"
                raise ValueError(msg)
            self.seen.append((event.seq, note))

    fan: Fanout[Sink] = Fanout(log, "sink")
    a, b = Sink(), Sink()
    fan.subscribe(a)
    fan.subscribe(b)
    event = _event(4)
    fan.deliver(event, lambda sink: sink.handle(event, "bad" if sink is a else "ok"))
    assert a.seen == [] and b.seen == [(4, "ok")]
    fan.unsubscribe(b)
    assert list(fan) == [a] and b not in fan


def test_concurrent_subscribes_are_all_kept() -> None:
    """Subscriptions from many threads at once are all kept (none lost to a race)."""
    fan: Fanout[Callback] = Fanout(log)
    barrier = threading.Barrier(8)

    def add() -> None:
        barrier.wait()
        for _ in range(200):
            fan.subscribe(lambda e: None)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fan) == 1600
