"""Verify: prove that every byte of a committed checkpoint is what its manifest promises.

``verify_checkpoint`` reads each file once, front to back, in large blocks, and checks:

- the manifest's self-checksum (and that it parses and validates);
- that every file the manifest lists exists with exactly the listed size, and that no
  other file is present;
- data files: the safetensors header region ``[0, data_start)`` against the file's
  digest, that it is a valid safetensors header agreeing with the manifest
  (:mod:`.format.safetensors_header`), every chunk against its own digest, every torch
  legacy prefix (files laid out for stock DCP readers) against the prefix recomputed
  from its chunk's dtype and sizes, and that every other byte (the alignment padding
  between chunks) is zero;
- other files (``.metadata``): the digest of all their bytes;
- the manifest's internal consistency (chunk lengths, alignment, overlaps, coverage) and
  that every stored object decodes.

In the DCP layout (FORMAT.md §8; no ``manifest.json``, the manifest inside
``.metadata``): the footer's structure and the manifest (read by ``read_manifest``), the
pickle before them against the footer's digest, and each ``.distcp`` data file's size,
chunks (each against its digest) and every other byte (``torch.save``'s zip structure,
the object items) against the file's digest, in one pass. The ``torch.save`` archives
are not parsed: the digests cover their bytes, and whether DCP's own reader can load
them is the writer's promise, not something a byte check can prove.

Together this detects any changed, missing or added byte. Nothing is unpickled: the
``.metadata`` pickle is only hashed. Only regular files inside the checkpoint are
opened (:mod:`quicksave.storage.safeio`): a symbolic link, FIFO or device is reported, never
read. Spec: docs/FORMAT.md.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from quicksave.adapters.dcp_reader import require_committed
from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format import objects as objcodec
from quicksave.format.dcp_layout import FOOTER_SIZE, parse_footer
from quicksave.format.dtypes import known_dtype, safetensors_code
from quicksave.format.manifest import LAYOUT_DCP, FileEntry, Manifest
from quicksave.format.safetensors_header import (
    ExpectedChunk,
    header_length,
    legacy_prefixes,
    mismatches,
    parse_header,
)
from quicksave.format.torch_legacy import legacy_prefix_for
from quicksave.loading.manifest_reader import read_manifest
from quicksave.saving.plan import chunk_key
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.backend import join
from quicksave.storage.checkpoint_dir import CheckpointDir, Member

READ_BLOCK = 16 << 20  # one reused buffer; large reads keep syscalls few on big files


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        file: the file inside the checkpoint concerned (``manifest.json``, a data file,
            ``.metadata`` (which holds the manifest in the DCP layout), an unexpected
            file), or None for the checkpoint as a whole.
        fqn: the tensor or object concerned, if any.
        kind: a short category: ``manifest``, ``missing-file``, ``unexpected-file``,
            ``size``, ``header``, ``chunk``, ``prefix``, ``padding``, ``checksum``,
            ``truncated``, ``unreadable``, ``object``.
        message: what is wrong, in words.
    """

    file: str | None
    fqn: str | None
    kind: str
    message: str

    def __str__(self) -> str:
        where = self.file or "<checkpoint>"
        if self.fqn is not None:
            where += f": {self.fqn}"
        return f"{where}: {self.kind}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify_checkpoint`.

    Attributes:
        path: the checkpoint directory (absolute).
        problems: everything found wrong, in file order; empty when intact.
        files_checked: files read (the manifest included).
        bytes_checked: bytes read and checked, the manifest included.
        tensors: tensor entries in the manifest (0 if it could not be read).
        objects: object entries in the manifest (0 if it could not be read).
    """

    path: str
    problems: tuple[Problem, ...] = ()
    files_checked: int = 0
    bytes_checked: int = 0
    tensors: int = 0
    objects: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Region:
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


def byte_progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar over bytes on stderr (a no-op bar when not ``enabled``)."""
    from tqdm import tqdm  # imported lazily: most callers never draw a bar

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not enabled,
        desc=desc,
        leave=False,
    )


def _manifest_problems(m: Manifest, where: str = MANIFEST_NAME) -> list[Problem]:
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


def _read_at(f: Member, offset: int, length: int, path: str) -> bytes:
    """Up to ``length`` bytes of ``f`` from ``offset`` (fewer only at its end)."""
    buf = bytearray(max(0, min(length, f.size - offset)))
    view = memoryview(buf)
    got = 0
    try:
        while got < len(buf):
            n = f.pread_into(view[got:], offset + got)
            if n == 0:
                break
            got += n
    except OSError as e:
        raise CorruptCheckpointError(f"cannot read data file: {e.strerror}", path=path) from None
    finally:
        view.release()
    del buf[got:]
    return bytes(buf)


def _header_problems(
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
        prefix = _read_at(fd, 0, 8, fpath)
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
        text = _read_at(fd, 8, n, fpath)
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


def _regions_for(
    name: str,
    entry: FileEntry,
    m: Manifest,
    problems: list[Problem],
    prefixes: dict[int, int] | None = None,
) -> list[_Region]:
    """The checks covering bytes ``[0, entry.size)`` of one listed file, in order;
    ``prefixes``: chunk start -> start of the torch legacy prefix before it (from the
    header, whose own bytes are checked against its digest)."""
    prefixes = prefixes or {}
    if m.layout == LAYOUT_DCP:
        return _dcp_regions(name, entry, m)
    if entry.data_start is None:
        return [_Region(0, entry.size, "checksum", expected=entry.xxh3_64)]
    regions = [_Region(0, entry.data_start, "header", expected=entry.xxh3_64)]
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
                regions.append(_Region(cur, p_start, "zero"))
            want = legacy_prefix_for(m.tensors[fqn].dtype, tuple(c.sizes))
            regions.append(_Region(p_start, start, "prefix", fqn=fqn, fixed=want or b""))
        elif start > cur:
            regions.append(_Region(cur, start, "zero"))
        regions.append(_Region(start, end, "chunk", fqn=fqn, expected=c.xxh3_64))
        cur = max(cur, end)
    if entry.size > cur:
        regions.append(_Region(cur, entry.size, "zero"))
    return regions


def _dcp_regions(name: str, entry: FileEntry, m: Manifest) -> list[_Region]:
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
            regions.append(_Region(cur, start, "outside", expected=entry.xxh3_64, hasher=outside))
        regions.append(_Region(start, end, "chunk", fqn=fqn, expected=digest))
        cur = max(cur, end)
    regions.append(
        _Region(cur, entry.size, "outside", expected=entry.xxh3_64, hasher=outside, last=True)
    )
    return regions


def _finish(name: str, r: _Region, problems: list[Problem]) -> None:
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


def _check_file(
    fd: Member,
    name: str,
    regions: list[_Region],
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
                _finish(name, r, problems)
                i += 1
            pos = block_end
            bar.update(n)
    except OSError as e:
        problems.append(Problem(name, None, "unreadable", f"cannot read: {e.strerror}"))
        return pos
    for r in regions[i:]:
        if r.end <= pos:  # empty regions at the very end
            _finish(name, r, problems)
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


def verify_checkpoint(
    path: str | os.PathLike[str] | Location,
    progress: bool = False,
    *,
    storage: StorageOptions | None = None,
) -> VerifyReport:
    """Check every byte of the committed quicksave checkpoint at ``path`` (either
    layout: FORMAT.md §1-§3, or the DCP layout of §8).

    Args:
        path: the checkpoint directory: a path, or a ``file://``, ``s3://`` or ``msc://``
            URL.
        progress: show a tqdm progress bar over the bytes read, on stderr.
        storage: how to reach an object store.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when the checkpoint is intact.
        Corruption is reported there (naming file and fqn), not raised.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or is not a quicksave checkpoint
            (a stock DCP directory included).
        NotCommittedError: ``path`` is an uncommitted (temporary or partial) checkpoint.

    Example::

        report = verify_checkpoint("ckpt/step-100")
        for p in report.problems:
            print(p)
    """
    loc = parse_location(path, options=storage)
    with CheckpointDir(loc) as d:
        return _verify(d, progress)


def _verify(d: CheckpointDir, progress: bool) -> VerifyReport:
    path = d.url
    require_committed(d.location, backend=d.backend)
    commit, commit_size = _commit_file(d)
    try:
        m = read_manifest(d)
    except CheckpointError as e:
        # Nothing else can be trusted without a valid manifest.
        return VerifyReport(
            path,
            (Problem(commit, e.fqn, "manifest", e.message),),
            files_checked=1,
            bytes_checked=commit_size,
        )

    problems = _manifest_problems(m, commit)
    try:
        present = d.names()
    except OSError as e:  # deleted meanwhile (another job's retention), or unreadable
        raise CheckpointNotFoundError(
            f"the checkpoint cannot be listed while it is verified ({e.strerror or 'gone'}; "
            "deleted meanwhile?)",
            path=path,
        ) from None
    for extra in sorted(present - set(m.files) - {commit}):
        try:
            is_dir = d.is_local and stat.S_ISDIR(os.lstat(os.path.join(path, extra)).st_mode)
        except OSError:
            is_dir = False
        kind = "directory" if is_dir else ("file" if d.is_local else "object")
        problems.append(
            Problem(extra, None, "unexpected-file", f"{kind} not listed in the manifest")
        )

    plan: list[tuple[str, Member, list[_Region], int]] = []
    checked = commit_size
    try:
        if m.layout == LAYOUT_DCP:  # the pickle before the manifest: the footer's digest
            pickled = _pickle_region(d, problems)
            if pickled is not None:
                plan.append(pickled)
                checked -= pickled[3]  # streamed below, counted there
        for name, entry in sorted(m.files.items()):
            fpath = d.member_url(name)  # a plain name: the manifest parser checked
            if name not in present:
                problems.append(
                    Problem(name, None, "missing-file", "listed in the manifest but absent")
                )
                continue
            try:
                f = d.open(name, what="file")
            except FileNotFoundError:
                problems.append(
                    Problem(name, None, "missing-file", "listed in the manifest but absent")
                )
                continue
            except CorruptCheckpointError as e:
                problems.append(Problem(name, None, "unexpected-file", e.message))
                continue
            plan.append((name, f, [], min(f.size, entry.size)))
            if f.size != entry.size:
                problems.append(
                    Problem(
                        name, None, "size", f"file has {f.size} bytes, manifest says {entry.size}"
                    )
                )
            prefixes: dict[int, int] = {}
            if entry.data_start is not None:
                problems += _header_problems(f, name, entry, f.size, m, fpath, prefixes)
            plan[-1][2].extend(_regions_for(name, entry, m, problems, prefixes))

        total = sum(limit for *_, limit in plan)
        buf = memoryview(bytearray(min(READ_BLOCK, max(total, 1))))
        with byte_progress(total, "verify", progress) as bar:
            for name, fd, regions, limit in plan:
                checked += _check_file(fd, name, regions, limit, problems, bar, buf)
    finally:
        for _, fd, _, _ in plan:
            fd.close()
    return VerifyReport(
        path,
        tuple(problems),
        files_checked=len(plan) + int(commit == MANIFEST_NAME),
        bytes_checked=checked,
        tensors=len(m.tensors),
        objects=len(m.objects),
    )


def _commit_file(d: CheckpointDir) -> tuple[str, int]:
    """The file holding the manifest and its size: ``manifest.json``, or in the DCP
    layout (no ``manifest.json``) ``.metadata``; size 0 if it cannot be seen."""
    for name in (MANIFEST_NAME, DCP_METADATA_NAME):
        if d.is_local:
            try:
                return name, os.lstat(os.path.join(d.url, name)).st_size
            except OSError:
                continue
        info = d.backend.stat(join(d.location.key, name))
        if info is not None:
            return name, info.size
    return MANIFEST_NAME, 0


def _pickle_region(
    d: CheckpointDir, problems: list[Problem]
) -> tuple[str, Member, list[_Region], int] | None:
    """The DCP-layout ``.metadata``'s pickle ``P`` as a region to stream against the
    footer's digest (read again: the file may have changed since the manifest was read)."""
    name = DCP_METADATA_NAME
    fpath = d.member_url(name)
    try:
        f = d.open(name, what="DCP metadata")
    except FileNotFoundError:
        problems.append(Problem(name, None, "missing-file", "vanished while verified"))
        return None
    except CorruptCheckpointError as e:
        problems.append(Problem(name, None, "unexpected-file", e.message))
        return None
    try:
        tail = _read_at(f, max(0, f.size - FOOTER_SIZE), FOOTER_SIZE, fpath)
        footer = parse_footer(tail, f.size, fpath)
    except CorruptCheckpointError as e:
        f.close()
        problems.append(Problem(name, None, "manifest", e.message))
        return None
    n = footer.pickle_length
    region = _Region(0, n, "pickle", expected=hexdigest(footer.pickle_xxh3_64))
    return name, f, [region], n
