"""Tensors updated densely between incremental saves (``saving/incremental.py``): their
blocks are written without first being compared with the base.

A tensor larger than ``block_bytes`` is tracked in blocks, and a block of a tensor whose
version counter moved is still compared with the base (hashed), because a sparse update
(an embedding's looked-up rows) leaves most blocks of a written tensor unchanged. Where
the update is dense (every weight of an MLP at every step), that comparison finds every
block changed, and costs a hash of the whole tensor at every save on top of the copy's
(a deferred block's is hashed again when it is copied). :class:`DenseTensors` remembers
the tensors of which (at least ``share`` of) the blocks compared at one save all
changed; at the saves that follow, a block of such a tensor whose counter moved since
the previous save is taken as changed: copied and written without the comparison,
exactly as a full save writes it. One save in ``rest`` compares again, and the tensor
stays dense only if it still is.

Never stale: this only ever writes a block that might not have changed, never refers
to one that did. The cost of being wrong is bytes: a tensor whose update turns sparse
is written whole for at most ``rest`` saves.

Call order (one save at a time, the saver's lock): :meth:`begin` → :meth:`assumed` per
block whose counter is read → later :meth:`compared` with that save's outcome →
:meth:`forget` when the base goes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class DenseTensors:
    """Which tensors' blocks are taken as changed without a comparison (module doc).

    Args:
        rest: one save in ``rest`` compares a dense tensor's blocks again.
        share: the share of a tensor's compared blocks that must have changed for it
            to count as dense.
    """

    def __init__(self, rest: int = 8, share: float = 0.9) -> None:
        self.rest = rest
        self.share = share
        self._left: dict[str, int] = {}  # dense tensor (fqn) -> saves it stays so
        self._seen: dict[str, tuple[int, int]] = {}  # block -> (data_ptr, counter) last save

    def begin(self) -> None:
        """A new save: each dense tensor has one save fewer left."""
        for fqn, left in list(self._left.items()):
            if left <= 1:
                del self._left[fqn]
            else:
                self._left[fqn] = left - 1

    def assumed(self, fqn: str, block: str, seen: tuple[int, int]) -> bool:
        """Whether ``block`` of tensor ``fqn``, whose ``(data_ptr, counter)`` is
        ``seen`` now, is taken as changed: its tensor is dense and its counter moved
        since the previous save (the same memory)."""
        last = self._seen.get(block)
        self._seen[block] = seen
        return fqn in self._left and last is not None and last[0] == seen[0] and last[1] != seen[1]

    def compared(self, blocks: Mapping[str, str], referred: Mapping[str, int]) -> None:
        """A committed save's outcome: its blocks compared with the base (block -> its
        tensor's fqn), and the blocks of it that were ``referred`` to (found unchanged)."""
        total = Counter(blocks.values())
        changed = Counter([blocks[b] for b in blocks.keys() - referred.keys()])
        for fqn, n in total.items():
            if n > 1 and changed[fqn] >= self.share * n:
                self._left[fqn] = self.rest
            else:
                self._left.pop(fqn, None)

    def forget(self) -> None:
        self._left.clear()
        self._seen.clear()
