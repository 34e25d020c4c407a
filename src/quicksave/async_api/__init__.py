"""The seeds' asynchronous checkpointing API, on quicksave's engine.

Same names and meaning as NVIDIA Resiliency Extension's ``async_ckpt`` — ``AsyncRequest``,
``AsyncCallsQueue`` (``core``), ``TorchAsyncCheckpoint`` (``torch_ckpt``) — so a user of it
can switch by changing imports; the planning API of ``state_dict_saver`` with
``FileSystemWriterAsync`` (``filesystem_async``); plus ``async_save`` (``save``): one save
in the quicksave format through :class:`quicksave.engine.AsyncSaver`.
"""

from .core import AsyncCallsQueue
from .filesystem_async import FileSystemWriterAsync
from .request import AsyncRequest
from .save import async_save
from .state_dict_saver import (
    CheckpointMetadataCache,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)
from .torch_ckpt import TorchAsyncCheckpoint

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "CheckpointMetadataCache",
    "FileSystemWriterAsync",
    "TorchAsyncCheckpoint",
    "async_save",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
