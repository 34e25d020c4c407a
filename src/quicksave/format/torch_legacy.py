"""The torch legacy-serialization prefix that makes a raw chunk a ``torch.save`` item.

torch's legacy format (``torch.save(t, f, _use_new_zipfile_serialization=False)``) is a
few pickles — magic number, protocol version, system info, the tensor with a persistent
id for its storage, the storage keys — followed, for each storage, by an 8-byte element
count and then the storage's raw bytes, which come last. So the bytes
``legacy_prefix(dtype, sizes) + raw`` (``raw``: the chunk's C-order element bytes) are a
complete legacy ``torch.save`` of the chunk, and ``torch.load(..., weights_only=True)``
rebuilds it. DCP's stock ``FileSystemReader`` (MSC's ``MultiStorageFileSystemReader``
is one) reads a tensor item exactly that way, so a data file that carries this prefix
right before a chunk's bytes is readable by it (docs/FORMAT.md §3, §5).

The prefix is a pure function of ``(dtype, sizes)``: unlike ``torch.save`` it names its
storage ``"0"`` (never a pointer) and writes fixed system information, so the same
dtype and shape always give the same bytes and a verifier recomputes them instead of
storing a digest. Dtypes the legacy format has no storage type for (float8, the
unsigned 16/32/64-bit and sub-byte integers, ``complex32``, ``bits*``) have no prefix
(:func:`legacy_prefix` returns None): their chunks stay raw-only.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
from typing import Any

# torch.serialization's constants, fixed here so that the prefix does not depend on the
# torch version or host that computes it (the legacy loader does not use type_sizes).
_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_PROTOCOL_VERSION = 1001
_SYS_INFO = {
    "protocol_version": _PROTOCOL_VERSION,
    "little_endian": True,
    "type_sizes": {"short": 2, "int": 4, "long": 8},
}
_PICKLE_PROTOCOL = 2  # torch.save's default
_STORAGE_KEY = "0"
TORCH_LEGACY_PREFIX = "__torch_legacy_"  # safetensors entry names: __torch_legacy_K__


class _Unsupported(Exception):
    pass


class _Storage:
    """Stands for the chunk's storage; pickled as a persistent id."""


class _Tensor:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def __reduce_ex__(self, protocol: int) -> Any:
        import torch

        stride: list[int] = []
        acc = 1
        for d in reversed(self.sizes):
            stride.append(acc)
            acc *= max(d, 1)
        return (
            torch._utils._rebuild_tensor_v2,
            (
                _Storage(),
                0,
                torch.Size(self.sizes),
                tuple(reversed(stride)),
                False,
                collections.OrderedDict(),
            ),
        )


def storage_type_name(dtype: Any) -> str | None:
    """The legacy storage class name of ``dtype`` (``FloatStorage``), or None."""
    import torch

    return torch.storage._dtype_to_storage_type_map().get(dtype)


@functools.lru_cache(maxsize=4096)
def legacy_prefix(dtype: Any, sizes: tuple[int, ...]) -> bytes | None:
    """The bytes that, followed by a ``dtype`` tensor's raw C-order bytes of shape
    ``sizes``, form a legacy ``torch.save`` of it; None for dtypes without a legacy
    storage type. Deterministic: the same arguments always give the same bytes."""
    import torch

    name = storage_type_name(dtype)
    if name is None:
        return None
    storage_cls = getattr(torch, name)
    sizes = tuple(int(d) for d in sizes)
    numel = 1
    for d in sizes:
        numel *= d
    f = io.BytesIO()
    for obj in (_MAGIC_NUMBER, _PROTOCOL_VERSION, _SYS_INFO):
        pickle.dump(obj, f, protocol=_PICKLE_PROTOCOL)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                return ("storage", storage_cls, _STORAGE_KEY, "cpu", numel, None)
            return None

    _Pickler(f, protocol=_PICKLE_PROTOCOL).dump(_Tensor(sizes))
    pickle.dump([_STORAGE_KEY], f, protocol=_PICKLE_PROTOCOL)
    f.write(struct.pack("<q", numel))
    return f.getvalue()


def legacy_prefix_for(dtype_name: str, sizes: tuple[int, ...]) -> bytes | None:
    """:func:`legacy_prefix` for a manifest dtype name (None if this torch lacks it)."""
    from quicksave.format.dtypes import known_dtype

    dtype = known_dtype(dtype_name)
    return None if dtype is None else legacy_prefix(dtype, tuple(sizes))


def object_bytes(value: Any) -> bytes | None:
    """A non-tensor value as DCP stores a ``BYTE_IO`` item: a legacy-format ``torch.save``
    of it, with storage keys numbered in order (``torch.save`` names them by pointer), so
    the same value gives the same bytes. None if the value holds a tensor whose dtype the
    legacy format cannot store."""
    import torch

    storages: dict[int, tuple[str, Any]] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.storage.TypedStorage):
                key, _ = storages.setdefault(obj._cdata, (str(len(storages)), obj))
                cls = getattr(torch, obj._pickle_storage_type())
                return ("storage", cls, key, "cpu", obj._size(), None)
            return None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and storage_type_name(obj.dtype) is None:
                raise _Unsupported  # torch would nest a zip-format save (random keys)
            return NotImplemented

    f = io.BytesIO()
    for obj in (_MAGIC_NUMBER, _PROTOCOL_VERSION, _SYS_INFO):
        pickle.dump(obj, f, protocol=_PICKLE_PROTOCOL)
    try:
        _Pickler(f, protocol=_PICKLE_PROTOCOL).dump(value)
    except (_Unsupported, KeyError, pickle.PicklingError, TypeError, AttributeError):
        return None
    pickle.dump([key for key, _ in storages.values()], f, protocol=_PICKLE_PROTOCOL)
    for _, st in storages.values():
        f.write(struct.pack("<q", st._size()))
        raw = torch.empty(0, dtype=torch.uint8).set_(st._untyped_storage.cpu())
        f.write(raw.numpy().tobytes())
    return f.getvalue()
