"""The manager's node-memory tier: each rank's newest snapshots in the node's memory,
and the recovery that reads them before the folder.

Each rank writes its own state, as it holds it (a DTensor as its local shard), to a
single-rank checkpoint of quicksave's format under the node's job-scoped tmpfs folder
(:class:`~quicksave.tiers.node_memory.NodeMemory`;
``world-<W>/rank-<r>/step-<N>``), through the
same engine and worker as the folder's saves (``local=True``: no vote, no collective).
It commits there by the local rule (the draft directory renamed), keeps
``MemoryTierConfig.keep`` snapshots, and outlives the trainer: the node's agent frees it
when the job ends or no trainer is attached for ``idle_timeout_s``.

Recovery (``load()`` with no step): every rank lists the steps its node holds for it;
the steps that every rank holds and that are not older than the folder's newest are
tried newest first, each rank loading its own snapshot (checksums verified as for any
load); one that fails on any rank (torn, missing) is skipped on every rank, and when
none loads every rank loads from the folder. A
snapshot is only used by the same world size (the one it was written by: it cannot be
resharded); a changed world size loads from the folder.

Peer replicas (``MemoryTierConfig.replicas``): each committed snapshot is offered, in
step order, to :class:`~quicksave.tiers.peer_replicas.PeerReplicas`, which copies it in
the background into the memory of ranks on other nodes. Recovery then counts a step as
held by a rank when its own memory or a peer's replica holds it; a rank whose own
memory lacks the step tried gets it from the peer first
(:mod:`quicksave.tiers.peer_recovery`), and its :attr:`MemoryTier.source` is
``"peer"`` (``"memory"`` on the ranks that read their own): the label is per rank.

A snapshot that fails to write is logged (naming the tier, rank and path) and counted in
:attr:`MemoryTier.failures`; the folder's saves go on untouched, and recovery never
trusts a snapshot that did not commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from quicksave import api
from quicksave.commit.files import remove_tree
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError
from quicksave.layout.dcp_metadata import manifest_to_metadata
from quicksave.loading.checkpoint import Checkpoint, require_committed
from quicksave.loading.run_folder import committed_steps
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.folder import apply_retention
from quicksave.manager.policies import KeepLatestK
from quicksave.manager.session import CheckpointSession
from quicksave.manager.states import OptimizerState
from quicksave.manager.step_io import StepIO
from quicksave.manager.streamed_load import OptimizerStream, load_streamed
from quicksave.ranks import collectives
from quicksave.saving.handle import SaveHandle
from quicksave.saving.in_flight import POOL_PREFIX
from quicksave.storage import parse_location
from quicksave.tiers import peer_recovery
from quicksave.tiers.node_memory import NodeMemory, NodeMemoryConfig, job_key
from quicksave.tiers.peer_replicas import PeerReplicas, Placement

logger = logging.getLogger("quicksave")

TIER = "memory"


@dataclass
class LoadRecord:
    """What the last ``load()`` restored: the step, the tier it came from on this rank
    (``"memory"``: its node's memory; ``"peer"``: fetched from a peer's replica;
    ``"folder"``; ``"object-store"``: the upload tier's store), the seconds until
    ``load()`` returned (training may start) and :attr:`restored_s`, until every
    state was in place (later, where the optimizers' states streamed in behind:
    ``streamed_load.py``)."""

    step: int
    tier: str
    seconds: float
    started: float = field(default=0.0, repr=False)  # time.perf_counter() at the call
    stream: OptimizerStream | None = field(default=None, repr=False)

    @classmethod
    def now(
        cls, step: int, tier: str, started: float, stream: OptimizerStream | None
    ) -> LoadRecord:
        return cls(step, tier, time.perf_counter() - started, started, stream)

    @property
    def restored_s(self) -> float | None:
        """Seconds from the call until every state was loaded (None: still loading)."""
        if self.stream is None:
            return self.seconds
        done = self.stream.restored_at
        return None if done is None else done - self.started


def local_view(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (the same storage: a
    load into the view fills the DTensor); containers are rebuilt, leaves kept."""
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, Mapping):
        return {k: local_view(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_view(v) for v in value)
    return value


def _has_dtensor(value: Any) -> bool:
    """Whether ``value`` holds a DTensor (the leaves of the types in ``_NOT_DTENSOR``
    are passed over without a call: a state dict holds thousands of them)."""
    if isinstance(value, DTensor):
        return True
    if isinstance(value, Mapping):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(_has_dtensor(v) for v in value if type(v) not in _NOT_DTENSOR)


_NOT_DTENSOR = frozenset({torch.Tensor, torch.nn.Parameter, int, float, str, bool, type(None)})


def _merge_plain(into: Any, loaded: Any) -> Any:
    """``into`` with each non-tensor leaf taken from ``loaded`` (tensors were filled in
    place through the view)."""
    if isinstance(into, Mapping) and isinstance(loaded, Mapping):
        return {k: _merge_plain(v, loaded.get(k, v)) for k, v in into.items()}
    if isinstance(into, (list, tuple)) and isinstance(loaded, (list, tuple)):
        return type(into)(_merge_plain(a, b) for a, b in zip(into, loaded, strict=False))
    return into if isinstance(into, torch.Tensor) else loaded


class MemoryTier:
    """One rank's node-memory tier (see the module docstring).

    Args:
        config: the manager's config; ``config.memory`` is set.
        session: the folder's session (rank, world size, the async writer).
        io: the manager's step I/O (what a full checkpoint holds).
    """

    def __init__(self, config: CheckpointConfig, session: CheckpointSession, io: StepIO) -> None:
        assert config.memory is not None
        self.config = config
        self.memory = config.memory
        self.session = session
        self.io = io
        self.rank = session.rank() or 0
        self.world_size = session.world_size()
        url = session.location.url
        placement = None  # checked before anything is made
        if self.memory.replicas:
            placement = Placement.resolve(
                self.memory.replicas, self.memory.ranks_per_node, self.world_size
            )
        node = NodeMemoryConfig(
            root=self.memory.root,
            job_id=self.memory.job_id,
            idle_timeout_s=self.memory.idle_timeout_s,
        )
        self.node = NodeMemory.attach(node, key=job_key(self.memory.job_id, url), folder_url=url)
        # the world size in the path: a snapshot is read back by the world that wrote it
        self.world_dir = self.node.path / f"world-{self.world_size}"
        where = self.world_dir / f"rank-{self.rank}"
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder = str(where)
        for stale in where.glob(f"{POOL_PREFIX}*"):  # a dead trainer's staging buffers
            stale.unlink(missing_ok=True)
        self.location = parse_location(self.folder)
        # The snapshots are their staging buffers (the engine's ``in_place``): the kept
        # ones, those in flight and the one being staged.
        self.buffers = self.memory.keep + config.max_in_flight + 1
        self.retention = KeepLatestK(self.memory.keep)
        self.pending: dict[int, SaveHandle] = {}
        self.failures = 0
        self.last_error: CheckpointError | None = None
        self.source = TIER  # where the last load() read this rank's snapshot from
        self._serving: _Serving | None = None  # a past fetch still serving peers
        self._outbox: dict[int, bool | None] = {}  # steps to offer the replicas, in
        # order: made? (None: not known yet)
        self._unsent: set[int] = set()  # the replicas' unsent steps at the last retention
        self._holders: dict[int, list[int]] = {}  # recovery: step -> each rank's holder
        self.replicas: PeerReplicas | None = None
        if placement is not None:
            group = collectives.new_gloo_group(
                collectives.group_ranks(session.checkpoint_group()), config.commit_timeout_s
            )
            self.replicas = PeerReplicas(
                self.world_dir, self.rank, placement, self.memory.keep, group
            )

    def path(self, step: int) -> str:
        return f"{self.folder}/step-{step}"

    def due(self, step: int) -> bool:
        return step > 0 and step % self.memory.every == 0

    def steps(self) -> list[int]:
        """The steps committed in this rank's memory, ascending."""
        return committed_steps(self.location, allow_dcp=False, backend=None)

    def save(self, step: int) -> bool:
        """Snapshot ``step`` into this rank's node memory (async modes: started, the
        copy overlapped as the folder's saves are); False if it was not made (held
        already, skipped by backpressure, or failed: logged)."""
        self.poll()
        if step in self._outbox or step in self.pending:
            return False
        if self.session.writer is not None:
            self._settle_older()  # (before the step is in the outbox: not offered yet)
        self._outbox[step] = None  # offered to the replicas once its outcome is known
        if step in self.steps():
            self._outbox[step] = True
            self._offer()
            return False
        state = self.io.collect("full")
        if _has_dtensor(state):  # (else the collected dict is the view: no copy)
            state = local_view(state)
        metadata = {
            "checkpoint_kind": "full",
            "tier": TIER,
            "world_size": self.world_size,
            "rank": self.rank,
        }
        path = self.path(step)
        writer = self.session.writer
        try:
            if writer is None:
                api.save(state, path, step=step, user_metadata=metadata, no_dist=True)
                self._outbox[step] = True
                self._offer()
                self._retain(set() if self.replicas is None else self.replicas.unsent())
                return True
            handle = writer.submit(state, path, step, metadata, local=True, in_place=self.buffers)
        except CheckpointError as e:
            self._failed(step, e)
            self._offer()
            return False
        if handle is None:
            self._outbox[step] = False
            self._offer()
            return False
        self.pending[step] = handle
        return True

    def _settle_older(self) -> None:
        """Before a new step takes a buffer: while ``max_in_flight`` older snapshots are
        still committing beside the newest one (staged, perhaps not yet handed over),
        wait for the oldest, then collect it and apply the retention, so that its
        retired snapshot's buffer is free (the buffers count one being staged beside
        those in flight); past ``commit_timeout_s`` the engine's backpressure decides."""
        busy = sorted(s for s, h in self.pending.items() if not h.done())
        if len(busy) <= self.config.max_in_flight:
            return
        try:
            self.pending[busy[0]].wait(self.config.commit_timeout_s)
        except (CheckpointError, TimeoutError):
            pass  # its outcome is read by poll()
        self.poll()

    def poll(self, wait_s: float = 0.0) -> None:
        """Collect the snapshots that finished (waiting up to ``wait_s`` for all of
        them); a failed one is logged and counted; then the retention."""
        deadline = time.monotonic() + wait_s
        finished = False
        for step, handle in list(self.pending.items()):
            if not handle.done() and wait_s:
                try:
                    handle.wait(max(0.0, deadline - time.monotonic()))
                except (CheckpointError, TimeoutError):
                    pass  # its outcome is read below
            if not handle.done():
                continue
            del self.pending[step]
            finished = True
            error = handle.exception()
            if error is not None:
                self._failed(step, error)
            elif step in self._outbox:
                self._outbox[step] = True
        self._offer()
        if wait_s and self.replicas is not None:
            self.replicas.drain(max(0.0, deadline - time.monotonic()))
        unsent = set() if self.replicas is None else self.replicas.unsent()
        if finished or unsent != self._unsent:  # a snapshot done, or one no longer read
            self._retain(unsent)

    def _offer(self, *, abandon: bool = False) -> None:
        """Offer the replicas the steps whose snapshots are settled, in step order (a
        step still being written holds back the later ones; ``abandon``: offered as not
        made; so is one that the retention retired while an older one held it back)."""
        for step in sorted(self._outbox):
            if self._outbox[step] is None and not abandon:
                break
            made = bool(self._outbox.pop(step))
            if made and not os.path.isdir(self.path(step)):
                made = False
                logger.info(
                    "quicksave: rank %d's snapshot of step %d was retired before its replicas "
                    "were sent (an older snapshot's commit held them back)",
                    self.rank,
                    step,
                )
            if self.replicas is not None:
                self.replicas.offer(step, self.path(step) if made else None)

    def _failed(self, step: int, error: BaseException) -> None:
        self._outbox[step] = False
        self.failures += 1
        self.last_error = error if isinstance(error, CheckpointError) else None
        logger.warning(
            "quicksave: the memory tier's snapshot of step %d on rank %d (%s) failed: %s",
            step,
            self.rank,
            self.path(step),
            error,
        )

    def _retain(self, unsent: set[int]) -> None:
        """The memory tier's retention: ``keep`` snapshots, besides those in flight and
        those the replicas still read (``unsent``: their files are staging buffers, not
        to be staged into while read)."""
        self._unsent = unsent
        held = set(self.pending) | unsent
        try:
            apply_retention(self.location, self.retention, held, allow_dcp=False, backend=None)
        except (OSError, CheckpointError) as e:
            logger.warning("quicksave: the memory tier's retention in %s: %s", self.folder, e)

    def steps_everywhere(self) -> list[int]:
        """The steps every rank can get, in its own memory or from a peer's replica,
        written by this world size, ascending (collective with several ranks: every
        rank calls it alike)."""
        mine = self.steps()
        if self.world_size == 1:
            return mine
        held = {} if self.replicas is None else self.replicas.held()
        reports = collectives.all_gather_object((mine, held), self.session.checkpoint_group())
        self._holders = peer_recovery.holders_by_step(reports)
        return sorted(self._holders)

    def load(self, step: int, states: Mapping[str, Any], *, strict: bool) -> None:
        """Load this rank's snapshot of ``step`` into ``states``: from this node's
        memory, or (a rank whose memory lacks it: see :meth:`steps_everywhere`) read from
        the replica's holder straight into ``states`` (every rank calls it alike then).

        Raises:
            CheckpointError: the snapshot is missing, torn or does not fit the states, or
                its transfer from a peer failed.
        """
        holders = self._holders.get(step, [])
        self.source = TIER
        self._end_serving()
        if not any(h != r for r, h in enumerate(holders)):
            self._load_own(step, states, strict=strict)
            return
        group = self.session.checkpoint_group()
        serves = any(h == self.rank != t for t, h in enumerate(holders))

        def load(checkpoint: Checkpoint) -> bool:  # whether its optimizers' reads go on
            stream = self.config.stream_load and not serves  # (a holder serves after)
            remote = checkpoint.remote
            end = None if remote is None else remote.close
            self._load_checkpoint(
                step, checkpoint, states, strict=strict, stream=stream, on_stream_end=end
            )
            return stream and self.io.pending is not None

        def fetch(served: threading.Event | None = None) -> bool:
            return peer_recovery.fetch(
                step, holders, self.rank, self.world_dir, group, load, served
            )

        if holders[self.rank] != self.rank:
            if not fetch():
                raise CheckpointError(
                    f"rank {holders[self.rank]} no longer holds this rank's snapshot of step "
                    f"{step}",
                    path=self.path(step),
                    rank=self.rank,
                )
            self.source = "peer"
            return
        # A rank that reads its own memory serves its part of the fetch (if any) on a
        # thread meanwhile. It waits until the receivers' first loads are in (their
        # failure is then this load's), not for their streams: those are served on.
        serving = self._serving = _Serving(fetch)
        try:
            self._load_own(step, states, strict=strict)
        finally:
            serving.settle()

    def _end_serving(self, timeout: float | None = None) -> None:
        """Wait for the serving of a past fetch (the receivers' streams) to end."""
        serving, self._serving = self._serving, None
        if serving is None:
            return
        try:
            serving.join(timeout)
        except (CheckpointError, TimeoutError) as e:
            logger.warning("quicksave: serving a peer's recovery on rank %d: %s", self.rank, e)

    def _load_own(self, step: int, states: Mapping[str, Any], *, strict: bool) -> None:
        path = self.path(step)
        checkpoint = require_committed(path, step=step, rank=self.rank)  # classified once
        self._load_checkpoint(
            step,
            checkpoint,
            states,
            strict=strict,
            stream=self.config.stream_load,
            # failed after load() returned: the snapshot is never picked again
            on_error=lambda _: remove_tree(path),
        )

    def _load_checkpoint(
        self,
        step: int,
        checkpoint: Checkpoint,
        states: Mapping[str, Any],
        *,
        strict: bool,
        stream: bool,
        on_error: Callable[[BaseException], None] | None = None,
        on_stream_end: Callable[[], None] | None = None,
    ) -> None:
        if not any(_has_dtensor(_peek(s)) for s in states.values()):
            self.io.pending = load_streamed(  # no collective: the optimizers' may stream
                states,
                lambda part, leave: api.load(
                    part, checkpoint, strict=strict, no_dist=True, leave=leave
                ),
                checkpoint,
                stream=stream,
                on_done=lambda: self.session.loaded(step),
                on_error=on_error,
                on_stream_end=on_stream_end,
            )
            return
        dicts = {}
        undos = []  # a failed load takes the allocated (uninitialised) state back
        manifest = checkpoint.read.get("manifest") or read_manifest(checkpoint.location)
        checkpoint.read["manifest"] = manifest
        stored = manifest_to_metadata(manifest, checkpoint.url)
        for name, state in states.items():
            if isinstance(state, OptimizerState):
                undos += _materialize(state, stored.state_dict_metadata, f"{name}.")
            dicts[name] = state.state_dict()
        view = local_view(dicts)
        try:
            api.load(view, checkpoint, strict=strict, no_dist=True)
        except BaseException:
            for undo in undos:
                undo()
            raise
        merged = _merge_plain(dicts, view)
        for name, state in states.items():
            state.load_state_dict(merged[name])
        self.session.loaded(step)  # the writer plans now: optimizer states exist

    def close(self, *, job_done: bool) -> None:
        """Wait for the snapshots in flight (up to the close timeout), then detach from
        the node's memory (``job_done``: the job ended; its memory is freed once no
        trainer of it is attached)."""
        self.poll(wait_s=self.config.close_timeout_s)
        self._end_serving(self.config.close_timeout_s)
        if self.replicas is not None:
            self._offer(abandon=True)  # the peers expect every step: unsettled as none
            self.replicas.close(self.config.close_timeout_s)
        self.node.detach(job_done=job_done)


class _Serving:
    """A holder's part of a fetch (``run(served)``), on a thread of its own.

    Call order: start (``__init__``) → :meth:`settle` (training thread: the receivers'
    first loads are in, or the serving ended: its error raised) → :meth:`join` (the
    receivers' streams are served too)."""

    def __init__(self, run: Callable[[threading.Event], Any]) -> None:
        self.served = threading.Event()
        self._error: BaseException | None = None
        self._ended = False
        self._thread = threading.Thread(
            target=self._run, args=(run,), name="quicksave-serve", daemon=True
        )
        self._thread.start()

    def _run(self, run: Callable[[threading.Event], Any]) -> None:
        try:
            run(self.served)
        except BaseException as e:  # noqa: BLE001 - raised by settle() or join()
            self._error = e
        finally:
            self._ended = True
            self.served.set()

    def settle(self) -> None:
        self.served.wait()
        if self._ended:
            self.join()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"still serving after {timeout} s")
        error, self._error = self._error, None
        if error is not None:
            raise error


def _peek(state: Any) -> Any:
    """What ``state`` holds now (its state dict), to see whether it holds DTensors."""
    if isinstance(state, OptimizerState):
        return [p for part in state.parts for p in part.parameters()]
    return state.state_dict() if hasattr(state, "state_dict") else state


def _materialize(state: OptimizerState, stored: Mapping[str, Any], prefix: str) -> list:
    """An optimizer without state gets it, so that the snapshot's local shards load
    into it in place: allocated from the snapshot's metadata (local shapes; returned:
    the function that takes it back), or where that cannot be done, torch's own way (a
    step on zero gradients, at learning rate 0)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    undo = state.prepare_load(stored, prefix, local=True)
    for optim in state.optimizers:
        if not optim.state:
            _init_optim_state(optim)
    return [] if undo is None else [undo]


def load_from_memory(memory: MemoryTier, strict: bool, floor: int = -1) -> int | None:
    """Every rank alike (``CheckpointManager.load()`` with no step): load the newest step
    that every rank's node memory holds and that is not older than the folder's newest
    (nor than ``floor``: a newer step held by a tier behind the folder); a step that fails
    to load on some rank is skipped on every rank (logged) and the next older one tried.
    None: none loaded (the caller loads from the folder)."""
    session = memory.session
    folder = session.committed_steps()
    for step in reversed(memory.steps_everywhere()):
        if (folder and folder[-1] > step) or floor > step:
            break
        error = None
        try:
            memory.load(step, memory.io.states, strict=strict)
        except CheckpointError as e:
            error = e
        error = session.agree_failure(error)
        if error is None:
            logger.log(session.info_level(), "quicksave: resumed from node memory, step %d", step)
            return step
        stream, memory.io.pending = memory.io.pending, None
        if stream is not None:  # another rank failed: this one's stream ends first
            with contextlib.suppress(CheckpointError):
                stream.wait()
        logger.warning("quicksave: skipped step %d of the memory tier: %s", step, error)
    return None
