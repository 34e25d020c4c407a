"""The typed-JSON codec for non-tensor values: exact round trips, and decoding that never
executes or imports anything named by the file."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch

from helpers.state import assert_same_value
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError
from quicksave.format.objects import decode, encode

VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**64,
    -(2**300),
    1.5,
    -0.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    5e-324,
    "",
    "ünïcödé ☃ \U0001f600",
    "\x00",
    b"",
    b"\xff\x00",
    bytearray(b"ab"),
    io.BytesIO(b"\x00stream"),
    complex(0, -0.0),
    (),
    (1, (2, (3,))),
    [],
    [1, [2.5, [None]]],
    {},
    {"a": 1, 2: "b", None: [3], (1, "t"): {"n": {}}},
    {1, 2, 3},
    frozenset({"a"}),
    torch.Size([]),
    torch.Size([0, 3]),
    torch.float8_e8m0fnu,
    torch.uint3,
    torch.device("cpu"),
    torch.device("cuda", 1),
    torch.device("meta"),
    np.arange(6, dtype=np.uint16).reshape(2, 3).T,
    np.zeros((0, 2)),
    np.array(7.5),
    np.array(["ab", "c"]),
    np.array([1 + 2j], dtype=np.complex64),
    np.array([True]),
    np.float64(-0.0),
    np.float32(1.25),
    np.int8(-3),
    np.uint64(2**63),
    np.bool_(False),
    np.complex128(1 - 1j),
    torch.arange(5, dtype=torch.bfloat16),
    torch.tensor(3),
    torch.ones(0, 2, dtype=torch.complex64),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_roundtrip_through_json_text(value):
    encoded = encode(value, "fqn")
    text = json.dumps(encoded, allow_nan=False)  # strict JSON: no NaN literals
    assert_same_value(decode(json.loads(text)), value)


def test_plain_json_stays_plain():
    assert encode([1, "a", None, 2.5, True]) == [1, "a", None, 2.5, True]
    assert encode(float("nan")) == {"$t": "float", "v": "nan"}
    assert encode(-0.0) == -0.0 and math.copysign(1, encode(-0.0)) == -1


def test_dict_key_order_is_kept():
    value = {"b": 1, "a": 2, 3: 4}
    assert list(decode(encode(value))) == ["b", "a", 3]


def test_set_encoding_is_deterministic():
    assert encode({3, 1, 2}) == encode({2, 3, 1})


def test_namedtuple_and_custom_types_are_refused():
    from collections import namedtuple

    point = namedtuple("Point", "x y")
    with pytest.raises(IncompatibleStateError) as info:
        encode({"p": point(1, 2)}, "state")
    assert info.value.fqn == "state.p"
    assert "test_objects.Point cannot be stored without pickle" in info.value.message


def test_object_ndarray_is_refused():
    with pytest.raises(IncompatibleStateError) as info:
        encode([np.array([None], dtype=object)], "x")
    assert info.value.message == "numpy object arrays cannot be stored without pickle"
    assert info.value.fqn == "x[0]"


@pytest.mark.parametrize(
    "payload",
    [
        {"$t": "pickle", "v": "gASVAAAAAAAAAAA="},
        {"$t": "object", "module": "os", "name": "system", "args": ["true"]},
        {"no_tag": 1},
        {"$t": 5},
        {"$t": "float", "v": "1e999"},
        {"$t": "float", "v": "__import__('os')"},
        {"$t": "bytes", "v": "not base64!"},
        {"$t": "ndarray", "dtype": "|O", "shape": [1], "v": "AAAAAAAAAAA="},
        {"$t": "ndarray", "dtype": "<f8", "shape": [3], "v": "AAAAAAAAAAA="},
        {"$t": "npscalar", "dtype": "|O", "v": "AAAAAAAAAAA="},
        {"$t": "tensor", "dtype": "float32", "shape": [2], "v": "AAAA"},
        {"$t": "size", "v": ["x"]},
        {"$t": "device", "v": "not-a-device"},
        {"$t": "tuple"},
        [1, {"$t": "nope"}],
    ],
    ids=lambda p: json.dumps(p)[:40],
)
def test_decode_rejects_anything_else(payload):
    with pytest.raises(CorruptCheckpointError) as info:
        decode(payload, fqn="opt.state", path="/ckpt/manifest.json")
    err = info.value
    assert err.message.startswith("cannot decode stored object: ")
    assert (err.fqn, err.path) == ("opt.state", "/ckpt/manifest.json")


@pytest.mark.parametrize("name", ["Tensor", "__class__", "load", "float99"])
def test_decode_rejects_unknown_dtype_names(name: str):
    as_tensor = {"$t": "tensor", "dtype": name, "shape": [0], "v": ""}
    for payload in ({"$t": "dtype", "v": name}, [as_tensor]):
        with pytest.raises(IncompatibleStateError) as info:
            decode(payload, fqn="x", path="/ckpt/manifest.json")
        assert info.value.message == (
            f"unknown dtype {name!r} in checkpoint (written by a newer torch?)"
        )
        assert (info.value.fqn, info.value.path) == ("x", "/ckpt/manifest.json")


def test_decode_never_imports_or_calls(monkeypatch):
    import builtins

    real_import = builtins.__import__
    calls = []

    def spy(name, *args, **kwargs):
        calls.append(name)
        return real_import(name, *args, **kwargs)

    payload = encode({"a": (1, b"x", {2}), "n": np.arange(3), "t": torch.ones(2)})
    monkeypatch.setattr(builtins, "__import__", spy)
    decode(payload)
    decode_fails = {"$t": "object", "module": "subprocess", "name": "run"}
    with pytest.raises(CorruptCheckpointError):
        decode(decode_fails)
    assert "subprocess" not in calls and "os" not in calls
