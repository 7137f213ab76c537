"""Durations as people type them: ``90m``, ``12h``, ``30d``, ``2w`` or seconds."""

from __future__ import annotations

import re

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The longest accepted (a token's life, a gc's age): past it, a typo.
MAX_DURATION_S = 10 * 365 * 86400


def parse_duration(text: str, *, zero: bool = False) -> float:
    """Seconds in ``text``; ValueError, in plain words, for anything else,
    for more than ten years, and (unless ``zero``) for none at all."""
    match = _DURATION.fullmatch(text)
    seconds = float(match[1]) * _UNIT_S[match[2]] if match else -1.0
    enough = seconds >= 0 if zero else seconds > 0
    if not (enough and seconds <= MAX_DURATION_S):  # also inf, from a number too long
        raise ValueError(
            f"{text!r} is not a duration of at most ten years; give one such as 90m, 12h, 30d or 2w"
        )
    return seconds
