"""NVRx's data-path surface of ``FileSystemWriterAsync``: its static write helpers, its
class-level caches and hooks, and the module-level names of NVRx's ``filesystem_async``
(``WriteBucket``, ``ConsistentDataIdentifier``, ``get_write_results_queue``).

quicksave's own save path does not go through these (``FileSystemWriterAsync`` stages in
``prepare_write_data`` and writes with ``get_save_function_and_args()``'s ``save_fn``);
they exist so that code written against NVRx's writer runs unchanged: a ``WriteBucket``
is written in DCP's item format (``dcp_write.write_dcp_file``) by threads, results go on
the caller's queues as NVRx's workers put them. No collective.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult

from quicksave.compat.nvrx.dcp_save import INVALID_SETUP
from quicksave.compat.nvrx.dcp_write import write_dcp_file
from quicksave.errors import CheckpointError

WriteBucket = tuple[str, str, tuple[list, list]]
"""NVRx's description of one file's writes: ``(file path, storage key (the file's name in
the checkpoint), ([(WriteItem, BytesIO)], [(WriteItem, CPU tensor)]))``."""


class ConsistentDataIdentifier:
    """NVRx's key of a cached data structure in its worker. quicksave's worker caches no
    data structure between saves, so this only carries ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConsistentDataIdentifier) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """A queue that write results can be put on from other processes (NVRx's helper): a
    new multiprocessing manager queue of context ``mp_mode`` on every call (NVRx keeps
    one per process; quicksave keeps no module state, so hold the one you get)."""
    import multiprocessing

    return multiprocessing.get_context(mp_mode).Manager().Queue()


def _write_bucket(open_file: Callable[..., Any], write_bucket: Any, use_fsync: bool) -> list:
    """Write one ``WriteBucket`` in DCP's item format (``format.dcp_layout``); its
    ``WriteResult``s point at each item's bytes."""
    file_name, storage_key, (bytes_data, tensor_data) = write_bucket
    items: list[tuple[str, Any]] = []
    index: dict[str, Any] = {}
    for n, (write_item, data) in enumerate(list(bytes_data) + list(tensor_data)):
        key = f"{n}:{write_item.index.fqn}"
        items.append((key, data))
        index[key] = write_item.index
    with open_file(file_name, "wb") as stream:
        written = write_dcp_file(stream, items, fsync=use_fsync)
    out = []
    for k, w in written.items.items():
        info = _StorageInfo(storage_key, w.item_offset, w.item_length)
        out.append(WriteResult(index[k], w.item_length, info))
    return out


class _NoCache:
    """Stands for NVRx's class-level caches (``_cached_identifiers``,
    ``_shm_tensor_cache``): quicksave keeps none, so there is nothing to clear."""

    def clear(self) -> None:
        pass

    def discard(self, key: object) -> None:
        pass

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return 0


class NvrxDataPath:
    """NVRx's class attributes and static methods of ``FileSystemWriterAsync`` (its base
    class here)."""

    _cached_identifiers = _NoCache()
    _shm_tensor_cache = _NoCache()

    @classmethod
    def cleanup_tensor_caches(cls) -> None:
        """NVRx's cache clean-up; quicksave keeps no class-level tensor cache."""

    @classmethod
    def register_shm_drain_callback(cls, fn: Callable[[], Any] | None) -> None:
        """NVRx's shared-memory drain hook; accepted, no effect (staging buffers here are
        per save)."""

    @staticmethod
    def preload_tensors(resolved_plan_data: Any, non_blocking: bool = True) -> list:
        """NVRx's worker-side preload of its own cached data structures. quicksave stages
        in ``prepare_write_data`` and its ``preload_fn`` is the second element of
        ``get_save_function_and_args()``; NVRx's structures have no counterpart here.

        Raises:
            CheckpointError: always, naming what to use instead.
        """
        raise CheckpointError(
            "FileSystemWriterAsync.preload_tensors takes NVRx's internal data structures; "
            "use the preload_fn of writer.get_save_function_and_args()"
        )

    @staticmethod
    def write_preloaded_data(
        transform_list: Any,
        open_file: Callable[..., Any],
        local_thread_idx: int,
        write_bucket: Any,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """Write one ``WriteBucket`` (DCP's item format) and put ``(local_thread_idx,
        write results or the exception)`` on ``results_queue``; then mark one task of
        ``count_queue`` done (``get`` + ``task_done``), as NVRx's workers do.
        ``transform_list`` must hold no stream extension."""
        try:
            if any(getattr(t, "extensions", None) for t in transform_list or ()):
                raise CheckpointError("stream extensions are not supported")
            out: Any = (local_thread_idx, _write_bucket(open_file, write_bucket, use_fsync))
        except Exception as e:  # noqa: BLE001 - reported through the queue, as NVRx
            out = (local_thread_idx, e)
        results_queue.put(out)
        if count_queue is not None:
            count_queue.get()
            count_queue.task_done()

    @staticmethod
    def write_preloaded_data_proc(
        transform_list: Any,
        open_file: Callable[..., Any],
        local_proc_idx: int,
        write_bucket: Any,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """:meth:`write_preloaded_data` (NVRx runs it in a child process)."""
        NvrxDataPath.write_preloaded_data(
            transform_list,
            open_file,
            local_proc_idx,
            write_bucket,
            results_queue,
            count_queue,
            use_fsync,
            **kwargs,
        )

    @staticmethod
    def write_preloaded_data_multithread(
        transform_list: Any,
        use_msc: bool,
        open_file: Callable[..., Any],
        rank: int,
        write_buckets: list,
        global_results_queue: Any,
    ) -> None:
        """Write every bucket, one thread each, and put ``{bucket index: write results}``
        (or the first exception) on ``global_results_queue``."""
        import queue as queue_mod

        local: queue_mod.Queue = queue_mod.Queue()
        with ThreadPoolExecutor(max(1, len(write_buckets))) as pool:
            for i, bucket in enumerate(write_buckets):
                pool.submit(
                    NvrxDataPath.write_preloaded_data,
                    transform_list,
                    open_file,
                    i,
                    bucket,
                    local,
                    None,
                    True,
                )
        results: dict[int, Any] = {}
        while not local.empty():
            i, r = local.get()
            if isinstance(r, Exception):
                global_results_queue.put(r)
                return
            results[i] = r
        global_results_queue.put(results)

    @staticmethod
    def write_preloaded_data_multiproc(
        transform_list: Any,
        use_msc: bool,
        open_file: Callable[..., Any],
        rank: int,
        write_buckets: list,
        global_results_queue: Any,
    ) -> None:
        """:meth:`write_preloaded_data_multithread`: file writes release the GIL, so
        threads do what NVRx's processes do. As NVRx, it refuses to run inside a daemonic
        process (an ``AsyncCallsQueue(is_daemon=True)`` worker): "Invalid Setup!"."""
        import multiprocessing

        if multiprocessing.current_process().daemon:
            global_results_queue.put(CheckpointError(INVALID_SETUP, rank=rank))
            return
        NvrxDataPath.write_preloaded_data_multithread(
            transform_list, use_msc, open_file, rank, write_buckets, global_results_queue
        )
