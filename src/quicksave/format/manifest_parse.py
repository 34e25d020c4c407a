"""Parsing a manifest: JSON bytes -> the dataclasses of :mod:`.manifest`, every member
checked (type, range, names, the self-checksum, chunk references) before anything is
read or allocated from it. Spec: docs/FORMAT.md §2, §7, §9."""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any, NoReturn

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CorruptCheckpointError
from quicksave.format import ALIGNMENT, FORMAT_NAME, FORMAT_VERSION, READ_VERSIONS, strict_json
from quicksave.format.dtype_names import element_size_of_name
from quicksave.format.keys import typed_path
from quicksave.format.manifest import (
    CHECKSUM_KEY,
    INT_LIMIT,
    LAYOUT_DCP,
    LAYOUT_QUICKSAVE,
    MAX_MANIFEST_BYTES,
    ZERO_DIGEST,
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    PlannedChunk,
    RankPlan,
    TensorEntry,
)
from quicksave.format.naming import bad_member_name

_DIGEST = re.compile(r"[0-9a-f]{16}\Z")
_DTYPE_NAME = re.compile(r"[a-z0-9_]{1,64}\Z")


def _check_self_digest(data: bytes, path: str) -> None:
    key = CHECKSUM_KEY.encode()
    pos = data.rfind(key)
    if pos < 0:
        raise CorruptCheckpointError("manifest has no manifest_xxh3_64 checksum", path=path)
    pos += len(key)
    stored = data[pos : pos + 16]
    zeroed = data[:pos] + ZERO_DIGEST.encode() + data[pos + 16 :]
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


def _base(c: dict, cw: str, fqn: str, step: int | None, layout: str, path: str) -> int | None:
    """The step whose checkpoint holds the chunk's bytes (FORMAT.md §9), or None."""
    if "base" not in c:
        return None
    base = c["base"]
    if not _is_int(base):
        _fail(
            f"{cw}.base must be a step (an integer in [0, 2**63)), got {str(base)[:80]!r}",
            path,
            fqn,
        )
    if layout != LAYOUT_QUICKSAVE:
        _fail(f"{cw}.base: layout {layout!r} has no chunk references", path, fqn)
    if step is None or base >= step:
        _fail(f"{cw}.base {base} must be below the checkpoint's own step {step}", path, fqn)
    return base


def _chunk(
    c: Any,
    cw: str,
    fqn: str,
    shape: tuple[int, ...],
    esize: int | None,
    files: dict[str, FileEntry],
    layout: str,
    path: str,
    step: int | None,
) -> ChunkEntry:
    file = _req(c, "file", str, cw, path)
    base = _base(c, cw, fqn, step, layout, path)
    entry = files.get(file)
    if base is not None:
        # A file of the base, which need not be listed here: a plain name (the base's
        # manifest, where the bytes are read, lists it with its data_start).
        if bad_member_name(file) is not None:
            _fail(f"{cw} names bad file {file!r}", path, fqn)
        entry = FileEntry(size=INT_LIMIT - 1, xxh3_64=ZERO_DIGEST, rank=0, data_start=ALIGNMENT)
    elif entry is None:
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
    return ChunkEntry(offsets, sizes, file, offset, length, _digest(c, cw, path, fqn), base)


def _tensors(
    doc: dict, files: dict[str, FileEntry], layout: str, path: str, step: int | None
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
            _chunk(c, f"{w}.chunks[{i}]", fqn, shape, esize, files, layout, path, step)
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


def _checked_json(data: bytes, path: str) -> Any:
    """A manifest's JSON document, once its size and self-checksum are checked."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError("manifest larger than 1 GiB", path=path)
    _check_self_digest(data, path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON: {e}", path=path) from None
    return strict_json.loads(text, what="manifest", path=path)


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
    doc = _checked_json(data, path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError("not a quicksave manifest", path=path)
    version = _req(doc, "format_version", int, "manifest", path)
    if version not in READ_VERSIONS:
        raise CorruptCheckpointError(
            f"manifest format_version {version} is not supported by this quicksave "
            f"(reads versions {' and '.join(map(str, READ_VERSIONS))}); upgrade quicksave",
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
    tensors = _tensors(doc, files, got, path, step)
    refers = any(c.base is not None for t in tensors.values() for c in t.chunks)
    if refers != (version != FORMAT_VERSION):
        why = (
            "has chunk references (base): it must be 2"
            if refers
            else "must be 1: no chunk has a base"
        )
        _fail(f"format_version {version} {why}", path)
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
        plans=_plans(doc, world_size, path),
        layout=got,
        empty_dicts=_empty_dicts(doc, path),
    )


def bases_in(data: bytes, path: str = "manifest.json") -> frozenset[int]:
    """The steps that a manifest's chunks refer to (FORMAT.md §9), without validating
    the rest: what retention asks of every new checkpoint it keeps (a whole parse of a
    600-chunk manifest costs ~18 ms of the trainer's CPU; this, a third of it). The
    self-checksum is checked first, so a damaged manifest is refused, never half-read.

    Raises:
        CorruptCheckpointError: damaged, not JSON, or a chunk or reference malformed
            (naming ``path`` and the fqn).
    """
    doc = _checked_json(data, path)
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    if not isinstance(tensors, dict):
        _fail("manifest has no tensors object", path)
    out: set[int] = set()
    for fqn, entry in tensors.items():
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            _fail("the tensor's chunks are malformed", path, fqn)
        for c in chunks:
            base = c.get("base")
            if base is not None:
                if not _is_int(base):
                    _fail("a chunk's base must be an integer step in [0, 2**63)", path, fqn)
                out.add(base)
    return frozenset(out)
