"""Write one rank's staged file images to storage, and commit a checkpoint's files.

Order of calls in a job (``quicksave.worker.execute``, ``quicksave.worker.multirank``):
``backend_for`` (the job's backend) → ``write_files`` (every file image of the rank from
the staging pool, the missing chunk digests computed on the way) →
``commit.parts.manifest_from_parts`` (the digests into the manifest) → ``commit_files``
(``.metadata``, the manifest, then the checkpoint made visible by the location's commit
strategy); ``discard`` removes what a
failed job wrote. Every rank writes
its own files; ``commit_files`` runs once per checkpoint (a single rank, or the
coordinator of a multi-rank save). ``commit_files`` is also the commit of the DCP
storage writer (``quicksave.adapters.dcp_writer``).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

from quicksave.checksum import hexdigest
from quicksave.commit import CheckpointKind, CommitStrategy, strategy_for
from quicksave.commit.parts import part_name
from quicksave.commit.strategy import StagedFiles
from quicksave.errors import AlreadyCommittedError, CheckpointError, CheckpointExistsError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.manifest import FileEntry, Manifest, TensorsTemplate, to_json_bytes
from quicksave.storage.backend import PAGE, Backend, join
from quicksave.storage.location import Location
from quicksave.storage.retry import StoreHealth
from quicksave.worker.job import FileJob, PersistJob, Usage


def backend_for(
    job: PersistJob, backends: dict[tuple, Backend], health: StoreHealth | None = None
) -> Backend:
    """The backend a job writes through, kept in ``backends`` from job to job (one per
    container and write settings: a store's client is costly, a local one holds only
    settings)."""
    loc = job.location
    key = (loc.backend_id(), job.fsync, job.o_direct, job.write_rate, job.rank)
    if key not in backends:
        backends[key] = loc.open(
            fsync=job.fsync,
            o_direct=job.o_direct,
            rank=job.rank,
            write_rate=job.write_rate,
            health=health,
        )
    return backends[key]


def check_target(job: PersistJob, strategy: CommitStrategy) -> None:
    """Before a job writes anything: raise unless its checkpoint can be committed at
    its location (:meth:`CommitStrategy.check_target`; ``AlreadyCommittedError`` for a
    committed one). An uncommitted leftover there (a crashed save's) is removed first
    where a single-rank job's rank holds the folder's lease (``job.clear_uncommitted``).
    A multi-rank job passes over uncommitted objects: on a store the other ranks of the
    same save may have written theirs there already (in place), and no rank may delete
    them; the coordinator's commit checks what is there (a leftover of another save
    fails it, and housekeeping removes it)."""
    loc = job.location
    assert loc is not None
    try:
        strategy.check_target(loc, job.rank, replace=job.replace)
        return
    except AlreadyCommittedError:
        raise
    except CheckpointExistsError:
        if strategy.classify(loc) is not CheckpointKind.UNCOMMITTED:
            raise
        if job.dist is not None:
            return
        if not job.clear_uncommitted:
            raise
        strategy.remove(loc)
    strategy.check_target(loc, job.rank, replace=job.replace)


def write_files(
    job: PersistJob, pool: memoryview, backend: Backend, usage: Usage
) -> dict[str, str]:
    """Write every file image of the job into its temporary directory (an object store:
    under the checkpoint's prefix); return the xxh3-64 of every chunk (safetensors key ->
    hex): those the trainer hashed while staging (``job.digests``), the others computed
    while writing. Adds the writer threads' CPU and the bytes hashed to ``usage``."""
    strategy_for(job.location, backend).prepare_draft(job.draft)  # also with no file: parts, commit
    if job.linked is not None:
        return _link_file(job, pool, usage)

    def one(f: FileJob) -> tuple[dict[str, str], float]:
        cpu0 = time.thread_time()
        key = join(job.draft, f.name)
        if job.bases and any(e[0] in job.bases for e in f.entries):
            image = pool[f.base : f.base + f.size]
            pieces = _pieces_around(f, image, job.bases, job.digests)
            return backend.put_pieces(key, f.size, pieces), time.thread_time() - cpu0
        todo = tuple(e for e in f.entries if e[0] not in job.digests)
        # the pool lays every image out to whole pages past its end (for O_DIRECT)
        image = pool[f.base : f.base + f.size + (-f.size % PAGE)]
        return backend.put_padded(key, image, f.size, todo), time.thread_time() - cpu0

    digests: dict[str, str] = dict(job.digests)
    usage.bytes_hashed += sum(e[2] for f in job.files for e in f.entries if e[0] not in digests)
    if len(job.files) <= 1 or job.thread_count <= 1:
        for f in job.files:
            digests.update(one(f)[0])  # on the job's thread: counted by its usage.cpu0
    else:
        with ThreadPoolExecutor(min(job.thread_count, len(job.files))) as ex:
            for d, cpu in ex.map(one, job.files):
                digests.update(d)
                usage.helpers_cpu_s += cpu
    return digests


def _pieces_around(
    f: FileJob, image: memoryview, bases: dict[str, int], digests: dict[str, str]
) -> list[tuple[str | None, int, memoryview]]:
    """The pieces of ``f``'s image that are written (``Backend.put_pieces``): everything
    but the chunks that refer to an earlier checkpoint, whose ranges stay holes (zeros,
    FORMAT.md §9; the pool holds no bytes of theirs). A chunk is named (hashed on the
    way) unless its digest is known; neighbouring unnamed pieces are merged."""
    spans: list[tuple[str | None, int, int]] = []  # (name, start, end)

    def add(name: str | None, start: int, end: int) -> None:
        if end <= start:
            return
        if name is None and spans and spans[-1][0] is None and spans[-1][2] == start:
            spans[-1] = (None, spans[-1][1], end)
        else:
            spans.append((name, start, end))

    cur = 0
    for key, offset, length in sorted(f.entries, key=lambda e: e[1]):
        add(None, cur, offset)  # header, padding
        if key not in bases:
            add(None if key in digests else key, offset, offset + length)
        cur = offset + length
    add(None, cur, f.size)
    return [(name, start, image[start:end]) for name, start, end in spans]


def _link_file(job: PersistJob, pool: memoryview, usage: Usage) -> dict[str, str]:
    """In place: the job's one data file is the pool's own file (``job.linked``, on the
    draft's filesystem), hard-linked into the draft; the chunks the trainer did not hash
    are hashed from the pool."""
    import xxhash

    digests: dict[str, str] = dict(job.digests)
    for f in job.files:  # one at most (the pool holds it at offset 0)
        for key, offset, length in f.entries:
            if key not in digests:
                chunk = pool[f.base + offset : f.base + offset + length]
                digests[key] = hexdigest(xxhash.xxh3_64_intdigest(chunk))
                usage.bytes_hashed += length
        target = join(job.draft, f.name)
        try:
            os.link(job.linked, target)
        except OSError as e:
            raise CheckpointError(
                f"cannot link the staged snapshot: {e}", path=target, rank=job.rank
            ) from e
    return digests


def discard(job: PersistJob, backend: Backend, parts: bool = False) -> None:
    """Remove what a failed job of this rank wrote (best effort; on object stores
    objects without a manifest are invisible anyway, and start-up clean-up takes them):
    its files, and its part (``parts``: every rank's, the coordinator's clean-up)."""
    names = [f.name for f in job.files]
    if job.dist is not None:
        ranks = range(job.dist.world_size) if parts else (job.rank,)
        names += [part_name(r) for r in ranks]
    strategy_for(job.location, backend).discard(job.draft, names)


def commit_files(
    strategy: CommitStrategy,
    draft: str,
    loc: Location,
    manifest: Manifest,
    dcp_metadata: bytes,
    *,
    replace: bool = False,
    staged: StagedFiles | None = None,
    template: TensorsTemplate | None = None,
) -> None:
    """Add ``.metadata`` to the manifest's files and commit the save written under
    ``draft`` at ``loc`` (:meth:`CommitStrategy.commit`): ``.metadata``, then the
    manifest, last (``replace``: exchanged with a committed checkpoint at ``loc``;
    ``staged``: the files in the pool they were written from; ``template``: of the
    skeleton the manifest was filled from, ``format.manifest.to_json_bytes``)."""
    import xxhash

    expected = {name: entry.size for name, entry in manifest.files.items()}
    files = dict(manifest.files)
    files[DCP_METADATA_NAME] = FileEntry(
        len(dcp_metadata), hexdigest(xxhash.xxh3_64_intdigest(dcp_metadata))
    )
    manifest_bytes = to_json_bytes(dataclasses.replace(manifest, files=files), template)
    members = {DCP_METADATA_NAME: dcp_metadata, MANIFEST_NAME: manifest_bytes}
    strategy.commit(draft, loc, members, expected, replace=replace, staged=staged)


def staged_files(job: PersistJob, pool: memoryview) -> StagedFiles:
    """The job's data files in ``pool`` (views, no copy), for the commit."""
    return StagedFiles(pool, {f.name: (f.base, f.size) for f in job.files})
