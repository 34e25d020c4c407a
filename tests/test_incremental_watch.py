"""Incremental saves with the kernel's write tracking (``IncrementalConfig.watch_writes``,
``saving/clean_blocks.py``): an untouched frozen block is referred to without being
hashed; a write the version counters miss (``.data``, numpy, a swapped storage) is in
the next checkpoint, bit-exact, with only the blocks written hashed; deferred blocks
(overlap) too; where the kernel offers nothing (or the option is off) every block is
hashed as before."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import quicksave
from helpers.state import assert_bit_equal
from quicksave.layout.plan import chunk_key
from quicksave.loading.verify import verify_checkpoint
from quicksave.saving.staging import DeferredAt
from quicksave.saving.write_watch import WriteWatch
from test_incremental_save import _bases, _manifest

ROWS, COLS = 512, 256  # 512 KiB of float32: 8 row blocks of 64 KiB
BLOCK = 64 << 10
FROZEN = ROWS * COLS * 4
HEAD = 64 << 10

needs_kernel = pytest.mark.skipif(
    not WriteWatch().available(), reason="the kernel offers no async write-protect (< 6.7)"
)


def _saver(watch: bool = True, **kw: Any) -> quicksave.AsyncSaver:
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=BLOCK, watch_writes=watch)
    return quicksave.AsyncSaver(
        quicksave.EngineConfig(mode="thread", fsync=False, incremental=incremental, **kw)
    )


def _frozen() -> torch.Tensor:
    """A frozen weight in a mapping of its own: its blocks start on page boundaries and
    share no page with other allocations (whose writes would count for a shared page:
    correct, but the costs asserted here would then depend on the allocator)."""
    m = mmap.mmap(-1, FROZEN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.float32).view(ROWS, COLS)  # (keeps m alive)
    t.copy_(torch.randn(ROWS, COLS))
    return t


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # "head": trained at every step, one chunk (its counter moves: never watched nor hashed)
    return {"frozen": _frozen(), "head": torch.zeros(16 << 10)}


def _loads(path: Path, state: dict[str, torch.Tensor]) -> None:
    assert verify_checkpoint(path).ok, verify_checkpoint(path).problems
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    quicksave.load(out, path)
    for k, v in state.items():
        assert_bit_equal(out[k], v, f"{path.name}: {k}")


def _run(
    folder: Path,
    saver: quicksave.AsyncSaver,
    state: dict[str, torch.Tensor],
    steps: range,
    edit: Any = None,
    **save_kw: Any,
) -> dict[int, tuple[int, int]]:
    """Save ``state`` at each step (``edit(step)`` first); per step, the bytes hashed
    on the training thread and the bytes whose hash the kernel spared."""
    costs = {}
    for step in steps:
        state["head"].add_(1.0)
        if edit is not None:
            edit(step)
        handle = saver.save(state, folder / f"step-{step}", step=step, **save_kw)
        assert handle is not None
        saver.maybe_wait_for_staging()
        handle.wait()
        clean = saver._incr._clean  # (white box: what the kernel spared)
        costs[step] = (saver._incr.cost[1], 0 if clean is None else clean.skipped)
        _loads(folder / f"step-{step}", state)
    return costs


@needs_kernel
def test_an_untouched_frozen_base_is_referred_to_without_hashing(tmp_path: Path) -> None:
    state = _state()
    with _saver() as saver:
        costs = _run(tmp_path, saver, state, range(1, 6))
    # 1: nothing known; 2: steady since 1, protected then hashed; 3 on: the kernel's word
    assert costs[1] == (FROZEN + HEAD, 0)
    assert costs[2] == (FROZEN, 0)
    assert all(costs[s] == (0, FROZEN) for s in (3, 4, 5)), costs
    assert _bases(_manifest(tmp_path, 5), "frozen") == [1] * 8
    assert _bases(_manifest(tmp_path, 5), "head") == [None]


@needs_kernel
def test_after_prepare_a_frozen_base_is_watched_from_the_first_save(tmp_path: Path) -> None:
    """``prepare()`` sees the counters: a block that nothing wrote between it and the
    first save is protected at the first save, whose digest of it holds, so the second
    save already refers to it unhashed (not protected then hashed again); the trained
    head, whose counter moved, is never watched. A write the counters miss between
    ``prepare()`` and the first save is in the first save (hashed after the
    protection), one after it in the second."""
    state = _state()
    frozen = state["frozen"]

    def edit(step: int) -> None:
        if step == 1:
            frozen.data[3] += 1.0  # before the first save: in it (block 0)
        if step == 3:
            frozen.numpy()[100, 0] = 7.0  # after it: in step 3's checkpoint (block 1)

    with _saver() as saver:
        saver.prepare(state, background=False)
        costs = _run(tmp_path, saver, state, range(1, 5), edit)
    block = FROZEN // 8
    assert costs[1] == (FROZEN + HEAD, 0)
    assert costs[2] == (0, FROZEN)  # (without prepare(): hashed again, as above)
    assert costs[3] == (block, FROZEN - block)
    assert _bases(_manifest(tmp_path, 2), "frozen") == [1] * 8
    assert _bases(_manifest(tmp_path, 3), "frozen") == [1, None, 1, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1, 3, 1, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 4), "head") == [None]


@needs_kernel
def test_writes_the_counters_miss_are_in_the_next_checkpoint(tmp_path: Path) -> None:
    state = _state()
    frozen = state["frozen"]
    version = frozen._version

    def edit(step: int) -> None:
        if step == 4:
            frozen.data[70] += 1.0  # block 1 (rows 64..127)
        if step == 5:
            frozen.numpy()[300, 5] = 42.0  # block 4 (rows 256..319)
        if step == 6:
            state["frozen"].data = torch.randn(ROWS, COLS)  # another storage, counter still

    with _saver() as saver:
        costs = _run(tmp_path, saver, state, range(1, 8), edit)
    assert frozen._version == version  # torch saw none of them
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1, None, 1, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 5), "frozen") == [1, 4, 1, 1, None, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 6), "frozen") == [None] * 8
    assert _bases(_manifest(tmp_path, 7), "frozen") == [6] * 8
    block = FROZEN // 8
    assert costs[4] == (block, FROZEN - block)  # only the block written is hashed
    assert costs[5] == (block, FROZEN - block)
    assert costs[6] == (FROZEN, 0)  # new memory: hashed (and watched from now on)


@needs_kernel
def test_a_block_written_at_every_save_is_always_in_the_checkpoint(tmp_path: Path) -> None:
    """Written behind its counter at every step: found written, then unwatched for a
    rest, then watched again — every checkpoint holds its bytes of that step."""
    state = _state()

    def edit(step: int) -> None:
        state["frozen"].data[3] += 1.0  # block 0, at every step

    with _saver() as saver:
        _run(tmp_path, saver, state, range(1, 9), edit)
    for step in range(2, 9):
        assert _bases(_manifest(tmp_path, step), "frozen") == [None] + [1] * 7


@needs_kernel
def test_deferred_blocks_are_watched_too(tmp_path: Path) -> None:
    """Overlap staging: a deferred frozen block is protected on the training thread,
    hashed by the background copy, and referred to unhashed from then on."""
    state = _state()
    frozen = state["frozen"]

    def edit(step: int) -> None:
        if step == 5:
            frozen.detach().numpy()[130, 0] = -1.0  # block 2

    with _saver(staging="overlap") as saver:
        costs = _run(tmp_path, saver, state, range(1, 7), edit, deferred=lambda f, t: True)
    assert costs[4][1] == FROZEN
    assert costs[6][1] == FROZEN  # block 2 recorded again from the background's hash
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1] * 8
    assert _bases(_manifest(tmp_path, 5), "frozen") == [1, 1, None, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 6), "frozen") == [1, 1, 5, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("how", ["unavailable", "off"])
def test_without_the_kernel_every_block_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "unavailable":
        monkeypatch.setattr(WriteWatch, "available", lambda self: False)
    state = _state()

    def edit(step: int) -> None:
        if step == 3:
            state["frozen"].data[70] += 1.0

    with _saver(watch=how != "off") as saver:
        costs = _run(tmp_path, saver, state, range(1, 5), edit)
    assert costs[1] == (FROZEN + HEAD, 0)
    assert all(costs[s] == (FROZEN, 0) for s in range(2, 5)), costs
    assert _bases(_manifest(tmp_path, 3), "frozen") == [1, None, 1, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1, 3, 1, 1, 1, 1, 1, 1]


@needs_kernel
def test_shared_memory_is_never_watched(tmp_path: Path) -> None:
    """Another process may write shared memory without this one's page tables: such a
    block is hashed at every save."""
    state = _state()
    state["frozen"] = state["frozen"].clone().share_memory_()
    with _saver() as saver:
        costs = _run(tmp_path, saver, state, range(1, 5))
    assert all(costs[s] == (FROZEN, 0) for s in range(2, 5)), costs
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1] * 8


@needs_kernel
def test_with_trusted_counters_the_kernel_has_the_last_word(tmp_path: Path) -> None:
    """``trust_counters`` beside the kernel's tracking: a ``.data`` write (its counter
    still) is seen by the kernel, so the block is hashed and written — no failed save."""
    state = _state()
    incremental = quicksave.IncrementalConfig(
        enabled=True, block_bytes=BLOCK, trust_counters=True, watch_writes=True
    )
    config = quicksave.EngineConfig(mode="thread", fsync=False, incremental=incremental)

    def edit(step: int) -> None:
        if step == 4:
            state["frozen"].data[130] += 1.0  # block 2

    with quicksave.AsyncSaver(config) as saver:
        _run(tmp_path, saver, state, range(1, 6), edit)
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1, 1, None, 1, 1, 1, 1, 1]
    assert _bases(_manifest(tmp_path, 5), "frozen") == [1, 1, 4, 1, 1, 1, 1, 1]


@needs_kernel
def test_a_forked_child_writing_its_copy_changes_nothing_here(tmp_path: Path) -> None:
    """A fork (a DataLoader worker) while blocks are watched: the child's writes go to
    its own pages and it exits cleanly; the parent's writes are still seen."""
    state = _state()

    def edit(step: int) -> None:
        if step == 4:
            pid = os.fork()
            if pid == 0:
                try:
                    state["frozen"].numpy()[:] = 7.0
                finally:
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            state["frozen"].data[450] += 1.0  # block 7, in the parent

    with _saver() as saver:
        costs = _run(tmp_path, saver, state, range(1, 6), edit)
    assert costs[4] == (FROZEN // 8, FROZEN - FROZEN // 8)
    assert _bases(_manifest(tmp_path, 4), "frozen") == [1] * 7 + [None]


@needs_kernel
def test_a_periodic_full_save_copies_a_deferred_frozen_tensor_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save that ends a chain (``full_every``) writes every block again: the blocks
    of a tensor the training thread defers (the manager's ``DeferredAt``: its first
    block's address) are copied by the background copy, as at the first save — not in
    ``save()``, though the kernel proved them clean — and hashed from their copies."""
    state = _state()
    incremental = quicksave.IncrementalConfig(
        enabled=True, block_bytes=BLOCK, watch_writes=True, full_every=3
    )
    config = quicksave.EngineConfig(
        mode="thread", fsync=False, staging="overlap", incremental=incremental
    )
    deferred = DeferredAt(frozenset({state["frozen"].data_ptr(), state["head"].data_ptr()}))
    in_save: dict[int, list[str]] = {}
    with quicksave.AsyncSaver(config) as saver:
        stage = saver._incr.stage

        def spy(job: Any, *args: Any) -> Any:
            job, now, later = stage(job, *args)
            in_save[job.step] = [n for n in now if n.startswith("frozen")]
            return job, now, later

        monkeypatch.setattr(saver._incr, "stage", spy)
        _run(tmp_path, saver, state, range(1, 5), deferred=deferred)
    assert _bases(_manifest(tmp_path, 3), "frozen") == [1] * 8  # clean, kernel-proven
    assert _bases(_manifest(tmp_path, 4), "frozen") == [None] * 8  # the chain's end
    assert in_save[4] == [] and in_save[1] == [], in_save


def test_a_result_leaves_out_the_digests_it_refers_to(tmp_path: Path) -> None:
    """The writer sends back the digests of what it wrote, not of the chunks referred
    to (the base's, which the saver holds; a lora save's 384 of them made the result
    two writes of the pipe, between which the trainer waited): the base the saver
    keeps has every tracked digest anyway, equal to the manifest's, and the saves
    after keep referring."""
    state = _state()
    results = []
    with _saver() as saver:
        settled = saver._incr.settled  # (white box: what the worker sent back)

        def spy(result: Any) -> None:
            results.append(result)
            settled(result)

        saver._incr.settled = spy  # type: ignore[method-assign]
        _run(tmp_path, saver, state, range(1, 5))
        base = saver._incr._base
    assert base is not None and base.step == 4
    frozen = {f"frozen@{r},0" for r in range(0, ROWS, ROWS // 8)}
    assert frozen <= base.digests.keys()
    chunks = {
        chunk_key(fqn, c["offsets"], c["sizes"], t["shape"]): c
        for fqn, t in _manifest(tmp_path, 4)["tensors"].items()
        for c in t["chunks"]
    }
    assert {k: chunks[k]["xxh3_64"] for k in base.digests} == base.digests
    for step in (3, 4):
        assert _bases(_manifest(tmp_path, step), "frozen") == [1] * 8
    assert frozen <= results[0].digests.keys()  # (the first save wrote them)
    assert all(not (frozen & r.digests.keys()) for r in results[2:])
