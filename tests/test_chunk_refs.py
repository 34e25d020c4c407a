"""Chunk references (FORMAT.md §9): a checkpoint whose manifest says that some chunks'
bytes are in an earlier checkpoint of the same run folder (``base``) loads bit-exactly
through every read path, fails clearly (naming both checkpoints) when its base is
missing, uncommitted or damaged, is checked by verify, keeps its base under retention,
and converts to something standalone. Incremental checkpoints are made from two full
ones by :mod:`helpers.chunk_refs` (the referenced bytes zeroed in the newer one)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from helpers.checks import seal_manifest
from helpers.chunk_refs import damage_chunks, manifest_of, refer, unchanged
from helpers.state import assert_bit_equal, random_tensor
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest import to_json_bytes
from quicksave.format.manifest_parse import bases_in, from_json_bytes
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave.manager.folder import apply_retention
from quicksave.manager.policies import KeepLatestK
from quicksave.manager.references import BaseCache
from quicksave.storage import parse_location
from quicksave.tools.convert import convert
from quicksave.tools.read_full import read_flat

FROZEN = ("frozen", "emb")  # unchanged between the two saves: step-3 refers to step-1


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {
        "frozen": random_tensor((64, 8), torch.bfloat16, seed=1),
        "emb": random_tensor((33, 7), torch.float32, seed=2),
        "head": random_tensor((5,), torch.float32, seed=seed),
    }


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run folder with a full ``step-1`` and ``step-3`` whose ``frozen`` and ``emb``
    refer to step-1 (their own bytes zeroed). Returns the folder and step-3's state."""
    folder = tmp_path / "run"
    quicksave.save(_state(3), folder / "step-1", step=1)
    quicksave.save(_state(4), folder / "step-3", step=3)
    refer(folder / "step-3", 1, FROZEN)
    return folder, _state(4)


def _zeros(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in expected.items()}


def _assert_all(out: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for fqn, value in expected.items():
        assert_bit_equal(out[fqn], value, fqn)


# ------------------------------------------------------------------------ the format


def test_the_manifest_is_version_2_and_round_trips(run) -> None:
    folder, _ = run
    data = (folder / "step-3" / MANIFEST_NAME).read_bytes()
    doc = json.loads(data)
    assert doc["format_version"] == 2
    assert [c.get("base") for c in doc["tensors"]["frozen"]["chunks"]] == [1]
    assert "base" not in doc["tensors"]["head"]["chunks"][0]
    m = from_json_bytes(data)
    assert m.format_version == 2 and m.bases() == {1}
    assert to_json_bytes(m) == data
    assert json.loads((folder / "step-1" / MANIFEST_NAME).read_bytes())["format_version"] == 1


def _with_base(folder: Path, base: object) -> bytes:
    doc = json.loads((folder / "step-3" / MANIFEST_NAME).read_bytes())
    doc["tensors"]["frozen"]["chunks"][0]["base"] = base
    return seal_manifest(doc)


@pytest.mark.parametrize(
    ("base", "why"),
    [
        ("1", "base must be a step"),
        ("../step-1", "base must be a step"),
        ("/tmp/step-1", "base must be a step"),
        (True, "base must be a step"),
        (1.0, "base must be a step"),
        (-1, "base must be a step"),
        (None, "base must be a step"),
        (3, "base 3 must be below the checkpoint's own step 3"),
        (7, "base 7 must be below the checkpoint's own step 3"),
    ],
)
def test_a_base_that_is_not_an_earlier_step_is_rejected(run, base, why) -> None:
    folder, _ = run
    with pytest.raises(CorruptCheckpointError, match="manifest: ") as info:
        from_json_bytes(_with_base(folder, base), "/x/manifest.json")
    assert why in info.value.message
    assert info.value.fqn == "frozen"


def test_version_1_with_a_reference_and_a_reference_without_step_are_rejected(run) -> None:
    folder, _ = run
    doc = json.loads((folder / "step-3" / MANIFEST_NAME).read_bytes())
    doc["format_version"] = 1
    with pytest.raises(CorruptCheckpointError, match="has chunk references"):
        from_json_bytes(seal_manifest(doc))
    doc["format_version"] = 2
    doc["step"] = None
    with pytest.raises(CorruptCheckpointError, match="below the checkpoint's own step None"):
        from_json_bytes(seal_manifest(doc))


def test_writing_a_reference_to_a_later_step_is_refused(run) -> None:
    folder, _ = run
    m = manifest_of(folder / "step-3")
    with pytest.raises(ValueError, match="need layout 'quicksave' and a step above them"):
        to_json_bytes(dataclasses.replace(m, step=1))


# -------------------------------------------------------------------------- reading


def test_api_load_reads_referenced_chunks_from_the_base(run) -> None:
    folder, expected = run
    out = _zeros(expected)
    quicksave.load(out, folder / "step-3")
    _assert_all(out, expected)


def test_a_subset_into_other_layouts_and_the_dcp_reader(run) -> None:
    """A different selection of keys, a destination that is not the stored chunk as it
    is (non-contiguous: read through a buffer), and DCP's own load through the adapter."""
    folder, expected = run
    out = {"frozen": torch.zeros(8, 64, dtype=torch.bfloat16).t(), "head": torch.zeros(5)}
    quicksave.load(out, folder / "step-3", strict=False)
    assert_bit_equal(out["frozen"].contiguous(), expected["frozen"], "frozen")
    assert_bit_equal(out["head"], expected["head"], "head")
    out = _zeros(expected)
    with warnings.catch_warnings():  # DCP: torch.distributed is not initialized
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=quicksave.StorageReader(folder / "step-3"), no_dist=True)
    _assert_all(out, expected)


def test_read_flat_and_load_state_materialise_the_references(run) -> None:
    folder, expected = run
    flat, m = read_flat(parse_location(folder / "step-3"), False)
    for fqn, value in expected.items():
        assert_bit_equal(flat[fqn][1], value, fqn)
    state = quicksave.load_state(folder / "step-3")
    _assert_all(state, expected)


def test_a_missing_base_names_both_checkpoints_and_the_tensor(run) -> None:
    folder, expected = run
    shutil.rmtree(folder / "step-1")
    with pytest.raises(CorruptCheckpointError) as info:
        quicksave.load(_zeros(expected), folder / "step-3")
    assert info.value.path == str(folder / "step-3")
    assert str(folder / "step-1") in info.value.message
    assert "not a committed checkpoint" in info.value.message
    assert info.value.fqn in FROZEN


def test_an_uncommitted_base_is_refused(run) -> None:
    folder, expected = run
    (folder / "step-1" / MANIFEST_NAME).unlink()
    with pytest.raises(CorruptCheckpointError, match="never committed") as info:
        quicksave.load(_zeros(expected), folder / "step-3")
    assert info.value.path == str(folder / "step-3")
    assert str(folder / "step-1") in info.value.message


def test_damaged_bytes_in_the_base_fail_their_checksum_naming_both(run) -> None:
    folder, expected = run
    damage_chunks(folder / "step-1", "emb")
    for load in (
        lambda: quicksave.load(_zeros(expected), folder / "step-3"),
        lambda: read_flat(parse_location(folder / "step-3"), False),
    ):
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
            load()
        assert info.value.path.startswith(str(folder / "step-1"))
        assert f"the checkpoint that {folder / 'step-3'} refers to" in info.value.message
        assert info.value.fqn == "emb"


def test_a_missing_data_file_in_the_base_names_both(run) -> None:
    folder, expected = run
    for f in (folder / "step-1").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CorruptCheckpointError, match="data file is missing") as info:
        quicksave.load(_zeros(expected), folder / "step-3")
    assert info.value.path.startswith(str(folder / "step-1"))
    assert str(folder / "step-3") in info.value.message


# ------------------------------------------------------------------------ the manager


class Holder:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            self.state[k].copy_(v)


def _manager(folder: Path, holder: Holder, **kw) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=1, async_mode="disabled", **kw)
    return CheckpointManager(config, {"m": holder})


def _manager_run(folder: Path) -> None:
    """Steps 1, 2 and 3 saved by a manager; step-3's ``m.frozen`` and ``m.emb`` refer to
    step-1."""
    holder = Holder(_state(3))
    with _manager(folder, holder) as m:
        for step in (1, 2, 3):
            holder.state["head"].copy_(_state(step)["head"])
            assert m.save(step, force=True)
    refer(folder / "step-3", 1, [f"m.{k}" for k in FROZEN])


def test_manager_load_reads_an_incremental_checkpoint(tmp_path: Path) -> None:
    _manager_run(tmp_path)
    holder = Holder({k: torch.zeros_like(v) for k, v in _state(0).items()})
    with _manager(tmp_path, holder, read_only=True) as m:
        assert m.load() == 3
    _assert_all(holder.state, _state(3))


def test_manager_load_falls_back_past_a_broken_base(tmp_path: Path, caplog) -> None:
    _manager_run(tmp_path)
    damage_chunks(tmp_path / "step-1", "m.frozen")
    holder = Holder({k: torch.zeros_like(v) for k, v in _state(0).items()})
    with caplog.at_level(logging.ERROR, logger="quicksave"):
        with _manager(tmp_path, holder) as m:
            assert m.load() == 2
    _assert_all(holder.state, _state(2))
    assert "step 3 cannot be loaded" in caplog.text
    assert not (tmp_path / "step-3").exists()  # the writer quarantined it
    assert list(tmp_path.glob("step-3.corrupt-*"))


# ------------------------------------------------------------------------- verify


def test_verify_checks_references_and_their_targets(run) -> None:
    folder, _ = run
    report = verify_checkpoint(folder / "step-3")
    assert report.ok, report.problems
    m = manifest_of(folder / "step-3")
    assert report.bytes_checked >= sum(c.length for k in FROZEN for c in m.tensors[k].chunks)

    damage_chunks(folder / "step-1", "emb")
    report = verify_checkpoint(folder / "step-3")
    assert [(p.fqn, p.kind) for p in report.problems] == [("emb", "reference")]
    (problem,) = report.problems
    assert problem.file is not None and problem.file.startswith("../step-1/")
    assert "checksum mismatch" in problem.message and str(folder / "step-1") in problem.message

    shutil.rmtree(folder / "step-1")
    report = verify_checkpoint(folder / "step-3")
    assert sorted((p.fqn, p.kind) for p in report.problems) == [
        ("emb", "reference"),
        ("frozen", "reference"),
    ]
    assert all("cannot be read" in p.message for p in report.problems)


def test_references_are_depth_1(run) -> None:
    """A reference names the ultimate base; one naming a checkpoint that itself refers
    further is refused by verify (and its bytes, zeros there, fail on load)."""
    folder, expected = run
    quicksave.save(_state(4), folder / "step-5", step=5)
    m = refer(folder / "step-5", 3, FROZEN)  # frozen and emb: to step 1, their holder
    assert m.bases() == {1}
    assert verify_checkpoint(folder / "step-5").ok
    chunks = tuple(dataclasses.replace(c, base=3) for c in m.tensors["frozen"].chunks)
    tensors = {**m.tensors, "frozen": dataclasses.replace(m.tensors["frozen"], chunks=chunks)}
    (folder / "step-5" / MANIFEST_NAME).write_bytes(
        to_json_bytes(dataclasses.replace(m, tensors=tensors))
    )
    (problem,) = verify_checkpoint(folder / "step-5").problems
    assert (problem.fqn, problem.kind) == ("frozen", "reference")
    assert "the base refers to step 1 for this chunk (references are depth 1)" in problem.message
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        quicksave.load(_zeros(expected), folder / "step-5")


def test_verify_finds_own_bytes_left_in_a_referenced_range(run) -> None:
    folder, _ = run
    c = manifest_of(folder / "step-3").tensors["frozen"].chunks[0]
    with open(folder / "step-3" / c.file, "r+b") as f:
        f.seek(c.offset)
        f.write(b"\1")
    report = verify_checkpoint(folder / "step-3")
    assert [p.kind for p in report.problems] == ["padding"]


# ---------------------------------------------------------------------- retention


def test_retention_keeps_a_referenced_step_until_nothing_refers_to_it(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        quicksave.save(_state(step), folder / f"step-{step}", step=step)
    refer(folder / "step-3", 1, FROZEN)
    cache = BaseCache()
    apply_retention(folder, KeepLatestK(1), set(), bases=cache)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-3"]
    quicksave.load(_zeros(_state(3)), folder / "step-3")
    quicksave.save(_state(4), folder / "step-4", step=4)
    apply_retention(folder, KeepLatestK(1), set(), bases=cache)
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]


def test_retention_closes_over_the_references_of_kept_bases(tmp_path: Path) -> None:
    """Step 3 refers to step 2 for ``frozen``, and step 2 to step 1 for ``emb``: with
    only step 3 to keep, step 2 stays (step 3 needs it), and so does step 1 (step 2,
    listed, must stay loadable)."""
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        quicksave.save(_state(9), folder / f"step-{step}", step=step)
    refer(folder / "step-2", 1, ["emb"])
    refer(folder / "step-3", 2, ["frozen"])
    apply_retention(folder, KeepLatestK(1), set())
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2", "step-3"]
    assert verify_checkpoint(folder / "step-2").ok and verify_checkpoint(folder / "step-3").ok


def test_a_kept_manifest_that_cannot_be_read_keeps_every_older_step(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        quicksave.save(_state(step), folder / f"step-{step}", step=step)
    (folder / "step-3" / MANIFEST_NAME).write_bytes(b"{}")
    apply_retention(folder, KeepLatestK(1), set())
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2", "step-3"]


def test_the_manager_keeps_a_referenced_step(tmp_path: Path) -> None:
    """keep_latest_k=2 after step 4: steps 3 and 4 stay, step 3 refers to step 1, so
    step 1 stays too and only step 2 goes; step 3 still loads."""
    _manager_run(tmp_path)
    holder = Holder(_state(3))
    with _manager(tmp_path, holder, keep_latest_k=2) as m:
        assert m.load() == 3
        assert m.save(4, force=True)
        names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
        assert names == ["step-1", "step-3", "step-4"]
        assert m.load(3) == 3
    _assert_all(holder.state, _state(3))


# ------------------------------------------------------------------------ convert


@pytest.mark.parametrize("to", ["quicksave", "dcp"])
def test_convert_writes_a_standalone_copy(run, tmp_path: Path, to: str) -> None:
    folder, expected = run
    out = tmp_path / f"copy-{to}"
    convert(folder / "step-3", out, to)
    shutil.rmtree(folder / "step-1")
    loaded = _zeros(expected)
    if to == "quicksave":
        assert json.loads((out / MANIFEST_NAME).read_bytes())["format_version"] == 1
        quicksave.load(loaded, out)
        assert verify_checkpoint(out).ok
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    _assert_all(loaded, expected)
    with pytest.raises(CheckpointError):
        quicksave.load(_zeros(expected), folder / "step-3")


def test_the_base_cache_reads_a_manifest_once_and_again_when_the_step_is_saved_again(
    run, monkeypatch
) -> None:
    from quicksave.manager import references

    folder, _ = run
    reads: list[str] = []
    real = references.bases_in

    def counting(data, path):
        reads.append(path)
        return real(data, path)

    monkeypatch.setattr(references, "bases_in", counting)
    cache = BaseCache()
    loc = parse_location(folder)
    assert cache.bases(loc, 3, None) == {1}
    assert cache.bases(loc, 3, None) == {1}
    assert cache.bases(loc, 1, None) == frozenset()  # version 1: its first bytes say so
    assert reads == [str(folder / "step-3" / MANIFEST_NAME)]
    shutil.rmtree(folder / "step-3")
    quicksave.save(_state(4), folder / "step-3", step=3)  # saved again, standalone
    assert cache.bases(loc, 3, None) == frozenset()


def test_retention_reads_the_same_bases_as_the_whole_manifest_and_refuses_damage(
    run, tmp_path: Path
) -> None:
    """``bases_in`` (what retention reads of each kept checkpoint) gives what the whole
    parse gives, on manifests with references and without; a damaged manifest, or one
    whose chunks are not what they must be, is refused (retention then keeps every
    older step), never read in part."""
    folder, _ = run
    for step in (1, 3):
        path = folder / f"step-{step}" / MANIFEST_NAME
        data = path.read_bytes()
        assert bases_in(data, str(path)) == read_manifest(folder / f"step-{step}").bases()
    data = (folder / "step-3" / MANIFEST_NAME).read_bytes()
    assert bases_in(data) == {1}
    at = data.index(b'"base":1') + len(b'"base":')
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        bases_in(data[:at] + b"2" + data[at + 1 :])
    doc = json.loads(data)
    fqn = next(f for f, t in doc["tensors"].items() if any("base" in c for c in t["chunks"]))
    for bad in ("1", -1, 2**63):
        broken = json.loads(data)
        next(c for c in broken["tensors"][fqn]["chunks"] if "base" in c)["base"] = bad
        with pytest.raises(CorruptCheckpointError, match="base") as e:
            bases_in(seal_manifest(broken))
        assert e.value.fqn == fqn
    broken = json.loads(data)
    broken["tensors"][fqn]["chunks"] = {"0": 1}
    with pytest.raises(CorruptCheckpointError, match="chunks are malformed"):
        bases_in(seal_manifest(broken))


def test_the_verify_command_reports_a_damaged_base(run, capsys) -> None:
    from quicksave.cli.main import main

    folder, _ = run
    assert main(["verify", str(folder / "step-3")]) == 0
    damage_chunks(folder / "step-1", "frozen")
    assert main(["verify", str(folder / "step-3")]) == 1
    out = capsys.readouterr().out
    assert "../step-1/" in out and "frozen: reference: checksum mismatch" in out
    assert str(folder / "step-1") in out


@pytest.mark.parametrize("stream", [True, False])
def test_a_resume_of_a_partly_frozen_model_streams_from_an_incremental_checkpoint(
    tmp_path: Path, stream: bool
) -> None:
    """A frozen first layer (no gradient, no optimizer state): step 2 refers to step 1
    for everything that did not change; the resume, streamed or not, is bit-exact."""
    from quicksave.manager import ModelState, OptimizerState

    def job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        model[0].requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def train(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()

    def states(model, optim) -> dict:
        return {"model": ModelState(model), "optim": OptimizerState(model, optim)}

    folder = tmp_path / "ckpt"
    model, optim = job(0)
    config = CheckpointConfig(folder=str(folder), async_mode="disabled")
    with CheckpointManager(config, states(model, optim)) as manager:
        for step in (1, 2):
            train(model, optim)
            manager.save(step, force=True)
    same = unchanged(folder / "step-2", 1)
    assert {"model.0.weight", "model.0.bias"} <= set(same)
    refer(folder / "step-2", 1, same)
    loaded, loaded_optim = job(3)
    config = CheckpointConfig(folder=str(folder), async_mode="disabled", stream_load=stream)
    with CheckpointManager(config, states(loaded, loaded_optim)) as manager:
        assert manager.load() == 2
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True):
            assert_bit_equal(a, b)
        train(loaded, loaded_optim)  # waits for the streamed optimizer state
    train(model, optim)
    for a, b in zip(loaded.parameters(), model.parameters(), strict=True):
        assert_bit_equal(a, b)


def test_the_json_schema_knows_references(run) -> None:
    import jsonschema

    from helpers.checks import validate_against_schema

    folder, _ = run
    doc = json.loads((folder / "step-3" / MANIFEST_NAME).read_bytes())
    validate_against_schema(doc)
    validate_against_schema(json.loads((folder / "step-1" / MANIFEST_NAME).read_bytes()))
    for bad in (
        {**doc, "format_version": 1},  # a reference in version 1
        json.loads((folder / "step-1" / MANIFEST_NAME).read_bytes()) | {"format_version": 2},
        {**doc, "layout": "dcp"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate_against_schema(bad)
    doc["tensors"]["frozen"]["chunks"][0]["base"] = "../step-1"
    with pytest.raises(jsonschema.ValidationError):
        validate_against_schema(doc)


def test_a_data_file_of_the_base_need_not_be_listed_or_present_here(tmp_path: Path) -> None:
    """Saved into two data files: the one of step 3 left holding only referenced chunks
    is deleted and no longer listed; its chunks are read from step 1's file."""
    folder = tmp_path / "run"
    quicksave.save(_state(3), folder / "step-1", step=1, thread_count=2)
    quicksave.save(_state(4), folder / "step-3", step=3, thread_count=2)
    files_before = set(manifest_of(folder / "step-3").files)
    m = refer(folder / "step-3", 1, FROZEN, drop_files=True)
    dropped = files_before - set(m.files)
    assert dropped, "the saves are expected to put frozen/emb and head in different files"
    assert any(c.file in dropped for k in FROZEN for c in m.tensors[k].chunks)
    out = _zeros(_state(4))
    quicksave.load(out, folder / "step-3")
    _assert_all(out, _state(4))
    flat, _ = read_flat(parse_location(folder / "step-3"), False)
    assert_bit_equal(flat["frozen"][1], _state(4)["frozen"], "frozen")
    assert verify_checkpoint(folder / "step-3").ok
