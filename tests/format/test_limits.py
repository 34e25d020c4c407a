"""The limits a reader enforces on what a checkpoint says (FORMAT.md §2–4): JSON that
Python's parser chokes on, integers out of range, sizes that would allocate before
anything is checked, dtype names that would import code. Every case is a
CorruptCheckpointError (or IncompatibleStateError for a dtype this torch lacks), and a
writer refuses to write what a reader would refuse."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import quicksave
from helpers.checks import golden_manifest_doc, manifest_parse_error, seal_manifest
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError
from quicksave.format import strict_json
from quicksave.format.dtype_names import ELEMENT_SIZES
from quicksave.format.dtypes import dtype_from_name, dtype_name, known_dtype
from quicksave.format.manifest import to_json_bytes
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.format.objects import MAX_VALUE_DEPTH, decode, encode
from quicksave.format.safetensors_header import (
    ExpectedChunk,
    header_length,
    mismatches,
    parse_header,
)

FIXTURE = Path(__file__).parent / "fixtures" / "manifest_v1.json"
DATA = "rank-00000-00.safetensors"  # holds model.linear.weight in the fixture


def _doc() -> dict:
    return golden_manifest_doc()


def _error(data: bytes) -> str:
    return manifest_parse_error(data, "/c/manifest.json").message


def _text_error(old: bytes, new: bytes) -> str:
    from helpers.checks import reseal

    data = FIXTURE.read_bytes()
    assert old in data
    return _error(reseal(data.replace(old, new, 1)))


# ----------------------------------------------------------------------- strict JSON


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (b'"user_metadata":{', b'"user_metadata":{"d":' + b"[" * 50_000 + b"]" * 50_000 + b",",
         "manifest nests deeper than 100 levels"),
        (b'"user_metadata":{', b'"user_metadata":{"d":' + b"[" * 120 + b"]" * 120 + b",",
         "manifest: user_metadata nests deeper than 100 levels"),
        (b'"step":3', b'"step":' + b"1" * 5000,
         "manifest is not valid JSON: integer literal longer than 256 digits"),
        (b'"step":3', b'"step":-' + b"1" * 257,
         "manifest is not valid JSON: integer literal longer than 256 digits"),
        (b'"user_metadata":{', b'"user_metadata":{"x":NaN,',
         "manifest is not valid JSON: NaN is not valid JSON"),
        (b'"user_metadata":{', b'"user_metadata":{"x":-Infinity,',
         "manifest is not valid JSON: -Infinity is not valid JSON"),
        (b'"user_metadata":{', b'"user_metadata":{"x":1e400,',
         "manifest is not valid JSON: number '1e400' does not fit a float"),
    ],
    ids=["deep", "deep-user-metadata", "long-int", "long-negative-int", "nan", "-inf", "1e400"],
)  # fmt: skip
def test_json_limits(old: bytes, new: bytes, message: str) -> None:
    assert _text_error(old, new) == message


def test_long_digit_runs_inside_strings_are_fine() -> None:
    doc = _doc()
    doc["user_metadata"]["digits"] = "7" * 1000
    doc["user_metadata"]["big"] = 10**255
    m = from_json_bytes(seal_manifest(doc))
    assert m.user_metadata["digits"] == "7" * 1000 and m.user_metadata["big"] == 10**255


def test_unwritable() -> None:
    nested: list = []
    for _ in range(200):
        nested = [nested]
    loop: list = []
    loop.append(loop)
    assert strict_json.unwritable({"a": [1, "x", None, 2.5]}) is None
    assert strict_json.unwritable(nested) == "nests deeper than 100 levels (or contains itself)"
    assert strict_json.unwritable(loop) == "nests deeper than 100 levels (or contains itself)"
    assert strict_json.unwritable({"n": 10**300}) == "an integer has more than 256 digits"
    assert strict_json.unwritable([float("inf")]) == "NaN and infinite floats are not JSON"


def test_writer_refuses_user_metadata_readers_refuse() -> None:
    m = from_json_bytes(FIXTURE.read_bytes())
    deep: list = []
    for _ in range(120):
        deep = [deep]
    for bad in (float("nan"), 10**400, deep):
        with pytest.raises(IncompatibleStateError, match="user_metadata cannot be stored"):
            to_json_bytes(dataclasses.replace(m, user_metadata={"x": bad}))


# ------------------------------------------------------------------- field ranges


def _chunk(d: dict, fqn: str = "model.linear.weight") -> dict:
    return d["tensors"][fqn]["chunks"][0]


W = "manifest: tensors['model.linear.weight']"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(step=-1), "manifest: step must be null or an integer in [0, 2**63)"),
        (lambda d: d.update(step=2**63), "manifest: step must be null or an integer in [0, 2**63)"),
        (lambda d: d.update(world_size=0),
         "manifest: manifest.world_size must be an integer in [1, 2**63)"),
        (lambda d: d["files"][DATA].update(size=-1),
         f"manifest: files['{DATA}'].size must be an integer in [0, 2**63)"),
        (lambda d: d["files"][DATA].update(size=2**63),
         f"manifest: files['{DATA}'].size must be an integer in [0, 2**63)"),
        (lambda d: d["files"][DATA].update(rank=1),
         f"manifest: files['{DATA}'].rank 1 is not below world_size 1"),
        (lambda d: d["files"][DATA].update(data_start=4097),
         f"manifest: files['{DATA}'].data_start 4097 must be a multiple of 4096 within the "
         "file's size 4144"),
        (lambda d: d["files"][DATA].pop("data_start"),
         f"manifest: files['{DATA}'] lacks 'data_start'"),
        (lambda d: d["files"][DATA].update(xxh3_64="\x1b[2J" + "0" * 12),
         f"manifest: files['{DATA}'].xxh3_64 must be 16 lowercase hex digits"),
        (lambda d: d["files"].update({"manifest.json": {"size": 1, "xxh3_64": "0" * 16}}),
         "manifest: bad file name 'manifest.json'"),
        (lambda d: d["files"].update({"a\x00b": {"size": 1, "xxh3_64": "0" * 16}}),
         "manifest: bad file name 'a\\x00b'"),
        (lambda d: _chunk(d).update(offset=-4096),
         f"{W}.chunks[0].offset must be an integer in [0, 2**63)"),
        (lambda d: _chunk(d).update(offset=0),
         f"{W}.chunks[0].offset 0 must be a multiple of 4096 at or after the data region of "
         f"'{DATA}' (byte 4096)"),
        (lambda d: _chunk(d).update(offset=4100),
         f"{W}.chunks[0].offset 4100 must be a multiple of 4096 at or after the data region of "
         f"'{DATA}' (byte 4096)"),
        (lambda d: _chunk(d).update(length=44),
         f"{W}.chunks[0].length is 44, but sizes [3, 4] of 4-byte elements need 48"),
        (lambda d: _chunk(d).update(file=".metadata"),
         f"{W}.chunks[0] is stored in '.metadata', which is not a data file"),
        (lambda d: _chunk(d).update(sizes=[3, 2**63]), f"{W}.chunks[0].sizes must be a list of "
         "integers in [0, 2**63)"),
        (lambda d: d["tensors"]["model.linear.weight"].update(shape=[2**62, 4]),
         f"{W}.shape [4611686018427387904, 4] holds 2**63 bytes or more"),
        (lambda d: d["tensors"]["model.linear.weight"].update(dtype="Float32"),
         f"{W}.dtype 'Float32' is not a dtype name"),
        (lambda d: d["tensors"]["model.linear.weight"].update(path=[{"k": 1}]),
         f"{W}.path must be a non-empty list of strings and integers ≥ 0"),
        (lambda d: d["objects"]["train.lr"].update(path=[]),
         "manifest: objects['train.lr'].path must be a non-empty list of strings and integers ≥ 0"),
        (lambda d: d.update(user_metadata=[1]), "manifest: user_metadata must be an object"),
    ],
    ids=[
        "step-negative", "step-2**63", "world-size-0", "size-negative", "size-2**63",
        "rank-too-big", "data-start-unaligned", "rank-without-data-start", "digest",
        "manifest-listed",
        "nul-name", "offset-negative", "offset-in-header", "offset-unaligned", "length",
        "chunk-in-metadata", "sizes-2**63", "huge-shape", "dtype-pattern", "tensor-path",
        "object-path", "user-metadata-list",
    ],
)  # fmt: skip
def test_field_ranges(mutate, message: str) -> None:
    doc = _doc()
    mutate(doc)
    assert _error(seal_manifest(doc)) == message


def test_unknown_dtype_parses_and_fails_on_use() -> None:
    """A dtype name this torch lacks (a newer torch's) is not corruption of the manifest:
    it parses (inspect and ls still work) and fails when the tensor is needed."""
    doc = _doc()
    doc["tensors"]["model.linear.weight"]["dtype"] = "_dynamo"
    _chunk(doc)["length"] = 12345  # the length cannot be checked without an element size
    m = from_json_bytes(seal_manifest(doc))
    with pytest.raises(IncompatibleStateError, match="unknown dtype '_dynamo'") as info:
        dtype_from_name(m.tensors["model.linear.weight"].dtype, path="/c", fqn="x")
    assert (info.value.path, info.value.fqn) == ("/c", "x")


# ---------------------------------------------------------------------------- dtypes


def test_dtype_table_is_every_torch_dtype_by_canonical_name() -> None:
    torch_dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    table = {known_dtype(n) for n in ELEMENT_SIZES} - {None}
    assert table == torch_dtypes, "a torch dtype is missing from format/dtype_names.py"
    for name, size in ELEMENT_SIZES.items():
        dtype = known_dtype(name)
        assert dtype is None or (dtype_name(dtype), dtype.itemsize) == (name, size)


@pytest.mark.parametrize("name", ["_dynamo", "float", "half", "Tensor", "nn", "__class__", 3])
def test_names_outside_the_table_are_unknown(name) -> None:
    assert known_dtype(name) is None


# --------------------------------------------------------------------- typed objects


def _decode_error(value) -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        decode(value, fqn="o", path="/c/manifest.json")
    assert (info.value.fqn, info.value.path) == ("o", "/c/manifest.json")
    return info.value.message.removeprefix("cannot decode stored object: ")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"$t": "tensor", "dtype": "float32", "shape": [2**30], "v": ""},
         "tensor declares 1073741824 elements of 4 bytes but holds 0 base64 characters"),
        ({"$t": "tensor", "dtype": "float32", "shape": [-1], "v": ""},
         "shape must be a list of integers in [0, 2**63)"),
        ({"$t": "tensor", "dtype": "float32", "shape": [1] * 65, "v": "AAAAAA=="},
         "shape has more than 64 dimensions"),
        ({"$t": "tensor", "dtype": "float32", "shape": [2**62, 2**62], "v": ""},
         "tensor declares 21267647932558653966460912964485513216 elements of 4 bytes but "
         "holds 0 base64 characters"),
        ({"$t": "ndarray", "dtype": "<f8", "shape": [2**40], "v": ""},
         "ndarray declares 1099511627776 elements of 8 bytes but holds 0 base64 characters"),
        ({"$t": "npscalar", "dtype": "<f8", "v": ""},
         "npscalar declares 1 elements of 8 bytes but holds 0 base64 characters"),
        ({"$t": "ndarray", "dtype": "|O", "shape": [1], "v": "AAAAAAAAAAA="},
         "numpy dtype '|O' is not allowed"),
        ({"$t": "ndarray", "dtype": "O,i4", "shape": [1], "v": "AAAAAAAAAAA="},
         "numpy dtype 'O,i4' is not allowed"),
        ({"$t": "ndarray", "dtype": "|V8", "shape": [1], "v": "AAAAAAAAAAA="},
         "numpy dtype '|V8' is not allowed"),
        ({"$t": "npscalar", "dtype": "<M8[s]", "v": "AAAAAAAAAAA="},
         "numpy dtype '<M8[s]' is not allowed"),
        ({"$t": "dict", "v": ["ab"]}, "dict items must be [key, value] pairs"),
        ({"$t": "complex", "v": ["1j", 0]}, "complex parts must be numbers"),
        ({"$t": "device", "v": "cuda:0; rm -rf"}, "bad device 'cuda:0; rm -rf'"),
        ({"$t": "bytes", "v": 5}, "payload must be a base64 string"),
        ({"$t": "size", "v": [2**63]}, "size must be a list of integers in [0, 2**63)"),
        (10**300, "integer with more than 256 digits"),
    ],
    ids=[
        "tensor-4GiB", "tensor-negative", "tensor-ndim", "tensor-overflow", "ndarray-8TiB",
        "npscalar-empty", "ndarray-object", "ndarray-structured", "ndarray-void",
        "npscalar-datetime", "dict-pairs", "complex-strings", "device", "bytes-type", "size",
        "big-int",
    ],
)  # fmt: skip
def test_objects_are_checked_before_allocating(value, message: str) -> None:
    assert _decode_error(value) == message


def test_object_nesting_is_bounded_both_ways() -> None:
    ok: object = 1
    for _ in range(MAX_VALUE_DEPTH // 2 - 1):  # tuples take two JSON levels each
        ok = (ok,)
    assert decode(json.loads(json.dumps(encode(ok)))) == ok
    too_deep = {"$t": "tuple", "v": [{"$t": "tuple", "v": []}]}
    for _ in range(200):
        too_deep = {"$t": "tuple", "v": [too_deep]}
    assert _decode_error(too_deep) == f"value nests deeper than {MAX_VALUE_DEPTH} levels"
    nested: list = []
    for _ in range(MAX_VALUE_DEPTH + 1):
        nested = [nested]
    loop: list = []
    loop.append(loop)
    for bad in (nested, loop):
        with pytest.raises(IncompatibleStateError, match="nests deeper than 96 levels") as info:
            encode({"k": bad}, "opt")
        assert info.value.fqn.startswith("opt.k")


@pytest.mark.parametrize(
    "value",
    [10**256, -(10**256), np.array(["2020-01-01"], dtype="datetime64[D]"), np.datetime64(1, "s")],
    ids=["int", "negative-int", "datetime-array", "datetime-scalar"],
)
def test_writer_refuses_objects_readers_refuse(value) -> None:
    with pytest.raises(IncompatibleStateError) as info:
        encode(value, "x")
    assert info.value.fqn == "x"


def test_save_refuses_them_naming_the_fqn(tmp_path: Path) -> None:
    with pytest.raises(IncompatibleStateError) as info:
        quicksave.save({"w": torch.ones(1), "seed": 10**300}, tmp_path / "c")
    assert info.value.fqn == "seed" and "more than 256 digits" in info.value.message


# ------------------------------------------------------------ safetensors headers


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[bytes, list[ExpectedChunk]]:
    """A real data file holding an F32 tensor and a complex128 one (stored as U8), and
    what the manifest says of its chunks."""
    state = {"w": torch.arange(6, dtype=torch.float32), "c": torch.ones(2).to(torch.complex128)}
    quicksave.save(state, tmp_path / "c", thread_count=1)
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    by_file: dict[str, list[ExpectedChunk]] = {}
    for fqn, code in (("w", "F32"), ("c", "U8")):
        ch = doc["tensors"][fqn]["chunks"][0]
        by_file.setdefault(ch["file"], []).append(
            ExpectedChunk(fqn, fqn, ch["offset"], ch["length"], code)
        )
    name, expected = max(by_file.items(), key=lambda kv: len(kv[1]))
    return (tmp_path / "c" / name).read_bytes(), expected


def test_header_of_a_real_file_parses_and_matches(data_file) -> None:
    raw, expected = data_file
    n = header_length(raw[:8], len(raw), "/f")
    metadata, entries = parse_header(raw[8 : 8 + n], len(raw), "/f")
    assert metadata == {"format": "quicksave", "format_version": "1", "rank": "0"}
    assert mismatches(metadata, entries, 0, expected) == []
    first = expected[0]
    entry = next(e for e in entries if e.name == first.key)
    moved = [ExpectedChunk(first.key, first.fqn, 4096 * 9, first.length, first.dtype)]
    unknown = [(None, f"header entry {c.key!r} is not in the manifest") for c in expected[1:]]
    assert mismatches(metadata, entries, 1, moved) == [
        (None, "__metadata__ is {'format': 'quicksave', 'format_version': '1', 'rank': '0'}, "
         "expected {'format': 'quicksave', 'format_version': '1', 'rank': '1'}"),
        (first.fqn, f"header entry {first.key!r} is {first.dtype} at bytes {entry.start}.."
         f"{entry.end}; the manifest says {first.dtype} at 36864..{36864 + first.length}"),
    ] + unknown  # fmt: skip


def _header_error(text: bytes, size: int) -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        parse_header(text, size, "/f")
    assert info.value.path == "/f"
    return info.value.message.removeprefix("safetensors header: ")


def test_header_length_is_bounded_by_the_file() -> None:
    with pytest.raises(CorruptCheckpointError, match="claims 1099511627776 bytes, but the file"):
        header_length(struct.pack("<Q", 2**40), 8192, "/f")
    with pytest.raises(CorruptCheckpointError, match="fewer than the 8-byte header length"):
        header_length(b"\x01", 1, "/f")


@pytest.mark.parametrize(
    ("entries", "size", "message"),
    [
        ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, 4,
         "entry 'a' has unknown dtype 'F99'"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2**40]}}, 4,
         "entry 'a': data_offsets [0, 1099511627776] do not lie inside the data region"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4,
         "entry 'a': data_offsets [0, 4] hold 4 bytes, its shape [2] of F32 needs 8"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4,
         "entry 'a': shape and data_offsets must be integers ≥ 0"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, 4,
         "a hole in the data region"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
          "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, 4,
         "an overlap in the data region"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, 4,
         "the entries end at byte"),
        ({"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": 1}}, 0,
         "entry 'a' must have exactly dtype, shape and data_offsets"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__ must map strings to strings"),
    ],
    ids=["dtype", "beyond", "shape-bytes", "negative", "hole", "overlap", "short", "extra", "meta"],
)  # fmt: skip
def test_bad_headers(entries: dict, size: int, message: str) -> None:
    text = json.dumps(entries).encode()
    assert message in _header_error(text, 8 + len(text) + size)


def test_header_json_limits() -> None:
    deep = b'{"__metadata__":{"a":"b"},"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert _header_error(deep, 10**6) == "safetensors header nests deeper than 100 levels"
    assert "not UTF-8" in _header_error(b'{"\xff":1}', 100)
