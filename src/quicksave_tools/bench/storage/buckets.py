"""The buckets of one ``quicksave bench --storage`` run: made fresh per shape and
repeat (or one given bucket), emptied and deleted after each use (:class:`Buckets`),
and :func:`delete_prefix` for one checkpoint's objects."""

from __future__ import annotations

import contextlib
from typing import Any


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix`` and abort its unfinished uploads."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents") or ()]
    for lo in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=bucket,
            Delete={"Objects": [{"Key": k} for k in keys[lo : lo + 1000]], "Quiet": True},
        )
    try:
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    except Exception:  # noqa: BLE001 - not every store lists uploads
        uploads = None
    for u in uploads or ():
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])


class Buckets:
    """Fresh buckets (or one given bucket) for the run; objects and own buckets are
    deleted by :meth:`drop` and :meth:`close` (a store frees a bucket's space at once,
    deleted objects only at its next compaction)."""

    def __init__(self, client: Any, run_id: str, given: str | None) -> None:
        self.client, self.run_id, self.given = client, run_id, given
        self.made: list[str] = []

    def name(self, tag: str) -> str:
        return self.given or f"qsbench-{self.run_id}-{tag}"

    def make(self, tag: str) -> str:
        name = self.name(tag)
        if self.given is None:
            try:
                self.client.create_bucket(Bucket=name)
            except self.client.exceptions.BucketAlreadyOwnedByYou:
                pass
            self.made.append(name)
        # the first write to a new bucket waits for its volumes: not on a method's time
        key = f"{self.run_id}/.probe"
        self.client.put_object(Bucket=name, Key=key, Body=b"probe")
        self.client.delete_object(Bucket=name, Key=key)
        return name

    def drop(self, tag: str) -> None:
        name = self.name(tag)
        with contextlib.suppress(Exception):
            delete_prefix(self.client, name, "" if self.given is None else self.run_id + "/")
        if self.given is None and name in self.made:
            with contextlib.suppress(Exception):
                self.client.delete_bucket(Bucket=name)
            self.made.remove(name)

    def close(self) -> None:
        for name in list(self.made):
            with contextlib.suppress(Exception):
                delete_prefix(self.client, name, "")
            with contextlib.suppress(Exception):
                self.client.delete_bucket(Bucket=name)
        self.made.clear()
        if self.given is not None:
            with contextlib.suppress(Exception):
                delete_prefix(self.client, self.given, self.run_id + "/")
