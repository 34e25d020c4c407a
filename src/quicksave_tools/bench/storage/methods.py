"""Save and load of each method of ``quicksave bench --storage`` on one bucket
(:class:`Methods`): the raw baselines (:mod:`.raw_s3`), ``dcp.save``/``dcp.load``
through the Multi-Storage Client (its config written by :func:`write_msc_config`) and
through s3torchconnector, and quicksave itself, each of its round trips in a fresh
process (:meth:`Methods.in_child`, with this installation's package or a baseline's);
which ones cannot run here, and why."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch

from quicksave.checksum import tensor_view
from quicksave_tools.bench.baseline import baseline_env, is_baseline, plain
from quicksave_tools.bench.storage.config import (
    DCP_MSC,
    DCP_S3TC,
    IN_CHILD,
    RAW_BOTO3,
    RAW_THREADS,
    WARMUP_BYTES,
    MiB,
    StorageBenchConfig,
)
from quicksave_tools.bench.storage.quicksave_child import round_trip_in_child
from quicksave_tools.bench.storage.raw_s3 import RawS3
from quicksave_tools.bench.storage.target import Target


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


class Methods:
    """Save and load of every method on one bucket; ``unavailable[m]`` says why a
    method cannot run here."""

    def __init__(self, target: Target, client: Any, config: StorageBenchConfig, msc: str):
        self.target, self.client, self.config = target, client, config
        self.raw = RawS3(client, config.part_mib * MiB, config.concurrency)
        self.msc_profiles = msc  # profile name prefix
        self.unavailable: dict[str, str] = {}
        self.workdir = tempfile.mkdtemp(prefix="quicksave-storage-bench-")  # child specs
        self.children = 0
        self.packages: dict[str, str] = {}  # method run in a child -> its quicksave's folder
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
        shutil.rmtree(self.workdir, ignore_errors=True)

    def in_child(
        self, method: str, bucket: str, prefix: str, shape: str, total: int, seed: int
    ) -> dict[str, Any]:
        """Save and load of ``method`` (one of :data:`IN_CHILD`, or its ``@baseline``)
        to ``s3://bucket/prefix`` in a fresh process (:mod:`.quicksave_child`), after an
        untimed round trip of a tiny state dict to ``prefix-warmup``: ``{"save": ...,
        "load": ...}`` (seconds, client and server CPU seconds). The caller deletes
        both prefixes."""
        if plain(method) not in IN_CHILD:
            raise ValueError(f"{method!r} does not run in a child process")
        env = None
        if is_baseline(method):
            assert self.config.baseline is not None
            env = baseline_env(self.config.baseline, self.workdir)
        spec = {
            "shape": shape,
            "bytes": total,
            "seed": seed,
            "url": f"s3://{bucket}/{prefix}",
            "warmup_url": f"s3://{bucket}/{prefix}-warmup",
            "warmup_bytes": WARMUP_BYTES,
            "endpoint_url": self.target.endpoint_url,
            "region": self.target.region,
            "server_pid": self.target.server_pid(),
        }
        self.children += 1
        got = round_trip_in_child(
            spec, self.workdir, self.children, self.config.child_timeout_s, env
        )
        self.packages[method] = got["quicksave"]
        return got

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
        else:
            raise ValueError(f"unknown method {method!r}")
