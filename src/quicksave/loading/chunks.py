"""The read steps of one chunk: where its bytes are, reading them into memory, checking
them.

- :class:`ChunkSource` resolves a chunk to the checkpoint that holds its file:
  :class:`RunFolder` (what every read uses by default) follows a chunk reference
  (``base``, FORMAT.md §9) to the checkpoint ``step-<base>`` beside the one being read;
  :class:`OwnCheckpoint` answers the checkpoint being read for every chunk.
- :class:`ChunkFiles` opens the data files a read needs, each once, in whichever
  checkpoint holds them (a committed one: else the read fails naming both), and closes
  them together; :meth:`ChunkFiles.naming` makes an error about a chunk read from
  another checkpoint name the one being read too.
- :func:`read_chunk_into`, :func:`check_chunk_digest`, :func:`check_chunk_within`: the
  bytes of one chunk into a buffer, its xxh3-64, its bounds in its file.
- :func:`runs`: neighbouring small chunks of one file grouped for one ranged read each
  (object stores), and :class:`Span`, bytes already read served as a file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format.manifest import ChunkEntry
from quicksave.loading.checkpoint import Checkpoint, check_still_there, require_committed
from quicksave.storage import Location
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir, Member, fill
from quicksave.storage.cold_read import Seen
from quicksave.trace import phase

Where = tuple[str, str]  # (the URL of the checkpoint holding a file, the file's name)


class ChunkSource(Protocol):
    """Where the bytes of a chunk of the checkpoint being read are stored."""

    def locate(self, checkpoint: Location, fqn: str, entry: ChunkEntry) -> tuple[Location, str]:
        """The checkpoint holding the file of ``entry`` (a chunk of tensor ``fqn`` in
        the manifest of ``checkpoint``) and the file's name there; the bytes are at
        ``entry.offset`` .. ``entry.offset + entry.length`` of that file."""
        ...


@dataclass(frozen=True)
class OwnCheckpoint:
    """Every chunk is in a file of the checkpoint whose manifest lists it."""

    def locate(self, checkpoint: Location, fqn: str, entry: ChunkEntry) -> tuple[Location, str]:
        return checkpoint, entry.file


OWN_CHECKPOINT = OwnCheckpoint()


@dataclass(frozen=True)
class RunFolder:
    """A chunk with a ``base`` is in the file of the same name of the checkpoint
    ``step-<base>`` in the folder of the checkpoint being read (its sibling: a step, never
    a path, so never outside that folder; FORMAT.md §9); every other chunk is in the
    checkpoint itself."""

    def locate(self, checkpoint: Location, fqn: str, entry: ChunkEntry) -> tuple[Location, str]:
        if entry.base is None:
            return checkpoint, entry.file
        return checkpoint.parent().child(f"step-{entry.base}"), entry.file


RUN_FOLDER = RunFolder()


class ChunkFiles:
    """The data files one read opens, each once: in the checkpoint being read, or in
    the one ``source`` names for a chunk (reached through ``backend`` when it serves
    that location too, else through a backend of its own; it must be a committed
    checkpoint, classified once per read); all closed by :meth:`close`.

    Args:
        checkpoint: the checkpoint being read.
        backend: an open backend serving it (kept open), or None (one is opened).
        source: where each chunk is (default: its own checkpoint, or the one its
            reference names).
        rank: named in errors.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        backend: Backend | None,
        source: ChunkSource = RUN_FOLDER,
        rank: int | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.source = source
        self.rank = rank
        self.dir = CheckpointDir(checkpoint.location, backend, rank=rank)
        self._dirs: dict[str, CheckpointDir] = {checkpoint.url: self.dir}
        self._open: dict[Where, Member] = {}

    def where(self, fqn: str, entry: ChunkEntry) -> Where:
        """The checkpoint and file that hold ``entry``.

        Raises:
            CorruptCheckpointError: another checkpoint holds it, and that one is not a
                committed checkpoint (missing, uncommitted, unreadable); names both.
            CheckpointNotFoundError, NotCommittedError: the checkpoint being read was
                deleted meanwhile.
        """
        loc, name = self.source.locate(self.checkpoint.location, fqn, entry)
        if loc.url not in self._dirs:
            shared = loc.backend_id() == self.checkpoint.location.backend_id()
            backend = self.dir.backend if shared else None
            d = CheckpointDir(loc, backend, rank=self.rank)
            try:
                require_committed(loc, backend=d.backend, rank=self.rank)
            except CheckpointError as e:
                d.close()
                # Deleted as a whole meanwhile (another job's retention)? Then not damage.
                check_still_there(self.checkpoint, self.dir.backend, fqn=fqn, rank=self.rank)
                raise CorruptCheckpointError(
                    f"a chunk of this checkpoint is stored in {loc.url}, which is not a "
                    f"committed checkpoint: {e.message}",
                    path=self.checkpoint.url,
                    fqn=fqn,
                    rank=self.rank,
                ) from None
            self._dirs[loc.url] = d
        return loc.url, name

    @contextmanager
    def naming(self, where: Where) -> Iterator[None]:
        """Within: a ``CorruptCheckpointError`` about a chunk at ``where`` (a file of
        another checkpoint) names the checkpoint being read too (it names the file)."""
        try:
            yield
        except CorruptCheckpointError as e:
            if where[0] == self.checkpoint.url:
                raise
            raise CorruptCheckpointError(
                f"{e.message}; in the checkpoint that {self.checkpoint.url} refers to "
                "for this chunk",
                path=e.path,
                fqn=e.fqn,
                rank=e.rank,
            ) from None

    def url(self, where: Where) -> str:
        """The file's path or URL, for errors."""
        return self._dirs[where[0]].member_url(where[1])

    def open(self, where: Where, fqn: str, rank: int | None) -> Member:
        """The file at ``where`` (see :meth:`where`), opened once.

        Raises:
            CheckpointNotFoundError: the checkpoint being read was deleted meanwhile.
            NotCommittedError: it is being deleted (on a store: its commit is gone).
            CorruptCheckpointError: the file is missing, or not a regular file.
        """
        f = self._open.get(where)
        if f is not None:
            return f
        d = self._dirs[where[0]]
        with self.naming(where):
            try:
                f = d.open(where[1], what="data file", fqn=fqn, rank=rank)
            except FileNotFoundError:
                # retention of another job? then not damage
                check_still_there(self.checkpoint, self.dir.backend, fqn=fqn, rank=rank)
                raise CorruptCheckpointError(
                    "data file is missing", path=d.member_url(where[1]), fqn=fqn, rank=rank
                ) from None
        self._open[where] = f
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
        for d in self._dirs.values():
            d.close()

    def __enter__(self) -> ChunkFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_chunk_into(
    fd: Member,
    view: memoryview,
    entry: ChunkEntry,
    *,
    path: str,
    fqn: str,
    rank: int | None,
    verify: bool = True,
) -> None:
    """Fill ``view`` with the bytes of ``entry`` from the open data file ``fd`` (at
    ``path``; a :class:`~quicksave.storage.checkpoint_dir.Member` on any backend) and
    check their xxh3-64, computed piece by piece as the bytes land (while a piece read
    through a buffer is still in the CPU's cache).

    Raises:
        CorruptCheckpointError: the file ends before the chunk does, or the checksum
            does not match; names the file, the fqn and the rank.
    """
    hasher = xxhash.xxh3_64() if verify else None
    got = fd.read_into(
        view[: entry.length], entry.offset, None if hasher is None else hasher.update
    )
    if got < entry.length:
        raise CorruptCheckpointError(
            f"data file is truncated: chunk needs bytes {entry.offset}.."
            f"{entry.offset + entry.length}, file ends at {entry.offset + got}",
            path=path,
            fqn=fqn,
            rank=rank,
        )
    if hasher is not None:
        with phase("load.verify"):
            _check_digest(hasher.intdigest(), entry, path=path, fqn=fqn, rank=rank)


def check_chunk_digest(
    view: memoryview, entry: ChunkEntry, *, path: str, fqn: str, rank: int | None
) -> None:
    """Raise if the bytes of chunk ``entry`` read into ``view`` fail its xxh3-64."""
    with phase("load.verify"):  # per chunk: chunks are checked as they arrive
        _check_digest(xxhash.xxh3_64_intdigest(view), entry, path=path, fqn=fqn, rank=rank)


def _check_digest(digest: int, entry: ChunkEntry, *, path: str, fqn: str, rank: int | None) -> None:
    actual = hexdigest(digest)
    if actual != entry.xxh3_64:
        raise CorruptCheckpointError(
            f"checksum mismatch in chunk at offsets {list(entry.offsets)} "
            f"(stored {entry.xxh3_64}, read {actual})",
            path=path,
            fqn=fqn,
            rank=rank,
        )


def check_chunk_within(entry: ChunkEntry, size: int, path: str, fqn: str, rank: int | None) -> None:
    """Raise if the chunk ``entry`` ends beyond the ``size`` bytes its file holds."""
    if entry.offset + entry.length > size:
        raise CorruptCheckpointError(
            f"data file is truncated: chunk needs bytes {entry.offset}.."
            f"{entry.offset + entry.length}, file ends at {size}",
            path=path,
            fqn=fqn,
            rank=rank,
        )


RUN_BYTES = 32 << 20  # object stores: neighbouring small chunks up to this are read at once
RUN_GAP = 1 << 20  # ... when the bytes between them are fewer than this
RUN_SMALL = 8 << 20  # chunks this large or larger are read straight into their destination


class Located(Protocol):
    """A chunk to read: where its file is, and its entry."""

    where: Where
    entry: ChunkEntry


C = TypeVar("C", bound=Located)


def runs(work: list[C]) -> list[list[C]]:
    """``work`` (sorted by file and offset) cut into runs of neighbouring small chunks
    of one file, each spanning at most ``RUN_BYTES``; a chunk of ``RUN_SMALL`` bytes or
    more is its own run, read straight into its destination (the backend splits a large
    one into parallel ranged reads)."""
    out: list[list[C]] = []
    for c in work:
        if c.entry.length >= RUN_SMALL:  # one request is worth it: no copy through memory
            out.append([c])
            continue
        if out and out[-1][0].entry.length < RUN_SMALL:
            last = out[-1]
            head = last[0]
            tail_end = max(x.entry.offset + x.entry.length for x in last)
            if (
                head.where == c.where
                and c.entry.offset - tail_end < RUN_GAP
                and c.entry.offset + c.entry.length - head.entry.offset <= RUN_BYTES
            ):
                last.append(c)
                continue
        out.append([c])
    return out


class Span:
    """Bytes of a data file already read (``view`` holds the file from ``base``), read
    again as a Member."""

    def __init__(self, view: memoryview, base: int) -> None:
        self.view, self.base = view, base
        self.size = base + len(view)

    def pread_into(self, view: memoryview, offset: int) -> int:
        lo = offset - self.base
        n = max(0, min(len(view), len(self.view) - lo))
        view[:n] = self.view[lo : lo + n]
        return n

    def read_scatter(self, views: list[memoryview], offset: int) -> int:
        got = 0
        for v in views:
            n = self.pread_into(v, offset + got)
            got += n
            if n < len(v):
                break
        return got

    def read_into(self, view: memoryview, offset: int, seen: Seen | None = None) -> int:
        return fill(self, view, offset, seen)

    def close(self) -> None:
        pass
