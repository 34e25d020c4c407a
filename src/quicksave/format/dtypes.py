"""torch dtype <-> manifest name <-> safetensors dtype code.

Names from a checkpoint are resolved only through a fixed table built from the names
in :mod:`.dtype_names` (FORMAT.md §4: decoding imports nothing named by the file).
``getattr(torch, name)`` on a name from a file could import a submodule (``_dynamo``)
or return any attribute of ``torch``; the table cannot.
"""

from __future__ import annotations

import torch

from quicksave.errors import IncompatibleStateError
from quicksave.format.dtype_names import ELEMENT_SIZES


def _table() -> dict[str, torch.dtype]:
    table = {}
    for name in ELEMENT_SIZES:
        value = torch.__dict__.get(name)  # a plain lookup: never imports, never calls
        if (
            isinstance(value, torch.dtype)
            and str(value) == f"torch.{name}"
            and value.itemsize == ELEMENT_SIZES[name]
        ):
            table[name] = value
    return table


_BY_NAME: dict[str, torch.dtype] = _table()

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
    if _name in _BY_NAME:
        _SAFETENSORS_CODES[_BY_NAME[_name]] = _code

_QUANTIZED = {
    _BY_NAME[n] for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if n in _BY_NAME
}


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def known_dtype(name: object) -> torch.dtype | None:
    """The torch dtype called ``name`` in a checkpoint, or None if there is none."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def dtype_from_name(name: str, *, path: str | None = None, fqn: str | None = None) -> torch.dtype:
    """The torch dtype called ``name`` (a canonical name such as ``bfloat16``).

    Raises:
        IncompatibleStateError: no such dtype in this torch (the message repeats the
            name, which may come from a file), naming ``path`` and ``fqn`` if given.
    """
    value = known_dtype(name)
    if value is None:
        raise IncompatibleStateError(
            f"unknown dtype {name!r} in checkpoint (written by a newer torch?)",
            path=path,
            fqn=fqn,
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
    return dtype.itemsize
