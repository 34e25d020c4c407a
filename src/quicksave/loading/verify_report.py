"""What :func:`quicksave.loading.verify.verify_checkpoint` returns: one :class:`Problem` per
thing found wrong (file, fqn, kind, message) and the :class:`VerifyReport` that holds
them with the counts of what was read."""

from __future__ import annotations

from dataclasses import dataclass


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
            ``truncated``, ``unreadable``, ``object``, ``reference`` (a chunk that refers to
            an earlier checkpoint, FORMAT.md §9: ``file`` is ``../step-<base>/<name>``).
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
