"""The tracked split of a save's state for incremental saves (``saving/incremental.py``):
every tensor of at least ``min_bytes`` is *tracked*; one larger than ``block_bytes``
becomes row blocks along dim 0 of about that size, each a chunk of its own. The split
depends on names, dtypes and shapes only, so the layout, the plan cache's entry and the
staging pool are the same at every save, whatever changed; the block views are cut
again only when a tensor's memory, layout or version counter changed since the last save."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from quicksave.format.dtypes import dtype_name, element_size
from quicksave.layout.plan import ItemSpec
from quicksave.saving.config import IncrementalConfig
from quicksave.saving.guard import counter
from quicksave.saving.rank_plans import LocalState


@dataclass(frozen=True)
class _Split:
    """The tracked chunks of one structure (its ``shape_key``)."""

    items: tuple[ItemSpec, ...]  # every chunk of the save, blocks included
    rows: dict[str, tuple[tuple[str, int, int], ...]]  # fqn -> its blocks (key, start, end)
    tracked: dict[str, str]  # chunk key -> fqn of every tracked chunk


def _specs(state: LocalState) -> list[tuple[ItemSpec, torch.Tensor]]:
    """Every chunk of ``state`` with its local tensor (a whole tensor: one chunk)."""
    if state.items is not None:
        return [(spec, state.tensors[spec.key]) for spec in state.items]
    out = []
    for fqn, t in state.tensors.items():
        shape = tuple(int(s) for s in t.shape)
        nbytes = math.prod(shape) * element_size(t.dtype)
        out.append((ItemSpec(fqn, (0,) * len(shape), shape, shape, dtype_name(t.dtype), nbytes), t))
    return out


def _split_of(state: LocalState, config: IncrementalConfig) -> _Split:
    items: list[ItemSpec] = []
    rows: dict[str, tuple[tuple[str, int, int], ...]] = {}
    tracked: dict[str, str] = {}
    for spec, _ in _specs(state):
        sizes, nbytes = spec.sizes, spec.nbytes
        if nbytes <= config.block_bytes or len(sizes) == 0 or sizes[0] < 2:
            items.append(spec)
            if nbytes >= config.min_bytes:
                tracked[spec.key] = spec.fqn
            continue
        row = nbytes // sizes[0]
        per = max(1, config.block_bytes // max(row, 1))
        blocks = []
        for start in range(0, sizes[0], per):
            end = min(start + per, sizes[0])
            offsets = (spec.offsets[0] + start, *spec.offsets[1:])
            sub = (end - start, *sizes[1:])
            block = ItemSpec(
                spec.fqn, offsets, sub, spec.global_shape, spec.dtype, (end - start) * row
            )
            items.append(block)
            blocks.append((block.key, start, end))
            tracked[block.key] = spec.fqn
        rows[spec.key] = tuple(blocks)
    return _Split(tuple(items), rows, tracked)


class Blocks:
    """The tracked split of the latest structure (one entry, like the plan cache).

    Attributes:
        kept: the blocks of the latest :meth:`blocked` whose views were kept from the
            call before: their tensor's address, layout and version counter had not
            changed since (a save's *steady* blocks; a hint, never proof of bytes).
    """

    def __init__(self, config: IncrementalConfig) -> None:
        self.config = config
        self._memo: tuple[object, _Split] | None = None
        # tensor name -> (_cut_key, its block views): the last save's
        self._views: dict[
            str, tuple[tuple | None, list[tuple[str, torch.Tensor, torch.Tensor]]]
        ] = {}
        self.kept: frozenset[str] = frozenset()

    def blocked(self, state: LocalState) -> LocalState:
        """``state`` with its tracked chunks as chunks of their own: the large ones as
        row blocks (views, no copy). Its ``shape_key`` (whole tensors) or its items
        (chunks: several ranks) name the split, so a plan made from it is never taken
        for a plan of the chunks unsplit."""
        key = state.shape_key if state.items is None else state.items
        memo = self._memo
        if memo is None or memo[0] != key:
            memo = (key, _split_of(state, self.config))
            self._memo = memo
        split = memo[1]
        tensors: dict[str, torch.Tensor] = {}
        sources: dict[str, torch.Tensor] = {}
        views, self._views = self._views, {}
        kept_keys: list[str] = []
        with torch.no_grad():  # (views of parameters: no autograd graph)
            for name, t in state.tensors.items():
                blocks = split.rows.get(name)
                src = state.sources.get(name, t)
                if blocks is None:
                    tensors[name] = t
                    sources[name] = src
                    continue
                sliced = type(src).__name__ != "DTensor"  # (its shape is the global one)
                at = _cut_key(t, src) if sliced else None  # (None: not kept)
                kept = views.get(name)
                # (the first kept view starts at row 0: still on the tensor's memory, or
                # its storage was resized away under it and another lies there now)
                if (
                    at is None
                    or kept is None
                    or kept[0] != at
                    or kept[1][0][1].data_ptr() != t.data_ptr()
                ):
                    # (a DTensor's own counter is kept: the DTensor itself)
                    cut = [(k, t[a:b], src[a:b] if sliced else src) for k, a, b in blocks]
                    kept = (at, cut)
                else:
                    kept_keys += [k for k, _, _ in kept[1]]
                self._views[name] = kept
                for k, view, src_view in kept[1]:
                    tensors[k] = view
                    sources[k] = src_view
        self.kept = frozenset(kept_keys)
        cfg = self.config
        shape = state.shape_key if state.items is None else state.shape
        return dataclasses.replace(
            state,
            tensors=tensors,
            sources=sources,
            items=split.items,
            shape=None if shape is None else (shape, "blocks", cfg.block_bytes, cfg.min_bytes),
            tracked=split.tracked,
        )


def _cut_key(t: torch.Tensor, src: torch.Tensor) -> tuple | None:
    """What block views of ``t`` and ``src`` depend on: where their memory starts, how it
    is laid out, and the source's counter. A state dict's tensors are new objects at
    every save (``detach()``), but a view kept from an earlier one with the same key
    reads the same bytes: its storage is held, so no other can lie at that address
    (:class:`Blocks` keeps the views of the last save only). A kept source view has the
    counter of the tensor it was cut from; should the memory now belong to another
    tensor whose counter happens to read the same, the counter only misleads the way
    it always may (``incremental.py``: counters never decide that a block is unchanged
    unchecked)."""
    version = counter(src)
    if version is None:  # (an inference tensor) cut at every save
        return None
    return (t.data_ptr(), t.stride(), t.dtype, src.data_ptr(), src.stride(), version)
