"""Loads without a template give back exactly the structure that was saved: dict keys
with their types (int, bool, None, float, str), lists, tuples, empty dicts
(FORMAT.md §2.1), through every writer (``quicksave.save``, the async engine, the
manager) and every templateless reader (``load_state``, ``load_full_state``,
``convert --to torch|safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers.state import Holder

import quicksave
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CorruptCheckpointError
from quicksave.format.manifest import to_json_bytes
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.tools.convert import convert, load_full_state


def assert_exactly(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal, with the same types all the way down (dict keys included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
        return
    if isinstance(expected, dict):  # OrderedDict comes back as dict: same mapping
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}"
        assert [(type(k), k) for k in sorted(actual, key=repr)] == [
            (type(k), k) for k in sorted(expected, key=repr)
        ], where
        for k in expected:
            assert_exactly(actual[k], expected[k], f"{where}[{k!r}]")
        return
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_exactly(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def trained_optimizer_state() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    fresh = opt.state_dict()  # before any step: "state" is an empty dict
    fresh = {"state": {}, "param_groups": [dict(g) for g in fresh["param_groups"]]}
    for _ in range(2):
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict() | {"fresh": fresh}


def odd_keys() -> dict[Any, Any]:
    return {
        7: "int",
        -3: {"neg": torch.arange(3)},
        False: 0.5,
        None: [1, 2],
        2.5: (1, "x"),
        "0": "a string that looks like an int",
        "empty": {},
        "nested_empty": {"a": {}, 4: {}},
        "list": [{}, torch.ones(2), {"k": 1}],
    }


def state() -> dict[str, Any]:
    model, optim = trained_optimizer_state()
    return {"model": model, "optim": optim, "odd": odd_keys(), "step": 12}


def test_load_full_state_round_trips_an_optimizer_state_dict_exactly(tmp_path: Path) -> None:
    model, optim = trained_optimizer_state()
    quicksave.save({"optim": optim}, tmp_path / "c")
    got, _ = load_full_state(tmp_path / "c")
    assert_exactly(got["optim"], optim)
    assert sorted(got["optim"]["state"]) == [0, 1, 2, 3]
    # and it loads into an optimizer: the moments are the saved ones
    fresh = torch.optim.AdamW(
        torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)
        ).parameters()
    )
    fresh.load_state_dict({k: v for k, v in got["optim"].items() if k != "fresh"})
    assert torch.equal(
        fresh.state_dict()["state"][2]["exp_avg_sq"], optim["state"][2]["exp_avg_sq"]
    )


@pytest.mark.parametrize("writer", ["save", "engine-thread", "engine-process", "manager"])
def test_every_writer_records_the_structure(tmp_path: Path, writer: str) -> None:
    expected = state()
    path = tmp_path / "ckpt"
    if writer == "save":
        quicksave.save(expected, path)
    elif writer.startswith("engine"):
        saver = AsyncSaver(EngineConfig(mode=writer.split("-")[1]))
        try:
            saver.save(expected, path, step=12).wait()
        finally:
            saver.close()
    else:
        holder = Holder(expected)
        config = quicksave.CheckpointConfig(folder=str(tmp_path), interval=1, async_mode="process")
        with quicksave.CheckpointManager(config, {"all": holder}) as manager:
            manager.save(12)
        path = Path(manager.step_path(12))
        expected = {"all": expected}
    assert_exactly(quicksave.load_state(path), expected)


def test_convert_outputs_keep_the_structure(tmp_path: Path) -> None:
    expected = state()
    quicksave.save(expected, tmp_path / "c")
    convert(tmp_path / "c", tmp_path / "c.pt", to="torch")
    assert_exactly(torch.load(tmp_path / "c.pt", weights_only=True), expected)
    convert(tmp_path / "c", tmp_path / "c.safetensors", to="safetensors")
    assert_exactly(quicksave.load_state(tmp_path / "c.safetensors"), expected)


def test_templated_loads_are_unchanged(tmp_path: Path) -> None:
    expected = state()
    # DCP's own load planner turns an empty dict inside a list into a None leaf (its
    # _flatten_sharded_tensors rebuilds lists); that is DCP's, not this change's
    expected["odd"]["list"] = [torch.ones(2), {"k": 1}]
    quicksave.save(expected, tmp_path / "c")
    dest = state()
    dest["odd"]["list"] = [torch.zeros(2), {"k": 0}]
    for t in dest["optim"]["state"].values():
        t["exp_avg"].zero_()
    dest["step"] = 0
    quicksave.load(dest, tmp_path / "c")
    assert_exactly(dest, expected)


def test_other_key_types_come_back_as_their_str(tmp_path: Path) -> None:
    quicksave.save({"m": {(1, 2): torch.ones(1), b"raw": 3}}, tmp_path / "c")
    got = quicksave.load_state(tmp_path / "c")
    assert_exactly(got, {"m": {"(1, 2)": torch.ones(1), "b'raw'": 3}})


def test_manifest_records_key_types_beside_dcp_paths(tmp_path: Path) -> None:
    quicksave.save({"o": {"state": {0: {"m": torch.ones(1)}}, "e": {}}}, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    entry = doc["tensors"]["o.state.0.m"]
    assert entry["path"] == ["o", "state", "0", "m"]  # DCP's path, as before
    assert entry["key_types"] == [None, None, "int", None]
    assert doc["empty_dicts"] == [{"path": ["o", "e"]}]


def test_manifest_without_key_types_gives_strings(tmp_path: Path) -> None:
    """A checkpoint written before key types were recorded: keys as DCP named them."""
    quicksave.save({"o": {0: torch.ones(1)}}, tmp_path / "c")
    m = read_manifest(tmp_path / "c")
    t = m.tensors["o.0"]
    old = type(m)(
        **{**m.__dict__, "tensors": {"o.0": type(t)(**{**t.__dict__, "path": ("o", "0")})}}
    )
    (tmp_path / "c" / "manifest.json").write_bytes(to_json_bytes(old))
    assert_exactly(quicksave.load_state(tmp_path / "c"), {"o": {"0": torch.ones(1)}})


@pytest.mark.parametrize(
    "key_types",
    [["int"], [None, "int", None], [None, "bool"], [None, "float"], [None, "complex"], "int"],
)
def test_bad_key_types_are_corruption(tmp_path: Path, key_types: Any) -> None:
    quicksave.save({"o": {"x": torch.ones(1)}}, tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["tensors"]["o.x"]["key_types"] = key_types
    m_bytes = _reseal(doc)
    manifest.write_bytes(m_bytes)
    with pytest.raises(CorruptCheckpointError, match="key_types"):
        quicksave.load_state(tmp_path / "c")


def _reseal(doc: dict[str, Any]) -> bytes:
    """The manifest bytes of ``doc`` with a valid self-checksum (FORMAT.md §2)."""
    import xxhash

    doc["manifest_xxh3_64"] = "0" * 16
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    digest = format(xxhash.xxh3_64_intdigest(data), "016x")
    return data.replace(b'"' + b"0" * 16 + b'"', b'"' + digest.encode() + b'"')


def test_stock_dcp_checkpoint_loads_without_template(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.arange(4.0)}, "opt": {"state": {0: {"m": torch.ones(2)}}}}
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    got = quicksave.load_state(tmp_path / "d")
    # DCP records dict keys as strings only
    assert_exactly(
        got, {"model": {"w": torch.arange(4.0)}, "opt": {"state": {"0": {"m": torch.ones(2)}}}}
    )


def test_a_file_that_is_not_quicksave_safetensors_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(quicksave.CheckpointError, match="not a quicksave checkpoint") as e:
        quicksave.load_state(tmp_path / "x.safetensors")
    assert str(tmp_path / "x.safetensors") in str(e.value)
    (tmp_path / "junk").write_bytes(b"\x00" * 100)
    with pytest.raises(quicksave.CheckpointError, match="junk"):
        quicksave.load_state(tmp_path / "junk")


@pytest.mark.parametrize("writer", ["save", "engine"])
def test_keys_that_flatten_alike_are_refused_before_any_write(tmp_path: Path, writer: str) -> None:
    sd = {"o": {0: torch.ones(1), "0": torch.zeros(1)}}
    with pytest.raises(quicksave.IncompatibleStateError, match="rename one") as e:
        if writer == "save":
            quicksave.save(sd, tmp_path / "c")
        else:
            saver = AsyncSaver(EngineConfig(mode="thread"))
            try:
                saver.save(sd, tmp_path / "c")
            finally:
                saver.close()
    assert e.value.fqn == "o.0"
    assert list(tmp_path.iterdir()) == []


def _leave_a_mark(path: str) -> int:
    Path(path).write_text("code ran")
    return 1


class _Planted:
    """A value whose unpickling runs code (what a hostile DCP checkpoint can hold)."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (_leave_a_mark, (self.mark,))


def test_stock_dcp_objects_are_not_unpickled_without_permission(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    mark = tmp_path / "mark"
    with pytest.warns(UserWarning):
        dcp.save(
            {"w": torch.ones(2), "evil": _Planted(str(mark))}, checkpoint_id=str(tmp_path / "d")
        )
    for load in (
        lambda: quicksave.load_state(tmp_path / "d"),
        lambda: quicksave.load({"w": torch.zeros(2), "evil": None}, tmp_path / "d"),
    ):
        with pytest.raises(quicksave.CheckpointError, match="allow_dcp_pickle") as e:
            load()
        assert e.value.fqn == "evil" and str(tmp_path / "d") in str(e.value)
        assert not mark.exists()
    # trusted: the caller said so
    assert quicksave.load_state(tmp_path / "d", allow_dcp_pickle=True)["evil"] == 1
    assert mark.read_text() == "code ran"


def test_dcp_compatible_metadata_holds_dcp_classes_only(tmp_path: Path) -> None:
    """``StorageWriter(dcp_compat=True)`` with quicksave's planner (the object-store
    layout of the NVRx writer): int keys and empty dicts reach the manifest, never
    ``.metadata``'s pickle."""
    import torch.distributed.checkpoint as dcp

    from quicksave.adapters.dcp_save_planner import DcpSavePlanner
    from quicksave.loading.dcp_stock import read_dcp_metadata

    sd = {"optim": {"state": {0: {"m": torch.arange(3.0)}}, "loop": {}}, "step": 2}
    writer = quicksave.StorageWriter(tmp_path / "c", dcp_compat=True)
    with pytest.warns(UserWarning):
        dcp.save(sd, storage_writer=writer, planner=DcpSavePlanner())
    md = read_dcp_metadata(tmp_path / "c")  # the restricted unpickler: DCP's classes only
    assert md.planner_data["optim.state.0.m"] == ("optim", "state", "0", "m")
    assert all(isinstance(k, str) for k in md.planner_data)
    got = quicksave.load_state(tmp_path / "c")
    assert list(got["optim"]["state"]) == [0] and got["optim"]["loop"] == {}
    stock = {"optim": {"state": {0: {"m": torch.zeros(3)}}}, "step": 0}
    with pytest.warns(UserWarning):
        dcp.load(stock, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(stock["optim"]["state"][0]["m"], torch.arange(3.0)) and stock["step"] == 2
