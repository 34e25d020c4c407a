"""StagingPool built for tensor slots (the NVRx-compatible writer's pool): the slot layout,
tensors over the pool's bytes whose storages are exactly their own bytes, staging of
sources in any layout, reuse by a later save, the allocation error, and the pool pickled
as one file descriptor into a real (spawned) child process that sees the trainer's bytes
and leaks nothing over many saves."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from helpers_engine.engine_util import open_fds, pool_mappings
from quicksave.compat.nvrx.process_state import NvrxProcessState
from quicksave.compat.nvrx.staging import stage_to_pool, tensors_of
from quicksave.errors import CheckpointError
from quicksave.stage import pool as pool_module
from quicksave.stage.pool import StagingPool
from quicksave.stage.tensor_slots import SLOT_ALIGN, slot_layout
from quicksave.worker import fnpickle

CHILD_TIMEOUT_S = 120


def _sources(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    cplx = torch.randn(5, dtype=torch.complex64, generator=g)
    return {
        "big": torch.randn(600, 1024, generator=g),  # over the batch size: its own copy
        "transposed": base.t(),  # non-contiguous
        "every_other": torch.arange(40, dtype=torch.int64)[::2] + seed,
        "expanded": torch.tensor([1.5 + seed, 2.5]).expand(3, 2),  # stride 0
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "conj": cplx.conj(),  # a lazy conjugate: its values, not its raw bytes
        "neg": torch._neg_view(base),  # a lazy negation
        "scalar": torch.tensor(7 + seed, dtype=torch.int32),
        "empty": torch.empty(0, 3),
        "empty_middle": torch.empty(4, 0, 2, dtype=torch.float16),
        "bool": torch.rand(11, generator=g) > 0.5,
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(13, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.arange(3, dtype=torch.uint8),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(_bytes(a).numpy()) == bytes(_bytes(b).numpy())
    )


def test_the_slot_layout_places_every_tensor_aligned_in_order() -> None:
    src = _sources()
    layout = slot_layout(src)
    assert [s.key for s in layout.slots] == list(src)
    end = 0
    for s, t in zip(layout.slots, src.values(), strict=True):
        assert s.offset % SLOT_ALIGN == 0 and s.offset >= end
        assert (s.dtype, s.shape, s.nbytes) == (t.dtype, tuple(t.shape), t.numel() * t.itemsize)
        end = s.offset + s.nbytes
    assert layout.nbytes % os.sysconf("SC_PAGE_SIZE") == 0 and layout.nbytes >= end
    assert slot_layout(src) == layout  # pure
    assert slot_layout({}).nbytes == os.sysconf("SC_PAGE_SIZE")  # never an empty pool


def test_tensors_are_views_of_the_pool_each_with_its_own_storage() -> None:
    src = _sources()
    pool = StagingPool(slot_layout(src), pin=False)
    try:
        pool.stage_slots(src)
        out = pool.tensors()
        assert list(out) == list(src)
        base, end = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.nbytes
        for key, t in out.items():
            assert _same(t, src[key]), key
            assert t.is_contiguous()
            storage = t.untyped_storage()
            assert storage.nbytes() == t.numel() * t.itemsize  # torch.save writes just it
            if t.numel():
                assert base <= storage.data_ptr() < end  # no copy
        # the same bytes: a write through the pool shows in the tensor
        slot = next(s for s in pool.layout.slots if s.key == "u8")
        pool.buffer[slot.offset] = 200
        assert int(out["u8"][0]) == 200
        assert tensors_of(pool).keys() == out.keys()
        plain = {"a": torch.ones(2)}
        assert tensors_of(plain) is plain
    finally:
        pool.close()


def test_the_tensors_outlive_a_closed_pool() -> None:
    src = {"w": torch.arange(1000, dtype=torch.float32)}
    pool = StagingPool(slot_layout(src), pin=False)
    pool.stage_slots(src)
    out = pool.tensors()
    pool.close()  # the mapping stays while a tensor over it lives
    assert torch.equal(out["w"], src["w"])


def test_a_free_pool_large_enough_is_reused_and_holds_the_new_values() -> None:
    state = NvrxProcessState()
    first = stage_to_pool(_sources(0), state.spare_pool.take)
    state.spare_pool.give(first)
    fd = first.fd
    # the same shapes, new values: the same memory again
    second = stage_to_pool(_sources(1), state.spare_pool.take)
    assert second is first and second.fd == fd
    for key, t in second.tensors().items():
        assert _same(t, _sources(1)[key]), key
    state.spare_pool.give(second)
    # fewer tensors: still fits
    small = {"x": torch.arange(10)}
    third = stage_to_pool(small, state.spare_pool.take)
    assert third is first and torch.equal(third.tensors()["x"], small["x"])
    state.spare_pool.give(third)
    # larger: the free pool is closed, a new one is built
    big = {"x": torch.zeros(first.nbytes // 4 + 1, dtype=torch.float32)}
    fourth = stage_to_pool(big, state.spare_pool.take)
    assert fourth is not first and first.fd == -1
    assert torch.equal(fourth.tensors()["x"], big["x"])
    # a pool released over a free one closes the older one
    state.spare_pool.give(fourth)
    other = stage_to_pool(small, lambda layout: None)
    state.spare_pool.give(other)
    assert fourth.fd == -1 and state.spare_pool.take(slot_layout(small)) is other
    other.close()


def test_file_image_and_slot_pools_never_adopt_each_others_layouts() -> None:
    from helpers_engine.engine_util import engine_plan

    sd = {"w": torch.ones(100)}
    files = engine_plan(sd).layout
    images = StagingPool(files, pin=False)
    slots = StagingPool(slot_layout(sd), pin=False)
    try:
        assert not images.adopt(slot_layout(sd))
        assert not slots.adopt(files)
        with pytest.raises(TypeError):
            images.tensors()
        with pytest.raises(TypeError):
            images.stage_slots(sd)
    finally:
        images.close()
        slots.close()


def test_an_allocation_failure_names_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(pool_module.os, "posix_fallocate", no_memory)
    before = open_fds()
    src = {"w": torch.zeros(3 << 18, dtype=torch.float32)}  # 3 MiB
    with pytest.raises(CheckpointError, match=r"cannot allocate a 3\.0 MiB staging pool"):
        stage_to_pool(src, lambda layout: None)
    assert open_fds() == before  # the memfd was closed


def test_a_pool_mapped_from_another_process_cannot_be_sent_on() -> None:
    src = {"w": torch.arange(16, dtype=torch.int16)}
    pool = StagingPool(slot_layout(src), pin=False)
    try:
        pool.stage_slots(src)
        again = ForkingPickler.loads(ForkingPickler.dumps(pool))  # mapped a second time
        assert again.fd == -1 and torch.equal(again.tensors()["w"], src["w"])
        with pytest.raises(CheckpointError, match="cannot be sent on"):
            ForkingPickler.dumps(again)
        del again
    finally:
        pool.close()


# ------------------------------------------------------------ a real worker process
def _read_pool(payload: bytes) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Load a pickled pool (alone, or as a call's argument as ``pickle_call`` sends it),
    return its tensors' bytes and write a marker byte into one slot (the trainer checks
    it). Everything loaded is garbage on return."""
    loaded = ForkingPickler.loads(payload)
    if isinstance(loaded, tuple):  # (fn, args, kwargs)
        fn, args, kwargs = loaded
        tensors = fn(*args, **kwargs)
    else:
        tensors = tensors_of(loaded)
    seen = {k: (t.dtype, tuple(t.shape), bytes(_bytes(t).numpy())) for k, t in tensors.items()}
    tensors["u8"][0] = 0x5A
    return seen


def _worker(conn: Connection) -> None:
    """The child: read each pool sent, then report its open fds and pool mappings."""
    while True:
        payload = conn.recv_bytes()
        if not payload:
            return
        seen = _read_pool(payload)
        gc.collect()
        conn.send((seen, open_fds(), pool_mappings()))


def _wait_until(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("pickler", ["forking", "call"])
def test_a_pickled_pool_reaches_a_spawned_process_as_one_handle_and_leaks_nothing(
    pickler: str,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child,), daemon=True)
    proc.start()
    child.close()
    state = NvrxProcessState()
    child_fds: list[int] = []
    parent_fds: list[int] = []
    try:
        for save in range(12):
            src = _sources(save)
            if save % 4 == 3:
                src["extra"] = torch.full((70_000,), float(save))  # larger: a new pool
            pool = stage_to_pool(src, state.spare_pool.take)
            if pickler == "forking":
                payload = ForkingPickler.dumps(pool)
            else:  # as pickle_call sends a save function's arguments
                payload = fnpickle.dumps((tensors_of, (pool,), {}))
            assert len(payload) < 4096  # a handle, not the bytes
            parent.send_bytes(payload)
            assert parent.poll(CHILD_TIMEOUT_S), "the child did not answer"
            seen, fds, mappings = parent.recv()
            assert mappings == 0  # the child unmapped the pool with its last tensor
            for key, t in src.items():
                dtype, shape, raw = seen[key]
                assert (dtype, shape) == (t.dtype, tuple(t.shape)), key
                assert raw == bytes(_bytes(t).numpy()), key
            assert int(pool.tensors()["u8"][0]) == 0x5A  # the child wrote the trainer's pages
            state.spare_pool.give(pool)  # finalize: the next save may reuse it
            child_fds.append(fds)
            parent_fds.append(open_fds())
        parent.send_bytes(b"")
        proc.join(CHILD_TIMEOUT_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        parent.close()
    assert len(set(child_fds[1:])) == 1, child_fds  # nothing accumulates in the child
    # the trainer's resource sharer closes its copy of each fd once the child has it
    settled = min(parent_fds[1:])
    assert _wait_until(lambda: open_fds() <= settled), (open_fds(), parent_fds)
    held = state.spare_pool.take(slot_layout({}))
    assert held is not None
    held.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)
