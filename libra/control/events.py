"""The controller's event log: every state change becomes a numbered `Event` that watchers
receive in order. A bounded history lets a watcher resume from the last sequence it saw.

Publishers are any thread (the job, the planner, the gRPC loop). Threads watch through `watch`;
the gRPC server's watchers through `watch_async`, which costs its loop one wake-up per event
however many watchers it has. A watcher that falls `max_pending` events behind is ended with
`WatcherFellBehind` rather than growing without bound; it resumes from its last sequence.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from libra.control.types import Event, EventKind


class WatcherFellBehind(OverflowError):
    """A watcher left too many events unread; the message says where to resume."""


class _AsyncInbox:
    def __init__(self, max_pending: int):
        self.pending: collections.deque[Event] = collections.deque()
        self.ready = asyncio.Event()
        self.max_pending = max_pending
        self.overflowed = False

    def put(self, event: Event) -> None:
        if len(self.pending) >= self.max_pending:
            self.overflowed = True
        else:
            self.pending.append(event)
        self.ready.set()


class EventBus:
    def __init__(self, history: int = 10_000):
        self._lock = threading.Lock()
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._subscribers: set[queue.SimpleQueue] = set()
        self._loop_inboxes: dict[asyncio.AbstractEventLoop, set[_AsyncInbox]] = {}
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
            for loop in list(self._loop_inboxes):
                try:
                    loop.call_soon_threadsafe(self._deliver_on_loop, loop, event)
                except RuntimeError:  # that loop closed: its watchers are gone with it
                    del self._loop_inboxes[loop]
        return event

    def _subscribe(self, after_sequence: int, only_new: bool, add: Callable[[], None]) -> list[Event]:
        with self._lock:
            add()
            return [] if only_new else [e for e in self._history if e.sequence > after_sequence]

    def watch(
        self,
        after_sequence: int,
        kinds: frozenset[EventKind],
        is_active,
        only_new: bool = False,
        poll_s: float = 0.25,
    ) -> Iterator[Event]:
        """The retained events with sequence > `after_sequence` (none with `only_new`), then new
        ones, of the given kinds (empty: all), until `is_active()` turns false. The subscription
        starts at this call, not at the first `next()`, so nothing published in between is
        missed; iterate what it returns."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        backlog = self._subscribe(after_sequence, only_new, lambda: self._subscribers.add(inbox))
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

    async def watch_async(
        self,
        after_sequence: int,
        kinds: frozenset[EventKind],
        only_new: bool = False,
        max_pending: int = 10_000,
    ) -> AsyncIterator[Event]:
        """As `watch`, on the running loop, until the consumer stops iterating (or is cancelled);
        raises `WatcherFellBehind` once `max_pending` events wait unread."""
        loop = asyncio.get_running_loop()
        inbox = _AsyncInbox(max_pending)
        backlog = self._subscribe(
            after_sequence, only_new, lambda: self._loop_inboxes.setdefault(loop, set()).add(inbox)
        )
        last_sent = after_sequence
        try:
            for event in backlog:
                last_sent = event.sequence
                if not kinds or event.kind in kinds:
                    yield event
            while True:
                await inbox.ready.wait()
                inbox.ready.clear()
                if inbox.overflowed:
                    raise WatcherFellBehind(
                        f"the watcher fell {max_pending} events behind; "
                        f"resume with after_sequence={last_sent}"
                    )
                while inbox.pending:
                    event = inbox.pending.popleft()
                    if event.sequence <= last_sent:
                        continue  # also in the backlog
                    last_sent = event.sequence
                    if not kinds or event.kind in kinds:
                        yield event
        finally:
            with self._lock:
                self._loop_inboxes.get(loop, set()).discard(inbox)

    def _deliver_on_loop(self, loop: asyncio.AbstractEventLoop, event: Event) -> None:
        with self._lock:
            inboxes = list(self._loop_inboxes.get(loop, ()))
        for inbox in inboxes:
            inbox.put(event)
