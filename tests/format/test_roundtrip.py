"""Round trips through quicksave.save / quicksave.load: every dtype, every layout, every
kind of non-tensor value, bit for bit; and the data files are valid safetensors."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import quicksave
from helpers.checks import check_checkpoint
from helpers.state import (
    assert_bit_equal,
    assert_same_value,
    filler_like,
    placeholder_like,
    quantized_dtypes,
    random_tensor,
    raw,
    storable_dtypes,
)
from helpers.state import (
    storable_dtypes as _dtypes,
)

DTYPES = _dtypes()


def _roundtrip(sd: dict, dest: dict, path: Path, **load_kwargs) -> dict:
    quicksave.save(sd, path)
    doc = check_checkpoint(path)
    quicksave.load(dest, path, **load_kwargs)
    return doc


def test_dtype_list_is_complete():
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    expected = (
        {
            "float64",
            "float32",
            "float16",
            "bfloat16",
            "complex32",
            "complex64",
            "complex128",
            "bool",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "float4_e2m1fn_x2",
            "bits8",
            "bits16",
            "bits1x8",
            "bits2x4",
            "bits4x2",
        }
        | {f"uint{i}" for i in range(1, 8)}
        | {f"int{i}" for i in range(1, 8)}
    )
    assert expected <= names
    assert not names & {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_bit_exact(dtype: torch.dtype, ckpt: Path):
    sd = {
        "matrix": random_tensor((5, 7), dtype, seed=1),
        "scalar": random_tensor((), dtype, seed=2),
        "empty": random_tensor((0, 4), dtype),
    }
    dest = {k: filler_like(v) for k, v in sd.items()}
    doc = _roundtrip(sd, dest, ckpt)
    for k in sd:
        assert_bit_equal(dest[k], sd[k], k)
        assert doc["tensors"][k]["dtype"] == str(dtype).removeprefix("torch.")


def test_nan_payloads_survive(ckpt: Path):
    # Distinct NaN bit patterns (signalling, negative, with payload) must not be canonicalized.
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00123, 0x7FBFFFFF], dtype=torch.int64)
    f32 = bits.to(torch.int32).view(torch.float32)
    f64 = torch.tensor([0x7FF0000000000001, -0x0008000000000001], dtype=torch.int64)
    f64 = f64.view(torch.float64)
    bf16 = torch.tensor([0x7FC1, 0xFF81 - 0x10000, 0x7F81], dtype=torch.int16)
    bf16 = bf16.view(torch.bfloat16)
    sd = {"f32": f32, "f64": f64, "bf16": bf16, "neg_zero": torch.tensor([-0.0, 0.0])}
    dest = {k: filler_like(v) for k, v in sd.items()}
    _roundtrip(sd, dest, ckpt)
    for k in sd:
        assert_bit_equal(dest[k], sd[k], k)


def test_all_dtypes_in_one_checkpoint_are_valid_safetensors(ckpt: Path):
    sd = {f"t_{str(d)[6:]}": random_tensor((3, 5), d, seed=i) for i, d in enumerate(DTYPES)}
    quicksave.save(sd, ckpt)
    doc = check_checkpoint(ckpt)
    seen = set()
    for name, entry in doc["files"].items():
        if "rank" not in entry:
            continue
        with safe_open(str(ckpt / name), "pt") as f:
            meta = f.metadata()
            assert meta == {"format": "quicksave", "format_version": "1", "rank": "0"}
            for key in f.keys():
                if key.startswith("__quicksave_pad_"):
                    assert not f.get_tensor(key).any()
                    continue
                stored = f.get_tensor(key)
                original = sd[key]
                if stored.dtype == original.dtype:
                    assert_bit_equal(stored, original, key)
                else:  # no safetensors code: the raw bytes as U8
                    assert stored.dtype == torch.uint8
                    assert torch.equal(stored, raw(original)), key
                seen.add(key)
    assert seen == set(sd)
    native = {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
    for dtype in native:  # these must be stored with their own safetensors dtype
        with safe_open(
            str(ckpt / doc["tensors"][f"t_{str(dtype)[6:]}"]["chunks"][0]["file"]), "pt"
        ) as f:
            assert f.get_tensor(f"t_{str(dtype)[6:]}").dtype == dtype


def test_non_contiguous_sources_and_destinations(ckpt: Path):
    base = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    sd = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    dest = {
        "transposed": torch.zeros(6, 8).t(),  # non-contiguous destination
        "strided": torch.zeros(6, 6)[::2, ::2],
        "expanded": torch.zeros(3, 2),
        "channels_last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    _roundtrip(sd, dest, ckpt)
    for k in sd:
        assert torch.equal(dest[k], sd[k]), k
    assert not dest["transposed"].is_contiguous()


def test_views_sharing_storage_are_both_restored(ckpt: Path):
    base = torch.arange(20, dtype=torch.int64)
    sd = {"head": base[:12], "tail": base[8:], "whole": base.view(4, 5)}
    dest_base = torch.full((20,), -1, dtype=torch.int64)
    dest = {"head": dest_base[:12], "tail": dest_base[8:], "whole": torch.zeros(4, 5).long()}
    _roundtrip(sd, dest, ckpt)
    assert torch.equal(dest_base, base)  # both views wrote through to the shared storage
    assert torch.equal(dest["whole"], base.view(4, 5))


def test_zero_dim_and_empty(ckpt: Path):
    sd = {
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "int_scalar": torch.tensor(-7),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.bfloat16),
        "empty_3d": torch.empty(0, 2, 0, dtype=torch.int8),
    }
    dest = {k: filler_like(v) for k, v in sd.items()}
    doc = _roundtrip(sd, dest, ckpt)
    for k in sd:
        assert_bit_equal(dest[k], sd[k], k)
    assert doc["tensors"]["scalar"]["shape"] == []
    assert doc["tensors"]["empty_2d"]["chunks"][0]["length"] == 0


def test_nested_state_dict_and_lists_of_tensors(ckpt: Path):
    sd = {
        "model": {"layer": {"weight": torch.randn(3, 3), "bias": torch.randn(3)}},
        "optim": {"state": {0: {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.1}]},
        "list": [torch.ones(2), torch.zeros(1), 7],
    }
    dest = placeholder_like(sd)
    doc = _roundtrip(sd, dest, ckpt)
    assert_same_value(dest, sd, "sd")
    assert doc["tensors"]["model.layer.weight"]["path"] == ["model", "layer", "weight"]


@pytest.mark.parametrize("dtype", quantized_dtypes(), ids=str)
def test_quantized_rejected_before_any_io(dtype: torch.dtype, ckpt: Path):
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, dtype)
    with pytest.raises(quicksave.IncompatibleStateError) as info:
        quicksave.save({"ok": torch.ones(2), "net": {"q": q}}, ckpt)
    assert info.value.fqn == "net.q"
    assert "quantized tensors" in str(info.value) and "int_repr()" in str(info.value)
    assert "fqn=net.q" in str(info.value)
    assert list(ckpt.parent.iterdir()) == []  # neither the target nor a temp dir


def _values() -> dict:
    rng = np.random.RandomState(5)
    state = random.Random(3)
    return {
        "int": 42,
        "huge": 2**200 + 1,
        "neg_huge": -(3**150),
        "bool": True,
        "float": 0.1,
        "nan": float("nan"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "neg_zero": -0.0,
        "complex": complex(1.5, -2),
        "str": 'héllo wörld ☃ 😀 \u0000 "quoted"',
        "empty_str": "",
        "bytes": bytes(range(256)),
        "bytearray": bytearray(b"\x00\x01"),
        "bytesio": io.BytesIO(b"stream \xff"),
        "none": None,
        "tuple": (1, "a", (2.5, None), {"k": b"v"}),
        "set": {3, 1, 2},
        "frozenset": frozenset({"x", "y"}),
        "dict_keys": {1: "int key", (1, 2): "tuple key", "s": [1, 2, {"deep": (None,)}]},
        "nested": {"list": [1, [2, [3, {"x": -0.0}]]], "empty": {}, "empty_list": []},
        "size": torch.Size([2, 3, 4]),
        "dtype": torch.float8_e4m3fn,
        "device": torch.device("cpu"),
        "ndarray": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "ndarray_0d": np.array(3, dtype=np.int16),
        "np_scalar": np.float64(2.5),
        "np_scalars": [np.complex128(1 - 2j), np.int64(-3), np.bool_(True), np.float16(0.5)],
        "np_rng": rng.get_state(),
        "np_global_rng": np.random.get_state(),
        "py_rng": state.getstate(),
        "torch_rng": torch.get_rng_state(),
        "small_tensor_in_tuple": (torch.arange(3), "x"),
    }


def test_non_tensor_values(ckpt: Path):
    sd = {"values": _values()}
    dest = placeholder_like(sd)
    _roundtrip(sd, dest, ckpt)
    assert_same_value(dest, sd, "sd")
    # The restored RNG states actually work as states.
    restored = dest["values"]
    r = random.Random()
    r.setstate(restored["py_rng"])
    assert r.random() == random.Random(3).random()
    np_rng = np.random.RandomState()
    np_rng.set_state(restored["np_rng"])
    assert np_rng.randint(1 << 30) == np.random.RandomState(5).randint(1 << 30)
    torch.set_rng_state(restored["torch_rng"])


class _Custom:
    pass


@pytest.mark.parametrize(
    "value, type_name",
    [
        (_Custom(), "test_roundtrip._Custom"),
        ([1, {"inner": _Custom()}], "test_roundtrip._Custom"),
        (np.array([object()], dtype=object), None),
        (lambda: 1, "builtins.function"),
    ],
    ids=["instance", "nested", "object-array", "lambda"],
)
def test_unstorable_values_rejected_before_any_io(value, type_name, ckpt: Path):
    with pytest.raises(quicksave.IncompatibleStateError) as info:
        quicksave.save({"t": torch.ones(1), "extra": {"thing": value}}, ckpt)
    err = info.value
    assert err.fqn is not None and err.fqn.startswith("extra.thing")
    assert f"fqn={err.fqn}" in str(err)
    if type_name is not None:
        assert f"value of type {type_name} cannot be stored without pickle" in str(err)
    else:
        assert "numpy object arrays cannot be stored without pickle" in str(err)
    assert list(ckpt.parent.iterdir()) == []


def test_chunk_offsets_aligned_and_files_listed(ckpt: Path):
    sd = {f"p{i}": torch.randn(i * 100 + 1) for i in range(10)}
    quicksave.save(sd, ckpt, step=5)
    doc = check_checkpoint(ckpt)
    assert doc["step"] == 5 and doc["world_size"] == 1
    offsets = [c["offset"] for t in doc["tensors"].values() for c in t["chunks"]]
    assert len(offsets) == 10 and all(o % 4096 == 0 for o in offsets)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*doc["files"], "manifest.json"])


def test_storable_dtypes_helper_matches_torch():
    # Guards the parametrization above: every non-quantized dtype torch exposes is tested.
    all_dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert set(storable_dtypes()) == all_dtypes - set(quantized_dtypes())


def test_non_string_dict_keys_keep_their_type(ckpt: Path):
    # DCP turns keys into strings in its paths; values must land under the original keys.
    sd = {"state": {0: {"count": 3, "buf": torch.ones(2)}, 1: {"count": 4}}, "m": {(1, 2): "t"}}
    dest = {"state": {0: {"count": 0, "buf": torch.zeros(2)}, 1: {"count": 0}}, "m": {(1, 2): ""}}
    _roundtrip(sd, dest, ckpt)
    assert_same_value(dest, sd, "sd")


def test_optimizer_state_roundtrip(ckpt: Path):
    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    quicksave.save({"model": model.state_dict(), "optim": opt.state_dict()}, ckpt)
    model2, opt2 = trained(1)
    dest = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    quicksave.load(dest, ckpt)
    opt2.load_state_dict(dest["optim"])
    assert_same_value(opt2.state_dict(), opt.state_dict(), "optim")
    assert_same_value(model2.state_dict(), model.state_dict(), "model")
