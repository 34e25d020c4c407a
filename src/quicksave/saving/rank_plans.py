"""Pure multi-rank save planning: local plans, the deduplicated global plan, delta
re-planning, and what a rank's plan cache holds of them (``RankShare``). No I/O and no
process group in here (``exchange`` holds the collectives), so 256 ranks can be planned
in one process.

Flow of one save (every rank): ``local_plan(state_dict, rank)`` → (exchange) →
coordinator: ``global_plan(local_plans)`` or ``delta(previous, changed)`` → each rank
gets ``GlobalPlan.layouts[rank]`` and writes exactly those chunks.

Example::

    plans = [local_plan(sd_of_rank[r], r) for r in range(4)]
    gp = global_plan(plans, thread_count=2)
    gp.layouts[1]          # what rank 1 writes (replicated chunks appear once overall)
    gp.skeleton.files      # every data file of the checkpoint, checksums still empty
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import xxhash

from quicksave.errors import IncompatibleStateError
from quicksave.format import ALIGNMENT
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_name, element_size
from quicksave.format.keys import names_itself
from quicksave.format.manifest import (
    Manifest,
    RankPlan,
)
from quicksave.layout.plan import ItemSpec, RankLayout, item_spec_of, layout_rank, planned_chunk
from quicksave.layout.skeleton import manifest_skeleton, placed_of
from quicksave.ranks import replicas
from quicksave.saving.collect import check_tensor, to_state_dict, whole_local
from quicksave.saving.keypaths import flatten_with_paths
from quicksave.saving.plan_cache import PlanCache

Path = tuple[Any, ...]  # nested state-dict path of a flattened fqn (str / int keys)


@dataclass(frozen=True)
class LocalPlan:
    """What one rank holds: every tensor chunk (sorted by fqn, offsets), the fqns of its
    non-tensor values, and nested paths of fqns that came from nested dicts/lists.

    ``key`` hashes everything except the values, so an unchanged structure gives the
    same key save after save (that is what the plan cache compares).
    """

    rank: int
    items: tuple[ItemSpec, ...]
    objects: tuple[str, ...]
    paths: tuple[tuple[str, Path], ...] = ()
    key: str = ""
    empty_dicts: tuple[Path, ...] = ()  # paths of empty dicts (keypaths.empty_dicts)


@dataclass(frozen=True)
class GlobalPlan:
    """The coordinator's plan for every rank of one save.

    Attributes:
        local_plans: the inputs, index = rank.
        assigned: per rank, the chunks it writes (each chunk of the checkpoint once).
        layouts: per rank, where those chunks go (``plan.layout_rank``).
        objects: per rank, the fqns of the non-tensor values it writes (lowest holder).
        skeleton: the manifest with every chunk and file placed and checksums empty.
        thread_count: data files per rank the layouts were made for.
        key: hash of the local plan keys and the layout parameters.
    """

    local_plans: tuple[LocalPlan, ...]
    assigned: tuple[tuple[ItemSpec, ...], ...]
    layouts: tuple[RankLayout, ...]
    objects: tuple[tuple[str, ...], ...]
    skeleton: Manifest
    thread_count: int
    alignment: int
    key: str


# ------------------------------------------------------------------- local side


def _hash(value: object) -> str:
    # repr() of tuples of str/int/dataclasses is deterministic across processes.
    return xxhash.xxh3_128_hexdigest(repr(value).encode("utf-8", "surrogatepass"))


def _chunks(
    fqn: str, leaf: torch.Tensor, rank: int | None
) -> Iterator[tuple[ItemSpec, torch.Tensor]]:
    """(chunk spec, local tensor holding it) for every chunk of ``leaf`` on this rank."""
    check_tensor(fqn, leaf, rank)
    name = type(leaf).__name__
    if name == "ShardedTensor":
        global_shape = tuple(int(s) for s in leaf.metadata().size)
        for shard in leaf.local_shards():
            md = shard.metadata
            yield (
                _spec(fqn, md.shard_offsets, md.shard_sizes, global_shape, shard.tensor),
                (shard.tensor.detach()),
            )
    elif name == "DTensor":
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(
            leaf.shape, leaf.device_mesh, leaf.placements
        )
        local = leaf.to_local().detach()
        yield _spec(fqn, offsets, sizes, tuple(leaf.shape), local), local
    else:
        shape = tuple(leaf.shape)
        yield _spec(fqn, (0,) * len(shape), shape, shape, leaf), leaf.detach()


def _whole(fqn: str, leaf: torch.Tensor, rank: int) -> torch.Tensor:
    """``leaf``'s local tensor, which holds all of it (``collect.whole_local``)."""
    check_tensor(fqn, leaf, rank)
    try:
        return whole_local(fqn, leaf)
    except IncompatibleStateError as e:
        raise IncompatibleStateError(e.message, fqn=fqn, rank=rank) from None


def _whole_spec(fqn: str, local: torch.Tensor) -> ItemSpec:
    """The one chunk of a whole tensor (its key is ``fqn``)."""
    shape = tuple(local.shape)
    dtype = local.dtype
    return ItemSpec(
        fqn, (0,) * len(shape), shape, shape, dtype_name(dtype), local.numel() * element_size(dtype)
    )


def _spec(fqn: str, offsets, sizes, global_shape, local: torch.Tensor) -> ItemSpec:
    sizes = tuple(int(s) for s in sizes)
    return ItemSpec(
        fqn=fqn,
        offsets=tuple(int(o) for o in offsets),
        sizes=sizes,
        global_shape=tuple(int(s) for s in global_shape),
        dtype=dtype_name(local.dtype),
        nbytes=math.prod(sizes) * element_size(local.dtype),
    )


@dataclass(frozen=True)
class LocalState:
    """One pass over this rank's state dict at ``save()``: what that save writes from,
    and the rank's plan of it (made on first use: a single-rank save whose shapes are
    unchanged never needs it, see :attr:`shape_key`).

    Attributes:
        rank: this rank.
        tensors: chunk key (``ItemSpec.key``) -> the local tensor holding it.
        values: fqn -> typed-JSON encoding of every non-tensor value (taken now).
        sources: chunk key -> the state dict's tensor holding it, whose version counter
            counts writes to it (a DTensor's local tensor has a counter of its own that
            in-place ops on the DTensor leave alone; see guard.py).
        paths: ``(fqn, key path)`` of every fqn that does not name its path alone.
        empty: the paths of the empty dicts (``keypaths.flatten_with_paths``).
        items: every chunk's ``ItemSpec``; None: every tensor is whole (``whole=True``),
            one chunk each, its key its fqn, and its spec made with :attr:`plan`.
        shape: :attr:`shape_key`, where the collector knows it already (the collect
            cache keeps it with the structure); None: made from the tensors.
        tracked: chunk key -> fqn of the chunks an incremental save may refer to
            instead of writing (``saving/incremental.py``); empty: none.
    """

    rank: int
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    sources: dict[str, torch.Tensor]
    paths: tuple[tuple[str, Path], ...] = ()
    empty: tuple[Path, ...] = ()
    items: tuple[ItemSpec, ...] | None = None
    shape: tuple | None = None
    tracked: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def plan(self) -> LocalPlan:
        """The rank's ``LocalPlan`` (cached, and sent to the coordinator)."""
        items = self.items
        if items is None:
            items = tuple(_whole_spec(fqn, t) for fqn, t in self.tensors.items())
        return make_local_plan(self.rank, items, list(self.values), self.paths, self.empty)

    @property
    def shape_key(self) -> tuple:
        """What a single-rank plan of whole tensors depends on, cheaper to make than
        :attr:`plan`'s key: names, dtypes and shapes, the values' names."""
        if self.shape is not None:
            return self.shape
        return (
            tuple((fqn, t.dtype, t.shape) for fqn, t in self.tensors.items()),
            tuple(self.values),
        )


def collect_local(state_dict: Mapping[str, Any], rank: int, *, whole: bool = False) -> LocalState:
    """Flatten ``state_dict`` once: this rank's plan, the local tensor of every chunk
    (``DTensor.to_local()``, a ShardedTensor's local shard tensors, plain tensors; all
    detached) and every value encoded (the encoding is also the check). The one
    collector of every save path: ``quicksave.save``, the engine's multi-rank saves and
    (``whole=True``) its single-rank ones.

    Args:
        state_dict: nested dicts/lists of tensors (plain, DTensor, ShardedTensor),
            ``Stateful`` objects at the top level, and JSON-encodable values.
        rank: this rank (recorded in the plan and in error messages).
        whole: every tensor must be whole on this rank (a single-rank saver's: plain
            tensors, or DTensors on a one-rank mesh; ``collect.whole_local``); each is
            then one chunk named by its fqn.

    Raises:
        IncompatibleStateError: a value quicksave cannot store (names fqn and rank).

    Example::

        state = collect_local({"model": model.state_dict(), "step": 3}, rank=0)
        state.plan.key, state.tensors, state.values["step"]
    """
    nested = to_state_dict(state_dict)
    flat, mappings, empty = flatten_with_paths(nested, rank)  # names as DCP names them
    items: list[ItemSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    paths: list[tuple[str, Path]] = []
    for fqn, leaf in flat.items():
        if isinstance(leaf, torch.Tensor):
            if whole:
                tensors[fqn] = _whole(fqn, leaf, rank)
                sources[fqn] = leaf
            else:
                for spec, local in _chunks(fqn, leaf, rank):
                    key = spec.key
                    items.append(spec)
                    tensors[key] = local
                    sources[key] = leaf if type(leaf).__name__ == "DTensor" else local
        else:
            try:
                values[fqn] = objcodec.encode(leaf, fqn)  # refused before any rank writes
            except IncompatibleStateError as e:
                raise IncompatibleStateError(e.message, fqn=fqn, rank=rank) from None
        path = tuple(mappings.get(fqn, (fqn,)))
        if not names_itself(path, fqn):
            paths.append((fqn, path))
    return LocalState(
        rank, tensors, values, sources, tuple(paths), tuple(empty), None if whole else tuple(items)
    )


def local_plan(state_dict: Mapping[str, Any], rank: int) -> LocalPlan:
    """This rank's local plan (``collect_local(...).plan``): every chunk it holds and the
    fqns of its values; its ``key`` changes only when the structure changes.

    Example::

        lp = local_plan({"model": model.state_dict(), "step": 3}, rank=0)
    """
    return collect_local(state_dict, rank).plan


def make_local_plan(
    rank: int,
    items: Sequence[ItemSpec],
    objects: Sequence[str] = (),
    paths: Sequence[tuple[str, Path]] | Mapping[str, Path] = (),
    empty: Sequence[Path] = (),
) -> LocalPlan:
    """A ``LocalPlan`` in canonical order with its key (for plans built without a state
    dict: restored from a manifest, or simulated).

    Example::

        make_local_plan(0, [ItemSpec("w", (0,), (4,), (4,), "float32", 16)], ["step"])
    """
    pairs = paths.items() if isinstance(paths, Mapping) else paths
    body = (
        tuple(sorted(items, key=lambda it: (it.fqn, it.offsets))),
        tuple(sorted(objects)),
        tuple(sorted(pairs, key=lambda p: p[0])),
        tuple(sorted(empty, key=repr)),
    )
    # Hash plain tuples: repr() of 500 dataclasses is the slow part of a cache hit.
    flat = tuple((i.fqn, i.offsets, i.sizes, i.global_shape, i.dtype, i.nbytes) for i in body[0])
    key = _hash((flat, body[1], body[2], body[3]) if body[3] else (flat, body[1], body[2]))
    return LocalPlan(rank, body[0], body[1], body[2], key, body[3])


# ------------------------------------------------------------------ global side


def plan_key(local_keys: Sequence[str], thread_count: int, alignment: int = ALIGNMENT) -> str:
    """The key of the global plan made from local plans with these keys."""
    return _hash((int(thread_count), int(alignment), tuple(local_keys)))


def _assign(
    local_plans: Sequence[LocalPlan],
) -> tuple[list[list[ItemSpec]], dict[str, tuple[str, tuple[int, ...]]]]:
    """Dedup: every distinct chunk to exactly one holder, balanced by bytes.

    Chunks only one rank holds are forced; shared chunks go, biggest first, to the
    holder with the fewest bytes so far (lowest rank on ties): deterministic.
    """
    holders: dict[tuple, list[int]] = {}
    first: dict[tuple, ItemSpec] = {}
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for r, lp in enumerate(local_plans):  # r: the index (the rank, but for one plan)
        for it in lp.items:
            m = meta.get(it.fqn)
            if m is None:
                meta[it.fqn] = (it.dtype, it.global_shape, lp.rank)
            elif m[0] != it.dtype or m[1] != it.global_shape:
                raise IncompatibleStateError(
                    f"ranks disagree on this tensor: rank {m[2]} has {m[0]} "
                    f"{list(m[1])}, rank {lp.rank} has {it.dtype} {list(it.global_shape)}",
                    fqn=it.fqn,
                    rank=lp.rank,
                )
            idx = (it.fqn, it.offsets, it.sizes)
            h = holders.get(idx)
            if h is None:
                holders[idx] = [r]
                first[idx] = it
            elif h[-1] != r:
                h.append(r)
    loads = [0] * len(local_plans)
    assigned: list[list[ItemSpec]] = [[] for _ in local_plans]
    shared = []
    for idx, h in holders.items():
        if len(h) == 1:
            it = first[idx]
            loads[h[0]] += it.nbytes
            assigned[h[0]].append(it)
        else:
            shared.append(idx)
    shared.sort(key=lambda idx: (-first[idx].nbytes, idx))
    for idx in shared:
        it = first[idx]
        chosen = min(holders[idx], key=loads.__getitem__)  # holders ascend: ties -> lowest
        loads[chosen] += it.nbytes
        assigned[chosen].append(it)
    for a in assigned:
        a.sort(key=lambda it: (it.fqn, it.offsets))
    return assigned, {fqn: (m[0], m[1]) for fqn, m in meta.items()}


def global_plan(
    local_plans: Sequence[LocalPlan],
    thread_count: int = 1,
    alignment: int = ALIGNMENT,
    *,
    previous: GlobalPlan | None = None,
) -> GlobalPlan:
    """Deduplicate and lay out every rank's chunks; build the manifest skeleton.

    Args:
        local_plans: one per rank, ``local_plans[r].rank == r`` (one plan alone: a
            single-rank save, of any rank; its manifest records no ``plans``, FORMAT.md §2).
        thread_count: data files (writer threads) per rank.
        alignment: byte alignment of chunks in data files.
        previous: an earlier plan; layouts of ranks whose assigned chunks did not change
            are reused from it (the result is identical either way).

    Returns:
        The ``GlobalPlan``.

    Raises:
        IncompatibleStateError: ranks disagree on a tensor's dtype or shape, a name is a
            tensor on one rank and a value on another, or shards miss/overlap elements.

    Example::

        gp = global_plan([local_plan(sd0, 0), local_plan(sd1, 1)], thread_count=2)
    """
    for r, lp in enumerate(local_plans):
        if lp.rank != r and len(local_plans) > 1:
            raise ValueError(f"local_plans[{r}] is rank {lp.rank}'s plan")
    assigned, meta = _assign(local_plans)
    reuse = (
        previous is not None
        and previous.thread_count == thread_count
        and previous.alignment == alignment
        and len(previous.assigned) == len(assigned)
    )
    layouts = []
    for r, items in enumerate(assigned):
        if reuse and previous.assigned[r] == tuple(items):  # type: ignore[union-attr]
            layouts.append(previous.layouts[r])  # type: ignore[union-attr]
        else:
            layouts.append(layout_rank(local_plans[r].rank, items, thread_count, alignment))
    owners: dict[str, int] = {}
    paths: dict[str, Path] = {}
    for r, lp in enumerate(local_plans):
        for fqn in lp.objects:
            if fqn in meta:
                raise IncompatibleStateError(
                    f"this name is a tensor on some rank and a non-tensor value on rank {lp.rank}",
                    fqn=fqn,
                    rank=lp.rank,
                )
            owners.setdefault(fqn, r)
        for fqn, p in lp.paths:
            paths.setdefault(fqn, p)
    per_rank_objects: list[list[str]] = [[] for _ in local_plans]
    for fqn, r in owners.items():
        per_rank_objects[r].append(fqn)
    files, placed = placed_of(layouts)
    skeleton = manifest_skeleton(
        meta,
        files,
        placed,
        dict.fromkeys(owners),
        world_size=len(local_plans),
        paths=paths,
        plans=manifest_plans(local_plans) if len(local_plans) > 1 else None,
        empty_dicts=tuple(sorted({e for lp in local_plans for e in lp.empty_dicts}, key=repr)),
    )
    key = plan_key([lp.key for lp in local_plans], thread_count, alignment)
    return GlobalPlan(
        local_plans=tuple(local_plans),
        assigned=tuple(tuple(a) for a in assigned),
        layouts=tuple(layouts),
        objects=tuple(tuple(sorted(o)) for o in per_rank_objects),
        skeleton=skeleton,
        thread_count=thread_count,
        alignment=alignment,
        key=key,
    )


# ---------------------------------------------------------------------- delta


def delta(
    previous: GlobalPlan,
    changed: Mapping[int, LocalPlan],
    thread_count: int | None = None,
    alignment: int | None = None,
) -> GlobalPlan:
    """The global plan after the ranks in ``changed`` replaced their local plans; the
    other ranks' plans come from ``previous``. Identical to ``global_plan`` of the merged
    plans; layouts of ranks whose share did not change are reused.

    Example::

        gp2 = delta(gp, {3: local_plan(new_sd_of_rank3, 3)})
    """
    tc = previous.thread_count if thread_count is None else thread_count
    al = previous.alignment if alignment is None else alignment
    merged = list(previous.local_plans)
    for r, lp in changed.items():
        if not 0 <= r < len(merged) or lp.rank != r:
            raise ValueError(f"changed plan for rank {r} does not fit a {len(merged)}-rank plan")
        merged[r] = lp
    if (
        tc == previous.thread_count
        and al == previous.alignment
        and all(merged[r].key == previous.local_plans[r].key for r in changed)
    ):
        return previous
    return global_plan(merged, tc, al, previous=previous)


# ------------------------------------------------------------- replicated entries


def local_copies(
    state: LocalState, keys: Iterable[str] | None = None, describe: bool = True
) -> dict[str, replicas.Copy]:
    """This rank's copies (engine planning): of ``keys`` only, or of every entry that
    could be shared (all values, and every chunk ``checked`` would compare)."""
    wanted = None if keys is None else set(keys)
    out: dict[str, replicas.Copy] = {}
    for fqn, encoded in state.values.items():
        key = replicas.value_key(fqn)
        if wanted is None or key in wanted:
            out[key] = replicas.value_copy(fqn, encoded, describe)
    for spec in state.plan.items:
        key = replicas.tensor_key(spec.key)
        if (wanted is None and spec.nbytes <= replicas.CHECK_BYTES) or (wanted and key in wanted):
            c = replicas.tensor_copy(spec.fqn, state.tensors[spec.key], describe)
            if c is not None:
                out[key] = c
    return out


def shared_keys(plans: Sequence[LocalPlan]) -> list[tuple[str, ...]]:
    """Per rank, its entries that another rank holds too and that are compared (values;
    chunks up to ``replicas.CHECK_BYTES``): what it fingerprints on a plan-cache hit."""
    holders: dict[str, int] = {}
    per_rank: list[list[str]] = []
    for lp in plans:
        keys = [replicas.value_key(fqn) for fqn in lp.objects]
        keys += [
            replicas.tensor_key(it.key) for it in lp.items if it.nbytes <= replicas.CHECK_BYTES
        ]
        for k in keys:
            holders[k] = holders.get(k, 0) + 1
        per_rank.append(keys)
    return [tuple(sorted(k for k in keys if holders[k] > 1)) for keys in per_rank]


# ------------------------------------------------------------------ plan cache


def _plans_from_manifest(manifest: Manifest) -> tuple[LocalPlan, ...] | None:
    """Every rank's local plan as stored in ``manifest.plans`` (None if absent)."""
    stored = manifest.plans
    if not stored or len(stored) != manifest.world_size:
        return None
    out = []
    for r, rp in enumerate(stored):
        items = []
        paths: dict[str, Path] = {}
        for c in rp.tensors:
            items.append(item_spec_of(c))
            t = manifest.tensors.get(c.fqn)
            if t is not None and t.path is not None:
                paths[c.fqn] = tuple(t.path)
        for fqn in rp.objects:
            o = manifest.objects.get(fqn)
            if o is not None and o.path is not None:
                paths[fqn] = tuple(o.path)
        out.append(make_local_plan(r, items, rp.objects, paths, rp.empty_dicts))
    return tuple(out)


def manifest_plans(local_plans: Sequence[LocalPlan]) -> tuple[RankPlan, ...]:
    """``local_plans`` as the manifest's ``plans`` entries (what a restart seeds from)."""
    return tuple(
        RankPlan(
            tensors=tuple(planned_chunk(it) for it in lp.items),
            objects=tuple(lp.objects),
            empty_dicts=lp.empty_dicts,
        )
        for lp in local_plans
    )


@dataclass(frozen=True)
class RankShare:
    """What a multi-rank save's plan gives one rank: the share its ``PlanCache`` holds.

    Attributes:
        layout: what this rank writes; ``objects``: the values it writes.
        key: the global plan's key (the same on every rank: what the ranks vote on).
        shared: this rank's entries that other ranks hold too and whose copies are
            compared (``shared_keys``): what it fingerprints on a hit.
    """

    layout: RankLayout
    objects: tuple[str, ...]
    key: str
    shared: tuple[str, ...] = ()


def seeded_cache(manifest: Manifest) -> PlanCache[RankShare]:
    """A plan cache seeded with the per-rank plans stored in a loaded checkpoint, so the
    first save after a restart needs no plan exchange when no rank's plan changed.

    Example::

        cache = seeded_cache(read_manifest("ckpt/step-100"))
    """
    return PlanCache(seed=_plans_from_manifest(manifest))


def reusable_key(
    cache: PlanCache[RankShare], local: LocalPlan, rank: int, context: tuple[int, int, int]
) -> str | None:
    """The global plan key this rank could reuse for ``local`` (from the last agreed
    plan, or from the checkpoint the cache was seeded from), or None (a miss)."""
    share = cache.lookup(local.key, context)
    if share is not None:
        return share.key
    seed = cache.seed
    if seed is not None and len(seed) == context[0] and seed[rank].key == local.key:
        return plan_key([lp.key for lp in seed], context[2])
    return None


def base_plans(cache: PlanCache[RankShare]) -> tuple[LocalPlan, ...] | None:
    """Every rank's last known local plan (coordinator side of a delta exchange)."""
    if isinstance(cache.plan, GlobalPlan):
        return cache.plan.local_plans
    return cache.seed
