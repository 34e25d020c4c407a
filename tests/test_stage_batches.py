"""Small tensors staged in batches (one torch call per batch, not a Python call per
tensor) give the same pool bytes and the same per-chunk xxh3-64 digests as staging each
tensor alone; and a pool is kept, not rebuilt, for a plan with the same file images
(issue 20, point 9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import quicksave
import quicksave.saving.in_flight as in_flight
from helpers_engine.engine_util import engine_plan
from quicksave.checksum import hexdigest
from quicksave.loading.verify import verify_checkpoint
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.stage.pool import BATCH_BYTES, HASH_BLOCK, StagingPool, digest_of


def _mixed_state() -> dict[str, torch.Tensor]:
    """Many small tensors of every kind the batched path must copy exactly, and a few
    larger ones that take the copy-and-hash pass."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i in range(300):
        sd[f"layer{i:03d}.bias"] = torch.randn(640, generator=g)
        sd[f"layer{i:03d}.step"] = torch.tensor(float(i))
    sd["bf16"] = torch.randn(33, generator=g).bfloat16()
    sd["int64step"] = torch.arange(30, dtype=torch.int64)[::3]
    sd["transposed"] = torch.randn(37, 5, generator=g).t()
    sd["conj"] = torch.randn(6, 3, dtype=torch.complex64, generator=g).conj()
    sd["f8"] = torch.randn(9, generator=g).to(torch.float8_e5m2)
    sd["bool"] = torch.rand(13, generator=g) > 0.3
    sd["negzero"] = torch.tensor(-0.0)
    sd["empty"] = torch.empty(0, 4)
    sd["bits8"] = torch.arange(16, dtype=torch.uint8).view(torch.bits8)  # no copy kernel
    sd["big"] = torch.randn(700_001, generator=g)  # several hash blocks
    sd["big_strided"] = torch.randn(400, 700, generator=g).t()
    return sd


def _plan(sd: dict[str, torch.Tensor]) -> Any:
    return engine_plan(sd)


def _items(plan: Any, pool: StagingPool, sd: dict[str, torch.Tensor]) -> list:
    return [
        (name, pool.pool.base_of(file) + offset, length, sd[name])
        for name, (file, offset, length) in plan.places.items()
    ]


def test_batched_staging_gives_the_bytes_and_digests_of_staging_one_by_one() -> None:
    sd = _mixed_state()
    plan = _plan(sd)
    batched, single = StagingPool(plan.layout, pin=False), StagingPool(plan.layout, pin=False)
    try:
        digests: dict[str, str] = {}
        assert batched.stage_many(_items(plan, batched, sd), digests) == []  # no GPU
        expected = {}
        for name, (file, offset, length) in plan.places.items():
            expected[name] = single.stage_hashed(single.view(file, offset, length), sd[name])
        assert torch.equal(batched.buffer, single.buffer)  # every byte, headers included
        assert digests == expected
        for name, (file, offset, length) in plan.places.items():
            view = single.view(file, offset, length)
            assert digests[name] == digest_of(view)
            assert digests[name] == hexdigest(xxhash.xxh3_64(bytes(view.numpy())).intdigest())
    finally:
        batched.close()
        single.close()


def test_small_tensors_take_one_torch_call_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {f"b{i:04d}": torch.full((640,), float(i)) for i in range(1000)}  # 2.5 KiB each
    plan = _plan(sd)
    pool = StagingPool(plan.layout, pin=False)
    calls = {"foreach": 0, "stage": 0, "stage_hashed": 0}
    real_foreach = torch._foreach_copy_

    def foreach(*args: Any, **kwargs: Any) -> Any:
        calls["foreach"] += 1
        return real_foreach(*args, **kwargs)

    def counted(name: str) -> Any:
        real = getattr(StagingPool, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "_foreach_copy_", foreach)
    monkeypatch.setattr(StagingPool, "stage", counted("stage"))
    monkeypatch.setattr(StagingPool, "stage_hashed", counted("stage_hashed"))
    try:
        digests: dict[str, str] = {}
        pool.stage_many(_items(plan, pool, sd), digests)
        nbytes = sum(t.numel() * 4 for t in sd.values())
        assert calls["stage"] == calls["stage_hashed"] == 0  # no Python call per tensor
        assert calls["foreach"] == -(-nbytes // BATCH_BYTES) <= 3
        for name, (file, offset, length) in plan.places.items():
            view = pool.view(file, offset, length)
            assert torch.equal(view.view(torch.float32), sd[name])
            assert digests[name] == digest_of(view)
    finally:
        pool.close()
    assert max(t.numel() * 4 for t in sd.values()) <= HASH_BLOCK


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("staging", ["overlap", "blocking"])
def test_a_checkpoint_of_many_small_tensors_verifies_and_loads_equal(
    tmp_path: Path, mode: str, staging: str
) -> None:
    sd = {k: v for k, v in _mixed_state().items() if k != "bits8"}
    expected = {k: v.clone() for k, v in sd.items()}
    with AsyncSaver(EngineConfig(mode=mode, staging=staging)) as saver:
        handle = saver.save(sd, tmp_path / "ckpt", step=1, deferred=lambda fqn, t: True)
        handle.wait(60)
    report = verify_checkpoint(tmp_path / "ckpt")
    assert report.ok, report.problems
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}

    quicksave.load(loaded, str(tmp_path / "ckpt"))
    for k, v in expected.items():
        assert torch.equal(loaded[k].resolve_conj(), v.resolve_conj()), k


def test_a_pool_is_kept_for_a_plan_with_the_same_file_images() -> None:
    sd = {f"w{i}": torch.randn(100 + i) for i in range(5)}
    plan = _plan(sd)
    pool = StagingPool(plan.layout, pin=False)
    try:
        # another order of the same tensors: the same plan (the planner sorts by name)
        reordered = dict(reversed(list(sd.items())))
        assert _plan(reordered).key == plan.key
        assert pool.adopt(_plan(reordered).layout) and pool.layout == plan.layout
        # other names, same sizes: the headers are rewritten in place
        renamed = {f"v{i}": t for i, t in enumerate(sd.values())}
        other = _plan(renamed)
        pool.stage_many(_items(plan, pool, sd))  # old bytes in place
        assert pool.adopt(other.layout)
        pool.stage_many(_items(other, pool, renamed))
        fresh = StagingPool(other.layout, pin=False)
        try:
            fresh.stage_many(_items(other, fresh, renamed))
            assert torch.equal(pool.buffer, fresh.buffer)  # headers, gaps and data
        finally:
            fresh.close()
        # other sizes: not adopted, nothing changed
        bigger = _plan({**renamed, "v0": torch.randn(5000)})
        before = pool.buffer.clone()
        assert not pool.adopt(bigger.layout)
        assert pool.layout == other.layout and torch.equal(pool.buffer, before)
    finally:
        pool.close()


def test_the_engine_keeps_its_pool_when_only_the_order_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = []

    class Counting(StagingPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(in_flight, "StagingPool", Counting)
    sd = {f"w{i}": torch.full((1000 + i,), float(i)) for i in range(8)}
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        saver.save(sd, tmp_path / "a", step=1).wait(60)
        reordered = dict(reversed(list(sd.items())))
        saver.save(reordered, tmp_path / "b", step=2).wait(60)
    assert len(built) == 1
    for name in ("a", "b"):
        assert verify_checkpoint(tmp_path / name).ok
        loaded = {k: torch.zeros_like(v) for k, v in sd.items()}

        quicksave.load(loaded, str(tmp_path / name))
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)
