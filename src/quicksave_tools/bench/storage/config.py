"""What ``quicksave bench --storage`` measures: the method and shape names, the
:class:`StorageBenchConfig` the command line fills in, and its argument checks
(:func:`check_config`, called first by
:func:`~quicksave_tools.bench.storage.run.run_storage_benchmark`)."""

from __future__ import annotations

from dataclasses import dataclass

from quicksave_tools.bench.baseline import BASELINE, check_baseline, plain

MiB = 1 << 20

RAW_THREADS = "raw threads"
RAW_BOTO3 = "raw boto3"
DCP_MSC = "dcp+MSC"
DCP_S3TC = "dcp+s3torchconnector"
QUICKSAVE = "quicksave"
METHODS = (RAW_THREADS, RAW_BOTO3, DCP_MSC, DCP_S3TC, QUICKSAVE)
RAW_METHODS = (RAW_THREADS, RAW_BOTO3)
SHAPES = ("large", "small", "model")
NOTES = {
    RAW_THREADS: "one multipart upload of slices of one buffer / parallel ranged GETs "
    "with readinto",
    RAW_BOTO3: "boto3 upload_fileobj / download_fileobj, TransferConfig",
    DCP_MSC: "MultiStorageFileSystemWriter/Reader, thread_count=2, MSC defaults",
    DCP_S3TC: "S3StorageWriter (thread_count=2) / S3StorageReader, path style",
    QUICKSAVE: "quicksave.save/load to s3:// in a fresh process (2 writer / 4 reader "
    "threads, xxh3)",
}
IN_CHILD = (QUICKSAVE,)  # run in a fresh process per round trip, also as @baseline
SMALL_TENSOR = 4 * MiB
WARMUP_BYTES = 8 * MiB


@dataclass(frozen=True)
class StorageBenchConfig:
    """What ``quicksave bench --storage`` measures.

    Args:
        size_mib: bytes of each shape's state dict, in MiB.
        repeat: timed runs of every method per shape (their order rotates).
        shapes: workload shapes (see :data:`SHAPES`).
        methods: throughput methods (see :data:`METHODS`).
        endpoint: an S3 endpoint to use instead of starting SeaweedFS (credentials and
            region from the AWS environment chain).
        bucket: with ``endpoint``: an existing bucket to use (only the benchmark's own
            objects are written and deleted); default: fresh buckets, deleted after.
        concurrency: parts in flight of the raw methods.
        part_mib: part size of the raw methods.
        training: run the training-loop part.
        throughput: run the save/load throughput part.
        train_steps, train_interval, train_hidden, train_layers, train_batch: the loop
            (checkpoint every ``train_interval`` steps; ``train_layers`` Linear(hidden,
            hidden)).
        train_repeat: runs of each target (S3, local), alternating.
        train_threads: ``torch.set_num_threads`` of the training processes.
        directory: where the local-directory training run writes (default: the
            current directory).
        seed: seed of the tensor values and the model.
        train_timeout_s: a training run that takes longer is stopped, reported failed.
        baseline: a folder holding another version's ``quicksave`` package (e.g. an
            earlier commit's ``src``): quicksave's throughput method and the training
            loop's checkpointing targets also run with it, as ``<name>@baseline``,
            interleaved with this version's runs on the same workloads.
        child_timeout_s: a throughput round trip run in its own process that takes
            longer is stopped, reported failed.
        train_pin: place the training processes on the first CPU this process may use and
            the checkpoint worker (``worker_cpus``) and the server the bench started on
            the others, the way a GPU trainer's loop thread and its host's spare cores
            are: the overhead then measures what checkpointing costs the loop itself, not
            what a store on the same two cores costs it.
        server_nice: the SeaweedFS the bench starts runs at this lower CPU priority: it
            stands in for a remote store, which would not take the trainer's CPUs (on this
            2-core machine the server otherwise uses ~11 CPU-s per GiB written beside the
            training loop it is measured against). 0 to share the CPUs equally.
    """

    size_mib: int = 1024
    repeat: int = 3
    shapes: tuple[str, ...] = SHAPES
    methods: tuple[str, ...] = METHODS
    endpoint: str | None = None
    bucket: str | None = None
    concurrency: int = 8
    part_mib: int = 32
    training: bool = True
    throughput: bool = True
    train_steps: int = 45
    train_interval: int = 10
    train_hidden: int = 1024
    train_layers: int = 8
    train_batch: int = 256
    train_repeat: int = 2
    train_threads: int = 2
    train_warmup: int = 1
    train_calibration_steps: int = 8
    directory: str | None = None
    seed: int = 0
    train_timeout_s: float = 900.0
    server_nice: int = 19
    train_pin: bool = False
    baseline: str | None = None
    child_timeout_s: float = 900.0


def all_methods(config: StorageBenchConfig) -> tuple[str, ...]:
    """The throughput methods run: ``config.methods``, and with a baseline each method
    of :data:`IN_CHILD` again with the baseline's package."""
    twins = [m + BASELINE for m in config.methods if m in IN_CHILD]
    return (*config.methods, *(twins if config.baseline is not None else ()))


def note(method: str) -> str:
    """How ``method`` (``@baseline`` ones too) moves the bytes, for the report."""
    text = NOTES[plain(method)]
    return text if plain(method) == method else text + "; the baseline's package"


def check_config(config: StorageBenchConfig) -> None:
    if config.size_mib < 1 or config.repeat < 1:
        raise ValueError("size_mib and repeat must be at least 1")
    if config.concurrency < 1 or config.part_mib < 5:
        raise ValueError("concurrency must be at least 1 and part_mib at least 5 (S3's minimum)")
    for s in config.shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for m in config.methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if config.baseline is not None:
        check_baseline(config.baseline)
    if RAW_THREADS not in config.methods or QUICKSAVE not in config.methods:
        raise ValueError(f"methods must include {RAW_THREADS!r} and {QUICKSAVE!r}")
    if config.training:
        for name in ("train_steps", "train_interval", "train_hidden", "train_layers"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if config.train_interval > config.train_steps:
            raise ValueError("train_interval must not exceed train_steps")
        if config.train_repeat < 1:
            raise ValueError("train_repeat must be at least 1")
