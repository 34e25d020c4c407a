"""A committed single-rank snapshot as it travels between ranks: its files opened for
sending (:class:`Outgoing`), and received into a draft directory that commits by the
local rule, one rename (:class:`Incoming`).

Both sides hand ``torch.distributed`` uint8 tensors that are maps of the files
themselves (no copy through a Python buffer): the sender's private, copy-on-write maps
of its files, the receiver's shared maps of files made at their final size. A snapshot
is a flat folder of regular files (``manifest.json`` with the checksums, ``.metadata``,
the data files); only the file names and sizes travel in the header, and the reader
verifies the checksums when the copy is loaded, so a torn copy is never trusted.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from quicksave.commit import files as commit_files
from quicksave.commit.kinds import new_token
from quicksave.errors import CheckpointError

FileList = list[tuple[str, int]]  # (name, size) of each file of a snapshot


def check_names(listed: object) -> FileList:
    """A received header's file list as ``[(name, size)]``, or CheckpointError if any
    name is not a plain file name or any size is not a whole number."""
    out: FileList = []
    if not isinstance(listed, list):
        raise CheckpointError(f"a peer's file list is not a list: {listed!r}")
    for item in listed:
        name, size = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\0" in name
            or not isinstance(size, int)
            or size < 0
        ):
            raise CheckpointError(f"a peer sent a bad file entry: {item!r}")
        out.append((name, size))
    return out


def _map(fd: int, size: int, access: int, populate: bool = False) -> torch.Tensor:
    """The file as a uint8 tensor; the tensor holds the map (it is unmapped when the
    last reference goes, never under a transfer still in flight). ``populate``: its
    pages mapped now (``MAP_POPULATE``), in one call rather than one fault each."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        return torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, size, access=access), dtype=torch.uint8)


class Outgoing:
    """The files of a committed snapshot, mapped (so that a retention that deletes the
    snapshot meanwhile does not take them from under the send)."""

    def __init__(self, path: str, files: FileList, tensors: list[torch.Tensor]) -> None:
        self.path = path
        self.files = files
        self._tensors = tensors

    @classmethod
    def open(cls, path: str) -> Outgoing:
        """Map every file of the snapshot at ``path`` (private, copy-on-write maps).

        Raises:
            CheckpointError: it is gone or a file cannot be read (names the path).
        """
        files: FileList = []
        tensors = []
        try:
            for name in sorted(os.listdir(path)):
                fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    size = os.fstat(fd).st_size
                    tensors.append(_map(fd, size, mmap.ACCESS_COPY))
                finally:
                    os.close(fd)
                files.append((name, size))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open the snapshot to send it: {e}", path=path) from e
        return cls(path, files, tensors)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)

    def tensors(self) -> list[torch.Tensor]:
        """One uint8 tensor per non-empty file, in ``files`` order."""
        return [t for t in self._tensors if t.numel()]

    def by_name(self) -> dict[str, torch.Tensor]:
        """Each file's uint8 tensor, by name."""
        return {name: t for (name, _), t in zip(self.files, self._tensors, strict=True)}

    def close(self) -> None:
        """Drop the maps (each is unmapped once no transfer holds its tensor)."""
        self._tensors = []


class Incoming:
    """A snapshot being received into the draft directory beside ``final``."""

    def __init__(self, final: Path, files: FileList) -> None:
        self.final = final
        self.files = files
        self.draft = commit_files.temp_path_for(str(final), new_token())
        self._tensors: list[torch.Tensor] = []
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.mkdir(self.draft, 0o700)
        try:
            for name, size in files:
                fd = os.open(os.path.join(self.draft, name), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, size)
                    if size:  # allocated and mapped now, not page by page under the receive
                        os.posix_fallocate(fd, 0, size)
                        self._tensors.append(_map(fd, size, mmap.ACCESS_WRITE, populate=True))
                finally:
                    os.close(fd)
        except (OSError, ValueError):
            self.discard()
            raise

    def tensors(self) -> list[torch.Tensor]:
        """One uint8 tensor per non-empty file, in ``files`` order: receive into them."""
        return self._tensors

    def commit(self) -> bool:
        """Make the received snapshot visible at ``final`` (one rename; a tmpfs needs no
        flush). False (the draft removed) if ``final`` is committed already."""
        self._tensors = []
        if self.final.exists():
            self.discard()
            return False
        commit_files.publish(self.draft, str(self.final), dict(self.files))
        return True

    def discard(self) -> None:
        self._tensors = []
        shutil.rmtree(self.draft, ignore_errors=True)


def scratch(files: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """Buffers to receive a snapshot into that this rank cannot keep (its own memory
    failed it): the bytes must still be taken off the wire."""
    return [torch.empty(size, dtype=torch.uint8) for _, size in files if size]
