"""torch dtype <-> manifest name <-> safetensors dtype code."""

from __future__ import annotations

import torch

from ..errors import IncompatibleStateError

# safetensors codes for dtypes it knows; everything else is stored as U8 bytes in the
# safetensors header and described exactly by the manifest.
_SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
}
for _name, _code in (("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ")):
    if hasattr(torch, _name):
        _SAFETENSORS_CODES[getattr(torch, _name)] = _code

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise IncompatibleStateError(
            f"unknown dtype {name!r} in checkpoint (written by a newer torch?)"
        )
    return value


def safetensors_code(dtype: torch.dtype) -> str | None:
    """The safetensors dtype code, or None if the bytes must be described as U8."""
    return _SAFETENSORS_CODES.get(dtype)


def check_storable(dtype: torch.dtype, fqn: str, rank: int | None = None) -> None:
    if dtype in _QUANTIZED:
        raise IncompatibleStateError(
            f"quantized tensors ({dtype_name(dtype)}) cannot be stored as raw bytes; "
            "save .int_repr() with its scale and zero point instead",
            fqn=fqn,
            rank=rank,
        )


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
