"""Incremental saves of a tensor updated densely (``saving/dense_blocks.py``): once a
save found every block of a trained tensor changed, its blocks are written uncompared
(no hash in ``save()``) while its counter keeps moving, and compared again one save in
``rest``; a tensor updated sparsely keeps being compared, its unchanged blocks referred
to; a dense tensor that stops changing is referred to again after its next comparison;
every checkpoint loads bit-exactly."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import quicksave
from quicksave.saving.dense_blocks import DenseTensors
from quicksave.saving.staging import DeferredAt
from test_incremental_save import _bases, _manifest
from test_incremental_watch import _loads

BLOCK = 64 << 10  # "dense" and "sparse" are 8 blocks of 64 KiB each
ROWS, COLS = 512, 256


def _saver(**kw: Any) -> quicksave.AsyncSaver:
    incremental = quicksave.IncrementalConfig(
        enabled=True, block_bytes=BLOCK, full_every=100, watch_writes=False
    )
    return quicksave.AsyncSaver(
        quicksave.EngineConfig(mode="thread", fsync=False, incremental=incremental, **kw)
    )


def test_dense_blocks_go_uncompared_sparse_ones_stay_compared(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {"dense": torch.randn(ROWS, COLS), "sparse": torch.randn(ROWS, COLS)}
    saver = _saver()
    hashed = {}
    stop_at = 12  # from this step on "dense" is no longer written
    try:
        for step in range(1, 16):
            if step < stop_at:
                state["dense"].add_(0.5)  # every block changes
            state["sparse"][step % ROWS].add_(1.0)  # one row: one block of 8
            handle = saver.save(state, tmp_path / f"step-{step}", step=step)
            hashed[step] = saver._incr.cost[1]  # (on the training thread, in save())
            handle.wait()  # committed: the next save refers to this one
            _loads(tmp_path / f"step-{step}", state)
    finally:
        saver.close()
    block = ROWS * COLS * 4 // 8
    sparse_only = 8 * block  # "sparse" compared whole: 8 blocks hashed
    # step 1 full (hashes both as checksums), step 2 compares both: "dense" all changed
    assert hashed[2] == 16 * block
    # from step 3 on, "dense" is written uncompared: only "sparse" is hashed ...
    assert all(hashed[s] == sparse_only for s in (3, 4, 5, 6, 7, 8, 9)), hashed
    # ... but for one save in 8, which compares it again (still dense)
    assert hashed[10] == 16 * block, hashed
    assert hashed[11] == sparse_only
    # "sparse": 7 of its 8 blocks referred to at every compared save
    for step in (3, 9, 11):
        refs = _bases(_manifest(tmp_path, step), "sparse")
        assert sum(1 for b in refs if b is not None) == 7, (step, refs)
        dense = _bases(_manifest(tmp_path, step), "dense")
        assert dense == [None] * 8, (step, dense)  # written
    # "dense" stopped changing at step 12: its counter stands, so step 12 compares it and
    # refers to every block of it (the checkpoint of step 11 holds the same bytes)
    assert hashed[12] == 16 * block, hashed
    assert _bases(_manifest(tmp_path, 12), "dense") == [11] * 8


def test_a_deferred_dense_tensor_is_copied_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlap staging with the tensors deferred by address, as the manager defers an
    optimizer's tensors (a tensor's first block; the others follow it): once "dense"
    counts as dense, its blocks, taken as changed, are copied with its first block by
    the background copy, as a full save copies them, never inside ``save()`` on the
    training thread."""
    torch.manual_seed(0)
    state = {"dense": torch.randn(ROWS, COLS), "sparse": torch.randn(ROWS, COLS)}
    saver = _saver(staging="overlap")
    copied: dict[int, dict[str, list[str]]] = {}
    stage = saver._copier.stage

    def spy(pool: Any, plan: Any, tensors: Any, names: list[str], *a: Any, **k: Any) -> int:
        where = threading.current_thread().name
        copied.setdefault(step, {}).setdefault(where, []).extend(names)
        return stage(pool, plan, tensors, names, *a, **k)

    monkeypatch.setattr(saver._copier, "stage", spy)
    deferred = DeferredAt(frozenset(t.data_ptr() for t in state.values()))
    try:
        for step in range(1, 6):
            state["dense"].add_(0.5)
            state["sparse"][step % ROWS].add_(1.0)
            path = tmp_path / f"step-{step}"
            handle = saver.save(state, path, step=step, deferred=deferred)
            saver.maybe_wait_for_staging()
            handle.wait()
            _loads(path, state)
    finally:
        saver.close()
    for step in (3, 4, 5):  # (dense from step 3: written uncompared)
        assert _bases(_manifest(tmp_path, step), "dense") == [None] * 8
        main = copied[step].get(threading.main_thread().name, [])
        assert not [n for n in main if n.startswith("dense")], (step, main)
        assert sum(n.startswith("dense") for n in copied[step]["quicksave-stage"]) == 8


def test_dense_tensors_rule() -> None:
    d = DenseTensors(rest=3, share=0.9)
    d.begin()
    assert not d.assumed("w", "w/0", (1, 1))  # never seen: compared
    d.compared({"w/0": "w", "w/1": "w"}, referred={})  # both changed: dense
    d.compared({"e/0": "e", "e/1": "e"}, referred={"e/1": 4})  # half: not dense
    d.begin()
    assert d.assumed("w", "w/0", (1, 2))  # counter moved, same memory
    assert not d.assumed("w", "w/1", (9, 1))  # first sight of this block: compared
    assert not d.assumed("e", "e/0", (5, 1)) and not d.assumed("e", "e/0", (5, 2))
    d.begin()
    assert not d.assumed("w", "w/0", (1, 2))  # counter stood: compared
    assert not d.assumed("w", "w/0", (2, 3))  # other memory: compared
    d.begin()  # one save in 3 compares again
    assert not d.assumed("w", "w/0", (2, 4))
    d.forget()
    assert not d.assumed("w", "w/0", (2, 5))
