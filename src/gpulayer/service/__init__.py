"""The control plane: jobs in, placements out, results back, waiters woken.

One :class:`ControlPlane` serves clients (submit, wait, cancel, logs) and
workers (register, acquire, started, logs, finished) through a transport. Its
in-memory view (the queue, the live workers and their free slots, the running
jobs) drives placement; the store is the durable record, written in one
transaction per step. Every wait here is a condition or an event that the step
which ends it signals: nothing on the dispatch path sleeps or polls.

The parts: ``state.py`` (the in-memory records), ``core.py`` (the shared
state and steps: place, record, dispatch, release, the retry timer),
``endings.py`` (ending an attempt: the job finished or queued again, its
waiters told), ``sharing.py`` (projects' quotas, usage and preemption's
holds), ``dependencies.py`` and ``arrays.py`` (what holds a job back),
``blobs.py`` (who may read what), ``fleet.py`` (what workers do),
``recovery.py`` (taking over after a crash), ``projects.py`` (projects'
administration), ``plane.py`` (what clients do, and the class that joins
them).
"""

from .plane import ControlPlane
from .state import Snapshot

__all__ = ["ControlPlane", "Snapshot"]
