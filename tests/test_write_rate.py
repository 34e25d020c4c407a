"""``write_rate_mbps``: the writer paces its local writes (on a fake clock: no timing)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import quicksave.storage.posix_io as posix_io
from quicksave.errors import CheckpointError
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver


class FakeClock:
    """``time.monotonic`` that moves only when the writer sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_paced_write_takes_its_bytes_over_the_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(posix_io, "WRITE_PIECE", 64 << 10)
    # posix_io's own view of the time module only: other threads keep the real clock
    monkeypatch.setattr(
        posix_io, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep)
    )
    image = memoryview(bytearray(range(256)) * 4096)  # 1 MiB: 16 pieces
    rate = 4 << 20  # bytes/s: the whole file is due after 0.25 s
    posix_io.write_image(str(tmp_path / "f"), image, len(image), [], rank=0, rate=rate)
    assert (tmp_path / "f").read_bytes() == bytes(image)
    # one sleep before each piece but the first, each bringing the clock to its due time
    assert len(clock.slept) == 15
    assert sum(clock.slept) == pytest.approx((len(image) - (64 << 10)) / rate)
    clock.slept.clear()
    posix_io.write_image(str(tmp_path / "g"), image, len(image), [], rank=0)
    assert clock.slept == []  # no rate: no pacing


def test_the_rate_reaches_the_writer_and_the_checkpoint_is_whole(tmp_path: Path) -> None:
    sd = {"w": torch.randn(1 << 16), "b": torch.arange(7)}
    with AsyncSaver(EngineConfig(mode="thread", write_rate_mbps=1000.0)) as saver:
        saver.save(sd, tmp_path / "ckpt", step=1).wait(60)
    assert verify_checkpoint(tmp_path / "ckpt").ok


@pytest.mark.parametrize("bad", [0, -5.0, math.nan, math.inf, True, "100"])
def test_a_bad_rate_is_refused_naming_the_knob(tmp_path: Path, bad: object) -> None:
    with pytest.raises(CheckpointError, match="write_rate_mbps"):
        CheckpointConfig(folder=str(tmp_path), write_rate_mbps=bad)  # type: ignore[arg-type]


def test_the_manager_passes_the_rate_to_its_engine(tmp_path: Path) -> None:
    config = CheckpointConfig(folder=str(tmp_path), write_rate_mbps=250)
    assert config.engine_config().write_rate_mbps == 250.0
    assert CheckpointConfig(folder=str(tmp_path)).engine_config().write_rate_mbps is None
