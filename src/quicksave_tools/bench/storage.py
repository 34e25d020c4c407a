"""``quicksave bench --storage``: save and load throughput against an S3 server, and what
checkpointing to S3 costs a training loop, measured side by side in one run.

Unless ``--endpoint URL`` is given (credentials and region then come from the AWS
environment chain), the benchmark starts its own SeaweedFS (``weed server -s3`` on
loopback, :class:`~quicksave_tools.testing.seaweed.SeaweedServer`) and stops it (its process
group killed) when it ends, also on an error, Ctrl-C or SIGTERM.

Every method moves the same bytes (``--size-mib``, default 1 GiB) of each workload shape
(``--shapes``):

* ``large`` — four tensors of a quarter of the size each (256 MiB at 1 GiB), float32;
* ``small`` — 4 MiB tensors (256 at 1 GiB), float32 and bfloat16 alternating;
* ``model`` — a transformer's checkpoint: 24 layers of attention, MLP and layer-norm
  weights and biases (float32, hidden size chosen to fill the size), each with AdamW's
  ``exp_avg``, ``exp_avg_sq`` and a one-element ``step``: 1152 tensors from 4 bytes to
  a few MiB, most of the bytes in chunks under 8 MiB.

Methods (save, then load of what it saved, values checked; every save to a fresh
prefix; the objects are deleted after each load, and every shape and repeat gets a
fresh bucket, deleted afterwards):

* ``raw threads`` — the bytes packed once (untimed) into one buffer, uploaded as one
  multipart upload whose parts are slices of it (``--part-mib``, ``--concurrency`` in
  flight; no checksums) and read back with parallel ranged GETs straight into a
  buffer (``readinto``): the practical limit of this server and client.
* ``raw boto3`` — the same buffer through boto3's ``upload_fileobj`` /
  ``download_fileobj`` (``TransferConfig``, same part size and concurrency).
* ``dcp+MSC`` — ``dcp.save`` / ``dcp.load`` with the Multi-Storage Client's
  ``MultiStorageFileSystemWriter`` / ``Reader`` (``thread_count=2``), through an MSC
  config the benchmark writes in a temporary directory (MSC's default S3 settings).
* ``dcp+s3torchconnector`` — ``dcp.save`` / ``dcp.load`` with s3torchconnector's
  ``S3StorageWriter`` (``thread_count=2``) / ``S3StorageReader`` (path-style addressing,
  the endpoint given to its client); reported as not available, with the reason, where
  it cannot run.
* ``quicksave`` — ``quicksave.save`` / ``quicksave.load`` to ``s3://`` (defaults: 2
  writer threads, 4 reader threads, xxh3 of every chunk written and verified).

"raw" in the ratios is the faster of the two raw methods (by median). Every method is
run once on a tiny state dict first (imports, clients, connection pools), not timed;
the order of the methods rotates with every repeat. Reported per method: median and
best seconds and MB/s (10^6 bytes/s), and CPU seconds of this process and, for an own
server, of the server (on a small machine the client and the server share the CPUs).

The training-loop part (``--no-training`` skips it) runs a seeded MLP + AdamW with a
:class:`~quicksave.manager.CheckpointManager` (``async_mode="process"``, default
staging) checkpointing every ``--train-interval`` steps to ``s3://`` and to a local
directory, each run in a fresh process, with runs without checkpoints before, between
and after them. Overhead per checkpoint = (loop seconds, waiting for the last
checkpoint included, − the median loop seconds without checkpoints) / checkpoints.

Example::

    quicksave bench --storage
    quicksave bench --storage --size-mib 256 --repeat 1 --json storage.json
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... quicksave bench --storage \\
        --endpoint http://127.0.0.1:8333
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from quicksave.checksum import tensor_view
from quicksave_tools.bench.methods import nbytes_of, pid_cpu_s, state_dict_of
from quicksave_tools.bench.training import run_child

MiB = 1 << 20

RAW_THREADS = "raw threads"
RAW_BOTO3 = "raw boto3"
DCP_MSC = "dcp+MSC"
DCP_S3TC = "dcp+s3torchconnector"
QUICKSAVE = "quicksave"
METHODS = (RAW_THREADS, RAW_BOTO3, DCP_MSC, DCP_S3TC, QUICKSAVE)
RAW_METHODS = (RAW_THREADS, RAW_BOTO3)
SHAPES = ("large", "small", "model")
NOTES = {
    RAW_THREADS: "one multipart upload of slices of one buffer / parallel ranged GETs "
    "with readinto",
    RAW_BOTO3: "boto3 upload_fileobj / download_fileobj, TransferConfig",
    DCP_MSC: "MultiStorageFileSystemWriter/Reader, thread_count=2, MSC defaults",
    DCP_S3TC: "S3StorageWriter (thread_count=2) / S3StorageReader, path style",
    QUICKSAVE: "quicksave.save/load to s3:// (2 writer / 4 reader threads, xxh3)",
}
SMALL_TENSOR = 4 * MiB
WARMUP_BYTES = 8 * MiB
_CHILD = (
    "import sys; from quicksave_tools.bench.storage import train_child; "
    "sys.exit(train_child(sys.argv[1:]))"
)


@dataclass(frozen=True)
class StorageBenchConfig:
    """What ``quicksave bench --storage`` measures.

    Args:
        size_mib: bytes of each shape's state dict, in MiB.
        repeat: timed runs of every method per shape (their order rotates).
        shapes: workload shapes (see :data:`SHAPES`).
        methods: throughput methods (see :data:`METHODS`).
        endpoint: an S3 endpoint to use instead of starting SeaweedFS (credentials and
            region from the AWS environment chain).
        bucket: with ``endpoint``: an existing bucket to use (only the benchmark's own
            objects are written and deleted); default: fresh buckets, deleted after.
        concurrency: parts in flight of the raw methods.
        part_mib: part size of the raw methods.
        training: run the training-loop part.
        throughput: run the save/load throughput part.
        train_steps, train_interval, train_hidden, train_layers, train_batch: the loop
            (checkpoint every ``train_interval`` steps; ``train_layers`` Linear(hidden,
            hidden)).
        train_repeat: runs of each target (S3, local), alternating.
        train_threads: ``torch.set_num_threads`` of the training processes.
        directory: where the local-directory training run writes (default: the
            current directory).
        seed: seed of the tensor values and the model.
        train_timeout_s: a training run that takes longer is stopped, reported failed.
        train_pin: place the training processes on the first CPU this process may use and
            the checkpoint worker (``worker_cpus``) and the server the bench started on
            the others, the way a GPU trainer's loop thread and its host's spare cores
            are: the overhead then measures what checkpointing costs the loop itself, not
            what a store on the same two cores costs it.
        server_nice: the SeaweedFS the bench starts runs at this lower CPU priority: it
            stands in for a remote store, which would not take the trainer's CPUs (on this
            2-core machine the server otherwise uses ~11 CPU-s per GiB written beside the
            training loop it is measured against). 0 to share the CPUs equally.
    """

    size_mib: int = 1024
    repeat: int = 3
    shapes: tuple[str, ...] = SHAPES
    methods: tuple[str, ...] = METHODS
    endpoint: str | None = None
    bucket: str | None = None
    concurrency: int = 8
    part_mib: int = 32
    training: bool = True
    throughput: bool = True
    train_steps: int = 45
    train_interval: int = 10
    train_hidden: int = 1024
    train_layers: int = 8
    train_batch: int = 256
    train_repeat: int = 2
    train_threads: int = 2
    train_warmup: int = 1
    train_calibration_steps: int = 8
    directory: str | None = None
    seed: int = 0
    train_timeout_s: float = 900.0
    server_nice: int = 19
    train_pin: bool = False


# ------------------------------------------------------------------------ the server
@dataclass
class Target:
    """Where the benchmark writes: an S3 endpoint, its region and credentials (``None``:
    from the AWS chain), and the :class:`SeaweedServer` behind it if this run started
    one."""

    endpoint_url: str
    region: str
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    server: Any = None
    kind: str = "external"

    @classmethod
    def from_server(cls, server: Any, kind: str = "SeaweedFS on loopback") -> Target:
        """The target of a running :class:`~quicksave_tools.testing.seaweed.SeaweedServer`
        (``server`` is used for its CPU time, never stopped by the benchmark)."""
        return cls(
            server.endpoint_url,
            server.region,
            server.access_key_id,
            server.secret_access_key,
            server=server,
            kind=kind,
        )

    def env(self) -> dict[str, str]:
        """AWS_* variables that point SDKs (boto3, the CRT of s3torchconnector, MSC) here."""
        out = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }
        if self.access_key_id is not None and self.secret_access_key is not None:
            out["AWS_ACCESS_KEY_ID"] = self.access_key_id
            out["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key
        return out

    def client(self, concurrency: int = 8) -> Any:
        """A boto3 S3 client: path style, no request/response checksums, enough
        connections for ``concurrency`` parts in flight."""
        import boto3
        from botocore.config import Config

        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            max_pool_connections=max(2 * concurrency, 10),
            retries={"max_attempts": 3, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs: dict[str, Any] = {}
        if self.access_key_id is not None:
            kwargs["aws_access_key_id"] = self.access_key_id
            kwargs["aws_secret_access_key"] = self.secret_access_key
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config, **kwargs
        )

    def storage(self) -> Any:
        """quicksave's :class:`~quicksave.storage.StorageOptions` for this target."""
        from quicksave.storage import S3Options, StorageOptions

        return StorageOptions(
            s3=S3Options(
                endpoint_url=self.endpoint_url,
                region=self.region,
                access_key_id=self.access_key_id,
                secret_access_key=self.secret_access_key,
            )
        )

    def server_cpu_s(self) -> float | None:
        """CPU seconds the server's process has used so far (None: not ours)."""
        running = getattr(self.server, "_running", None)
        proc = getattr(running, "proc", None)
        if proc is None:
            return None
        return pid_cpu_s(proc.pid)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside (so that ``finally`` blocks stop
    the server); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def open_target(config: StorageBenchConfig, log: Any = None) -> Iterator[Target]:
    """The target of ``config``: ``config.endpoint`` (AWS chain), or a SeaweedFS started
    here and stopped (process group killed) when the block ends, however it ends."""
    if config.endpoint:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        yield Target(
            config.endpoint,
            region or "us-east-1",
            os.environ.get("AWS_ACCESS_KEY_ID"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
            kind="external",
        )
        return
    from quicksave_tools.testing.seaweed import SeaweedServer

    server = SeaweedServer(nice=config.server_nice)
    try:
        with _sigterm_as_interrupt():
            server.start()
            _say(log, f"SeaweedFS started at {server.endpoint_url} in {server.startup_s:.1f} s")
            yield Target.from_server(server, kind="SeaweedFS on loopback (started by the bench)")
    finally:
        server.stop()


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _say(log: Any, text: str) -> None:
    if log is not None:
        print(text, file=log, flush=True)


# ------------------------------------------------------------------------ buckets
def _delete_prefix(client: Any, bucket: str, prefix: str) -> None:
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


class _Buckets:
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
            _delete_prefix(self.client, name, "" if self.given is None else self.run_id + "/")
        if self.given is None and name in self.made:
            with contextlib.suppress(Exception):
                self.client.delete_bucket(Bucket=name)
            self.made.remove(name)

    def close(self) -> None:
        for name in list(self.made):
            with contextlib.suppress(Exception):
                _delete_prefix(self.client, name, "")
            with contextlib.suppress(Exception):
                self.client.delete_bucket(Bucket=name)
        self.made.clear()
        if self.given is not None:
            with contextlib.suppress(Exception):
                _delete_prefix(self.client, self.given, self.run_id + "/")


# ------------------------------------------------------------------------ state dicts
def shape_specs(shape: str, total_bytes: int) -> list[tuple[str, torch.dtype, int]]:
    """Names, dtypes and byte sizes of the tensors of ``shape`` (see the module doc)."""
    if shape == "large":
        each = max(4, (total_bytes // 4) // 4 * 4)
        return [(f"large.{i}", torch.float32, each) for i in range(4)]
    if shape == "small":
        n = max(1, total_bytes // SMALL_TENSOR)
        return [
            (f"layer.{i}.weight", torch.float32 if i % 2 == 0 else torch.bfloat16, SMALL_TENSOR)
            for i in range(n)
        ]
    if shape == "model":
        return _model_specs(total_bytes)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


MODEL_LAYERS = 24


def _model_specs(total_bytes: int) -> list[tuple[str, torch.dtype, int]]:
    """A transformer's parameters with AdamW's state, float32, ~``total_bytes`` in all:
    per layer 12 h^2 weights (qkv 3h^2, out h^2, MLP 4h^2 + 4h^2) and 8 small vectors."""
    h = max(8, int((total_bytes / (3 * 4 * 12 * MODEL_LAYERS)) ** 0.5) // 8 * 8)
    per_layer = (
        ("attn.qkv.weight", 3 * h * h),
        ("attn.qkv.bias", 3 * h),
        ("attn.out.weight", h * h),
        ("attn.out.bias", h),
        ("norm1.weight", h),
        ("norm1.bias", h),
        ("mlp.up.weight", 4 * h * h),
        ("mlp.up.bias", 4 * h),
        ("mlp.down.weight", 4 * h * h),
        ("mlp.down.bias", h),
        ("norm2.weight", h),
        ("norm2.bias", h),
    )
    specs = []
    for i in range(MODEL_LAYERS):
        for name, numel in per_layer:
            fqn = f"model.layers.{i}.{name}"
            specs.append((fqn, torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.exp_avg", torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.exp_avg_sq", torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.step", torch.float32, 4))
    return specs


def build_shape(shape: str, total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic state dict of ``shape`` holding about ``total_bytes``."""
    return state_dict_of(shape_specs(shape, total_bytes), seed)


def _pack(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bytes of every tensor of ``sd``, one after the other, in one uint8 tensor."""
    flat = torch.empty(nbytes_of(sd), dtype=torch.uint8)
    pos = 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        flat[pos : pos + n].copy_(t.reshape(-1).view(torch.uint8))
        pos += n
    return flat


# ------------------------------------------------------------------------ raw methods
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


# ------------------------------------------------------------------------ DCP methods
def write_msc_config(directory: str, target: Target, profiles: dict[str, str]) -> str:
    """An MSC config (JSON) with one S3 profile per ``{profile: bucket}``, all on
    ``target`` (path-style addressing; static credentials where the target has them,
    else MSC's default chain); returns its path."""
    doc: dict[str, Any] = {"profiles": {}}
    for profile, bucket in profiles.items():
        entry: dict[str, Any] = {
            "storage_provider": {
                "type": "s3",
                "options": {
                    "base_path": bucket,
                    "endpoint_url": target.endpoint_url,
                    "region_name": target.region,
                    "s3": {"addressing_style": "path"},
                },
            }
        }
        if target.access_key_id is not None:
            entry["credentials_provider"] = {
                "type": "S3Credentials",
                "options": {
                    "access_key": target.access_key_id,
                    "secret_key": target.secret_access_key,
                },
            }
        doc["profiles"][profile] = entry
    path = os.path.join(directory, "msc_config.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds a secret key
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def _dcp_msc_save(sd: dict[str, torch.Tensor], url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter

    dcp.save(sd, storage_writer=MultiStorageFileSystemWriter(url, thread_count=2), no_dist=True)


def _dcp_msc_load(dest: dict[str, torch.Tensor], url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

    dcp.load(dest, storage_reader=MultiStorageFileSystemReader(url, thread_count=2), no_dist=True)


class _S3tc:
    """s3torchconnector's DCP writer/reader, their client pointed at ``target``."""

    def __init__(self, target: Target) -> None:
        from s3torchconnector import S3ClientConfig  # ImportError: not installed

        self.target = target
        self.config = S3ClientConfig(force_path_style=True)

    def _fs(self, reader_constructor: Any = None) -> Any:
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem

        t = self.target
        client = S3Client(t.region, endpoint=t.endpoint_url, s3client_config=self.config)
        return S3FileSystem(
            t.region, s3_client=client, s3client_config=self.config,
            reader_constructor=reader_constructor,
        )  # fmt: skip

    def save(self, sd: dict[str, torch.Tensor], url: str) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(self.target.region, url, self.config, thread_count=2)
        writer.fs = self._fs()  # S3StorageWriter gives its client no endpoint
        dcp.save(sd, storage_writer=writer, no_dist=True)

    def load(self, dest: dict[str, torch.Tensor], url: str) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(self.target.region, url, self.config)
        reader.fs = self._fs(reader._reader_constructor)
        dcp.load(dest, storage_reader=reader, no_dist=True)


# ------------------------------------------------------------------------ measuring
def _cpu() -> float:
    return time.process_time()


@dataclass
class _Sample:
    seconds: float
    client_cpu_s: float
    server_cpu_s: float | None


def _timed(target: Target, fn: Callable[[], Any]) -> _Sample:
    gc.collect()
    s0, c0 = target.server_cpu_s(), _cpu()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    c1, s1 = _cpu(), target.server_cpu_s()
    server = None if s0 is None or s1 is None else s1 - s0
    return _Sample(dt, c1 - c0, server)


class _Methods:
    """Save and load of every method on one bucket; ``unavailable[m]`` says why a
    method cannot run here."""

    def __init__(self, target: Target, client: Any, config: StorageBenchConfig, msc: str):
        self.target, self.client, self.config = target, client, config
        self.raw = RawS3(client, config.part_mib * MiB, config.concurrency)
        self.msc_profiles = msc  # profile name prefix
        self.unavailable: dict[str, str] = {}
        self.s3tc: _S3tc | None = None
        if DCP_S3TC in config.methods:
            try:
                self.s3tc = _S3tc(target)
            except ImportError as e:
                self.unavailable[DCP_S3TC] = f"s3torchconnector is not installed ({e})"
        if DCP_MSC in config.methods:
            try:
                import multistorageclient.contrib.torch.filesystem  # noqa: F401
            except ImportError as e:
                self.unavailable[DCP_MSC] = f"multistorageclient is not installed ({e})"

    def close(self) -> None:
        self.raw.close()

    def save(self, method: str, bucket: str, tag: str, prefix: str, sd: dict, flat: Any) -> None:
        if method == RAW_THREADS:
            self.raw.put(bucket, prefix + "/data", tensor_view(flat))
        elif method == RAW_BOTO3:
            self.raw.boto3_put(bucket, prefix + "/data", tensor_view(flat))
        elif method == DCP_MSC:
            _dcp_msc_save(sd, f"msc://{self.msc_profiles}{tag}/{prefix}")
        elif method == DCP_S3TC:
            assert self.s3tc is not None
            self.s3tc.save(sd, f"s3://{bucket}/{prefix}")
        elif method == QUICKSAVE:
            import quicksave

            quicksave.save(sd, f"s3://{bucket}/{prefix}", storage=self.target.storage())
        else:
            raise ValueError(f"unknown method {method!r}")

    def load(self, method: str, bucket: str, tag: str, prefix: str, dest: dict, flat: Any) -> None:
        if method == RAW_THREADS:
            self.raw.get(bucket, prefix + "/data", tensor_view(flat))
        elif method == RAW_BOTO3:
            self.raw.boto3_get(bucket, prefix + "/data", tensor_view(flat))
        elif method == DCP_MSC:
            _dcp_msc_load(dest, f"msc://{self.msc_profiles}{tag}/{prefix}")
        elif method == DCP_S3TC:
            assert self.s3tc is not None
            self.s3tc.load(dest, f"s3://{bucket}/{prefix}")
        elif method == QUICKSAVE:
            import quicksave

            quicksave.load(dest, f"s3://{bucket}/{prefix}", storage=self.target.storage())
        else:
            raise ValueError(f"unknown method {method!r}")


@dataclass
class _Data:
    """One shape's source and destination, as tensors and as packed buffers."""

    sd: dict[str, torch.Tensor]
    dest: dict[str, torch.Tensor]
    flat: torch.Tensor
    flat_dest: torch.Tensor

    @classmethod
    def build(cls, shape: str, total: int, seed: int) -> _Data:
        sd = build_shape(shape, total, seed)
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # preallocated, touched
        flat = _pack(sd)
        return cls(sd, dest, flat, torch.zeros_like(flat))

    def clear_dest(self, method: str) -> None:
        if method in RAW_METHODS:
            self.flat_dest.zero_()
        else:
            for t in self.dest.values():
                t.zero_()  # a load that leaves old bytes in place must not pass

    def check(self, method: str) -> None:
        if method in RAW_METHODS:
            if not torch.equal(self.flat, self.flat_dest):
                raise RuntimeError(f"{method} read back different bytes")
            return
        for name, t in self.sd.items():
            if not torch.equal(self.dest[name], t):
                raise RuntimeError(f"{method} loaded wrong values for {name}")


def _slug(method: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", method).strip("-").lower()


def _one(
    methods: _Methods,
    method: str,
    bucket: str,
    tag: str,
    prefix: str,
    data: _Data,
    samples: dict[str, dict[str, list[_Sample]]] | None,
) -> None:
    """Save, load, check and delete one method's checkpoint (timed into ``samples``)."""
    t = methods.target
    try:
        s = _timed(t, lambda: methods.save(method, bucket, tag, prefix, data.sd, data.flat))
        data.clear_dest(method)
        lo = _timed(t, lambda: methods.load(method, bucket, tag, prefix, data.dest, data.flat_dest))
        data.check(method)
    finally:
        _delete_prefix(methods.client, bucket, prefix + "/")
    if samples is not None:
        samples.setdefault("save", {}).setdefault(method, []).append(s)
        samples.setdefault("load", {}).setdefault(method, []).append(lo)


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 400 else text[:399] + "…"


def _summary(samples: list[_Sample], nbytes: int) -> dict[str, Any]:
    secs = [s.seconds for s in samples]
    med, best = statistics.median(secs), min(secs)
    server = [s.server_cpu_s for s in samples if s.server_cpu_s is not None]
    return {
        "seconds": [round(x, 4) for x in secs],
        "median_s": round(med, 4),
        "min_s": round(best, 4),
        "mbps_median": round(nbytes / 1e6 / med, 1),
        "mbps_best": round(nbytes / 1e6 / best, 1),
        "client_cpu_s_median": round(statistics.median(s.client_cpu_s for s in samples), 3),
        "server_cpu_s_median": round(statistics.median(server), 3) if server else None,
    }


def _ratios(section: dict[str, Any]) -> dict[str, Any]:
    """quicksave's speed (1/median seconds) relative to raw (the faster raw method)
    and to each DCP method; None where one of the two was not measured."""

    def med(m: str) -> float | None:
        row = section.get(m) or {}
        return row.get("median_s")

    raws = [(med(m), m) for m in RAW_METHODS if med(m)]
    raw_s, raw_name = min(raws) if raws else (None, None)
    q = med(QUICKSAVE)
    out: dict[str, Any] = {"raw_method": raw_name}
    msc = med(DCP_MSC)
    # the most any method could get on this server: raw's speed over dcp+MSC's
    out["raw_vs_dcp_msc"] = round(msc / raw_s, 3) if msc and raw_s else None
    for name, ref in (
        ("vs_raw", raw_s),
        ("vs_dcp_msc", med(DCP_MSC)),
        ("vs_dcp_s3tc", med(DCP_S3TC)),
    ):
        out[name] = round(ref / q, 3) if q and ref else None
    return out


def _measure_shape(
    shape: str,
    config: StorageBenchConfig,
    methods: _Methods,
    buckets: _Buckets,
    run_id: str,
    log: Any,
) -> dict[str, Any]:
    """Every method ``config.repeat`` times on ``shape`` (one bucket per repeat)."""
    total = config.size_mib * MiB
    data = _Data.build(shape, total, config.seed)
    nbytes = nbytes_of(data.sd)
    todo = [m for m in config.methods if m not in methods.unavailable]
    samples: dict[str, dict[str, list[_Sample]]] = {}
    failed: dict[str, str] = {}
    for r in range(config.repeat):
        tag = f"{shape}-r{r}"
        bucket = buckets.make(tag)
        try:
            shift = r % len(todo) if todo else 0
            for method in todo[shift:] + todo[:shift]:
                if method in failed or method in methods.unavailable:
                    continue
                prefix = f"{run_id}/{shape}/r{r}/{_slug(method)}"
                try:
                    _one(methods, method, bucket, tag, prefix, data, samples)
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    failed[method] = _why(e)
                    _say(log, f"  {shape} {method}: FAILED {failed[method]}")
                    continue
                s, lo = samples["save"][method][-1], samples["load"][method][-1]
                _say(
                    log,
                    f"  {shape} r{r} {method}: save {s.seconds:.2f} s "
                    f"({nbytes / 1e6 / s.seconds:.0f} MB/s), load {lo.seconds:.2f} s "
                    f"({nbytes / 1e6 / lo.seconds:.0f} MB/s)",
                )
        finally:
            buckets.drop(tag)
    out: dict[str, Any] = {
        "tensors": len(data.sd),
        "bytes": nbytes,
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in data.sd.values()),
    }
    for kind in ("save", "load"):
        section: dict[str, Any] = {}
        for m in config.methods:
            if m in methods.unavailable:
                section[m] = {"unavailable": methods.unavailable[m], "note": NOTES[m]}
            elif m in failed:
                section[m] = {"failed": failed[m], "note": NOTES[m]}
            else:
                section[m] = {**_summary(samples[kind][m], nbytes), "note": NOTES[m]}
        section_ratios = _ratios(section)
        out[kind] = section
        out[f"{kind}_ratios"] = section_ratios
    del data
    gc.collect()
    return out


def _warm_up(
    config: StorageBenchConfig, methods: _Methods, buckets: _Buckets, run_id: str, log: Any
) -> None:
    """Every method once on a tiny state dict (imports, clients, pools); a method that
    fails here is reported as not available, with the reason."""
    tag = "warmup"
    bucket = buckets.make(tag)
    try:
        for shape in config.shapes:
            data = _Data.build(shape, min(WARMUP_BYTES, config.size_mib * MiB), config.seed + 1)
            for method in config.methods:
                if method in methods.unavailable:
                    continue
                prefix = f"{run_id}/warmup/{shape}/{_slug(method)}"
                try:
                    _one(methods, method, bucket, tag, prefix, data, None)
                except Exception as e:  # noqa: BLE001
                    if method in (RAW_THREADS, QUICKSAVE):
                        raise  # nothing to compare with / the subject itself: a failure
                    methods.unavailable[method] = f"cannot run against this server: {_why(e)}"
                    _say(log, f"  {method}: not available: {methods.unavailable[method]}")
    finally:
        buckets.drop(tag)


# ------------------------------------------------------------------------ training loop
def train_child(argv: list[str]) -> int:
    """One training run (``argv = [spec_path]``): writes its result JSON, 0 on success."""
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        result = _train_run(spec)
    except Exception as e:  # noqa: BLE001
        result = {"failed": _why(e), "traceback": traceback.format_exc()[-4000:]}
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0 if "failed" not in result else 1


def _train_run(spec: dict[str, Any]) -> dict[str, Any]:
    from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
    from quicksave.storage import S3Options, StorageOptions
    from quicksave_tools.bench.training_loop import _train

    if spec.get("trainer_cpus"):  # before torch starts its threads: they inherit it
        os.sched_setaffinity(0, spec["trainer_cpus"])
    torch.set_num_threads(spec["threads"])
    model, optim, train_step = _train(spec)
    for _ in range(spec["warmup"]):
        train_step()  # allocates AdamW's state
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    result: dict[str, Any] = {
        "target": spec["target"],
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": sum(
            t.numel() * t.element_size()
            for t in [*model.state_dict().values()]
            + [v for st in optim.state.values() for v in st.values() if torch.is_tensor(v)]
        ),
    }
    calibration = result["calibration_step_s"] = []
    for _ in range(spec["calibration_steps"]):
        t0 = time.perf_counter()
        train_step()
        calibration.append(time.perf_counter() - t0)
    manager = None
    if spec["target"] != "none":
        t0 = time.perf_counter()
        storage = StorageOptions()
        if spec["target"] == "s3":  # credentials: the AWS chain (this process's env)
            storage = StorageOptions(
                s3=S3Options(endpoint_url=spec["endpoint_url"], region=spec["region"])
            )
        cfg = CheckpointConfig(
            folder=spec["folder"],
            interval=spec["interval"],
            async_mode="process",
            storage=storage,
            worker_cpus=tuple(spec["worker_cpus"]) if spec.get("worker_cpus") else None,
        )
        manager = CheckpointManager(cfg, states)
        result["setup_s"] = time.perf_counter() - t0
    step_s, save_s, saved = [], [], []
    cpu0 = time.process_time()
    begin = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        t0 = time.perf_counter()
        train_step()
        t1 = time.perf_counter()
        if manager is not None and manager.save(step):
            saved.append(step)
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        save_s.append(t2 - t1)
    t_drain = time.perf_counter()
    records: list[dict[str, Any]] = []
    if manager is not None:
        manager.close()  # waits for the checkpoints in flight: part of the loop's time
    end = time.perf_counter()
    loop_cpu = time.process_time() - cpu0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker, reaped by close()
    if manager is not None:
        keys = ("step", "bytes", "blocking_s", "staging_s", "durable_s", "write_s", "status")
        records = [
            {k: getattr(r, k) for k in keys if getattr(r, k, None) is not None}
            for r in manager.metrics
        ]
        bad = [r for r in records if r.get("status") != "committed"]
        if bad or len(records) != len(saved):
            raise RuntimeError(f"not every checkpoint committed: {records}")
    result.update(
        loop_s=end - begin,
        steps_loop_s=t_drain - begin,  # the steps alone: the final wait left out
        drain_s=end - t_drain,
        step_s=step_s,
        save_s=save_s,
        saved_steps=saved,
        records=records,
        trainer_cpu_s=loop_cpu,
        worker_cpu_s=children.ru_utime + children.ru_stime,
    )
    return result


def _placement(config: StorageBenchConfig, log: Any) -> tuple[list[int] | None, list[int] | None]:
    """``train_pin``: (the trainer's CPUs, the worker's and server's); (None, None) when
    not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not config.train_pin:
        return None, None
    if len(cpus) < 2:
        _say(log, "  training: --train-pin needs two CPUs; running unpinned")
        return None, None
    _say(log, f"  training: trainer on CPUs {cpus[:1]}, worker and server on {cpus[1:]}")
    return cpus[:1], cpus[1:]


@contextlib.contextmanager
def _server_on(target: Target, cpus: list[int] | None) -> Iterator[None]:
    """Every thread of the server this bench started runs on ``cpus`` inside the block
    (as it was, after); nothing to do for another endpoint or ``None``."""
    running = getattr(target.server, "_running", None)
    proc = getattr(running, "proc", None)
    if not cpus or proc is None:
        yield
        return

    def place(where: Any) -> None:
        for task in os.listdir(f"/proc/{proc.pid}/task"):  # Go's threads: each one
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task), where)

    before = os.sched_getaffinity(proc.pid)
    place(cpus)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            place(before)


def train_schedule(config: StorageBenchConfig) -> list[str]:
    """``none`` first, then per repeat local and S3 (order alternating), each pair
    followed by ``none``."""
    runs = ["none"]
    for r in range(config.train_repeat):
        runs += (["local", "s3"] if r % 2 == 0 else ["s3", "local"]) + ["none"]
    return runs


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _run_training(
    config: StorageBenchConfig, target: Target, buckets: _Buckets, run_id: str, log: Any
) -> dict[str, Any]:
    parent = os.path.abspath(config.directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    base = tempfile.mkdtemp(prefix="quicksave-storage-bench-", dir=parent)
    tag = "train"
    bucket = buckets.make(tag)
    trainer_cpus, worker_cpus = _placement(config, log)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        with _server_on(target, worker_cpus):
            for i, kind in enumerate(train_schedule(config)):
                prefix = f"{run_id}/train/{i:02d}"
                folder = {
                    "none": os.path.join(base, f"{i:02d}-none"),
                    "local": os.path.join(base, f"{i:02d}-local"),
                    "s3": f"s3://{bucket}/{prefix}",
                }[kind]
                spec = {
                    "target": kind,
                    "folder": folder,
                    "endpoint_url": target.endpoint_url,
                    "region": target.region,
                    "hidden": config.train_hidden,
                    "layers": config.train_layers,
                    "batch": config.train_batch,
                    "seed": config.seed,
                    "steps": config.train_steps,
                    "interval": config.train_interval,
                    "threads": config.train_threads,
                    "trainer_cpus": trainer_cpus,
                    "worker_cpus": worker_cpus,
                    "warmup": config.train_warmup,
                    "calibration_steps": config.train_calibration_steps,
                    "result": os.path.join(base, f"{i:02d}-result.json"),
                }
                t0 = time.perf_counter()
                s0 = target.server_cpu_s()
                try:
                    result = run_child(
                        _CHILD,
                        spec,
                        os.path.join(base, f"{i:02d}-spec.json"),
                        config.train_timeout_s,
                    )
                    s1 = target.server_cpu_s()
                finally:
                    if kind == "s3":
                        with contextlib.suppress(Exception):
                            _delete_prefix(buckets.client, bucket, prefix + "/")
                    else:
                        shutil.rmtree(folder, ignore_errors=True)
                result["wall_s"] = time.perf_counter() - t0
                if s0 is not None and s1 is not None:
                    result["server_cpu_s"] = s1 - s0
                runs.setdefault(kind, []).append(result)
                state = result.get("failed") or f"loop {result['loop_s']:.2f} s"
                _say(log, f"  training [{i + 1}] {kind}: {state}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        buckets.drop(tag)
    return _training_report(config, runs)


def _training_report(config: StorageBenchConfig, runs: dict[str, list[dict]]) -> dict[str, Any]:
    none_ok = [r for r in runs.get("none", []) if "failed" not in r]
    baseline = _median([r["loop_s"] for r in none_ok])
    baseline_steps = _median([r.get("steps_loop_s", r["loop_s"]) for r in none_ok])
    out: dict[str, Any] = {
        "placement": "pinned" if config.train_pin else "shared",
        "model": {
            "hidden": config.train_hidden,
            "layers": config.train_layers,
            "batch": config.train_batch,
            "params": none_ok[0]["params"] if none_ok else None,
            "state_bytes": none_ok[0]["bytes"] if none_ok else None,
        },
        "steps": config.train_steps,
        "interval": config.train_interval,
        "order": train_schedule(config),
        "baseline": {
            "loop_s": [round(r["loop_s"], 4) for r in none_ok],
            "loop_median_s": baseline,
            "step_median_s": _median([s for r in none_ok for s in r["step_s"]]),
        },
        "targets": {},
    }
    if not none_ok:
        bad = runs.get("none", [{}])
        out["baseline"]["failed"] = bad[0].get("failed", "not run") if bad else "not run"
    for kind in ("local", "s3"):
        rs = runs.get(kind, [])
        ok = [r for r in rs if "failed" not in r]
        if not ok:
            out["targets"][kind] = {"failed": rs[0]["failed"] if rs else "not run"}
            continue
        n = len(ok[0]["saved_steps"])
        loop = _median([r["loop_s"] for r in ok])
        steps_loop = _median([r["steps_loop_s"] for r in ok])
        assert steps_loop is not None
        assert loop is not None
        paired = [
            (r["loop_s"] - len(r["step_s"]) * statistics.median(r["calibration_step_s"])) / n
            for r in ok
            if n and r["calibration_step_s"]
        ]
        recs = [rec for r in ok for rec in r["records"]]
        out["targets"][kind] = {
            "loop_s": [round(r["loop_s"], 4) for r in ok],
            "loop_median_s": loop,
            "checkpoints": n,
            "overhead_per_checkpoint_s": (loop - baseline) / n if n and baseline else None,
            # the same without the final wait for the last checkpoint (a one-off at the
            # end of a job, which dominates a short loop's per-checkpoint share)
            "in_loop_overhead_per_checkpoint_s": (
                (steps_loop - baseline_steps) / n if n and baseline_steps else None
            ),
            "paired_overhead_per_checkpoint_s": _median(paired),
            "blocking_median_s": _median([x["blocking_s"] for x in recs if "blocking_s" in x]),
            "durable_median_s": _median([x["durable_s"] for x in recs if "durable_s" in x]),
            "drain_median_s": _median([r["drain_s"] for r in ok]),
            "setup_median_s": _median([r.get("setup_s", 0.0) for r in ok]),
            "server_cpu_s": [round(r["server_cpu_s"], 3) for r in ok if "server_cpu_s" in r],
            "worker_cpu_s": [round(r["worker_cpu_s"], 3) for r in ok if "worker_cpu_s" in r],
            "trainer_cpu_s": [round(r["trainer_cpu_s"], 3) for r in ok if "trainer_cpu_s" in r],
        }
    local, s3 = out["targets"].get("local", {}), out["targets"].get("s3", {})
    a, b = s3.get("overhead_per_checkpoint_s"), local.get("overhead_per_checkpoint_s")
    out["s3_minus_local_overhead_s"] = round(a - b, 4) if a is not None and b is not None else None
    for key in (
        "overhead_per_checkpoint_s",
        "paired_overhead_per_checkpoint_s",
        "in_loop_overhead_per_checkpoint_s",
    ):
        a, b = s3.get(key), local.get(key)
        out[f"s3_vs_local_{key.removesuffix('_per_checkpoint_s')}"] = (
            round(a / b, 3) if a is not None and b and b > 0 else None
        )
    return out


# ------------------------------------------------------------------------ the run
def _check_config(config: StorageBenchConfig) -> None:
    if config.size_mib < 1 or config.repeat < 1:
        raise ValueError("size_mib and repeat must be at least 1")
    if config.concurrency < 1 or config.part_mib < 5:
        raise ValueError("concurrency must be at least 1 and part_mib at least 5 (S3's minimum)")
    for s in config.shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for m in config.methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if RAW_THREADS not in config.methods or QUICKSAVE not in config.methods:
        raise ValueError(f"methods must include {RAW_THREADS!r} and {QUICKSAVE!r}")
    if config.training:
        for name in ("train_steps", "train_interval", "train_hidden", "train_layers"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if config.train_interval > config.train_steps:
            raise ValueError("train_interval must not exceed train_steps")
        if config.train_repeat < 1:
            raise ValueError("train_repeat must be at least 1")


def run_storage_benchmark(
    config: StorageBenchConfig, target: Target | None = None, log: Any = None
) -> dict[str, Any]:
    """Run the whole benchmark and return its report (JSON-serializable).

    Args:
        config: sizes, shapes, methods, repeats and the training loop.
        target: where to write (tests pass their server's); None: ``config.endpoint``,
            or a SeaweedFS started here and stopped at the end, however the run ends.
        log: a text stream for progress lines (None: quiet).

    Returns:
        ``config``, ``machine``, ``server``, ``shapes`` (per shape: ``save`` and
        ``load`` per method — seconds, median, best, MB/s, CPU seconds, or
        ``unavailable``/``failed`` with the reason — and ``save_ratios`` /
        ``load_ratios`` of quicksave against raw and the DCP methods) and ``training``.

    Raises:
        ValueError: bad arguments.
        RuntimeError, CheckpointError: raw or quicksave could not run at all.
    """
    _check_config(config)
    if target is None:
        with open_target(config, log) as own:
            return run_storage_benchmark(config, own, log)
    load_before = os.getloadavg()
    run_id = uuid.uuid4().hex[:10]
    client = target.client(config.concurrency)
    buckets = _Buckets(client, run_id, config.bucket)
    msc_dir = tempfile.mkdtemp(prefix="quicksave-msc-")
    msc_prefix = f"qsbench{run_id}"
    tags = ["warmup"] + [f"{s}-r{r}" for s in config.shapes for r in range(config.repeat)]
    msc_config = write_msc_config(msc_dir, target, {msc_prefix + t: buckets.name(t) for t in tags})
    env = {**target.env(), "MSC_CONFIG": msc_config}
    methods = _Methods(target, client, config, msc_prefix)
    report: dict[str, Any] = {"shapes": {}}
    try:
        with _sigterm_as_interrupt(), _patched_env(env), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
            if config.throughput:
                _say(log, "warm-up (every method once, tiny state dict)")
                _warm_up(config, methods, buckets, run_id, log)
            for shape in config.shapes if config.throughput else ():
                _say(log, f"shape {shape}: {config.size_mib} MiB, {config.repeat} repeat(s)")
                report["shapes"][shape] = _measure_shape(
                    shape, config, methods, buckets, run_id, log
                )
            if config.training:
                _say(log, "training loop: none / local / s3, each in a fresh process")
                report["training"] = _run_training(config, target, buckets, run_id, log)
            else:
                report["training"] = {"skipped": "--no-training"}
    finally:
        methods.close()
        buckets.close()
        with contextlib.suppress(Exception):
            client.close()
        shutil.rmtree(msc_dir, ignore_errors=True)
    report["config"] = {**asdict(config), "shapes": list(config.shapes)}
    report["config"]["methods"] = list(config.methods)
    report["server"] = {"kind": target.kind, "endpoint": target.endpoint_url}
    if target.server is not None:
        report["server"]["weed"] = _weed_version(target.server)
    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    report["acceptance"] = _acceptance(report)
    return {
        k: report[k] for k in ("config", "machine", "server", "shapes", "training", "acceptance")
    }


def _weed_version(server: Any) -> str | None:
    try:
        from quicksave_tools.testing.seaweed import find_weed

        out = subprocess.run(
            [str(find_weed()), "version"], capture_output=True, text=True, timeout=10
        ).stdout
    except Exception:  # noqa: BLE001
        return None
    m = re.search(r"version\s+(\S+)\s+(\d\S*)", out)  # "version 8000GB 4.48 pypi ..."
    if m:
        return f"{m.group(2)} ({m.group(1)} build)"
    return out.strip().splitlines()[0] if out.strip() else None


TARGETS = (  # (what, section, ratio key, at least)
    ("quicksave save ≥ 0.8× raw", "save_ratios", "vs_raw", 0.8),
    ("quicksave save ≥ 3× dcp+MSC", "save_ratios", "vs_dcp_msc", 3.0),
    ("quicksave load ≥ 0.8× raw", "load_ratios", "vs_raw", 0.8),
    ("quicksave load ≥ 4× dcp+MSC", "load_ratios", "vs_dcp_msc", 4.0),
)


def _acceptance(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, per shape, with the measured ratio and whether it is met."""
    out = []
    for what, section, key, least in TARGETS:
        for shape, s in report["shapes"].items():
            value = s[section].get(key)
            out.append(
                {
                    "target": what,
                    "shape": shape,
                    "value": value,
                    "met": value is not None and value >= least,
                }
            )
    t = report.get("training") or {}
    if "targets" in t:
        for key, what in (
            ("s3_vs_local_overhead", "training overhead per checkpoint: S3 ≤ 1.3× local"),
            ("s3_vs_local_in_loop_overhead", "the same, final wait left out"),
        ):
            value = t.get(key)
            out.append(
                {
                    "target": what,
                    "shape": f"training ({t.get('placement', 'shared')})",
                    "value": value,
                    # None: not measurable (the local overhead is within the noise, ≤ 0)
                    "met": None if value is None else value <= 1.3,
                }
            )
    return out


# ------------------------------------------------------------------------ the report
def _f(x: float | None, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def format_storage_report(report: dict[str, Any]) -> str:
    """Markdown: one table per shape (save and load side by side), the ratios, the
    training-loop table and the acceptance targets."""
    c, m, srv = report["config"], report["machine"], report["server"]
    weed = f" {srv['weed']}" if srv.get("weed") else ""
    lines = [
        f"{srv['kind']}{weed} at {srv['endpoint']}; {c['repeat']} repeat(s) per method, "
        f"medians; raw: {c['part_mib']} MiB parts, {c['concurrency']} in flight; "
        f"{m['cpus']} CPUs, torch {m['torch']}, load average {m['loadavg_before'][0]} → "
        f"{m['loadavg_after'][0]}",
    ]
    for shape, s in report["shapes"].items():
        lines += [
            "",
            f"**{shape}**: {s['bytes'] / MiB:.0f} MiB in {s['tensors']} tensors "
            f"(largest {s['largest_tensor_bytes'] / MiB:.0f} MiB)",
            "",
            "| method | save s | save MB/s | load s | load MB/s | client CPU s (save/load) "
            "| server CPU s (save/load) | how |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name in s["save"]:
            sv, ld = s["save"][name], s["load"][name]
            if "median_s" not in sv or "median_s" not in ld:
                why = sv.get("unavailable") or sv.get("failed") or ld.get("failed")
                label = "not available" if "unavailable" in sv else "failed"
                lines.append(f"| {name} | – | – | – | – | – | – | {label}: {why} |")
                continue
            lines.append(
                f"| {name} | {sv['median_s']:.2f} | {sv['mbps_median']:.0f} | "
                f"{ld['median_s']:.2f} | {ld['mbps_median']:.0f} | "
                f"{sv['client_cpu_s_median']:.2f} / {ld['client_cpu_s_median']:.2f} | "
                f"{_f(sv['server_cpu_s_median'])} / {_f(ld['server_cpu_s_median'])} | "
                f"{sv['note']} |"
            )
        sr, lr = s["save_ratios"], s["load_ratios"]
        lines += [
            "",
            f"quicksave save: {_f(sr['vs_raw'])}× raw ({sr['raw_method']}), "
            f"{_f(sr['vs_dcp_msc'])}× dcp+MSC, {_f(sr['vs_dcp_s3tc'])}× dcp+s3torchconnector; "
            f"load: {_f(lr['vs_raw'])}× raw ({lr['raw_method']}), {_f(lr['vs_dcp_msc'])}× "
            f"dcp+MSC, {_f(lr['vs_dcp_s3tc'])}× dcp+s3torchconnector",
            "",
            f"ceiling (raw vs dcp+MSC): save {_f(sr['raw_vs_dcp_msc'])}×, load "
            f"{_f(lr['raw_vs_dcp_msc'])}×",
        ]
    t = report.get("training") or {}
    if "targets" in t:
        md = t["model"]
        gb = (md["state_bytes"] or 0) / 1e9
        lines += [
            "",
            f"**training loop**: MLP {md['layers']}×{md['hidden']} + AdamW ({gb:.2f} GB of "
            f"state), {t['steps']} steps, a checkpoint every {t['interval']} steps, "
            "CheckpointManager(async_mode='process', default staging); median step "
            f"{_f(t['baseline']['step_median_s'], '.3f')} s without checkpoints; "
            + (
                "pinned: trainer on one CPU, worker and server on the others"
                if t.get("placement") == "pinned"
                else "shared: trainer, worker and server on the same CPUs"
            ),
            "",
            "| target | loop s (median) | checkpoints | overhead s / checkpoint | without "
            "final wait | paired s / checkpoint | blocking s | save→durable s | server CPU s "
            "| worker CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| no checkpoints | {_f(t['baseline']['loop_median_s'])} | 0 | – | – | – | – | – "
            "| – | – |",
        ]
        for kind, label in (("local", "local directory"), ("s3", "s3://")):
            r = t["targets"].get(kind, {})
            if "failed" in r:
                lines.append(f"| {label} | failed: {r['failed']} | | | | | | | | |")
                continue
            cpu, wcpu = r["server_cpu_s"], r["worker_cpu_s"]
            lines.append(
                f"| {label} | {r['loop_median_s']:.2f} | {r['checkpoints']} | "
                f"{_f(r['overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['in_loop_overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['paired_overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['blocking_median_s'], '.3f')} | {_f(r['durable_median_s'])} | "
                f"{_f(statistics.median(cpu) if cpu else None, '.1f')} | "
                f"{_f(statistics.median(wcpu) if wcpu else None, '.1f')} |"
            )
        lines += [
            "",
            f"overhead per checkpoint, S3 / local: {_f(t['s3_vs_local_overhead'])}× "
            f"(without the final wait: {_f(t['s3_vs_local_in_loop_overhead'])}×; paired: "
            f"{_f(t['s3_vs_local_paired_overhead'])}×; – where the local overhead "
            f"is ≤ 0, i.e. within the noise); S3 − local: "
            f"{_f(t['s3_minus_local_overhead_s'], '.3f')} s per checkpoint",
        ]
    acc = report.get("acceptance") or []
    if acc:
        lines += ["", "| target | shape | measured | met |", "|---|---|---:|---|"]
        for a in acc:
            lines.append(
                f"| {a['target']} | {a['shape']} | {_f(a['value'])}× | "
                f"{'n/a' if a['met'] is None else 'yes' if a['met'] else 'NO'} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    d = StorageBenchConfig()
    p = argparse.ArgumentParser(
        prog="quicksave bench --storage",
        description="Save/load throughput to S3 of quicksave vs raw boto3 transfers, "
        "dcp+MSC and dcp+s3torchconnector, and the training-loop overhead of checkpointing "
        "to S3 vs a local directory, side by side in one run. Starts its own SeaweedFS "
        "unless --endpoint is given.",
    )
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="S3 endpoint to use (credentials, region: AWS environment chain); default: "
        "start SeaweedFS on loopback",
    )
    p.add_argument("--bucket", help="with --endpoint: an existing bucket to use")
    p.add_argument("--size-mib", type=int, default=d.size_mib, help="bytes per shape (1024)")
    p.add_argument(
        "--repeat",
        "--repeats",
        dest="repeat",
        type=int,
        default=d.repeat,
        help=f"timed runs of every method per shape ({d.repeat})",
    )
    p.add_argument(
        "--shapes", default=",".join(d.shapes), help="comma-separated: " + ",".join(SHAPES)
    )
    p.add_argument("--methods", default=",".join(d.methods), help="comma-separated methods")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="raw: parts in flight")
    p.add_argument("--part-mib", type=int, default=d.part_mib, help="raw: part size in MiB")
    p.add_argument("--no-training", action="store_true", help="skip the training-loop part")
    p.add_argument(
        "--no-throughput", action="store_true", help="skip the save/load throughput part"
    )
    p.add_argument("--train-steps", type=int, default=d.train_steps)
    p.add_argument("--train-interval", type=int, default=d.train_interval)
    p.add_argument("--train-hidden", type=int, default=d.train_hidden)
    p.add_argument("--train-layers", type=int, default=d.train_layers)
    p.add_argument("--train-batch", type=int, default=d.train_batch)
    p.add_argument("--train-repeat", type=int, default=d.train_repeat)
    p.add_argument("--train-threads", type=int, default=d.train_threads)
    p.add_argument(
        "--train-pin",
        action="store_true",
        help="trainer on the first CPU; checkpoint worker and server on the others",
    )
    p.add_argument("--dir", default=None, help="folder of the local training run (default: .)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--server-nice",
        type=int,
        default=d.server_nice,
        help="CPU niceness of the SeaweedFS the bench starts (19: a stand-in for a remote store)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --storage``.

    Returns:
        0 on success, 2 on bad arguments, 1 if raw or quicksave could not run or a
        method loaded wrong values, 130 on Ctrl-C (the server is stopped in every case).

    Example::

        quicksave bench --storage --size-mib 1024 --repeat 3 --json storage.json
    """
    args = build_parser().parse_args(argv)
    config = StorageBenchConfig(
        size_mib=args.size_mib,
        repeat=args.repeat,
        shapes=tuple(s.strip() for s in args.shapes.split(",") if s.strip()),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        endpoint=args.endpoint,
        bucket=args.bucket,
        concurrency=args.concurrency,
        part_mib=args.part_mib,
        training=not args.no_training,
        throughput=not args.no_throughput,
        train_steps=args.train_steps,
        train_interval=args.train_interval,
        train_hidden=args.train_hidden,
        train_layers=args.train_layers,
        train_batch=args.train_batch,
        train_repeat=args.train_repeat,
        train_threads=args.train_threads,
        directory=args.dir,
        seed=args.seed,
        server_nice=args.server_nice,
        train_pin=args.train_pin,
    )
    if config.bucket and not config.endpoint:
        print("quicksave bench --storage: --bucket needs --endpoint", file=sys.stderr)
        return 2
    try:
        report = run_storage_benchmark(config, log=sys.stderr)
    except ValueError as e:
        print(f"quicksave bench --storage: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quicksave bench --storage: interrupted (server stopped)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - raw or quicksave failed: say so, no traceback
        print(f"quicksave bench --storage: {_why(e)}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_storage_report(report))
    return 0


__all__ = [
    "METHODS",
    "SHAPES",
    "StorageBenchConfig",
    "Target",
    "build_shape",
    "format_storage_report",
    "main",
    "open_target",
    "run_storage_benchmark",
]
