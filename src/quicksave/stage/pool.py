"""Stage: copy tensors into a reusable pool of host memory, laid out as the file images
or as plain tensor slots.

The pool is one anonymous shared-memory region (``memfd``): no path, so nothing can leak
when processes die; its file descriptor is handed to the worker process, which maps the
same pages and writes files straight from them. Bytes never travel through a pipe.

Two layouts, one pool:

* **file images** (a ``RankLayout``, the engine's): every data file of a rank back to
  back, each at a 4 KiB-aligned base, exactly as the file will be on disk (header
  included, written at build), so persisting is a few large sequential writes — and
  O_DIRECT works, since bases and lengths are page-aligned.
* **tensor slots** (a ``SlotLayout``, tensor_slots.py; the NVRx-compatible writer's): every
  tensor at a 64-byte aligned offset, no headers. The trainer copies into the slots
  (:meth:`StagingPool.stage_slots`) and the writer reads them back as tensors
  (:meth:`StagingPool.tensors`). Such a pool travels to NVRx's persistent worker process
  pickled (``ForkingPickler``) as ONE file descriptor, whatever the number of tensors:
  the worker maps the same pages again (no populate, no header), and unmaps them when
  that object and its tensors are garbage. A pool large enough for the next save's
  slots is reused by it (:meth:`StagingPool.adopt`).

Memory is allocated and touched once (``fallocate``, then every page faulted in: a fresh
page costs a fault and a clearing on its first write), reused by every save with the
same plan, and rebuilt only when the plan changes. Who touches the pages matters on a
busy machine: a pool built ahead of the first save (``populate=False``) is allocated
here but its pages are cleared and mapped by the worker process (its ``MAP_POPULATE``,
at the worker's lower CPU priority, in another address space), so that training threads
neither pay for the page clearing nor wait on their own process's memory-map lock while
it runs; the trainer's mapping then takes only cheap minor faults at the first copy. In
thread mode :meth:`StagingPool.touch` does the clearing from a background thread. At
start-up, when nothing competes, the pool is populated where it is built, behind
:func:`shield_free_pages` so that it takes fresh pages rather than those the training
loop recycles (see that function). On a CUDA machine the pool is also page-locked
(``cudaHostRegister``) so device-to-host copies run asynchronously on a side stream.

Pool states: EMPTY → (build) → READY → (stage) → STAGED → (worker writing) → IN_USE
→ (worker done) → READY. A pool in IN_USE is never written: backpressure lives in the
engine, which owns the pools (in the NVRx-compatible API: the free pool is handed back
only at finalize, when its write is over).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import torch
import xxhash

from quicksave.checksum import hexdigest, tensor_view
from quicksave.errors import CheckpointError
from quicksave.format import ALIGNMENT
from quicksave.layout.plan import RankLayout
from quicksave.stage.page_shield import shield_free_pages
from quicksave.stage.tensor_slots import SlotLayout, slot_tensors
from quicksave.worker.persist import as_writable_source

# Copy-and-hash block: small enough that the block is still in the L2 cache when it is
# hashed right after its copy, large enough that the Python loop costs nothing (~6k
# iterations per 1.6 GB).
HASH_BLOCK = 256 << 10
# Tensors up to HASH_BLOCK are staged in batches: one torch call copies a batch of up to
# BATCH_BYTES (still in the cache when each tensor is hashed right after), instead of a
# Python call per tensor (a language model holds ~1,000 such biases, norms and steps).
BATCH_BYTES = 1 << 20


def digest_of(view: torch.Tensor) -> str:
    """The xxh3-64 (hex) of the pool bytes ``view`` (a uint8 tensor)."""
    return hexdigest(xxhash.xxh3_64(view.numpy()).intdigest())


# What to stage where: (key, pool offset, length, tensor); the key names the digest.
Item = tuple[str, int, int, torch.Tensor]


def _plain_cpu(src: torch.Tensor, nbytes: int) -> bool:
    """A CPU tensor whose bytes are one piece, as they are (``memmove``-able)."""
    return (
        src.device.type == "cpu"
        and src.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and src.numel() * src.dtype.itemsize == nbytes
    )


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class PoolFile:
    """Where one data file's image lies in the pool."""

    name: str
    base: int  # pool offset of the file's byte 0
    size: int  # the file's exact size


@dataclass(frozen=True)
class PoolLayout:
    files: tuple[PoolFile, ...]
    nbytes: int  # total pool size (page-aligned)

    def base_of(self, name: str) -> int:
        for f in self.files:
            if f.name == name:
                return f.base
        raise KeyError(name)


def pool_layout(layout: RankLayout | SlotLayout) -> PoolLayout:
    """Place a rank's file images back to back at aligned bases (a slot layout holds no
    file image: only its size). Pure."""
    if isinstance(layout, SlotLayout):
        return PoolLayout((), layout.nbytes)
    files = []
    cur = 0
    for f in layout.files:
        files.append(PoolFile(f.name, cur, f.size))
        cur = _align(cur + f.size)
    return PoolLayout(tuple(files), max(cur, ALIGNMENT))


def pool_cost(layout: RankLayout) -> int:
    """Bytes of host memory a pool for ``layout`` takes (declared before allocating)."""
    return pool_layout(layout).nbytes


class StagingPool:
    """Shared host memory holding one rank's checkpoint: its file images, or its tensors
    in slots (see the module docstring).

    Args:
        layout: the rank's file layout (layout/plan.py; the headers are written at build time),
            or a slot layout (slots.py; nothing is written at build time).
        pin: page-lock for CUDA copies (default: when CUDA is available).
        populate: fault every page into this process now (``MAP_POPULATE``), behind a
            :func:`shield_free_pages` so that the pool does not take the pages training
            recycles. False: the pages are allocated (``fallocate``: running out of
            memory is an error here, never a ``SIGBUS`` later) but left for another
            process or :meth:`touch`.
        file: back the pool with a new file at this path (on a tmpfs: a memory tier's
            folder) instead of an anonymous memfd, for a layout of at most one data
            file, which then lies at the file's offset 0 with the file's exact size: a
            checkpoint can take the pool's bytes as its data file by a hard link (no
            copy), and :meth:`linked` says whether one still does. :meth:`close`
            removes the pool's own name; a link keeps the bytes.

    Raises:
        CheckpointError: the memory cannot be allocated (names the size).
    """

    def __init__(
        self,
        layout: RankLayout | SlotLayout,
        *,
        pin: bool | None = None,
        populate: bool = True,
        file: str | None = None,
    ) -> None:
        self._init_state(layout, pool_layout(layout).nbytes)
        size = self.nbytes
        if file is not None:
            if len(self.pool.files) > 1:
                raise CheckpointError(
                    f"a pool backed by a file holds one data file, not {len(self.pool.files)}",
                    path=file,
                )
            # the data file's exact size, and so the pool's (not whole pages)
            size = self.nbytes = self.pool.files[0].size if self.pool.files else self.nbytes
        shield = shield_free_pages(self.nbytes) if populate else contextlib.nullcontext()
        try:
            with shield:
                if file is None:
                    self.fd = os.memfd_create(f"quicksave-pool-{os.getpid()}", os.MFD_CLOEXEC)
                else:
                    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                    self.fd = os.open(file, flags, 0o600)
                    self.file = file
                os.ftruncate(self.fd, size)
                os.posix_fallocate(self.fd, 0, size)  # allocate now, not at first write
                mm = mmap.mmap(
                    self.fd,
                    self.nbytes,
                    flags=mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0),
                )
        except OSError as e:
            self.close()
            raise CheckpointError(
                f"cannot allocate a {self.nbytes / 2**20:.1f} MiB staging pool in shared "
                f"memory: {e.strerror}; lower max_in_flight or free memory",
                path=file,
            ) from e
        self._attach(mm)
        self._write_headers()
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin:
            self._pin()

    def _init_state(self, layout: RankLayout | SlotLayout, nbytes: int) -> None:
        self.layout = layout
        self.pool = pool_layout(layout)
        self.nbytes = nbytes  # the memory's size (a slot layout adopted may use less)
        self.fd = -1
        self.file: str | None = None  # the backing file's path (None: a memfd)
        self._mm: mmap.mmap | None = None
        self._bytes: memoryview | None = None
        self._typed: dict[tuple, torch.Tensor] = {}
        self._registered = False

    def _attach(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self.buffer = torch.frombuffer(mm, dtype=torch.uint8)
        self._bytes = memoryview(mm)  # for hashing slices without a tensor each

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickle as ONE handle to the memory, not its bytes: the file descriptor goes
        with ``multiprocessing.reduction.DupFd`` (``ForkingPickler``: through the
        resource sharer, as torch's own shared tensors; the receiver must load it
        once), with the layout; :func:`_map_sent_pool` maps it again on load. A pickle
        never loaded (its worker died first) leaves the duplicate descriptor, and so the
        pool's memory, with the resource sharer until this process exits."""
        if self.fd < 0:
            raise CheckpointError("a staging pool mapped from another process cannot be sent on")
        return _map_sent_pool, (DupFd(self.fd), self.nbytes, self.layout)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, modules may be gone
            pass

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise CheckpointError(f"cudaHostRegister of the staging pool failed (error {int(err)})")
        self._registered = True

    def _write_headers(self) -> None:
        if isinstance(self.layout, SlotLayout):
            return  # plain tensors: no header
        for f, pf in zip(self.layout.files, self.pool.files, strict=True):
            self.buffer[pf.base : pf.base + len(f.header)].copy_(
                torch.frombuffer(bytearray(f.header), dtype=torch.uint8)
            )
            for off, fixed in f.fixed:  # torch legacy prefixes (dcp_compat layouts)
                self.buffer[pf.base + off : pf.base + off + len(fixed)].copy_(
                    torch.frombuffer(bytearray(fixed), dtype=torch.uint8)
                )

    def adopt(self, layout: RankLayout | SlotLayout) -> bool:
        """Take ``layout`` for this pool's memory if its file images lie at the same
        places with the same sizes (the tensors' order in the state dict, names or
        values that are not tensors may differ): the headers are rewritten and the gaps
        between tensors cleared, nothing is allocated or faulted in. Returns False (and
        changes nothing) if the images differ. Call only while no save uses the pool.

        A slot layout is taken by a slot pool at least its size (nothing to rewrite: a
        slot pool has no header, and no reader looks between the slots)."""
        if layout == self.layout:
            return True
        if isinstance(layout, SlotLayout) or isinstance(self.layout, SlotLayout):
            if not isinstance(self.layout, SlotLayout) or not isinstance(layout, SlotLayout):
                return False
            if layout.nbytes > self.nbytes:
                return False
            self.layout = layout
            self._typed.clear()
            return True
        if pool_layout(layout) != self.pool:
            return False
        self.layout = layout
        self._typed.clear()
        for f, pf in zip(layout.files, self.pool.files, strict=True):
            cur = f.data_start
            for e in sorted(f.entries, key=lambda e: e.offset):
                if e.offset > cur:
                    self.buffer[pf.base + cur : pf.base + e.offset].zero_()
                cur = max(cur, e.offset + e.length)
        self._write_headers()  # after the gaps: the torch legacy prefixes lie in them
        return True

    def touch(self) -> None:
        """Fault in every page of the pool (one write per page; the memory-map lock is
        taken per fault, not for the whole pool as ``MAP_POPULATE`` takes it). Call
        before the pool is handed out: it rewrites the headers."""
        self.buffer[:: mmap.PAGESIZE].zero_()
        self._write_headers()

    @property
    def pinned(self) -> bool:
        return self._registered

    def linked(self) -> bool:
        """Whether a checkpoint holds this file-backed pool's bytes as its data file (a
        hard link besides the pool's own name): the pool must not be staged into then."""
        return self.fd >= 0 and self.file is not None and os.fstat(self.fd).st_nlink > 1

    def view(self, file: str, offset: int, length: int) -> torch.Tensor:
        """The pool bytes of ``file[offset:offset+length]`` as a uint8 tensor."""
        base = self.pool.base_of(file)
        return self.buffer[base + offset : base + offset + length]

    def stage(self, dest: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy ``src`` (any device, any strides) into the pool bytes ``dest``."""
        if dest.numel() == 0:
            return
        src = src.detach()
        try:
            typed = dest.view(src.dtype)
            target = typed.view(src.shape) if src.dim() else typed[0]
            target.copy_(src, non_blocking=non_blocking)
        except (RuntimeError, TypeError):
            # dtypes without copy kernels (bits*, sub-byte ints): move the raw bytes
            raw = as_writable_source(src)
            dest.copy_(torch.frombuffer(tensor_view(raw), dtype=torch.uint8))

    def stage_hashed(self, dest: torch.Tensor, src: torch.Tensor) -> str:
        """Copy ``src`` into the pool bytes ``dest`` like :meth:`stage` and return the
        xxh3-64 (hex) of those bytes, computed in the same pass over memory: each
        :data:`HASH_BLOCK` is hashed right after it is copied, while it is still in the
        cache, so the writer need not read the pool again to hash it. The copy is
        ``memmove`` on one thread with the GIL released (a CPU tensor in one piece);
        anything else (CUDA, strided, conjugated) is staged by :meth:`stage` and then
        hashed from the pool."""
        n = dest.numel()
        h = xxhash.xxh3_64()
        if n == 0:
            return hexdigest(h.intdigest())
        src = src.detach()
        arr = dest.numpy()
        if _plain_cpu(src, n):
            s, d = src.data_ptr(), dest.data_ptr()
            for a in range(0, n, HASH_BLOCK):
                b = min(n, a + HASH_BLOCK)
                ctypes.memmove(d + a, s + a, b - a)
                h.update(arr[a:b])
        else:
            self.stage(dest, src, non_blocking=False)
            return digest_of(dest)
        return hexdigest(h.intdigest())

    def digest(self, offset: int, length: int) -> str:
        """The xxh3-64 (hex) of the pool bytes ``[offset, offset + length)``."""
        assert self._bytes is not None
        return hexdigest(xxhash.xxh3_64_intdigest(self._bytes[offset : offset + length]))

    def _target(self, offset: int, length: int, src: torch.Tensor) -> torch.Tensor:
        """The pool bytes at ``offset`` as a tensor of ``src``'s dtype and shape (made
        once per place and kept: later saves of the same plan copy into it at once)."""
        key = (offset, src.dtype, src.shape)
        target = self._typed.get(key)
        if target is None:
            target = self.buffer[offset : offset + length].view(src.dtype).view(src.shape)
            self._typed[key] = target
        return target

    def stage_many(
        self,
        items: Sequence[Item],
        digests: dict[str, str] | None = None,
        *,
        non_blocking: bool = False,
    ) -> list[tuple[str, int, int]]:
        """Copy every ``(key, offset, length, tensor)`` of ``items`` into the pool bytes
        at ``offset``, like :meth:`stage`; with ``digests``, put each one's xxh3-64 (hex)
        under its key, exactly as :meth:`stage_hashed` and :func:`digest_of` give it.

        Tensors up to :data:`HASH_BLOCK` bytes and those on a GPU are copied in batches
        (one ``torch._foreach_copy_`` per :data:`BATCH_BYTES`, CPU ones hashed right
        after their batch); a larger CPU tensor is copied and hashed in one pass
        (:meth:`stage_hashed`). A batch that torch cannot copy as typed tensors (dtypes
        without copy kernels) is staged tensor by tensor.

        Returns:
            ``(key, offset, length)`` of the GPU tensors still to hash (with ``digests``)
            once their copies, queued on the current stream, are done.
        """
        later: list[tuple[str, int, int]] = []
        batch: list[Item] = []
        size = 0

        def flush() -> None:
            self._copy_batch(batch, non_blocking)
            if digests is not None:
                for key, offset, length, src in batch:
                    if src.is_cuda:
                        later.append((key, offset, length))
                    else:
                        digests[key] = self.digest(offset, length)
            batch.clear()

        for item in items:
            key, offset, length, src = item
            if digests is not None and length > HASH_BLOCK and not src.is_cuda:
                digests[key] = self.stage_hashed(self.buffer[offset : offset + length], src)
                continue
            if batch and (size + length > BATCH_BYTES or batch[-1][3].device != src.device):
                flush()
                size = 0
            batch.append(item)
            size += length
        if batch:
            flush()
        return later

    def _copy_batch(self, batch: Sequence[Item], non_blocking: bool) -> None:
        items = [it for it in batch if it[2] > 0]
        try:
            targets = [self._target(off, n, src) for _, off, n, src in items]
            with torch.no_grad():
                torch._foreach_copy_(targets, [src for *_, src in items], non_blocking=non_blocking)
        except (RuntimeError, TypeError):
            # dtypes without typed views or copy kernels (bits*, sub-byte ints)
            for _, off, n, src in items:
                self.stage(self.buffer[off : off + n], src, non_blocking=non_blocking)

    def views(self, items: Sequence[Item]) -> list[torch.Tensor]:
        """The pool bytes of every ``(key, offset, length, tensor)`` of ``items`` with a
        length, as tensors of that tensor's dtype and shape, for :meth:`copy_views`: a
        caller that stages the same places at every save makes them once."""
        return [self._target(off, n, src) for _, off, n, src in items if n > 0]

    def copy_views(
        self,
        views: list[torch.Tensor],
        sources: list[torch.Tensor],
        *,
        non_blocking: bool = False,
    ) -> None:
        """Copy ``sources[i]`` into ``views[i]`` (from :meth:`views`) in one torch call.

        Raises:
            RuntimeError, TypeError: torch has no copy kernel for a dtype (bits*,
                sub-byte ints): stage those with :meth:`stage_many`.
        """
        with torch.no_grad():
            torch._foreach_copy_(views, sources, non_blocking=non_blocking)

    def stage_slots(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy every tensor of ``sources`` (any device, any strides) into its slot of
        this pool's slot layout, with :meth:`stage_many` (small tensors in batches);
        returns once every copy is done."""
        layout = self.layout
        if not isinstance(layout, SlotLayout):
            raise TypeError("stage_slots() needs a pool built for a slot layout")
        self.stage_many([(s.key, s.offset, s.nbytes, sources[s.key]) for s in layout.slots])

    def tensors(self) -> dict[str, torch.Tensor]:
        """key -> the tensor in its slot (no copy; see :func:`slot_tensors`), in this
        process's mapping. Each tensor keeps the mapping alive while it lives."""
        if not isinstance(self.layout, SlotLayout) or self._mm is None:
            raise TypeError("tensors() needs an open pool built for a slot layout")
        return slot_tensors(self._mm, self.layout)

    def close(self) -> None:
        """Release the memory (the worker's mapping keeps it alive until it unmaps)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        self._typed = {}
        if self._bytes is not None:
            self._bytes.release()
            self._bytes = None
        self.buffer = None  # type: ignore[assignment]
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file)  # a checkpoint linking the bytes keeps them
            self.file = None


def _map_sent_pool(handle: Any, nbytes: int, layout: RankLayout | SlotLayout) -> StagingPool:
    """Load side of :meth:`StagingPool.__reduce__`: map the memory sent as ``handle`` (a
    ``DupFd``) again, without populating it or writing anything. The pool keeps no file
    descriptor (the mapping holds the memory) and cannot be sent on; its mapping goes
    when it and the tensors over it are garbage."""
    fd = handle.detach()
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    pool = StagingPool.__new__(StagingPool)
    pool._init_state(layout, nbytes)
    pool._attach(mm)
    return pool


class SparePool:
    """The pool of a finished save, kept for the next save that fits in it (a new pool
    costs page faults on every byte). At most one waits: giving another closes the
    older one. Thread-safe (the training thread takes, a finalize callback gives).

    Example::

        spare = SparePool()
        pool = stage_to_pool(sources, spare.take)   # reuses the spare when it fits
        ...                                          # the save is finalized:
        spare.give(pool)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: StagingPool | None = None

    @property
    def waiting(self) -> StagingPool | None:
        """The spare pool now, if any (it stays the spare)."""
        return self._pool

    def take(self, layout: SlotLayout) -> StagingPool | None:
        """The spare pool, once, if it is large enough for ``layout`` (it then holds
        ``layout``: :meth:`StagingPool.adopt`); else None (a smaller one is closed)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None or pool.adopt(layout):
            return pool
        pool.close()
        return None

    def give(self, pool: StagingPool) -> None:
        """``pool``'s save is over: it becomes the spare (an older spare is closed)."""
        with self._lock:
            old, self._pool = self._pool, pool
        if old is not None and old is not pool:
            old.close()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
