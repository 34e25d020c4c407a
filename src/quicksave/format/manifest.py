"""The manifest: frozen dataclasses <-> versioned JSON, with a self-checksum.

``manifest.json`` is the commit of a checkpoint. It is written last, from these
dataclasses, with a deterministic layout (the same state gives the same bytes) and ends
with ``"manifest_xxh3_64"``: the xxh3-64 of the file's bytes with that value replaced by
16 zeros. Any changed byte is therefore detected. Spec: docs/FORMAT.md.

Two on-disk layouts share this manifest: ``quicksave`` (safetensors data files, the
manifest in ``manifest.json``) and ``dcp`` (DCP's own ``__{rank}_{i}.distcp`` files, the
manifest inside ``.metadata`` after DCP's pickle; FORMAT.md §8, :mod:`.dcp_layout`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NoReturn

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError
from quicksave.format import ALIGNMENT, FORMAT_NAME, FORMAT_VERSION, strict_json
from quicksave.format.dtype_names import element_size_of_name
from quicksave.format.keys import DictKey, key_types_of, typed_path
from quicksave.format.naming import bad_member_name

_CHECKSUM_KEY = '"manifest_xxh3_64":"'
_ZERO_DIGEST = "0" * 16
MAX_MANIFEST_BYTES = 1 << 30
INT_LIMIT = 1 << 63  # every size, offset, length, step and rank is below it
_DIGEST = re.compile(r"[0-9a-f]{16}\Z")
_DTYPE_NAME = re.compile(r"[a-z0-9_]{1,64}\Z")
LAYOUT_QUICKSAVE = "quicksave"  # safetensors data files, manifest.json (FORMAT.md §1-§3)
LAYOUT_DCP = "dcp"  # DCP's .distcp files, the manifest inside .metadata (FORMAT.md §8)
LAYOUTS = (LAYOUT_QUICKSAVE, LAYOUT_DCP)


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor: the box ``offsets``..``offsets+sizes`` of the
    global tensor, whose raw little-endian bytes are at ``file[offset:offset+length]``
    (layout ``quicksave``: 4 KiB-aligned; ``dcp``: wherever torch.save put them)."""

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
    # nested state-dict path, if flattened; non-str dict keys are DictKey (keys.py)
    path: tuple[str | int, ...] | None = None


@dataclass(frozen=True)
class ObjectEntry:
    value: Any  # typed JSON, see format/objects.py
    path: tuple[str | int, ...] | None = None


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint. Layout ``quicksave``: data files (``rank`` and
    ``data_start`` set) carry the xxh3-64 of their safetensors header region
    ``[0, data_start)``; other files the xxh3-64 of all bytes. Layout ``dcp``: only data
    files are listed (``rank`` set, ``data_start`` None), each with the xxh3-64 of all its
    bytes outside its chunks, in file order."""

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
    empty_dicts: tuple[tuple[str | int, ...], ...] = ()  # this rank's (Manifest.empty_dicts)

    def normalized(self) -> RankPlan:
        """The same plan in a canonical order (plan equality ignores item order)."""
        return RankPlan(
            tuple(sorted(self.tensors, key=lambda c: (c.fqn, c.offsets))),
            tuple(sorted(self.objects)),
            tuple(sorted(self.empty_dicts, key=repr)),
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
    layout: str = LAYOUT_QUICKSAVE  # or LAYOUT_DCP (FORMAT.md §8)
    # paths of the state dict's empty dicts, which have no entry (FORMAT.md §2.1)
    empty_dicts: tuple[tuple[str | int, ...], ...] = ()

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
        d["path"] = [str(k) if isinstance(k, DictKey) else k for k in path]
        types = key_types_of(path)
        if types is not None:
            d["key_types"] = types
    return d


def _plan_json(p: RankPlan) -> dict[str, Any]:
    out: dict[str, Any] = {
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
    if p.empty_dicts:
        out["empty_dicts"] = [_opt_path({}, e) for e in sorted(p.empty_dicts, key=repr)]
    return out


def check_user_metadata(value: Any, path: str | None = None, rank: int | None = None) -> None:
    """Raise unless ``value`` can be stored as ``user_metadata`` (a dict of JSON that
    readers accept). Writers call it before any I/O.

    Raises:
        IncompatibleStateError: not a dict, or something readers refuse (nesting, huge
            integers, NaN, non-JSON values; FORMAT.md §2).
    """
    if not isinstance(value, dict):
        raise IncompatibleStateError(
            f"user_metadata must be a dict, got {type(value).__name__}", path=path, rank=rank
        )
    why = strict_json.unwritable(value, strict_json.MAX_DEPTH - 2)
    if why is not None:
        raise IncompatibleStateError(f"user_metadata cannot be stored: {why}", path=path, rank=rank)


def to_json_bytes(m: Manifest) -> bytes:
    """Serialize deterministically and append the self-checksum.

    Raises:
        IncompatibleStateError: ``user_metadata`` holds something readers refuse
            (nesting, huge integers, NaN; FORMAT.md §2).
        ValueError: ``m.layout`` is not one of :data:`LAYOUTS`.
    """
    if m.layout not in LAYOUTS:
        raise ValueError(f"unknown manifest layout {m.layout!r}; expected one of {LAYOUTS}")
    check_user_metadata(m.user_metadata)
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
    if m.empty_dicts:
        doc["empty_dicts"] = [_opt_path({}, p) for p in sorted(m.empty_dicts, key=repr)]
    if m.layout == LAYOUT_DCP:
        doc["layout"] = LAYOUT_DCP  # right before the self-checksum (FORMAT.md §8)
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


def _fail(message: str, path: str, fqn: str | None = None, rank: int | None = None) -> NoReturn:
    raise CorruptCheckpointError(f"manifest: {message}", path=path, fqn=fqn, rank=rank)


def _req(obj: dict, key: str, kind: type | tuple[type, ...], where: str, path: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        _fail(f"{where} lacks '{key}'", path)
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        _fail(f"{where}.{key} has the wrong type", path)
    return value


def _is_int(value: Any, lo: int = 0, hi: int = INT_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def _int(obj: dict, key: str, where: str, path: str, lo: int = 0, fqn: str | None = None) -> int:
    value = _req(obj, key, int, where, path)
    if not _is_int(value, lo):
        _fail(f"{where}.{key} must be an integer in [{lo}, 2**63)", path, fqn)
    return value


def _digest(obj: dict, where: str, path: str, fqn: str | None = None) -> str:
    value = _req(obj, "xxh3_64", str, where, path)
    if not _DIGEST.match(value):
        _fail(f"{where}.xxh3_64 must be 16 lowercase hex digits", path, fqn)
    return value


def _dtype(obj: dict, where: str, path: str, fqn: str | None = None) -> str:
    value = _req(obj, "dtype", str, where, path)
    if not _DTYPE_NAME.match(value):
        _fail(f"{where}.dtype {value[:80]!r} is not a dtype name", path, fqn)
    return value


def _int_tuple(values: Any, where: str, path: str, fqn: str | None = None) -> tuple[int, ...]:
    # ``type(v) is int``: parsed JSON has no int subclasses but bool, which it excludes.
    if not isinstance(values, list) or not all(
        type(v) is int and 0 <= v < INT_LIMIT for v in values
    ):
        _fail(f"{where} must be a list of integers in [0, 2**63)", path, fqn)
    return tuple(values)


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _box(
    offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...], where: str, path: str
) -> str | None:
    """Why the box ``offsets``..``offsets+sizes`` is not inside ``shape``, or None."""
    if (
        len(offsets) != len(shape)
        or len(sizes) != len(shape)
        or any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True))
    ):
        return f"{where} lies outside shape {list(shape)}"
    return None


def _state_path(entry: dict, where: str, path: str, fqn: str) -> tuple[str | int, ...] | None:
    p = entry.get("path")
    if p is None:
        return None
    if not isinstance(p, list) or not p or not all(isinstance(k, str) or _is_int(k) for k in p):
        _fail(f"{where}.path must be a non-empty list of strings and integers ≥ 0", path, fqn)
    try:
        return typed_path(p, entry.get("key_types"))
    except ValueError as e:
        _fail(f"{where}.key_types: {e}", path, fqn)


def _empty_dicts(doc: dict, path: str) -> tuple[tuple[str | int, ...], ...]:
    raw = doc.get("empty_dicts", [])
    if not isinstance(raw, list):
        _fail("empty_dicts must be a list", path)
    out = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict) or "path" not in e:
            _fail(f"empty_dicts[{i}] lacks 'path'", path)
        out.append(_state_path(e, f"empty_dicts[{i}]", path, str(e["path"])[:200]))
    return tuple(p for p in out if p is not None)


def _plans(doc: dict, world_size: int, path: str) -> tuple[RankPlan, ...] | None:
    raw = doc.get("plans")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != world_size:
        _fail(f"plans must be a list of world_size={world_size} rank plans", path)
    out = []
    for rank, p in enumerate(raw):
        w = f"plans[{rank}]"
        chunks = []
        for i, c in enumerate(_req(p, "tensors", list, w, path)):
            cw = f"{w}.tensors[{i}]"
            fqn = _req(c, "fqn", str, cw, path)
            offsets = _int_tuple(_req(c, "offsets", list, cw, path), f"{cw}.offsets", path, fqn)
            sizes = _int_tuple(_req(c, "sizes", list, cw, path), f"{cw}.sizes", path, fqn)
            shape = _int_tuple(_req(c, "shape", list, cw, path), f"{cw}.shape", path, fqn)
            why = _box(offsets, sizes, shape, cw, path)
            if why is not None:
                _fail(why, path, fqn, rank)
            chunks.append(PlannedChunk(fqn, offsets, sizes, shape, _dtype(c, cw, path, fqn)))
        objs = _req(p, "objects", list, w, path)
        if not all(isinstance(o, str) for o in objs):
            _fail(f"{w}.objects must be strings", path)
        out.append(RankPlan(tuple(chunks), tuple(objs), _empty_dicts(p, path)))
    return tuple(out)


def _files(doc: dict, world_size: int, layout: str, path: str) -> dict[str, FileEntry]:
    from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME

    files: dict[str, FileEntry] = {}
    for name, f in _req(doc, "files", dict, "manifest", path).items():
        w = f"files[{name!r}]"
        if (
            bad_member_name(name) is not None
            or name == MANIFEST_NAME
            or (layout == LAYOUT_DCP and name == DCP_METADATA_NAME)
        ):
            _fail(f"bad file name {name!r}", path)
        size = _int(f, "size", w, path)
        digest = _digest(f, w, path)
        rank = data_start = None
        if layout == LAYOUT_DCP:  # data files only, digest of the bytes outside chunks
            rank = _int(f, "rank", w, path)
            if rank >= world_size:
                _fail(f"{w}.rank {rank} is not below world_size {world_size}", path)
            if f.get("data_start") is not None:
                _fail(f"{w} has data_start, which layout 'dcp' does not use", path)
        elif f.get("rank") is not None or f.get("data_start") is not None:
            rank = _int(f, "rank", w, path)
            data_start = _int(f, "data_start", w, path, lo=8)
            if rank >= world_size:
                _fail(f"{w}.rank {rank} is not below world_size {world_size}", path)
            if data_start % ALIGNMENT or data_start > size:
                _fail(
                    f"{w}.data_start {data_start} must be a multiple of {ALIGNMENT} "
                    f"within the file's size {size}",
                    path,
                )
        files[name] = FileEntry(size=size, xxh3_64=digest, rank=rank, data_start=data_start)
    return files


def _chunk(
    c: Any,
    cw: str,
    fqn: str,
    shape: tuple[int, ...],
    esize: int | None,
    files: dict[str, FileEntry],
    layout: str,
    path: str,
) -> ChunkEntry:
    file = _req(c, "file", str, cw, path)
    entry = files.get(file)
    if entry is None:
        _fail(f"{cw} names unknown file {file!r}", path, fqn)
    offsets = _int_tuple(_req(c, "offsets", list, cw, path), f"{cw}.offsets", path, fqn)
    sizes = _int_tuple(_req(c, "sizes", list, cw, path), f"{cw}.sizes", path, fqn)
    why = _box(offsets, sizes, shape, cw, path)
    if why is not None:
        _fail(why, path, fqn)
    offset = _int(c, "offset", cw, path, fqn=fqn)
    length = _int(c, "length", cw, path, fqn=fqn)
    if layout == LAYOUT_DCP:  # anywhere torch.save put it, inside the file
        if offset + length > entry.size:
            _fail(
                f"{cw} (bytes {offset}..{offset + length}) lies beyond the size "
                f"{entry.size} of {file!r}",
                path,
                fqn,
            )
    elif entry.data_start is None:
        _fail(f"{cw} is stored in {file!r}, which is not a data file", path, fqn)
    elif offset % ALIGNMENT or offset < entry.data_start:
        _fail(
            f"{cw}.offset {offset} must be a multiple of {ALIGNMENT} at or after the "
            f"data region of {file!r} (byte {entry.data_start})",
            path,
            fqn,
        )
    if esize is not None and length != _numel(sizes) * esize:
        _fail(
            f"{cw}.length is {length}, but sizes {list(sizes)} of {esize}-byte elements "
            f"need {_numel(sizes) * esize}",
            path,
            fqn,
        )
    return ChunkEntry(offsets, sizes, file, offset, length, _digest(c, cw, path, fqn))


def _tensors(
    doc: dict, files: dict[str, FileEntry], layout: str, path: str
) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for fqn, t in _req(doc, "tensors", dict, "manifest", path).items():
        w = f"tensors[{fqn!r}]"
        dtype = _dtype(t, w, path, fqn)
        shape = _int_tuple(_req(t, "shape", list, w, path), f"{w}.shape", path, fqn)
        # An unknown name (a newer torch) fails when the tensor is read, not here.
        esize = element_size_of_name(dtype)
        if _numel(shape) * (esize or 1) >= INT_LIMIT:
            _fail(f"{w}.shape {list(shape)} holds 2**63 bytes or more", path, fqn)
        chunks = tuple(
            _chunk(c, f"{w}.chunks[{i}]", fqn, shape, esize, files, layout, path)
            for i, c in enumerate(_req(t, "chunks", list, w, path))
        )
        tensors[fqn] = TensorEntry(dtype, shape, chunks, _state_path(t, w, path, fqn))
    if layout == LAYOUT_DCP:
        _check_disjoint(tensors, path)
    return tensors


def _check_disjoint(tensors: dict[str, TensorEntry], path: str) -> None:
    """Layout ``dcp``: no two chunks share a byte of a file (each is one torch.save
    record; the bytes between them are covered by the file's own digest)."""
    spans = sorted(
        (c.file, c.offset, c.offset + c.length, fqn)
        for fqn, t in tensors.items()
        for c in t.chunks
        if c.length
    )
    for (file, _, end, fqn), (file2, start2, _, fqn2) in pairwise(spans):
        if file == file2 and start2 < end:
            _fail(
                f"chunks of {fqn!r} and {fqn2!r} overlap in {file!r} (byte {start2})",
                path,
                fqn2,
            )


def from_json_bytes(
    data: bytes, path: str = "manifest.json", *, layout: str | None = None
) -> Manifest:
    """Parse and validate a manifest (FORMAT.md §2): self-checksum first, then JSON
    under :mod:`~quicksave.format.strict_json`'s limits, then every member's type and
    range, before anything is read or allocated.

    Args:
        data: the manifest's bytes.
        path: named in errors.
        layout: the layout the manifest must declare (where it was found says which:
            ``manifest.json`` holds ``quicksave``, ``.metadata`` ``dcp``); None accepts
            either.

    Raises:
        CorruptCheckpointError: naming ``path`` (and the fqn where there is one).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError("manifest larger than 1 GiB", path=path)
    _check_self_digest(data, path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON: {e}", path=path) from None
    doc = strict_json.loads(text, what="manifest", path=path)
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
    if step is not None and not _is_int(step):
        _fail("step must be null or an integer in [0, 2**63)", path)
    world_size = _int(doc, "world_size", "manifest", path, lo=1)
    got = doc.get("layout", LAYOUT_QUICKSAVE)
    if "layout" in doc and got != LAYOUT_DCP:
        _fail(f"layout must be {LAYOUT_DCP!r} when present", path)
    if layout is not None and got != layout:
        _fail(f"layout {got!r} where a manifest of layout {layout!r} belongs", path)
    files = _files(doc, world_size, got, path)
    tensors = _tensors(doc, files, got, path)
    objects: dict[str, ObjectEntry] = {}
    for fqn, o in _req(doc, "objects", dict, "manifest", path).items():
        w = f"objects[{fqn!r}]"
        if not isinstance(o, dict) or "value" not in o:
            _fail(f"{w} lacks 'value'", path, fqn)
        objects[fqn] = ObjectEntry(value=o["value"], path=_state_path(o, w, path, fqn))
    user = doc.get("user_metadata", {})
    if not isinstance(user, dict):
        _fail("user_metadata must be an object", path)
    strict_json.check_depth(user, what="manifest: user_metadata", path=path)
    return Manifest(
        step=step,
        world_size=world_size,
        tensors=tensors,
        objects=objects,
        files=files,
        user_metadata=user,
        format_version=version,
        plans=_plans(doc, world_size, path),
        layout=got,
        empty_dicts=_empty_dicts(doc, path),
    )
