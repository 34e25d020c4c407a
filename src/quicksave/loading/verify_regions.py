"""The byte checks of :func:`quicksave.loading.verify.verify_checkpoint`, one file at a
time: :func:`regions_for` cuts a listed file into regions (safetensors header, chunks,
zero padding, torch legacy prefixes; in the DCP layout the chunks and the bytes around
them), :func:`check_file` streams the file once, front to back, feeding each block to
the regions it covers, and :func:`finish_region` turns a region's result into a
:class:`~quicksave.loading.verify_report.Problem` (digest mismatch, non-zero padding, wrong
prefix); a file that ends early is reported as truncated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from quicksave.checksum import hexdigest
from quicksave.format.manifest import LAYOUT_DCP, FileEntry, Manifest
from quicksave.format.torch_legacy import legacy_prefix_for
from quicksave.loading.verify_report import Problem
from quicksave.storage.checkpoint_dir import Member


@dataclass
class Region:
    """A byte range of one file and how to check it (mutable: it accumulates a hash)."""

    start: int
    end: int
    # "header" | "chunk" | "zero" | "checksum" | "prefix" | "outside" | "pickle"
    kind: str
    fqn: str | None = None
    expected: str | None = None
    fixed: bytes | None = None  # "prefix": the bytes it must hold
    got: bytearray = field(default_factory=bytearray)
    hasher: xxhash.xxh3_64 = field(default_factory=xxhash.xxh3_64)
    first_nonzero: int | None = None
    nonzero: int = 0
    last: bool = False  # "outside": the file's last such region, where its digest ends

    def feed(self, block: memoryview, at: int) -> None:
        if self.kind == "zero":
            arr = np.frombuffer(block, dtype=np.uint8)
            n = int(np.count_nonzero(arr))
            if n:
                if self.first_nonzero is None:
                    self.first_nonzero = at + int(np.flatnonzero(arr)[0])
                self.nonzero += n
        elif self.kind == "prefix":
            self.got += block
        else:
            self.hasher.update(block)


def regions_for(
    name: str,
    entry: FileEntry,
    m: Manifest,
    problems: list[Problem],
    prefixes: dict[int, int] | None = None,
) -> list[Region]:
    """The checks covering bytes ``[0, entry.size)`` of one listed file, in order (the
    range of a chunk that refers to an earlier checkpoint is padding here);
    ``prefixes``: chunk start -> start of the torch legacy prefix before it (from the
    header, whose own bytes are checked against its digest)."""
    prefixes = prefixes or {}
    if m.layout == LAYOUT_DCP:
        return _dcp_regions(name, entry, m)
    if entry.data_start is None:
        return [Region(0, entry.size, "checksum", expected=entry.xxh3_64)]
    regions = [Region(0, entry.data_start, "header", expected=entry.xxh3_64)]
    chunks = sorted(
        (
            (c.offset, c.offset + c.length, fqn, c)
            for fqn, t in m.tensors.items()
            for c in t.chunks
            if c.file == name
        ),
        key=lambda x: (x[0], x[1]),
    )
    cur = entry.data_start
    for start, end, fqn, c in chunks:
        if start < cur and end > start:
            problems.append(
                Problem(
                    name,
                    fqn,
                    "manifest",
                    f"chunk at offsets {list(c.offsets)} (bytes {start}..{end}) overlaps the "
                    f"header or another chunk (which ends at byte {cur})",
                )
            )
            continue
        if c.base is not None and end > entry.size:
            continue  # a hole past the file's end: the trailing padding check covers it
        if end > entry.size:
            problems.append(
                Problem(
                    name,
                    fqn,
                    "manifest",
                    f"chunk at offsets {list(c.offsets)} (bytes {start}..{end}) lies beyond the "
                    f"file's recorded size {entry.size}",
                )
            )
            continue
        p_start = prefixes.get(start)
        if p_start is not None and cur <= p_start < start:
            if p_start > cur:
                regions.append(Region(cur, p_start, "zero"))
            want = legacy_prefix_for(m.tensors[fqn].dtype, tuple(c.sizes))
            regions.append(Region(p_start, start, "prefix", fqn=fqn, fixed=want or b""))
        elif start > cur:
            regions.append(Region(cur, start, "zero"))
        if c.base is None:
            regions.append(Region(start, end, "chunk", fqn=fqn, expected=c.xxh3_64))
        else:  # stored in its base (verify_refs.py); here a hole, zero like padding
            regions.append(Region(start, end, "zero"))
        cur = max(cur, end)
    if entry.size > cur:
        regions.append(Region(cur, entry.size, "zero"))
    return regions


def _dcp_regions(name: str, entry: FileEntry, m: Manifest) -> list[Region]:
    """A DCP-layout data file: its chunks, each against its digest, and the bytes
    between and around them, all fed to one hasher for the file's digest. The manifest
    parser checked that the chunks lie inside the file's size and do not overlap."""
    outside = xxhash.xxh3_64()
    chunks = sorted(
        (c.offset, c.offset + c.length, fqn, c.xxh3_64)
        for fqn, t in m.tensors.items()
        for c in t.chunks
        if c.file == name
    )
    regions = []
    cur = 0
    for start, end, fqn, digest in chunks:
        if start > cur:
            regions.append(Region(cur, start, "outside", expected=entry.xxh3_64, hasher=outside))
        regions.append(Region(start, end, "chunk", fqn=fqn, expected=digest))
        cur = max(cur, end)
    regions.append(
        Region(cur, entry.size, "outside", expected=entry.xxh3_64, hasher=outside, last=True)
    )
    return regions


def finish_region(name: str, r: Region, problems: list[Problem]) -> None:
    if r.kind == "zero":
        if r.nonzero:
            problems.append(
                Problem(
                    name,
                    None,
                    "padding",
                    f"{r.nonzero} non-zero byte(s) in padding bytes {r.start}..{r.end} "
                    f"(first at byte {r.first_nonzero}); padding must be zero",
                )
            )
        return
    if r.kind == "prefix":
        if bytes(r.got) != r.fixed:
            what = (
                "differ from the torch legacy prefix of the chunk's dtype and sizes"
                if r.fixed
                else "precede a chunk whose dtype has no torch legacy prefix"
            )
            problems.append(
                Problem(
                    name, r.fqn, "prefix", f"torch legacy prefix bytes {r.start}..{r.end} {what}"
                )
            )
        return
    if r.kind == "outside" and not r.last:
        return  # the file's digest goes on in its next region
    actual = hexdigest(r.hasher.intdigest())
    if actual == r.expected:
        return
    what = {
        "header": f"safetensors header (bytes 0..{r.end})",
        "chunk": f"chunk bytes {r.start}..{r.end}",
        "checksum": "file contents",
        "outside": "the bytes outside the chunks (torch.save structure, object items)",
        "pickle": f"DCP's metadata pickle (bytes 0..{r.end})",
    }[r.kind]
    problems.append(
        Problem(
            name,
            r.fqn,
            "checksum" if r.kind in ("outside", "pickle") else r.kind,
            f"checksum mismatch in {what}: "
            f"{'footer' if r.kind == 'pickle' else 'manifest'} {r.expected}, file {actual}",
        )
    )


def check_file(
    fd: Member,
    name: str,
    regions: list[Region],
    limit: int,
    problems: list[Problem],
    bar: Any,  # a tqdm bar (disabled when no progress is wanted)
    buf: memoryview,
) -> int:
    """Stream the open file ``fd`` up to ``limit`` bytes through ``regions``; returns
    bytes read."""
    pos = 0
    i = 0
    try:
        while pos < limit:
            n = fd.pread_into(buf[: min(len(buf), limit - pos)], pos)
            if not n:
                break
            block_end = pos + n
            while i < len(regions) and regions[i].start < block_end:
                r = regions[i]
                a = max(r.start, pos)
                b = min(r.end, block_end)
                if b > a:
                    r.feed(buf[a - pos : b - pos], a)
                if r.end > block_end:
                    break
                finish_region(name, r, problems)
                i += 1
            pos = block_end
            bar.update(n)
    except OSError as e:
        problems.append(Problem(name, None, "unreadable", f"cannot read: {e.strerror}"))
        return pos
    for r in regions[i:]:
        if r.end <= pos:  # empty regions at the very end
            finish_region(name, r, problems)
        else:
            problems.append(
                Problem(
                    name,
                    r.fqn,
                    "truncated",
                    f"file ends at byte {pos}, inside or before {r.kind} bytes {r.start}..{r.end}",
                )
            )
    return pos
