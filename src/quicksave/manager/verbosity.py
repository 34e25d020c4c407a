"""``CheckpointConfig(log_level=...)``: the one switch that shows what quicksave does.

quicksave logs to the ``"quicksave"`` logger and, like any library, leaves logging
alone by default: its warnings and errors reach stderr through Python's last-resort
handler, its INFO lines (a resume, a commit) go nowhere until the application configures
logging. ``log_level="info"`` makes them visible without that: the logger is set to the
level and, if no handler would show its records (none on it or on its ancestors, the
root's included), it gets one that writes to stderr. An application that configured
logging itself keeps its handlers and format; only the level is set.

The manager that asked undoes it in ``close()`` (:meth:`Shown.undo`): its handler is
removed and the logger's level restored. No module state: what to undo is in the
returned object.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMAT = "%(asctime)s %(levelname)s %(message)s"


@dataclass
class Shown:
    """What :func:`show_logs` changed, to be undone once."""

    logger: logging.Logger
    previous_level: int
    handler: logging.Handler | None

    def undo(self) -> None:
        """Remove the handler added (if any) and restore the level."""
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()
            self.handler = None
        self.logger.setLevel(self.previous_level)


def show_logs(level: str | None, name: str = "quicksave") -> Shown | None:
    """Show the ``name`` logger's records from ``level`` up (see the module docstring).

    Args:
        level: ``"debug"``, ``"info"``, ``"warning"``, ``"error"``, or None (change
            nothing).
        name: the logger.

    Returns:
        What to undo, or None if ``level`` is None.

    Example::

        shown = show_logs("info")
        ...  # quicksave's INFO lines reach stderr
        shown.undo()
    """
    if level is None:
        return None
    logger = logging.getLogger(name)
    shown = Shown(logger, logger.level, None)
    logger.setLevel(LEVELS[level])
    if not logger.hasHandlers():
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        shown.handler = handler
    return shown
