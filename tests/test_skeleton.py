"""The one manifest builder (``saving.skeleton`` + ``commit.parts.manifest_from_parts``):
every save path describes the same state the same way, and the filler refuses parts
that do not match the plan instead of committing a manifest with holes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import quicksave
from quicksave.commit.manifest_reader import read_manifest
from quicksave.commit.parts import RankPart, manifest_from_parts
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError
from quicksave.layout.plan import ItemSpec, layout_rank
from quicksave.layout.skeleton import chunk_keys_of, manifest_skeleton, placed_of
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.saving.rank_plans import global_plan, local_plan


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(33, 7, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "empty": torch.zeros(0, 4),
        "opt": {"step": 11, "lr": 0.25, "name": "adam", "nothing": None},
    }


def _described(m) -> tuple:
    """What a manifest says about the state, whatever the file layout."""
    tensors = {
        fqn: (t.dtype, t.shape, t.path, tuple((c.offsets, c.sizes, c.xxh3_64) for c in t.chunks))
        for fqn, t in m.tensors.items()
    }
    objects = {fqn: (o.value, o.path) for fqn, o in m.objects.items()}
    return m.step, m.world_size, tensors, objects, m.user_metadata


def test_every_save_path_describes_the_same_state_alike(tmp_path: Path) -> None:
    sd = _state()
    quicksave.save(sd, tmp_path / "api", step=4, user_metadata={"k": "v"})
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        saver.save(sd, tmp_path / "engine", step=4, user_metadata={"k": "v"}).wait(60)
    api, engine = read_manifest(tmp_path / "api"), read_manifest(tmp_path / "engine")
    assert _described(api) == _described(engine)
    assert all(c.xxh3_64 for t in api.tensors.values() for c in t.chunks)
    assert api.objects["opt.nothing"].value is None  # a None value, reported as such


def _one_rank_skeleton():
    items = [
        ItemSpec("a", (0,), (8,), (8,), "float32", 32),
        ItemSpec("b", (0, 0), (2, 3), (2, 3), "int64", 48),
    ]
    files, placed = placed_of([layout_rank(0, items, 2)])
    shapes = {it.fqn: (it.dtype, it.global_shape) for it in items}
    return manifest_skeleton(shapes, files, placed, {"x": None}, world_size=1)


def test_filled_from_parts_every_chunk_and_value() -> None:
    sk = _one_rank_skeleton()
    keys = chunk_keys_of(sk)
    m = manifest_from_parts(sk, keys, [RankPart(0, {"a": "1" * 16, "b": "2" * 16}, {"x": 5})], "t")
    assert [c.xxh3_64 for c in m.tensors["a"].chunks] == ["1" * 16]
    assert m.objects["x"].value == 5


def test_references_are_filled_with_the_checksums_and_checked() -> None:
    sk = dataclasses.replace(_one_rank_skeleton(), step=7)
    keys = chunk_keys_of(sk)
    part = [RankPart(0, {"a": "1" * 16, "b": "2" * 16}, {"x": 5})]
    m = manifest_from_parts(sk, keys, part, "t", bases={"b": 3})
    assert [(c.xxh3_64, c.base) for c in m.tensors["b"].chunks] == [("2" * 16, 3)]
    assert [(c.xxh3_64, c.base) for c in m.tensors["a"].chunks] == [("1" * 16, None)]
    assert m.format_version == 2 and m.bases() == {3}
    for bad, what in (({"b": 7}, "refer to step 7"), ({"c": 1}, "'c' cannot refer")):
        with pytest.raises(CorruptCheckpointError, match=what):
            manifest_from_parts(sk, keys, part, "t", bases=bad)


@pytest.mark.parametrize(
    "chunks, objects, what",
    [
        ({"a": "1" * 16}, {"x": 5}, "no rank reported writing this chunk"),
        ({"a": "1" * 16, "b": "2" * 16, "c": "3" * 16}, {"x": 5}, "the plan does not have"),
        ({"a": "1" * 16, "b": "2" * 16}, {}, "no rank reported writing this value"),
        ({"a": "1" * 16, "b": "2" * 16}, {"x": 5, "y": 1}, "no such value in the plan"),
    ],
)
def test_parts_that_do_not_match_the_plan_are_refused(chunks, objects, what) -> None:
    sk = _one_rank_skeleton()
    with pytest.raises(CorruptCheckpointError, match=what):
        manifest_from_parts(sk, chunk_keys_of(sk), [RankPart(0, chunks, objects)], "t")


def test_a_chunk_or_value_reported_by_two_ranks_is_refused() -> None:
    plans = [local_plan({"a": torch.ones(4), "x": 1}, r) for r in range(2)]
    gp = global_plan(plans)
    keys = chunk_keys_of(gp.skeleton)
    one = RankPart(0, {"a": "1" * 16}, {"x": 1})
    with pytest.raises(CorruptCheckpointError, match="written by ranks 0 and 1"):
        manifest_from_parts(gp.skeleton, keys, [one, RankPart(1, {"a": "1" * 16}, {})], "t")
    with pytest.raises(CorruptCheckpointError, match="rank 0 did too"):
        manifest_from_parts(gp.skeleton, keys, [one, RankPart(1, {}, {"x": 1})], "t")
    m = manifest_from_parts(gp.skeleton, keys, [one, RankPart(1, {}, {})], "t")
    assert m.world_size == 2 and m.objects["x"].value == 1


def test_a_tensor_whose_chunks_miss_elements_is_refused() -> None:
    items = [ItemSpec("a", (0,), (4,), (8,), "float32", 16)]  # half of an 8-element tensor
    files, placed = placed_of([layout_rank(0, items)])
    with pytest.raises(IncompatibleStateError, match="cover 4 of 8 elements"):
        manifest_skeleton({"a": ("float32", (8,))}, files, placed, {}, world_size=1)
