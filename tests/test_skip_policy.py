"""The skip policy (tests/helpers/skip_policy.py) fails a run with a skip it does not
allow, and lets the GPU and root-only skips through, listed as not run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HELPERS_ROOT = Path(__file__).parent  # holds the helpers package

CONFTEST = """
from helpers.skip_policy import SkipPolicy

def pytest_configure(config):
    config.pluginmanager.register(SkipPolicy(), "quicksave-skip-policy")
"""

ALLOWED_ONLY = """
import pytest
from helpers.skip_policy import GPU_SKIP, ROOT_SKIP

def test_runs():
    assert True

@pytest.mark.skipif(True, reason=GPU_SKIP)
def test_on_a_gpu():
    pass

def test_as_root():
    pytest.skip(f"{ROOT_SKIP}: no tmpfs mount here")

@pytest.mark.xfail(reason="an expectation, not a skip", strict=True)
def test_expected_to_fail():
    assert False
"""


def _run(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HELPERS_ROOT), *sys.path]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gpu_and_root_skips_pass_listed_as_not_run(tmp_path: Path) -> None:
    out = _run(tmp_path, {"conftest.py": CONFTEST, "test_allowed.py": ALLOWED_ONLY})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in out.stdout
    assert "not run here (needs a CUDA device): 1" in out.stdout
    assert "not run here (needs root (or a privilege this machine does not grant)): 1" in (
        out.stdout
    )
    assert "not allowed" not in out.stdout


def test_any_other_skip_fails_the_run(tmp_path: Path) -> None:
    other = """
import pytest

def test_runs():
    assert True

def test_skips_itself():
    pytest.skip("flaky on this machine")
"""
    missing = """
import pytest

pytest.importorskip("a_package_that_is_not_installed_qs")

def test_never_collected():
    pass
"""
    out = _run(
        tmp_path,
        {
            "conftest.py": CONFTEST,
            "test_allowed.py": ALLOWED_ONLY,
            "test_other.py": other,
            "test_missing.py": missing,
        },
    )
    assert out.returncode == 1, out.stdout + out.stderr  # every test that ran passed
    assert "2 passed, 4 skipped, 1 xfailed" in out.stdout
    assert "2 skip(s) not allowed" in out.stdout
    assert "test_other.py::test_skips_itself: flaky on this machine" in out.stdout
    assert "test_missing.py: could not import 'a_package_that_is_not_installed_qs'" in out.stdout
