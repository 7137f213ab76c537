"""Identifiers: short, URL-safe, unique, and sortable by creation time."""

from __future__ import annotations

import os
import re
import threading
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case
_ID = re.compile(f"[{_ALPHABET}]{{14}}")
_ID_OR_PREFIX = re.compile(f"[{_ALPHABET}]{{1,14}}")
_RAND_BITS = 25
_lock = threading.Lock()
_last = (0, 0)  # (millis, random part) of the last id made here


_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]  # two digits at a time


def _b32(value: int, width: int) -> str:
    """``value`` in ``width`` base-32 digits (``width`` even)."""
    pairs = []
    for _ in range(width // 2):
        value, pair = divmod(value, 1024)
        pairs.append(_PAIRS[pair])
    return "".join(reversed(pairs))


def new_id() -> str:
    """14 characters: 45 bits of milliseconds, then 25 bits that are random.

    Within one process, ids made in the same millisecond count up from the
    first one's random part (like a monotonic ULID), so they never collide
    and keep their order; across processes a clash needs the same
    millisecond and the same 25 random bits.
    """
    global _last
    millis = time.time_ns() // 1_000_000
    with _lock:
        last_ms, last_rand = _last
        if millis <= last_ms:
            millis, rand = last_ms, last_rand + 1
            if rand >> _RAND_BITS:  # 33 million ids in one millisecond: borrow the next
                millis, rand = millis + 1, 0
        else:
            rand = int.from_bytes(os.urandom(4), "big") >> (32 - _RAND_BITS)
        _last = (millis, rand)
    return _b32(((millis & ((1 << 45) - 1)) << _RAND_BITS) | rand, 14)


def is_job_id(value: str) -> bool:
    """Whether ``value`` looks like an id GPUlayer makes."""
    return _ID.fullmatch(value) is not None


def is_job_id_or_prefix(value: str) -> bool:
    """Whether ``value`` could be a job's id or the start of one."""
    return _ID_OR_PREFIX.fullmatch(value) is not None


def check_id_or_prefix(field: str, value: str) -> None:
    """A job named as a person types it: its id, or the start of one."""
    from .errors import SpecError

    if not isinstance(value, str) or not _ID_OR_PREFIX.fullmatch(value):
        shown = repr(value) if len(str(value)) <= 40 else repr(str(value)[:37] + "...")
        raise SpecError(
            field, f"a job id (or its start) is 1 to 14 characters of {_ALPHABET}, got {shown}"
        )


def check_id(field: str, value: str) -> None:
    """Ids from outside (a client proposing one) must look like ours."""
    from .errors import SpecError

    if not _ID.fullmatch(value):
        raise SpecError(field, f"a job id is 14 characters of {_ALPHABET}, got {value!r}")
