"""The state dict a benchmark measures, and the baseline operations it is compared with.

Everything here is plain I/O with no timing: :mod:`quicksave_tools.bench.throughput` times it.
"""

from __future__ import annotations

import mmap
import os

import torch
import torch.distributed.checkpoint as dcp

PIECE = 64 << 20  # bytes per raw read/write syscall


# ----------------------------------------------------------------------- state dict
def tensor_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes. The harness's own, not
    the library's: ``bench --training --baseline`` runs it against other versions of
    quicksave, whose internals differ."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_specs(total_bytes: int) -> list[tuple[str, torch.dtype, int]]:
    """Names, dtypes and byte sizes of a state dict shaped like a real model's.

    Half the bytes are in four large tensors (1/4, 1/8, 1/16, 1/16 of the total: 256,
    128, 64, 64 MiB at 1 GiB), the rest in 16 medium, 64 + 128 + 256 small and 64 tiny
    (4 KiB, norm-like) tensors: 532 tensors in all, float32 and bfloat16 alternating.
    """
    groups = [
        ("embed", [total_bytes // 4, total_bytes // 8, total_bytes // 16, total_bytes // 16]),
        ("mlp", [total_bytes // 64] * 16),
        ("attn", [total_bytes // 512] * 64),
        ("proj", [total_bytes // 2048] * 128),
        ("bias", [total_bytes // 4096] * 256),
        ("norm", [4096] * 64),
    ]
    specs = []
    for group, sizes in groups:
        for i, nbytes in enumerate(sizes):
            dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
            nbytes -= nbytes % 4  # a whole number of elements of either dtype
            specs.append((f"{group}.{i}.weight", dtype, max(nbytes, 4)))
    return specs


def build_state_dict(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic state dict of about ``total_bytes`` (see :func:`tensor_specs`)."""
    return state_dict_of(tensor_specs(total_bytes), seed)


def state_dict_of(
    specs: list[tuple[str, torch.dtype, int]], seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random tensors (deterministic for ``seed``) of the ``(name, dtype, bytes)`` of
    ``specs``: rows of 1024 elements where the size allows, else one dimension."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, dtype, nbytes in specs:
        numel = nbytes // dtype.itemsize
        shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        sd[name] = torch.randn(shape, generator=g, dtype=dtype)
    return sd


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# -------------------------------------------------------------------------- methods
def raw_save(sd: dict[str, torch.Tensor], path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in sd.values():
            view = tensor_view(t)
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos : pos + PIECE])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_direct_save(sd: dict[str, torch.Tensor], path: str, bounce: memoryview) -> None:
    """Like :func:`raw_save` but with ``O_DIRECT``: the bytes skip the page cache.

    Tensors are packed through ``bounce`` (page-aligned, a multiple of 4 KiB) because
    ``O_DIRECT`` needs aligned memory, offsets and lengths; a page-aligned staging pool
    laid out like the file would not need this copy.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    size = len(bounce)
    fill = total = 0

    def flush(n: int) -> None:
        if os.write(fd, bounce[:n]) != n:
            raise OSError(f"short O_DIRECT write to {path}")

    try:
        for t in sd.values():
            view = tensor_view(t)
            pos = 0
            while pos < len(view):
                n = min(size - fill, len(view) - pos)
                bounce[fill : fill + n] = view[pos : pos + n]
                fill, pos, total = fill + n, pos + n, total + n
                if fill == size:
                    flush(size)
                    fill = 0
        if fill:
            padded = -(-fill // 4096) * 4096
            bounce[fill:padded] = bytes(padded - fill)
            flush(padded)
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_io_error(directory: str) -> str | None:
    """Why ``O_DIRECT`` cannot be used in ``directory`` (None if it can)."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = os.path.join(directory, ".o_direct_probe")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return None
    except OSError as e:
        return f"O_DIRECT not supported here: {e.strerror}"
    finally:
        buf.close()
        if os.path.exists(probe):
            os.remove(probe)


def raw_load(dest: dict[str, torch.Tensor], path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in dest.values():
            view = tensor_view(t)
            pos = 0
            while pos < len(view):
                n = os.readv(fd, [view[pos : pos + PIECE]])
                if n == 0:
                    raise RuntimeError(f"{path} is shorter than the state dict")
                pos += n
    finally:
        os.close(fd)


def torch_save(sd: dict[str, torch.Tensor], path: str, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def dcp_save(sd: dict[str, torch.Tensor], path: str) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


def dcp_load(dest: dict[str, torch.Tensor], path: str) -> None:
    dcp.load(dest, storage_reader=dcp.FileSystemReader(path))


def pid_cpu_s(pid: int) -> float | None:
    """CPU seconds (utime + stime) process ``pid`` has used so far (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
