"""The raw baselines of ``quicksave bench --storage`` (:class:`RawS3`): one multipart
upload of slices of one buffer and parallel ranged GETs read straight into one buffer
(own threads), or boto3's managed transfers of the same buffer."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
from typing import Any

from quicksave_tools.bench.storage.config import MiB


class _ViewFile:
    """A seekable file over a memoryview: read-only (request bodies, ``read`` returns
    slices, no copy) or write-only (``download_fileobj`` target, ``write`` copies in)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def __len__(self) -> int:
        return len(self.view) - self.pos

    def read(self, size: int | None = -1) -> memoryview:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.pos + size)
        chunk = self.view[self.pos : end]
        self.pos = end
        return chunk

    def write(self, data: Any) -> int:
        n = len(data)
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = max(0, min(base + pos, len(self.view)))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _read_body_into(body: Any, dest: memoryview) -> None:
    """Fill ``dest`` from a botocore StreamingBody: straight from the socket with
    http.client's ``readinto`` where it is reachable, else ``read`` and copy."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    got, want = 0, len(dest)
    if fp is not None and hasattr(fp, "readinto"):
        while got < want:
            n = fp.readinto(dest[got:])
            if not n:
                raise http.client.IncompleteRead(b"", want - got)
            got += n
        if hasattr(raw, "release_conn"):
            raw.release_conn()
        return
    while got < want:
        chunk = body.read(min(want - got, 8 * MiB))
        if not chunk:
            raise http.client.IncompleteRead(b"", want - got)
        dest[got : got + len(chunk)] = chunk
        got += len(chunk)
    body.close()


class RawS3:
    """The raw baselines: one multipart upload of slices of one buffer and parallel
    ranged GETs into one buffer (own threads), or boto3's managed transfers."""

    def __init__(self, client: Any, part_size: int, concurrency: int) -> None:
        self.client, self.part_size, self.concurrency = client, part_size, concurrency
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency, "raw-s3")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def put(self, bucket: str, key: str, view: memoryview) -> None:
        c, step = self.client, self.part_size
        if len(view) <= step:
            c.put_object(Bucket=bucket, Key=key, Body=view.tobytes())
            return
        upload_id = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def part(i: int, lo: int) -> dict[str, Any]:
            answer = c.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=i + 1,
                Body=_ViewFile(view[lo : lo + step]),
            )
            return {"ETag": answer["ETag"], "PartNumber": i + 1}

        try:
            futures = [
                self.pool.submit(part, i, lo) for i, lo in enumerate(range(0, len(view), step))
            ]
            parts = [f.result() for f in futures]
            c.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                c.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    def get(self, bucket: str, key: str, dest: memoryview) -> None:
        step = self.part_size

        def ranged(lo: int) -> None:
            hi = min(lo + step, len(dest))
            answer = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")
            _read_body_into(answer["Body"], dest[lo:hi])

        futures = [self.pool.submit(ranged, lo) for lo in range(0, len(dest), step)]
        for f in futures:
            f.result()

    def transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.concurrency,
            use_threads=True,
        )

    def boto3_put(self, bucket: str, key: str, view: memoryview) -> None:
        self.client.upload_fileobj(_ViewFile(view), bucket, key, Config=self.transfer_config())

    def boto3_get(self, bucket: str, key: str, dest: memoryview) -> None:
        self.client.download_fileobj(bucket, key, _ViewFile(dest), Config=self.transfer_config())
