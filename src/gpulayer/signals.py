"""Waking whoever waits, whether a thread or an event loop.

A :class:`Signal` is a one-shot list of callbacks: ``fire()`` calls each once
and forgets them; a waiter that wants more subscribes again. Threads subscribe
an ``Event.set``; the HTTP server subscribes ``loop.call_soon_threadsafe(...)``
so ten thousand waiting workers hold no thread. The control plane subscribes
and fires under its own lock, so a check and a subscription are atomic and no
wake-up is lost.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

Unsubscribe = Callable[[], None]


class Signal:
    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> Unsubscribe:
        self._waiters.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):  # already fired
                self._waiters.remove(callback)

        return unsubscribe

    def fire(self) -> None:
        waiters, self._waiters = self._waiters, []
        for callback in waiters:
            callback()

    def __len__(self) -> int:
        return len(self._waiters)


def wait_on(lock: threading.Lock, signal: Signal, timeout: float | None) -> bool:
    """Block this thread (holding ``lock``) until ``signal`` fires or ``timeout``.

    ``lock`` is released while waiting and held again on return, like
    ``Condition.wait``. Returns whether the signal fired.
    """
    event = threading.Event()
    unsubscribe = signal.subscribe(event.set)
    lock.release()
    try:
        fired = event.wait(timeout)
    finally:
        lock.acquire()
    if not fired:
        unsubscribe()
    return fired
