"""Commit by rename, on a local filesystem: a save is written under the hidden
``.quicksave.<encoded name>.tmp-<token>/`` beside the checkpoint and one rename of that
directory makes it visible (:mod:`quicksave.commit.files` holds the file operations;
:mod:`quicksave.commit.kinds` the names; docs/FORMAT.md, "Commit").

A directory is a committed checkpoint iff its name has no ``.tmp-`` (nor ``.corrupt-``,
``.replaced-``) marker and it holds ``manifest.json``, or (the DCP layout, FORMAT.md §8)
no ``manifest.json`` but a ``.metadata`` that ends with the layout's footer. Deletion and
quarantine are renames too, so nothing is ever half-deleted under a committed name.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping

from quicksave.commit import files, outputs
from quicksave.commit.kinds import COMMITTED, CheckpointKind, kind_of, new_token
from quicksave.commit.strategy import CommitStrategy, StagedFiles, metadata_has_footer
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.storage import posix_io
from quicksave.storage.location import Location


class RenameCommit(CommitStrategy):
    """Commit, deletion and quarantine by atomic renames of directories."""

    name = "rename"
    atomic_replace = True
    writes_in_place = False
    can_write_dcp_layout = True

    def classify(self, loc: Location) -> CheckpointKind:
        path = loc.key
        try:
            names = set(os.listdir(path))
        except FileNotFoundError:  # missing, or vanished while listed (retention, clean-up)
            return CheckpointKind.MISSING
        except NotADirectoryError:  # a file, or a parent that is a file
            return (
                CheckpointKind.NOT_CHECKPOINT if os.path.lexists(path) else CheckpointKind.MISSING
            )
        return kind_of(loc.name, names, lambda: metadata_has_footer(loc))

    def committed(
        self, folder: Location, match: Callable[[str], bool] | None = None
    ) -> dict[str, CheckpointKind]:
        try:
            names = os.listdir(folder.key)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for name in sorted(names):
            if match is None or match(name):
                kind = self.classify(folder.child(name))
                if kind in COMMITTED:
                    found[name] = kind
        return found

    def _check_in_the_way(self, loc: Location, rank: int | None) -> None:
        final = loc.key
        if os.path.isdir(final) and not os.path.islink(final):
            try:
                empty = not os.listdir(final)
            except OSError:
                empty = False
            if empty:
                return
            what = "a directory that is not empty (not a committed checkpoint)"
        else:
            what = "a file" if not os.path.islink(final) else "a symbolic link"
        raise CheckpointExistsError(
            f"{what} is in the way; quicksave never replaces it: choose another path or remove it",
            path=final,
            rank=rank,
        )

    @classmethod
    def draft(cls, loc: Location, token: str) -> str:
        return files.temp_path_for(loc.key, token)

    def begin(self, loc: Location, token: str, *, replace: bool = False) -> str:
        self.check_target(loc, replace=replace)
        tmp = self.draft(loc, token)
        self._make_draft(tmp, loc.key)  # the error names the checkpoint the user asked for
        return tmp

    def prepare_draft(self, draft: str) -> None:
        self._make_draft(draft, files.final_path_of(draft))  # named as in begin

    def _make_draft(self, draft: str, named: str) -> None:
        try:
            os.makedirs(draft, exist_ok=True)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "EIO")
            raise CheckpointError(
                f"cannot create the checkpoint's temporary directory: {name} ({e.strerror})",
                path=named,
                rank=getattr(self.backend, "rank", None),
            ) from e

    def prune_draft(self, draft: str, keep: Collection[str]) -> None:
        """Everything in the temporary directory but ``keep``: merged parts, partial
        members, and what a crashed earlier attempt at the same name left."""
        try:
            names = os.listdir(draft)
        except FileNotFoundError:
            return
        except OSError as e:
            raise CheckpointError(
                f"cannot list the temporary directory: {e.strerror}", path=draft
            ) from e
        for name in names:
            if name in keep:
                continue
            path = os.path.join(draft, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CheckpointError(
                    f"cannot remove {name} from the temporary directory: {e.strerror}",
                    path=draft,
                ) from e

    def member_key(self, draft: str, name: str) -> str:
        return os.path.join(draft, name)

    def write_member(self, draft: str, name: str, data: bytes, *, fsync: bool = True) -> str:
        """A temporary name, fsync, rename, fsync of the directory."""
        path = os.path.join(draft, name)
        partial = f"{path}.{new_token()}.writing"  # never one a crashed attempt left
        if fsync:
            posix_io.write_durable(partial, data)
        else:
            with open(partial, "wb") as f:
                f.write(data)
        os.replace(partial, path)
        if fsync:
            files.fsync_path(draft)
        return path

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
        """Write ``members`` durably into ``draft``, then rename it to ``loc`` (with
        ``replace``, exchanged with a committed checkpoint there:
        :func:`~quicksave.commit.files.publish`)."""
        whole = dict(expected)
        for name, data in members.items():
            posix_io.write_durable(os.path.join(draft, name), data)
            whole[name] = len(data)
        exchange = replace and self.classify(loc) in COMMITTED
        files.publish(draft, loc.key, whole, replace=exchange)

    def discard(self, draft: str, names: Iterable[str]) -> None:
        shutil.rmtree(draft, ignore_errors=True)

    def _exists(self, loc: Location) -> bool:
        return os.path.lexists(loc.key)

    def write_output(
        self, loc: Location, build: Callable[[str], list[str] | None], what: str
    ) -> None:
        """Built beside ``loc`` under a temporary name, then renamed (a file: hard-linked)
        into place (:func:`~quicksave.commit.outputs.publish_output`)."""
        self.check_free(loc)
        out = loc.key
        tmp = files.temp_path_for(out, new_token())
        try:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            build(tmp)
            outputs.publish_output(tmp, out)
        except OSError as e:
            raise CheckpointError(f"cannot write {what}: {e}", path=out) from e
        finally:
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.path.lexists(tmp):
                os.unlink(tmp)

    def create_folder(self, folder: Location, rank: int | None) -> None:
        path = folder.key
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(
                "checkpoint folder is a file, not a directory; choose another folder",
                path=path,
                rank=rank,
            )
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint folder: {e.strerror}", path=path, rank=rank
            ) from e

    def remove(self, loc: Location) -> bool:
        return files.remove_tree(loc.key)

    @classmethod
    def reserve(cls, loc: Location) -> bool:
        """An empty directory at ``loc`` (the rename of the save's temporary replaces
        it, in the same single step)."""
        try:
            os.makedirs(os.path.dirname(loc.key), exist_ok=True)
            os.mkdir(loc.key)
        except FileExistsError:
            return False
        except OSError as e:
            raise CheckpointError(
                f"cannot reserve the checkpoint's name: {e.strerror}", path=loc.key
            ) from e
        return True

    @classmethod
    def release(cls, loc: Location) -> bool:
        """``rmdir``: only an empty directory goes, never a checkpoint committed meanwhile."""
        if os.path.islink(loc.key) or not os.path.isdir(loc.key):
            return False
        try:
            os.rmdir(loc.key)
        except OSError:  # not empty (committed meanwhile, or someone else's), or gone
            return False
        return True

    def unlink(self, loc: Location) -> bool:
        if not os.path.islink(loc.key):
            return False
        os.unlink(loc.key)
        return True

    def quarantine(self, loc: Location, why: str) -> str | None:
        moved = files.quarantine_path(loc.key)
        try:
            os.rename(loc.key, moved)
        except OSError as e:
            raise CheckpointError(f"cannot move it aside: {e.strerror}", path=loc.key) from e
        return moved

    def clean_leftovers(
        self, folder: Location, stale_after_s: float, keep: Collection[str] = ()
    ) -> list[str]:
        """Every temporary under ``folder``, whatever its age: only the lease holder
        calls this, and a writer still finishing (a dead trainer's worker) then fails its
        rename instead of committing a half-deleted directory."""
        removed = files.clean_stale_temporaries(folder.key)
        return [os.path.join(folder.key, name) for name in removed]
