"""quicksave: asynchronous, distributed, atomic checkpointing for PyTorch.

Layers (docs/ARCHITECTURE.md): ``CheckpointManager`` (policy) → functions
(``save`` / ``load`` / ``async_save`` / ``StorageWriter`` / ``StorageReader``) → the engine
(``AsyncSaver``, and NVRx's ``AsyncRequest`` / ``AsyncCallsQueue`` /
``TorchAsyncCheckpoint``).

Names are imported on first use: the checkpoint worker process imports
``quicksave.worker.main`` and its modules only, and must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NotCommittedError,
    WorkerFailedError,
)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "save": "quicksave.api",
    "load": "quicksave.api",
    "load_state": "quicksave.tools.convert",
    "export_hf": "quicksave.tools.hf_export",
    "LoadPlanner": "quicksave.api",
    "StorageReader": "quicksave.adapters.dcp_reader",
    "StorageWriter": "quicksave.adapters.dcp_writer",
    "StorageOptions": "quicksave.storage",
    "S3Options": "quicksave.storage",
    "verify_checkpoint": "quicksave.loading.verify",
    "AsyncSaver": "quicksave.saving.engine",
    "EngineConfig": "quicksave.saving.config",
    "IncrementalConfig": "quicksave.saving.config",
    "SaveHandle": "quicksave.saving.handle",
    "SaveResult": "quicksave.saving.handle",
    "async_save": "quicksave.saving.async_save",
    **{
        name: "quicksave.compat.nvrx"
        for name in (
            "AsyncCallsQueue",
            "AsyncRequest",
            "CheckpointMetadataCache",
            "FileSystemWriterAsync",
            "TorchAsyncCheckpoint",
            "get_metadata_caching_status",
            "init_checkpoint_metadata_cache",
            "save_state_dict_async_finalize",
            "save_state_dict_async_plan",
            "verify_global_md_reuse",
        )
    },
    **{
        name: "quicksave.manager"
        for name in (
            "CheckpointConfig",
            "CheckpointManager",
            "EveryNSeconds",
            "EveryNSteps",
            "KeepLatestK",
            "MemoryTierConfig",
            "ModelState",
            "OptimizerState",
            "PerRank",
            "RNGState",
            "RetentionPolicy",
            "SavePolicy",
            "SaveRecord",
            "StatefulList",
            "TrainState",
            "UploadTierConfig",
        )
    },
}

__all__ = [
    "AsyncCallsQueue",
    "CheckpointMetadataCache",
    "FileSystemWriterAsync",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
    "AsyncRequest",
    "AsyncSaver",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "EngineConfig",
    "EveryNSeconds",
    "EveryNSteps",
    "IncompatibleStateError",
    "IncrementalConfig",
    "KeepLatestK",
    "MemoryTierConfig",
    "LoadPlanner",
    "ModelState",
    "NotCommittedError",
    "OptimizerState",
    "PerRank",
    "RNGState",
    "RetentionPolicy",
    "SaveHandle",
    "SavePolicy",
    "SaveRecord",
    "SaveResult",
    "StatefulList",
    "S3Options",
    "StorageOptions",
    "StorageReader",
    "StorageWriter",
    "TorchAsyncCheckpoint",
    "TrainState",
    "UploadTierConfig",
    "WorkerFailedError",
    "async_save",
    "export_hf",
    "load",
    "load_state",
    "save",
    "verify_checkpoint",
]


assert set(__all__) == set(_LAZY) | {n for n in __all__ if n.endswith("Error")}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quicksave' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from quicksave.adapters.dcp_reader import StorageReader
    from quicksave.adapters.dcp_writer import StorageWriter
    from quicksave.api import LoadPlanner, load, save
    from quicksave.compat.nvrx import (
        AsyncCallsQueue,
        AsyncRequest,
        CheckpointMetadataCache,
        FileSystemWriterAsync,
        TorchAsyncCheckpoint,
        get_metadata_caching_status,
        init_checkpoint_metadata_cache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
        verify_global_md_reuse,
    )
    from quicksave.loading.verify import verify_checkpoint
    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        EveryNSeconds,
        EveryNSteps,
        KeepLatestK,
        MemoryTierConfig,
        ModelState,
        OptimizerState,
        PerRank,
        RetentionPolicy,
        RNGState,
        SavePolicy,
        SaveRecord,
        StatefulList,
        TrainState,
        UploadTierConfig,
    )
    from quicksave.saving.async_save import async_save
    from quicksave.saving.config import EngineConfig, IncrementalConfig
    from quicksave.saving.engine import AsyncSaver
    from quicksave.saving.handle import SaveHandle, SaveResult
    from quicksave.storage import S3Options, StorageOptions
    from quicksave.tools.hf_export import export_hf
