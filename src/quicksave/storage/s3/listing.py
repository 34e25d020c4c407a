"""The namespace of an S3 bucket: what is there (:func:`stat`, :func:`list_objects`,
:func:`children`, through paginated listings fetched page by page with retries), and
removing it (:func:`delete` in batches of 1,000 keys; :func:`abort_uploads`: the
multipart uploads that crashed saves left behind).

Called by :class:`~quicksave.storage.s3.backend.S3Backend` (any thread); every request
goes through :meth:`~quicksave.storage.s3.requests.S3Requests.call`. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.storage.backend import ObjectInfo
from quicksave.storage.s3.errors import error_code, is_not_found
from quicksave.storage.s3.requests import S3Requests

DELETE_BATCH = 1000  # S3: at most 1,000 keys per DeleteObjects


def stat(req: S3Requests, key: str) -> ObjectInfo | None:
    """The object ``key`` (HEAD), or None if there is none (in a bucket that exists)."""
    url = req.url(key)

    def attempt() -> ObjectInfo | None:
        try:
            answer = req.client.head_object(Bucket=req.bucket, Key=key)
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise
        return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())

    info = req.call(attempt, what="HEAD", url=url)
    if info is None:
        # HEAD answers a missing bucket and a missing key alike (bare 404): tell
        # them apart once per backend, so a typo in the bucket is not "no checkpoint"
        req.check_bucket(url)
    return info


def _pages(req: S3Requests, method: str, url: str, what: str, **params: Any) -> Iterator[dict]:
    """The pages of a paginated listing, each fetched with retries."""
    call = getattr(req.client, method)
    token: dict[str, Any] = {}
    while True:
        page = req.call(lambda t=token: call(**params, **t), what=what, url=url)
        yield page
        if not page.get("IsTruncated"):
            return
        if method == "list_objects_v2":
            nxt = page.get("NextContinuationToken")
            token = {"ContinuationToken": nxt}
        else:
            nxt = page.get("NextKeyMarker")
            token = {"KeyMarker": nxt, "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        if not nxt:
            return


def list_objects(req: S3Requests, prefix: str) -> Iterator[ObjectInfo]:
    """Every object whose key starts with ``prefix``."""
    url = req.url(prefix)
    for page in _pages(req, "list_objects_v2", url, "LIST", Bucket=req.bucket, Prefix=prefix):
        for item in page.get("Contents") or ():
            yield ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())


def children(req: S3Requests, prefix: str) -> list[str]:
    """The names directly under ``prefix`` (objects and common prefixes), sorted."""
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    url = req.url(prefix)
    names: set[str] = set()
    for page in _pages(
        req, "list_objects_v2", url, "LIST", Bucket=req.bucket, Prefix=prefix, Delimiter="/"
    ):
        for item in page.get("CommonPrefixes") or ():
            name = item["Prefix"][len(prefix) :].rstrip("/")
            if name:
                names.add(name)
        for item in page.get("Contents") or ():
            name = item["Key"][len(prefix) :]
            if name:
                names.add(name)
    return sorted(names)


def delete(req: S3Requests, keys: Iterable[str]) -> None:
    """Delete ``keys`` (missing ones are no error), 1,000 a request."""
    todo = list(dict.fromkeys(keys))
    for lo in range(0, len(todo), DELETE_BATCH):
        batch = todo[lo : lo + DELETE_BATCH]
        url = req.url(batch[0])
        answer = req.call(
            lambda batch=batch: req.client.delete_objects(
                Bucket=req.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            ),
            what=f"DELETE of {len(batch)} object(s)",
            url=url,
        )
        failed = [e for e in answer.get("Errors") or () if e.get("Code") != "NoSuchKey"]
        if failed:
            first = failed[0]
            raise CheckpointError(
                f"could not delete {len(failed)} of {len(batch)} object(s); first: "
                f"{first.get('Code')}: {req.scrub(str(first.get('Message', '')))}",
                path=req.url(first.get("Key", batch[0])),
            )


def abort_uploads(req: S3Requests, prefix: str, older_than_s: float) -> int:
    """Abort the multipart uploads under ``prefix`` started more than ``older_than_s``
    seconds ago; returns how many."""
    url = req.url(prefix)
    now = time.time()
    count = 0
    for page in _pages(
        req, "list_multipart_uploads", url, "listing multipart uploads",
        Bucket=req.bucket, Prefix=prefix,
    ):  # fmt: skip
        for upload in page.get("Uploads") or ():
            initiated = upload.get("Initiated")
            age = now - initiated.timestamp() if initiated is not None else float("inf")
            if age <= older_than_s:
                continue
            key, upload_id = upload["Key"], upload["UploadId"]

            def abort(key: str = key, upload_id: str = upload_id) -> None:
                try:
                    req.client.abort_multipart_upload(
                        Bucket=req.bucket, Key=key, UploadId=upload_id
                    )
                except Exception as exc:
                    if error_code(exc)[0] != "NoSuchUpload":  # gone already: fine
                        raise

            req.call(abort, what="aborting a multipart upload", url=req.url(key))
            count += 1
    return count
