"""Commit by writing the manifest last, on an object store (S3, MSC): there is no rename,
so a save's objects go straight under the checkpoint's prefix, and the manifest,
written after a listing has checked every other object, is the commit. Objects appear
whole or not at all; a prefix without its manifest (in the DCP layout: its ``.metadata``
with the layout's footer) is never listed, loaded or kept.

Deletion removes the commit first (``manifest.json``, then ``.metadata``: the checkpoint
is gone at once), then the data. Quarantine keeps the commit object and the reason under
``<name>.corrupt-<token>/`` and deletes the original's, so the data left under
``<name>/`` is an uncommitted leftover. Leftovers of crashed saves are removed only when
older than ``stale_after_s`` (a save still being written is never hit; docs/
ARCHITECTURE.md, "Object stores").
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from quicksave.commit import outputs
from quicksave.commit.kinds import (
    COMMITTED,
    QUARANTINE_MARK,
    CheckpointKind,
    kind_of,
    new_token,
)
from quicksave.commit.manifest_reader import read_manifest
from quicksave.commit.strategy import CommitStrategy, StagedFiles, metadata_has_footer
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.storage.backend import Backend, join
from quicksave.storage.checkpoint_dir import CheckpointDir
from quicksave.storage.location import Location


class ManifestLastCommit(CommitStrategy):
    """Commit by the manifest's presence; deletion and quarantine by the commit object."""

    name = "manifest-last"
    atomic_replace = False
    writes_in_place = True
    can_write_dcp_layout = False

    def classify(self, loc: Location) -> CheckpointKind:
        names = set(self.backend.children(loc.key))
        if not names:
            return CheckpointKind.MISSING
        return kind_of(loc.name, names, lambda: metadata_has_footer(loc, self.backend))

    def groups(self, folder: Location) -> dict[str, dict[str, Any]]:
        """``folder`` in one listing: first key component (``step-10``) -> {the rest of
        the key: ObjectInfo}."""
        base = folder.key + "/" if folder.key else ""
        groups: dict[str, dict[str, Any]] = {}
        for o in self.backend.list(base):
            head, sep, tail = o.key[len(base) :].partition("/")
            if sep:
                groups.setdefault(head, {})[tail] = o
        return groups

    def _kind_in(self, folder: Location, name: str, objs: Mapping[str, Any]) -> CheckpointKind:
        top = {k for k in objs if "/" not in k}
        if not top:
            return CheckpointKind.NOT_CHECKPOINT
        loc = folder.child(name)
        return kind_of(name, top, lambda: metadata_has_footer(loc, self.backend))

    def committed(
        self, folder: Location, match: Callable[[str], bool] | None = None
    ) -> dict[str, CheckpointKind]:
        found = {}
        for name, objs in sorted(self.groups(folder).items()):
            if match is None or match(name):
                kind = self._kind_in(folder, name, objs)
                if kind in COMMITTED:
                    found[name] = kind
        return found

    def _check_in_the_way(self, loc: Location, rank: int | None) -> None:
        raise CheckpointExistsError(
            "objects of an uncommitted save are under this prefix (a save that crashed "
            "or is still running); quicksave never replaces them: choose another path, or "
            "let a CheckpointManager clean them up",
            path=loc.url,
            rank=rank,
        )

    @classmethod
    def reserve(cls, loc: Location) -> bool:
        """An empty directory where the scheme's store has directories (an fsspec
        filesystem: the objects written under it make it the checkpoint); nothing where
        folders are only prefixes (S3, MSC): the scheme's entry says which."""
        return loc.entry.reserve(loc.scheme, loc.container, loc.key)

    @classmethod
    def release(cls, loc: Location) -> bool:
        return loc.entry.release(loc.scheme, loc.container, loc.key)

    @classmethod
    def draft(cls, loc: Location, token: str) -> str:
        return loc.key  # the objects go straight under the checkpoint's prefix

    def member_key(self, draft: str, name: str) -> str:
        return join(draft, name)

    def write_member(self, draft: str, name: str, data: bytes, *, fsync: bool = True) -> str:
        key = join(draft, name)
        self.backend.put(key, memoryview(data))
        return self.backend.url(key)

    def commit(
        self,
        draft: str,
        loc: Location,
        members: Mapping[str, bytes],
        expected: Mapping[str, int],
        *,
        replace: bool = False,
        staged: StagedFiles | None = None,
    ) -> None:
        """Check every object of ``expected`` (one listing), write every member but the
        last, then the last one (the manifest): its presence is the commit. Nothing is
        written before the check, and a member written before a failure is deleted
        again: a ``.metadata`` left alone under a prefix would read as a stock DCP
        checkpoint."""
        if replace:
            raise CheckpointError(
                "cannot replace a checkpoint on an object store (no atomic replace)",
                path=loc.url,
            )
        *first, (last, last_data) = members.items()
        check_objects(self.backend, draft, loc.url, expected, last)
        written: list[str] = []
        try:
            for name, data in first:
                key = join(draft, name)
                self.backend.put(key, memoryview(data))
                written.append(key)
            self.backend.put(join(draft, last), memoryview(last_data))
        except BaseException:
            with contextlib.suppress(Exception):  # unless the manifest landed after all
                if self.backend.stat(join(draft, last)) is None:
                    self.backend.delete(written)
            raise

    def discard(self, draft: str, names: Iterable[str]) -> None:
        """Delete the named objects and the ``.metadata`` of a commit interrupted before
        its manifest — but nothing at all where a manifest is there: then the prefix
        holds a committed checkpoint (this save's, if only its reply was lost, or
        another writer's), and its objects are not ours to delete. Best effort: objects
        without a manifest are invisible, and the lease holder's clean-up takes what
        stays; a ``.metadata`` alone, though, would read as a stock DCP checkpoint."""
        with contextlib.suppress(Exception):
            if self.backend.stat(join(draft, MANIFEST_NAME)) is not None:
                return
            self.backend.delete([join(draft, n) for n in (*names, DCP_METADATA_NAME)])

    def abandon(self, draft: str, names: Iterable[str]) -> None:
        """Nothing: the prefix is the checkpoint's own, and another rank's writer may
        still commit it; the lease holder's clean-up takes what stays."""

    def _exists(self, loc: Location) -> bool:
        return self.backend.stat(loc.key) is not None or bool(self.backend.children(loc.key))

    def write_output(
        self, loc: Location, build: Callable[[str], list[str] | None], what: str
    ) -> None:
        """Built in a local scratch directory, then uploaded: a file as one object
        (whole or not at all), a directory file by file in ``build``'s order (a failure
        deletes what was uploaded)."""
        self.check_free(loc)
        with tempfile.TemporaryDirectory(prefix="quicksave-output-") as scratch:
            path = os.path.join(scratch, "out")
            try:
                names = build(path)
            except OSError as e:
                raise CheckpointError(f"cannot write {what}: {e}", path=loc.url) from e
            try:
                if names is None:
                    outputs.upload_file(self.backend, loc.key, path)
                else:
                    outputs.upload_dir(self.backend, loc.key, loc.url, path, names)
            except OSError as e:  # reading the scratch copy back
                raise CheckpointError(f"cannot write {what}: {e}", path=loc.url) from e

    def create_folder(self, folder: Location, rank: int | None) -> None:
        """Nothing needs creating; the folder is listed at once, so that a missing
        bucket, bad credentials or an unreachable endpoint fail here."""
        self.backend.children(folder.key)

    def remove(self, loc: Location) -> bool:
        base = loc.key + "/"
        if not self.backend.children(loc.key):
            return False
        self.backend.delete([base + MANIFEST_NAME])
        self.backend.delete([base + DCP_METADATA_NAME])
        self.backend.delete([o.key for o in self.backend.list(base)])
        return True

    def quarantine(self, loc: Location, why: str) -> str | None:
        moved = loc.parent().child(f"{loc.name}{QUARANTINE_MARK}{new_token()}")
        b = self.backend
        commit_name = MANIFEST_NAME
        key = join(loc.key, commit_name)
        info = b.stat(key)
        if info is None and metadata_has_footer(loc, b):
            commit_name = DCP_METADATA_NAME
            key = join(loc.key, commit_name)
            info = b.stat(key)
        if info is not None:
            data = b.get(key, max(info.size, 1))
            b.put(join(moved.key, commit_name), memoryview(data))
        b.put(join(moved.key, "REASON.txt"), memoryview(why.encode("utf-8", "replace")))
        b.delete([key])
        return moved.url

    def clean_leftovers(
        self, folder: Location, stale_after_s: float, keep: Collection[str] = ()
    ) -> list[str]:
        """Only what is older than ``stale_after_s``: prefixes holding quicksave
        objects but no manifest, objects of a committed checkpoint that its manifest does
        not list (parts, a crashed earlier attempt's files), and incomplete multipart
        uploads; never the names in ``keep``."""
        b = self.backend
        removed = []
        cutoff = time.time() - stale_after_s
        base = folder.key + "/" if folder.key else ""
        for name, objs in self.groups(folder).items():
            if name in keep:
                continue
            kind = self._kind_in(folder, name, objs)
            if kind in COMMITTED:
                if kind is CheckpointKind.DCP or QUARANTINE_MARK in name:
                    continue  # nothing of ours to tell apart; quarantine is kept
                listed = self._listed_names(folder.child(name))
                doomed = [k for k, o in objs.items() if k not in listed and o.mtime < cutoff]
            elif kind is CheckpointKind.UNCOMMITTED and QUARANTINE_MARK not in name:
                if max(o.mtime for o in objs.values()) >= cutoff:
                    continue  # possibly a save still being written: not ours to judge yet
                if b.stat(base + name + "/" + MANIFEST_NAME) is not None:
                    continue  # committed meanwhile
                doomed = list(objs)
            else:
                continue
            if doomed:
                b.delete(base + name + "/" + k for k in doomed)
                removed.append(f"{len(doomed)} object(s) under {folder.child(name).url}")
        aborted = b.abort_uploads(base, stale_after_s)
        if aborted:
            removed.append(f"{aborted} multipart upload(s) under {folder.url}")
        return removed

    def _listed_names(self, loc: Location) -> set[str]:
        """The names a committed checkpoint's manifest accounts for (everything else
        under its prefix is a leftover); all of them if the manifest cannot be read."""
        try:
            m = read_manifest(CheckpointDir(loc, self.backend))
        except CheckpointError:
            return set(self.backend.children(loc.key)) | {""}  # keep everything
        return set(m.files) | {MANIFEST_NAME, DCP_METADATA_NAME}


def check_objects(
    backend: Backend,
    prefix: str,
    final: str,
    expected: Mapping[str, int],
    commit_name: str = MANIFEST_NAME,
) -> None:
    """Before a commit on an object store: check that every object of ``expected``
    (name -> size) is under ``prefix`` with its size, and that no commit object
    (``commit_name``) is there yet, in one listing.

    Raises:
        CheckpointError: an object is missing or of another size (nothing committed).
        CheckpointExistsError: another save committed a checkpoint there meanwhile.
    """
    base = prefix.rstrip("/") + "/"
    present = {o.key[len(base) :]: o.size for o in backend.list(base)}
    for member, size in sorted(expected.items()):
        got = present.get(member)
        if got != size:
            state = "missing" if got is None else f"{got} bytes, expected {size}"
            raise CheckpointError(
                f"cannot commit: object {member} is {state} (deleted by another process?); "
                "nothing was committed",
                path=final,
            )
    if commit_name in present:
        raise CheckpointExistsError(
            "cannot commit: another save committed a checkpoint here meanwhile", path=final
        )
