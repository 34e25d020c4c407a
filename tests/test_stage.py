"""StagingPool: byte cost against the staged bytes, exact staging (and hashing while
copying), memory released, and the page shield that keeps a pool's allocation off the
pages training recycles."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
from collections.abc import Iterator

import pytest
import torch
import xxhash

from helpers.skip_policy import ROOT_SKIP
from helpers_engine.engine_util import engine_plan, pool_mappings, same_bytes
from quicksave.checksum import hexdigest
from quicksave.format.dtypes import element_size
from quicksave.stage.page_shield import shield_free_pages
from quicksave.stage.pool import StagingPool, pool_cost


def _model_state(layers: int = 4, d: int = 512, vocab: int = 8000) -> dict[str, torch.Tensor]:
    """A transformer-shaped state with AdamW moments: big matrices, small vectors, scalars."""
    params: dict[str, torch.Tensor] = {"embed": torch.randn(vocab, d)}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            params[f"l{i}.attn.{n}"] = torch.randn(d, d)
        params[f"l{i}.mlp.up"] = torch.randn(4 * d, d)
        params[f"l{i}.mlp.down"] = torch.randn(d, 4 * d)
        for n in ("ln1", "ln2"):
            params[f"l{i}.{n}.weight"] = torch.ones(d)
            params[f"l{i}.{n}.bias"] = torch.zeros(d)
    sd = {f"model.{k}": v for k, v in params.items()}
    for k, v in params.items():
        sd[f"optim.{k}.exp_avg"] = torch.zeros_like(v)
        sd[f"optim.{k}.exp_avg_sq"] = torch.zeros_like(v)
        sd[f"optim.{k}.step"] = torch.tensor(10.0)
    return sd


def _staged_and_pool_bytes(sd: dict[str, torch.Tensor]) -> tuple[int, int]:
    plan = engine_plan(sd)
    staged = sum(t.numel() * element_size(t.dtype) for t in sd.values())
    return staged, pool_cost(plan.layout)


def test_pool_costs_at_most_105_percent_of_a_model_state() -> None:
    sd = _model_state()
    staged, pooled = _staged_and_pool_bytes(sd)
    ratio = pooled / staged
    print(f"model-shaped: {len(sd)} tensors, staged {staged / 2**20:.1f} MiB, ratio {ratio:.4f}")
    assert ratio <= 1.05
    # the pool really is that size once built
    pool = StagingPool(engine_plan(sd).layout, pin=False)
    try:
        assert pool.nbytes == pooled
    finally:
        pool.close()


def test_tiny_tensors_pay_the_alignment() -> None:
    """Each tensor starts 4 KiB aligned: a state of only tiny tensors cannot meet 1.05x
    (documented limit; real states are dominated by large tensors)."""
    sd = {f"s{i}": torch.tensor(float(i)) for i in range(100)}
    staged, pooled = _staged_and_pool_bytes(sd)
    print(f"100 scalars: staged {staged} B, pool {pooled} B")
    assert pooled >= 100 * 4096 > 1.05 * staged


@pytest.mark.parametrize(
    "src",
    [
        torch.randn(37, 5).t(),
        torch.randn(4, 6, 8)[:, ::2, 1::3],
        torch.tensor(-0.0),
        torch.tensor([float("nan"), 1.5]).bfloat16(),
        torch.arange(10, dtype=torch.int64)[::3],
        torch.randn(9).to(torch.float8_e5m2),
        torch.rand(13) > 0.3,
    ],
    ids=["transposed", "strided3d", "negzero0d", "bf16nan", "int64step", "f8", "bool"],
)
def test_stage_copies_exact_bytes(src: torch.Tensor) -> None:
    with _pool_view_for(src) as (pool, dest):
        pool.stage(dest, src)
        assert same_bytes(_as_staged(dest, src), src.contiguous())


@contextlib.contextmanager
def _pool_view_for(src: torch.Tensor) -> Iterator[tuple[StagingPool, torch.Tensor]]:
    """A pool planned for ``src`` (and a small neighbour) and the pool bytes of ``src``."""
    sd = {"x": src, "pad": torch.ones(3)}
    plan = engine_plan(sd)
    pool = StagingPool(plan.layout, pin=False)
    try:
        c = plan.tensors["x"].chunks[0]
        yield pool, pool.view(c.file, c.offset, c.length)
    finally:
        pool.close()


def _as_staged(dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dest.view(src.dtype).view(src.shape) if src.dim() else dest.view(src.dtype)[0]


@pytest.mark.parametrize(
    "src",
    [
        torch.randn(700_001),  # several hash blocks and a partial one
        torch.randn(37, 5).t(),  # strided: staged by copy_, then hashed from the pool
        torch.tensor(-0.0),
        torch.randn(6, 3, dtype=torch.complex64).conj(),  # conjugate bit: materialised
        torch.arange(10, dtype=torch.int64)[::3],
        torch.randn(9).to(torch.float8_e5m2),
        torch.rand(13) > 0.3,
    ],
    ids=["big", "transposed", "negzero0d", "conj", "int64step", "f8", "bool"],
)
def test_stage_hashed_copies_exact_bytes_and_returns_their_xxh3(src: torch.Tensor) -> None:
    with _pool_view_for(src) as (pool, dest):
        digest = pool.stage_hashed(dest, src)
        assert same_bytes(_as_staged(dest, src), src.resolve_conj().contiguous())
        assert digest == hexdigest(xxhash.xxh3_64(bytes(dest.numpy())).intdigest())


# ----------------------------------------------------------------- page shield
def _frames(buf: mmap.mmap) -> set[int]:
    """Physical frame numbers of the pages of ``buf`` (``/proc/self/pagemap``)."""
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    n = len(buf) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // mmap.PAGESIZE * 8)
        entries = struct.unpack(f"{n}Q", f.read(8 * n))
    return {e & ((1 << 55) - 1) for e in entries if e >> 63}  # present pages only


def _pool_frames(nbytes: int, shield: bool) -> tuple[set[int], set[int]]:
    """Frames of a region freed just before a pool-sized memfd is allocated, and of the
    pool (allocated behind a shield or not)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    recycled = mmap.mmap(-1, nbytes, flags=flags)  # what a training step frees
    freed = _frames(recycled)
    recycled.close()
    fd = os.memfd_create("test-pool")
    try:
        os.ftruncate(fd, nbytes)
        if shield:
            with shield_free_pages(nbytes):
                os.posix_fallocate(fd, 0, nbytes)
                pool = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        else:
            os.posix_fallocate(fd, 0, nbytes)
            pool = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        taken = _frames(pool)
        pool.close()
    finally:
        os.close(fd)
    return freed, taken


def _frames_visible() -> bool:
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe[0] = 1
    try:
        return _frames(probe) != {0}
    finally:
        probe.close()


@pytest.mark.skipif(
    not os.path.exists("/proc/self/pagemap") or not _frames_visible(),
    reason=f"{ROOT_SKIP}: physical frame numbers are visible only to root (CAP_SYS_ADMIN)",
)
def test_a_pool_built_behind_the_shield_leaves_the_recycled_pages_to_training() -> None:
    """Counts pages, times nothing: a populated pool built right after 256 MiB were freed
    takes most of those very pages (so the next training step gets cold ones); behind the
    shield it takes almost none of them. The shield stops where faulting pages in gets
    3x slower than on recycled ones, which a busy machine can mimic for a moment (the
    other processes' frees and faults interleave): the best of three tries counts."""
    nbytes = 256 << 20
    freed, taken = _pool_frames(nbytes, shield=False)
    plain = len(freed & taken) / len(freed)
    shielded = 1.0
    for _ in range(3):
        freed, taken = _pool_frames(nbytes, shield=True)
        shielded = min(shielded, len(freed & taken) / len(freed))
        if shielded < 0.1:
            break
    print(f"pool pages among the 256 MiB freed just before: {plain:.0%}, {shielded:.0%} shielded")
    assert plain > 0.5  # the problem exists here: without the shield the test would fail
    assert shielded < 0.1


def test_the_shield_holds_nothing_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    import quicksave.stage.page_shield as stage

    monkeypatch.setattr(stage, "_available_bytes", lambda: (1 << 30) + (200 << 20))
    with shield_free_pages(256 << 20) as held:
        assert held == 0


def test_pool_memory_is_released_on_close() -> None:
    sd = {"w": torch.ones(1 << 18)}
    layout = engine_plan(sd).layout
    before = pool_mappings()
    pools = [StagingPool(layout, pin=False) for _ in range(3)]
    assert pool_mappings() == before + 3
    for p in pools:
        p.close()
    assert pool_mappings() == before


def test_an_unpopulated_pool_keeps_its_headers_when_touched() -> None:
    sd = _model_state(layers=1, d=64, vocab=128)
    layout = engine_plan(sd).layout
    pool = StagingPool(layout, pin=False, populate=False)
    try:
        for f, pf in zip(layout.files, pool.pool.files, strict=True):
            assert bytes(pool.buffer[pf.base : pf.base + len(f.header)].numpy()) == f.header
        pool.touch()
        for f, pf in zip(layout.files, pool.pool.files, strict=True):
            assert bytes(pool.buffer[pf.base : pf.base + len(f.header)].numpy()) == f.header
            tail = pool.buffer[pf.base + len(f.header) : pf.base + pf.size]
            assert int(tail.count_nonzero()) == 0
    finally:
        pool.close()
