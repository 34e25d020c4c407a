"""The engine's configuration: :class:`EngineConfig`, how an ``AsyncSaver`` works (worker
mode, staging mode, writer threads, backpressure, pools in flight, durability, limits,
incremental saves: :class:`IncrementalConfig`).

Built once by the caller (or by the manager from its own config) and passed to
``AsyncSaver``; validated at construction, read-only afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from quicksave.errors import CheckpointError
from quicksave.storage import StorageOptions
from quicksave.worker.config import WorkerConfig

if TYPE_CHECKING:  # the persisters' module is the engine's to import, when it starts one
    from quicksave.worker.persisters import Persister, PersisterStart


@dataclass(frozen=True)
class IncrementalConfig:
    """Incremental saves (docs/FORMAT.md §9): a block of a tensor whose bytes are those
    of the last checkpoint this saver committed in the same run folder is neither
    copied nor written again; the new checkpoint refers to that one for it
    (``saving/incremental.py``). Saves go to filesystem folders only: a save to an
    object store is refused (it has no sparse objects; ``check_destination``).

    Attributes:
        enabled: off (default): every save writes every byte, as without this option.
        block_bytes: tensors larger than this are tracked in row blocks (along dim 0)
            of about this many bytes, each a chunk of its own in every save, changed
            or not (the layout never depends on what changed).
        min_bytes: tensors smaller than this are always written (tracking them costs
            more manifest than it saves).
        max_unused: bounds what a chain of references keeps on disk: once the
            older checkpoints a save would refer to hold more bytes that the state no
            longer uses (blocks changed since, their untracked tensors) than this
            multiple of the state's bytes, that save writes again the blocks still held
            by the most superseded of them (until the bound holds), and retention
            can delete those: about ``1 + max_unused`` times the state on disk besides
            what retention keeps, without rewriting the whole state for it (a frozen
            base referred to by every save leaves unused only its own save's other
            bytes: a LoRA run rewrites it only if its adapters and moments alone
            exceed the bound). With no ``full_every``, every checkpoint of such a run
            refers to the save that wrote the base: ``verify`` it, or set
            ``full_every``, where a damaged file must not cost more than a few
            checkpoints. None: no bound.
        full_every: every ``full_every``-th save of a chain is full (refers to
            nothing), so that no checkpoint depends on one more than
            ``full_every - 1`` saves older: a damaged base (``verify`` names both
            checkpoints; ``load()`` falls back) then costs at most that many
            checkpoints, at the price of writing the whole state again. None
            (default): no bound by count; 1: every save is full.
        trust_counters: a tracked CPU block whose tensor's version counter and address
            are those of the last save is referred to without hashing it in
            ``save()``; the background copy hashes it before the save is handed to the
            writer, and a block that changed anyway (a write the counters miss:
            through ``.data``, a numpy or DLPack view, a fused kernel, another
            process) fails that save, never committed, and the saver hashes every
            block from then on. The check runs after ``save()`` returns, with
            ``staging="blocking"`` too (until ``maybe_wait_for_staging()``): such a
            write to a block meanwhile also fails the save. Off (default): every block
            is hashed in ``save()``.
        watch_writes: (default: on) the kernel's own write tracking spares the hash
            of an unchanged CPU block: its pages are write-protected before it is
            hashed (userfaultfd in async write-protect mode), and at the next save a
            block the kernel reports unwritten since (``PAGEMAP_SCAN``) keeps its
            digest, unhashed (``saving/clean_blocks.py``). On by default because it
            trusts nothing the kernel did not prove: every write through this
            process's page tables is seen (any thread, ``.data``, numpy and DLPack
            views, any kernel), unlike version counters. Only blocks of unpinned,
            unshared, private anonymous CPU memory whose tensor's counter stood still
            over the last save are watched, so a tensor trained at every step pays
            nothing. Where the kernel does not offer it (not Linux, before 6.7, no
            permission) every block is hashed, as with it off (logged once). Turn it
            off where a device writes CPU tensors by DMA without CUDA's pinning (a
            tensor registered for RDMA): such writes bypass the page tables.
    """

    enabled: bool = False
    block_bytes: int = 4 << 20
    min_bytes: int = 64 << 10
    max_unused: float | None = 1.0
    full_every: int | None = None
    trust_counters: bool = False
    watch_writes: bool = True

    def __post_init__(self) -> None:
        for name in ("block_bytes", "min_bytes", "full_every"):
            value = getattr(self, name)
            if name == "full_every" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(
                    f"IncrementalConfig.{name} must be a positive integer, got {value!r}"
                )
        unused = self.max_unused
        if unused is not None and (
            isinstance(unused, bool) or not isinstance(unused, int | float) or not unused >= 0
        ):
            raise CheckpointError(
                f"IncrementalConfig.max_unused must be a number >= 0 or None, got {unused!r}"
            )
        for name in ("enabled", "trust_counters", "watch_writes"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(
                    f"IncrementalConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class EngineConfig:
    """How an AsyncSaver works.

    Attributes:
        mode: ``"process"`` (a persistent worker process per rank writes the files) or
            ``"thread"`` (a background thread of this process does).
        staging: ``"blocking"`` (``save()`` returns once every tensor is copied) or
            ``"overlap"`` (tensors selected by ``save(deferred=...)`` are copied in the
            background; call ``maybe_wait_for_staging()`` before mutating them).
        thread_count: data files (and writer threads) per rank.
        backpressure: ``"wait"`` for a free pool, or ``"skip"`` the save (logged).
        max_in_flight: staging pools, i.e. saves that may be in flight at once.
        o_direct: write files with O_DIRECT where the filesystem allows.
        fsync: fsync files and directories (off only for throwaway tests).
        worker: heartbeat and timeouts of the worker process.
        close_timeout_s: how long ``close()`` waits for saves in flight.
        pin_memory: page-lock pools for CUDA copies (default: when CUDA is available).
        storage: how to reach object stores (``s3://``, ``msc://`` paths).
        write_rate_mbps: MB/s (10^6 bytes) each writer thread writes to local files at
            most: spreads a save's disk traffic over more time, for machines where it
            slows training (the time to durable grows accordingly). None: no limit.
        clear_uncommitted: this rank holds the folder's writer lease (a manager's
            coordinator): its writer removes an uncommitted leftover (a crashed save's)
            at a single-rank save's target before writing, instead of failing the save.
        persister: starts (or attaches to) this rank's writer, a
            :class:`~quicksave.worker.persisters.Persister` (e.g. one that attaches to a
            writer process that outlives the trainer); None: the built-in one of
            ``mode`` (``quicksave.worker.persisters.PERSISTERS``).
        incremental: :class:`IncrementalConfig` (one rank or several; ``local``
            saves write every byte).
    """

    mode: Literal["process", "thread"] = "process"
    staging: Literal["overlap", "blocking"] = "blocking"
    thread_count: int = 2
    backpressure: Literal["wait", "skip"] = "wait"
    max_in_flight: int = 1
    o_direct: bool = True
    fsync: bool = True
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    close_timeout_s: float = 300.0
    pin_memory: bool | None = None
    storage: StorageOptions = field(default_factory=StorageOptions)
    write_rate_mbps: float | None = None
    clear_uncommitted: bool = False
    persister: Callable[[PersisterStart], Persister] | None = None
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)

    def __post_init__(self) -> None:
        rate = self.write_rate_mbps
        if rate is not None and not rate > 0:
            raise CheckpointError(f"EngineConfig.write_rate_mbps must be > 0 or None: {rate!r}")
        for name, value, allowed in (
            ("mode", self.mode, ("process", "thread")),
            ("staging", self.staging, ("overlap", "blocking")),
            ("backpressure", self.backpressure, ("wait", "skip")),
        ):
            if value not in allowed:
                raise CheckpointError(
                    f"EngineConfig.{name} must be one of {allowed}, got {value!r}"
                )
        if not isinstance(self.incremental, IncrementalConfig):
            raise CheckpointError(
                "EngineConfig.incremental must be an IncrementalConfig, got "
                f"{type(self.incremental).__name__}"
            )
        if self.thread_count < 1 or self.max_in_flight < 1:
            raise CheckpointError("EngineConfig.thread_count and max_in_flight must be >= 1")
