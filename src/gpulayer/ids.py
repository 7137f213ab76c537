"""Identifiers: short, URL-safe, and sortable by creation time."""

from __future__ import annotations

import os
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(_ALPHABET[digit])
    return "".join(reversed(chars))


def new_id() -> str:
    """12 characters: 45 bits of milliseconds, then 15 random bits.

    Ids sort by creation time (to the millisecond), which keeps `gpulayer jobs`
    and the store's index in submission order, and stay short enough to type.
    """
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(2), "big") & 0x7FFF
    return _b32(((millis & ((1 << 45) - 1)) << 15) | rand, 12)
