"""The S3 backend: one bucket of Amazon S3 or an S3-compatible store (SeaweedFS, MinIO...).

Objects are written from the caller's memory (``put``: one PUT up to ``part_size``, a
multipart upload of slices of the buffer beyond it, several parts in flight) and read
straight into the caller's buffer (``read_into``: ranged GETs, parallel for large reads,
the response body read into the destination slice with ``readinto``). No temporary
files, no whole-buffer copies.

Every request goes through one retry loop (:func:`~quicksave.storage.retry.call_with_retries`):
throttling, 5xx and connection failures (:func:`~quicksave.storage.s3.errors.is_retryable`)
are retried with full-jitter exponential backoff for as long as
``S3Options.retry_deadline_s`` allows (``S3Options.max_attempts``, unset by default, may
also cap the tries); botocore's own retries are switched off so that there is exactly
one loop. Everything else (access denied, bad credentials, a missing bucket) becomes a
:class:`~quicksave.errors.CheckpointError` at once, naming the ``s3://`` URL. No message
ever holds a secret key or session token.

Modules, in the order a request meets them:

- :mod:`~quicksave.storage.s3.backend`: :class:`S3Backend`, which wires the others;
- :mod:`~quicksave.storage.s3.client`: the botocore client, endpoint and credentials;
- :mod:`~quicksave.storage.s3.upload`: single and multipart PUTs, aborts, conditional PUTs;
- :mod:`~quicksave.storage.s3.download`: ranged and scatter reads, small whole objects;
- :mod:`~quicksave.storage.s3.listing`: HEAD, listings, deletion, stale uploads;
- :mod:`~quicksave.storage.s3.requests`: the retrying, translating request layer;
- :mod:`~quicksave.storage.s3.errors`: which failures are transient, what to call them.

Torch-free (the worker process imports it); boto3 is imported when a backend is made,
with a clear error naming the ``quicksave[s3]`` extra when it is not installed.
"""

from quicksave.storage.s3.backend import S3Backend

__all__ = ["S3Backend"]
