"""What a chain of incremental saves keeps on disk (``IncrementalConfig.max_unused``;
``saving/incremental.py``): per older step that a base refers to, the bytes that step's
save wrote and the bytes of them the base's state still uses. The rest is *unused*: kept
only because the chain refers to that step (an earlier save's blocks changed since, its
untracked tensors). Once it exceeds the bound, the next save writes again the blocks the
least used of those steps still hold (:meth:`ChainDisk.victims`), so that it refers to
them no more and retention may delete them: a compaction, as a log-structured store's
cleaner picks its emptiest segments: what it costs is the bytes those steps still hold,
never the whole state for it. A frozen base referred to by every save leaves unused only
what its own save wrote besides it (the trainable and untracked bytes of that save), so
it is rewritten only where that alone exceeds the bound. Pure bookkeeping of one rank's
bytes: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ChainDisk:
    """One base's view of its chain's disk.

    Attributes:
        wrote: step -> the bytes its save of this rank wrote, for the base's own step
            and every older step it refers to.
        used: older step -> the bytes of it the base's state refers to.
        unused: what those older steps wrote that the base's state does not use.
        total: the bytes of this rank's state.
    """

    wrote: dict[int, int]
    used: dict[int, int]
    unused: int
    total: int

    @classmethod
    def after(
        cls,
        step: int,
        bases: Mapping[str, int],
        sizes: Mapping[str, int],
        total: int,
        before: ChainDisk | None,
    ) -> ChainDisk:
        """The chain's disk once the save of ``step`` committed, referring to
        ``bases`` (chunk -> step holding it; ``sizes``: chunk -> its bytes) from the base
        whose view was ``before`` (None: a full save)."""
        used: dict[int, int] = {}
        for key, held in bases.items():
            used[held] = used.get(held, 0) + sizes[key]
        known = {} if before is None else before.wrote
        # (a step the base did not know: taken as a whole state's bytes, so it goes soon)
        wrote = {held: known.get(held, total) for held in used}
        wrote[step] = total - sum(used.values())
        unused = sum(max(0, wrote[held] - n) for held, n in used.items())
        return cls(wrote, used, unused, total)

    def victims(self, limit: float | None) -> frozenset[int]:
        """The older steps that the next save stops referring to (their blocks written
        again), so that at most ``limit`` × the state's bytes stay unused, at the least
        bytes written again that this finds: the cheapest single step that frees enough
        alone, or else the steps that free the most per byte written again first (the
        least used of what they wrote; the older first among equals), whichever writes
        less. None: no bound."""
        if limit is None or self.unused <= limit * self.total:
            return frozenset()
        used, wrote = self.used, self.wrote
        excess = self.unused - limit * self.total
        freed = {s: max(0, wrote[s] - n) for s, n in used.items()}
        greedy, left = [], excess
        for step in sorted(used, key=lambda s: (used[s] / max(1, wrote[s]), s)):
            if left <= 0:
                break
            greedy.append(step)
            left -= freed[step]
        alone = [s for s in used if freed[s] >= excess]
        if alone:
            single = min(alone, key=lambda s: (used[s], s))
            if used[single] <= sum(used[s] for s in greedy):
                return frozenset({single})
        return frozenset(greedy)
