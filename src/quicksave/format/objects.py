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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError
from .dtypes import dtype_from_name, dtype_name

JSONValue = Any


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def encode(value: Any, fqn: str = "") -> JSONValue:
    """Encode ``value`` as typed JSON.

    Raises:
        IncompatibleStateError: the value (or something inside it) has a type that
            cannot be stored without pickle; the message names the fqn and the type.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    # np.float64 / np.complex128 subclass float / complex: keep their numpy type.
    if isinstance(value, float) and not isinstance(value, np.generic):
        if math.isfinite(value):
            return value
        return {"$t": "float", "v": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{fqn}[{i}]") for i, v in enumerate(value)]
    if (
        isinstance(value, tuple)
        and not hasattr(value, "_fields")
        and not isinstance(
            value,
            torch.Size,  # a tuple subclass: must reach its own tag below
        )
    ):
        return {"$t": "tuple", "v": [encode(v, f"{fqn}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {
            "$t": "dict",
            "v": [[encode(k, fqn), encode(v, f"{fqn}.{k}")] for k, v in value.items()],
        }
    if isinstance(value, (set, frozenset)):
        tag = "set" if isinstance(value, set) else "frozenset"
        items = sorted(value, key=repr)
        return {"$t": tag, "v": [encode(v, fqn) for v in items]}
    if isinstance(value, complex) and not isinstance(value, np.generic):
        return {"$t": "complex", "v": [encode(value.real), encode(value.imag)]}
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
        arr = np.ascontiguousarray(value)
        # ascontiguousarray turns a 0-d array into shape (1,): keep the original shape.
        return {
            "$t": "ndarray",
            "dtype": arr.dtype.str,
            "shape": list(value.shape),
            "v": _b64(arr.tobytes()),
        }
    if isinstance(value, np.generic):
        return {"$t": "npscalar", "dtype": value.dtype.str, "v": _b64(value.tobytes())}
    raise IncompatibleStateError(
        f"value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored "
        "without pickle; convert it to tensors, numbers, strings, bytes, lists or dicts "
        "(e.g. in the Stateful's state_dict())",
        fqn=fqn,
    )


def _tensor(obj: dict) -> torch.Tensor:
    dtype = dtype_from_name(obj["dtype"])
    raw = bytearray(_unb64(obj["v"]))
    shape = obj["shape"]
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _float(text: str) -> float:
    if text not in ("nan", "inf", "-inf"):
        raise ValueError(f"bad float {text!r}")
    return float(text)


_DECODERS: dict[str, Callable[[dict], Any]] = {
    "float": lambda o: _float(o["v"]),
    "tuple": lambda o: tuple(decode(v) for v in o["v"]),
    "dict": lambda o: {decode(k): decode(v) for k, v in o["v"]},
    "set": lambda o: {decode(v) for v in o["v"]},
    "frozenset": lambda o: frozenset(decode(v) for v in o["v"]),
    "complex": lambda o: complex(decode(o["v"][0]), decode(o["v"][1])),
    "bytes": lambda o: _unb64(o["v"]),
    "bytearray": lambda o: bytearray(_unb64(o["v"])),
    "bytesio": lambda o: io.BytesIO(_unb64(o["v"])),
    "dtype": lambda o: dtype_from_name(o["v"]),
    "size": lambda o: torch.Size(o["v"]),
    "device": lambda o: torch.device(o["v"]),
    "tensor": _tensor,
    "ndarray": lambda o: (
        np.frombuffer(_unb64(o["v"]), dtype=np.dtype(o["dtype"])).reshape(o["shape"]).copy()
    ),
    "npscalar": lambda o: np.frombuffer(_unb64(o["v"]), dtype=np.dtype(o["dtype"]))[0],
}


def decode(value: JSONValue, fqn: str | None = None, path: str | None = None) -> Any:
    """Inverse of :func:`encode`. Builds only plain data types; never imports or calls
    anything named by the file."""
    try:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if isinstance(value, dict):
            tag = value.get("$t")
            decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
            if decoder is None:
                raise ValueError(f"unknown object tag {tag!r}")
            return decoder(value)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ValueError(f"unexpected JSON value of type {type(value).__name__}")
    except CheckpointError as e:
        # Raised by a nested decode or the dtype lookup, which do not know where they are.
        if e.path is None and e.fqn is None and (path is not None or fqn is not None):
            raise type(e)(e.message, path=path, fqn=fqn) from None
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise CorruptCheckpointError(
            f"cannot decode stored object: {e}", path=path, fqn=fqn
        ) from None
