"""Pure multi-rank planning in one process: 8 to 256 simulated ranks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tests.helpers.manifests import committed_json

from quicksave.errors import IncompatibleStateError
from quicksave.format.manifest import to_json_bytes
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.layout.plan import ItemSpec
from quicksave.saving.rank_plans import (
    LocalPlan,
    collect_local,
    delta,
    global_plan,
    local_plan,
    plan_key,
    reusable_key,
    seeded_cache,
)


def _item(fqn: str, offsets, sizes, shape, nbytes_per: int = 4) -> ItemSpec:
    return ItemSpec(
        fqn, tuple(offsets), tuple(sizes), tuple(shape), "float32", math.prod(sizes) * nbytes_per
    )


def _plan(rank: int, items, objects=(), paths=()) -> LocalPlan:
    items = tuple(sorted(items, key=lambda it: (it.fqn, it.offsets)))
    body = (items, tuple(sorted(objects)), tuple(paths))
    return LocalPlan(rank, items, body[1], body[2], str(hash(repr(body))))


def _model_plans(world: int, tensors: int, tag: str = "") -> list[LocalPlan]:
    """Half the tensors row-sharded over all ranks, half replicated on every rank."""
    plans = []
    for r in range(world):
        items = []
        for t in range(tensors):
            rows, cols = 4 * world, 8 + t % 5
            if t % 2:
                items.append(_item(f"m{tag}.{t}", (r * 4, 0), (4, cols), (rows, cols)))
            else:
                items.append(_item(f"m{tag}.{t}", (0,), (16 + t,), (16 + t,)))
        plans.append(_plan(r, items, objects=("step", f"rank{r}")))
    return plans


def _greedy_reference(plans: list[LocalPlan]) -> list[set[str]]:
    """Independent statement of the policy: forced chunks first, then shared chunks by
    size (descending, then fqn/offsets/sizes) to the least loaded holder, lowest rank
    on ties."""
    holders: dict[tuple, list[int]] = {}
    spec: dict[tuple, ItemSpec] = {}
    for p in plans:
        for it in p.items:
            holders.setdefault((it.fqn, it.offsets, it.sizes), []).append(p.rank)
            spec[(it.fqn, it.offsets, it.sizes)] = it
    load = [0] * len(plans)
    out: list[set[str]] = [set() for _ in plans]
    for idx, h in holders.items():
        if len(h) == 1:
            load[h[0]] += spec[idx].nbytes
            out[h[0]].add(spec[idx].key)
    for idx in sorted(
        (i for i in holders if len(holders[i]) > 1), key=lambda i: (-spec[i].nbytes, i)
    ):
        best = sorted(holders[idx], key=lambda r: (load[r], r))[0]
        load[best] += spec[idx].nbytes
        out[best].add(spec[idx].key)
    return out


@pytest.mark.parametrize("world", [8, 64])
def test_every_chunk_written_once_by_a_holder_balanced(world: int) -> None:
    plans = _model_plans(world, 40)
    gp = global_plan(plans, thread_count=2)
    written = [{e.item.key for f in lay.files for e in f.entries} for lay in gp.layouts]
    assert written == _greedy_reference(plans)
    all_keys = [k for w in written for k in w]
    assert len(all_keys) == len(set(all_keys))
    assert set(all_keys) == {it.key for p in plans for it in p.items}
    loads = [sum(it.nbytes for it in a) for a in gp.assigned]
    biggest_shared = max(
        it.nbytes for it in plans[0].items if not it.offsets[0] and len(it.sizes) == 1
    )
    assert max(loads) - min(loads) <= biggest_shared
    # Objects: the lowest holder writes each value.
    assert gp.objects[0] == ("rank0", "step")
    assert all(gp.objects[r] == (f"rank{r}",) for r in range(1, world))


def test_skeleton_places_every_chunk_and_file() -> None:
    plans = _model_plans(8, 10)
    plans[0] = dataclasses.replace(plans[0], paths=(("m.0", ("m", "0")),))
    gp = global_plan(plans, thread_count=3)
    sk = gp.skeleton
    assert sk.world_size == 8 and sk.step is None
    files = {f.name: (lay.rank, f) for lay in gp.layouts for f in lay.files}
    assert set(sk.files) == set(files)
    for name, entry in sk.files.items():
        rank, f = files[name]
        assert (entry.size, entry.rank, entry.data_start) == (f.size, rank, f.data_start)
        assert entry.xxh3_64 == f.header_xxh3_64
    for t in sk.tensors.values():
        assert sum(math.prod(c.sizes) for c in t.chunks) == math.prod(t.shape)
        assert all(c.xxh3_64 == "" for c in t.chunks)
        assert list(t.chunks) == sorted(t.chunks, key=lambda c: c.offsets)
    assert sk.tensors["m.0"].path == ("m", "0")
    assert sk.objects["step"].value is None
    assert [len(p.tensors) for p in sk.plans] == [len(p.items) for p in plans]


def test_delta_equals_full_replan_256_ranks() -> None:
    plans = _model_plans(256, 12)
    gp = global_plan(plans, thread_count=2)
    assert delta(gp, {}) is gp
    assert delta(gp, {5: plans[5]}) is gp  # unchanged plan: nothing to do
    changed = {}
    for r in (0, 7, 200):
        extra = _item(f"new.{r}", (0,), (1000 + r,), (1000 + r,))
        changed[r] = _plan(r, plans[r].items + (extra,), plans[r].objects)
    # A replicated tensor newly held by two ranks shifts the balance for everyone.
    shared = _item("shared.new", (0,), (5000,), (5000,))
    changed[9] = _plan(9, plans[9].items + (shared,), plans[9].objects)
    changed[10] = _plan(10, plans[10].items + (shared,), plans[10].objects)
    merged = list(plans)
    for r, p in changed.items():
        merged[r] = p
    full = global_plan(merged, thread_count=2)
    got = delta(gp, changed)
    assert got.layouts == full.layouts
    assert got.assigned == full.assigned
    assert to_json_bytes(got.skeleton) == to_json_bytes(full.skeleton)
    assert got.key == full.key != gp.key
    # Ranks whose share did not change keep the very same layout object.
    assert got.layouts[100] is gp.layouts[100]
    assert got.key == plan_key([p.key for p in merged], 2)


def test_ranks_disagreeing_on_dtype_are_named() -> None:
    a = _plan(0, [_item("w", (0,), (4,), (4,))])
    b = _plan(1, [dataclasses.replace(_item("w", (0,), (4,), (4,)), dtype="bfloat16", nbytes=8)])
    with pytest.raises(IncompatibleStateError) as e:
        global_plan([a, b])
    assert "rank 0 has float32 [4], rank 1 has bfloat16 [4]" in str(e.value)
    assert "fqn=w" in str(e.value) and "rank=1" in str(e.value)


def test_missing_shard_is_refused() -> None:
    a = _plan(0, [_item("w", (0, 0), (2, 3), (4, 3))])
    b = _plan(1, [])
    with pytest.raises(IncompatibleStateError, match=r"cover 6 of 12 elements.*fqn=w, rank=0"):
        global_plan([a, b])


def test_tensor_on_one_rank_value_on_another_is_refused() -> None:
    a = _plan(0, [_item("x", (0,), (2,), (2,))])
    b = _plan(1, [], objects=("x",))
    with pytest.raises(IncompatibleStateError, match=r"non-tensor value on rank 1.*fqn=x"):
        global_plan([a, b])


def test_local_plan_names_and_keys_match_quicksave_save() -> None:
    sd = {"model": {"w": torch.ones(3, 2), "b": torch.zeros(2)}, "opt": [torch.ones(1)], "step": 4}
    lp = local_plan(sd, rank=3)
    assert [it.fqn for it in lp.items] == ["model.b", "model.w", "opt.0"]
    assert lp.objects == ("step",)
    assert dict(lp.paths)["model.w"] == ("model", "w")
    state = collect_local(sd, rank=3)
    assert state.plan == lp and state.values == {"step": 4}
    tensors = state.tensors
    assert set(tensors) == {it.key for it in lp.items}
    assert tensors["model.w"].data_ptr() == sd["model"]["w"].data_ptr()  # no copy
    # The key depends on structure only: new values, same key; new shape, new key.
    sd2 = {
        "model": {"w": torch.full((3, 2), 5.0), "b": torch.ones(2)},
        "opt": [torch.ones(1)],
        "step": 9,
    }
    assert local_plan(sd2, 3).key == lp.key
    sd2["model"]["b"] = torch.ones(3)
    assert local_plan(sd2, 3).key != lp.key


def test_local_plan_refuses_unstorable_values() -> None:
    with pytest.raises(IncompatibleStateError, match=r"fqn=cfg.fn, rank=2"):
        local_plan({"cfg": {"fn": object()}, "w": torch.ones(1)}, rank=2)
    with pytest.raises(IncompatibleStateError, match=r"meta device.*fqn=w, rank=1"):
        local_plan({"w": torch.empty(2, device="meta")}, rank=1)


def test_cache_seeded_from_a_manifest_round_trip() -> None:
    sds = [
        {"model": {"w": torch.ones(4, 4), f"own{r}": torch.ones(r + 1)}, "step": 1}
        for r in range(4)
    ]
    plans = [local_plan(sd, r) for r, sd in enumerate(sds)]
    gp = global_plan(plans, thread_count=2)
    loaded = from_json_bytes(committed_json(gp.skeleton))
    cache = seeded_cache(loaded)
    assert cache.seed is not None
    assert [p.key for p in cache.seed] == [p.key for p in plans]
    assert cache.seed == tuple(plans)
    ctx = (4, 0, 2)
    assert reusable_key(cache, plans[2], 2, ctx) == gp.key
    assert reusable_key(cache, local_plan({"other": torch.ones(1)}, 2), 2, ctx) is None
    assert reusable_key(cache, plans[2], 2, (5, 0, 2)) is None  # another world size
    # A manifest without plans seeds nothing.
    bare = dataclasses.replace(loaded, plans=None)
    assert seeded_cache(bare).seed is None
