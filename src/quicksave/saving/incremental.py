"""Incremental saves (``IncrementalConfig``, docs/FORMAT.md §9): a block of a tensor whose
bytes are those of the last checkpoint this saver committed in the same run folder is
neither copied into the staging pool nor written; the new checkpoint's manifest refers to
the checkpoint that holds the block's bytes (its ``base``).

Two pieces, for an ``AsyncSaver`` (``saving/engine.py``) of one rank or several:

- :class:`~.block_split.Blocks` (collect/plan): every tensor of at least
  ``min_bytes`` is *tracked*; one larger than ``block_bytes`` becomes row blocks along
  dim 0 of about that size, each a chunk of its own. The split depends on names, dtypes
  and shapes only, so the layout, the plan cache's entry and the staging pool are the
  same at every save, whatever changed.
- :class:`Increments` (stage → settle): per save, which tracked blocks are unchanged
  since the base, i.e. the last save of this saver that committed in the same folder.

**Never stale.** A block is referred to only when the xxh3-64 of its bytes now equals
the digest that the base's manifest records for the same chunk (same fqn, box, dtype,
place: the plan key is the base's). CPU blocks are hashed where they lie (no copy);
other blocks (CUDA, non-contiguous) are staged and hashed from the pool, and an
unchanged one is then only not written; deferred blocks (overlap) are hashed by the
background copy before it copies (:class:`_Sift`). By default torch's version counters
never decide that a block is unchanged (they miss writes through ``.data``, numpy and
DLPack views, fused kernels, other processes); they only spare the hash of a tensor
kept whole that is certainly changed: its counter moved since the last save (a write
with the same values also moves it, so this can cost a write, never a stale block).
With ``trust_counters`` a block whose counter did not move is referred to unhashed and
checked by the background copy before the save reaches the writer: a miss fails that
save and ends the trust. The digest taken here becomes the chunk's checksum only where
the bytes are copied right after, on the same thread, from the tensor hashed; a block
copied later by the background copy is hashed from its copy.

**The kernel's word** (``watch_writes``, default on; :mod:`.clean_blocks`): a CPU block
whose pages were write-protected before it was hashed, and that the kernel reports
unwritten since, keeps its recorded digest without a hash. It is resolved first, on the
training thread: equal to the base's digest → referred to, neither copied nor sifted;
otherwise copied (in ``save()``: the recorded digest is its checksum, the kernel proving
the bytes those hashed; deferred: its copy is hashed). Every other steady CPU block is
protected before anything hashes it, and the digest this save reports for it (whoever
read it: this thread, the background copy, the writer) is recorded at
:meth:`Increments.settled`. A block protected now is never presumed on its counter.

**Dense updates** (:mod:`.dense_blocks`): a block of a tensor whose blocks all changed
when last compared, and whose counter moved since the previous save, is written
uncompared (one save in several compares it again): a dense update then costs what a
full save costs, not a hash more. It can only write an unchanged block, never refer to a
changed one.

**Several ranks** decide alone, each for the chunks it writes, from its own view: a
rank refers only to the newest step committed and only when none of its saves is in
flight (then it has every outcome, the newest commit's included), so whatever another
rank decided, every reference names a step that retention keeps. The ranks may differ
on which blocks are written (one rank's save full, another's not); the checkpoint is
valid either way. Its part carries its references (``RankPart.bases``) to the
coordinator's commit. Version counters are never trusted there (a DTensor's in-place
ops move its own counter, not its local tensor's).

**Which save is full.** The first save of a saver, a save whose layout (plan key),
folder or naming differs from the base's, a save while another save of this saver is
in flight (its commit could make the base older than the newest step, which retention
may then delete), a save after a failed one, an ``overwrite``, and every
``full_every``-th save of a chain where set: each refers to nothing. Otherwise a chain
goes on; what it keeps on disk is bounded by ``max_unused`` instead: once the older
steps the base refers to hold more bytes its state no longer uses than that multiple of
the state's, the next save writes again the blocks still held by the fewest of them
that bring it back under the bound, the least used first (:mod:`.chain_disk`);
retention can then delete those. A frozen base referred to by every save leaves unused
only its own save's other bytes (a LoRA run's adapters and moments of that save), so it
is rewritten only where those alone exceed the bound. Once a referring save commits,
retention keeps its bases (``manager/references.py``).

Call order (the saver's training thread, under its lock): :meth:`Increments.blocked`
at collect (``save()`` and ``prepare()``) → :meth:`Increments.stage` at the start of
staging (its :attr:`Increments.sift`, if any, runs on the background copy's thread) →
:meth:`Increments.settled` for every job result → :meth:`Increments.forget` when a
worker fails. A load needs nothing: a save after it at a step not above the base's is
full. No I/O, no collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import xxhash

from quicksave.checksum import hexdigest, tensor_view
from quicksave.commit import strategy_class
from quicksave.errors import CheckpointError
from quicksave.saving.block_split import Blocks
from quicksave.saving.chain_disk import ChainDisk
from quicksave.saving.clean_blocks import CleanBlocks
from quicksave.saving.config import IncrementalConfig
from quicksave.saving.dense_blocks import DenseTensors
from quicksave.saving.engine_plan import PlannedSave
from quicksave.saving.guard import counter
from quicksave.saving.rank_plans import LocalState
from quicksave.saving.staging import PoolCopier
from quicksave.saving.write_watch import WriteWatch
from quicksave.stage.pool import StagingPool
from quicksave.storage import Location
from quicksave.worker.calls import CallResult
from quicksave.worker.job import JobResult, PersistJob

_PENDING = 16  # candidates kept for saves whose result has not come (the oldest go)


def check_destination(
    config: IncrementalConfig, location: Location, rank: int | None, local: bool = False
) -> None:
    """Raise unless incremental saves (``config.enabled``) can go to ``location``
    (``local`` snapshots pass: they are full, in-place buffers).

    An object store (its commit strategy writes objects in place, the manifest last)
    has no sparse objects: a referring checkpoint's holes would be sent as zeros (as
    many bytes as a full save), its data files assembled in memory first, and every
    checkpoint would still depend on its bases. So incremental saves go to a
    filesystem folder; the object-store tier copies them to a store self-contained.

    Raises:
        CheckpointError: ``location`` is an object store (named, with what to do).
    """
    if config.enabled and not local and strategy_class(location).writes_in_place:
        raise CheckpointError(
            f"incremental saves (IncrementalConfig(enabled=True)) need a filesystem folder: "
            f"{location.url} is an object store, which has no sparse objects (a referring "
            "checkpoint would upload its unchanged blocks as zeros, as many bytes as a full "
            "save). Save to a local folder with CheckpointConfig(upload=UploadTierConfig("
            f"{location.url!r})) to copy checkpoints to the store, or turn incremental off",
            path=location.url,
            rank=rank,
        )


@dataclass(frozen=True)
class _Held:
    """The base: the newest save of this saver that committed, as its manifest has it."""

    folder: str
    step: int
    plan_key: Hashable
    chain: int  # saves since the last full one (0: this one is full)
    digests: dict[str, str]  # tracked chunk key -> xxh3-64 of its bytes
    holders: dict[str, int]  # tracked chunk key -> the step whose files hold it
    # tracked whole tensor (every tracked block, trust_counters) -> (data_ptr, _version)
    versions: dict[str, tuple[int, int]]
    disk: ChainDisk  # what its chain keeps on disk (``max_unused``)


@dataclass(frozen=True)
class _Candidate:
    """A save in flight that becomes the base once it commits."""

    folder: str
    step: int
    plan_key: Hashable
    chain: int
    tracked: frozenset[str]
    bases: dict[str, int]
    versions: dict[str, tuple[int, int]]
    tokens: dict[str, int]  # blocks protected by this save (``CleanBlocks.protect``)
    compared: dict[str, str]  # block compared with the base -> its tensor's fqn
    rewritten: frozenset[str]  # blocks held by a victim step (``ChainDisk.victims``)
    # the digests of the base referred to (a referred block's are its; the result does
    # not send them back)
    held: dict[str, str]
    disk: ChainDisk | None  # the base's (None: a full save)
    sizes: dict[str, int]  # tracked chunk -> its bytes
    total: int  # the bytes of this rank's state


def _folder_of(url: str) -> tuple[str, str]:
    """(the run folder, the checkpoint's name) of a checkpoint's URL."""
    head, _, name = url.rstrip("/").rpartition("/")
    return head, name


def digest_of(t: torch.Tensor) -> str:
    """xxh3-64 of a contiguous CPU tensor's bytes, read where they lie."""
    return hexdigest(xxhash.xxh3_64_intdigest(tensor_view(t)))


def _hashable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be hashed where they lie."""
    return t.device.type == "cpu" and t.is_contiguous()


@dataclass(frozen=True)
class _Sift:
    """What the background copy of one save hashes (off the training thread) before it
    copies: the deferred blocks that may be unchanged, of which it copies only those
    that changed (their copies are hashed again, as every background copy's: the bytes
    hashed here are not provably the bytes copied); and (``trust_counters``) the blocks
    already referred to on their version counters' word, which must be unchanged.
    Called once, on the ``quicksave-stage`` thread, before the guard confirms the save.

    Raises:
        CheckpointError: a block referred to on its counter's word changed (the save is
            not committed; ``distrust`` is called first).
    """

    names: set[str]
    tensors: dict[str, torch.Tensor]
    base: _Held
    bases: dict[str, int]  # the save's candidate's: the references found are added
    presumed: frozenset[str] = frozenset()
    distrust: Callable[[], None] | None = None
    where: tuple[int | None, str, int] = (None, "", 0)  # step, path, rank (for errors)

    def __call__(
        self, names: list[str], digests: dict[str, str], found: dict[str, int]
    ) -> tuple[list[str], int]:
        """``names`` less the unchanged blocks, whose digests and bases go into
        ``digests`` and ``found``; and the bytes hashed."""
        keep: list[str] = []
        missed: list[str] = []
        hashed = 0
        for name in names:
            if name in self.names or name in self.presumed:
                t = self.tensors[name]
                hashed += t.numel() * t.element_size()
                same = self.base.digests.get(name) == digest_of(t)
                if name in self.presumed:
                    if not same:
                        missed.append(name)
                    continue
                if same:
                    digests[name] = self.base.digests[name]
                    found[name] = self.bases[name] = self.base.holders[name]
                    continue
            keep.append(name)
        if missed:
            if self.distrust is not None:
                self.distrust()
            raise _missed_error(missed, *self.where)
        return keep, hashed


def _missed_error(names: list[str], step: int | None, path: str, rank: int) -> CheckpointError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return CheckpointError(
        f"the save of step {step} was not committed: {len(names)} block(s) ({shown}) changed "
        "although torch's version counters did not move (a write through .data, a numpy or "
        "DLPack view, a fused kernel or another process), and IncrementalConfig("
        "trust_counters=True) would have kept their old bytes. This saver hashes every "
        "block from now on: the next save writes what changed",
        path=path,
        fqn=names[0],
        rank=rank,
    )


class Increments:
    """One saver's incremental state: the base, and the saves that may become it.

    Args:
        config: the saver's ``IncrementalConfig``.
        copier: stages the blocks hashed from the pool (the saver's ``PoolCopier``).
        unguarded: addresses the background copy saw written (``BackgroundCopy``'s
            set): never deferred again.

    Attributes:
        cost: ``(bytes copied, bytes hashed)`` by the latest :meth:`stage`.
        sift: what the latest save's background copy hashes before it copies (the
            deferred blocks that may be unchanged); None: nothing.
    """

    def __init__(self, config: IncrementalConfig, copier: PoolCopier, unguarded: set[int]) -> None:
        self.config = config
        self._blocks = Blocks(config)
        self._copier = copier
        self._unguarded = unguarded
        self._base: _Held | None = None
        self._pending: dict[int, _Candidate] = {}
        self._trusted = config.trust_counters  # until a block changes behind a counter
        self.cost = (0, 0)
        self.sift: _Sift | None = None
        watch = config.enabled and config.watch_writes
        self._clean = CleanBlocks(WriteWatch()) if watch else None
        self._dense = DenseTensors()
        self._sized: tuple[Hashable, dict[str, int], int] | None = None

    def close(self) -> None:
        """Stop watching (the saver closes): every registration and held storage goes
        (the block views kept too)."""
        self._blocks = Blocks(self.config)
        if self._clean is not None:
            self._clean.close()
            self._clean = None

    def blocked(self, state: LocalState) -> LocalState:
        """``state`` as an incremental save plans it (:meth:`Blocks.blocked`); as it is
        where incremental saves are off."""
        return self._blocks.blocked(state) if self.config.enabled else state

    def observed(self, state: LocalState) -> LocalState:
        """``state`` (:meth:`blocked`'s), seen at ``prepare()``: its tracked blocks'
        addresses and version counters count as the last save's for the steady hint
        (:meth:`CleanBlocks.observe`), so a block that nothing wrote between
        ``prepare()`` and the first save (a frozen base) is watched from the first save,
        whose digest of it then holds: the second save refers to it unhashed."""
        if self._clean is not None and state.tracked:
            self._clean.observe([(n, state.sources[n]) for n in state.tracked])
        return state

    def base_step(self) -> int | None:
        """The step of the current base (None: the next save is full)."""
        return None if self._base is None else self._base.step

    def _distrust(self) -> None:
        """A block changed behind its version counter: hash every block from now on."""
        self._trusted = False

    def forget(self) -> None:
        """The next save is full: a worker failed (a save may have committed unseen),
        or the folder may have changed under this saver (a load, a quarantine)."""
        self._base = None
        self._pending.clear()
        self._dense.forget()

    def _base_for(self, job: PersistJob, plan_key: Hashable, idle: bool) -> _Held | None:
        base = self._base
        if base is None or job.step is None or job.replace or not idle:
            return None
        folder, name = _folder_of(job.final_path)
        cfg = self.config
        if (
            name != f"step-{job.step}"
            or folder != base.folder
            or not base.step < job.step
            or base.plan_key != plan_key
            or (cfg.full_every is not None and base.chain + 1 >= cfg.full_every)
        ):
            return None
        return base

    def _sizes(
        self, plan_key: Hashable, tensors: dict[str, torch.Tensor], tracked: dict[str, str]
    ) -> tuple[dict[str, int], int]:
        """(tracked chunk -> its bytes, the bytes of every chunk): once per plan."""
        memo = self._sized
        if memo is None or memo[0] != plan_key:
            sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
            memo = (plan_key, {k: sizes[k] for k in tracked}, sum(sizes.values()))
            self._sized = memo
        return memo[1], memo[2]

    def stage(
        self,
        job: PersistJob,
        planned: PlannedSave,
        now: list[str],
        later: list[str],
        pool: StagingPool,
        ready: torch.cuda.Event | None,
        idle: bool,
    ) -> tuple[PersistJob, list[str], list[str]]:
        """Decide which tracked blocks of this save are unchanged since the base.

        Args:
            job: the save's job (``bases`` and ``digests`` are set on the copy returned).
            planned: the save (its ``tracked`` chunks; none: nothing to do).
            now / later: ``split``'s names copied in ``save()`` / in the background.
            pool, ready: where and after what the blocks hashed from the pool are staged.
            idle: no other save of this saver is in flight.

        Returns:
            ``(job, now, later)``: the names left to copy (a block of a tensor whose
            first block is deferred is deferred too); :attr:`cost` says what this cost.
        """
        tensors, sources, plan = planned.tensors, planned.sources, planned.plan
        self.cost = (0, 0)
        self.sift = None
        # (several ranks: the chunks this rank writes)
        tracked = {k: f for k, f in planned.tracked.items() if k in tensors}
        if not tracked:
            return job, now, later
        base = self._base_for(job, plan.key, idle)
        # the older steps whose blocks are written again (``max_unused``): those blocks
        # (``rewritten``) are never referred to, compared or sifted
        victims = frozenset() if base is None else base.disk.victims(self.config.max_unused)
        rewritten: frozenset[str] = frozenset()
        if base is not None and victims:
            rewritten = frozenset(n for n in tracked if base.holders.get(n) in victims)
        digests: dict[str, str] = {}
        bases: dict[str, int] = {}
        versions: dict[str, tuple[int, int]] = {}
        copied = hashed = 0

        compared: set[str] = set()  # compared with the base (dense_blocks)
        self._dense.begin()

        def unchanged(name: str, digest: str) -> bool:
            digests[name] = digest
            if base is None or name in rewritten:
                return False  # (a victim's block: written again, not compared)
            compared.add(name)
            if base.digests.get(name) != digest:
                return False
            bases[name] = base.holders[name]
            return True

        # the kernel's word first (watch_writes): a block proven unwritten since it was
        # hashed is resolved here, before any classification below; the others of
        # steady tensors are protected now, before anything hashes them
        resolved: dict[str, str] = {}  # clean but changed since the base -> its digest
        tokens: dict[str, int] = {}  # protected now -> token (digests recorded once read)
        clean = self._clean
        if clean is not None and clean.available():
            clean.begin(set(tracked))
            referred: set[str] = set()
            protect: dict[str, torch.Tensor] = {}
            found, steady = clean.check(
                [(n, tensors[n], sources[n]) for n in tracked], self._blocks.kept
            )
            for name in tracked:
                if name not in found and name in steady and clean.watchable(name, tensors[name]):
                    protect[name] = tensors[name]
            if base is not None:  # (found equal to the base's digest: referred to, at once)
                held = base.digests
                referred = {n for n, d in found.items() if held.get(n) == d and n not in rewritten}
                digests.update({n: found[n] for n in referred})
                bases.update({n: base.holders[n] for n in referred})
                compared.update(referred)
            resolved = {n: d for n, d in found.items() if n not in referred}
            tokens = clean.protect(protect)
            if referred:
                now = [n for n in now if n not in referred]
                later = [n for n in later if n not in referred]

        # (not with several ranks: a DTensor's in-place ops move its own counter only)
        trust = self._trusted and base is not None and job.dist is None
        presumed: set[str] = set()

        def moved(name: str) -> bool:
            # a whole tensor whose counter moved since the base was certainly written
            src = sources[name]
            version = counter(src)
            if version is None:  # no counter: never presumed, compared by its bytes
                return False
            seen = (src.data_ptr(), version)
            if trust or tracked[name] == name:
                versions[name] = seen
            last = None if base is None else base.versions.get(name)
            # (a block protected now is hashed: the kernel's word beats the counter's)
            if (
                trust
                and last == seen
                and _hashable(tensors[name])
                and name not in tokens
                and name not in rewritten
            ):
                presumed.add(name)  # (checked by the background copy: _Sift)
                digests[name] = base.digests[name]  # type: ignore[union-attr]
                bases[name] = base.holders[name]  # type: ignore[union-attr]
                return False
            whole = tracked[name] == name
            if not whole:  # a block of a tensor updated densely: taken as changed
                return self._dense.assumed(tracked[name], name, seen)
            return last is not None and last[0] == seen[0] and last[1] != seen[1]

        def deferrable(t: torch.Tensor) -> bool:
            return not t.is_inference() and t.data_ptr() not in self._unguarded

        deferred_fqns = {tracked[n] for n in later if n in tracked}
        to_sift: set[str] = set()  # hashed by the background copy, before it copies
        keep_now: list[str] = []
        moved_later: list[str] = []
        from_pool: list[str] = []
        for name in now:
            fqn = tracked.get(name)
            t = tensors[name]
            with_later = fqn in deferred_fqns and deferrable(t)  # (its tensor's other blocks)
            if name in resolved:
                if base is None and with_later:
                    moved_later.append(name)  # (a full save: hashed from its deferred copy)
                else:
                    unchanged(name, resolved[name])
                    keep_now.append(name)  # copied right below, its digest known
            elif fqn is None:
                keep_now.append(name)
            elif moved(name):  # (changed: copied with its tensor's other blocks)
                (moved_later if with_later else keep_now).append(name)
            elif name in presumed:
                moved_later.append(name)  # referred to; the background copy checks it
            elif with_later:
                moved_later.append(name)  # its tensor's other blocks are deferred
                if base is not None and _hashable(t) and name not in rewritten:
                    to_sift.add(name)
            elif not _hashable(t):
                from_pool.append(name)
            else:
                hashed += t.numel() * t.element_size()
                digest = digest_of(t)
                if clean is not None and name in tokens:
                    clean.hashed(name, tokens[name], digest)  # (read after its protection)
                if not unchanged(name, digest):
                    keep_now.append(name)  # copied right below: its digest is the copy's
        for name in later:
            if name in tracked and not moved(name) and base is not None:
                if (
                    _hashable(tensors[name])
                    and name not in presumed
                    and name not in resolved
                    and name not in rewritten
                ):
                    to_sift.add(name)
        keep_later = later + moved_later
        compared |= to_sift
        if to_sift or presumed:
            where = (job.step, job.final_path, job.rank)
            self.sift = _Sift(
                to_sift,
                tensors,
                base,
                bases,
                frozenset(presumed),
                self._distrust,
                where,  # type: ignore[arg-type]
            )
        if from_pool:  # staged and hashed there; an unchanged one is only not written
            pooled: dict[str, str] = {}
            copied = self._copier.stage(pool, plan, tensors, from_pool, pooled, ready=ready)
            hashed += copied
            for name in from_pool:
                unchanged(name, pooled[name])
        job = dataclasses.replace(
            job, digests={**job.digests, **digests}, bases=dict(bases), report_digests=True
        )
        folder, name = _folder_of(job.final_path)
        # only a step-<N> checkpoint can be a base: a reference names the step, and a
        # save under another name (Lightning's last.ckpt) holds no step-<N> to refer to
        if job.step is not None and name == f"step-{job.step}":
            chain = 0 if base is None else base.chain + 1
            while len(self._pending) >= _PENDING:
                del self._pending[next(iter(self._pending))]
            sizes, total = self._sizes(plan.key, tensors, tracked)
            self._pending[job.job_id] = _Candidate(
                folder, job.step, plan.key, chain, frozenset(tracked), bases, versions, tokens,
                {n: tracked[n] for n in compared | rewritten}, rewritten,
                {} if base is None else base.digests,
                None if base is None else base.disk, sizes, total,
            )  # fmt: skip
        self.cost = (copied, hashed)
        return job, keep_now, keep_later

    def settled(self, result: JobResult | CallResult) -> None:
        """A job's result: a committed save with every tracked digest known becomes
        the base, unless a newer step is the base already (the base is always the
        newest step committed: retention never deletes that one); a failed one leaves
        none (the next save is full)."""
        candidate = self._pending.pop(result.job_id, None)
        if candidate is None or not isinstance(result, JobResult):
            return
        if not result.ok:
            self._base = None
            return
        digests = result.digests
        if candidate.bases:  # (a block referred to has the base's digest: not sent back)
            digests = {**{k: candidate.held[k] for k in candidate.bases}, **digests}
        if self._clean is not None:  # (read after their protections: recorded)
            self._clean.settled(candidate.tokens, digests)
        referred: dict[str, int] = candidate.bases
        if candidate.rewritten:  # (written again for a victim: unchanged if the base's bytes)
            held = candidate.held
            same = {n: 0 for n in candidate.rewritten if digests.get(n) == held.get(n)}
            referred = {**referred, **same}
        self._dense.compared(candidate.compared, referred)
        if self._base is not None and self._base.step > candidate.step:
            return  # a newer step committed first: it stays the base (the newest one)
        if not candidate.tracked <= digests.keys():
            self._base = None
            return
        self._base = _Held(
            candidate.folder,
            candidate.step,
            candidate.plan_key,
            candidate.chain,
            {k: digests[k] for k in candidate.tracked},
            {**dict.fromkeys(candidate.tracked, candidate.step), **candidate.bases},
            candidate.versions,
            ChainDisk.after(
                candidate.step, candidate.bases, candidate.sizes, candidate.total, candidate.disk
            ),
        )
