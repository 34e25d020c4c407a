"""The dtype names a checkpoint may use, with their element sizes. Torch-free.

A manifest names dtypes by their canonical torch name (``str(dtype)`` without
``torch.``). Readers look names up here and in :mod:`quicksave.format.dtypes`, which
builds its torch table from these names: a name from a file never reaches ``getattr``.
"""

from __future__ import annotations

ELEMENT_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"uint{n}": 1 for n in range(1, 8)},
    **{f"int{n}": 1 for n in range(1, 8)},
}

# Element size of every safetensors code FORMAT.md §3 allows in a data file's header.
SAFETENSORS_CODE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "C64": 8,
}


def element_size_of_name(name: object) -> int | None:
    """Bytes per element of the dtype called ``name``, or None if it is not known."""
    return ELEMENT_SIZES.get(name) if isinstance(name, str) else None
