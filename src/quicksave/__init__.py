"""quicksave: asynchronous, distributed, atomic checkpointing for PyTorch.

Layers (docs/ARCHITECTURE.md): ``CheckpointManager`` (policy) → functions
(``save`` / ``load`` / ``StorageWriter`` / ``StorageReader``) → the engine.
"""

from .api import LoadPlanner, load, save
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NotCommittedError,
    WorkerFailedError,
)
from .reader import StorageReader
from .writer import StorageWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "LoadPlanner",
    "NotCommittedError",
    "StorageReader",
    "StorageWriter",
    "WorkerFailedError",
    "load",
    "save",
]

# The manager layer (built on the functions above).
from .manager import (  # noqa: E402
    CheckpointConfig,
    CheckpointManager,
    EveryNSeconds,
    EveryNSteps,
    KeepLatestK,
    ModelState,
    OptimizerState,
    RetentionPolicy,
    RNGState,
    SavePolicy,
    SaveRecord,
    StatefulList,
    TrainState,
)

__all__ += [
    "CheckpointConfig",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepLatestK",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "RetentionPolicy",
    "SavePolicy",
    "SaveRecord",
    "StatefulList",
    "TrainState",
]

# The seeds' async API (engine layer) and the async function.
from .async_api import AsyncCallsQueue, AsyncRequest, TorchAsyncCheckpoint, async_save  # noqa: E402

__all__ += ["AsyncCallsQueue", "AsyncRequest", "TorchAsyncCheckpoint", "async_save"]
