"""The one subscriber fan-out: each event handed to every subscriber in order, a failing one isolated.

The controller (its ``subscribe``), the telemetry log source
(:class:`~torpor.statemachine.log.logsource.LogSource`) and the telemetry tracker (its
sinks) hand each event to their subscribers through a :class:`Fanout`:

- a subscriber may name the event kinds it wants (``kinds``); it is skipped
  for the others;
- a subscriber that raises (``Exception``) is logged with its event and the
  others still get the event: a subscriber never breaks the publisher;
- subscribing and unsubscribing are safe from any thread, also from inside a
  subscriber: a publication goes to the subscribers of the moment it began
  (the list is replaced on change, never mutated, so publishing takes no lock
  and copies nothing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from torpor.statemachine.core.events import Event, EventKind

S = TypeVar("S")
C = TypeVar("C", bound=Callable[[Event], object])

_Entry = tuple[S, frozenset[EventKind] | None]


class Fanout(Generic[S]):
    """Subscribers of type ``S``; :meth:`publish` calls each callback, :meth:`deliver` any other kind.

    ``logger`` and ``what`` make the line logged when a subscriber fails:
    ``"<what> <subscriber> failed on event #<seq> <kind>"``, with the traceback.
    """

    def __init__(self, logger: logging.Logger, what: str = "subscriber") -> None:
        self._logger = logger
        self._what = what
        self._lock = threading.Lock()
        self._entries: tuple[_Entry[S], ...] = ()

    def subscribe(self, subscriber: S, kinds: Iterable[EventKind | str] | None = None) -> Callable[[], None]:
        """Add ``subscriber`` (for events of ``kinds`` only, when given); return a function that removes it."""
        entry: _Entry[S] = (subscriber, None if kinds is None else frozenset(EventKind(k) for k in kinds))
        with self._lock:
            self._entries = (*self._entries, entry)

        def unsubscribe() -> None:
            with self._lock:
                entries = list(self._entries)
                for index, known in enumerate(entries):
                    if known is entry:
                        del entries[index]
                        self._entries = tuple(entries)
                        return

        return unsubscribe

    def unsubscribe(self, subscriber: S) -> None:
        """Remove the first subscription of ``subscriber`` (nothing when it has none), as ``list.remove`` would."""
        with self._lock:
            entries = list(self._entries)
            for index, (known, _) in enumerate(entries):
                if known is subscriber or known == subscriber:
                    del entries[index]
                    self._entries = tuple(entries)
                    return

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[S]:
        return iter([subscriber for subscriber, _ in self._entries])

    def __contains__(self, subscriber: object) -> bool:
        return any(s is subscriber or s == subscriber for s, _ in self._entries)

    def __repr__(self) -> str:
        return f"Fanout({self._what}, {len(self._entries)} subscribed)"

    def publish(self: Fanout[C], event: Event) -> None:
        """Call every subscriber that wants ``event`` with it, in subscription order."""
        self.deliver(event, lambda callback: callback(event))

    def deliver(self, event: Event, call: Callable[[S], object]) -> None:
        """``call(subscriber)`` for every subscriber that wants ``event``, in subscription order."""
        for subscriber, kinds in self._entries:
            if kinds is not None and event.kind not in kinds:
                continue
            try:
                call(subscriber)
            except Exception:  # a subscriber must never break the publisher or the other subscribers
                self._failed(subscriber, event)

    def _failed(self, subscriber: object, event: Event) -> None:
        self._logger.exception("%s %r failed on event #%d %s", self._what, subscriber, event.seq, event.kind.value)


__all__ = ["Fanout"]
