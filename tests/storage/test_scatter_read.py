"""Scatter reads: one request for a run of neighbouring small chunks, its body landing
straight in each destination (real S3 server), and the same call on local files."""

from __future__ import annotations

import os

import boto3  # noqa: F401  (pinned in the dev extra: missing, collection fails)
import pytest
import torch

import quicksave
from quicksave.errors import CorruptCheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.storage import StorageOptions
from quicksave.storage.local import LocalBackend
from quicksave.storage.location import parse_location


def _options(s3_server) -> StorageOptions:
    return s3_server.storage_options()


def _views(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.parametrize("sizes", [[1], [10, 0, 3000, 1], [4096] * 9, [0, 0, 5]])
def test_s3_scatter_read_fills_views_in_turn(s3_server, s3_bucket, sizes):
    data = os.urandom(50_000)
    backend = parse_location(f"s3://{s3_bucket}/x", options=_options(s3_server)).open()
    try:
        backend.put("x/blob", memoryview(data))
        bufs, views = _views(sizes)
        backend.read_scatter("x/blob", 123, views)
        assert b"".join(bufs) == data[123 : 123 + sum(sizes)]
    finally:
        backend.close()


def test_s3_scatter_read_past_the_end_is_corrupt_naming_the_url(s3_server, s3_bucket):
    backend = parse_location(f"s3://{s3_bucket}/x", options=_options(s3_server)).open()
    try:
        backend.put("x/blob", memoryview(b"0123456789"))
        _, views = _views([4, 4, 4])
        with pytest.raises(CorruptCheckpointError, match=f"s3://{s3_bucket}/x/blob"):
            backend.read_scatter("x/blob", 0, views)
    finally:
        backend.close()


def test_local_scatter_read(tmp_path):
    data = os.urandom(10_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    backend = LocalBackend()
    bufs, views = _views([100, 0, 7000, 1])
    backend.read_scatter(str(path), 50, views)
    assert b"".join(bufs) == data[50:7151]
    _, views = _views([9000, 2000])
    with pytest.raises(CorruptCheckpointError, match="blob"):
        backend.read_scatter(str(path), 0, views)


def _small_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for i in range(40):  # neighbours in one data file: read as runs
        n = 1 + (i * 997) % 5000
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        t = torch.randn(n, generator=g).to(dtype)
        sd[f"layer.{i}.w"] = t if i % 5 else t.reshape(1, n)
    sd["scalar"] = torch.tensor(3.5)
    return sd


def test_load_of_many_small_tensors_from_s3_is_bit_exact(s3_server, s3_bucket):
    opts = _options(s3_server)
    sd = _small_tensors()
    url = f"s3://{s3_bucket}/run/step-1"
    quicksave.save(sd, url, storage=opts)
    # matching destinations: read straight into them
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    quicksave.load(dest, url, storage=opts)
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    # destinations that need a conversion or are views: read into a buffer, then copied
    base = {k: torch.zeros(v.numel() * 2, dtype=v.dtype) for k, v in sd.items()}
    views = {k: base[k][::2].view(v.shape) for k, v in sd.items()}
    quicksave.load(views, url, storage=opts)
    for k, v in sd.items():
        assert torch.equal(views[k], v), k
        assert not base[k][1::2].any(), k  # nothing written between the strided elements


def test_a_flipped_byte_inside_a_run_names_its_tensor(s3_server, s3_bucket):
    opts = _options(s3_server)
    sd = _small_tensors()
    url = f"s3://{s3_bucket}/run/step-2"
    quicksave.save(sd, url, storage=opts)
    client = s3_server.client()
    try:
        raw = client.get_object(Bucket=s3_bucket, Key=f"run/step-2/{MANIFEST_NAME}")["Body"].read()
        m = from_json_bytes(raw)
        victim = "layer.17.w"
        entry = m.tensors[victim].chunks[0]
        key = f"run/step-2/{entry.file}"
        body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        body[entry.offset + entry.length // 2] ^= 0xFF
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    finally:
        client.close()
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CorruptCheckpointError, match=victim):
        quicksave.load(dest, url, storage=opts)


def test_neighbouring_small_chunks_cost_one_request_per_run(s3_server, s3_bucket, fault_proxy):
    sd = _small_tensors()
    url = f"s3://{s3_bucket}/run/step-3"
    quicksave.save(sd, url, storage=_options(s3_server))
    proxied = s3_server.storage_options(endpoint_url=fault_proxy.endpoint_url)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    fault_proxy.reset_stats()
    quicksave.load(dest, url, storage=proxied)
    requests = fault_proxy.stats["requests"]
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    # listing, manifest, .metadata-free load: a handful of requests, and one GET per data
    # file (the tensors sit next to each other), never one per tensor
    assert requests < 12, requests
