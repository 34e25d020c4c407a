"""Typed JSON encoding of non-tensor values.

Values are encoded into plain JSON where JSON is exact (null, booleans, integers,
finite floats, strings, lists) and into tagged objects ``{"$t": TAG, ...}`` otherwise.
Decoding never executes code from the file: it only builds the container and scalar
types listed in ``_DECODERS``. See docs/FORMAT.md, "Objects".
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from quicksave.errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError
from quicksave.format.dtypes import dtype_from_name, dtype_name, element_size
from quicksave.format.manifest import INT_LIMIT
from quicksave.format.strict_json import MAX_DEPTH, MAX_INT_DIGITS

JSONValue = Any
MAX_INT = 10**MAX_INT_DIGITS  # |integers| stay below it, so their literal fits the limit
MAX_NDIM = 64
# JSON nesting of a stored value; the manifest puts values 3 levels down and bounds
# itself at MAX_DEPTH, so values get MAX_DEPTH - 4 (one spare).
MAX_VALUE_DEPTH = MAX_DEPTH - 4
# numpy ``dtype.str`` of plain numbers, booleans and fixed-width strings: byte order,
# kind, item size. Never objects ("O"), void/structured ("V") or anything parsed further.
_NP_DTYPE = re.compile(r"[<>|=][biufcSU][0-9]{1,6}\Z")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,9})?\Z")


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError("payload must be a base64 string")
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode(value: Any, fqn: str = "") -> JSONValue:
    """Encode ``value`` as typed JSON.

    Raises:
        IncompatibleStateError: the value (or something inside it) has a type that
            cannot be stored without pickle, an integer with more than
            ``MAX_INT_DIGITS`` digits, a numpy dtype other than numbers, booleans and
            fixed-width strings, or nests deeper than readers accept; the message
            names the fqn.
    """
    return _encode(value, fqn, 0)


def _encode(value: Any, fqn: str, depth: int) -> JSONValue:
    # ``depth`` is the JSON nesting of ``value`` inside the stored value: readers bound
    # it (MAX_VALUE_DEPTH), so writers refuse what readers would refuse.
    if depth > MAX_VALUE_DEPTH:
        raise IncompatibleStateError(
            f"value nests deeper than {MAX_VALUE_DEPTH} levels (or contains itself)", fqn=fqn
        )
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -MAX_INT < value < MAX_INT:
            raise IncompatibleStateError(
                f"integer with more than {MAX_INT_DIGITS} digits; store it as a string or bytes",
                fqn=fqn,
            )
        return int(value)
    # np.float64 / np.complex128 subclass float / complex: keep their numpy type.
    if isinstance(value, float) and not isinstance(value, np.generic):
        if math.isfinite(value):
            return value
        return {"$t": "float", "v": repr(value)}
    if isinstance(value, list):
        return [_encode(v, f"{fqn}[{i}]", depth + 1) for i, v in enumerate(value)]
    if (
        isinstance(value, tuple)
        and not hasattr(value, "_fields")
        and not isinstance(
            value,
            torch.Size,  # a tuple subclass: must reach its own tag below
        )
    ):
        items = [_encode(v, f"{fqn}[{i}]", depth + 2) for i, v in enumerate(value)]
        return {"$t": "tuple", "v": items}
    if isinstance(value, dict):
        return {
            "$t": "dict",
            "v": [
                [_encode(k, fqn, depth + 3), _encode(v, f"{fqn}.{k}", depth + 3)]
                for k, v in value.items()
            ],
        }
    if isinstance(value, (set, frozenset)):
        tag = "set" if isinstance(value, set) else "frozenset"
        items = sorted(value, key=repr)
        return {"$t": tag, "v": [_encode(v, fqn, depth + 2) for v in items]}
    if isinstance(value, complex) and not isinstance(value, np.generic):
        return {"$t": "complex", "v": [_encode(value.real, fqn, 0), _encode(value.imag, fqn, 0)]}
    if isinstance(value, (bytes, bytearray)):
        return {"$t": "bytes" if isinstance(value, bytes) else "bytearray", "v": _b64(value)}
    if isinstance(value, io.BytesIO):
        return {"$t": "bytesio", "v": _b64(value.getvalue())}
    if isinstance(value, torch.dtype):
        return {"$t": "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.Size):
        return {"$t": "size", "v": list(value)}
    if isinstance(value, torch.device):
        return {"$t": "device", "v": str(value)}
    if isinstance(value, torch.Tensor):
        # A tensor that DCP did not flatten (e.g. inside a tuple): small, stored inline.
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "$t": "tensor",
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "v": _b64(raw),
        }
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise IncompatibleStateError(
                "numpy object arrays cannot be stored without pickle", fqn=fqn
            )
        _check_np_dtype(value.dtype, fqn)
        arr = np.ascontiguousarray(value)
        # ascontiguousarray turns a 0-d array into shape (1,): keep the original shape.
        return {
            "$t": "ndarray",
            "dtype": arr.dtype.str,
            "shape": list(value.shape),
            "v": _b64(arr.tobytes()),
        }
    if isinstance(value, np.generic):
        _check_np_dtype(value.dtype, fqn)
        return {"$t": "npscalar", "dtype": value.dtype.str, "v": _b64(value.tobytes())}
    raise IncompatibleStateError(
        f"value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored "
        "without pickle; convert it to tensors, numbers, strings, bytes, lists or dicts "
        "(e.g. in the Stateful's state_dict())",
        fqn=fqn,
    )


def _check_np_dtype(dtype: np.dtype, fqn: str) -> None:
    if not _NP_DTYPE.match(dtype.str):
        raise IncompatibleStateError(
            f"numpy dtype {dtype} cannot be stored: only numbers, booleans and fixed-width "
            "strings are",
            fqn=fqn,
        )


def _shape(value: Any, what: str = "shape") -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < INT_LIMIT for d in value
    ):
        raise ValueError(f"{what} must be a list of integers in [0, 2**63)")
    if len(value) > MAX_NDIM:
        raise ValueError(f"{what} has more than {MAX_NDIM} dimensions")
    return tuple(value)


def _raw(obj: dict, numel: int, itemsize: int, what: str) -> bytes:
    """The base64 payload of ``obj``, checked to hold exactly ``numel`` elements of
    ``itemsize`` bytes before it is decoded (so a 60-byte object cannot declare
    gigabytes)."""
    text = obj["v"]
    if not isinstance(text, str):
        raise ValueError(f"{what} payload must be a base64 string")
    nbytes = numel * itemsize
    if nbytes >= INT_LIMIT or len(text) != 4 * ((nbytes + 2) // 3):
        raise ValueError(
            f"{what} declares {numel} elements of {itemsize} bytes but holds "
            f"{len(text)} base64 characters"
        )
    raw = _unb64(text)
    if len(raw) != nbytes:
        raise ValueError(f"{what} declares {nbytes} bytes but holds {len(raw)}")
    return raw


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(obj: dict) -> torch.Tensor:
    dtype = dtype_from_name(obj["dtype"])
    shape = _shape(obj["shape"])
    raw = _raw(obj, _numel(shape), element_size(dtype), "tensor")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _np_dtype(text: Any) -> np.dtype:
    """A numpy dtype from its ``dtype.str``: plain numbers, booleans and fixed-width
    strings only (never objects, structured or void types)."""
    if not isinstance(text, str) or not _NP_DTYPE.match(text):
        raise ValueError(f"numpy dtype {str(text)[:40]!r} is not allowed")
    return np.dtype(text)


def _ndarray(obj: dict) -> np.ndarray:
    dtype = _np_dtype(obj["dtype"])
    shape = _shape(obj["shape"])
    raw = _raw(obj, _numel(shape), dtype.itemsize, "ndarray")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _npscalar(obj: dict) -> Any:
    dtype = _np_dtype(obj["dtype"])
    return np.frombuffer(_raw(obj, 1, dtype.itemsize, "npscalar"), dtype=dtype)[0]


def _float(text: Any) -> float:
    if text not in ("nan", "inf", "-inf"):
        raise ValueError(f"bad float {str(text)[:40]!r}")
    return float(text)


def _items(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError("v must be an array")
    return value


def _pairs(value: Any) -> list:
    if not all(isinstance(p, list) and len(p) == 2 for p in _items(value)):
        raise ValueError("dict items must be [key, value] pairs")
    return value


def _real(value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("complex parts must be numbers")
    return value


def _device(text: Any) -> torch.device:
    if not isinstance(text, str) or not _DEVICE.match(text):
        raise ValueError(f"bad device {str(text)[:40]!r}")
    return torch.device(text)


# Each decoder gets the tagged object and ``sub(value, levels)``, which decodes a value
# nested ``levels`` JSON levels below the tagged object.
_Sub = Callable[[Any, int], Any]
_DECODERS: dict[str, Callable[[dict, _Sub], Any]] = {
    "float": lambda o, sub: _float(o["v"]),
    "tuple": lambda o, sub: tuple(sub(v, 2) for v in _items(o["v"])),
    "dict": lambda o, sub: {sub(k, 3): sub(v, 3) for k, v in _pairs(o["v"])},
    "set": lambda o, sub: {sub(v, 2) for v in _items(o["v"])},
    "frozenset": lambda o, sub: frozenset(sub(v, 2) for v in _items(o["v"])),
    "complex": lambda o, sub: complex(*(_real(sub(v, 2)) for v in _pairs([o["v"]])[0])),
    "bytes": lambda o, sub: _unb64(o["v"]),
    "bytearray": lambda o, sub: bytearray(_unb64(o["v"])),
    "bytesio": lambda o, sub: io.BytesIO(_unb64(o["v"])),
    "dtype": lambda o, sub: dtype_from_name(o["v"]),
    "size": lambda o, sub: torch.Size(_shape(o["v"], "size")),
    "device": lambda o, sub: _device(o["v"]),
    "tensor": lambda o, sub: _tensor(o),
    "ndarray": lambda o, sub: _ndarray(o),
    "npscalar": lambda o, sub: _npscalar(o),
}


def _decode(value: JSONValue, depth: int) -> Any:
    if depth > MAX_VALUE_DEPTH:
        raise ValueError(f"value nests deeper than {MAX_VALUE_DEPTH} levels")
    if isinstance(value, list):
        return [_decode(v, depth + 1) for v in value]
    if isinstance(value, dict):
        tag = value.get("$t")
        decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
        if decoder is None:
            raise ValueError(f"unknown object tag {str(tag)[:40]!r}")
        return decoder(value, lambda v, levels: _decode(v, depth + levels))
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -MAX_INT < value < MAX_INT:
            raise ValueError(f"integer with more than {MAX_INT_DIGITS} digits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite float outside a {'$t': 'float'} object")
        return value
    raise ValueError(f"unexpected JSON value of type {type(value).__name__}")


def decode(value: JSONValue, fqn: str | None = None, path: str | None = None) -> Any:
    """Inverse of :func:`encode`. Builds only plain data types; never imports or calls
    anything named by the file. Sizes are checked before anything is allocated, and
    nesting is bounded (FORMAT.md §4).

    Raises:
        CorruptCheckpointError: not a value :func:`encode` can produce.
        IncompatibleStateError: an unknown torch dtype name (a newer torch?).
    """
    try:
        return _decode(value, 0)
    except CheckpointError as e:
        # Raised by the dtype lookup, which does not know where it is.
        if e.path is None and e.fqn is None and (path is not None or fqn is not None):
            raise type(e)(e.message, path=path, fqn=fqn) from None
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, MemoryError) as e:
        raise CorruptCheckpointError(
            f"cannot decode stored object: {e}", path=path, fqn=fqn
        ) from None
