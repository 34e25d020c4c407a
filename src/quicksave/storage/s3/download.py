"""Reading S3 objects straight into the caller's buffers: ranged GETs (:func:`read_into`;
parallel on the backend's :class:`~quicksave.storage.transfer_pool.TransferPool` for
reads larger than a part), the response body read into the destination slice with
``readinto``; scatter reads of neighbouring chunks (:func:`read_scatter`); whole small
objects (:func:`get`, :func:`get_tagged`, refused beyond a size bound). A ranged GET that
breaks off is retried from where it stopped.

Called by :class:`~quicksave.storage.s3.backend.S3Backend` (any thread); every request
goes through :meth:`~quicksave.storage.s3.requests.S3Requests.call`. Torch-free.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Sequence
from typing import Any

from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import byte_view
from quicksave.storage.s3.errors import error_code, is_not_found
from quicksave.storage.s3.listing import stat
from quicksave.storage.s3.requests import S3Requests
from quicksave.storage.transfer_pool import TransferPool

# how the response body is read: "readinto" (straight into the destination, through the
# http.client response under urllib3) or "copy" (botocore's read(), then a memcpy)
READ_MODE = "readinto"
_COPY_CHUNK = 8 << 20


def read_into(
    req: S3Requests, pool: TransferPool, step: int, key: str, offset: int, dest: memoryview
) -> None:
    """Fill ``dest`` from ``key`` at ``offset``: one ranged GET, or ``step``-sized ranged
    GETs in parallel for a larger read."""
    view = byte_view(dest, writable=True)
    size = len(view)
    url = req.url(key)
    if offset < 0:
        raise ValueError(f"negative offset {offset}")
    if size == 0:
        info = stat(req, key)
        if info is None:
            raise CheckpointNotFoundError("no such object", path=url)
        if info.size < offset:
            raise _short(url, offset, 0, info.size)
        return
    if size <= step:
        _read_range(req, key, offset, view, url, None)
        return
    pool.run(
        [
            (
                lambda stop, lo=lo: _read_range(
                    req, key, offset + lo, view[lo : lo + step], url, stop
                )
            )
            for lo in range(0, size, step)
        ]
    )


def read_scatter(
    req: S3Requests,
    pool: TransferPool,
    step: int,
    key: str,
    offset: int,
    dests: Sequence[memoryview],
) -> None:
    """Fill each of ``dests`` in turn from ``key`` at ``offset``: one ranged GET whose
    body lands in every view."""
    views = [byte_view(d, writable=True) for d in dests]
    views = [v for v in views if len(v)]
    if len(views) <= 1:
        read_into(req, pool, step, key, offset, views[0] if views else memoryview(bytearray()))
        return
    _read_range(req, key, offset, views, req.url(key), None)


def _short(url: str, offset: int, length: int, actual: int | None) -> CheckpointError:
    have = "of unknown size" if actual is None else f"only {actual} bytes long"
    return CorruptCheckpointError(
        f"object is {have}; reading {length} bytes at offset {offset} needs "
        f"{offset + length}: truncated, or not the expected object",
        path=url,
    )


def _read_range(
    req: S3Requests,
    key: str,
    offset: int,
    dest: memoryview | list[memoryview],
    url: str,
    stop: threading.Event | None,
) -> None:
    """Fill ``dest`` (one view, or several filled in turn) from ``key`` at
    ``offset``: one ranged GET, resumed where it broke off when a retry is needed."""
    views = [dest] if isinstance(dest, memoryview) else dest
    length = sum(len(v) for v in views)
    done = 0

    def attempt() -> None:
        nonlocal done
        start = offset + done
        want = length - done
        try:
            answer = req.client.get_object(
                Bucket=req.bucket, Key=key, Range=f"bytes={start}-{start + want - 1}"
            )
        except Exception as exc:
            if error_code(exc)[0] == "InvalidRange":  # the object ends before `start`
                info = req.head(key)
                raise _short(url, offset, length, info.size if info else None) from None
            raise
        body = answer["Body"]
        got = answer.get("ContentLength")
        total = _parse_total(answer.get("ContentRange"))
        if answer.get("ContentRange") is None and start != 0:
            _close_body(body, reuse=False)
            raise CheckpointError("the server ignored the Range header of a ranged GET", path=url)
        if got is not None and got < want:
            _close_body(body, reuse=False)
            raise _short(url, offset, length, total)
        try:
            done += _read_body_into(body, _skip(views, done))
        except _Progress as p:  # keep what arrived: the next try resumes after it
            done += p.got
            raise p.cause from None

    req.call(attempt, what=f"ranged GET of {length} bytes at offset {offset}", url=url, stop=stop)


def get(req: S3Requests, key: str, max_bytes: int) -> bytes:
    """The whole object ``key``, refused beyond ``max_bytes``."""
    url = req.url(key)

    def attempt() -> bytes:
        answer = req.client.get_object(Bucket=req.bucket, Key=key)
        return _small_body(answer, max_bytes, url)

    return req.call(attempt, what="GET", url=url)


def get_tagged(req: S3Requests, key: str, max_bytes: int) -> tuple[bytes, str] | None:
    """The whole object ``key`` and its ETag, or None if there is none."""
    url = req.url(key)

    def attempt() -> tuple[bytes, str] | None:
        try:
            answer = req.client.get_object(Bucket=req.bucket, Key=key)
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise
        return _small_body(answer, max_bytes, url), str(answer.get("ETag") or "")

    got = req.call(attempt, what="GET", url=url)
    if got is None:
        req.check_bucket(url)  # a typo in the bucket is no "no object"
    return got


def _parse_total(content_range: str | None) -> int | None:
    """The object's size from a ``Content-Range: bytes a-b/total`` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (taken in turn)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _read_body_into(body: Any, dests: list[memoryview]) -> int:
    """Read a botocore StreamingBody into ``dests``, filling each in turn (a scatter
    read: neighbouring chunks straight into their destinations); returns how many bytes
    arrived before a failure (raised after counting, so that a retry resumes)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = READ_MODE == "readinto" and fp is not None and hasattr(fp, "readinto")
    got = 0
    try:
        for dest in dests:
            want, have = len(dest), 0
            while have < want:
                if direct:
                    n = fp.readinto(dest[have:])
                else:
                    chunk = body.read(min(want - have, _COPY_CHUNK))
                    n = len(chunk)
                    dest[have : have + n] = chunk
                if not n:
                    raise http.client.IncompleteRead(b"", want - have)
                have += n
                got += n
    except BaseException as exc:
        _close_body(body, reuse=False)
        raise _Progress(got, exc) from exc
    _close_body(body, reuse=True)
    return got


class _Progress(Exception):
    """Internal: a body read failed after ``got`` bytes (``cause`` says why)."""

    def __init__(self, got: int, cause: BaseException) -> None:
        super().__init__(got, cause)
        self.got = got
        self.cause = cause


def _small_body(answer: dict, max_bytes: int, url: str) -> bytes:
    """The body of a GET answer, refused (CorruptCheckpointError) beyond ``max_bytes``:
    by its declared length before reading, or by what came."""
    body = answer["Body"]
    size = answer.get("ContentLength")
    if size is not None and size > max_bytes:
        _close_body(body, reuse=False)
        raise CorruptCheckpointError(
            f"object is {size} bytes, more than the {max_bytes} expected at most", path=url
        )
    data = body.read()
    _close_body(body, reuse=True)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(
            f"object is {len(data)} bytes, more than the {max_bytes} expected at most", path=url
        )
    return data


def _close_body(body: Any, *, reuse: bool) -> None:
    """Finish with a response body: hand a fully read connection back to the pool
    (``reuse``), or drop it (a half-read one cannot carry another request)."""
    raw = getattr(body, "_raw_stream", None)
    try:
        if reuse and raw is not None and hasattr(raw, "release_conn"):
            raw.release_conn()
            return
        body.close()
        if raw is not None and hasattr(raw, "release_conn"):
            raw.release_conn()
    except Exception:  # noqa: BLE001
        pass
