"""The one manifest builder: a save's manifest fixed before its bytes are written (the
skeleton), then filled from what the ranks' writers report.

Every save path builds its manifest here:

- the engine (one rank: ``engine_plan.plan_one_rank``; several: the plan exchange) and
  ``quicksave.save``: the skeleton at plan time, from the ranks' layouts, through
  ``rank_plans.global_plan``;
- ``quicksave.StorageWriter`` (``dcp.save``): at the commit, from DCP's global metadata
  and the layouts it fixed in ``prepare_global_plan``;
- the NVRx-compatible writer's DCP layout: at the commit, from DCP's global metadata and
  the places the ranks' parts report (that layout's offsets are known only once written).

Then one filler, :func:`quicksave.commit.parts.manifest_from_parts`, puts in each chunk's
checksum and each object's value from one ``RankPart`` per rank (read from storage, sent
in ``quicksave.save``'s commit round, or made from DCP's write results), and refuses a
chunk nobody reported, one reported twice or one the plan does not have.

Pure and torch-free: the worker process imports the filler's module, and this one is as
cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quicksave.errors import IncompatibleStateError
from quicksave.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    RankPlan,
    TensorEntry,
)
from quicksave.layout.plan import ItemSpec, RankLayout, chunk_key

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Placed:
    """Where one chunk's bytes go: ``length`` bytes at ``offset`` of data file ``file``,
    written by ``rank``."""

    item: ItemSpec
    file: str
    offset: int
    length: int
    rank: int


def placed_of(layouts: Iterable[RankLayout]) -> tuple[dict[str, FileEntry], list[Placed]]:
    """The data files and chunk places of quicksave-layout files (every offset known at
    plan time)."""
    files: dict[str, FileEntry] = {}
    placed: list[Placed] = []
    for layout in layouts:
        for f in layout.files:
            files[f.name] = FileEntry(f.size, f.header_xxh3_64, layout.rank, f.data_start)
            placed.extend(
                Placed(e.item, f.name, e.offset, e.length, layout.rank) for e in f.entries
            )
    return files, placed


def manifest_skeleton(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    files: Mapping[str, FileEntry],
    placed: Iterable[Placed],
    objects: Mapping[str, Any],
    *,
    world_size: int,
    paths: Mapping[str, Path] | None = None,
    plans: tuple[RankPlan, ...] | None = None,
    empty_dicts: tuple = (),
) -> Manifest:
    """The manifest with every chunk placed and checksums empty.

    Args:
        tensors: fqn -> (dtype name, global shape), in the order the manifest keeps.
        files: every data file.
        placed: every chunk (each exactly once).
        objects: fqn -> the value's typed JSON, or ``None`` where a rank's part brings it.
        world_size: ranks that save.
        paths: fqn -> key path into the nested state dict, where it is not the fqn.
        plans: every rank's plan (the manifest's ``plans``; ``None`` for one rank).
        empty_dicts: key paths of empty containers.

    Raises:
        IncompatibleStateError: a chunk of an unknown tensor, or a tensor whose chunks do
            not cover its elements exactly once (missing or overlapping shards).
    """
    paths = paths or {}
    chunks: dict[str, list[ChunkEntry]] = {fqn: [] for fqn in tensors}
    writer_of: dict[str, int] = {}
    for p in placed:
        it = p.item
        if it.fqn not in chunks:
            raise IncompatibleStateError("a chunk of a tensor the plan does not have", fqn=it.fqn)
        chunks[it.fqn].append(ChunkEntry(it.offsets, it.sizes, p.file, p.offset, p.length, ""))
        writer_of.setdefault(it.fqn, p.rank)
    entries: dict[str, TensorEntry] = {}
    for fqn, (dtype, shape) in tensors.items():
        cs = chunks[fqn]
        _check_coverage(fqn, shape, cs, writer_of.get(fqn))
        cs.sort(key=lambda c: c.offsets)
        entries[fqn] = TensorEntry(dtype, tuple(shape), tuple(cs), paths.get(fqn))
    return Manifest(
        step=None,
        world_size=world_size,
        tensors=entries,
        objects={fqn: ObjectEntry(v, paths.get(fqn)) for fqn, v in objects.items()},
        files=dict(files),
        plans=plans,
        empty_dicts=tuple(empty_dicts),
    )


def chunk_keys_of(skeleton: Manifest) -> dict[str, tuple[str, int]]:
    """Safetensors chunk key -> (fqn, chunk index) of every chunk of ``skeleton``: how
    the filler finds the chunk a part's checksum belongs to."""
    return {
        chunk_key(fqn, c.offsets, c.sizes, t.shape): (fqn, i)
        for fqn, t in skeleton.tensors.items()
        for i, c in enumerate(t.chunks)
    }


def _check_coverage(
    fqn: str, shape: Sequence[int], chunks: list[ChunkEntry], rank: int | None
) -> None:
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        raise IncompatibleStateError(
            f"the ranks' chunks cover {covered} of {math.prod(shape)} elements of this "
            f"{list(shape)} tensor (missing or overlapping shards; every element must be "
            "held by some rank, and shards must not overlap)",
            fqn=fqn,
            rank=rank,
        )
