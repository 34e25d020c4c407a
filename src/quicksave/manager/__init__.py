"""The manager layer: torchtitan-style ``CheckpointManager`` with its config, policies
and ``Stateful`` wrappers, over ``CheckpointSession`` (one job's use of one checkpoint
folder, which the integrations share)."""

from quicksave.manager.config import CheckpointConfig, MemoryTierConfig, UploadTierConfig
from quicksave.manager.manager import CheckpointManager
from quicksave.manager.policies import (
    EveryNSeconds,
    EveryNSteps,
    KeepLatestK,
    RetentionPolicy,
    SavePolicy,
)
from quicksave.manager.records import SaveRecord
from quicksave.manager.session import CheckpointSession
from quicksave.manager.states import (
    ModelState,
    OptimizerState,
    PerRank,
    RNGState,
    StatefulList,
    TrainState,
)

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointSession",
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
]
