"""The options of quicksave's torchtitan backend, as torchtitan's config system sees them.

:class:`TitanCheckpointConfig` is torchtitan's ``BaseCheckpointManager.Config`` plus
quicksave's options (asynchronous mode, worker, threads, stock DCP folders, timeouts);
it is validated when built and translated into a :class:`~quicksave.CheckpointConfig`
by :meth:`TitanCheckpointConfig.quicksave_config`, which the backend's session uses.
No I/O, no collectives.

Importing this module imports torchtitan; ``import quicksave`` never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

try:
    from torchtitan.components.checkpointer import BaseCheckpointManager
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "quicksave.integrations.torchtitan needs torchtitan >= 0.3 "
        "(pip install 'quicksave[torchtitan]')"
    ) from e

from quicksave.errors import CheckpointError
from quicksave.manager.config import CheckpointConfig


@dataclass(kw_only=True, slots=True)
class TitanCheckpointConfig(BaseCheckpointManager.Config):
    """torchtitan's checkpoint options (``BaseCheckpointManager.Config``) and
    quicksave's. Every field is a torchtitan CLI flag (``--checkpoint.<field>``).

    Declared by :class:`~quicksave.integrations.torchtitan.QuicksaveCheckpointManager`
    as its ``Config``: ``QuicksaveCheckpointManager.Config(...).build(...)`` builds it.
    """

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """``disabled``: save() returns once committed. ``async``: once staged; written
    in the background. ``async_with_pinned_mem``: parameters and optimizer states
    are staged during the next forward/backward too."""

    async_worker: Literal["process", "thread"] = "process"
    """Who writes in the async modes: a worker process per rank, or a thread."""

    thread_count: int = 2
    """Data files (and writer threads) per rank."""

    allow_dcp: bool = False
    """Also list and load stock DCP ``step-<N>`` folders (e.g. written by stock
    torchtitan): their ``.metadata`` pickle is read by a restricted unpickler."""

    allow_dcp_pickle: bool = False
    """Unpickle stock DCP metadata without restriction (trusted folders only)."""

    save_timeout_s: float = 900.0
    """A save still being written after this long has failed."""

    commit_timeout_s: float = 120.0
    """Several ranks: how long the commit waits for every rank's files."""

    close_timeout_s: float = 300.0
    """How long ``close()`` (and a load, a last-step save) waits for saves."""

    def __post_init__(self) -> None:
        BaseCheckpointManager.Config.__post_init__(self)
        for name in ("last_save_in_hf", "initial_load_in_hf"):
            if getattr(self, name):
                raise CheckpointError(
                    f"checkpoint.{name} is not supported by QuicksaveCheckpointManager: "
                    "Hugging Face safetensors are not quicksave checkpoints. Use "
                    "torchtitan's stock CheckpointManager for Hugging Face import/export, "
                    "or export a quicksave checkpoint with "
                    "`quicksave convert --to safetensors CKPT OUT`"
                )
        self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
        self.quicksave_config()  # validates the quicksave options now

    def quicksave_config(self, folder: str | None = None) -> CheckpointConfig:
        """The equivalent :class:`~quicksave.CheckpointConfig` (engine, timeouts,
        retention), for ``folder`` (default: ``self.folder``)."""
        if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
            raise CheckpointError(
                "checkpoint.async_mode must be 'disabled', 'async' or "
                f"'async_with_pinned_mem', got {self.async_mode!r}"
            )
        return CheckpointConfig(
            folder=folder or self.folder,
            keep_latest_k=self.keep_latest_k,
            export_dtype=self.export_dtype,
            thread_count=self.thread_count,
            async_mode="disabled" if self.async_mode == "disabled" else self.async_worker,
            staging="overlap" if self.async_mode == "async_with_pinned_mem" else "blocking",
            save_timeout_s=self.save_timeout_s,
            commit_timeout_s=self.commit_timeout_s,
            close_timeout_s=self.close_timeout_s,
            read_only=self.load_only,
            allow_dcp=self.allow_dcp,
            allow_dcp_pickle=self.allow_dcp_pickle,
        )
