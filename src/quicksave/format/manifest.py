"""The manifest: frozen dataclasses -> versioned JSON, with a self-checksum (the parser,
JSON -> dataclasses: :mod:`.manifest_parse`).

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
from dataclasses import dataclass, field
from typing import Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import IncompatibleStateError
from quicksave.format import FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_REFS, strict_json
from quicksave.format.keys import DictKey, key_types_of

CHECKSUM_KEY = '"manifest_xxh3_64":"'
ZERO_DIGEST = "0" * 16
MAX_MANIFEST_BYTES = 1 << 30
INT_LIMIT = 1 << 63  # every size, offset, length, step and rank is below it
LAYOUT_QUICKSAVE = "quicksave"  # safetensors data files, manifest.json (FORMAT.md §1-§3)
LAYOUT_DCP = "dcp"  # DCP's .distcp files, the manifest inside .metadata (FORMAT.md §8)
LAYOUTS = (LAYOUT_QUICKSAVE, LAYOUT_DCP)


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor: the box ``offsets``..``offsets+sizes`` of the
    global tensor, whose raw little-endian bytes are at ``file[offset:offset+length]``
    (layout ``quicksave``: 4 KiB-aligned; ``dcp``: wherever torch.save put them) of the
    checkpoint itself, or, when ``base`` is set, of the checkpoint ``step-<base>`` of
    the same run folder (a chunk reference, FORMAT.md §9)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    xxh3_64: str
    base: int | None = None

    def with_digest(self, xxh3_64: str, base: int | None = None) -> ChunkEntry:
        """This chunk with checksum ``xxh3_64``, referring to the checkpoint of step
        ``base`` if given (``dataclasses.replace``, without its field-by-field lookup: a
        manifest fills thousands at each save)."""
        base = self.base if base is None else base
        return ChunkEntry(
            self.offsets, self.sizes, self.file, self.offset, self.length, xxh3_64, base
        )


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    # nested state-dict path, if flattened; non-str dict keys are DictKey (keys.py)
    path: tuple[str | int, ...] | None = None

    def with_chunks(self, chunks: tuple[ChunkEntry, ...]) -> TensorEntry:
        """This tensor with ``chunks`` (as :meth:`ChunkEntry.with_digest`)."""
        return TensorEntry(self.dtype, self.shape, chunks, self.path)


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
    plans: tuple[RankPlan, ...] | None = None  # per rank; loading never needs it
    layout: str = LAYOUT_QUICKSAVE  # or LAYOUT_DCP (FORMAT.md §8)
    # paths of the state dict's empty dicts, which have no entry (FORMAT.md §2.1)
    empty_dicts: tuple[tuple[str | int, ...], ...] = ()

    def total_tensor_bytes(self) -> int:
        return sum(c.length for t in self.tensors.values() for c in t.chunks)

    @property
    def format_version(self) -> int:
        """The version this manifest is written as: 2 when a chunk refers to an earlier
        checkpoint (FORMAT.md §9), else 1 (what readers without references read)."""
        return FORMAT_VERSION_REFS if self.bases() else FORMAT_VERSION

    def bases(self) -> set[int]:
        """The steps of the earlier checkpoints that chunks of this one refer to."""
        return {c.base for t in self.tensors.values() for c in t.chunks if c.base is not None}


# --------------------------------------------------------------------------- encode


def _chunk_json(c: ChunkEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "offsets": list(c.offsets),
        "sizes": list(c.sizes),
        "file": c.file,
        "offset": c.offset,
        "length": c.length,
        "xxh3_64": c.xxh3_64,
    }
    if c.base is not None:
        out["base"] = c.base
    return out


def _opt_path(d: dict[str, Any], path: tuple | None) -> dict[str, Any]:
    if path is not None:
        for k in path:  # (a manifest has thousands of paths: the common case, fast)
            if isinstance(k, DictKey):
                d["path"] = [str(k) if isinstance(k, DictKey) else k for k in path]
                d["key_types"] = key_types_of(path)
                break
        else:
            d["path"] = list(path)
    return d


def _dumps(value: Any) -> str:
    """``value`` as the manifest encodes JSON: compact, ASCII, no NaN."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _tensors_doc(tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """The manifest's ``tensors`` member, sorted by name."""
    return {
        fqn: _opt_path(
            {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "chunks": [_chunk_json(c) for c in t.chunks],
            },
            t.path,
        )
        for fqn, t in sorted(tensors.items())
    }


_SLOT = "\x00quicksave-checksum\x00"  # a chunk's checksum, left open in a template


class TensorsTemplate:
    """The manifest's ``tensors`` member of a skeleton (every chunk placed, checksums
    empty, no references: ``layout.skeleton``) encoded once with each chunk's checksum
    left open, so that a manifest filled from that skeleton (``commit.parts.
    manifest_from_parts``) encodes its tensors by joining the pieces around its checksums
    and references: the same bytes as :func:`to_json_bytes` alone, without making and
    encoding a dict per chunk (a manifest has thousands; a writer encodes one per save).

    Args:
        skeleton: the skeleton's tensor entries.

    Raises:
        ValueError: the skeleton is not one (a chunk has a checksum or a reference), or a
            name or key path holds the text that marks an open checksum.
    """

    def __init__(self, skeleton: dict[str, TensorEntry]) -> None:
        self.names = sorted(skeleton)
        self.counts = [len(skeleton[fqn].chunks) for fqn in self.names]
        if any(c.xxh3_64 or c.base is not None for t in skeleton.values() for c in t.chunks):
            raise ValueError("a template is made from a skeleton: no checksums, no references")
        opened = {
            fqn: TensorEntry(
                t.dtype,
                t.shape,
                tuple(
                    ChunkEntry(c.offsets, c.sizes, c.file, c.offset, c.length, _SLOT)
                    for c in t.chunks
                ),
                t.path,
            )
            for fqn, t in skeleton.items()
        }
        self.pieces = _dumps(_tensors_doc(opened)).split(_dumps(_SLOT))
        if len(self.pieces) != sum(self.counts) + 1:
            raise ValueError("a name or key path of the skeleton holds the template's marker")
        # the latest fill's tensor entries, and each tensor's text (in ``names`` order)
        self._last: tuple[dict[str, TensorEntry], list[str]] = ({}, [])

    def fill(self, m: Manifest) -> str:
        """The ``tensors`` member of ``m``, filled from this template's skeleton. A tensor
        entry that is the one the latest fill had (:attr:`last`, the same object: a
        frozen tensor of an incremental save, whose chunks and references did not
        change) takes the text encoded then.

        Raises:
            ValueError: ``m``'s tensors are not this skeleton's (names, chunk counts).
        """
        tensors = m.tensors
        if len(tensors) != len(self.names):
            raise ValueError("the manifest's tensors are not the template's")
        last, encoded = self._last
        pieces = self.pieces
        segments: list[str] = []
        i = 1
        for fqn, count in zip(self.names, self.counts, strict=True):
            t = tensors.get(fqn)
            if t is None or len(t.chunks) != count:
                raise ValueError(f"the manifest's tensor {fqn!r} is not the template's")
            if last.get(fqn) is t:
                segments.append(encoded[len(segments)])
                i += count
                continue
            out = []
            for c in t.chunks:
                d, base = c.xxh3_64, c.base
                out.append(f'"{d}"' if d.isascii() and d.isalnum() else _dumps(d))
                if base is not None:
                    out.append(
                        f',"base":{base}' if type(base) is int else f',"base":{_dumps(base)}'
                    )
                out.append(pieces[i])
                i += 1
            segments.append("".join(out))
        self._last = (tensors, segments)  # (replaced whole: a fill on another thread
        return pieces[0] + "".join(segments)  # reads the one before or this one)

    @property
    def last(self) -> dict[str, TensorEntry]:
        """The tensor entries of the latest manifest filled (``commit.parts.
        manifest_from_parts`` takes those that did not change as they are)."""
        return self._last[0]


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


def to_json_bytes(m: Manifest, template: TensorsTemplate | None = None) -> bytes:
    """Serialize deterministically and append the self-checksum; ``template``: the
    template of ``m``'s tensors (:class:`TensorsTemplate`, made from the skeleton ``m`` was
    filled from), which encodes them faster, to the same bytes.

    Raises:
        IncompatibleStateError: ``user_metadata`` holds something readers refuse
            (nesting, huge integers, NaN; FORMAT.md §2).
        ValueError: ``m.layout`` is not one of :data:`LAYOUTS`; a chunk refers to a
            step not below ``m.step`` (or ``m.step`` is None), or in layout ``dcp``
            (FORMAT.md §9); ``template`` is not of ``m``'s tensors.
    """
    if m.layout not in LAYOUTS:
        raise ValueError(f"unknown manifest layout {m.layout!r}; expected one of {LAYOUTS}")
    bases = m.bases()
    if bases and (m.layout != LAYOUT_QUICKSAVE or m.step is None or max(bases) >= m.step):
        raise ValueError(
            f"chunk references to steps {sorted(bases)} need layout {LAYOUT_QUICKSAVE!r} "
            f"and a step above them (step {m.step}, layout {m.layout!r})"
        )
    check_user_metadata(m.user_metadata)
    # the document's members in order, each encoded alone: the same bytes as one
    # json.dumps of the whole (JSON is compositional), and the tensors may come encoded
    doc: dict[str, str] = {
        "format": _dumps(FORMAT_NAME),
        "format_version": _dumps(m.format_version),
        "step": _dumps(m.step),
        "world_size": _dumps(m.world_size),
        "tensors": _dumps(_tensors_doc(m.tensors)) if template is None else template.fill(m),
        "objects": _dumps(
            {fqn: _opt_path({"value": o.value}, o.path) for fqn, o in sorted(m.objects.items())}
        ),
        "files": _dumps(
            {
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
            }
        ),
        "user_metadata": _dumps(m.user_metadata),
    }
    if m.plans is not None:
        doc["plans"] = _dumps([_plan_json(p) for p in m.plans])
    if m.empty_dicts:
        doc["empty_dicts"] = _dumps([_opt_path({}, p) for p in sorted(m.empty_dicts, key=repr)])
    if m.layout == LAYOUT_DCP:
        doc["layout"] = _dumps(LAYOUT_DCP)  # right before the self-checksum (FORMAT.md §8)
    doc["manifest_xxh3_64"] = _dumps(ZERO_DIGEST)  # last, always (FORMAT.md §2)
    text = "{" + ",".join(f"{_dumps(k)}:{v}" for k, v in doc.items()) + "}\n"
    data = text.encode("ascii")
    digest = hexdigest(xxhash.xxh3_64_intdigest(data))
    pos = data.rindex(CHECKSUM_KEY.encode()) + len(CHECKSUM_KEY)
    return data[:pos] + digest.encode() + data[pos + 16 :]
