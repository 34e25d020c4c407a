"""Peer replicas: each rank's node-memory snapshots copied into the memory of ranks on
other nodes, so that a node that is lost (its trainers, its agent and its memory) can
be recovered from its peers.

**Placement** (:class:`Placement`): ranks ``n * ranks_per_node`` to
``(n + 1) * ranks_per_node - 1`` are node ``n``; rank ``r``'s ``k``-th replica
(``k = 1 .. replicas``) goes to rank ``(r + k * ranks_per_node) % world_size``, the rank
in the same position ``k`` nodes further on, so each of the ``replicas`` copies is on a
different node than the snapshot and than each other (``replicas`` < the number of
nodes).

**Where** (on the receiving rank's node): ``<job folder>/world-<W>/replica-of-<src>/
step-<N>``, beside the node's own ``rank-<r>/`` folders, committed by the local rule
(received into a draft directory, then one rename: a copy cut short by a crash is never
visible), the newest ``keep`` kept per source; the node's agent frees them with the rest
of the job's memory.

**When** (:class:`PeerReplicas`): after a rank's snapshot of step ``N`` commits in its
own memory, the memory tier offers it here (in step order; a snapshot that was not made
is offered as None); a background thread of the trainer sends it to the rank's
targets and receives its sources' snapshots of the same step, so the training thread
never waits for a peer. Every rank offers the same steps in the same order (the memory
tier's schedule is a function of the step), and for each step and each ``k`` every rank
makes one exchange with the pair (target ``k``, source ``k``): a small header (the step
and the file list, or none), then the files. The group is a gloo group of its own (made
once, by every rank alike), with a timeout: a peer that died or stopped replicating
fails the exchange, and the thread logs it and stops replicating (the snapshots in own
memory go on). Recovery from the replicas: :mod:`quicksave.tiers.peer_recovery`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quicksave.commit import files as commit_files
from quicksave.errors import CheckpointError
from quicksave.loading.run_folder import committed_steps
from quicksave.ranks import collectives
from quicksave.tiers.peer_files import Incoming, Outgoing, check_names, scratch

logger = logging.getLogger("quicksave")

REPLICA_DIR = re.compile(r"replica-of-(0|[1-9][0-9]*)")
_TAG = 0  # the replication group's tags; the ``k``-th exchange of a step uses _TAG + 16 k
_STOP = object()


def replica_dir(world_dir: Path, source: int) -> Path:
    """Where a node keeps its replicas of rank ``source``'s snapshots."""
    return world_dir / f"replica-of-{int(source)}"


@dataclass(frozen=True)
class Placement:
    """Which ranks hold whose replicas (module docstring)."""

    world_size: int
    ranks_per_node: int
    replicas: int

    @classmethod
    def resolve(
        cls,
        replicas: int,
        ranks_per_node: int | None,
        world_size: int,
        environ: Mapping[str, str] | None = None,
    ) -> Placement:
        """The placement of ``replicas`` copies; ``ranks_per_node`` None: the launcher's
        ``LOCAL_WORLD_SIZE`` (``environ``, default ``os.environ``), else ``world_size``.

        Raises:
            CheckpointError: the ranks do not split into whole nodes, or there are not
                ``replicas`` other nodes to place the copies on.
        """
        if ranks_per_node is None:
            env = os.environ if environ is None else environ
            local = env.get("LOCAL_WORLD_SIZE", "")
            ranks_per_node = int(local) if local.isdigit() and int(local) > 0 else world_size
        if world_size % ranks_per_node:
            raise CheckpointError(
                f"memory.ranks_per_node is {ranks_per_node} but the world has {world_size} "
                "ranks: the ranks do not split into whole nodes"
            )
        nodes = world_size // ranks_per_node
        if replicas >= nodes and replicas > 0:
            raise CheckpointError(
                f"memory.replicas is {replicas} but the job has {nodes} node(s) of "
                f"{ranks_per_node} rank(s) (ranks_per_node: memory.ranks_per_node, else "
                "LOCAL_WORLD_SIZE): each replica needs another node than the snapshot's"
            )
        return cls(world_size, ranks_per_node, replicas)

    def targets(self, rank: int) -> list[int]:
        """The ranks that hold ``rank``'s replicas, ``k = 1 .. replicas``."""
        return [(rank + k * self.ranks_per_node) % self.world_size for k in self._ks()]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` holds, ``k = 1 .. replicas``."""
        return [(rank - k * self.ranks_per_node) % self.world_size for k in self._ks()]

    def _ks(self) -> range:
        return range(1, self.replicas + 1)


@dataclass
class Sent:
    """One step's exchanges on this rank: bytes sent and received, and the seconds."""

    step: int
    sent: int
    received: int
    seconds: float


class PeerReplicas:
    """One rank's replication (module docstring): offers from the training thread, the
    exchanges in a background thread.

    Args:
        world_dir: the node's ``<job folder>/world-<W>``.
        rank: this rank (its rank in ``group``, and in the placement).
        placement: whose replicas go where.
        keep: replicas kept per source.
        group: the replication's own gloo group (every rank of the job, with a timeout).
    """

    def __init__(
        self, world_dir: Path, rank: int, placement: Placement, keep: int, group: Any
    ) -> None:
        self.world_dir = world_dir
        self.rank = rank
        self.placement = placement
        self.keep = keep
        self.group = group
        self.log: list[Sent] = []  # the exchanges done, oldest first
        self.error: BaseException | None = None  # why the thread stopped replicating
        self._queue: deque[Any] = deque()
        self._busy = False
        self._sending: int | None = None  # the step whose files are being sent
        self._cond = threading.Condition()
        for source in placement.sources(rank):  # what a crashed receiver left
            commit_files.clean_stale_temporaries(str(replica_dir(world_dir, source)))
        self._thread = threading.Thread(
            target=self._run, name=f"quicksave-replicas-{rank}", daemon=True
        )
        self._thread.start()

    def held(self) -> dict[int, list[int]]:
        """The steps of each source whose replicas this rank holds, ascending."""
        out = {}
        for source in self.placement.sources(self.rank):
            steps = committed_steps(str(replica_dir(self.world_dir, source)), allow_dcp=False)
            if steps:
                out[source] = steps
        return out

    def unsent(self) -> set[int]:
        """The steps of this rank's snapshots still to send (queued or being sent): the
        memory tier keeps them, so that their files (its staging buffers) are not staged
        into again while they are read."""
        with self._cond:
            if self.error is not None:  # stopped: nothing is read any more
                return set()
            out = {step for step, item in self._queue if isinstance(item, Outgoing)}
            return out if self._sending is None else out | {self._sending}

    def offer(self, step: int, path: str | None) -> None:
        """Replicate this rank's committed snapshot of ``step`` at ``path`` (None: it was
        not made; the peers are told so). Call in step order, for every step the memory
        tier snapshots, on every rank alike; returns at once. When ``keep`` offers wait
        already, the oldest of them is sent as none (its files released)."""
        outgoing = None
        if path is not None and self.error is None:
            try:
                outgoing = Outgoing.open(path)
            except CheckpointError as e:
                logger.warning(
                    "quicksave: rank %d cannot replicate step %d: %s", self.rank, step, e
                )
        with self._cond:
            if self.error is not None:
                return
            waiting = [i for i, item in enumerate(self._queue) if item[1] is not None]
            if outgoing is not None and len(waiting) >= self.keep:
                old_step, old = self._queue[waiting[0]]
                old.close()
                self._queue[waiting[0]] = (old_step, None)
            self._queue.append((step, outgoing))
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every offer so far is exchanged (or replication stopped, or was
        closed); False if some were still waiting after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._busy) and self.error is None and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Exchange what was offered (up to ``timeout`` seconds), then end the thread."""
        with self._cond:
            self._queue.append((None, _STOP))
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                step, outgoing = self._queue.popleft()
                self._busy = True
                self._sending = step if isinstance(outgoing, Outgoing) else None
            if outgoing is _STOP:
                break
            try:
                self._exchange(step, outgoing)
            except (RuntimeError, CheckpointError, OSError, ValueError) as e:
                self._stop(step, e)
                break
            finally:
                if outgoing is not None:
                    outgoing.close()
                with self._cond:
                    self._busy = False
                    self._sending = None
                    self._cond.notify_all()
        with self._cond:
            self._busy = False
            self._sending = None
            self._cond.notify_all()

    def _stop(self, step: int, error: BaseException) -> None:
        logger.warning(
            "quicksave: rank %d stops replicating its memory snapshots to its peers "
            "(step %d's exchange with ranks %s failed: %s); its own snapshots go on",
            self.rank,
            step,
            self.placement.targets(self.rank) + self.placement.sources(self.rank),
            error,
        )
        with self._cond:
            self.error = error
            self._sending = None  # its exchange failed: its files are read no more
            for _, item in self._queue:
                if isinstance(item, Outgoing):
                    item.close()
            self._queue.clear()
            self._cond.notify_all()

    def _exchange(self, step: int, outgoing: Outgoing | None) -> None:
        """Step ``step``'s exchanges: with each ``k``, send to target ``k`` and receive
        from source ``k`` (the same pairs on every rank, so every call is matched)."""
        begin = time.perf_counter()
        sent = received = 0
        targets = self.placement.targets(self.rank)
        sources = self.placement.sources(self.rank)
        for k, (target, source) in enumerate(zip(targets, sources, strict=True)):
            tag = _TAG + 16 * k
            header = {"step": step, "files": None if outgoing is None else outgoing.files}
            theirs = collectives.exchange_objects(header, target, source, self.group, tag)
            if not isinstance(theirs, dict) or theirs.get("step") != step:
                raise CheckpointError(
                    f"rank {source} sent {theirs!r} where rank {self.rank} expected its "
                    f"snapshot of step {step}: the ranks' snapshot steps differ"
                )
            listed = None if theirs.get("files") is None else check_names(theirs["files"])
            incoming = self._receiver(source, step, listed)
            if incoming is None:
                recvs = scratch(listed or [])
            else:
                recvs = incoming.tensors()
            sends = [] if outgoing is None else outgoing.tensors()
            try:
                collectives.exchange_tensors(sends, target, recvs, source, self.group, tag + 2)
            except BaseException:
                if incoming is not None:
                    incoming.discard()
                raise
            sent += 0 if outgoing is None else outgoing.nbytes
            if listed is not None:
                received += sum(size for _, size in listed)
            if incoming is not None:
                self._commit(source, step, incoming)
        self.log.append(Sent(step, sent, received, time.perf_counter() - begin))

    def _receiver(self, source: int, step: int, listed: list[tuple[str, int]] | None) -> Any:
        """Where ``source``'s snapshot of ``step`` is received: an :class:`Incoming`,
        or None (nothing sent; or this node cannot take it: the bytes are dropped)."""
        if listed is None:
            return None
        final = replica_dir(self.world_dir, source) / f"step-{step}"
        try:
            return Incoming(final, listed)
        except OSError as e:
            logger.warning(
                "quicksave: rank %d cannot keep rank %d's replica of step %d in %s: %s",
                self.rank,
                source,
                step,
                final,
                e,
            )
            return None

    def _commit(self, source: int, step: int, incoming: Incoming) -> None:
        try:
            incoming.commit()
        except (CheckpointError, OSError) as e:
            incoming.discard()
            logger.warning(
                "quicksave: rank %d's replica of rank %d's step %d did not commit: %s",
                self.rank,
                source,
                step,
                e,
            )
            return
        folder = replica_dir(self.world_dir, source)
        for old in committed_steps(str(folder), allow_dcp=False)[: -self.keep]:
            commit_files.remove_tree(str(folder / f"step-{old}"))
