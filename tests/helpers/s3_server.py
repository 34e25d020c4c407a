"""A SeaweedFS S3 server on loopback for a block of tests (a fixture's body): started,
yielded, stopped. It FAILS the test when it cannot start (boto3 or the ``weed`` binary
missing: both are in the ``dev`` extra), never skips: a silently skipped S3 suite would
hide that CI lost them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from quicksave_tools.testing.seaweed import SeaweedServer
from quicksave_tools.testing.seaweed_process import SeaweedError


@contextlib.contextmanager
def seaweed_server() -> Iterator[SeaweedServer]:
    try:
        import boto3  # noqa: F401
    except ImportError as e:
        pytest.fail(
            f"the S3 tests need boto3 ({e}); install the dev extra: pip install -e .[dev]",
            pytrace=False,
        )
    server = SeaweedServer()
    try:
        server.start()
    except SeaweedError as e:
        pytest.fail(f"could not start the SeaweedFS S3 server: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
