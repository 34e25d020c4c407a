"""Inspect: what a checkpoint holds (``quicksave inspect``), from its metadata only.

A quicksave checkpoint is described from its manifest alone (``manifest.json``, or the
manifest inside a DCP-layout ``.metadata``, FORMAT.md §8); nothing is unpickled and no
tensor data is read. A stock DCP directory keeps its metadata in a
pickle (``.metadata``), which could run code when loaded: it is read by the restricted
unpickler of :mod:`quicksave.loading.dcp_stock` (DCP's metadata classes only), or fully only
when the caller explicitly allows it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from quicksave.commit import CheckpointKind
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_name, element_size
from quicksave.loading.checkpoint import require_committed
from quicksave.storage import Location, StorageOptions, parse_location

_TAG_TYPES = {
    "float": "float",
    "tuple": "tuple",
    "dict": "dict",
    "set": "set",
    "frozenset": "frozenset",
    "complex": "complex",
    "bytes": "bytes",
    "bytearray": "bytearray",
    "bytesio": "io.BytesIO",
    "dtype": "torch.dtype",
    "size": "torch.Size",
    "device": "torch.device",
    "tensor": "torch.Tensor",
    "ndarray": "numpy.ndarray",
    "npscalar": "numpy scalar",
}
PREVIEW_CHARS = 60


@dataclass(frozen=True)
class TensorInfo:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int  # stored bytes (sum of chunk lengths)
    chunks: int


@dataclass(frozen=True)
class ObjectInfo:
    fqn: str
    type: str
    preview: str  # a short repr of the value ("" when it cannot be shown without pickle)


@dataclass(frozen=True)
class CheckpointSummary:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: the checkpoint directory (absolute).
        format: ``quicksave`` or ``dcp``.
        step: training step (None when not recorded).
        world_size: ranks that wrote it (None for DCP, which does not record it).
        tensors: one entry per tensor, sorted by fqn.
        objects: one entry per non-tensor value, sorted by fqn.
        files: file name -> size in bytes (quicksave: as listed in the manifest; the
            file holding the manifest, ``manifest.json`` or a DCP-layout ``.metadata``,
            is not listed).
        user_metadata: the manifest's free-form metadata (empty for DCP).
        layout: the files' layout: ``quicksave`` (safetensors files, ``manifest.json``)
            or ``dcp`` (DCP's files: a stock DCP checkpoint, or a quicksave one in the
            DCP layout).
    """

    path: str
    format: str
    step: int | None
    world_size: int | None
    tensors: tuple[TensorInfo, ...]
    objects: tuple[ObjectInfo, ...]
    files: dict[str, int] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    layout: str = "quicksave"

    @property
    def tensor_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``quicksave inspect --json``)."""
        doc = asdict(self)
        for t in doc["tensors"]:
            t["shape"] = list(t["shape"])
        doc["totals"] = {
            "tensors": len(self.tensors),
            "objects": len(self.objects),
            "tensor_bytes": self.tensor_bytes,
            "files": len(self.files),
            "file_bytes": self.file_bytes,
        }
        return doc


def object_type(value: Any) -> str:
    """The Python type a typed-JSON value decodes to, without decoding it."""
    if value is None:
        return "NoneType"
    if isinstance(value, dict):
        tag = value.get("$t")
        return _TAG_TYPES.get(tag, f"unknown tag {tag!r}") if isinstance(tag, str) else "invalid"
    return type(value).__name__


def _preview(value: Any, fqn: str, path: str) -> str:
    try:
        text = repr(objcodec.decode(value, fqn=fqn, path=path))
    except CheckpointError as e:
        return f"<{e.message}>"
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _quicksave_summary(loc: Location) -> CheckpointSummary:
    m = read_manifest(loc)
    path = loc.url
    tensors = tuple(
        TensorInfo(fqn, t.dtype, t.shape, sum(c.length for c in t.chunks), len(t.chunks))
        for fqn, t in sorted(m.tensors.items())
    )
    objects = tuple(
        ObjectInfo(fqn, object_type(o.value), _preview(o.value, fqn, path))
        for fqn, o in sorted(m.objects.items())
    )
    return CheckpointSummary(
        path=path,
        format="quicksave",
        step=m.step,
        world_size=m.world_size,
        tensors=tensors,
        objects=objects,
        files={name: f.size for name, f in sorted(m.files.items())},
        user_metadata=dict(m.user_metadata),
        layout=m.layout,
    )


def _dcp_summary(loc: Location, allow_pickle: bool) -> CheckpointSummary:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from quicksave.loading.catalog import _step_from_name
    from quicksave.loading.dcp_stock import read_dcp_metadata
    from quicksave.storage.checkpoint_dir import CheckpointDir

    md = read_dcp_metadata(loc, allow_pickle=allow_pickle)
    path = loc.url
    tensors, objects = [], []
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            esize = element_size(dtype)
            nbytes = 0
            for c in item.chunks:
                n = 1
                for s in c.sizes:
                    n *= s
                nbytes += n * esize
            tensors.append(
                TensorInfo(fqn, dtype_name(dtype), tuple(item.size), nbytes, len(item.chunks))
            )
        else:
            objects.append(ObjectInfo(fqn, "object (torch.save bytes)", ""))
    return CheckpointSummary(
        path=path,
        format="dcp",
        step=_step_from_name(loc.name),
        world_size=None,
        tensors=tuple(tensors),
        objects=tuple(objects),
        files=dict(sorted(CheckpointDir(loc).sizes().items())),
        layout="dcp",
    )


def inspect_checkpoint(
    path: str | os.PathLike[str] | Location,
    *,
    allow_pickle: bool = False,
    storage: StorageOptions | None = None,
) -> CheckpointSummary:
    """Describe the tensors and values in the checkpoint at ``path``.

    Args:
        path: a committed quicksave checkpoint, or a stock ``torch.distributed.checkpoint``
            directory: a path, or a ``file://``, ``s3://`` or ``msc://`` URL.
        allow_pickle: unpickle a DCP directory's ``.metadata`` without restriction.
            Unpickling runs code named by the file: only for checkpoints you trust.
            Without it the pickle is read by a restricted unpickler that admits only
            DCP's metadata classes (:mod:`quicksave.loading.dcp_stock`). Never needed for
            quicksave checkpoints.

    Returns:
        A :class:`CheckpointSummary`.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or not a checkpoint.
        NotCommittedError: an uncommitted (temporary or partial) checkpoint.
        CorruptCheckpointError: the manifest is damaged, or a DCP ``.metadata`` is not
            DCP metadata (names the refused global when the restricted unpickler refused
            it).

    Example::

        summary = inspect_checkpoint("ckpt/step-100")
        print(summary.step, len(summary.tensors))
    """
    loc = parse_location(path, options=storage)
    if require_committed(loc, allow_dcp=True).kind is CheckpointKind.QUICKSAVE:
        return _quicksave_summary(loc)
    return _dcp_summary(loc, allow_pickle)
