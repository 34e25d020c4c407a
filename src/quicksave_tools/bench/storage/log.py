"""Progress lines of ``quicksave bench --storage`` (:func:`say`) and the one-line
reason a method failed (:func:`why`)."""

from __future__ import annotations

from typing import Any


def say(log: Any, text: str) -> None:
    if log is not None:
        print(text, file=log, flush=True)


def why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 400 else text[:399] + "…"
