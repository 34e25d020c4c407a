"""The S3 backend: :class:`S3Backend`, the :class:`~quicksave.storage.backend.Backend` of
one bucket of Amazon S3 or an S3-compatible store (SeaweedFS, MinIO...).

It wires the pieces of :mod:`quicksave.storage.s3`: the client
(:mod:`~quicksave.storage.s3.client`), the retrying request layer
(:mod:`~quicksave.storage.s3.requests`), uploads (:mod:`~quicksave.storage.s3.upload`),
downloads (:mod:`~quicksave.storage.s3.download`) and the namespace
(:mod:`~quicksave.storage.s3.listing`), and owns the thread pool of parallel parts and
ranged reads. Made by ``Location.open`` (any rank, and the worker process); torch-free.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.storage.backend import AssembledWrites, ObjectInfo, Range, S3Options
from quicksave.storage.retry import RetryPolicy, StoreHealth
from quicksave.storage.s3 import download, listing, upload
from quicksave.storage.s3.client import make_client
from quicksave.storage.s3.requests import S3Requests
from quicksave.storage.transfer_pool import TransferPool


class S3Backend(AssembledWrites):
    """The :class:`~quicksave.storage.backend.Backend` of one S3 bucket.

    Args:
        bucket: the bucket's name.
        options: endpoint, credentials, part size, concurrency, retries, timeouts
            (``None`` fields leave a setting to the standard AWS chain).
        client: an S3 client to use instead of making one (tests).
        rng: the random source of backoff jitter (default: a fresh ``random.Random``).
        sleep, clock: injectable for tests.
        scheme: the URL scheme its locations are named with (an S3-compatible server
            registered under a scheme of its own: ``quicksave.storage.schemes.S3Scheme``).

    Thread-safe: the botocore client is shared by threads; the thread pool of parallel
    parts and ranged reads belongs to this instance (made on first use, stopped by
    :meth:`close`).
    """

    atomic_rename = False

    def __init__(
        self,
        bucket: str,
        options: S3Options | None = None,
        *,
        client: Any = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        health: StoreHealth | None = None,
        scheme: str = "s3",
    ) -> None:
        if not bucket or "/" in bucket:
            raise CheckpointError(f"not an S3 bucket name: {bucket!r}")
        self.bucket = bucket
        self.scheme = scheme
        self.options = options = options if options is not None else S3Options()
        self.part_size = max(int(options.part_size), upload.MIN_PART_SIZE)
        self.max_concurrency = max(1, int(options.max_concurrency))
        attempts = options.max_attempts
        self.policy = RetryPolicy(
            max_attempts=None if attempts is None else max(1, int(attempts)),
            deadline_s=float(options.retry_deadline_s),
            rng=rng if rng is not None else random.Random(),
            sleep=sleep,
            clock=clock,
            health=health,
        )
        secrets = {s for s in (options.secret_access_key, options.session_token) if s}
        self._pool = TransferPool(self.max_concurrency, "quicksave-s3")
        self._owns_client = client is None
        if client is None:
            client, secrets = make_client(bucket, options, self.max_concurrency)
        self._client = client
        meta = getattr(client, "meta", None)
        self.endpoint_url: str | None = getattr(meta, "endpoint_url", None) or options.endpoint_url
        self._requests = S3Requests(
            bucket, client, options, self.policy, secrets, self.endpoint_url, scheme
        )

    def url(self, key: str) -> str:
        return self._requests.url(key)

    def __repr__(self) -> str:
        return f"S3Backend(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r})"

    # ----------------------------------------------------------------- objects

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        return upload.put(self._requests, self._pool, self.part_size, key, data, ranges)

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        download.read_into(self._requests, self._pool, self.part_size, key, offset, dest)

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        download.read_scatter(self._requests, self._pool, self.part_size, key, offset, dests)

    def get(self, key: str, max_bytes: int) -> bytes:
        return download.get(self._requests, key, max_bytes)

    # ----------------------------------------------------------------- namespace

    def stat(self, key: str) -> ObjectInfo | None:
        return listing.stat(self._requests, key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return listing.list_objects(self._requests, prefix)

    def children(self, prefix: str) -> list[str]:
        return listing.children(self._requests, prefix)

    def delete(self, keys: Iterable[str]) -> None:
        listing.delete(self._requests, keys)

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        return listing.abort_uploads(self._requests, prefix, older_than_s)

    # ----------------------------------------------------------------- conditional

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        return upload.put_if(self._requests, key, data, if_match)

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        return download.get_tagged(self._requests, key, max_bytes)

    def close(self) -> None:
        self._pool.close()
        if self._owns_client:
            closer = getattr(self._client, "close", None)
            if closer is not None:
                try:
                    closer()
                except Exception:  # noqa: BLE001
                    pass

    def __enter__(self) -> S3Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
