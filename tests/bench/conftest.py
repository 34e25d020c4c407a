"""Fixtures of the benchmark tests: the storage tests' SeaweedFS S3 server (``s3_server``,
from tests/storage/conftest.py), for the ``quicksave bench --storage`` smoke test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Loaded by path under a name of its own: a second plain ``conftest`` module would clash
# with pytest's own import of tests/storage/conftest.py.
_spec = importlib.util.spec_from_file_location(
    "quicksave_tests_storage_conftest", Path(__file__).parent.parent / "storage" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_storage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_storage)

s3_server = _storage.s3_server
