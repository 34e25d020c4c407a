"""Writing objects to S3 from the caller's memory: one PUT up to the part size
(:func:`put`), a multipart upload of slices of the buffer beyond it, several parts in
flight on the backend's :class:`~quicksave.storage.transfer_pool.TransferPool`, aborted
when any part fails; and the conditional PUT of the writer lease (:func:`put_if`).
No temporary files, no whole-buffer copies.

Called by :class:`~quicksave.storage.s3.backend.S3Backend` (any thread); every request
goes through :meth:`~quicksave.storage.s3.requests.S3Requests.call`. Torch-free.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.storage.backend import Range, byte_view, check_ranges, hash_ranges
from quicksave.storage.s3.errors import error_code
from quicksave.storage.s3.requests import S3Requests
from quicksave.storage.transfer_pool import TransferPool

MIN_PART_SIZE = 5 << 20  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000  # S3: at most 10,000 parts per upload
SMALL_BODY = 1 << 20  # bodies up to this are sent as bytes (see _body)
# Single PUTs up to this size carry Content-MD5 (manifests, .metadata, parts, small data
# files: hashing at most 8 MiB is cheap next to the PUT it guards).
CHECKED_PUT = 8 << 20


class _MemoryReader:
    """A read-only, seekable file over a memoryview: what botocore takes as a request
    body (it refuses a bare memoryview) without copying the buffer. ``read`` returns
    slices of the view; each attempt gets a fresh reader, so retries rewind."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def __len__(self) -> int:  # botocore's Content-Length (remaining bytes)
        return len(self._view) - self._pos

    def read(self, size: int | None = -1) -> memoryview:
        end = (
            len(self._view) if size is None or size < 0 else min(self._pos + size, len(self._view))
        )
        chunk = self._view[self._pos : end]
        self._pos = end
        return chunk

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(base + pos, len(self._view)))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:  # botocore may close the body; the view stays the caller's
        pass


def _body(view: memoryview) -> bytes | _MemoryReader:
    """A request body for ``view``: small ones as bytes (a copy of up to 1 MiB costs less
    than the ``Expect: 100-continue`` round trip botocore adds to file-like bodies),
    larger ones as a :class:`_MemoryReader` over the caller's memory."""
    if len(view) <= SMALL_BODY:
        return view.tobytes()
    return _MemoryReader(view)


def part_size_for(part_size: int, size: int) -> int:
    """The part size of an upload of ``size`` bytes: ``part_size``, or more to keep
    within 10,000 parts (whole MiB)."""
    part = part_size
    if size > part * MAX_PARTS:  # keep within 10,000 parts, whole MiB
        part = -(-size // MAX_PARTS)
        part = -(-part // (1 << 20)) * (1 << 20)
    return part


def put(
    req: S3Requests,
    pool: TransferPool,
    part_size: int,
    key: str,
    data: memoryview,
    ranges: Sequence[Range],
) -> dict[str, str]:
    """Store ``data`` as ``key`` (one PUT, or a multipart upload of parts of
    ``part_size`` bytes or more) and return the xxh3-64 of every range."""
    view = byte_view(data)
    size = len(view)
    check_ranges(ranges, size)
    url = req.url(key)
    part = part_size_for(part_size, size)
    if size <= part:
        digests = hash_ranges(view, ranges)
        extra = {}
        if size <= CHECKED_PUT:
            # The store checks the body it got against this and refuses a short one.
            # A PUT cut off by the writer's death (SIGKILL mid-request) must never
            # leave a truncated object: for the manifest, that is a commit.
            extra["ContentMD5"] = base64.b64encode(hashlib.md5(view).digest()).decode()
        req.call(
            lambda: req.client.put_object(Bucket=req.bucket, Key=key, Body=_body(view), **extra),
            what=f"PUT of {size} bytes",
            url=url,
        )
        return digests
    return _put_multipart(req, pool, key, view, ranges, part, url)


def _put_multipart(
    req: S3Requests,
    pool: TransferPool,
    key: str,
    view: memoryview,
    ranges: Sequence[Range],
    part: int,
    url: str,
) -> dict[str, str]:
    size = len(view)
    created = req.call(
        lambda: req.client.create_multipart_upload(Bucket=req.bucket, Key=key),
        what="starting a multipart upload",
        url=url,
    )
    upload_id = created["UploadId"]
    try:
        offsets = range(0, size, part)
        count = len(offsets)

        def upload(number: int, piece: memoryview) -> Callable[[threading.Event], dict]:
            def task(stop: threading.Event) -> dict:
                answer = req.call(
                    lambda: req.client.upload_part(
                        Bucket=req.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=_body(piece),
                    ),
                    what=f"upload of part {number}/{count} ({len(piece)} bytes)",
                    url=url,
                    stop=stop,
                )
                return {"PartNumber": number, "ETag": answer["ETag"]}

            return task

        futures, stop = pool.start(
            [upload(i + 1, view[off : off + part]) for i, off in enumerate(offsets)]
        )
        try:
            # the caller's thread hashes while the parts are on the wire (xxhash drops
            # the GIL): one more pass over memory, overlapped with the upload
            digests = hash_ranges(view, ranges)
        except BaseException:
            TransferPool.stop(futures, stop)
            raise
        parts = pool.finish(futures, stop)
        _complete(req, key, upload_id, parts, size, url)
        return digests
    except BaseException as exc:
        _abort(req, key, upload_id)
        if isinstance(exc, CheckpointError):
            raise
        if isinstance(exc, Exception):
            raise CheckpointError(
                f"multipart upload of {size} bytes failed (aborted): "
                f"{req.scrub(f'{type(exc).__name__}: {exc}')}",
                path=url,
            ) from exc
        raise


def _complete(req: S3Requests, key: str, upload_id: str, parts: list, size: int, url: str) -> None:
    tries = 0

    def complete() -> None:
        nonlocal tries
        tries += 1
        try:
            req.client.complete_multipart_upload(
                Bucket=req.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except Exception as exc:
            # an earlier try may have completed it and only its answer was lost
            if tries > 1 and error_code(exc)[0] == "NoSuchUpload":
                info = req.head(key)
                if info is not None and info.size == size:
                    return
            raise

    req.call(complete, what=f"completing a multipart upload of {len(parts)} parts", url=url)


def _abort(req: S3Requests, key: str, upload_id: str) -> None:
    """Abort an upload, best effort and briefly (two tries at most: the store may be
    what failed; a leftover is found later by the backend's ``abort_uploads``)."""
    tries = min(2, req.policy.max_attempts or 2)
    try:
        req.call(
            lambda: req.client.abort_multipart_upload(
                Bucket=req.bucket, Key=key, UploadId=upload_id
            ),
            what="aborting a multipart upload",
            url=req.url(key),
            policy=dataclasses.replace(req.policy, max_attempts=tries),
        )
    except Exception:  # noqa: BLE001 - the original failure is what matters
        pass


def put_if(req: S3Requests, key: str, data: bytes, if_match: str | None) -> str | None:
    """The backend's ``put_if``: ``If-None-Match: *`` (``if_match`` None) or
    ``If-Match``; the new ETag, or None when the condition did not hold."""
    view = byte_view(data)
    url = req.url(key)
    condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
    md5 = base64.b64encode(hashlib.md5(view).digest()).decode()

    def attempt() -> tuple[str, str | None]:
        conflicts = 0
        while True:
            try:
                answer = req.client.put_object(
                    Bucket=req.bucket, Key=key, Body=bytes(view), ContentMD5=md5, **condition
                )
            except Exception as exc:
                code, status = error_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return "refused", None
                if status == 501 or code == "NotImplemented":
                    return "unsupported", None
                if code == "ConditionalRequestConflict" and conflicts < 3:
                    # two conditional writes of the key crossed: S3 asks for another
                    # try, whose condition it evaluates afresh
                    conflicts += 1
                    req.policy.sleep(req.policy.backoff(conflicts))
                    continue
                raise
            return "written", answer.get("ETag")

    outcome, tag = req.call(attempt, what="conditional PUT", url=url)
    if outcome == "unsupported" or (outcome == "written" and not tag):
        raise NotImplementedError(f"{url}: the store does not support conditional writes")
    return tag
