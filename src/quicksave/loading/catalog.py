"""Catalog: list the checkpoints under a folder (``quicksave ls``).

A folder is searched ``depth`` levels down (default 2): the checkpoints in a run folder,
and in a parent of run folders (a bucket, ``/data/ckpts``) the checkpoints of each run,
named by their path from the folder (``run-7/step-100``). A checkpoint is a leaf: what
is inside one is never searched.

Cheap by design: it classifies directories by the files they hold, reads only the
manifest (for the step: ``manifest.json``, or the manifest inside a DCP-layout
``.metadata`` after reading its footer; a regular file only, see :mod:`quicksave.storage.safeio`)
and ``lstat``s the files; it never reads tensor data and never unpickles a DCP
``.metadata``. A damaged checkpoint is listed with its problem; it never fails the
listing of the others.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from quicksave.commit import CheckpointKind, classify, final_name, kind_of, metadata_has_footer
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.manifest import LAYOUT_DCP, LAYOUT_QUICKSAVE
from quicksave.storage import Location, ObjectInfo, StorageOptions, parse_location
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir
from quicksave.storage.local import dir_files

_STEP_IN_NAME = re.compile(r"(?:^|[^0-9])(\d+)$")
_LISTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP, CheckpointKind.UNCOMMITTED)
DEFAULT_DEPTH = 2  # a parent of run folders: <root>/<run>/step-<N>


@dataclass(frozen=True)
class CheckpointInfo:
    """One row of ``quicksave ls``.

    Attributes:
        name: the path relative to the listed root (``step-5``, or ``run-7/step-5`` in a
            run folder below it; ``.`` for the root itself).
        path: absolute path.
        format: ``quicksave`` or ``dcp``; for an uncommitted one, what it would become.
        committed: True for a committed checkpoint (quicksave or stock DCP).
        step: from the manifest; for DCP or uncommitted ones, from a trailing number in
            the name (``step-100`` → 100), else None.
        size: total bytes of all files in the directory.
        mtime: seconds since the epoch of ``manifest.json`` (``.metadata`` for DCP), or
            of the directory when neither exists.
        problem: why the manifest could not be read, else None (then ``step`` comes
            from the name).
        layout: the files' layout: ``quicksave`` (safetensors files and
            ``manifest.json``) or ``dcp`` (DCP's files: a stock DCP checkpoint, or a
            quicksave one in the DCP layout, FORMAT.md §8).
    """

    name: str
    path: str
    format: str
    committed: bool
    step: int | None
    size: int
    mtime: float
    problem: str | None = None
    layout: str = LAYOUT_QUICKSAVE

    @property
    def status(self) -> str:
        return "committed" if self.committed else "uncommitted"

    @property
    def run(self) -> str:
        """The folder holding it, relative to the listed root (``.``: the root)."""
        head, _, _ = self.name.rpartition("/")
        return head or "."


def _dir_size(path: str) -> int:
    return sum(dir_files(path).values())


def _step_from_name(name: str) -> int | None:
    match = _STEP_IN_NAME.search(final_name(name))  # a temporary: its checkpoint's name
    if not match or len(match.group(1)) > 18:  # a step is below 2**63
        return None
    return int(match.group(1))


def _layout_of(names: set[str]) -> str:
    """``quicksave`` when the directory holds a manifest.json or quicksave data files
    (the names say it for committed and uncommitted ones alike), else ``dcp``."""
    if MANIFEST_NAME in names or any(n.startswith(("rank-", "part-rank-")) for n in names):
        return LAYOUT_QUICKSAVE
    if DCP_METADATA_NAME in names or any(n.endswith(".distcp") for n in names):
        return LAYOUT_DCP
    return LAYOUT_QUICKSAVE


def describe(path: str, name: str | None = None) -> CheckpointInfo | None:
    """Describe the checkpoint at ``path``, or None if it is not one.

    Args:
        path: a directory.
        name: the name to show (default: the directory's base name).

    Returns:
        A :class:`CheckpointInfo`, or None for anything that is not a checkpoint.

    Example::

        info = describe("ckpt/step-100")
    """
    path = os.path.abspath(path)
    kind = classify(path)
    if kind not in _LISTED:
        return None
    base = os.path.basename(os.path.normpath(path))
    names = set(os.listdir(path))  # never the files' contents: only read_manifest reads
    step: int | None = None
    problem: str | None = None
    layout = _layout_of(names)
    if MANIFEST_NAME in names or kind is CheckpointKind.QUICKSAVE:
        fmt = "quicksave"
        try:
            step = read_manifest(path).step
        except CheckpointError as e:
            problem = e.message
            step = _step_from_name(base)
        commit = MANIFEST_NAME if MANIFEST_NAME in names else DCP_METADATA_NAME
        stamp = os.path.join(path, commit)
    elif kind is CheckpointKind.DCP:
        fmt, step, stamp = "dcp", _step_from_name(base), os.path.join(path, DCP_METADATA_NAME)
    else:
        fmt, step, stamp = "quicksave", _step_from_name(base), path
    return CheckpointInfo(
        name=name if name is not None else base,
        path=path,
        format=fmt,
        committed=kind in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP),
        step=step,
        size=_dir_size(path),
        mtime=os.lstat(stamp).st_mtime,  # the entry itself, even if a symbolic link
        problem=problem,
        layout=layout,
    )


def list_checkpoints(
    root: str | os.PathLike[str] | Location,
    *,
    depth: int = DEFAULT_DEPTH,
    storage: StorageOptions | None = None,
) -> list[CheckpointInfo]:
    """The checkpoints in ``root`` (or ``root`` itself if it is one), and in the folders
    below it down to ``depth`` levels: a parent of run folders lists every run's.

    Uncommitted ones (temporary directories of interrupted or running saves) are listed
    too, marked ``committed=False``. Sorted by run folder, then by step; checkpoints
    without a step sort last in their run, by name. Folders whose names begin with
    ``.`` and symbolic links to folders are not searched (a link to a checkpoint is
    listed).

    Args:
        root: a folder of checkpoints (or of run folders), or one checkpoint.
        depth: how many folder levels below ``root`` may hold checkpoints (1: only its
            entries; 2: also their entries, e.g. ``root/run-7/step-100``).
        storage: how to reach an object store.

    Returns:
        One :class:`CheckpointInfo` per checkpoint (possibly none).

    Raises:
        CheckpointNotFoundError: ``root`` does not exist or is not a directory (an
            object-store prefix with nothing under it is an empty folder, not an error).

    Example::

        for info in list_checkpoints("s3://bucket"):
            print(info.run, info.name, info.step, info.status)
    """
    loc = parse_location(root, what="checkpoint folder", options=storage)
    if not loc.is_local:
        return _sorted(_list_store(loc, depth))
    root = loc.key
    if not os.path.exists(root):
        raise CheckpointNotFoundError("no such file or directory", path=root)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(
            "not a directory (expected a folder of checkpoints)", path=root
        )
    own = describe(root, ".")
    if own is not None:
        return [own]
    found: list[CheckpointInfo] = []
    _walk_local(root, "", depth, found)
    return _sorted(found)


def _sorted(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    return sorted(
        infos, key=lambda i: (i.run, i.step is None, i.step if i.step is not None else 0, i.name)
    )


def _walk_local(path: str, prefix: str, depth: int, found: list[CheckpointInfo]) -> None:
    """Add the checkpoints among the entries of ``path`` (named ``prefix`` + name), and
    search the other folders ``depth - 1`` levels further."""
    if depth < 1:
        return
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:  # vanished or unreadable below the root: nothing to list there
        return
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=True):
                continue
            real_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        name = prefix + entry.name
        try:
            info = describe(entry.path, name)
        except FileNotFoundError:  # deleted meanwhile (retention, temp cleanup)
            continue
        except OSError as e:  # unreadable: list it with its problem, not fail the folder
            info = CheckpointInfo(
                name=name,
                path=os.path.abspath(entry.path),
                format="unknown",
                committed=False,
                step=_step_from_name(entry.name),
                size=0,
                mtime=0.0,
                problem=f"cannot read the directory: {e.strerror}",
            )
        if info is not None:
            found.append(info)
        elif real_dir and not entry.name.startswith("."):
            _walk_local(entry.path, name + "/", depth - 1, found)


@dataclass
class _Folder:
    """A folder of an object-store listing: every object under it (by key relative to
    it) and its sub-folders, down to the listing's depth."""

    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    folders: dict[str, _Folder] = field(default_factory=dict)


def _list_store(root: Location, depth: int) -> list[CheckpointInfo]:
    """``list_checkpoints`` on an object store: one listing of the whole prefix, grouped
    into folders by key components; one manifest read per committed checkpoint for its
    step."""
    backend = root.open()
    try:
        base = root.key + "/" if root.key else ""
        tree = _Folder()
        for o in backend.list(base):
            rest = o.key[len(base) :]
            folder = tree
            folder.objects[rest] = o
            parts = rest.split("/")
            for i, head in enumerate(parts[: min(depth, len(parts) - 1)]):
                folder = folder.folders.setdefault(head, _Folder())
                folder.objects["/".join(parts[i + 1 :])] = o
        own = _describe_store(root, backend, tree.objects, ".")
        if own is not None:
            return [own]
        found: list[CheckpointInfo] = []
        _walk_store(root, tree, "", depth, backend, found)
    finally:
        backend.close()
    return found


def _walk_store(
    loc: Location,
    tree: _Folder,
    prefix: str,
    depth: int,
    backend: Backend,
    found: list[CheckpointInfo],
) -> None:
    if depth < 1:
        return
    for name, folder in sorted(tree.folders.items()):
        info = _describe_store(loc.child(name), backend, folder.objects, prefix + name)
        if info is not None:
            found.append(info)
        elif not name.startswith("."):
            _walk_store(loc.child(name), folder, prefix + name + "/", depth - 1, backend, found)


def _describe_store(
    loc: Location, backend: Backend, objs: dict[str, ObjectInfo], name: str
) -> CheckpointInfo | None:
    top = {k for k in objs if "/" not in k}
    if not top:
        return None
    kind = kind_of(loc.name, top, lambda: metadata_has_footer(loc, backend))
    if kind not in _LISTED:
        return None
    step: int | None = _step_from_name(loc.name)
    problem: str | None = None
    fmt = "dcp" if kind is CheckpointKind.DCP else "quicksave"
    if MANIFEST_NAME in top or kind is CheckpointKind.QUICKSAVE:
        try:
            step = read_manifest(CheckpointDir(loc, backend)).step
        except CheckpointError as e:
            problem = e.message
    stamp = objs.get(MANIFEST_NAME) or objs.get(DCP_METADATA_NAME)
    return CheckpointInfo(
        name=name,
        path=loc.url,
        format=fmt,
        committed=kind in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP),
        step=step,
        size=sum(o.size for o in objs.values()),
        mtime=stamp.mtime if stamp else max(o.mtime for o in objs.values()),
        problem=problem,
        layout=_layout_of(top),
    )
