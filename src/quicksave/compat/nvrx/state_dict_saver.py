"""NVRx's three-phase distributed save (plan → write in the background → finalize),
writing quicksave checkpoints, with NVRx's metadata (plan) cache.

One save, every rank (training thread unless said otherwise)::

    save_state_dict_async_plan(state_dict, FileSystemWriterAsync(path), ...)
        local plan (always: it is local and cheap, and the only proof nothing changed)
        cached central plan and every rank's local plan unchanged?
            ── agree_plan_reuse: ONE all-reduce MIN (saving.plan_vote.agree_reuse) ──
            yes → reuse the central plan (and, on the coordinator, the global metadata)
        else, after a restart, the loaded checkpoint's plans match every rank's?
            ── verify_global_md_reuse: the same agreement, ONE all-reduce MIN ──
            yes → every rank replays the global planning on the loaded plans, locally
        else ── the plan exchange (compat.nvrx.dcp_steps.exchange_plans, over
                ranks.exchange.central_round): gather the local plans, DCP's global
                planning on the coordinator, scatter ──
        stage this rank's tensors to CPU (prepare_write_data)
    AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn) → queue
        save_fn (worker): data files, then the rank's part file = its "done" record
    maybe_finalize_async_calls(blocking=True, no_dist=False)  (every rank agrees it is done)
        finalize_fn → save_state_dict_async_finalize: the coordinator reads every rank's
        part from the temporary directory (no gather of write results), writes the
        manifest and renames (the commit); the other ranks return. On an object store
        (msc://, s3://) the parts are objects under the checkpoint's prefix and the
        manifest, written last, is the commit (``filesystem_async``'s docstring).

The only collectives are ``agree_plan_reuse``, ``verify_global_md_reuse`` and the plan
exchange (the one every save path uses); at most one runs
per save once plans are cached.

**The default cache.** As in NVRx, ``enable_cache=True`` without ``metadata_cache`` uses
the process's default cache, which ``init_checkpoint_metadata_cache(md)`` fills after a
restart and ``get_metadata_caching_status()`` reports on. It is one of the three pieces
of process-wide state NVRx's API defines, all kept in ``process_state.PROCESS``; pass a
``metadata_cache`` you hold to avoid it.

**Finalize is collective**, as NVRx documents: every rank's
``save_state_dict_async_finalize`` returns only once the checkpoint is committed, or
raises ``AsyncCheckpointError`` (torch's ``CheckpointException`` too) naming every rank
whose write failed and why. One barrier (every rank's write is done, even under
``no_dist=True``), the coordinator's commit, one broadcast of its outcome.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from quicksave.adapters.dcp_writer import rank_plan_of
from quicksave.compat.nvrx import dcp_steps as steps
from quicksave.compat.nvrx.errors import AsyncCheckpointError
from quicksave.compat.nvrx.filesystem_async import FileSystemWriterAsync
from quicksave.compat.nvrx.process_state import PROCESS
from quicksave.compat.nvrx.rank_write import RankWritesFailed, SaveLayout
from quicksave.errors import CheckpointError
from quicksave.format.keys import REPLICAS_KEY
from quicksave.ranks import collectives as talk
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.plan_vote import agree_reuse

logger = logging.getLogger("quicksave")

# The keys the ranks' plan-reuse votes compare: every rank that may reuse holds the same
# one (the cache of the last exchange, or the loaded checkpoint's plans).
_CACHED = "cached"
_LOADED = "loaded"


class CheckpointMetadataCache:
    """NVRx's plan cache: what the last save planned, reused while nothing changed.

    NVRx's view of a quicksave ``PlanCache`` (``plans``, saving/plan_cache.py: the one
    plan cache every save path uses), keyed by this rank's local plan as the manifest
    records it, under the group's size and coordinator and the writer's file layout:
    NVRx's names are views of it.

    Attributes:
        plans: the cache itself.
        cached_central_plan: this rank's central plan (the global planning's output).
        cached_local_plan: this rank's local plan at that planning.
        cached_global_metadata: the global metadata (the coordinator's; with quicksave's
            file layout of every rank in ``storage_data``).
        validated_cache_reuse: the last save reused the cached central plan (or planned
            the same one again).
        validated_loaded_metadata_reuse: the last save reused the plans of the loaded
            checkpoint (``init_checkpoint_metadata_cache``), skipping the exchange.
        loaded_all_plans: every rank's plan from the loaded checkpoint (its metadata's
            ``all_local_plans``), or None.
        save_count: saves planned through this cache (names temporary directories).

    Example::

        cache = CheckpointMetadataCache()
        ret = save_state_dict_async_plan(sd, writer, enable_cache=True, metadata_cache=cache)
    """

    def __init__(self) -> None:
        self.plans: PlanCache[SavePlan] = PlanCache()
        self.validated_cache_reuse: bool = False
        self.validated_loaded_metadata_reuse: bool = False
        self.save_count: int = 0

    @property
    def cached_central_plan(self) -> SavePlan | None:
        return self.plans.share

    @property
    def cached_local_plan(self) -> SavePlan | None:
        return self.plans.local

    @property
    def cached_global_metadata(self) -> Metadata | None:
        return self.plans.plan

    @property
    def loaded_all_plans(self) -> list[SavePlan] | None:
        return self.plans.seed

    def set_cached_global_metadata(self, cached_global_metadata: Metadata) -> None:
        """Adopt the metadata of a loaded checkpoint (``quicksave.StorageReader(path)
        .read_metadata()``), whose ``all_local_plans`` let the next save skip planning.

        Args:
            cached_global_metadata: DCP metadata; without ``all_local_plans`` no reuse is
                possible (logged).
        """
        self.plans.plan = cached_global_metadata
        self.plans.seed = getattr(cached_global_metadata, "all_local_plans", None)
        if self.plans.seed is None:
            logger.debug("quicksave: loaded metadata has no all_local_plans; no reuse")

    def set_cache_metadata(
        self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool
    ) -> None:
        """Record the plans of the save just planned (under the group of the last
        save planned through this cache).

        Args:
            central_plan: this rank's central plan.
            local_plan: this rank's local plan.
            global_md_verify_reuse: the loaded checkpoint's plans were reused.
        """
        self._remember(central_plan, local_plan, global_md_verify_reuse, self.plans.context or ())

    def _remember(
        self,
        central_plan: SavePlan,
        local_plan: SavePlan,
        loaded_reuse: bool,
        context: tuple[int, ...],
    ) -> None:
        previous = self.plans.share
        self.validated_loaded_metadata_reuse = loaded_reuse
        self.validated_cache_reuse = previous is not None and _same_items(central_plan, previous)
        self.plans.store(
            _plan_key(local_plan), context, central_plan, local=local_plan, plan=self.plans.plan
        )

    def prepare_save_state_dict_ret(
        self,
        rank: int,
        coordinator: int,
        save_state_dict_ret: tuple[FileSystemWriterAsync, Metadata | None, _DistWrapper],
    ) -> tuple[FileSystemWriterAsync, Metadata | None, _DistWrapper]:
        """Fill in the global metadata the coordinator needs when planning was skipped,
        and cache freshly planned metadata.

        Args:
            rank: this rank. coordinator: the coordinator rank.
            save_state_dict_ret: ``(writer, global_metadata or None, dist_wrapper)``.

        Returns:
            The same triple, with the cached global metadata on the coordinator when the
            plan was reused.
        """
        writer, metadata, wrapper = save_state_dict_ret
        if metadata is not None:
            self.plans.plan = metadata
        elif rank == coordinator and (
            self.validated_cache_reuse or self.validated_loaded_metadata_reuse
        ):
            metadata = self.plans.plan
        return writer, metadata, wrapper

    def get_cache_metadata(
        self,
    ) -> tuple[SavePlan | None, SavePlan | None, bool, list[SavePlan] | None]:
        """``(cached_central_plan, cached_local_plan, validated_cache_reuse,
        loaded_all_plans)``."""
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def get_metadata_caching_status(self) -> tuple[bool, bool]:
        """``(validated_cache_reuse, validated_loaded_metadata_reuse)``."""
        return self.validated_cache_reuse, self.validated_loaded_metadata_reuse


def init_checkpoint_metadata_cache(
    cached_global_metadata: Metadata | None = None,
    *,
    metadata_cache: CheckpointMetadataCache | None = None,
) -> CheckpointMetadataCache:
    """Fill a cache from a loaded checkpoint's metadata, so the first save after a restart
    can skip global planning.

    As in NVRx, without ``metadata_cache`` this fills the process's default cache (the
    one ``save_state_dict_async_plan(..., enable_cache=True)`` uses when no
    ``metadata_cache`` is passed; see ``process_state``).

    Args:
        cached_global_metadata: ``quicksave.StorageReader(path).read_metadata()`` (or
            DCP's); None: the cache is created (or kept) with nothing loaded.
        metadata_cache: the cache to fill; the process default if None.

    Returns:
        The cache it filled.

    Example::

        init_checkpoint_metadata_cache(quicksave.StorageReader(last).read_metadata())
        save_state_dict_async_plan(sd, FileSystemWriterAsync(path), enable_cache=True)
    """
    cache = (
        metadata_cache
        if metadata_cache is not None
        else PROCESS.default_metadata_cache(CheckpointMetadataCache)
    )
    if cached_global_metadata is not None:
        cache.set_cached_global_metadata(cached_global_metadata)
    return cache


def get_metadata_caching_status(
    *,
    metadata_cache: CheckpointMetadataCache | None = None,
) -> tuple[bool, bool] | None:
    """A cache's ``(validated_cache_reuse, validated_loaded_metadata_reuse)``.

    Args:
        metadata_cache: the cache passed to the saves; the process default if None.

    Returns:
        Its status, or None when there is no such cache (no default was ever used).

    Example::

        reused_plan, reused_loaded = get_metadata_caching_status()
    """
    cache = metadata_cache if metadata_cache is not None else PROCESS.metadata_cache
    return cache.get_metadata_caching_status() if cache is not None else None


# ------------------------------------------------------------------ collectives
def agree_plan_reuse(unchanged: bool, dist_wrapper: _DistWrapper) -> bool:
    """Collective: True on every rank iff every rank's local plan is unchanged (the
    one plan-reuse agreement, ``saving.plan_vote.agree_reuse``: one all-reduce MIN)."""
    return agree_reuse(
        _CACHED if unchanged else None, dist_wrapper.group, distributed=dist_wrapper.use_dist
    )


def verify_global_md_reuse(
    loaded_all_plans: list[SavePlan] | None,
    local_plan: SavePlan | None,
    rank: int,
    dist_wrapper: _DistWrapper,
) -> bool:
    """Collective (when plans were loaded for this world size): may every rank reuse the
    loaded checkpoint's plans? The one plan-reuse agreement
    (``saving.plan_vote.agree_reuse``: one all-reduce MIN on the planning group, CPU
    tensor for gloo, the current CUDA device for NCCL).

    Args:
        loaded_all_plans: every rank's plan from the loaded checkpoint.
        local_plan: this rank's plan now (None: it failed, never a match).
        rank: this rank (in the planning group).
        dist_wrapper: the planning wrapper.

    Returns:
        True on every rank iff every rank's plan equals its loaded one (items compared as
        the manifest records them; order and storage data do not matter).
    """
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False  # the same on every rank: no collective needed to agree
    same = _same_items(local_plan, loaded_all_plans[rank])
    if not same:
        logger.debug("quicksave: rank %d's plan differs from the loaded one", rank)
    return agree_reuse(
        _LOADED if same else None, dist_wrapper.group, distributed=dist_wrapper.use_dist
    )


def _plan_centrally(
    local_plan: SavePlan | CheckpointError,
    planner: SavePlanner,
    writer: FileSystemWriterAsync,
    dist_wrapper: _DistWrapper,
) -> tuple[SavePlan, Metadata | None]:
    """Collective: the plan exchange (``compat.nvrx.dcp_steps.exchange_plans``), the
    writer's layout recorded in the global metadata's ``storage_data``. A failure on
    any rank is raised on every rank (an interrupt: re-raised as such where it
    happened)."""

    def describe(metadata: Metadata) -> None:
        metadata.storage_data = writer.save_layout()

    return steps.exchange_plans(local_plan, planner, writer, dist_wrapper, describe_layout=describe)


# ------------------------------------------------------------------ plan
def _plan_key(plan: SavePlan) -> tuple:
    """What a plan holds, as the manifest records it (items in a canonical order, then
    its state-dict structure): the plan cache's key."""
    return rank_plan_of(_without_storage(plan)).normalized(), tuple(_structure(plan))


def _same_items(a: SavePlan | None, b: SavePlan | None) -> bool:
    return a is not None and b is not None and _plan_key(a) == _plan_key(b)


def _structure(plan: SavePlan) -> list[tuple[str, str]]:
    """The plan's state-dict paths, key types included (``repr``: a ``DictKey`` equals
    its string) and empty dicts: what the manifest records beside the items."""
    data = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    # REPLICAS_KEY: digests of values for the coordinator to compare, not structure
    return sorted((repr(k), repr(tuple(v))) for k, v in data.items() if k != REPLICAS_KEY)


def _without_storage(plan: SavePlan) -> SavePlan:
    # Compare what the plan holds (its items), not what a writer attached to it.
    return dataclasses.replace(plan, storage_data=None)


def _resolve_cache(
    enable_cache: bool, metadata_cache: CheckpointMetadataCache | None
) -> CheckpointMetadataCache | None:
    if not enable_cache:
        return None
    return (
        metadata_cache
        if metadata_cache is not None
        else PROCESS.default_metadata_cache(CheckpointMetadataCache)
    )


def _default_planner() -> SavePlanner:
    from quicksave.adapters.dcp_save_planner import DcpSavePlanner

    return DcpSavePlanner()


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    enable_cache: bool = False,
    metadata_cache: CheckpointMetadataCache | None = None,
) -> tuple[FileSystemWriterAsync, Metadata | None, _DistWrapper]:
    """Phase 1 of an asynchronous save (every rank): plan, then stage this rank's tensors.

    Args:
        state_dict: what to save (flattened by the planner; DTensor/ShardedTensor work).
        storage_writer: a ``FileSystemWriterAsync`` for the checkpoint path.
        process_group: the planning group (default group if None).
        coordinator_rank: the rank (in that group) that commits.
        planner: a DCP ``SavePlanner`` (default: quicksave's, which deduplicates
            replicated tensors across ranks); ``DefaultSavePlanner()`` works too.
        enable_cache: reuse the cached plans while unchanged (see the module docstring).
        metadata_cache: the cache (with ``enable_cache=True``; the process default, as
            in NVRx, if None).

    Returns:
        ``(storage_writer, global_metadata or None, dist_wrapper)``; pass it to
        ``save_state_dict_async_finalize``. Only the coordinator gets the metadata.

    Raises:
        CheckpointError: on every rank when any rank's planning failed (names the rank),
            or when ``storage_writer`` is not a ``FileSystemWriterAsync``.

    Example::

        ret = save_state_dict_async_plan(sd, FileSystemWriterAsync(path), None, 0)
        save_fn, preload_fn, save_args = ret[0].get_save_function_and_args()
    """
    if not isinstance(storage_writer, FileSystemWriterAsync):
        raise CheckpointError(
            f"storage_writer must be a FileSystemWriterAsync, not {type(storage_writer).__name__}"
        )
    use_dist = dist.is_available() and dist.is_initialized()
    dist_wrapper = _DistWrapper(process_group, use_dist, coordinator_rank)
    rank = dist_wrapper.get_rank()
    planner = planner if planner is not None else _default_planner()
    cache = _resolve_cache(enable_cache, metadata_cache)

    local_plan = steps.local_plan(state_dict, planner, storage_writer, dist_wrapper)
    planned = isinstance(local_plan, SavePlan)

    central_plan: SavePlan | None = None
    global_metadata: Metadata | None = None
    md_reuse = False
    # A plan holds every rank's file layout: reused only for the same group, coordinator
    # and layout parameters.
    context = (
        dist_wrapper.get_world_size(),
        coordinator_rank,
        storage_writer.thread_count,
        int(storage_writer.dcp_layout),
        int(storage_writer.dcp_compat),
    )
    if cache is not None and cache.plans.share is not None:
        unchanged = planned and cache.plans.lookup(_plan_key(local_plan), context) is not None
        if agree_plan_reuse(unchanged, dist_wrapper):
            central_plan = cache.plans.share
            cache.plans.hits += 1
    elif cache is not None and cache.plans.seed:
        md_reuse = verify_global_md_reuse(
            cache.plans.seed, local_plan if planned else None, rank, dist_wrapper
        )
        if md_reuse:
            # Every rank replays the coordinator's global planning on the loaded plans:
            # deterministic, so all get the same layout without exchanging anything.
            storage_writer.plan_id = "loaded:" + _loaded_id(cache.plans.plan)
            all_plans, md = planner.create_global_plan(list(cache.plans.seed))
            all_plans = storage_writer.prepare_global_plan(all_plans)
            md.storage_data = storage_writer.save_layout()
            central_plan = all_plans[rank]
            global_metadata = md if dist_wrapper.is_coordinator else None
            cache.plans.hits += 1
    if central_plan is None:
        if cache is not None:
            cache.plans.misses += 1
        central_plan, global_metadata = _plan_centrally(
            local_plan, planner, storage_writer, dist_wrapper
        )
    assert isinstance(local_plan, SavePlan)
    central_plan = planner.finish_plan(central_plan)

    if cache is not None:
        storage_writer.save_index = cache.save_count
        cache.save_count += 1
    storage_writer.prepare_write_data(central_plan, planner)
    ret = (storage_writer, global_metadata, dist_wrapper)
    if cache is not None:
        cache._remember(central_plan, local_plan, md_reuse, context)
        ret = cache.prepare_save_state_dict_ret(rank, coordinator_rank, ret)
    return ret


def _loaded_id(metadata: Metadata | None) -> str:
    meta = getattr(metadata, "storage_meta", None)
    return str(getattr(meta, "checkpoint_id", "") or "")


# ------------------------------------------------------------------ finalize
def save_state_dict_async_finalize(
    storage_writer: FileSystemWriterAsync,
    global_metadata: Metadata | None,
    dist_wrapper: _DistWrapper,
) -> None:
    """Phase 3 (every rank, once its ``save_fn`` is done): commit, collectively.

    Every rank waits at one barrier (so every rank's write is done, whatever
    ``no_dist`` the queue used); the coordinator then reads each rank's part (no write
    result travels between ranks), writes ``.metadata`` and renames the temporary
    directory into place (the commit; on an object store ``.metadata``, written last,
    is the commit); one broadcast gives every rank the outcome. So every rank returns
    only once the checkpoint is committed, or raises.

    Args:
        storage_writer, global_metadata, dist_wrapper: ``save_state_dict_async_plan``'s
            return value.

    Raises:
        AsyncCheckpointError: (every rank; torch's ``CheckpointException`` too) a rank's
            write failed or left no part, naming each such rank and its cause (on the
            coordinator as "Worker failure: ...", as NVRx reports it), or the commit
            failed; nothing is committed and this save's temporary directory (an object
            store: its objects) is removed.

    Example::

        save_state_dict_async_finalize(*save_state_dict_ret)
    """
    use_dist = dist_wrapper.use_dist
    if use_dist:
        talk.barrier(dist_wrapper.group)
    outcome: tuple[str, dict[int, str], str | None] | None = None
    if dist_wrapper.is_coordinator:
        try:
            _commit(storage_writer, global_metadata, dist_wrapper)
        except RankWritesFailed as e:
            outcome = (str(e), dict(e.causes), e.path)
        except CheckpointError as e:
            outcome = (str(e), {}, e.path)
    if use_dist:
        outcome = talk.broadcast_object(outcome, dist_wrapper.coordinator_rank, dist_wrapper.group)
    storage_writer.release_pool()  # every rank's write is over
    if outcome is None:
        return
    message, causes, path = outcome
    rank = dist_wrapper.get_rank()
    failures = {r: (CheckpointError(c, path=path, rank=r), None) for r, c in causes.items()}
    if not dist_wrapper.is_coordinator:
        coordinator = dist_wrapper.coordinator_rank
        if causes:
            named = "; ".join(f"rank {r} could not write its data ({c})" for r, c in causes.items())
            message = f"the checkpoint was not committed: {named}"
        else:
            message = f"the checkpoint was not committed: rank {coordinator} failed: {message}"
            failures = {coordinator: (CheckpointError(message, path=path), None)}
    raise AsyncCheckpointError(message, path=path, rank=rank, failures=failures)


def _commit(
    storage_writer: FileSystemWriterAsync,
    global_metadata: Metadata | None,
    dist_wrapper: _DistWrapper,
) -> None:
    """The coordinator's part of finalize: check every rank's part, then commit.

    Raises:
        RankWritesFailed: ranks failed to write (every one of them named).
        CheckpointError: anything else; this save's temporary data is removed.
    """
    draft = storage_writer.draft
    layout = getattr(global_metadata, "storage_data", None)
    if draft is None or not isinstance(layout, SaveLayout):
        raise CheckpointError(
            "save_state_dict_async_finalize needs the coordinator's global metadata from "
            "save_state_dict_async_plan (with FileSystemWriterAsync)",
            path=storage_writer.path,
            rank=dist_wrapper.get_rank(),
        )
    try:
        if len(layout.layouts) != dist_wrapper.get_world_size():
            raise CheckpointError(
                f"the plan is for {len(layout.layouts)} ranks, the group has "
                f"{dist_wrapper.get_world_size()}",
                path=storage_writer.draft_url(),
                rank=dist_wrapper.get_rank(),
            )
        storage_writer.commit_parts(global_metadata, layout)
    except CheckpointError:
        storage_writer.discard(layout)  # this save's temporary directory, or its objects
        raise


__all__ = [
    "CheckpointMetadataCache",
    "agree_plan_reuse",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
