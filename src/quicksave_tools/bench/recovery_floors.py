"""The raw floors of ``quicksave bench --recovery``: the least each tier's restore can
cost on this machine, measured on the same bytes, each in a fresh process (the child
side; :mod:`.recovery` runs them).

* ``memory`` — the state's bytes lie in a file in ``/dev/shm`` (node memory, not yet
  mapped by this process, as a node agent's are); they are mapped and copied
  (``memmove``, one thread) into the destinations of a fresh job — the parameters of a
  freshly built model and new, untouched AdamW state tensors — then every destination
  gets one xxh3-64 pass.
* ``disk`` — the quicksave checkpoint's files, evicted from the page cache (see
  :mod:`.recovery_state`), read by 4 threads with ``pread`` (8 MiB pieces) into fresh
  (untouched) memory; then evicted again and read the same way with ``O_DIRECT``.
* ``peer`` — two processes on loopback, one gloo group (a ``FileStore``): rank 0 sends
  a tensor of every state tensor's size, rank 1 receives them into a fresh job's
  destinations; timed on the receiver, then one xxh3-64 pass.
* ``object_store`` — the quicksave checkpoint's objects on the S3 server, fetched with
  8 parallel boto3 ranged GETs of 32 MiB read straight into fresh memory.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import time
from typing import Any

import torch
import xxhash

from quicksave_tools.bench.recovery_state import cached_fraction, evict, files_under, trainer

PIECE = 8 << 20
READ_THREADS = 4


def fresh_destinations(spec: dict[str, Any]) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """A fresh job's destinations of the state: the parameters (and buffers) of a newly
    built model, and for every parameter AdamW's two moments (new, untouched) and its
    step. Returns them and the model (which keeps them alive)."""
    model, _, _ = trainer(spec, seed=spec["seed"] + 1)
    out = [t.detach() for t in model.state_dict().values()]
    for p in model.parameters():
        out += [torch.empty_like(p), torch.empty_like(p), torch.empty((), dtype=torch.float32)]
    return out, model


def _hash_all(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())


def memory_floor(spec: dict[str, Any]) -> dict[str, Any]:
    dest, _model = fresh_destinations(spec)
    total = sum(t.numel() * t.element_size() for t in dest)
    path = os.path.join(spec["shm"], f"qs-recovery-floor-{os.getpid()}")
    chunk = torch.full((PIECE,), 7, dtype=torch.uint8).numpy().tobytes()
    try:
        with open(path, "wb") as f:  # node memory holding the bytes (untimed)
            for at in range(0, total, PIECE):
                f.write(chunk[: min(PIECE, total - at)])
        t0 = time.perf_counter()
        with open(path, "rb") as f:  # private and writable only so that ctypes takes it
            source = mmap.mmap(f.fileno(), total, flags=mmap.MAP_PRIVATE)
        anchor = ctypes.c_char.from_buffer(source)
        base, at = ctypes.addressof(anchor), 0
        for t in dest:
            n = t.numel() * t.element_size()
            ctypes.memmove(t.data_ptr(), base + at, n)
            at += n
        t1 = time.perf_counter()
        _hash_all(dest)
        t2 = time.perf_counter()
        del anchor
        source.close()
    finally:
        os.remove(path)
    return {"bytes": total, "seconds": t2 - t0, "copy_s": t1 - t0, "xxh3_s": t2 - t1}


def _chunks(paths: list[str], align: int) -> tuple[list[tuple[str, int, int, int]], int]:
    """(path, file offset, memory offset, length) pieces of every file, each file's
    region in memory starting at a multiple of ``align``; and the memory needed."""
    out, at = [], 0
    for path in paths:
        size = os.path.getsize(path)
        for off in range(0, size, PIECE):
            out.append((path, off, at + off, min(PIECE, size - off)))
        at += -(-size // align) * align
    return out, at


def _read_all(paths: list[str], direct: bool) -> tuple[float, int]:
    """4 threads read every file into fresh anonymous memory; (seconds, bytes)."""
    align = 4096 if direct else 1
    pieces, size = _chunks(paths, align)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fresh = mmap.mmap(-1, max(size, 1))  # page-aligned, untouched
    view = memoryview(fresh)
    fds = {p: os.open(p, flags) for p in paths}

    def read(piece: tuple[str, int, int, int]) -> int:
        path, off, at, n = piece
        want = -(-n // align) * align  # O_DIRECT: whole blocks; the file's end reads short
        got = os.preadv(fds[path], [view[at : at + want]], off)
        if got < n:
            raise OSError(f"short read of {path} at {off}: {got} of {n} bytes")
        return n

    try:
        with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
            done = sum(pool.map(read, pieces))
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        view.release()
        fresh.close()
    return seconds, done


def disk_floor(spec: dict[str, Any]) -> dict[str, Any]:
    folder = spec["folder"]
    paths = files_under(folder)
    evict(folder)
    cached = cached_fraction(folder)
    seconds, total = _read_all(paths, direct=False)
    out: dict[str, Any] = {
        "bytes": total,
        "files": len(paths),
        "threads": READ_THREADS,
        "pread_s": seconds,
        "cached_before": cached,
    }
    evict(folder)
    try:
        out["direct_s"], _ = _read_all(paths, direct=True)
    except OSError as e:
        out["direct_unavailable"] = f"O_DIRECT read failed: {e.strerror or e}"
    return out


def peer_floor(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the peer floor (``spec["rank"]``: 0 sends, 1 receives)."""
    import torch.distributed as dist

    rank = spec["rank"]
    if rank == 0:
        model, _, _ = trainer(spec, seed=spec["seed"])
        tensors = [t.detach() for t in model.state_dict().values()]
        for p in model.parameters():  # the moments: bytes of the same sizes
            tensors += [p.detach(), p.detach(), torch.zeros((), dtype=torch.float32)]
    else:
        tensors, model = fresh_destinations(spec)
    store = dist.FileStore(spec["store"], 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            if rank == 0:
                dist.send(t, dst=1)
            else:
                dist.recv(t, src=0)
        t1 = time.perf_counter()
        if rank == 1:
            _hash_all(tensors)
        t2 = time.perf_counter()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    total = sum(t.numel() * t.element_size() for t in tensors)
    return {"rank": rank, "bytes": total, "send_recv_s": t1 - t0, "seconds": t2 - t0}


def object_store_floor(spec: dict[str, Any]) -> dict[str, Any]:
    """Parallel ranged GETs of every object under ``spec["prefix"]`` (credentials and
    endpoint: this process's AWS environment)."""
    from quicksave_tools.bench.storage.raw_s3 import RawS3
    from quicksave_tools.bench.storage.target import Target

    target = Target(spec["endpoint_url"], spec["region"], os.environ.get("AWS_ACCESS_KEY_ID"),
                    os.environ.get("AWS_SECRET_ACCESS_KEY"))  # fmt: skip
    client = target.client(concurrency=8)
    listing = client.list_objects_v2(Bucket=spec["bucket"], Prefix=spec["prefix"])
    objects = sorted(((o["Key"], o["Size"]) for o in listing.get("Contents", [])),
                     key=lambda o: -o[1])  # fmt: skip
    raw = RawS3(client, part_size=32 << 20, concurrency=8)
    total = sum(size for _, size in objects)
    try:
        t0 = time.perf_counter()
        fresh = mmap.mmap(-1, max(total, 1))
        view, at = memoryview(fresh), 0
        for key, size in objects:
            if size:
                raw.get(spec["bucket"], key, view[at : at + size])
            at += size
        seconds = time.perf_counter() - t0
        view.release()
        fresh.close()
    finally:
        raw.close()
    return {"bytes": total, "objects": len(objects), "concurrency": 8, "seconds": seconds}


FLOORS = {
    "memory": memory_floor,
    "disk": disk_floor,
    "peer": peer_floor,
    "object_store": object_store_floor,
}
