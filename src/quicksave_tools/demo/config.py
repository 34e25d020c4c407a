"""``DemoConfig``: the settings of one ``quicksave demo``."""

from __future__ import annotations

from dataclasses import dataclass

from quicksave_tools.demo.train import DEFAULT_ASYNC_MODE


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo.

    Attributes:
        steps: training steps of every run.
        interval: checkpoint every ``interval`` steps.
        kill_at: the step after which the interrupted run is killed.
        folder: where checkpoints, results and logs go.
        keep: ``keep_latest_k`` of the manager (0 keeps all).
        seed: training seed (all runs use the same).
        threads: torch threads per child.
        async_mode: the manager's ``async_mode``.
        timeout_s: a child running longer than this is killed and the demo fails.
        keep_folder: leave ``folder`` in place afterwards (False only for a temp folder).
    """

    steps: int = 120
    interval: int = 20
    kill_at: int = 70
    folder: str = "qs-demo"
    keep: int = 0
    seed: int = 0
    threads: int = 1
    async_mode: str = DEFAULT_ASYNC_MODE
    timeout_s: float = 600.0
    keep_folder: bool = True
