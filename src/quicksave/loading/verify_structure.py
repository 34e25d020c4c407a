"""The structure checks of :func:`quicksave.loading.verify.verify_checkpoint`: the
manifest's internal consistency (dtypes, chunk coverage, objects that decode;
:func:`manifest_problems`) and each data file's safetensors header against the
manifest (:func:`header_problems`, which also gives the starts of the torch legacy
prefixes the byte checks need). :func:`read_at` reads a few bytes of an open member."""

from __future__ import annotations

from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import known_dtype, safetensors_code
from quicksave.format.manifest import FileEntry, Manifest
from quicksave.format.safetensors_header import (
    ExpectedChunk,
    header_length,
    legacy_prefixes,
    mismatches,
    parse_header,
)
from quicksave.layout.plan import chunk_key
from quicksave.loading.verify_report import Problem
from quicksave.storage.checkpoint_dir import Member, read_range


def manifest_problems(m: Manifest, where: str = MANIFEST_NAME) -> list[Problem]:
    """Internal consistency of a manifest that parsed (so its checksum matched and every
    chunk's length, alignment and file range were checked): dtypes this torch knows,
    coverage, and objects that decode. ``where``: the file holding the manifest."""
    problems: list[Problem] = []
    for fqn, t in m.tensors.items():
        if known_dtype(t.dtype) is None:
            problems.append(
                Problem(
                    where,
                    fqn,
                    "manifest",
                    f"unknown dtype {t.dtype!r} (written by a newer torch?)",
                )
            )
            continue
        numel = 1
        for d in t.shape:
            numel *= d
        covered = 0
        for c in t.chunks:
            n = 1
            for size in c.sizes:
                n *= size
            covered += n
        if covered != numel:
            problems.append(
                Problem(
                    where,
                    fqn,
                    "manifest",
                    f"chunks hold {covered} elements but shape {list(t.shape)} has {numel} "
                    "(chunks overlap or leave gaps)",
                )
            )
    for fqn, o in m.objects.items():
        try:
            objcodec.decode(o.value, fqn=fqn)
        except CheckpointError as e:  # a stored object must decode; report, don't stop
            problems.append(Problem(where, fqn, "object", f"cannot decode: {e.message}"))
    return problems


def _expected_chunks(name: str, m: Manifest) -> list[ExpectedChunk]:
    out = []
    for fqn, t in m.tensors.items():
        dtype = known_dtype(t.dtype)
        code = (safetensors_code(dtype) if dtype is not None else None) or "U8"
        for c in t.chunks:
            if c.file == name:
                key = chunk_key(fqn, c.offsets, c.sizes, t.shape)
                out.append(ExpectedChunk(key, fqn, c.offset, c.length, code))
    return out


def header_problems(
    fd: Member,
    name: str,
    entry: FileEntry,
    size: int,
    m: Manifest,
    fpath: str,
    prefixes: dict[int, int] | None = None,
) -> list[Problem]:
    """The data file is valid safetensors and its header agrees with the manifest.
    Fills ``prefixes`` (chunk start -> start of its torch legacy prefix entry)."""
    try:
        prefix = read_range(fd, 0, 8, path=fpath, what="data file", exact=False)
        n = header_length(prefix, size, fpath)
        if 8 + n != entry.data_start:
            return [
                Problem(
                    name,
                    None,
                    "header",
                    f"safetensors header: ends at byte {8 + n}, the manifest's data_start "
                    f"is {entry.data_start}",
                )
            ]
        text = read_range(fd, 8, n, path=fpath, what="data file", exact=False)
        # The manifest's size: a different real size is its own problem (kind size).
        metadata, entries = parse_header(text, entry.size, fpath)
    except CorruptCheckpointError as e:
        return [Problem(name, None, "header", e.message)]
    if prefixes is not None:
        prefixes.update(legacy_prefixes(entries))
    return [
        Problem(name, fqn, "header", f"safetensors header: {message}")
        for fqn, message in mismatches(metadata, entries, entry.rank, _expected_chunks(name, m))
    ]
