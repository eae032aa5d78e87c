"""Requests that arrive while an engine generation runs: `Engine.generate(params, [], feed=feed)`
keeps running, admitting what is `put` into the feed as slots free, until the feed is closed
and every sequence has ended (a server's engine loop: ptrain/serve/runner.py). Fed requests
have an `on_turn`, which gets their trajectories (the generation returns none of them).

The scheduler takes new requests at each round; when it has nothing to decode it waits on
the feed and on the tools together (`wakeup`), so a request that arrives while every
sequence waits on its tool starts at once.
"""

from __future__ import annotations

import concurrent.futures
import threading


class Feed:
    def __init__(self):
        self._lock = threading.Lock()
        self._items = []
        self._closed = False
        self._wake = None  # the future a waiting scheduler holds

    def put(self, request) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("Feed: closed; no more requests can join the generation")
            self._items.append(request)
            self._signal()

    def close(self) -> None:
        """No more requests: the generation ends when its sequences have."""
        with self._lock:
            self._closed = True
            self._signal()

    def wake(self) -> None:
        """Wakes a scheduler waiting for requests, to act on something else (new weights
        published to its switch: the swap falls at the top of its next round)."""
        with self._lock:
            self._signal()

    def take(self) -> list:
        with self._lock:
            items, self._items = self._items, []
            return items

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def done(self) -> bool:
        """Closed, and nothing left to take."""
        with self._lock:
            return self._closed and not self._items

    def wakeup(self) -> concurrent.futures.Future:
        """A future that completes when a request is put or the feed is closed (at once if
        one is waiting)."""
        with self._lock:
            future = concurrent.futures.Future()
            if self._items or self._closed:
                future.set_result(None)
            else:
                self._wake = future
            return future

    def _signal(self):
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._wake = None
