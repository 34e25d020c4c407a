"""Publishing a converted output: renamed into place without ever replacing an existing
one, or uploaded to an object store as one object."""

from __future__ import annotations

import os

from quicksave.commit import fsync_path
from quicksave.errors import CheckpointExistsError
from quicksave.storage.backend import Backend


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
