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
  that every stored object decodes;
- chunk references (FORMAT.md §9): the base is a committed checkpoint of the same run
  folder whose manifest lists the chunk stored in itself, and the chunk's bytes there
  match its checksum (:mod:`.verify_refs`); in the checkpoint's own data file the
  referenced chunk's bytes are padding (zero).

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

The order: the commit file and the manifest (:mod:`.manifest_reader`), the manifest's
own consistency and the listing against it (:mod:`.verify_structure`), then every
listed file opened, its header checked and cut into regions, and all files streamed
once (:mod:`.verify_regions`), with a byte progress bar (:mod:`.progress`); what is
wrong is collected as :class:`~quicksave.loading.verify_report.Problem` in a
:class:`~quicksave.loading.verify_report.VerifyReport` (:mod:`.verify_report`). Called by
any rank or process that has the checkpoint; it talks to no other rank.
"""

from __future__ import annotations

import os

from quicksave.checksum import hexdigest
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.dcp_layout import FOOTER_SIZE, parse_footer
from quicksave.format.manifest import LAYOUT_DCP
from quicksave.loading.checkpoint import require_committed
from quicksave.loading.progress import byte_progress
from quicksave.loading.verify_refs import reference_problems
from quicksave.loading.verify_regions import Region, check_file, regions_for
from quicksave.loading.verify_report import Problem, VerifyReport
from quicksave.loading.verify_structure import header_problems, manifest_problems
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.checkpoint_dir import CheckpointDir, Member, read_range

READ_BLOCK = 16 << 20  # one reused buffer; large reads keep syscalls few on big files


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

    problems = manifest_problems(m, commit)
    try:
        present = d.names()
    except OSError as e:  # deleted meanwhile (another job's retention), or unreadable
        raise CheckpointNotFoundError(
            f"the checkpoint cannot be listed while it is verified ({e.strerror or 'gone'}; "
            "deleted meanwhile?)",
            path=path,
        ) from None
    for extra in sorted(present - set(m.files) - {commit}):
        problems.append(
            Problem(
                extra, None, "unexpected-file", f"{d.describe(extra)} not listed in the manifest"
            )
        )

    plan: list[tuple[str, Member, list[Region], int]] = []
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
                problems += header_problems(f, name, entry, f.size, m, fpath, prefixes)
            plan[-1][2].extend(regions_for(name, entry, m, problems, prefixes))

        referred = sum(c.length for t in m.tensors.values() for c in t.chunks if c.base is not None)
        total = sum(limit for *_, limit in plan) + referred
        buf = memoryview(bytearray(min(READ_BLOCK, max(total, 1))))
        with byte_progress(total, "verify", progress) as bar:
            for name, fd, regions, limit in plan:
                checked += check_file(fd, name, regions, limit, problems, bar, buf)
            if referred:
                found, n = reference_problems(d, m, bar, buf)
                problems += found
                checked += n
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
        size = d.size_of(name)
        if size is not None:
            return name, size
    return MANIFEST_NAME, 0


def _pickle_region(
    d: CheckpointDir, problems: list[Problem]
) -> tuple[str, Member, list[Region], int] | None:
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
        tail = read_range(
            f, max(0, f.size - FOOTER_SIZE), FOOTER_SIZE, path=fpath, what="data file", exact=False
        )
        footer = parse_footer(tail, f.size, fpath)
    except CorruptCheckpointError as e:
        f.close()
        problems.append(Problem(name, None, "manifest", e.message))
        return None
    n = footer.pickle_length
    region = Region(0, n, "pickle", expected=hexdigest(footer.pickle_xxh3_64))
    return name, f, [region], n
