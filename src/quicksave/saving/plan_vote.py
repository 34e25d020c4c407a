"""Multi-rank save planning: the vote that settles a save, the plan exchange on a miss,
and ``plan_save`` that orchestrates them (the collectives themselves are
``ranks.collectives`` and ``ranks.exchange.central_round``).

Call order (every rank of ``group``, once per save, same order everywhere):

1. ``collect_local`` (pure, no communication: the plan, the local tensors, the values);
2. ``agree_save`` — ONE ``all_reduce(MIN)`` of nine small integers: can every rank save,
   is every rank ready now, did planning fail somewhere, does every rank hold a cached
   plan with the same key, are the copies of the entries several ranks hold equal
   (``replicas``), and a fresh random id for this save; and the integers the saver's
   owner has ride on it (``Rider``: the manager's outcome of earlier saves, a MAX sent
   as a MIN of negations). In steady state this is the only collective. A rank still
   busy (its previous save, a worker starting) votes "not ready" after a bounded wait
   and every rank votes again, so that no rank waits in a collective for another's
   unbounded local work (a gloo timeout would break the group for good);
3. on a miss only, ``exchange_plans``: one ``central_round`` (``ranks/exchange.py``: the
   plan exchange, shared with the NVRx-compatible API): ``gather_object`` of the plans
   that changed (the others send their plan's key) to the coordinator, which re-plans
   (``delta``), and ``scatter_object_list`` sends every rank its share. If the
   coordinator lacks a plan a rank thought it had (e.g. it restarted), one more
   gather/scatter round fetches it.
   Every rank sends its copies of shared entries too, and the coordinator compares
   them: copies that differ fail the save on every rank (``replicas.divergence``). A
   cache hit whose fingerprints of shared copies differ takes this path too, so that
   the coordinator can name what differs.

Example::

    cache = PlanCache()  # saving/plan_cache.py
    planned = plan_save(state_dict, cache, group, 0, rank, world_size, thread_count=2)
    planned.layout       # what this rank writes
    planned.token        # same on every rank, new for every save
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xxhash

from quicksave.errors import CheckpointError
from quicksave.format.manifest import Manifest
from quicksave.layout.plan import RankLayout
from quicksave.ranks import collectives as talk
from quicksave.ranks.exchange import central_round, collective_error
from quicksave.ranks.replicas import NEUTRAL, Copy, divergence, fingerprint
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.rank_plans import (
    GlobalPlan,
    LocalPlan,
    LocalState,
    RankShare,
    base_plans,
    collect_local,
    global_plan,
    local_copies,
    reusable_key,
    shared_keys,
)
from quicksave.trace import phase

__all__ = [
    "Agreement",
    "ExchangeResult",
    "PlannedSave",
    "Rider",
    "agree_reuse",
    "agree_save",
    "exchange_plans",
    "plan_save",
]

_RAND_BITS = 56  # the save id; the rest of int64 stays free for the reduction
_FP_BITS = 60


@dataclass(frozen=True)
class PlannedSave:
    """This rank's share of one planned save.

    Attributes:
        layout: what THIS rank writes (replicated chunks deduplicated across ranks).
        objects: fqns of the non-tensor values this rank writes (lowest holder).
        skeleton: coordinator only: the manifest with every rank's chunks and files
            placed and checksums empty (objects are ``ObjectEntry(None, path)``).
        token: the same on every rank for this save, new for every save.
        key: the global plan's key (the same on every rank).
        collectives: collectives this call ran (1 on a steady-state cache hit).
        tensors: chunk key -> this rank's local tensor holding it (every chunk it holds).
        values: fqn -> typed-JSON value of each object in ``objects``, taken at the call.
        sources: chunk key -> the tensor whose version counter tracks its writes.
        tracked: chunk key -> fqn of the chunks an incremental save may refer to.
    """

    layout: RankLayout
    objects: tuple[str, ...]
    skeleton: Manifest | None
    token: str
    key: str
    collectives: int
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    tracked: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Agreement:
    """What ``agree_save`` settled, identical on every rank."""

    failed_rank: int | None  # lowest rank whose local planning failed
    go: bool  # every rank can save now
    ready: bool  # every rank is ready now (else every rank votes again)
    reuse: bool  # every rank holds a cached plan with the same key
    save_id: int  # fresh random number, the same on every rank
    same_copies: bool = True  # every rank's fingerprint of its shared copies is equal
    carried: tuple[int, ...] = ()  # per carried value, its MAX over the ranks


class Rider(Protocol):
    """Integers that ride on a save's vote: an agreement of the saver's owner (the
    manager's outcome of earlier saves) that costs no collective of its own.

    Call order (every rank, inside ``plan_save``): ``values()`` before each round of
    votes; ``agreed(maxima)`` once, when ``plan_save`` returns (a plan or a skip: every
    rank alike), with each value's MAX over the ranks from the last round. Not called
    when planning raises (every rank raises then, and agrees in its own way).
    """

    def values(self) -> Sequence[int]:
        """This rank's values now (the same number on every rank, each >= -2**62)."""
        ...

    def agreed(self, maxima: tuple[int, ...]) -> None:
        """Each value's MAX over the ranks, the same on every rank."""
        ...


@dataclass(frozen=True)
class ExchangeResult:
    """What ``exchange_plans`` gave this rank."""

    layout: RankLayout
    objects: tuple[str, ...]
    key: str
    plan: GlobalPlan | None  # coordinator only
    collectives: int
    shared: tuple[str, ...] = ()  # this rank's compared entries (``PlanCache.shared``)


def reuse_votes(hit_key: str | None) -> list[int]:
    """This rank's entries of the plan-reuse agreement, for a ``MIN`` all-reduce: hit
    (0/1), the key's fingerprint and its negation (the MIN of both is the min and the
    max: equal iff every rank holds the same key). ``hit_key``: the key of the plan this
    rank could reuse, the same on every rank that could; None: a miss."""
    if hit_key is None:
        return [0, 0, 0]
    fp = xxhash.xxh3_64_intdigest(hit_key.encode("utf-8", "surrogatepass")) >> (64 - _FP_BITS)
    return [1, fp, -fp]


def reuse_agreed(minima: Sequence[int]) -> bool:
    """Whether every rank may reuse, from the MIN of every rank's :func:`reuse_votes`."""
    hit_min, fp_min, neg_fp_min = minima
    return hit_min == 1 and fp_min == -neg_fp_min


def agree_reuse(hit_key: str | None, group: Any, *, distributed: bool = True) -> bool:
    """The plan-reuse agreement alone: True on every rank iff every rank holds a reusable
    plan with the same key (ONE ``all_reduce(MIN)`` of three int64s; ``distributed=False``:
    this process alone, no collective). ``agree_save`` carries the same entries in the
    save's one vote; the NVRx-compatible saver asks this
    (``compat/nvrx/state_dict_saver.agree_plan_reuse``).

    Example::

        if agree_reuse(cache_key if unchanged else None, group):
            plan = cached_plan
    """
    votes = reuse_votes(hit_key)
    return reuse_agreed(talk.all_reduce_ints(votes, "min", group) if distributed else votes)


def agree_save(
    *,
    go: bool,
    failed: bool,
    hit_key: str | None,
    rank: int,
    world_size: int,
    group: Any,
    ready: bool = True,
    copies: int | None = None,
    carry: Sequence[int] = (),
) -> Agreement:
    """ONE ``all_reduce(MIN)`` of nine int64s (and the negation of each ``carry`` value)
    that settles everything a save needs agreed.

    Entries: go (0/1); ready (0/1); failed rank (``rank`` if this rank's planning failed,
    else ``world_size``); the plan-reuse agreement (:func:`reuse_votes`: every rank
    reuses the same global plan); the fingerprint of this rank's shared copies
    (``replicas.fingerprint``; None: it holds none) and its negation, the same way (a
    rank without copies votes ``NEUTRAL`` twice, above any fingerprint, so it does not
    count); a random id; then ``-v`` for each ``v`` of ``carry`` (a MIN of negations is
    the MAX: ``Agreement.carried``).

    Example::

        a = agree_save(go=True, failed=False, hit_key=k, rank=r, world_size=n, group=g)
    """
    values = talk.all_reduce_ints(
        [
            1 if go else 0,
            1 if ready else 0,
            rank if failed else world_size,
            *reuse_votes(hit_key),
            NEUTRAL if copies is None else copies,
            NEUTRAL if copies is None else -copies,
            secrets.randbits(_RAND_BITS),
            *(-int(v) for v in carry),
        ],
        "min",
        group,
    )
    go_min, ready_min, failed_min = values[:3]
    cp_min, neg_cp_min, save_id = values[6:9]
    return Agreement(
        failed_rank=failed_min if failed_min < world_size else None,
        go=go_min == 1,
        ready=ready_min == 1,
        reuse=reuse_agreed(values[3:6]),
        save_id=save_id,
        same_copies=cp_min == NEUTRAL or cp_min == -neg_cp_min,
        carried=tuple(-v for v in values[9:]),
    )


def exchange_plans(
    local: LocalPlan,
    cache: PlanCache[RankShare],
    group: Any,
    coordinator: int,
    *,
    rank: int,
    world_size: int,
    thread_count: int,
    copies: Mapping[str, Copy] | None = None,
) -> ExchangeResult:
    """Re-plan after a miss: changed plans go to the coordinator, shares come back.

    Ranks whose plan the coordinator already holds (from the last exchange or from the
    checkpoint the cache was seeded from) send only its key (a delta exchange).
    ``copies`` (this rank's copies of entries other ranks may hold, ``replicas``) go
    with it; the coordinator compares them.

    Raises:
        CheckpointError: the coordinator's planning refused the plans, or ranks hold
            different copies of one entry (``IncompatibleStateError``); every rank raises
            the same error, naming fqn and rank.
    """
    known = cache.local if cache.local is not None else None
    seeded = cache.seed[rank] if cache.seed is not None and rank < len(cache.seed) else None
    coordinator_has = (known is not None and known.key == local.key) or (
        seeded is not None and seeded.key == local.key
    )
    send: LocalPlan | str = local.key if coordinator_has else local
    mine = dict(copies or {})
    collectives = 0
    previous = cache.plan
    for _round in range(2):

        def decide(gathered: list) -> list:
            nonlocal previous
            payloads, previous = _coordinate(gathered, cache, world_size, thread_count)
            return payloads

        reply = central_round((send, mine), decide, group, coordinator, rank)
        collectives += 2
        if reply[0] == "resend":
            if rank in reply[1]:
                send = local
            continue
        _, layout, objects, key, shared = reply
        return ExchangeResult(
            layout, objects, key, previous if rank == coordinator else None, collectives, shared
        )
    raise CheckpointError("the coordinator still lacks some ranks' plans after a resend", rank=rank)


def _coordinate(
    gathered: list, cache: PlanCache[RankShare], world_size: int, thread_count: int
) -> tuple[list, GlobalPlan | None]:
    """Coordinator: merge sent plans with known ones, plan, compare the ranks' copies
    of shared entries; one reply per rank.

    Raises:
        CheckpointError: the plans are refused, or copies of a shared entry differ
            (``central_round`` raises it on every rank).
    """
    base = base_plans(cache)
    if base is not None and len(base) != world_size:
        base = None
    merged: list[LocalPlan] = []
    missing: list[int] = []
    for r, (g, _copies) in enumerate(gathered):
        if isinstance(g, LocalPlan):
            merged.append(g)
        elif base is not None and base[r].key == g:
            merged.append(base[r])
        else:
            missing.append(r)
    if missing:
        return [("resend", tuple(missing))] * world_size, cache.plan
    previous = cache.plan
    if previous is not None and len(previous.layouts) != world_size:
        previous = None
    gp = global_plan(merged, thread_count, previous=previous)
    differ = divergence([c for _, c in gathered])
    if differ is not None:
        raise differ
    shared = shared_keys(merged)
    replies = [("ok", gp.layouts[r], gp.objects[r], gp.key, shared[r]) for r in range(world_size)]
    return replies, gp


def plan_save(
    state_dict: Mapping[str, Any],
    cache: PlanCache[RankShare],
    group: Any,
    coordinator: int,
    rank: int,
    world_size: int,
    thread_count: int,
    go: bool = True,
    ready: Callable[[], bool | None] | None = None,
    rider: Rider | None = None,
    blocked: Callable[[LocalState], LocalState] | None = None,
) -> PlannedSave | None:
    """Plan one multi-rank save; every rank of ``group`` calls it for every save.

    Args:
        state_dict: this rank's collected state dict.
        cache: this rank's ``PlanCache`` (updated in place).
        group: the process group of the checkpoint collectives (gloo), or None (world).
        coordinator: rank in ``group`` that builds the global plan and commits.
        rank, world_size: this rank and the size of ``group``.
        thread_count: data files per rank.
        go: False if this rank cannot save now; then every rank returns None together
            (nobody is left waiting in a collective).
        ready: called before each vote (if ``go``): waits, for a bounded time well
            under the group's timeout, until this rank can take the save now, and says
            whether it can. While some rank is not ready every rank votes again (one
            more all-reduce each time), so that no rank sits in a collective while
            another does unbounded local work (finishing its previous save, starting a
            new worker); a collective past the group's timeout would break the group for
            every later save. None: always ready.
        rider: integers of the caller's own that ride on the vote (see ``Rider``).
        blocked: applied to this rank's collect before it is planned (incremental
            saves: ``Increments.blocked``, the same on every rank); None: nothing.

    Returns:
        This rank's ``PlannedSave``, or None if some rank said it cannot save.

    Raises:
        IncompatibleStateError: this rank's state dict cannot be stored (fqn, rank).
        CheckpointError: another rank's planning failed (it is named), the coordinator
            refused the combined plans, or a collective failed. Every rank raises.

    Example::

        planned = plan_save(sd, cache, ckpt_group, 0, rank, world_size, thread_count=2)
    """
    context = (world_size, coordinator, thread_count)
    state: LocalState | None = None
    error: BaseException | None = None
    hit_key = None
    shared: tuple[str, ...] = ()
    copies: dict[str, Copy] = {}  # a hit: the shared entries' (digests only); a miss: all
    vote: int | None = None  # a hit: the fingerprint of those copies
    if go:
        try:
            with phase("save.collect"):
                state = collect_local(state_dict, rank)
                if blocked is not None:
                    state = blocked(state)
            hit_key = reusable_key(cache, state.plan, rank, context)
            if hit_key is not None:
                shared = _shared_on_hit(cache, hit_key, rank)
                copies = local_copies(state, shared, describe=False)
                vote = fingerprint(copies)
            else:
                copies = local_copies(state)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the vote below
            error = e
    votes = 0
    while True:
        ready_now = ready() if ready is not None and go and error is None else True
        if ready_now is None:  # this rank cannot take the save after all: all skip it
            go, ready_now = False, True
        try:
            agreed = agree_save(
                go=go,
                failed=error is not None,
                hit_key=hit_key,
                rank=rank,
                world_size=world_size,
                group=group,
                ready=ready_now,
                copies=vote,
                carry=rider.values() if rider is not None else (),
            )
        except (RuntimeError, ValueError) as e:
            cache.clear()
            raise collective_error(e, rank, "the save-planning all-reduce") from e
        votes += 1
        if agreed.failed_rank is not None:
            if error is not None:
                raise error
            raise CheckpointError(
                f"rank {agreed.failed_rank} could not plan its part of the save (see its "
                "error); nothing was saved",
                rank=agreed.failed_rank,
            )
        if not agreed.go:
            if rider is not None:
                rider.agreed(agreed.carried)
            return None
        if agreed.ready:
            break
    assert state is not None
    local = state.plan
    token = f"{agreed.save_id:014x}"

    def planned(
        layout: RankLayout, objects: tuple[str, ...], skeleton: Manifest | None, key: str, n: int
    ) -> PlannedSave:
        values = {fqn: state.values[fqn] for fqn in objects}
        return PlannedSave(
            layout,
            objects,
            skeleton,
            token,
            key,
            n,
            state.tensors,
            values,
            state.sources,
            state.tracked,
        )

    if agreed.reuse and agreed.same_copies:
        cache.hits += 1
        share = cache.share
        if share is None or share.key != hit_key:  # a seeded hit: lay out the restored plans
            share = _adopt_seed(cache, local, context, rank, coordinator)
        cache.local = local
        skeleton = cache.plan.skeleton if rank == coordinator and cache.plan else None
        if rider is not None:
            rider.agreed(agreed.carried)
        return planned(share.layout, share.objects, skeleton, share.key, votes)
    if hit_key is not None:
        # This rank voted digests of its shared entries only. Either some rank's plan
        # changed (send every entry that may be shared now), or the plans are unchanged
        # but the shared copies differ somewhere (or the ranks hold different sets of
        # them): the coordinator compares the copies and names what differs. Same
        # digests as the vote's, plus the summaries for the message.
        try:
            copies = local_copies(state, shared if agreed.reuse else None)
        except Exception:  # noqa: BLE001 - digests alone still name the ranks
            pass
    cache.misses += 1
    try:
        result = exchange_plans(
            local,
            cache,
            group,
            coordinator,
            rank=rank,
            world_size=world_size,
            thread_count=thread_count,
            copies=copies,
        )
    except CheckpointError:
        cache.clear()
        raise
    except (RuntimeError, ValueError) as e:
        cache.clear()
        raise collective_error(e, rank, "the save-planning exchange") from e
    share = RankShare(result.layout, result.objects, result.key, result.shared)
    cache.store(local.key, context, share, local=local, plan=result.plan)
    cache.seed = None
    skeleton = result.plan.skeleton if result.plan is not None else None
    if rider is not None:
        rider.agreed(agreed.carried)
    return planned(result.layout, result.objects, skeleton, result.key, votes + result.collectives)


def _shared_on_hit(cache: PlanCache[RankShare], hit_key: str, rank: int) -> tuple[str, ...]:
    """The entries this rank fingerprints on a hit: from the last exchange, or (a hit
    on the plans seeded from a checkpoint) from those plans."""
    share = cache.share
    if (share is not None and share.key == hit_key) or cache.seed is None:
        return share.shared if share is not None else ()
    return shared_keys(cache.seed)[rank]


def _adopt_seed(
    cache: PlanCache[RankShare],
    local: LocalPlan,
    context: tuple[int, int, int],
    rank: int,
    coordinator: int,
) -> RankShare:
    """Every rank agreed to reuse the checkpoint's plans: plan them locally (pure and
    deterministic, so every rank gets the same result without talking)."""
    seed = cache.seed
    assert seed is not None
    gp = global_plan(seed, context[2])
    share = RankShare(gp.layouts[rank], gp.objects[rank], gp.key, shared_keys(seed)[rank])
    cache.store(local.key, context, share, local=local, plan=gp if rank == coordinator else None)
    cache.seed = None
    return share
