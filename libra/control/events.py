"""The controller's event log: every state change becomes a numbered `Event` that watchers
receive in order. A bounded history lets a watcher resume from the last sequence it saw."""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Iterator

from libra.control.types import Event, EventKind


class EventBus:
    def __init__(self, history: int = 10_000):
        self._lock = threading.Lock()
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._subscribers: set[queue.SimpleQueue] = set()
        self._sequence = 0

    @property
    def last_sequence(self) -> int:
        return self._sequence

    def publish(self, kind: EventKind, **fields) -> Event:
        with self._lock:
            self._sequence += 1
            event = Event(sequence=self._sequence, time=time.time(), kind=kind, **fields)
            self._history.append(event)
            for subscriber in self._subscribers:
                subscriber.put(event)
        return event

    def watch(
        self,
        after_sequence: int,
        kinds: frozenset[EventKind],
        is_active,
        only_new: bool = False,
        poll_s: float = 0.25,
    ) -> Iterator[Event]:
        """The retained events with sequence > `after_sequence` (none with `only_new`), then new
        ones, of the given kinds (empty: all), until `is_active()` turns false (the client went
        away or the server stops). The subscription starts at this call, not at the first
        `next()`, so nothing published in between is missed; iterate what it returns."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            backlog = [] if only_new else [e for e in self._history if e.sequence > after_sequence]
            self._subscribers.add(inbox)
        return self._follow(inbox, backlog, after_sequence, kinds, is_active, poll_s)

    def _follow(self, inbox, backlog, after_sequence, kinds, is_active, poll_s) -> Iterator[Event]:
        try:
            for event in backlog:
                if not kinds or event.kind in kinds:
                    yield event
            while is_active():
                try:
                    event = inbox.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if (not kinds or event.kind in kinds) and event.sequence > after_sequence:
                    yield event
        finally:
            with self._lock:
                self._subscribers.discard(inbox)
