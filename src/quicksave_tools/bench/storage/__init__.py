"""``quicksave bench --storage``: save and load throughput against an S3 server, and what
checkpointing to S3 costs a training loop, measured side by side in one run.

Unless ``--endpoint URL`` is given (credentials and region then come from the AWS
environment chain), the benchmark starts its own SeaweedFS (``weed server -s3`` on
loopback, :class:`~quicksave_tools.testing.seaweed.SeaweedServer`) and stops it (its process
group killed) when it ends, also on an error, Ctrl-C or SIGTERM.

Every method moves the same bytes (``--size-mib``, default 1 GiB) of each workload shape
(``--shapes``):

* ``large`` — four tensors of a quarter of the size each (256 MiB at 1 GiB), float32;
* ``small`` — 4 MiB tensors (256 at 1 GiB), float32 and bfloat16 alternating;
* ``model`` — a transformer's checkpoint: 24 layers of attention, MLP and layer-norm
  weights and biases (float32, hidden size chosen to fill the size), each with AdamW's
  ``exp_avg``, ``exp_avg_sq`` and a one-element ``step``: 1152 tensors from 4 bytes to
  a few MiB, most of the bytes in chunks under 8 MiB.

Methods (save, then load of what it saved, values checked; every save to a fresh
prefix; the objects are deleted after each load, and every shape and repeat gets a
fresh bucket, deleted afterwards):

* ``raw threads`` — the bytes packed once (untimed) into one buffer, uploaded as one
  multipart upload whose parts are slices of it (``--part-mib``, ``--concurrency`` in
  flight; no checksums) and read back with parallel ranged GETs straight into a
  buffer (``readinto``): the practical limit of this server and client.
* ``raw boto3`` — the same buffer through boto3's ``upload_fileobj`` /
  ``download_fileobj`` (``TransferConfig``, same part size and concurrency).
* ``dcp+MSC`` — ``dcp.save`` / ``dcp.load`` with the Multi-Storage Client's
  ``MultiStorageFileSystemWriter`` / ``Reader`` (``thread_count=2``), through an MSC
  config the benchmark writes in a temporary directory (MSC's default S3 settings).
* ``dcp+s3torchconnector`` — ``dcp.save`` / ``dcp.load`` with s3torchconnector's
  ``S3StorageWriter`` (``thread_count=2``) / ``S3StorageReader`` (path-style addressing,
  the endpoint given to its client); reported as not available, with the reason, where
  it cannot run.
* ``quicksave`` — ``quicksave.save`` / ``quicksave.load`` to ``s3://`` (defaults: 2
  writer threads, 4 reader threads, xxh3 of every chunk written and verified), each
  round trip in a fresh process that first saves and loads a tiny state dict untimed.

With ``--baseline SRC`` (a folder holding another version's ``quicksave`` package, e.g.
an earlier commit's ``src``), quicksave's method also runs as ``quicksave@baseline``
with that package, in the same rotation on the same shapes, and the training part runs
``local@baseline`` and ``s3@baseline`` beside ``local`` and ``s3``; the report adds
current / baseline ratios per workload (:mod:`.comparison`).

"raw" in the ratios is the faster of the two raw methods (by median). Every method is
run once on a tiny state dict first (imports, clients, connection pools), not timed;
the order of the methods rotates with every repeat. Reported per method: median and
best seconds and MB/s (10^6 bytes/s), and CPU seconds of this process and, for an own
server, of the server (on a small machine the client and the server share the CPUs).

The training-loop part (``--no-training`` skips it) runs a seeded MLP + AdamW with a
:class:`~quicksave.manager.CheckpointManager` (``async_mode="process"``, default
staging) checkpointing every ``--train-interval`` steps to ``s3://`` and to a local
directory, each run in a fresh process, with runs without checkpoints before, between
and after them. Overhead per checkpoint = (loop seconds, waiting for the last
checkpoint included, − the median loop seconds without checkpoints) / checkpoints.

The modules, in the order of a run: :mod:`.config` (names, :class:`StorageBenchConfig`,
checks), :mod:`.run` (one whole run), :mod:`.target` (the endpoint, the own server),
:mod:`.buckets`, :mod:`.workloads` (the shapes' state dicts), :mod:`.methods` and
:mod:`.raw_s3` (each method's save and load), :mod:`.quicksave_child` (quicksave's round
trip in a fresh process), :mod:`.throughput` (the timed runs), :mod:`.training` (the
training-loop part), :mod:`.comparison` (against a baseline), :mod:`.report`
(acceptance, Markdown) and :mod:`.log`; this package's :func:`main` is the command line.

Example::

    quicksave bench --storage
    quicksave bench --storage --size-mib 256 --repeat 1 --json storage.json
    quicksave bench --storage --size-mib 256 --repeat 1 --baseline ../old/src
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... quicksave bench --storage \\
        --endpoint http://127.0.0.1:8333
"""

from __future__ import annotations

import argparse
import json
import sys

from quicksave_tools.bench.storage.config import SHAPES, StorageBenchConfig
from quicksave_tools.bench.storage.log import why

# The run and the report are imported by main(): the child processes import modules of
# this package too, and with ``--baseline`` their quicksave is another version, which
# the parent's imports (quicksave's internals) need not fit.


def build_parser() -> argparse.ArgumentParser:
    d = StorageBenchConfig()
    p = argparse.ArgumentParser(
        prog="quicksave bench --storage",
        description="Save/load throughput to S3 of quicksave vs raw boto3 transfers, "
        "dcp+MSC and dcp+s3torchconnector, and the training-loop overhead of checkpointing "
        "to S3 vs a local directory, side by side in one run. Starts its own SeaweedFS "
        "unless --endpoint is given.",
    )
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="S3 endpoint to use (credentials, region: AWS environment chain); default: "
        "start SeaweedFS on loopback",
    )
    p.add_argument("--bucket", help="with --endpoint: an existing bucket to use")
    p.add_argument("--size-mib", type=int, default=d.size_mib, help="bytes per shape (1024)")
    p.add_argument(
        "--repeat",
        "--repeats",
        dest="repeat",
        type=int,
        default=d.repeat,
        help=f"timed runs of every method per shape ({d.repeat})",
    )
    p.add_argument(
        "--shapes", default=",".join(d.shapes), help="comma-separated: " + ",".join(SHAPES)
    )
    p.add_argument("--methods", default=",".join(d.methods), help="comma-separated methods")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="raw: parts in flight")
    p.add_argument("--part-mib", type=int, default=d.part_mib, help="raw: part size in MiB")
    p.add_argument("--no-training", action="store_true", help="skip the training-loop part")
    p.add_argument(
        "--no-throughput", action="store_true", help="skip the save/load throughput part"
    )
    p.add_argument("--train-steps", type=int, default=d.train_steps)
    p.add_argument("--train-interval", type=int, default=d.train_interval)
    p.add_argument("--train-hidden", type=int, default=d.train_hidden)
    p.add_argument("--train-layers", type=int, default=d.train_layers)
    p.add_argument("--train-batch", type=int, default=d.train_batch)
    p.add_argument("--train-repeat", type=int, default=d.train_repeat)
    p.add_argument("--train-threads", type=int, default=d.train_threads)
    p.add_argument(
        "--train-pin",
        action="store_true",
        help="trainer on the first CPU; checkpoint worker and server on the others",
    )
    p.add_argument("--dir", default=None, help="folder of the local training run (default: .)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--server-nice",
        type=int,
        default=d.server_nice,
        help="CPU niceness of the SeaweedFS the bench starts (19: a stand-in for a remote store)",
    )
    p.add_argument(
        "--baseline",
        metavar="SRC",
        help="a folder holding another quicksave package (an earlier commit's src): "
        "quicksave's throughput method and the training targets also run with it, as "
        "<name>@baseline, and the report compares the two",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --storage``.

    Returns:
        0 on success, 2 on bad arguments, 1 if raw or quicksave could not run or a
        method loaded wrong values, 130 on Ctrl-C (the server is stopped in every case).

    Example::

        quicksave bench --storage --size-mib 1024 --repeat 3 --json storage.json
    """
    from quicksave_tools.bench.storage.report import format_storage_report
    from quicksave_tools.bench.storage.run import run_storage_benchmark

    args = build_parser().parse_args(argv)
    config = StorageBenchConfig(
        size_mib=args.size_mib,
        repeat=args.repeat,
        shapes=tuple(s.strip() for s in args.shapes.split(",") if s.strip()),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        endpoint=args.endpoint,
        bucket=args.bucket,
        concurrency=args.concurrency,
        part_mib=args.part_mib,
        training=not args.no_training,
        throughput=not args.no_throughput,
        train_steps=args.train_steps,
        train_interval=args.train_interval,
        train_hidden=args.train_hidden,
        train_layers=args.train_layers,
        train_batch=args.train_batch,
        train_repeat=args.train_repeat,
        train_threads=args.train_threads,
        directory=args.dir,
        seed=args.seed,
        server_nice=args.server_nice,
        train_pin=args.train_pin,
        baseline=args.baseline,
    )
    if config.bucket and not config.endpoint:
        print("quicksave bench --storage: --bucket needs --endpoint", file=sys.stderr)
        return 2
    try:
        report = run_storage_benchmark(config, log=sys.stderr)
    except ValueError as e:
        print(f"quicksave bench --storage: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quicksave bench --storage: interrupted (server stopped)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - raw or quicksave failed: say so, no traceback
        print(f"quicksave bench --storage: {why(e)}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_storage_report(report))
    return 0


__all__ = ["build_parser", "main"]
