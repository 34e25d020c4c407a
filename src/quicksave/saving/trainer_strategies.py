"""The trainer side's commit strategies of one saver: the checks before a save and the
clean-up of a save its writer never finished, one strategy per container, kept until
the saver closes. Their calls run on the training thread, so a store's are bounded by
the worker's ``save_timeout_s``.

Call order (the saver's training thread, under its lock): :meth:`TrainerStrategies.of`
per save → :meth:`TrainerStrategies.close` once, when the saver closes.
"""

from __future__ import annotations

from quicksave.commit import CommitStrategy, strategy_for
from quicksave.storage import Location


class TrainerStrategies:
    """One saver's commit strategies, by container (``Location.backend_id``).

    Args:
        rank: the saver's rank (the backends name it in errors).
        timeout_s: the bound on each store call of theirs.
    """

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._strategies: dict[tuple, CommitStrategy] = {}

    def of(self, loc: Location) -> CommitStrategy:
        """The strategy of ``loc``'s container (made on first use)."""
        key = loc.backend_id()
        if key not in self._strategies:
            bounded = loc.bounded(self.timeout_s)
            self._strategies[key] = strategy_for(bounded, bounded.open(rank=self.rank), owned=True)
        return self._strategies[key]

    def close(self) -> None:
        """Close every strategy (and the backend it owns)."""
        for strategy in self._strategies.values():
            strategy.close()
        self._strategies.clear()
