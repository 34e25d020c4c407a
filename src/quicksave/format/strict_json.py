"""JSON as quicksave reads it from a checkpoint: RFC 8259 with limits (FORMAT.md §2).

Python's ``json`` module accepts ``NaN``/``Infinity``, turns ``1e999`` into ``inf``,
raises ``RecursionError`` on deep nesting and ``ValueError`` on integers over 4,300
digits. A checkpoint may come from anywhere, so
every such case is a :class:`~quicksave.errors.CorruptCheckpointError` here:

- integer literals have at most :data:`MAX_INT_DIGITS` digits;
- no ``NaN``, ``Infinity`` or ``-Infinity``; no number literal that overflows a float;
- nesting: input deeper than the interpreter's recursion limit is rejected while
  parsing; :func:`check_depth` bounds a parsed value at :data:`MAX_DEPTH` levels
  without recursion (callers apply it to the free-form parts, whose depth the format's
  structure does not fix).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from quicksave.errors import CorruptCheckpointError

MAX_DEPTH = 100
MAX_INT_DIGITS = 256
_MAX_INT = 10**MAX_INT_DIGITS


class JSONLimitError(ValueError):
    """A JSON text breaks one of the limits above (the message says which)."""


def _parse_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise JSONLimitError(f"integer literal longer than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONLimitError(f"number {text[:40]!r} does not fit a float")
    return value


def _parse_constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not valid JSON")


_STRICT = json.JSONDecoder(
    parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
)
# Without an integer hook (each integer parsed in C): used when no run of digits in the
# text is longer than the limit, so no integer literal can be.
_FAST = json.JSONDecoder(parse_float=_parse_float, parse_constant=_parse_constant)
_LONG_DIGITS = re.compile(rf"[0-9]{{{MAX_INT_DIGITS + 1}}}")


def depth_exceeds(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests more than ``limit`` levels, without
    recursion. A scalar has depth 0, ``[]`` depth 1, ``[[1]]`` depth 2."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth + 1 > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def unwritable(value: Any, limit: int = MAX_DEPTH) -> str | None:
    """Why readers would refuse ``value`` (plain JSON data a writer is about to store),
    or None: nesting deeper than ``limit``, an integer over :data:`MAX_INT_DIGITS`
    digits, a non-finite float. Iterative, so a value containing itself is caught."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int):
            if not -_MAX_INT < node < _MAX_INT:
                return f"an integer has more than {MAX_INT_DIGITS} digits"
        elif isinstance(node, float):
            if not math.isfinite(node):
                return "NaN and infinite floats are not JSON"
        elif isinstance(node, (dict, list, tuple)):
            if depth + 1 > limit:
                return f"nests deeper than {limit} levels (or contains itself)"
            stack.extend(
                (c, depth + 1) for c in (node.values() if isinstance(node, dict) else node)
            )
    return None


def check_depth(value: Any, *, what: str, path: str | None, fqn: str | None = None) -> None:
    """Raise CorruptCheckpointError if ``value`` nests deeper than :data:`MAX_DEPTH`."""
    if depth_exceeds(value):
        raise CorruptCheckpointError(
            f"{what} nests deeper than {MAX_DEPTH} levels", path=path, fqn=fqn
        )


def loads(text: str, *, what: str, path: str | None) -> Any:
    """Parse ``text`` under the limits of this module.

    Args:
        text: the JSON text (already decoded from bytes).
        what: how errors call it (``"manifest"``, ``"safetensors header"`` ...).
        path: the file, named in errors.

    Raises:
        CorruptCheckpointError: invalid JSON, or a limit is broken.
    """
    decoder = _STRICT if _LONG_DIGITS.search(text) else _FAST
    try:
        value = decoder.decode(text)
    except RecursionError:
        raise CorruptCheckpointError(
            f"{what} nests deeper than {MAX_DEPTH} levels", path=path
        ) from None
    except JSONLimitError as e:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {e}", path=path) from None
    except ValueError as e:  # json.JSONDecodeError and int() failures
        raise CorruptCheckpointError(f"{what} is not valid JSON: {e}", path=path) from None
    return value
