"""Write one rank's staged file images to storage, and commit a checkpoint's files.

Order of calls in a job (``quicksave.worker.execute``, ``quicksave.worker.multirank``):
``backend_for`` (the job's backend) → ``write_files`` (every file image of the rank from
the staging pool, the missing chunk digests computed on the way) → ``fill_checksums``
(the digests into the manifest) → ``commit_files`` (``.metadata``, the manifest, then the
checkpoint made visible); ``discard`` removes what a failed job wrote. Every rank writes
its own files; ``commit_files`` runs once per checkpoint (a single rank, or the
coordinator of a multi-rank save). ``commit_files`` is also the commit of the DCP
storage writer (``quicksave.adapters.dcp_writer``).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from quicksave import commit
from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.manifest import FileEntry, Manifest, to_json_bytes
from quicksave.parts import part_name
from quicksave.storage.backend import Backend, join
from quicksave.storage.local import LocalBackend
from quicksave.worker.job import FileJob, PersistJob, Usage


def backend_for(job: PersistJob, backends: dict[tuple, Backend]) -> Backend:
    """The backend a job writes through: a fresh local one (it holds only settings), or
    the object store's, kept in ``backends`` from job to job."""
    if job.location is None:
        return LocalBackend(
            fsync=job.fsync, o_direct=job.o_direct, rank=job.rank, write_rate=job.write_rate
        )
    key = job.location.backend_id()
    if key not in backends:
        backends[key] = job.location.open(rank=job.rank)
    return backends[key]


def write_files(
    job: PersistJob, pool: memoryview, backend: Backend, usage: Usage
) -> dict[str, str]:
    """Write every file image of the job into its temporary directory (an object store:
    under the checkpoint's prefix); return the xxh3-64 of every chunk (safetensors key ->
    hex): those the trainer hashed while staging (``job.digests``), the others computed
    while writing. Adds the writer threads' CPU and the bytes hashed to ``usage``."""
    local = isinstance(backend, LocalBackend)
    if local:
        os.makedirs(job.tmp_dir, exist_ok=True)

    def one(f: FileJob) -> tuple[dict[str, str], float]:
        cpu0 = time.thread_time()
        key = join(job.tmp_dir, f.name)
        todo = tuple(e for e in f.entries if e[0] not in job.digests)
        if local:  # whole pages past the end, for O_DIRECT
            image = pool[f.base : f.base + f.size + (-f.size % 4096)]
            digests = backend.put_padded(key, image, f.size, todo)
        else:
            digests = backend.put(key, pool[f.base : f.base + f.size], ranges=todo)
        return digests, time.thread_time() - cpu0

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


def fill_checksums(
    m: Manifest, digests: dict[str, str], keys: dict[str, tuple[str, int]]
) -> Manifest:
    """``m`` with the chunk digests (safetensors key -> xxh3-64 hex) filled in; ``keys``
    maps each key to its tensor and chunk index."""
    tensors = dict(m.tensors)
    chunks: dict[str, list] = {fqn: list(t.chunks) for fqn, t in m.tensors.items()}
    for key, digest in digests.items():
        fqn, i = keys[key]
        chunks[fqn][i] = dataclasses.replace(chunks[fqn][i], xxh3_64=digest)
    for fqn, t in m.tensors.items():
        tensors[fqn] = dataclasses.replace(t, chunks=tuple(chunks[fqn]))
    return dataclasses.replace(m, tensors=tensors)


def discard(job: PersistJob, backend: Backend, parts: bool = False) -> None:
    """Remove what a failed job of this rank wrote (best effort; on object stores
    objects without a manifest are invisible anyway, and start-up clean-up takes them)."""
    if backend.atomic_rename:
        shutil.rmtree(job.tmp_dir, ignore_errors=True)
        return
    keys = [join(job.tmp_dir, f.name) for f in job.files]
    if parts and job.dist is not None:
        keys += [join(job.tmp_dir, part_name(r)) for r in range(job.dist.world_size)]
    elif job.dist is not None:
        keys.append(join(job.tmp_dir, part_name(job.rank)))
    with contextlib.suppress(Exception):
        backend.delete(keys)


def commit_files(
    tmp_dir: str,
    final_path: str,
    manifest: Manifest,
    dcp_metadata: bytes,
    backend: Backend | None = None,
    *,
    replace: bool = False,
) -> None:
    """Write ``.metadata`` then the manifest, and make the checkpoint visible: locally
    into ``tmp_dir``, fsynced, then published by renaming it (``replace``: exchanged
    with a committed checkpoint at ``final_path``, :func:`.commit.publish`); on an
    object store under the checkpoint's prefix (``tmp_dir``), the manifest last, its
    presence the commit."""
    import xxhash

    files = dict(manifest.files)
    files[DCP_METADATA_NAME] = FileEntry(
        len(dcp_metadata), hexdigest(xxhash.xxh3_64_intdigest(dcp_metadata))
    )
    manifest = dataclasses.replace(manifest, files=files)
    manifest_bytes = to_json_bytes(manifest)
    expected = {name: entry.size for name, entry in files.items()}
    if backend is not None and not backend.atomic_rename:
        if replace:
            raise CheckpointError(
                "cannot replace a checkpoint on an object store (no atomic replace)",
                path=final_path,
            )
        backend.put(join(tmp_dir, DCP_METADATA_NAME), memoryview(dcp_metadata))
        commit.commit_on_store(backend, tmp_dir, final_path, expected, manifest_bytes)
        return
    commit.write_durable(os.path.join(tmp_dir, DCP_METADATA_NAME), dcp_metadata)
    commit.write_durable(os.path.join(tmp_dir, MANIFEST_NAME), manifest_bytes)
    expected[MANIFEST_NAME] = len(manifest_bytes)
    if replace:
        commit.publish(tmp_dir, final_path, expected, replace=True)
    else:
        commit.publish(tmp_dir, final_path, expected)
