"""The manifest: byte-exact golden file, JSON Schema, and rejection of bad manifests.

The golden file ``fixtures/manifest_v1.json`` pins format v1's bytes. If a change to
quicksave alters it, that is a format change: bump ``format_version`` (or prove the
change is harmless) before regenerating it with::

    .venv/bin/python -c "import sys; sys.path[:0] = ['tests', 'tests/format']; \
import test_manifest; test_manifest.regenerate_fixture()"

It embeds the digest of ``.metadata`` (a pickle of torch's DCP ``Metadata``), so a torch
upgrade that changes that class also changes the golden bytes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import torch

import quicksave
from helpers.checks import (
    SCHEMA_PATH,
    check_checkpoint,
    golden_manifest_doc,
    load_schema,
    manifest_parse_error,
    reseal,
    seal_manifest,
    validate_against_schema,
)
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CorruptCheckpointError
from quicksave.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    to_json_bytes,
)
from quicksave.format.manifest_parse import from_json_bytes

FIXTURE = Path(__file__).parent / "fixtures" / "manifest_v1.json"


def fixture_state() -> dict:
    """A small, fully deterministic state dict (fixed values, no randomness)."""
    return {
        "model": {
            "linear": {
                "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8,
                "bias": torch.tensor([-1.5, 0.0, 2.25], dtype=torch.bfloat16),
            },
            "mask": torch.tensor([True, False, True, True]),
        },
        "counter": torch.tensor(7, dtype=torch.int64),
        "half": torch.full((2, 2), 0.5, dtype=torch.float16),
        "train": {"epoch": 2, "name": "run-α", "lr": 0.001, "betas": (0.9, 0.999)},
        "extra": {"blob": b"\x00\x01quicksave", "none": None, "nan": float("nan")},
    }


def _write_fixture_checkpoint(path: Path) -> None:
    quicksave.save(fixture_state(), path, step=3, user_metadata={"run": "fixture", "n": 1})


def regenerate_fixture(tmp: str = "/tmp/quicksave-manifest-fixture") -> None:
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    _write_fixture_checkpoint(Path(tmp) / "ckpt")
    FIXTURE.write_bytes((Path(tmp) / "ckpt" / "manifest.json").read_bytes())
    shutil.rmtree(tmp)


@pytest.fixture
def saved(ckpt: Path) -> Path:
    _write_fixture_checkpoint(ckpt)
    return ckpt


def test_manifest_matches_golden_bytes(saved: Path):
    actual = (saved / "manifest.json").read_bytes()
    expected = FIXTURE.read_bytes()
    assert actual == expected, "manifest v1 bytes changed: see the module docstring"


def test_manifest_bytes_do_not_depend_on_path_or_run(tmp_path: Path):
    a, b = tmp_path / "a" / "one", tmp_path / "b" / "two"
    _write_fixture_checkpoint(a)
    _write_fixture_checkpoint(b)
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()


def test_golden_manifest_content():
    doc = json.loads(FIXTURE.read_bytes())
    assert list(doc) == [
        "format",
        "format_version",
        "step",
        "world_size",
        "tensors",
        "objects",
        "files",
        "user_metadata",
        "manifest_xxh3_64",
    ]
    assert (doc["format"], doc["format_version"], doc["step"], doc["world_size"]) == (
        "quicksave",
        1,
        3,
        1,
    )
    assert sorted(doc["tensors"]) == [
        "counter",
        "half",
        "model.linear.bias",
        "model.linear.weight",
        "model.mask",
    ]
    weight = doc["tensors"]["model.linear.weight"]
    assert weight["dtype"] == "float32" and weight["shape"] == [3, 4]
    assert weight["path"] == ["model", "linear", "weight"]
    assert weight["chunks"][0]["length"] == 48
    assert doc["tensors"]["counter"]["shape"] == [] and "path" not in doc["tensors"]["counter"]
    assert doc["objects"]["train.betas"] == {
        "value": {"$t": "tuple", "v": [0.9, 0.999]},
        "path": ["train", "betas"],
    }
    assert doc["objects"]["train.name"]["value"] == "run-\u03b1"
    assert doc["objects"]["extra.nan"]["value"] == {"$t": "float", "v": "nan"}
    assert doc["user_metadata"] == {"run": "fixture", "n": 1}
    assert ".metadata" in doc["files"] and "rank" not in doc["files"][".metadata"]
    data_files = [n for n, f in doc["files"].items() if "rank" in f]
    assert data_files and all(n.startswith("rank-00000-") for n in data_files)
    assert FIXTURE.read_bytes().isascii() and FIXTURE.read_bytes().endswith(b'"}\n')


def test_golden_checkpoint_is_consistent(saved: Path):
    check_checkpoint(saved)
    dest = {
        "model": {
            "linear": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3, dtype=torch.bfloat16)},
            "mask": torch.zeros(4, dtype=torch.bool),
        },
        "counter": torch.tensor(0),
        "half": torch.zeros(2, 2, dtype=torch.float16),
        "train": {"epoch": 0, "name": "", "lr": 0.0, "betas": ()},
        "extra": {"blob": b"", "none": 1, "nan": 0.0},
    }
    quicksave.load(dest, saved)
    expected = fixture_state()
    assert torch.equal(dest["model"]["linear"]["weight"], expected["model"]["linear"]["weight"])
    assert dest["train"] == expected["train"]
    assert dest["extra"]["blob"] == b"\x00\x01quicksave" and dest["extra"]["none"] is None


# ----------------------------------------------------------------------- JSON Schema


def test_schema_file_exists_and_is_a_valid_schema():
    assert SCHEMA_PATH.exists(), f"missing {SCHEMA_PATH}"
    jsonschema.Draft202012Validator.check_schema(load_schema())


def test_golden_manifest_validates_against_schema():
    validate_against_schema(json.loads(FIXTURE.read_bytes()))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(extra_member=1),
        lambda d: d.update(format_version=2),
        lambda d: d.update(world_size=0),
        lambda d: d["tensors"]["counter"]["chunks"][0].update(offset=100),
        lambda d: d["tensors"]["counter"]["chunks"][0].update(xxh3_64="XYZ"),
        lambda d: d["files"].update({"a/b": {"size": 1, "xxh3_64": "0" * 16}}),
        lambda d: d["objects"]["train.epoch"].update(value={"$t": "pickle", "v": ""}),
        lambda d: d["tensors"]["counter"].pop("chunks"),
        lambda d: d.update(step=-1),
        lambda d: d["tensors"]["counter"]["chunks"][0].update(length=2**63),
        lambda d: d["files"].update({"..": {"size": 1, "xxh3_64": "0" * 16}}),
        lambda d: d["files"].update({"a\x00": {"size": 1, "xxh3_64": "0" * 16}}),
        lambda d: d["tensors"]["counter"].update(dtype="\x1b[2J"),
        lambda d: d["objects"]["train.epoch"].update(
            value={"$t": "ndarray", "dtype": "|O", "shape": [1], "v": ""}
        ),
        lambda d: d["objects"]["train.epoch"].update(value={"$t": "tensor", "dtype": "float32"}),
    ],
    ids=[
        "extra-member",
        "version",
        "world-size",
        "unaligned",
        "digest",
        "file-name",
        "object-tag",
        "no-chunks",
        "negative-step",
        "length-2**63",
        "dotdot",
        "nul",
        "dtype-escape",
        "ndarray-object",
        "tensor-no-shape",
    ],
)
def test_schema_rejects_bad_manifests(mutate):
    doc = json.loads(FIXTURE.read_bytes())
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_against_schema(doc)


# ------------------------------------------------------------------ dataclass <-> JSON


def _manifest() -> Manifest:
    chunk = ChunkEntry((0, 2), (4, 2), "rank-00000-00.safetensors", 8192, 32, "0123456789abcdef")
    return Manifest(
        step=12,
        world_size=2,
        tensors={"w": TensorEntry("float32", (4, 4), (chunk,), ("m", "w"))},
        objects={"o": ObjectEntry({"$t": "tuple", "v": [1, 2]}), "z": ObjectEntry(None, ("z",))},
        files={
            "rank-00000-00.safetensors": FileEntry(12288, "fedcba9876543210", 0, 4096),
            ".metadata": FileEntry(10, "00000000000000ff"),
        },
        user_metadata={"k": [1, "v"]},
    )


def test_dataclass_roundtrip_and_determinism():
    m = _manifest()
    data = to_json_bytes(m)
    assert from_json_bytes(data) == m
    shuffled = Manifest(
        step=m.step,
        world_size=m.world_size,
        tensors=m.tensors,
        objects=dict(reversed(list(m.objects.items()))),
        files=dict(reversed(list(m.files.items()))),
        user_metadata=m.user_metadata,
    )
    assert to_json_bytes(shuffled) == data  # insertion order does not matter
    validate_against_schema(json.loads(data))


# --------------------------------------------------------------------------- rejects


def _golden_doc() -> dict:
    return golden_manifest_doc()


def _parse_error(data: bytes) -> CorruptCheckpointError:
    return manifest_parse_error(data)


def test_rejects_changed_byte():
    data = bytearray(FIXTURE.read_bytes())
    pos = data.index(b'"step":3') + len(b'"step":')
    data[pos] = ord("4")
    err = _parse_error(bytes(data))
    assert "manifest checksum mismatch" in err.message
    assert "the manifest was modified or damaged" in err.message


def test_rejects_changed_checksum():
    data = FIXTURE.read_bytes()
    pos = data.rindex(b'"manifest_xxh3_64":"') + len('"manifest_xxh3_64":"')
    flipped = data[:pos] + (b"0" if data[pos : pos + 1] != b"0" else b"1") + data[pos + 1 :]
    assert "manifest checksum mismatch" in _parse_error(flipped).message


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_rejects_truncated(keep: float):
    data = FIXTURE.read_bytes()
    err = _parse_error(data[: int(len(data) * keep)])
    assert err.message in ("manifest has no manifest_xxh3_64 checksum",) or err.message.startswith(
        "manifest checksum mismatch"
    )


def test_rejects_invalid_json_with_valid_checksum():
    data = FIXTURE.read_bytes()
    broken = reseal(data.replace(b'"tensors":{', b'"tensors":{{', 1))
    assert _parse_error(broken).message.startswith("manifest is not valid JSON: ")
    non_ascii = reseal(data.replace(b'"format":"quicksave"', b'"format":"quicks\xc3\xa4ve"'))
    assert _parse_error(non_ascii).message.startswith("manifest is not valid JSON: ")


def test_rejects_other_format_version():
    doc = _golden_doc()
    doc["format_version"] = 3
    err = _parse_error(seal_manifest(doc))
    assert err.message == (
        "manifest format_version 3 is not supported by this quicksave (reads versions 1 "
        "and 2); upgrade quicksave"
    )


def test_version_2_needs_a_chunk_reference():
    doc = _golden_doc()
    doc["format_version"] = 2
    err = _parse_error(seal_manifest(doc))
    assert err.message == "manifest: format_version 2 must be 1: no chunk has a base"


def test_rejects_other_format_name():
    doc = _golden_doc()
    doc["format"] = "safetensors"
    assert _parse_error(seal_manifest(doc)).message == "not a quicksave manifest"


def test_rejects_chunk_outside_shape():
    doc = _golden_doc()
    doc["tensors"]["model.linear.weight"]["chunks"][0]["offsets"] = [1, 0]
    err = _parse_error(seal_manifest(doc))
    assert err.message == (
        "manifest: tensors['model.linear.weight'].chunks[0] lies outside shape [3, 4]"
    )
    assert err.fqn == "model.linear.weight"


def test_rejects_chunk_rank_mismatch():
    doc = _golden_doc()
    doc["tensors"]["half"]["chunks"][0]["sizes"] = [2]
    err = _parse_error(seal_manifest(doc))
    assert err.message == "manifest: tensors['half'].chunks[0] lies outside shape [2, 2]"


def test_rejects_unknown_file_reference():
    doc = _golden_doc()
    doc["tensors"]["counter"]["chunks"][0]["file"] = "rank-00009-00.safetensors"
    err = _parse_error(seal_manifest(doc))
    assert err.message == (
        "manifest: tensors['counter'].chunks[0] names unknown file 'rank-00009-00.safetensors'"
    )
    assert err.fqn == "counter"


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".", ".."])
def test_rejects_file_names_leaving_the_directory(name: str):
    doc = _golden_doc()
    doc["files"][name] = {"size": 0, "xxh3_64": "0" * 16}
    assert _parse_error(seal_manifest(doc)).message == f"manifest: bad file name {name!r}"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("world_size"), "manifest: manifest lacks 'world_size'"),
        (lambda d: d.update(world_size="1"), "manifest: manifest.world_size has the wrong type"),
        (lambda d: d.update(step=True), "manifest: step must be null or an integer in [0, 2**63)"),
        (lambda d: d.update(tensors=[]), "manifest: manifest.tensors has the wrong type"),
        (
            lambda d: d["tensors"]["half"].update(shape=[2, -2]),
            "manifest: tensors['half'].shape must be a list of integers in [0, 2**63)",
        ),
        (
            lambda d: d["tensors"]["half"]["chunks"][0].pop("xxh3_64"),
            "manifest: tensors['half'].chunks[0] lacks 'xxh3_64'",
        ),
        (
            lambda d: d["files"][".metadata"].update(size=1.5),
            "manifest: files['.metadata'].size has the wrong type",
        ),
        (
            lambda d: d["objects"].update({"x": {"val": 1}}),
            "manifest: objects['x'] lacks 'value'",
        ),
    ],
    ids=[
        "missing",
        "type",
        "step-bool",
        "tensors-list",
        "negative",
        "chunk-key",
        "size-float",
        "object",
    ],
)
def test_rejects_malformed_members(mutate, message: str):
    doc = _golden_doc()
    mutate(doc)
    assert _parse_error(seal_manifest(doc)).message == message


def test_rejects_oversized_manifest(monkeypatch):
    from quicksave.format import manifest_parse as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 100)
    assert _parse_error(FIXTURE.read_bytes()).message == "manifest larger than 1 GiB"


def test_read_manifest_errors_name_the_file(tmp_path: Path):
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(tmp_path)
    assert info.value.message == "manifest.json is missing"
    assert info.value.path == str(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_bytes(FIXTURE.read_bytes())
    assert read_manifest(tmp_path).step == 3


def test_load_rejects_a_tampered_manifest(saved: Path):
    doc = json.loads((saved / "manifest.json").read_bytes())
    bad = copy.deepcopy(doc)
    bad["format_version"] = 7
    (saved / "manifest.json").write_bytes(seal_manifest(bad))
    with pytest.raises(CorruptCheckpointError) as info:
        quicksave.load({"counter": torch.tensor(0)}, saved, strict=False)
    assert "upgrade quicksave" in str(info.value)
    assert f"path={saved / 'manifest.json'}" in str(info.value)
