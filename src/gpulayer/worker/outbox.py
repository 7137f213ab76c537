"""Reports a worker could not deliver yet, delivered in order once it can.

A worker cut off from its server keeps running its tasks; what it has to say
about them (started, finished) waits here and goes out, oldest first, when
the server answers again. A task's result that waits is also kept on disk
(see ledger.py), so that it outlives the worker process. Delivery retries
with capped exponential backoff. Within the heartbeat timeout nothing is lost; past it the server has already
given the task up, and a late result for that attempt is ignored there.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from .. import defaults
from ..errors import ServerUnreachable

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, *, max_backoff: float = defaults.RECONNECT_MAX_S) -> None:
        self._items: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._nudged = False  # the server answered again: retry now, not after the back-off
        self._max_backoff = max_backoff
        self._thread: threading.Thread | None = None

    def send(self, deliver: Callable[[], None], keep: Callable[[], None] | None = None) -> None:
        """Deliver now if nothing is waiting; else (or on failure) queue it.

        ``keep`` runs when the report is queued, before the outbox's thread
        can deliver it: a worker keeps a task's result on disk that way, for
        the next worker process on its home should this one die first."""
        with self._cond:
            queued = bool(self._items)
        if not queued:
            try:
                deliver()
                return
            except ServerUnreachable:
                log.warning("server unreachable: keeping a report to deliver later")
        if keep is not None:
            try:
                keep()
            except OSError:  # a full disk, say: it still waits here, in memory
                log.warning("could not keep a report on disk", exc_info=True)
        with self._cond:
            self._items.append(deliver)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gpulayer-outbox", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def retry_now(self) -> None:
        """The server is back (it answered something else): end the back-off."""
        with self._cond:
            self._nudged = True
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._items)

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                while not self._items and not self._stopped:
                    self._cond.wait()
                if not self._items:
                    return
                deliver = self._items[0]
            try:
                deliver()
            except ServerUnreachable:
                with self._cond:  # wait, but wake at once on stop, or when nudged
                    self._cond.wait_for(lambda: self._stopped or self._nudged, timeout=backoff)
                    if self._stopped:
                        return
                    nudged, self._nudged = self._nudged, False
                backoff = 0.05 if nudged else min(backoff * 2, self._max_backoff)
                continue
            except Exception:
                log.exception("a report was refused by the server; dropping it")
            backoff = 0.05
            with self._cond:
                self._items.popleft()
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is delivered; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
