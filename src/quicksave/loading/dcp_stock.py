"""Reading stock ``torch.distributed.checkpoint`` directories without running their pickle.

A stock DCP directory keeps its metadata in ``.metadata``, a Python pickle, and DCP's
``FileSystemReader.read_metadata`` calls plain ``pickle.load``: whoever wrote the file
chooses what code runs. Here it is unpickled by :class:`_MetadataUnpickler`, which
admits only the globals that DCP's metadata is made of (torch 2.6 to 2.13): the
dataclasses of ``torch.distributed.checkpoint.metadata``, ``filesystem._StorageInfo``,
torch dtypes, ``torch.Size``, layouts and memory formats, and a few inert containers
(``collections.OrderedDict``, ``set``, ``frozenset``, ``pathlib`` paths). Each is looked
up in a fixed table: nothing named by the file is imported. Anything else is refused
with a :class:`~quicksave.errors.CorruptCheckpointError` naming the path and the
global. The result is then checked: types, dtypes, chunk boxes inside their tensors,
and data file names that stay inside the directory. The Multi-Storage Client's DCP writer
(``multistorageclient.contrib.torch``) records its checkpoint path, a ``MultiStoragePath``,
in ``storage_meta``: it unpickles to an inert :class:`_ForeignPath` (its path as a string),
never MSC's class.

Full unpickling is available with ``allow_pickle=True``, only for trusted checkpoints
(for example metadata carrying a custom planner's classes).

Example::

    import torch.distributed.checkpoint as dcp
    dcp.load(state_dict, storage_reader=DCPReader("ckpt/dcp-step-100"))
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME
from quicksave.format.dtype_names import ELEMENT_SIZES
from quicksave.format.dtypes import known_dtype
from quicksave.format.manifest import MAX_MANIFEST_BYTES
from quicksave.format.naming import bad_member_name
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend, join
from quicksave.storage.checkpoint_dir import CheckpointDir

MAX_METADATA_BYTES = MAX_MANIFEST_BYTES
_MANIFEST_START = b'{"format":"quicksave",'  # how a manifest written by quicksave begins
_INT_LIMIT = 1 << 63

_LAYOUTS: dict[str, torch.layout] = {
    str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    k: v for k, v in vars(torch).items() if isinstance(v, torch.memory_format)
}


def _layout(name: object) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: a fixed table lookup."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


class _ForeignPath:
    """Stand-in for a path object of another library recorded in the metadata (MSC's
    ``MultiStoragePath`` as ``storage_meta.checkpoint_id``): created empty, its pickled
    state kept as plain strings only. Nothing reads it; ``str()`` is the path."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError("a path's state must be a dict")
        self.path = str(state.get("_path", "")) if isinstance(state.get("_path"), str) else ""

    def __str__(self) -> str:
        return getattr(self, "path", "")

    def __repr__(self) -> str:
        return f"_ForeignPath({str(self)!r})"


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(_md, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(_md, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name in ELEMENT_SIZES:
        dtype = known_dtype(name)
        if dtype is not None:
            allowed[("torch", name)] = dtype
    for name, fmt in _MEMORY_FORMATS.items():
        allowed[("torch", name)] = fmt
    for layout_name, layout in _LAYOUTS.items():
        allowed[("torch", layout_name.removeprefix("torch."))] = layout
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    for module in ("pathlib", "pathlib._local"):
        allowed[(module, "PosixPath")] = pathlib.PurePosixPath
        allowed[(module, "PurePosixPath")] = pathlib.PurePosixPath
        allowed[(module, "WindowsPath")] = pathlib.PureWindowsPath
        allowed[(module, "PureWindowsPath")] = pathlib.PureWindowsPath
    allowed[("multistorageclient.pathlib", "MultiStoragePath")] = _ForeignPath
    return allowed


_ALLOWED = _allowed_globals()
# Only the metadata dataclasses take BUILD (state set on a fresh instance). Never a
# class, an enum member or any other shared object.
_BUILDABLE = frozenset(
    {
        _StorageInfo,
        _ForeignPath,
        *(
            v
            for (module, _), v in _ALLOWED.items()
            if module == "torch.distributed.checkpoint.metadata"
            and v is not getattr(_md, "_MEM_FORMAT_ENCODING", None)
        ),
    }
)


class _Refused(pickle.UnpicklingError):
    """A global outside the allowlist (the message names it)."""


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Unpickles DCP metadata and nothing else.

    The pure-Python unpickler is used (not the C one) because its opcode table can be
    narrowed: ``BUILD`` is refused on anything but an instance of an allowed class, so
    a pickle cannot set attributes on a class (``setattr(MetadataIndex, "__eq__", ...)``
    would change torch for the whole process).
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _BUILDABLE:
            raise pickle.UnpicklingError(f"BUILD on {type(target).__name__} objects is not allowed")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build


class RestrictedObjectsMixin:
    """For a DCP ``LoadPlanner``: the non-tensor values of a stock DCP checkpoint (each
    a ``torch.save`` pickle) are read with ``torch.load(weights_only=True)``, as
    ``.metadata`` is read with the restricted unpickler, unless ``allow_pickle``; DCP's
    own ``load_bytes`` unpickles them without restriction, running any code the
    checkpoint names. Set ``allow_pickle`` and ``path`` before loading."""

    allow_pickle: bool = False
    path: str = ""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                "this value is a pickle that the restricted unpickler refuses "
                f"({str(e).splitlines()[0][:300]}); pass allow_dcp_pickle=True to unpickle "
                "it without restriction (only for checkpoints you trust)",
                path=self.path,
                fqn=fqn,
            ) from None
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


def _unpickle_restricted(stream: io.BytesIO, path: str) -> Any:
    try:
        return _MetadataUnpickler(stream).load()
    except _Refused as e:
        raise CorruptCheckpointError(
            f"the DCP metadata pickle refers to {e.args[0]}, which is not part of DCP's "
            "metadata; refusing to unpickle it (pass allow_pickle=True only if you trust "
            "this checkpoint)",
            path=path,
        ) from None
    except Exception as e:  # any malformed pickle: UnpicklingError, EOFError, TypeError ...
        raise CorruptCheckpointError(
            f"cannot unpickle the DCP metadata: {type(e).__name__}: {e}", path=path
        ) from None


def _check_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT_LIMIT


def _check_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_check_int(v) for v in value)


def _check_structure(md: Any, path: str) -> None:
    """The unpickled object is DCP metadata of the expected shape (restricted mode)."""

    def bad(message: str, fqn: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"DCP metadata: {message}", path=path, fqn=fqn)

    if not isinstance(md, _md.Metadata):
        raise bad(f"the pickle holds a {type(md).__name__}, not a Metadata")
    sd = md.state_dict_metadata
    if not isinstance(sd, dict):
        raise bad("state_dict_metadata is not a dict")
    for fqn, item in sd.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(item, _md.BytesStorageMetadata):
            continue
        if not isinstance(item, _md.TensorStorageMetadata):
            raise bad(f"entry of type {type(item).__name__}", fqn)
        props = item.properties
        if not isinstance(props, _md.TensorProperties) or not isinstance(props.dtype, torch.dtype):
            raise bad("tensor properties are not TensorProperties with a dtype", fqn)
        if not _check_size(item.size) or not isinstance(item.chunks, list):
            raise bad("tensor size or chunk list is malformed", fqn)
        for c in item.chunks:
            if (
                not isinstance(c, _md.ChunkStorageMetadata)
                or not _check_size(c.offsets)
                or not _check_size(c.sizes)
                or len(c.offsets) != len(item.size)
                or len(c.sizes) != len(item.size)
                or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, item.size, strict=True))
            ):
                raise bad(f"a chunk lies outside the tensor's size {list(item.size)}", fqn)
    planner_data = md.planner_data
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise bad("planner_data is not a dict")
        for fqn, keys in planner_data.items():
            if not isinstance(fqn, str) or not isinstance(keys, (tuple, list)):
                raise bad("planner_data is not a mapping of fqn to a key path")
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
                raise bad("a planner_data key path holds something other than str/int", fqn)
    meta = md.storage_meta
    if meta is not None and not isinstance(meta, _md.StorageMeta):
        raise bad("storage_meta is not a StorageMeta")


def _check_storage(md: Any, path: str) -> None:
    """Every data location is a plain file name inside the directory with a sane byte
    range (both modes: DCP's reader opens these names)."""
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise CorruptCheckpointError("DCP metadata: storage_data is not a dict", path=path)
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        fqn = fqn if isinstance(fqn, str) else None
        if not isinstance(index, _md.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(
                "DCP metadata: storage_data must map MetadataIndex to _StorageInfo",
                path=path,
                fqn=fqn,
            )
        why = bad_member_name(info.relative_path)
        if why is not None:
            raise CorruptCheckpointError(
                f"DCP metadata: data file {info.relative_path!r} is not a plain name inside "
                f"the checkpoint ({why})",
                path=path,
                fqn=fqn,
            )
        if not _check_int(info.offset) or not _check_int(info.length):
            raise CorruptCheckpointError(
                f"DCP metadata: byte range offset={info.offset!r} length={info.length!r} is "
                "not two integers in [0, 2**63)",
                path=path,
                fqn=fqn,
            )
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise CorruptCheckpointError(
                "DCP metadata: transform_descriptors must be strings", path=path, fqn=fqn
            )


def metadata_file_name(rank: int | None = None) -> str:
    """``.metadata``, or a rank's own ``__<rank>.metadata``."""
    if rank is None:
        return DCP_METADATA_NAME
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise CorruptCheckpointError(f"bad rank {rank!r} for rank-local DCP metadata")
    return f"__{rank}{DCP_METADATA_NAME}"


def read_dcp_metadata(
    path: str | os.PathLike[str] | Location,
    allow_pickle: bool = False,
    *,
    rank: int | None = None,
    backend: Backend | None = None,
) -> _md.Metadata:
    """The ``Metadata`` of the stock DCP checkpoint directory ``path``.

    Args:
        path: the checkpoint directory.
        allow_pickle: unpickle ``.metadata`` without restriction. Unpickling runs code
            named by the file: only for checkpoints you trust. Without it, only DCP's
            metadata classes are admitted and nothing named by the file is imported.
        rank: read the rank-local ``__<rank>.metadata`` instead (DCP's fallback).

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        CorruptCheckpointError: ``.metadata`` is missing, not a regular file, larger than
            1 GiB, not a pickle of DCP metadata, refers to a global outside the allowlist
            (named in the message), names data outside the directory, or is the
            ``.metadata`` of a DCP-layout quicksave checkpoint that lost its footer (a
            quicksave manifest follows the pickle; docs/FORMAT.md §8).

    Example::

        md = read_dcp_metadata("ckpt/dcp-step-100")
        print(sorted(md.state_dict_metadata))
    """
    with CheckpointDir(path, backend) as d:
        file = d.member_url(metadata_file_name(rank))
        try:
            data = d.read(
                metadata_file_name(rank),
                MAX_METADATA_BYTES,
                what="DCP metadata",
                too_large=f"DCP metadata larger than {MAX_METADATA_BYTES} bytes",
            )
        except FileNotFoundError:
            raise CorruptCheckpointError("DCP metadata file is missing", path=file) from None
    stream = io.BytesIO(data)
    if allow_pickle:
        try:
            md = pickle.load(stream)  # the caller trusts this checkpoint
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot unpickle the DCP metadata: {type(e).__name__}: {e}", path=file
            ) from None
        if not isinstance(md, _md.Metadata):
            raise CorruptCheckpointError(
                f"DCP metadata: the pickle holds a {type(md).__name__}, not a Metadata",
                path=file,
            )
    else:
        md = _unpickle_restricted(stream, file)
        _check_structure(md, file)
    if data[stream.tell() : stream.tell() + len(_MANIFEST_START)] == _MANIFEST_START:
        # A DCP-layout .metadata (FORMAT.md §8) that lost its footer: read as a stock
        # DCP checkpoint it would load without the checksums that cover every byte.
        raise CorruptCheckpointError(
            "a quicksave manifest follows DCP's pickle but the file lacks a valid DCP-layout "
            "footer: a quicksave checkpoint whose .metadata is truncated or damaged; refusing "
            "to read it as a stock DCP checkpoint",
            path=file,
        )
    _check_storage(md, file)
    return md


class DCPReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is unpickled by the restricted
    unpickler of :func:`read_dcp_metadata`, and whose reads open regular files inside
    the checkpoint directory only, after checking each byte range against the file.

    Args:
        path: a stock DCP checkpoint directory.
        allow_pickle: unpickle ``.metadata`` without restriction (trusted checkpoints
            only; runs code named by the file).
        backend: an open backend serving ``path`` (object stores; kept open), so that a
            load makes one client; by default the reader opens its own.

    Call order: as DCP's ``FileSystemReader`` (``read_metadata`` → ``set_up_storage_reader``
    → ``prepare_local_plan`` / ``prepare_global_plan`` → ``read_data``).

    Example::

        dcp.load(state_dict, storage_reader=DCPReader("ckpt/dcp-step-100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        allow_pickle: bool = False,
        backend: Backend | None = None,
    ) -> None:
        self.location = parse_location(path)
        super().__init__(self.location.key)
        self.allow_pickle = allow_pickle
        # a caller's backend, or one of its own for the reader's lifetime
        self._backend: Backend = backend if backend is not None else self.location.open()
        self.fs = _BackendFileSystem(self._backend)
        self.path = self.location.key

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        md = read_dcp_metadata(
            self.location,
            allow_pickle=self.allow_pickle,
            rank=kwargs.get("rank"),
            backend=self._backend,
        )
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = _md.StorageMeta()
        if hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ends: dict[str, tuple[int, str]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            end = info.offset + info.length
            if end > ends.get(info.relative_path, (-1, ""))[0]:
                ends[info.relative_path] = (end, item.storage_index.fqn)
        with CheckpointDir(self.location, self._backend) as d:
            for name, (end, fqn) in ends.items():
                _check_range(d, name, end, fqn)
        return super().read_data(plan, planner)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        buf = bytearray(sinfo.length)  # one ranged read per item, not one per read()
        file.backend.read_into(file.key, sinfo.offset, memoryview(buf))
        return io.BytesIO(buf)


class _Member:
    def __init__(self, backend: Backend, key: str) -> None:
        self.backend, self.key = backend, key


class _BackendFileSystem(FileSystemBase):
    """DCP's file system interface over a backend: just enough for reading (the reader
    asks for one ranged read per item, see ``DCPReader._slice_file``; a file is read as
    a regular file only, :func:`quicksave.storage.safeio.open_regular`)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise CheckpointError("quicksave reads stock DCP checkpoints only", path=str(path))
        yield _Member(self.backend, str(path))

    def concat_path(self, path: Any, suffix: str) -> str:
        return join(str(path), suffix)

    def init_path(self, path: Any) -> str:
        return str(path)

    def rename(self, path: Any, new_path: Any) -> None:
        raise CheckpointError("read-only", path=str(path))

    def mkdir(self, path: Any) -> None:
        raise CheckpointError("read-only", path=str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def exists(self, path: Any) -> bool:
        return self.backend.stat(str(path)) is not None

    def rm_file(self, path: Any) -> None:
        raise CheckpointError("read-only", path=str(path))


def _check_range(d: CheckpointDir, name: str, end: int, fqn: str) -> None:
    file = d.member_url(name)
    try:
        f = d.open(name, what="DCP data file", fqn=fqn)
    except FileNotFoundError:
        raise CorruptCheckpointError("DCP data file is missing", path=file, fqn=fqn) from None
    f.close()
    if end > f.size:
        raise CorruptCheckpointError(
            f"DCP data file is truncated: an item needs bytes up to {end}, the file has {f.size}",
            path=file,
            fqn=fqn,
        )
