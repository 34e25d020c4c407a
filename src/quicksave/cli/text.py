"""Text for a terminal: names from a checkpoint are shown, never interpreted.

An fqn, a dtype, a file or directory name, an error message: anything from a checkpoint
may hold terminal control sequences (``ESC [ 2 J`` clears the screen, OSC 8 makes
links, OSC 52 writes the clipboard). Every human-readable line the CLI prints goes
through :func:`printable`, which shows control characters as Python-style escapes
(``\\x1b``, ``\\u202e``). ``--json`` output stays JSON: :func:`json_text` escapes the
same characters as ``\\u`` escapes, which JSON already allows.
"""

from __future__ import annotations

import json
import re
from typing import Any, TextIO

# C0 controls, DEL, C1 controls; the Unicode line/paragraph separators and the bidi
# embedding/override/isolate controls, which reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control character shown as an escape.

    Example::

        printable("a\\x1b[2Jb") == "a\\\\x1b[2Jb"
    """
    return _CONTROL.sub(_escape, str(text))


# json.dumps already escapes C0 controls in strings (and the newlines of ``indent`` are
# structure); these are the ones it leaves raw with ``ensure_ascii=False``.
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def json_text(doc: Any) -> str:
    """``doc`` as indented JSON (non-ASCII kept readable) with no raw control
    character: inside JSON strings they become ``\\u`` escapes, which parse back to
    the same text."""
    return _JSON_RAW.sub(_json_escape, json.dumps(doc, indent=2, ensure_ascii=False))


def say(text: str, out: TextIO) -> None:
    """Print one human-readable line, control characters escaped."""
    print(printable(text), file=out)


def print_json(doc: Any, out: TextIO) -> None:
    """Print ``doc`` as :func:`json_text`, with a final newline."""
    out.write(json_text(doc))
    out.write("\n")
