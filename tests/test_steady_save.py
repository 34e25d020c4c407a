"""A steady save reuses what only changes with the structure of the state (the collect
cache, the tied groups, the job's pickled parts, the pool views): every cached answer
equals the uncached one, and any change of the structure is seen."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import quicksave
from helpers.compare import assert_same, snapshot
from quicksave.errors import IncompatibleStateError
from quicksave.format.strict_json import MAX_INT_DIGITS
from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave.manager.states import payload_bytes
from quicksave.saving.collect_cache import CollectCache
from quicksave.saving.model_record import alias_key, tied_groups
from quicksave.saving.rank_plans import collect_local
from quicksave.worker.job import Arrivals, PickledOnce


def _state() -> dict[str, Any]:
    return {
        "model": {f"layer.{i}.weight": torch.randn(4, 3) for i in range(5)},
        "optim": {"state": {"0": {"step": torch.tensor(3.0), "m": torch.randn(2)}}, "lr": 0.1},
        "steps": [1, 2, 3],
        "nested": [torch.ones(2), {"x": 1}],
        "empty": {},
        7: torch.zeros(1),
    }


def _whole(sd: dict[str, Any]) -> Any:
    return collect_local(sd, 0, whole=True)


def _same_collect(a: Any, b: Any) -> None:
    assert list(a.tensors) == list(b.tensors)
    assert list(a.sources) == list(b.sources)
    for name in a.tensors:
        assert a.tensors[name] is b.sources[name] or torch.equal(a.tensors[name], b.tensors[name])
        assert a.sources[name] is b.sources[name]
    assert a.values == b.values and list(a.values) == list(b.values)
    assert a.paths == b.paths and a.empty == b.empty
    assert a.rank == b.rank and a.items is b.items is None
    assert a.shape_key == b.shape_key
    assert a.plan == b.plan


def test_a_cached_collect_equals_collect_local() -> None:
    cache = CollectCache()
    first = _state()
    cache.collect(first, 0)
    for _ in range(2):
        sd = _state()
        sd["optim"]["lr"] = 0.5  # a value changes: encoded again
        got = cache.collect(sd, 0)
        _same_collect(got, _whole(sd))
        assert got.values["optim.lr"] == 0.5
    assert (cache.hits, cache.misses) == (2, 1)


def test_a_steady_collect_keeps_the_structure_s_plan_key() -> None:
    cache = CollectCache()
    cache.collect(_state(), 0)
    first = cache.collect(_state(), 0)
    again = cache.collect(_state(), 0)
    assert first.shape is not None and again.shape is first.shape
    assert again.paths is first.paths


def _changes() -> list[tuple[str, Any]]:
    def new_key(sd: dict) -> None:
        sd["model"]["extra"] = torch.ones(1)

    def dropped_key(sd: dict) -> None:
        del sd["model"]["layer.0.weight"]

    def shape(sd: dict) -> None:
        sd["model"]["layer.1.weight"] = torch.randn(3, 4)

    def dtype(sd: dict) -> None:
        sd["model"]["layer.1.weight"] = torch.randn(4, 3, dtype=torch.float64)

    def to_value(sd: dict) -> None:
        sd["model"]["layer.2.weight"] = 1.5

    def list_gets_a_tensor(sd: dict) -> None:
        sd["steps"] = [1, torch.ones(1), 3]

    def key_type(sd: dict) -> None:
        sd["7"] = sd.pop(7)

    def dict_gets_a_key(sd: dict) -> None:
        sd["empty"] = {"a": torch.ones(1)}

    def meta(sd: dict) -> None:
        sd["model"]["layer.3.weight"] = torch.empty(4, 3, device="meta")

    return [
        (f.__name__, f)
        for f in (
            new_key,
            dropped_key,
            shape,
            dtype,
            to_value,
            list_gets_a_tensor,
            key_type,
            dict_gets_a_key,
            meta,
        )
    ]


@pytest.mark.parametrize("name,change", _changes())
def test_a_changed_structure_is_collected_again(name: str, change: Any) -> None:
    cache = CollectCache()
    cache.collect(_state(), 0)
    kept = cache.collect(_state(), 0).shape
    sd = _state()
    change(sd)
    if name == "meta":
        with pytest.raises(IncompatibleStateError, match="meta device"):
            cache.collect(sd, 0)
        return
    got = cache.collect(sd, 0)
    _same_collect(got, _whole(sd))
    assert cache.misses == 2 and kept is not None and got.shape is None  # key made again


def test_a_parameter_is_staged_detached_and_tracked_itself() -> None:
    p = nn.Parameter(torch.randn(3))
    cache = CollectCache()
    for _ in range(2):
        state = cache.collect({"w": p}, 0)
        assert state.sources["w"] is p
        assert not state.tensors["w"].requires_grad
    assert cache.hits == 1


def test_an_unsaveable_value_is_refused_on_a_steady_collect(tmp_path: Path) -> None:
    from quicksave.saving.config import EngineConfig
    from quicksave.saving.engine import AsyncSaver

    cache = CollectCache()
    cache.collect({"a": torch.ones(1), "v": 1}, 3)
    with pytest.raises(IncompatibleStateError) as e:
        cache.collect({"a": torch.ones(1), "v": 10 ** (MAX_INT_DIGITS + 1)}, 3)
    assert e.value.fqn == "v" and e.value.rank == 3
    with AsyncSaver(EngineConfig(mode="thread")) as saver:  # the saver names the path
        saver.save({"a": torch.ones(1), "v": 1}, str(tmp_path / "s0")).wait()
        target = str(tmp_path / "s1")
        with pytest.raises(IncompatibleStateError) as e:
            saver.save({"a": torch.ones(1), "v": 10 ** (MAX_INT_DIGITS + 1)}, target)
        assert saver._collected.hits == 0 and saver._collected.misses == 1
    assert e.value.fqn == "v" and e.value.path is not None and "s1" in e.value.path


def _tied_reference(state: dict[str, Any]) -> list[list[str]]:
    groups: dict[Any, list[str]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and (k := alias_key(value)) is not None:
            groups.setdefault(k, []).append(str(key))
    return [names for names in groups.values() if len(names) > 1]


def test_tied_groups_by_address_equal_those_by_alias_key() -> None:
    base = torch.randn(4, 4)
    state = {
        "a": base,
        "b": torch.randn(3),
        "a2": base,  # tied
        "row": base[0],  # same address, another view: not tied
        "t": base.t(),  # same address and shape, other strides: not tied
        "t2": base.t(),
        "e1": torch.empty(0),
        "e2": torch.empty(0),  # no memory: never tied
        "v": 3,
    }
    assert tied_groups(state) == _tied_reference(state) == [["a", "a2"], ["t", "t2"]]
    assert tied_groups({"x": torch.ones(2), "y": torch.ones(2)}) == []


def test_payload_bytes_counts_every_tensor_leaf() -> None:
    sd = {
        "a": torch.ones(3),
        "n": {"b": torch.ones(2, dtype=torch.float64), "c": [torch.ones(1), 5]},
        "l": [1, 2],
        "t": (torch.ones(4),),  # a tuple is one value, as DCP flattens it
    }
    assert payload_bytes(sd) == 12 + 16 + 4


def test_pickled_once_arrives_as_the_dict_and_pickles_once() -> None:
    entries = PickledOnce({"a": (1, 2), "b": "x"})
    first = pickle.dumps(entries)
    blob = entries.blob
    arrived = pickle.loads(first)
    assert arrived == {"a": (1, 2), "b": "x"}
    assert arrived.blob == blob  # (what the writer keys what it keeps on)
    pickle.dumps(entries)
    assert entries.blob is blob
    assert pickle.dumps(arrived) == first  # sent on, it pickles as the same bytes


def test_a_writer_unpickles_the_same_pickled_once_bytes_once() -> None:
    skeleton = PickledOnce({f"w{i}": (i, "x") for i in range(50)})
    arrivals = Arrivals(keep=2)
    msgs = [("job", {"tensors": skeleton, "objects": PickledOnce({"step": s})}) for s in range(4)]
    got = [arrivals.loads(pickle.dumps(m)) for m in msgs]
    assert all(g == (m[0], {"tensors": dict(skeleton), "objects": {"step": s}})
               for s, (g, m) in enumerate(zip(got, msgs, strict=True)))  # fmt: skip
    # the skeleton's bytes came in every message: one dict for all (kept, as the
    # latest used, while each message's own objects came and went)
    assert all(g[1]["tensors"] is got[0][1]["tensors"] for g in got)
    assert got[0][1]["objects"] is not got[1][1]["objects"]
    assert got[3][1]["tensors"].blob == skeleton.blob
    other = PickledOnce({"w0": (9, "y")})
    arrivals.loads(pickle.dumps(other))
    arrivals.loads(pickle.dumps(PickledOnce({"z": 1})))  # others since: the skeleton went
    again = arrivals.loads(pickle.dumps(msgs[0]))
    assert again[1]["tensors"] == dict(skeleton) and again[1]["tensors"] is not got[0][1]["tensors"]


# ---------------------------------------------------------------- through the manager


class _LM(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.head = nn.Linear(width, 16, bias=False)


def _manifest(path: str) -> dict[str, Any]:
    return json.loads((Path(path) / "manifest.json").read_text())


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_re_tie_and_a_new_shape_after_steady_saves_are_saved_exactly(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    model = _LM()
    states = {"model": quicksave.ModelState(model), "train": quicksave.TrainState()}
    config = CheckpointConfig(str(tmp_path), interval=1, async_mode=mode, keep_latest_k=10)

    def train() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        states["train"].step += 1

    with CheckpointManager(config, states) as manager:
        for step in range(1, 4):  # steady saves
            train()
            manager.save(step)
        assert manager.session.writer.saver._collected.hits >= 1
        manager.wait()
        assert "tied_weights" not in _manifest(manager.step_path(3))["user_metadata"]

        model.head.weight = model.embed.weight  # re-tied (same shape: 16 x 8)
        train()
        manager.save(4)
        manager.wait()
        tied = {"model": [["embed.weight", "head.weight"]]}
        assert _manifest(manager.step_path(4))["user_metadata"]["tied_weights"] == tied
        at_4 = snapshot(states)

        model.blocks[2] = nn.Linear(8, 8, bias=False)  # a key gone
        model.blocks[3].weight = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
        model.blocks[4].weight = nn.Parameter(torch.randn(8, 3))  # another shape
        train()
        manager.save(5)
        train()
        manager.save(6)  # steady again, with the new structure
        manager.wait()
        at_6 = snapshot(states)

    fresh = _LM()
    fresh.head.weight = fresh.embed.weight
    fresh_states = {"model": quicksave.ModelState(fresh), "train": quicksave.TrainState()}
    reader = CheckpointConfig(str(tmp_path), async_mode="disabled")
    with CheckpointManager(reader, fresh_states) as r:
        r.load(4)
    assert_same(snapshot(fresh_states), at_4)
    assert fresh.head.weight is fresh.embed.weight

    fresh.blocks[2] = nn.Linear(8, 8, bias=False)
    fresh.blocks[3].weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.float64))
    fresh.blocks[4].weight = nn.Parameter(torch.zeros(8, 3))
    with CheckpointManager(reader, fresh_states) as r:
        r.load(6)
    assert_same(snapshot(fresh_states), at_6)


def test_values_are_encoded_again_unless_the_same_immutable_object() -> None:
    cache = CollectCache()
    losses = [1.0]
    lr = 0.25
    cache.collect({"t": torch.ones(1), "lr": lr, "losses": losses, "step": 1}, 0)
    first = cache.collect({"t": torch.ones(1), "lr": lr, "losses": losses, "step": 1}, 0)
    same = cache.collect({"t": torch.ones(1), "lr": lr, "losses": losses, "step": 1}, 0)
    assert same.values == first.values == {"lr": 0.25, "losses": [1.0], "step": 1}
    losses.append(2.0)  # mutated in place: the same object, another value
    moved = cache.collect({"t": torch.ones(1), "lr": 0.5, "losses": losses, "step": 2}, 0)
    assert moved.values == {"lr": 0.5, "losses": [1.0, 2.0], "step": 2}
    assert cache.misses == 1


def test_a_tuple_is_encoded_again_unless_all_it_holds_is_immutable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quicksave.saving import collect_cache

    encoded: list[str] = []
    encode = collect_cache.objcodec.encode
    monkeypatch.setattr(
        collect_cache.objcodec, "encode", lambda v, fqn: encoded.append(fqn) or encode(v, fqn)
    )
    betas = (0.9, (0.999, "x"))
    held = [1]
    mixed = (0.5, held)
    cache = CollectCache()
    for _ in range(2):  # (the first two encode every value: no earlier one to keep)
        cache.collect({"t": torch.ones(1), "betas": betas, "mixed": mixed}, 0)
    encoded.clear()
    for _ in range(2):
        cache.collect({"t": torch.ones(1), "betas": betas, "mixed": mixed}, 0)
    assert encoded == ["mixed", "mixed"]
    held.append(2)  # the same tuple object, another value
    got = cache.collect({"t": torch.ones(1), "betas": betas, "mixed": mixed}, 0)
    assert got.values == _whole({"betas": betas, "mixed": mixed}).values
    assert cache.misses == 1


def test_an_encoding_is_kept_only_when_it_is_the_same_json() -> None:
    cases = [
        ([1, "a"], [1, "a"], True),
        ([1, "a"], [True, "a"], False),  # 1 == True, another JSON
        ([0.0], [-0.0], False),
        ([1], [1.0], False),
        (({"x": 1, "y": 2},), ({"y": 2, "x": 1},), False),  # another order
        (({"x": 1, "y": 2},), ({"x": 1, "y": 2},), True),
        ([float("nan")], [float("nan")], True),  # tagged alike
    ]
    for old, new, kept in cases:
        c = CollectCache()
        first = c.collect({"t": torch.ones(1), "v": old}, 0).values["v"]
        again = c.collect({"t": torch.ones(1), "v": old}, 0).values["v"]
        assert again is first
        got = c.collect({"t": torch.ones(1), "v": new}, 0).values["v"]
        assert (got is first) == kept, (old, new)
        assert json.dumps(got) == json.dumps(_whole({"v": new}).values["v"])


@pytest.mark.parametrize("staging", ["blocking", "overlap"])
def test_steady_saves_of_dtypes_without_copy_kernels_load_exactly(
    tmp_path: Path, staging: str
) -> None:
    from quicksave.saving.config import EngineConfig
    from quicksave.saving.engine import AsyncSaver

    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(64, generator=g),
        "f8": torch.randn(9, generator=g).to(torch.float8_e5m2),
        "bits8": torch.arange(16, dtype=torch.uint8).view(torch.bits8),
        "empty": torch.empty(0),
    }
    with AsyncSaver(EngineConfig(mode="thread", staging=staging)) as saver:
        for step in range(3):
            sd["w"].add_(1.0)
            saver.save(sd, str(tmp_path / f"s{step}"), step=step).wait()
        assert saver._collected.hits == 2
    loaded = {k: torch.zeros(v.nbytes, dtype=torch.uint8).view(v.dtype) for k, v in sd.items()}
    quicksave.load(loaded, str(tmp_path / "s2"))
    for k, v in sd.items():
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
