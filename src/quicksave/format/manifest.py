"""The manifest: frozen dataclasses <-> versioned JSON, with a self-checksum.

``manifest.json`` is the commit of a checkpoint. It is written last, from these
dataclasses, with a deterministic layout (the same state gives the same bytes) and ends
with ``"manifest_xxh3_64"``: the xxh3-64 of the file's bytes with that value replaced by
16 zeros. Any changed byte is therefore detected. Spec: docs/FORMAT.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from . import FORMAT_NAME, FORMAT_VERSION

_CHECKSUM_KEY = '"manifest_xxh3_64":"'
_ZERO_DIGEST = "0" * 16
MAX_MANIFEST_BYTES = 1 << 30


def hexdigest(value: int) -> str:
    return f"{value:016x}"


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor: the box ``offsets``..``offsets+sizes`` of the
    global tensor, whose raw little-endian bytes are at ``file[offset:offset+length]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    xxh3_64: str


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    path: tuple[str | int, ...] | None = None  # nested state-dict path, if flattened


@dataclass(frozen=True)
class ObjectEntry:
    value: Any  # typed JSON, see format/objects.py
    path: tuple[str | int, ...] | None = None


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint. Data files (``rank`` set) carry the xxh3-64 of their
    safetensors header region ``[0, data_start)``; other files the xxh3-64 of all bytes."""

    size: int
    xxh3_64: str
    rank: int | None = None
    data_start: int | None = None


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk a rank held when the save was planned (before deduplication): the box
    ``offsets``..``offsets+sizes`` of tensor ``fqn`` (global ``shape``, ``dtype`` name)."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RankPlan:
    """What one rank held when the save was planned: its tensor chunks and the fqns of its
    non-tensor values. A resumed job compares its own plan with it to reuse the plans."""

    tensors: tuple[PlannedChunk, ...]
    objects: tuple[str, ...]

    def normalized(self) -> RankPlan:
        """The same plan in a canonical order (plan equality ignores item order)."""
        return RankPlan(
            tuple(sorted(self.tensors, key=lambda c: (c.fqn, c.offsets))),
            tuple(sorted(self.objects)),
        )


@dataclass(frozen=True)
class Manifest:
    step: int | None
    world_size: int
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    files: dict[str, FileEntry]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    plans: tuple[RankPlan, ...] | None = None  # per rank; loading never needs it

    def total_tensor_bytes(self) -> int:
        return sum(c.length for t in self.tensors.values() for c in t.chunks)


# --------------------------------------------------------------------------- encode


def _chunk_json(c: ChunkEntry) -> dict[str, Any]:
    return {
        "offsets": list(c.offsets),
        "sizes": list(c.sizes),
        "file": c.file,
        "offset": c.offset,
        "length": c.length,
        "xxh3_64": c.xxh3_64,
    }


def _opt_path(d: dict[str, Any], path: tuple | None) -> dict[str, Any]:
    if path is not None:
        d["path"] = list(path)
    return d


def _plan_json(p: RankPlan) -> dict[str, Any]:
    return {
        "tensors": [
            {
                "fqn": c.fqn,
                "offsets": list(c.offsets),
                "sizes": list(c.sizes),
                "shape": list(c.shape),
                "dtype": c.dtype,
            }
            for c in p.tensors
        ],
        "objects": list(p.objects),
    }


def to_json_bytes(m: Manifest) -> bytes:
    """Serialize deterministically and append the self-checksum."""
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": m.format_version,
        "step": m.step,
        "world_size": m.world_size,
        "tensors": {
            fqn: _opt_path(
                {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": [_chunk_json(c) for c in t.chunks],
                },
                t.path,
            )
            for fqn, t in sorted(m.tensors.items())
        },
        "objects": {
            fqn: _opt_path({"value": o.value}, o.path) for fqn, o in sorted(m.objects.items())
        },
        "files": {
            name: {
                k: v
                for k, v in (
                    ("size", f.size),
                    ("xxh3_64", f.xxh3_64),
                    ("rank", f.rank),
                    ("data_start", f.data_start),
                )
                if v is not None
            }
            for name, f in sorted(m.files.items())
        },
        "user_metadata": m.user_metadata,
    }
    if m.plans is not None:
        doc["plans"] = [_plan_json(p) for p in m.plans]
    doc["manifest_xxh3_64"] = _ZERO_DIGEST  # last, always (FORMAT.md §2)
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False) + "\n"
    data = text.encode("ascii")
    digest = hexdigest(xxhash.xxh3_64_intdigest(data))
    pos = data.rindex(_CHECKSUM_KEY.encode()) + len(_CHECKSUM_KEY)
    return data[:pos] + digest.encode() + data[pos + 16 :]


# --------------------------------------------------------------------------- decode


def _check_self_digest(data: bytes, path: str) -> None:
    key = _CHECKSUM_KEY.encode()
    pos = data.rfind(key)
    if pos < 0:
        raise CorruptCheckpointError("manifest has no manifest_xxh3_64 checksum", path=path)
    pos += len(key)
    stored = data[pos : pos + 16]
    zeroed = data[:pos] + _ZERO_DIGEST.encode() + data[pos + 16 :]
    actual = hexdigest(xxhash.xxh3_64_intdigest(zeroed)).encode()
    if stored != actual:
        raise CorruptCheckpointError(
            f"manifest checksum mismatch (stored {stored.decode('ascii', 'replace')}, "
            f"computed {actual.decode()}): the manifest was modified or damaged",
            path=path,
        )


def _req(obj: dict, key: str, kind: type | tuple[type, ...], where: str, path: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"manifest: {where} lacks '{key}'", path=path)
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpointError(f"manifest: {where}.{key} has the wrong type", path=path)
    return value


def _int_tuple(values: Any, where: str, path: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise CorruptCheckpointError(f"manifest: {where} must be a list of integers ≥ 0", path=path)
    return tuple(values)


def _plans(doc: dict, world_size: int, path: str) -> tuple[RankPlan, ...] | None:
    raw = doc.get("plans")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != world_size:
        raise CorruptCheckpointError(
            f"manifest: plans must be a list of world_size={world_size} rank plans", path=path
        )
    out = []
    for rank, p in enumerate(raw):
        w = f"plans[{rank}]"
        chunks = []
        for i, c in enumerate(_req(p, "tensors", list, w, path)):
            cw = f"{w}.tensors[{i}]"
            fqn = _req(c, "fqn", str, cw, path)
            offsets = _int_tuple(_req(c, "offsets", list, cw, path), f"{cw}.offsets", path)
            sizes = _int_tuple(_req(c, "sizes", list, cw, path), f"{cw}.sizes", path)
            shape = _int_tuple(_req(c, "shape", list, cw, path), f"{cw}.shape", path)
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True))
            ):
                raise CorruptCheckpointError(
                    f"manifest: {cw} lies outside shape {list(shape)}",
                    path=path,
                    fqn=fqn,
                    rank=rank,
                )
            chunks.append(PlannedChunk(fqn, offsets, sizes, shape, _req(c, "dtype", str, cw, path)))
        objs = _req(p, "objects", list, w, path)
        if not all(isinstance(o, str) for o in objs):
            raise CorruptCheckpointError(f"manifest: {w}.objects must be strings", path=path)
        out.append(RankPlan(tuple(chunks), tuple(objs)))
    return tuple(out)


def from_json_bytes(data: bytes, path: str = "manifest.json") -> Manifest:
    """Parse and validate a manifest. Raises CorruptCheckpointError naming ``path``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError("manifest larger than 1 GiB", path=path)
    _check_self_digest(data, path)
    try:
        doc = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON: {e}", path=path) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError("not a quicksave manifest", path=path)
    version = _req(doc, "format_version", int, "manifest", path)
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"manifest format_version {version} is not supported by this quicksave "
            f"(reads version {FORMAT_VERSION}); upgrade quicksave",
            path=path,
        )
    step = doc.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CorruptCheckpointError("manifest: step must be an integer or null", path=path)
    world_size = _req(doc, "world_size", int, "manifest", path)

    files: dict[str, FileEntry] = {}
    for name, f in _req(doc, "files", dict, "manifest", path).items():
        w = f"files[{name!r}]"
        if "/" in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"manifest: bad file name {name!r}", path=path)
        files[name] = FileEntry(
            size=_req(f, "size", int, w, path),
            xxh3_64=_req(f, "xxh3_64", str, w, path),
            rank=f.get("rank"),
            data_start=f.get("data_start"),
        )

    tensors: dict[str, TensorEntry] = {}
    for fqn, t in _req(doc, "tensors", dict, "manifest", path).items():
        w = f"tensors[{fqn!r}]"
        shape = _int_tuple(_req(t, "shape", list, w, path), f"{w}.shape", path)
        chunks = []
        for i, c in enumerate(_req(t, "chunks", list, w, path)):
            cw = f"{w}.chunks[{i}]"
            file = _req(c, "file", str, cw, path)
            if file not in files:
                raise CorruptCheckpointError(
                    f"manifest: {cw} names unknown file {file!r}", path=path, fqn=fqn
                )
            offsets = _int_tuple(_req(c, "offsets", list, cw, path), f"{cw}.offsets", path)
            sizes = _int_tuple(_req(c, "sizes", list, cw, path), f"{cw}.sizes", path)
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True))
            ):
                raise CorruptCheckpointError(
                    f"manifest: {cw} lies outside shape {list(shape)}", path=path, fqn=fqn
                )
            chunks.append(
                ChunkEntry(
                    offsets=offsets,
                    sizes=sizes,
                    file=file,
                    offset=_req(c, "offset", int, cw, path),
                    length=_req(c, "length", int, cw, path),
                    xxh3_64=_req(c, "xxh3_64", str, cw, path),
                )
            )
        p = t.get("path")
        tensors[fqn] = TensorEntry(
            dtype=_req(t, "dtype", str, w, path),
            shape=shape,
            chunks=tuple(chunks),
            path=tuple(p) if isinstance(p, list) else None,
        )

    objects: dict[str, ObjectEntry] = {}
    for fqn, o in _req(doc, "objects", dict, "manifest", path).items():
        if not isinstance(o, dict) or "value" not in o:
            raise CorruptCheckpointError(
                f"manifest: objects[{fqn!r}] lacks 'value'", path=path, fqn=fqn
            )
        p = o.get("path")
        objects[fqn] = ObjectEntry(value=o["value"], path=tuple(p) if isinstance(p, list) else None)

    user = doc.get("user_metadata", {})
    return Manifest(
        step=step,
        world_size=world_size,
        tensors=tensors,
        objects=objects,
        files=files,
        user_metadata=user if isinstance(user, dict) else {},
        format_version=version,
        plans=_plans(doc, world_size, path),
    )


def read_manifest(checkpoint: str | os.PathLike[str]) -> Manifest:
    from . import MANIFEST_NAME

    path = os.path.join(os.fspath(checkpoint), MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError("manifest.json is missing", path=path) from None
    except OSError as e:
        raise CorruptCheckpointError(f"cannot read manifest: {e.strerror}", path=path) from None
    return from_json_bytes(data, path)
