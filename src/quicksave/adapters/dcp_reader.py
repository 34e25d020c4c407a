"""``quicksave.StorageReader``: quicksave checkpoints for ``torch.distributed.checkpoint.load``.

Nothing from the checkpoint is unpickled: the DCP metadata is rebuilt from the
manifest (``manifest.json``, or the one inside a DCP-layout ``.metadata``, whose chunks
lie at unaligned offsets inside DCP's own ``.distcp`` files and are read the same way).
Reads go straight into the destination tensors when a stored chunk maps onto a
contiguous piece of one (``preadv`` into its memory), otherwise through one buffer per
stored chunk; every chunk's xxh3-64 is checked as it is read.

Call order (DCP drives it): ``reset`` → ``read_metadata`` (all ranks) →
``set_up_storage_reader`` → ``prepare_local_plan`` / ``prepare_global_plan`` (identity) →
``read_data`` (all ranks, each its own read items).

Example::

    import torch.distributed.checkpoint as dcp
    dcp.load(state_dict, storage_reader=quicksave.StorageReader("ckpt/step-100"))
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from quicksave.checksum import hexdigest, tensor_view
from quicksave.commit import CheckpointKind, classify
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointNotFoundError, CorruptCheckpointError, NotCommittedError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_from_name
from quicksave.format.keys import EMPTY_KEY
from quicksave.format.manifest import ChunkEntry, Manifest, ObjectEntry, PlannedChunk, RankPlan
from quicksave.layout.dcp_metadata import manifest_to_metadata
from quicksave.loading.run_folder import not_a_checkpoint
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.backend import Backend, join
from quicksave.storage.checkpoint_dir import CheckpointDir, Member
from quicksave.trace import phase


def require_committed(
    path: str | os.PathLike[str] | Location,
    *,
    allow_dcp: bool = False,
    backend: Backend | None = None,
) -> CheckpointKind:
    """The kind of the committed checkpoint at ``path``; the one place that turns
    "not a loadable checkpoint" into an error.

    Args:
        path: a checkpoint directory (path, URL or Location).
        allow_dcp: accept a committed stock ``torch.distributed.checkpoint`` directory.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, not a checkpoint, or a DCP
            directory when ``allow_dcp`` is False.
        NotCommittedError: a temporary or partial checkpoint (it is never loaded).
    """
    loc = parse_location(path)
    kind = classify(loc, backend)
    if kind is CheckpointKind.QUICKSAVE or (allow_dcp and kind is CheckpointKind.DCP):
        return kind
    path = loc.url
    if kind is CheckpointKind.MISSING:
        raise CheckpointNotFoundError("no such file or directory", path=path)
    if kind is CheckpointKind.UNCOMMITTED:
        raise NotCommittedError(
            "checkpoint was never committed (a save was interrupted or is still running); "
            "it is never loaded",
            path=path,
        )
    if kind is CheckpointKind.DCP:
        raise CheckpointNotFoundError(
            "this is a stock torch.distributed.checkpoint directory, not a quicksave one; "
            "quicksave.load() reads it through DCP's own reader",
            path=path,
        )
    raise CheckpointNotFoundError(not_a_checkpoint(loc, backend), path=path)


def manifest_rank_plans(manifest: Manifest) -> tuple[RankPlan, ...] | None:
    """Every rank's plan at save time: the manifest's ``plans``, or for a one-rank
    checkpoint its whole content (FORMAT.md §2 lets writers omit it then); ``None`` when
    the manifest of a multi-rank checkpoint does not record them."""
    if manifest.plans is not None:
        return manifest.plans
    if manifest.world_size != 1:
        return None
    chunks = tuple(
        PlannedChunk(fqn, c.offsets, c.sizes, t.shape, t.dtype)
        for fqn, t in sorted(manifest.tensors.items())
        for c in t.chunks
    )
    return (RankPlan(chunks, tuple(sorted(manifest.objects)), manifest.empty_dicts),)


def save_plan_of(rank_plan: RankPlan, manifest: Manifest) -> SavePlan:
    """A DCP ``SavePlan`` equivalent to ``rank_plan`` (tensor properties other than the
    dtype take their defaults), carrying ``rank_plan`` as ``storage_data`` and the
    manifest's state-dict paths as ``planner_data``, as quicksave's writer and DCP's
    default planner produce them."""
    items = []
    paths: dict[str, tuple] = {}
    for c in rank_plan.tensors:
        whole = c.sizes == c.shape and not any(c.offsets)
        items.append(
            WriteItem(
                index=MetadataIndex(c.fqn, torch.Size(c.offsets)),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=dtype_from_name(c.dtype, fqn=c.fqn)),
                    size=torch.Size(c.shape),
                ),
            )
        )
        entry = manifest.tensors.get(c.fqn)
        paths[c.fqn] = (entry.path if entry is not None else None) or (c.fqn,)
    for fqn in rank_plan.objects:
        items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        entry = manifest.objects.get(fqn)
        paths[fqn] = (entry.path if entry is not None else None) or (fqn,)
    if rank_plan.empty_dicts:
        paths[EMPTY_KEY] = rank_plan.empty_dicts  # type: ignore[index]
    return SavePlan(items, storage_data=rank_plan, planner_data=paths)


def read_chunk_into(
    fd: Member,
    view: memoryview,
    entry: ChunkEntry,
    *,
    path: str,
    fqn: str,
    rank: int | None,
    verify: bool = True,
) -> None:
    """Fill ``view`` with the bytes of ``entry`` from the open data file ``fd`` (at
    ``path``; a :class:`~quicksave.storage.checkpoint_dir.Member` on any backend) and
    check their xxh3-64.

    Raises:
        CorruptCheckpointError: the file ends before the chunk does, or the checksum
            does not match; names the file, the fqn and the rank.
    """
    got = 0
    while got < entry.length:
        n = fd.pread_into(view[got:], entry.offset + got)
        if n == 0:
            raise CorruptCheckpointError(
                f"data file is truncated: chunk needs bytes {entry.offset}.."
                f"{entry.offset + entry.length}, file ends at {entry.offset + got}",
                path=path,
                fqn=fqn,
                rank=rank,
            )
        got += n
    if verify:
        check_chunk_digest(view, entry, path=path, fqn=fqn, rank=rank)


def check_chunk_digest(
    view: memoryview, entry: ChunkEntry, *, path: str, fqn: str, rank: int | None
) -> None:
    """Raise if the bytes of chunk ``entry`` read into ``view`` fail its xxh3-64."""
    with phase("load.verify"):  # per chunk: chunks are checked as they arrive
        actual = hexdigest(xxhash.xxh3_64_intdigest(view))
    if actual != entry.xxh3_64:
        raise CorruptCheckpointError(
            f"checksum mismatch in chunk at offsets {list(entry.offsets)} "
            f"(stored {entry.xxh3_64}, read {actual})",
            path=path,
            fqn=fqn,
            rank=rank,
        )


def check_chunk_within(entry: ChunkEntry, size: int, path: str, fqn: str, rank: int | None) -> None:
    """Raise if the chunk ``entry`` ends beyond the ``size`` bytes its file holds."""
    if entry.offset + entry.length > size:
        raise CorruptCheckpointError(
            f"data file is truncated: chunk needs bytes {entry.offset}.."
            f"{entry.offset + entry.length}, file ends at {size}",
            path=path,
            fqn=fqn,
            rank=rank,
        )


@dataclass
class _Chunk:
    fqn: str
    entry: ChunkEntry
    dtype: torch.dtype
    reqs: list[tuple[ReadItem, torch.Tensor]]


RUN_BYTES = 32 << 20  # object stores: neighbouring small chunks up to this are read at once
RUN_GAP = 1 << 20  # ... when the bytes between them are fewer than this
RUN_SMALL = 8 << 20  # chunks this large or larger are read straight into their destination


def _runs(work: list[_Chunk]) -> list[list[_Chunk]]:
    """``work`` (sorted by file and offset) cut into runs of neighbouring small chunks
    of one file, each spanning at most ``RUN_BYTES``; a chunk of ``RUN_SMALL`` bytes or
    more is its own run, read straight into its destination (the backend splits a large
    one into parallel ranged reads)."""
    runs: list[list[_Chunk]] = []
    for c in work:
        if c.entry.length >= RUN_SMALL:  # one request is worth it: no copy through memory
            runs.append([c])
            continue
        if runs and runs[-1][0].entry.length < RUN_SMALL:
            last = runs[-1]
            head = last[0].entry
            tail_end = max(x.entry.offset + x.entry.length for x in last)
            if (
                head.file == c.entry.file
                and c.entry.offset - tail_end < RUN_GAP
                and c.entry.offset + c.entry.length - head.offset <= RUN_BYTES
            ):
                last.append(c)
                continue
        runs.append([c])
    return runs


class _Span:
    """Bytes of a data file already read (``view`` holds the file from ``base``), read
    again as a Member."""

    def __init__(self, view: memoryview, base: int) -> None:
        self.view, self.base = view, base
        self.size = base + len(view)

    def pread_into(self, view: memoryview, offset: int) -> int:
        lo = offset - self.base
        n = max(0, min(len(view), len(self.view) - lo))
        view[:n] = self.view[lo : lo + n]
        return n

    def close(self) -> None:
        pass


class StorageReader(_DCPStorageReader):
    """Reads a committed quicksave checkpoint for ``torch.distributed.checkpoint.load``.

    Args:
        path: the checkpoint directory: a path, a ``file://``, ``s3://`` or ``msc://``
            URL, or a Location.
        thread_count: parallel reader threads (on object stores each also splits a
            large chunk into parallel ranged reads).
        verify: check every chunk's xxh3-64 while reading (on by default).
        storage: how to reach an object store (default: the environment's chain).
        backend: an open backend serving ``path`` to read through (kept open); by
            default one is opened per step.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        thread_count: int = 4,
        verify: bool = True,
        storage: StorageOptions | None = None,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        self.location = parse_location(path, options=storage)
        self.path = self.location.url
        self._storage = storage
        self._backend = backend  # a caller's open backend for the location (not closed)
        self.thread_count = max(1, thread_count)
        self.verify = verify
        self.rank: int | None = None
        self.manifest: Manifest | None = None
        self._metadata: Metadata | None = None  # built from ``manifest``, once
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            new = parse_location(checkpoint_id, options=self._storage)
            if new.backend_id() != self.location.backend_id():
                self._backend = None  # the caller's backend serves the old location only
            self.location = new
            self.path = self.location.url
            self.manifest = self._metadata = None
        self.storage_data = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_manifest(self) -> Manifest:
        if self.manifest is None:
            with CheckpointDir(self.location, self._backend) as d:
                require_committed(self.location, backend=d.backend)
                self.manifest = read_manifest(d)
        return self.manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP ``Metadata`` rebuilt from the manifest. It also carries ``all_local_plans``
        (every rank's ``SavePlan`` at save time, from the manifest's ``plans``; ``None``
        if not recorded), which ``init_checkpoint_metadata_cache`` uses to let the first
        save after a restart skip global planning.

        Built once per checkpoint and kept: a load asks for it before DCP does (a fresh
        optimizer's state is allocated from it), and on a model of ~1,500 tensors each
        build costs a few tenths of a second."""
        if self._metadata is None:
            manifest = self.read_manifest()
            md = manifest_to_metadata(manifest, self.path)
            md.storage_meta = StorageMeta(checkpoint_id=self.path)
            plans = manifest_rank_plans(manifest)
            md.all_local_plans = (
                None if plans is None else [save_plan_of(p, manifest) for p in plans]
            )
            self._metadata = md
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ------------------------------------------------------------------ reading
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        chunks: dict[MetadataIndex, _Chunk] = {}
        for req in plan.items:
            fqn, entry = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                assert isinstance(entry, ObjectEntry)
                value = objcodec.decode(entry.value, fqn=fqn, path=self.path)
                load_value = getattr(planner, "load_value", None)
                if load_value is not None:  # quicksave's LoadPlanner: the value as is
                    load_value(req, value)
                else:  # any other DCP planner expects torch.save bytes
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                continue
            chunk = chunks.get(req.storage_index)
            if chunk is None:
                t_entry = self.read_manifest().tensors[fqn]
                chunk = chunks[req.storage_index] = _Chunk(
                    fqn, entry, dtype_from_name(t_entry.dtype), []
                )
            chunk.reqs.append((req, planner.resolve_tensor(req).detach()))

        by_file: dict[str, list[_Chunk]] = defaultdict(list)
        for c in chunks.values():
            by_file[c.entry.file].append(c)
        fds: dict[str, Member] = {}
        d = CheckpointDir(self.location, self._backend, rank=self.rank)
        try:
            for name, file_chunks in by_file.items():
                f = self._open(d, name, file_chunks[0].fqn)
                fds[name] = f
                for c in file_chunks:  # before any read or buffer: the file holds it all
                    check_chunk_within(c.entry, f.size, d.member_url(name), c.fqn, self.rank)
            work = sorted(chunks.values(), key=lambda c: (c.entry.file, c.entry.offset))
            tasks: list[tuple[Callable[..., None], tuple]] = (
                [(self._read_run, (fds[r[0].entry.file], r)) for r in _runs(work)]
                if d.reads_in_runs
                else [(self._read_chunk, (fds[c.entry.file], c)) for c in work]
            )
            threads = d.read_threads(self.thread_count)
            if threads == 1 or len(tasks) <= 1:
                for fn, args in tasks:
                    fn(*args)
            else:
                with ThreadPoolExecutor(
                    min(threads, len(tasks)), thread_name_prefix="quicksave-read"
                ) as pool:
                    for f in [pool.submit(fn, *args) for fn, args in tasks]:
                        f.result()
        finally:
            for f in fds.values():
                f.close()
            d.close()
        for c in chunks.values():
            for req, dest in c.reqs:
                planner.commit_tensor(req, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_run(self, fd: Member, run: list[_Chunk]) -> None:
        """Object stores: one ranged read for a run of neighbouring chunks (many small
        tensors would otherwise cost one request each), its body scattered straight into
        each chunk's destination (the bytes between chunks into scratch), then every
        chunk checked."""
        if len(run) == 1:
            self._read_chunk(fd, run[0])
            return
        if any(b.entry.offset < a.entry.offset + a.entry.length for a, b in pairwise(run)):
            self._read_span(fd, run)  # overlapping chunks: read the span once, then copy
            return
        start = run[0].entry.offset
        pos = start
        views: list[memoryview] = []
        targets: list[tuple[_Chunk, memoryview, Callable[[], None]]] = []
        for c in run:
            if c.entry.offset > pos:
                views.append(memoryview(bytearray(c.entry.offset - pos)))
            view, finish = self._target(c)
            views.append(view)
            targets.append((c, view, finish))
            pos = c.entry.offset + c.entry.length
        got = fd.read_scatter(views, start)
        if got < pos - start:
            raise CorruptCheckpointError(
                f"data file is truncated: chunks need bytes {start}..{pos}, "
                f"file ends at {start + got}",
                path=join(self.path, run[0].entry.file),
                fqn=run[-1].fqn,
                rank=self.rank,
            )
        for c, view, finish in targets:
            self._check(view, c)
            finish()

    def _read_span(self, fd: Member, run: list[_Chunk]) -> None:
        start = run[0].entry.offset
        end = max(c.entry.offset + c.entry.length for c in run)
        view = memoryview(bytearray(end - start))
        got = fd.read_scatter([view], start)  # short where the file ends: the chunks say so
        held = _Span(view[:got], start)
        for c in run:
            self._read_chunk(held, c)

    def _open(self, d: CheckpointDir, name: str, fqn: str) -> Member:
        path = d.member_url(name)
        try:
            return d.open(name, what="data file", fqn=fqn, rank=self.rank)
        except FileNotFoundError:
            if classify(d.location, d.backend) is CheckpointKind.MISSING:  # retention
                raise CheckpointNotFoundError(
                    "the checkpoint was deleted while it was being loaded",
                    path=self.path,
                    fqn=fqn,
                    rank=self.rank,
                ) from None
            raise CorruptCheckpointError(
                "data file is missing", path=path, fqn=fqn, rank=self.rank
            ) from None

    def _read_into(self, fd: Member, view: memoryview, c: _Chunk) -> None:
        path = join(self.path, c.entry.file)
        read_chunk_into(fd, view, c.entry, path=path, fqn=c.fqn, rank=self.rank, verify=self.verify)
        self.bytes_read += c.entry.length

    def _check(self, view: memoryview, c: _Chunk) -> None:
        """The xxh3-64 check of a chunk already read into ``view``."""
        e = c.entry
        if self.verify:
            check_chunk_digest(view, e, path=join(self.path, e.file), fqn=c.fqn, rank=self.rank)
        self.bytes_read += e.length

    def _read_chunk(self, fd: Member, c: _Chunk) -> None:
        view, finish = self._target(c)
        self._read_into(fd, view, c)
        finish()

    def _target(self, c: _Chunk) -> tuple[memoryview, Callable[[], None]]:
        """Where chunk ``c``'s bytes are read to: its destination tensor itself when one
        request wants it whole, as stored (no copy); otherwise a buffer, and ``finish``
        copies the requested pieces from it once it is read and checked."""
        e = c.entry
        if len(c.reqs) == 1:
            req, dest = c.reqs[0]
            whole = not any(req.storage_offsets) and tuple(req.lengths) == tuple(e.sizes)
            if (
                whole
                and dest.device.type == "cpu"
                and dest.dtype == c.dtype
                and dest.is_contiguous()
                and dest.numel() * dest.element_size() == e.length
            ):
                return tensor_view(dest), _nothing
        buf = torch.empty(e.sizes, dtype=c.dtype)

        def finish() -> None:
            for req, dest in c.reqs:
                src = buf
                for dim, (start, length) in enumerate(
                    zip(req.storage_offsets, req.lengths, strict=True)
                ):
                    src = src.narrow(dim, start, length)
                if src.shape != dest.shape:
                    raise CorruptCheckpointError(
                        f"read request shape {list(dest.shape)} does not match "
                        f"stored {list(src.shape)}",
                        path=self.path,
                        fqn=c.fqn,
                        rank=self.rank,
                    )
                dest.copy_(src)

        return tensor_view(buf), finish


def _nothing() -> None:
    pass
