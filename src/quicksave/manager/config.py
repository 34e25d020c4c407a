"""``CheckpointConfig``: everything the manager needs to decide when, where and what to save.

One frozen dataclass, validated when it is built, so a bad value fails before the
training loop starts (never at step 10,000).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

INTERVAL_TYPES = ("steps", "seconds")

# The modes the manager can run. Only "disabled" (synchronous) exists so far; the
# asynchronous modes are added by the async engine and plug into CheckpointManager._write.
IMPLEMENTED_ASYNC_MODES = ("disabled",)


@dataclass(frozen=True)
class CheckpointConfig:
    """How a :class:`~quicksave.manager.CheckpointManager` checkpoints.

    Attributes:
        folder: the directory holding ``step-<N>`` checkpoints (created if missing).
        interval: save every ``interval`` steps (a whole number) or seconds.
        interval_type: ``"steps"`` or ``"seconds"``.
        keep_latest_k: keep only the newest ``k`` committed checkpoints; 0 keeps all.
        export_dtype: torch floating dtype name (``"float32"``, ``"bfloat16"``, ...) of
            the model-only export written at ``last_step``.
        last_step: the final training step. ``save(last_step)`` always saves (as if
            forced) and also writes ``<folder>/export-step-<N>``: the model weights only,
            floating tensors cast to ``export_dtype``.
        thread_count: writer threads (and data files) per rank.
        async_mode: ``"disabled"`` (synchronous saves). Asynchronous modes come with
            the async engine.
        enabled: if False the manager saves and loads nothing.

    Raises:
        CheckpointError: on construction, for any invalid value (message names it).

    Example::

        config = CheckpointConfig(folder="ckpt", interval=100, keep_latest_k=3,
                                  last_step=10_000, export_dtype="bfloat16")
    """

    folder: str
    interval: float = 500
    interval_type: str = "steps"
    keep_latest_k: int = 0
    export_dtype: str = "float32"
    last_step: int | None = None
    thread_count: int = 2
    async_mode: str = "disabled"
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.folder, os.PathLike):
            object.__setattr__(self, "folder", os.fspath(self.folder))
        if not isinstance(self.folder, str) or not self.folder:
            raise CheckpointError(f"folder must be a non-empty path, got {self.folder!r}")
        if self.interval_type not in INTERVAL_TYPES:
            raise CheckpointError(
                f"interval_type must be 'steps' or 'seconds', got {self.interval_type!r}"
            )
        if (
            isinstance(self.interval, bool)
            or not isinstance(self.interval, (int, float))
            or not math.isfinite(self.interval)
            or self.interval <= 0
        ):
            raise CheckpointError(f"interval must be a positive number, got {self.interval!r}")
        if self.interval_type == "steps" and self.interval != int(self.interval):
            raise CheckpointError(
                f"interval must be a whole number of steps, got {self.interval!r}"
            )
        _check_int("keep_latest_k", self.keep_latest_k, minimum=0)
        _check_int("thread_count", self.thread_count, minimum=1)
        if self.last_step is not None:
            _check_int("last_step", self.last_step, minimum=0)
        dtype = (
            getattr(torch, self.export_dtype, None) if isinstance(self.export_dtype, str) else None
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CheckpointError(
                f"export_dtype must name a torch floating dtype (e.g. 'float32', 'bfloat16'), "
                f"got {self.export_dtype!r}"
            )
        if not isinstance(self.async_mode, str) or not self.async_mode:
            raise CheckpointError(f"async_mode must be a non-empty string, got {self.async_mode!r}")
        if not isinstance(self.enabled, bool):
            raise CheckpointError(f"enabled must be True or False, got {self.enabled!r}")

    @property
    def export_torch_dtype(self) -> torch.dtype:
        """``export_dtype`` as a ``torch.dtype``."""
        return getattr(torch, self.export_dtype)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{name} must be an integer >= {minimum}, got {value!r}")
