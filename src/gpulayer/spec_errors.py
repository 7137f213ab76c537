"""A job spec's validation errors in plain words.

msgspec says what its types expected (``Expected `int` >= 0 - at `$.gpus```);
a user needs the field (and the key, for a map), the value given, what is
allowed, and the field meant when a name is misspelt::

    invalid job spec: gpus: must be a whole number, 0 or more; got -1 (an int)
    invalid job spec: env.BATCH: must be a string; got 5 (an int)
    invalid job spec: gpu: unknown field; did you mean 'gpus'? (fields: command, ...)
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import SpecError

_AT = re.compile(r"\s*-\s*at `\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[[^\]]*\])*)`$")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]")
_EXPECTED = re.compile(r"^Expected `([^`]*)`(?:, got `([^`]*)`)?(?: (>=|<=|>|<) (\S+))?$")

# What each msgspec type is, said to a person.
_TYPES = {
    "int": "a whole number",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "a mapping of names to values",
    "null": "nothing (null)",
}
_BOUNDS = {">=": "{} or more", "<=": "at most {}", ">": "more than {}", "<": "less than {}"}


def plain_spec_error(
    message: str,
    data: Mapping[str, Any],
    *,
    fields: Sequence[str],
    choices: Mapping[str, Sequence[str]],
) -> SpecError:
    """The SpecError for msgspec's ``message`` about ``data`` (the mapping
    given), whose valid top-level names are ``fields`` and whose enumerated
    fields' values are ``choices``."""
    unknown = re.fullmatch(r"Object contains unknown field `([^`]*)`(.*)", message)
    if unknown:
        name, where = unknown[1], _where(unknown[2], data)
        known = fields if not where[0] else _nested_fields(where[0])
        guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        inside = f" in {where[0]}" if where[0] else ""
        return SpecError(name, f"unknown field{inside}{hint} (fields: {', '.join(known)})")
    key = re.fullmatch(r"Expected `str`, got `([^`]*)` - at `key` in `\$\.([A-Za-z_]+)`", message)
    if key:  # a map's key that is not a string (YAML reads 1 and yes as others)
        return SpecError(
            key[2], f"its keys must be strings; one is {_KIND_NAMES.get(key[1], key[1])}"
        )
    at = _AT.search(message)
    body = message[: at.start()] if at else message
    path, value = _where(at[0] if at else "", data)
    field = path or "spec"
    top = _top(path)
    missing = re.fullmatch(r"Object missing required field `([^`]*)`", body)
    if missing:
        return SpecError(field, f"needs its field {missing[1]!r}")
    enum = re.fullmatch(r"Invalid enum value (.*)", body)
    if enum:
        allowed = choices.get(top) or choices.get(path.rsplit(".", 1)[-1]) or ()
        tail = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return SpecError(field, f"{enum[1]} is not allowed{tail}")
    pattern = re.fullmatch(r"Expected `str` matching regex '(.*)'", body)
    if pattern:
        want = (
            "a sha256 digest: 64 lowercase hex digits"
            if pattern[1] == "^[0-9a-f]{64}$"
            else f"a string matching {pattern[1]}"
        )
        return SpecError(field, f"must be {want}; got {_shown(value, top)}")
    expected = _EXPECTED.match(body)
    if expected:
        kinds = [_TYPES.get(k.strip(), k.strip()) for k in expected[1].split("|")]
        kinds = [k for k in kinds if k != _TYPES["null"]] or kinds
        want = " or ".join(kinds)
        if expected[3]:
            bound = expected[4].removesuffix(".0")  # 0.0 reads as 0
            want += ", " + _BOUNDS[expected[3]].format(bound)
        got = _shown(value, top)
        if top == "command" and isinstance(value, str):
            want += " (the program and its arguments, such as ['python', 'train.py'])"
        if top in choices:
            want += f"; allowed: {', '.join(choices[top])}"
        return SpecError(field, f"must be {want}; got {got}")
    return SpecError(field, body)


def _top(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def _nested_fields(path: str) -> list[str]:
    from .spec import ArtifactRef

    return list(ArtifactRef.__struct_fields__) if _top(path) == "inputs" else []


def _where(at: str, data: Mapping[str, Any]) -> tuple[str, Any]:
    """``at`` (msgspec's path, ``$`` gone, a map's key as ``[...]``) as a
    field name with each key filled in (``env.BATCH``, as check_spec names
    them), and the value found there. A map's
    key is the first whose value is wrong; msgspec does not say which."""
    at = at.strip().removeprefix("- at `$").removesuffix("`")
    parts: list[str] = []
    value: Any = data
    for attr, index in _STEP.findall(at):
        if attr:
            value = value.get(attr) if isinstance(value, Mapping) else None
            parts.append(("." if parts else "") + attr)
        elif index == "...":
            key, value = _suspect(value, at)
            parts.append(f".{key}")
        else:
            i = int(index)
            value = value[i] if isinstance(value, list) and i < len(value) else None
            parts.append(f"[{i}]")
    return "".join(parts), value


def _suspect(value: Any, at: str) -> tuple[str, Any]:
    """The entry of map ``value`` most likely meant: the first whose value
    is not a string where strings are expected (env, labels), else the first
    that is not a mapping (inputs), else the first."""
    if not isinstance(value, Mapping) or not value:
        return "?", None
    items = list(value.items())
    for key, item in items:
        if at.endswith("[...]") and not isinstance(item, str) and not isinstance(item, Mapping):
            return str(key), item
    for key, item in items:
        if not isinstance(item, str):
            return str(key), item
    return str(items[0][0]), items[0][1]


_KIND_NAMES = {"int": "a number", "float": "a number", "bool": "true/false", "null": "null"}
_KINDS = {bool: "true/false", int: "an int", float: "a number", str: "a string", list: "a list"}


def _shown(value: Any, field: str) -> str:
    """A value as the user gave it, cut short, and what kind it is; of a
    secret, the kind alone (its value is never shown back)."""
    kind = _KINDS.get(type(value), "a mapping" if isinstance(value, Mapping) else "nothing")
    if field == "secrets":
        return f"{kind} (its value is not shown)"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind})"


def unencodable_field(data: Any) -> str:
    """The first field of ``data`` (a spec's mapping) holding a string that
    UTF-8 cannot encode, named as check_spec names fields."""
    return _unencodable(data, "") or "spec"


def _unencodable(data: Any, path: str) -> str:
    if isinstance(data, Mapping):
        items: list[tuple[Any, Any]] = list(data.items())
    elif isinstance(data, list):
        items = list(enumerate(data))
    else:
        return ""
    for key, value in items:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        for text in (key, value):
            if isinstance(text, str):
                try:
                    text.encode()
                except UnicodeEncodeError:
                    return here
        found = _unencodable(value, here)
        if found:
            return found
    return ""
