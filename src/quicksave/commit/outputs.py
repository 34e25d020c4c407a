"""Outputs that are no checkpoint (a converted file, a Hugging Face export): built in
a local directory, then published without ever replacing what is there — renamed (or
hard-linked) into place on a filesystem, uploaded to an object store file by file (the
last one publishes; a failure deletes what was uploaded). The strategies'
:meth:`~quicksave.commit.strategy.CommitStrategy.write_output` calls these."""

from __future__ import annotations

import logging
import os

from quicksave.commit.files import fsync_path
from quicksave.errors import CheckpointExistsError
from quicksave.storage.backend import Backend, join

logger = logging.getLogger("quicksave")


def publish_output(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out`` without ever replacing an existing ``out``."""
    if os.path.isdir(tmp):
        if os.path.lexists(out):  # rename() would replace an empty directory
            raise CheckpointExistsError(
                "output appeared while converting; not overwritten", path=out
            )
        os.rename(tmp, out)
    else:
        try:
            os.link(tmp, out)  # fails if ``out`` exists: no window where it is replaced
        except FileExistsError:
            raise CheckpointExistsError(
                "output appeared while converting; not overwritten", path=out
            ) from None
        except OSError:  # filesystems without hard links
            if os.path.lexists(out):
                raise CheckpointExistsError(
                    "output appeared while converting; not overwritten", path=out
                ) from None
            os.rename(tmp, out)
        else:
            os.unlink(tmp)
    fsync_path(os.path.dirname(out))


def upload_file(backend: Backend, key: str, local: str) -> None:
    """Upload the local file ``local`` as the one object ``key`` of ``backend`` (an
    object appears whole or not at all), mapped rather than read into memory."""
    import mmap

    with open(local, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            backend.put(key, memoryview(b""))
            return
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                backend.put(key, view)
            finally:
                view.release()


def upload_dir(backend: Backend, prefix: str, url: str, local: str, names: list[str]) -> None:
    """Upload the files ``names`` of the directory ``local`` under ``prefix`` in order
    (the last one publishes the output); on a failure, delete what was uploaded."""
    done: list[str] = []
    try:
        for name in names:
            key = join(prefix, name)
            upload_file(backend, key, os.path.join(local, name))
            done.append(key)
    except BaseException:
        try:
            backend.delete(done)
        except Exception as e:  # the upload's error matters more; say what is left
            logger.error("quicksave: could not delete a partial output at %s: %s", url, e)
        raise
