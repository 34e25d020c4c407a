"""The reference checks of :func:`quicksave.loading.verify.verify_checkpoint`: every chunk
whose bytes an earlier checkpoint of the same run folder holds (``base``, FORMAT.md §9)
is checked against that checkpoint: it is committed, its manifest lists the chunk stored
in itself (the same tensor, dtype, box, file, offset, length and checksum: references
are depth 1), its file holds the chunk, and the chunk's bytes there match the checksum.
Each base is opened once and its referenced chunks are streamed through one buffer."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError
from quicksave.format.manifest import LAYOUT_QUICKSAVE, ChunkEntry, Manifest
from quicksave.loading.checkpoint import require_committed
from quicksave.loading.verify_report import Problem
from quicksave.storage.checkpoint_dir import CheckpointDir, Member

Ref = tuple[str, ChunkEntry]  # the fqn, the chunk entry of the checkpoint verified


def reference_problems(
    d: CheckpointDir, m: Manifest, bar: Any, buf: memoryview
) -> tuple[list[Problem], int]:
    """The problems of the chunk references of ``m`` (the manifest of the checkpoint
    ``d``) and the bytes read to find them; ``bar`` counts them (a tqdm bar)."""
    by_base: dict[int, list[Ref]] = defaultdict(list)
    for fqn, t in sorted(m.tensors.items()):
        for c in t.chunks:
            if c.base is not None:
                by_base[c.base].append((fqn, c))
    problems: list[Problem] = []
    checked = 0
    for base, refs in sorted(by_base.items()):
        loc = d.location.parent().child(f"step-{base}")
        shared = loc.backend_id() == d.location.backend_id()
        with CheckpointDir(loc, d.backend if shared else None) as bd:
            found, n = _check_base(bd, base, m, refs, bar, buf)
        problems += found
        checked += n
    return problems, checked


def _check_base(
    bd: CheckpointDir, base: int, m: Manifest, refs: list[Ref], bar: Any, buf: memoryview
) -> tuple[list[Problem], int]:
    label = f"../step-{base}"
    fqns = sorted({fqn for fqn, _ in refs})
    try:
        require_committed(bd.location, backend=bd.backend)
        bm = read_manifest(bd)
    except CheckpointError as e:
        why = f"the base {bd.url} that {len(refs)} chunk(s) refer to cannot be read: {e.message}"
        return [Problem(label, fqn, "reference", why) for fqn in fqns], 0
    problems: list[Problem] = []
    checked = 0
    opened: dict[str, Member] = {}
    try:
        for fqn, c in refs:
            where = f"{label}/{c.file}"
            why = _mismatch(bm, m, fqn, c)
            if why is not None:
                problems.append(Problem(where, fqn, "reference", f"{why} (base {bd.url})"))
                continue
            try:
                if c.file not in opened:
                    opened[c.file] = bd.open(c.file, what="data file", fqn=fqn)
                fd = opened[c.file]
            except (FileNotFoundError, CheckpointError) as e:
                msg = getattr(e, "message", "missing")
                problems.append(Problem(where, fqn, "reference", f"{msg} (base {bd.url})"))
                continue
            why, n = _check_bytes(fd, c, bar, buf)
            checked += n
            if why is not None:
                problems.append(Problem(where, fqn, "reference", f"{why} (base {bd.url})"))
    finally:
        for f in opened.values():
            f.close()
    return problems, checked


def _mismatch(bm: Manifest, m: Manifest, fqn: str, c: ChunkEntry) -> str | None:
    """Why the base's manifest ``bm`` does not hold chunk ``c`` of tensor ``fqn`` of ``m``
    stored in itself, or None."""
    if bm.layout != LAYOUT_QUICKSAVE:
        return f"the base is of layout {bm.layout!r}, which holds no referenced chunks"
    t, bt = m.tensors[fqn], bm.tensors.get(fqn)
    if bt is None or (bt.dtype, bt.shape) != (t.dtype, t.shape):
        return "the base has no tensor of this name, dtype and shape"
    same = [b for b in bt.chunks if (b.offsets, b.sizes) == (c.offsets, c.sizes)]
    if not same:
        return f"the base has no chunk at offsets {list(c.offsets)}"
    b = same[0]
    if b.base is not None:
        return f"the base refers to step {b.base} for this chunk (references are depth 1)"
    if (b.file, b.offset, b.length, b.xxh3_64) != (c.file, c.offset, c.length, c.xxh3_64):
        return (
            f"the base stores this chunk as {b.file} bytes {b.offset}..{b.offset + b.length} "
            f"(xxh3 {b.xxh3_64}), not {c.file} bytes {c.offset}..{c.offset + c.length} "
            f"(xxh3 {c.xxh3_64})"
        )
    return None


def _check_bytes(fd: Member, c: ChunkEntry, bar: Any, buf: memoryview) -> tuple[str | None, int]:
    """Stream the chunk's bytes from the base's file through ``buf``: why they are not
    the chunk (truncated, checksum), or None; and the bytes read."""
    if c.offset + c.length > fd.size:
        return (
            f"the base's file ends at byte {fd.size}, inside or before the chunk "
            f"(bytes {c.offset}..{c.offset + c.length})"
        ), 0
    hasher = xxhash.xxh3_64()
    pos, end = c.offset, c.offset + c.length
    try:
        while pos < end:
            n = fd.pread_into(buf[: min(len(buf), end - pos)], pos)
            if not n:
                break
            hasher.update(buf[:n])
            pos += n
            bar.update(n)
    except OSError as e:
        return f"cannot read the base's file: {e.strerror}", pos - c.offset
    if pos < end:
        return f"the base's file ends at byte {pos}, inside the chunk", pos - c.offset
    actual = hexdigest(hasher.intdigest())
    if actual != c.xxh3_64:
        return (
            f"checksum mismatch in the base's chunk bytes {c.offset}..{end}: "
            f"manifest {c.xxh3_64}, file {actual}"
        ), c.length
    return None, c.length
