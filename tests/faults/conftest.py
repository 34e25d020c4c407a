"""Fixtures of the fault-injection suite (helpers: ``faultkit``, ``forkserver``,
``campaign_*``; the runner: ``campaign.py``).

Every campaign test runs twice: ``fast`` (scale 1, part of ``pytest -q``) and
``campaign`` (marked ``slow`` and ``campaign``, deselected by default; run with
``pytest -m campaign tests/faults``), at the scale given by the environment variable
``QUICKSAVE_CAMPAIGN_SCALE`` (default 10).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from forkserver import ForkServer


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer]:
    """One fork server for the session (importing torch once costs seconds)."""
    server = ForkServer()
    yield server
    server.close()
