"""Per-rank manifest parts: how a multi-rank checkpoint commits without gathering.

Every rank's writer, after its data files are durable, writes ``part-rank-RRRRR.json``
under the save's draft key (:meth:`CommitStrategy.write_member`): the checksums of
the chunks it wrote and the values of the objects it owns. The coordinator's writer
reads all parts and fills the manifest skeleton fixed at plan time (every file, offset
and length is known before any byte is written; only checksums and object values come
from the writers). No write result travels through a collective.

A part is written whole or not at all (a file: temporary name, fsync, rename; an
object appears whole) and carries its own checksum, so a torn or foreign file is
refused, never merged. Torch-free: the worker process imports this module.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.commit.strategy import CommitStrategy
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.format import strict_json
from quicksave.format.manifest import MAX_MANIFEST_BYTES, Manifest, ObjectEntry, TensorEntry

PART_FORMAT = "quicksave-part"


def part_name(rank: int) -> str:
    """File name of ``rank``'s part inside the temporary directory."""
    return f"part-rank-{rank:05d}.json"


@dataclass(frozen=True)
class RankPart:
    """What one rank's writer learned while writing (nothing the plan already knew)."""

    rank: int
    chunks: dict[str, str]  # safetensors key -> xxh3-64 hex of the chunk as written
    objects: dict[str, Any]  # fqn -> typed JSON value (objects this rank owns)
    # safetensors key -> the earlier step holding the chunk (an incremental save's
    # references, FORMAT.md §9; their digests are in ``chunks``)
    bases: dict[str, int] = dataclasses.field(default_factory=dict)


def seal(body: dict[str, Any]) -> bytes:
    """``body`` as compact JSON with its own xxh3-64 (``part_xxh3_64``) added, so a
    reader can tell a damaged part from a good one."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body = dict(body, part_xxh3_64=hexdigest(xxhash.xxh3_64_intdigest(raw)))
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _encode(part: RankPart) -> bytes:
    body = {
        "format": PART_FORMAT,
        "rank": part.rank,
        "chunks": part.chunks,
        "objects": part.objects,
    }
    if part.bases:
        body["bases"] = part.bases
    return seal(body)


def write_sealed(
    strategy: CommitStrategy, draft: str, name: str, data: bytes, fsync: bool = True
) -> str:
    """Write ``data`` (``seal``'s) whole or not at all, durably, as ``name`` under
    ``draft`` (:meth:`CommitStrategy.write_member`). Returns its path or URL."""
    return strategy.write_member(draft, name, data, fsync=fsync)


def write_part(strategy: CommitStrategy, draft: str, part: RankPart, fsync: bool = True) -> str:
    """Write ``part`` whole or not at all, durably, under ``draft``. Returns its path
    or URL."""
    return write_sealed(strategy, draft, part_name(part.rank), _encode(part), fsync)


def read_part(strategy: CommitStrategy, draft: str, rank: int) -> RankPart:
    """Read and check ``rank``'s part from under ``draft``.

    Raises:
        CheckpointError: the part is missing (names the rank).
        CorruptCheckpointError: it does not parse, fails its checksum, or is another
            rank's.
    """
    body, path = read_sealed(strategy, draft, rank, PART_FORMAT)
    chunks, objects = body.get("chunks"), body.get("objects")
    bases = body.get("bases", {})
    if (
        not isinstance(chunks, dict)
        or not isinstance(objects, dict)
        or not all(isinstance(v, str) for v in chunks.values())
        or not isinstance(bases, dict)
        or not all(type(v) is int and k in chunks for k, v in bases.items())
    ):
        raise CorruptCheckpointError(
            "the part's chunks, objects and bases are malformed", path=path, rank=rank
        )
    return RankPart(rank, dict(chunks), dict(objects), dict(bases))


def read_sealed(
    strategy: CommitStrategy, draft: str, rank: int, fmt: str
) -> tuple[dict[str, Any], str]:
    """``rank``'s sealed part of format ``fmt`` (``part-rank-RRRRR.json``) from under
    ``draft``, checked: bounded read of a regular file or object, strict JSON, its
    checksum, its format and rank. Returns ``(body without the checksum, its path or
    URL)``.

    Raises:
        CheckpointError: the part is missing (names the rank).
        CorruptCheckpointError: it does not parse, fails its checksum, or is another
            rank's or another format's.
    """
    path = strategy.member_url(draft, part_name(rank))
    try:
        data = strategy.read_member(draft, part_name(rank), MAX_MANIFEST_BYTES)
    except CheckpointNotFoundError:
        raise CheckpointError(
            "this rank's writer left no part (its write did not finish)", path=path, rank=rank
        ) from None
    except CorruptCheckpointError as e:  # not a regular file, or too large
        raise CorruptCheckpointError(f"the part: {e.message}", path=path, rank=rank) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"unreadable part: {e}", path=path, rank=rank) from None
    try:
        body = strict_json.loads(text, what="part", path=path)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(e.message, path=path, rank=rank) from None
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise CorruptCheckpointError("not a quicksave part", path=path, rank=rank)
    digest = body.pop("part_xxh3_64", None)
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if digest != hexdigest(xxhash.xxh3_64_intdigest(raw)):
        raise CorruptCheckpointError("the part fails its checksum", path=path, rank=rank)
    if body.get("rank") != rank:
        raise CorruptCheckpointError(
            f"the part says rank {body.get('rank')!r}", path=path, rank=rank
        )
    return body, path


def manifest_from_parts(
    skeleton: Manifest,
    chunk_keys: Mapping[str, tuple[str, int]],
    parts: list[RankPart],
    draft: str,
    *,
    objects_in_parts: bool = True,
    bases: Mapping[str, int] | None = None,
    previous: Mapping[str, TensorEntry] | None = None,
) -> Manifest:
    """Fill ``skeleton`` (every chunk placed, checksums empty) from every rank's part:
    the one way every save path completes its manifest (``layout.skeleton`` builds the
    skeletons). The chunks of ``bases`` (safetensors key -> step) refer to that earlier
    checkpoint of the same run folder for their bytes (FORMAT.md §9; their checksums
    come in the parts like the others'); the manifest is then written as version 2.

    Args:
        skeleton: the manifest fixed before the bytes were written.
        chunk_keys: safetensors key -> (fqn, chunk index in the skeleton), all ranks.
        parts: one part per rank.
        draft: named in errors.
        objects_in_parts: the parts bring every object's value (each exactly once);
            False: the skeleton holds the values already (a single-rank save).
        bases: the chunk references (every rank's).
        previous: the tensor entries of a manifest filled before from the same
            skeleton (``TensorsTemplate.last``): a chunk with the same checksum and
            reference is taken from it as it is, and a tensor whose every chunk is, too
            (an incremental save's frozen tensors: hundreds of blocks at every save).

    Raises:
        CorruptCheckpointError: a chunk or value nobody reported, one reported twice, or
            one the plan does not have — the parts do not match the plan; a reference
            to a key the plan does not have, or to a step not below the checkpoint's
            own; nothing is committed.
    """
    bases = bases or {}
    _check_bases(skeleton.step, chunk_keys, bases)
    chunks = {fqn: list(t.chunks) for fqn, t in skeleton.tensors.items()}
    last = {
        fqn: t
        for fqn, t in (previous or {}).items()
        if (s := skeleton.tensors.get(fqn)) is not None and len(s.chunks) == len(t.chunks)
    }
    seen: dict[str, int] = {}
    valued: dict[str, int] = {}
    objects = dict(skeleton.objects)
    for part in parts:
        # (checked for the whole part at once: a manifest has thousands of chunks)
        for key in part.chunks.keys() - chunk_keys.keys():
            raise CorruptCheckpointError(
                f"the part reports chunk {key!r}, which the plan does not have",
                path=draft,
                rank=part.rank,
            )
        for key in part.chunks.keys() & seen.keys():
            raise CorruptCheckpointError(
                f"chunk {key!r} was written by ranks {seen[key]} and {part.rank}",
                path=draft,
                fqn=chunk_keys[key][0],
                rank=part.rank,
            )
        seen.update(dict.fromkeys(part.chunks, part.rank))
        for key, digest in part.chunks.items():
            fqn, i = chunk_keys[key]
            entries, base = chunks[fqn], bases.get(key)
            was = last.get(fqn)
            if was is not None:
                c = was.chunks[i]
                if c.xxh3_64 == digest and c.base == base:
                    entries[i] = c
                    continue
            entries[i] = entries[i].with_digest(digest, base)
        for fqn, value in part.objects.items():
            old = objects.get(fqn)
            if objects_in_parts and (old is None or fqn in valued):
                why = "no such value in the plan" if old is None else f"rank {valued[fqn]} did too"
                raise CorruptCheckpointError(
                    f"the part reports this value ({why})", path=draft, fqn=fqn, rank=part.rank
                )
            valued[fqn] = part.rank
            objects[fqn] = ObjectEntry(value, old.path if old is not None else None)
    if len(seen) != len(chunk_keys):  # (every key seen is the plan's)
        for key, (fqn, _) in chunk_keys.items():
            if key not in seen:
                raise CorruptCheckpointError(
                    "no rank reported writing this chunk", path=draft, fqn=f"{fqn} ({key})"
                )
    if objects_in_parts:
        for fqn in objects:
            if fqn not in valued:
                raise CorruptCheckpointError(
                    "no rank reported writing this value", path=draft, fqn=fqn
                )
    tensors = {}
    for fqn, t in skeleton.tensors.items():
        filled = tuple(chunks[fqn])
        was = last.get(fqn)
        tensors[fqn] = was if was is not None and was.chunks == filled else t.with_chunks(filled)
    return dataclasses.replace(skeleton, tensors=tensors, objects=objects)


def _check_bases(
    step: int | None, chunk_keys: Mapping[str, tuple[str, int]], bases: Mapping[str, int]
) -> None:
    """Raise unless every reference of ``bases`` names a chunk of the plan and a step
    below the checkpoint's own ``step``."""
    for key, base in bases.items():
        where = chunk_keys.get(key)
        if where is None or step is None or not 0 <= base < step:
            raise CorruptCheckpointError(
                f"chunk {key!r} cannot refer to step {base} in the checkpoint of step {step}",
                fqn=None if where is None else where[0],
            )
