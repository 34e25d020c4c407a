"""``FileSystemWriterAsync``'s DCP layout (docs/FORMAT.md §8) on a local path: DCP's own
files, byte for byte, with quicksave's manifest at the end of ``.metadata``.

Order of calls:

1. (coordinator, or every rank replaying a loaded plan; trainer) :func:`dcp_rank_layout`
   lays out each rank's ``__{rank}_{i}.distcp`` files as DCP's ``FileSystemWriter`` does;
2. (every rank, checkpoint worker) :func:`write_dcp_rank_data` = ``save_fn``: the rank's
   data files (``dcp_write.write_dcp_file``, one thread each), then its part (item
   offsets and digests), its "done" record; a failure leaves an error part instead;
3. (coordinator, trainer, at finalize) :func:`commit_dcp` reads every rank's part
   (:func:`read_dcp_part`), writes ``.metadata`` = pickle | manifest | footer and renames
   the temporary directory into place.

No collective: the parts on disk are how the ranks' results reach the coordinator.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType

from quicksave.adapters.dcp_writer import dcp_skeleton, item_spec
from quicksave.commit import CommitStrategy, parts
from quicksave.compat.nvrx.dcp_write import write_dcp_file
from quicksave.compat.nvrx.rank_write import (
    RankWritesFailed,
    SaveLayout,
    clear_for_commit,
    rank_members,
    read_error_part,
    worker_strategy,
    write_error_part,
)
from quicksave.compat.nvrx.staging import tensors_of
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME
from quicksave.format.dcp_layout import encode_metadata
from quicksave.format.keys import dcp_planner_data
from quicksave.format.manifest import FileEntry, to_json_bytes
from quicksave.layout.plan import ItemSpec
from quicksave.layout.skeleton import Placed, chunk_keys_of
from quicksave.storage.location import Location

DCP_SUFFIX = ".distcp"
INVALID_SETUP = (
    "Invalid Setup! User cannot establish a daemon Async worker and then use Multi-Proc "
    "File IO: build the AsyncCallsQueue with is_daemon=False, or pass is_multiproc_io=False"
)


@dataclass(frozen=True)
class DcpItem:
    """One DCP write item of a rank: a tensor chunk (``spec``) or a byte item (an object)."""

    key: str
    fqn: str
    spec: ItemSpec | None  # None: a byte item

    @property
    def index(self) -> MetadataIndex:
        if self.spec is None:
            return MetadataIndex(self.fqn)
        return MetadataIndex(self.fqn, torch.Size(self.spec.offsets))


@dataclass(frozen=True)
class DcpFile:
    """A data file and its items in DCP's order: byte items first, then tensors."""

    name: str
    items: tuple[DcpItem, ...]


@dataclass(frozen=True)
class DcpRankLayout:
    rank: int
    files: tuple[DcpFile, ...]


def _dcp_item(item: Any) -> DcpItem:
    if item.type == WriteItemType.BYTE_IO:
        return DcpItem(item.index.fqn, item.index.fqn, None)
    spec = item_spec(item)
    return DcpItem(spec.key, spec.fqn, spec)


def dcp_rank_layout(
    rank: int, items: list[Any], thread_count: int, single_file_per_rank: bool = True
) -> DcpRankLayout:
    """The files rank ``rank`` writes, as DCP's ``FileSystemWriter`` lays them out:
    ``__{rank}_{i}.distcp``; one file per item without ``single_file_per_rank``; else
    ``thread_count`` files, byte items dealt round-robin and tensors, largest first, each
    to the least-filled file (with one file: every item, in plan order)."""
    if not single_file_per_rank:
        buckets = [[i] for i in items]
    elif thread_count <= 1:
        buckets = [list(items)]
    else:
        byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
        buckets = [[] for _ in range(thread_count)]
        sizes = [0] * thread_count
        tensors.sort(key=lambda i: item_spec(i).nbytes, reverse=True)  # stable, as DCP's
        for n, i in enumerate(byte_items):
            buckets[n % thread_count].append(i)
        for i in tensors:
            at = min(range(thread_count), key=lambda b: sizes[b])
            buckets[at].append(i)
            sizes[at] += item_spec(i).nbytes
    files = []
    for n, bucket in enumerate(buckets):
        ordered = [i for i in bucket if i.type == WriteItemType.BYTE_IO] + [
            i for i in bucket if i.type != WriteItemType.BYTE_IO
        ]
        files.append(DcpFile(f"__{rank}_{n}{DCP_SUFFIX}", tuple(_dcp_item(i) for i in ordered)))
    return DcpRankLayout(rank, tuple(files))


@dataclass(frozen=True)
class DcpWriteJob:
    """The picklable description of one rank's background write in the DCP layout.

    ``draft`` is the save's draft under the commit strategy of ``location`` (the
    checkpoint's; one that can write the DCP layout, so a temporary directory)."""

    rank: int
    draft: str
    location: Location
    layout: DcpRankLayout
    byte_items: dict[str, bytes]  # key -> DCP's bytes of the object (torch.save)
    objects: dict[str, Any]  # fqn -> typed JSON, for the manifest
    fsync: bool
    open_file: Callable[..., Any] = open
    multiproc_io: bool = False


def write_dcp_rank_data(job: DcpWriteJob, staged: Any) -> None:
    """``save_fn`` in the DCP layout: this rank's data files (one thread each), then its
    part (item offsets and digests), the rank's "done" record, through the commit
    strategy of the checkpoint's location (opened here, in the worker).

    A failure is recorded in an error part, which the coordinator reports at finalize on
    every rank (NVRx reports writer failures at finalize too); this function then returns
    normally. It raises only when even the error part cannot be written.

    Raises:
        CheckpointError: the write failed and the failure could not be recorded.
    """
    pool = staged  # keeps the pool's memory alive while its tensors are written
    staged = tensors_of(pool)
    with worker_strategy(job.location, job.fsync, job.rank) as strategy:
        try:
            _write_dcp_rank_files(job, staged, strategy)
        except Exception as e:  # noqa: BLE001 - recorded for the coordinator
            cause = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            try:
                strategy.prepare_draft(job.draft)
                write_error_part(strategy, job.draft, job.rank, cause)
            except (OSError, CheckpointError):
                raise CheckpointError(
                    f"rank {job.rank} failed to write its checkpoint data: {cause}",
                    path=job.draft,
                    rank=job.rank,
                ) from e


def _write_dcp_rank_files(job: DcpWriteJob, staged: Any, strategy: CommitStrategy) -> None:
    """The body of :func:`write_dcp_rank_data`: what this rank left in the draft by an
    earlier attempt removed, its data files written, its part last."""
    if job.multiproc_io:
        import multiprocessing

        if multiprocessing.current_process().daemon:
            raise CheckpointError(INVALID_SETUP, path=job.draft, rank=job.rank)
    strategy.prepare_draft(job.draft)
    names = [f.name for f in job.layout.files]
    strategy.delete_members(job.draft, names + rank_members(job.rank))

    def write_one(f: DcpFile) -> dict[str, Any]:
        items: list[tuple[str, Any]] = []
        for it in f.items:
            items.append((it.key, job.byte_items[it.key] if it.spec is None else staged[it.key]))
        with job.open_file(strategy.member_key(job.draft, f.name), "wb") as stream:
            w = write_dcp_file(stream, items, fsync=job.fsync)
        return _file_record(w)

    files = job.layout.files
    if len(files) <= 1:
        records = [write_one(f) for f in files]
    else:
        with ThreadPoolExecutor(len(files), thread_name_prefix="quicksave-dcp") as pool:
            records = list(pool.map(write_one, files))
    body = {
        "format": DCP_PART_FORMAT,
        "rank": job.rank,
        "files": {f.name: r for f, r in zip(files, records, strict=True)},
        "objects": job.objects,
    }
    parts.write_sealed(strategy, job.draft, parts.part_name(job.rank), parts.seal(body), job.fsync)


DCP_PART_FORMAT = "quicksave-dcp-part"


def _file_record(w: Any) -> dict[str, Any]:
    items = {}
    for key, it in w.items.items():
        items[key] = [
            it.item_offset,
            it.item_length,
            getattr(it, "raw_offset", None),
            getattr(it, "raw_length", None),
            getattr(it, "xxh3_64", None),
        ]
    return {"size": w.size, "xxh3_64": w.xxh3_64, "items": items}


def read_dcp_part(strategy: CommitStrategy, draft: str, layout: DcpRankLayout) -> dict[str, Any]:
    """One rank's DCP part under ``draft``, checked against its layout.

    Raises:
        CheckpointError: the rank recorded an error or left no part (its cause).
        CorruptCheckpointError: the part is damaged or does not match the layout.
    """
    rank = layout.rank
    cause = read_error_part(strategy, draft, rank)
    if cause is not None:
        raise CheckpointError(cause, path=strategy.backend.url(draft), rank=rank)
    body, path = parts.read_sealed(strategy, draft, rank, DCP_PART_FORMAT)
    files = body.get("files")
    for f in layout.files:
        rec = files.get(f.name) if isinstance(files, dict) else None
        items = rec.get("items") if isinstance(rec, dict) else None
        if (
            not isinstance(items, dict)
            or set(items) != {it.key for it in f.items}
            or not isinstance(rec.get("size"), int)
            or not isinstance(rec.get("xxh3_64"), str)
            or not all(_item_record_ok(items[it.key], it.spec is None) for it in f.items)
        ):
            raise CorruptCheckpointError(
                f"the part does not match the plan for {f.name}", path=path, rank=rank
            )
    if not isinstance(body.get("objects", {}), dict):
        raise CorruptCheckpointError("the part's objects are malformed", path=path, rank=rank)
    return body


def _item_record_ok(record: Any, byte_item: bool) -> bool:
    # [item_offset, item_length, raw_offset, raw_length, xxh3_64]; the last three are
    # null for a byte item
    if not isinstance(record, list) or len(record) != 5:
        return False
    ints = record[:2] if byte_item else record[:4]
    if not all(isinstance(v, int) and v >= 0 for v in ints):
        return False
    return byte_item or isinstance(record[4], str)


def commit_dcp(
    strategy: CommitStrategy,
    metadata: Metadata,
    layout: SaveLayout,
    *,
    draft: str,
    location: Location,
    step: int | None,
    user_metadata: dict[str, Any] | None,
    save_id: str,
    overwrite: bool,
) -> None:
    """The coordinator's commit of a DCP-layout save: read every rank's part, build DCP's
    ``Metadata`` (``storage_data`` → each item's bytes) and quicksave's manifest, write
    ``.metadata`` = pickle | manifest | footer (FORMAT.md §8), check that every file is
    whole, and commit ``draft`` at ``location`` through ``strategy`` (a
    rename of the temporary directory, replacing an older checkpoint there atomically
    when ``overwrite``).

    Raises:
        RankWritesFailed: ranks recorded errors or left no part (every one named).
        CheckpointError: the commit itself failed.
    """
    path = location.url
    bodies: dict[int, dict[str, Any]] = {}
    causes: dict[int, str] = {}
    for lay in layout.layouts:
        assert isinstance(lay, DcpRankLayout)
        try:
            bodies[lay.rank] = read_dcp_part(strategy, draft, lay)
        except CheckpointError as e:
            causes[lay.rank] = e.message
    if causes:
        raise RankWritesFailed(causes, path)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[str, FileEntry] = {}
    expected: dict[str, int] = {}
    placed: list[Placed] = []
    rank_parts: list[parts.RankPart] = []
    for lay in layout.layouts:
        body = bodies[lay.rank]
        digests: dict[str, str] = {}
        for f in lay.files:
            rec = body["files"][f.name]
            expected[f.name] = int(rec["size"])
            if any(it.spec is not None for it in f.items):  # the manifest lists tensor files
                # no header in this layout: the entry carries the whole file's checksum
                files[f.name] = FileEntry(int(rec["size"]), str(rec["xxh3_64"]), lay.rank, None)
            for it in f.items:
                item_off, item_len, raw_off, raw_len, digest = rec["items"][it.key]
                storage[it.index] = _StorageInfo(f.name, int(item_off), int(item_len))
                if it.spec is not None:
                    placed.append(Placed(it.spec, f.name, int(raw_off), int(raw_len), lay.rank))
                    digests[it.key] = str(digest)
        rank_parts.append(parts.RankPart(lay.rank, digests, dict(body.get("objects", {}))))
    plans = layout.plans if len(layout.plans) > 1 else None
    skeleton = dcp_skeleton(metadata, files, placed, world_size=len(layout.layouts), plans=plans)
    manifest = parts.manifest_from_parts(skeleton, chunk_keys_of(skeleton), rank_parts, draft)
    manifest = dataclasses.replace(
        manifest, step=step, user_metadata=dict(user_metadata or {}), layout="dcp"
    )
    dcp_md = copy.copy(metadata)
    dcp_md.storage_data = storage
    dcp_md.planner_data = dcp_planner_data(metadata.planner_data)  # the pickle: DCP's only
    dcp_md.storage_meta = StorageMeta(checkpoint_id=path, save_id=save_id)
    data = encode_metadata(pickle.dumps(dcp_md), to_json_bytes(manifest))
    clear_for_commit(strategy, draft, set(expected), len(layout.layouts))
    strategy.commit(draft, location, {DCP_METADATA_NAME: data}, expected, replace=overwrite)
