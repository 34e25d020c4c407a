"""NVIDIA Resiliency Extension's asynchronous checkpointing API, on quicksave's engine.

Same names and meaning as NVIDIA Resiliency Extension's ``async_ckpt`` — ``AsyncRequest``,
``AsyncCallsQueue`` (``core``), ``TorchAsyncCheckpoint`` (``torch_ckpt``) — so a user of it
can switch by changing imports; the planning API of ``state_dict_saver`` with
``FileSystemWriterAsync`` (``filesystem_async``). ``quicksave.async_api`` is the same API
under the name NVRx users switch their imports to.
"""

from quicksave.compat.nvrx.calls_queue import AsyncCallsQueue
from quicksave.compat.nvrx.filesystem_async import FileSystemWriterAsync
from quicksave.compat.nvrx.request import AsyncRequest
from quicksave.compat.nvrx.state_dict_saver import (
    CheckpointMetadataCache,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)
from quicksave.compat.nvrx.torch_ckpt import TorchAsyncCheckpoint

__all__ = [
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
]
