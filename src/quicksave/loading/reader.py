"""Reading a committed quicksave checkpoint for DCP's load planner: the reader's steps
that ``quicksave.load`` drives (:mod:`.steps`) and that ``quicksave.StorageReader``
(``adapters/dcp_reader.py``) hands to ``torch.distributed.checkpoint.load``.

Nothing from the checkpoint is unpickled: the DCP metadata is rebuilt from the manifest
(``manifest.json``, or the one inside a DCP-layout ``.metadata``, whose chunks lie at
unaligned offsets inside DCP's own ``.distcp`` files and are read the same way). Reads
go straight into the destination tensors when a stored chunk maps onto a contiguous
piece of one (``preadv`` into its memory; from a local file whose bytes are not in the
page cache, ``O_DIRECT``: ``storage/cold_read.py``), otherwise through one buffer per
stored chunk; every chunk's xxh3-64 is checked as it is read. Each chunk is read from the
checkpoint that holds it (:class:`~.chunks.ChunkSource`: by default the checkpoint
itself, or for a chunk reference the earlier checkpoint of the same run folder that it
names, FORMAT.md §9).

Call order: ``read_metadata`` (all ranks) → ``set_up_storage_reader`` →
``prepare_local_plan`` / ``prepare_global_plan`` (identity) → ``read_data`` (all ranks,
each its own read items).
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
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from quicksave.checksum import tensor_view
from quicksave.commit import CheckpointKind
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CorruptCheckpointError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_from_name
from quicksave.format.manifest import ChunkEntry, Manifest, ObjectEntry
from quicksave.layout.dcp_metadata import manifest_to_metadata
from quicksave.loading.checkpoint import (
    Checkpoint,
    RemoteFiles,
    check_still_there,
    require_committed,
)
from quicksave.loading.chunks import (
    RUN_FOLDER,
    ChunkFiles,
    ChunkSource,
    Span,
    Where,
    check_chunk_digest,
    check_chunk_within,
    read_chunk_into,
    runs,
)
from quicksave.loading.dcp_stock import DCPReader
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir, Member


@dataclass
class _Chunk:
    fqn: str
    entry: ChunkEntry
    dtype: torch.dtype
    where: Where  # the checkpoint and file holding it
    reqs: list[tuple[ReadItem, torch.Tensor]]


class CheckpointReader:
    """Reads one committed quicksave checkpoint into DCP's load planner.

    Args:
        path: the checkpoint: a path, a ``file://``, ``s3://`` or ``msc://`` URL, a
            Location, or a :class:`~.checkpoint.Checkpoint` already classified (then it
            is not classified again).
        thread_count: parallel reader threads (on object stores each also splits a
            large chunk into parallel ranged reads).
        verify: check every chunk's xxh3-64 while reading (on by default).
        storage: how to reach an object store (default: the environment's chain).
        backend: an open backend serving ``path`` to read through (kept open); by
            default one is opened per step.
        chunks: where each chunk's bytes are (default: the checkpoint's own files, and
            for a chunk reference those of the checkpoint it names).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location | Checkpoint,
        *,
        thread_count: int = 4,
        verify: bool = True,
        storage: StorageOptions | None = None,
        backend: Backend | None = None,
        chunks: ChunkSource = RUN_FOLDER,
    ) -> None:
        self.checkpoint = path if isinstance(path, Checkpoint) else None
        self.location = (
            path.location if isinstance(path, Checkpoint) else parse_location(path, options=storage)
        )
        self.path = self.location.url
        self._storage = storage
        self._backend = backend  # a caller's open backend for the location (not closed)
        self.thread_count = max(1, thread_count)
        self.verify = verify
        self.chunks = chunks
        self.rank: int | None = None
        self.manifest: Manifest | None = None
        self._metadata: Metadata | None = None  # built from ``manifest``, once
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.bytes_read = 0

    def read_manifest(self) -> Manifest:
        """The checkpoint's manifest, read once (the location is classified first,
        unless the reader was given a classified checkpoint).

        Raises:
            CheckpointNotFoundError, NotCommittedError: not a committed quicksave
                checkpoint, or deleted since it was classified.
            CorruptCheckpointError: the manifest is damaged.
        """
        if self.manifest is None and self.checkpoint is not None:
            self.manifest = self.checkpoint.read.get("manifest")
        if self.manifest is None:
            with CheckpointDir(self.location, self._backend) as d:
                target = self.checkpoint or self.location
                self.checkpoint = require_committed(target, backend=d.backend, rank=self.rank)
                try:
                    self.manifest = read_manifest(d)
                except CorruptCheckpointError:
                    check_still_there(self.checkpoint, d.backend, fqn=None, rank=self.rank)
                    raise
                self.checkpoint.read["manifest"] = self.manifest
        return self.manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP ``Metadata`` rebuilt from the manifest.

        Built once per checkpoint and kept: a load asks for it before DCP does (a fresh
        optimizer's state is allocated from it), and each build walks every chunk of
        every tensor."""
        if self._metadata is None:
            md = manifest_to_metadata(self.read_manifest(), self.path)
            md.storage_meta = StorageMeta(checkpoint_id=self.path)
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
        """Read this rank's items of ``plan`` into ``planner``'s destinations: objects
        decoded from typed JSON, each tensor chunk once (however many items want parts
        of it), from the checkpoint that holds it, checked, then committed."""
        checkpoint = self.checkpoint or require_committed(self.location, backend=self._backend)
        self.checkpoint = checkpoint
        files = ChunkFiles(checkpoint, self._backend, self.chunks, self.rank)
        try:
            chunks = self._chunks(plan, planner, files)
            if checkpoint.remote is None:
                self._read(files, chunks)
            else:
                self._read_remote(checkpoint.remote, files, chunks)
        finally:
            files.close()
        for c in chunks.values():
            for req, dest in c.reqs:
                planner.commit_tensor(req, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _chunks(
        self, plan: LoadPlan, planner: LoadPlanner, files: ChunkFiles
    ) -> dict[MetadataIndex, _Chunk]:
        """The stored chunks ``plan`` reads, each with the destinations it fills;
        objects are handed to ``planner`` at once."""
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
                    fqn, entry, dtype_from_name(t_entry.dtype), files.where(fqn, entry), []
                )
            chunk.reqs.append((req, planner.resolve_tensor(req).detach()))
        return chunks

    def _read(self, files: ChunkFiles, chunks: dict[MetadataIndex, _Chunk]) -> None:
        by_file: dict[Where, list[_Chunk]] = defaultdict(list)
        for c in chunks.values():
            by_file[c.where].append(c)
        for where, file_chunks in by_file.items():
            f = files.open(where, file_chunks[0].fqn, self.rank)
            with files.naming(where):
                for c in file_chunks:  # before any read or buffer: the file holds it all
                    check_chunk_within(c.entry, f.size, files.url(where), c.fqn, self.rank)
        work = sorted(chunks.values(), key=lambda c: (c.where, c.entry.offset))
        read: Callable[[ChunkFiles, list[_Chunk]], None] = self._read_run
        tasks = runs(work) if files.dir.reads_in_runs else [[c] for c in work]
        threads = files.dir.read_threads(self.thread_count)
        if threads == 1 or len(tasks) <= 1:
            for task in tasks:
                read(files, task)
            return
        with ThreadPoolExecutor(
            min(threads, len(tasks)), thread_name_prefix="quicksave-read"
        ) as pool:
            for f in [pool.submit(read, files, task) for task in tasks]:
                f.result()

    def _read_remote(
        self, remote: RemoteFiles, files: ChunkFiles, chunks: dict[MetadataIndex, _Chunk]
    ) -> None:
        """Every chunk in one exchange with the process that holds the files, straight
        into its destination (or its buffer), each one checked as it lands (while the
        later ones still travel)."""
        work = sorted(chunks.values(), key=lambda c: (c.where, c.entry.offset))
        for c in work:
            url = files.url(c.where)
            size = remote.sizes.get(c.where[1])
            if c.where[0] != self.path or size is None:
                raise CorruptCheckpointError(
                    "data file is missing from the peer's copy", path=url, fqn=c.fqn, rank=self.rank
                )
            check_chunk_within(c.entry, size, url, c.fqn, self.rank)
        targets = [(c, *self._target(c)) for c in work]

        def landed(i: int) -> None:
            c, view, _ = targets[i]
            check_chunk_digest(view, c.entry, path=files.url(c.where), fqn=c.fqn, rank=self.rank)

        reads = [(c.where[1], c.entry.offset, view) for c, view, _ in targets]
        remote.read(reads, landed if self.verify else None)
        for c, _, finish in targets:
            self.bytes_read += c.entry.length
            finish()

    def _read_run(self, files: ChunkFiles, run: list[_Chunk]) -> None:
        """One chunk, or on object stores one ranged read for a run of neighbouring
        chunks of one file (many small tensors would otherwise cost one request each),
        its body scattered straight into each chunk's destination (the bytes between
        chunks into scratch), then every chunk checked."""
        with files.naming(run[0].where):
            self._read_run_of(files, run)

    def _read_run_of(self, files: ChunkFiles, run: list[_Chunk]) -> None:
        fd = files.open(run[0].where, run[0].fqn, self.rank)
        url = files.url(run[0].where)
        if len(run) == 1:
            self._read_chunk(fd, run[0], url)
            return
        if any(b.entry.offset < a.entry.offset + a.entry.length for a, b in pairwise(run)):
            self._read_span(fd, run, url)  # overlapping chunks: read the span once, then copy
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
                path=url,
                fqn=run[-1].fqn,
                rank=self.rank,
            )
        for c, view, finish in targets:
            if self.verify:
                check_chunk_digest(view, c.entry, path=url, fqn=c.fqn, rank=self.rank)
            self.bytes_read += c.entry.length
            finish()

    def _read_span(self, fd: Member, run: list[_Chunk], url: str) -> None:
        start = run[0].entry.offset
        end = max(c.entry.offset + c.entry.length for c in run)
        view = memoryview(bytearray(end - start))
        got = fd.read_scatter([view], start)  # short where the file ends: the chunks say so
        held = Span(view[:got], start)
        for c in run:
            self._read_chunk(held, c, url)

    def _read_chunk(self, fd: Member, c: _Chunk, url: str) -> None:
        view, finish = self._target(c)
        read_chunk_into(fd, view, c.entry, path=url, fqn=c.fqn, rank=self.rank, verify=self.verify)
        self.bytes_read += c.entry.length
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


def reader_for(
    checkpoint: Checkpoint,
    backend: Backend | None,
    *,
    thread_count: int = 4,
    allow_dcp_pickle: bool = False,
) -> CheckpointReader | DCPReader:
    """The reader of a classified checkpoint: DCP's (restricted unpickling) for a stock
    DCP one, else quicksave's."""
    if checkpoint.kind is CheckpointKind.DCP:
        return DCPReader(checkpoint.location, allow_pickle=allow_dcp_pickle, backend=backend)
    return CheckpointReader(checkpoint, thread_count=thread_count, backend=backend)
