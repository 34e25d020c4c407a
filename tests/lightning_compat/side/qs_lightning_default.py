"""pytest plugin of ``run_lightning_tests.py`` for Lightning's own tests (every mode).

Registers the ``flaky`` marker (Lightning's CI installs pytest-rerunfailures, which defines
it; the tests run once each here, without reruns), and checks before any test that the
mode in ``QS_LIGHTNING_MODE`` is in effect: in ``sync`` and ``async`` mode, that
``sitecustomize.py`` of this directory made ``QuicksaveCheckpointIO`` Lightning's default
``CheckpointIO``; in ``stock`` mode, that it did not.
"""

from __future__ import annotations

import os

import pytest

MODES = ("stock", "sync", "async")


def _mode() -> str:
    mode = os.environ.get("QS_LIGHTNING_MODE", "")
    if mode not in MODES:
        raise pytest.UsageError(f"QS_LIGHTNING_MODE must be one of {MODES}, got {mode!r}")
    return mode


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "flaky: rerun marker of pytest-rerunfailures (no reruns here)"
    )
    mode = _mode()
    from lightning.pytorch.strategies import SingleDeviceStrategy

    io = SingleDeviceStrategy("cpu").checkpoint_io
    expected = "TorchCheckpointIO" if mode == "stock" else "QuicksaveCheckpointIO"
    if type(io).__name__ != expected or getattr(io, "async_save", False) != (mode == "async"):
        raise pytest.UsageError(
            f"mode {mode}: Lightning's default CheckpointIO is {io!r} (is the sitecustomize.py "
            "next to this plugin first on PYTHONPATH?)"
        )


def pytest_report_header(config: pytest.Config) -> str:
    mode = _mode()
    if mode == "stock":
        return "lightning_compat: stock (Lightning's TorchCheckpointIO)"
    return f"lightning_compat: QuicksaveCheckpointIO(async_save={mode == 'async'}) as default"
