"""The manager layer: torchtitan-style ``CheckpointManager`` with its config, policies
and ``Stateful`` wrappers."""

from .config import CheckpointConfig
from .manager import CheckpointManager
from .policies import EveryNSeconds, EveryNSteps, KeepLatestK, RetentionPolicy, SavePolicy
from .records import SaveRecord
from .states import ModelState, OptimizerState, PerRank, RNGState, StatefulList, TrainState

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepLatestK",
    "ModelState",
    "OptimizerState",
    "PerRank",
    "RNGState",
    "RetentionPolicy",
    "SavePolicy",
    "SaveRecord",
    "StatefulList",
    "TrainState",
]
