"""``quicksave`` command line.

Subcommands (``quicksave <cmd> --help`` for each)::

    quicksave ls ROOT [--json] [--bytes] [--depth N]   checkpoints (of each run), by step
    quicksave inspect CKPT [--json] [--allow-pickle]
    quicksave verify CKPT|FOLDER [--json] [--progress | --no-progress]
    quicksave convert CKPT OUT --to {torch,dcp,safetensors,quicksave,hf}
              [--state NAME] [--dtype DTYPE] [--max-shard-size SIZE] [--config PATH]
    quicksave demo ... / quicksave bench ...    (arguments passed through)

Exit status: 0 success; 1 ``verify`` found corruption (in any checkpoint of a folder);
2 a usage or checkpoint error (not found, not committed, unreadable ...), printed as
``quicksave: error: ...`` without a traceback. Human-readable output shows control
characters from a checkpoint (in names, dtypes, messages) as escapes (``\x1b``), never
raw (:mod:`.text`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from quicksave.cli.text import print_json as _print_json
from quicksave.cli.text import printable
from quicksave.cli.text import say as _say
from quicksave.errors import CheckpointError
from quicksave.loading.catalog import DEFAULT_DEPTH

PASS_THROUGH = {
    "demo": "run the end-to-end demo (arguments go to quicksave_tools.demo)",
    "bench": "run the benchmark suite (arguments go to quicksave_tools.bench)",
}


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, as ``ls -h``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(rows: list[list[str]], out: TextIO, right: Sequence[int] = ()) -> None:
    """Print ``rows`` (the first is the header) as aligned columns, control characters
    escaped."""
    rows = [[printable(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip(), file=out)


# --------------------------------------------------------------------------- ls
def cmd_ls(args: argparse.Namespace) -> int:
    from quicksave.loading.catalog import list_checkpoints
    from quicksave.storage import parse_location
    from quicksave.tiers.listing import memory_holdings, store_steps

    infos = list_checkpoints(args.root, depth=args.depth)
    runs = any(i.run != "." for i in infos)  # a parent of run folders: say whose each is
    # the node-memory tier of a run folder: the steps this node's memory holds of it
    held = (
        {}
        if runs
        else {h.step: h for h in memory_holdings(parse_location(args.root).url, args.memory_root)}
    )
    uploaded = set(store_steps(args.upload)) if args.upload else set()  # the store tier's
    in_folder = {i.step for i in infos if i.committed}
    only_memory = [h for step, h in held.items() if step not in in_folder]
    only_store = sorted(s for s in uploaded if s not in in_folder)

    def tiers(i) -> list[str]:  # the tiers that hold it committed
        if not i.committed:
            return []
        memory = ["memory"] * (i.step in held and held[i.step].complete)
        return ["folder", *memory] + ["object-store"] * (i.step in uploaded)

    def elsewhere(step: int) -> list[str]:  # the tiers of a step the folder lacks
        memory = ["memory"] * (step in held and held[step].complete)
        return memory + ["object-store"] * (step in uploaded)

    out = sys.stdout
    if args.json:
        _print_json(
            [
                {
                    "name": i.name,
                    "run": i.run,
                    "path": i.path,
                    "format": i.format,
                    "layout": i.layout,
                    "status": i.status,
                    "committed": i.committed,
                    "step": i.step,
                    "size": i.size,
                    "mtime": i.mtime,
                    "modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(i.mtime)),
                    "problem": i.problem,
                    "tiers": tiers(i),
                }
                for i in infos
            ]
            + [
                {
                    "name": f"step-{h.step}",
                    "step": h.step,
                    "path": h.path,
                    "committed": h.complete,
                    "status": _memory_status(h),
                    "tiers": elsewhere(h.step) if h.complete else ["memory"],
                    "ranks": h.ranks,
                    "world_size": h.world_size,
                }
                for h in only_memory
            ]
            + [
                {
                    "name": f"step-{s}",
                    "step": s,
                    "path": f"{args.upload.rstrip('/')}/step-{s}",
                    "committed": True,
                    "status": "committed",
                    "tiers": ["object-store"],
                }
                for s in only_store
                if s not in held
            ],
            out,
        )
        return 0
    if not infos and not only_memory and not only_store:
        levels = f"{args.depth} folder level{'s' if args.depth != 1 else ''}"
        _say(f"no checkpoints in {parse_location(args.root).url} ({levels} searched)", sys.stderr)
        return 0
    header = ["NAME", "STEP", "STATUS", "FORMAT", "SIZE", "MODIFIED", "TIERS"]
    rows = [["RUN"] * runs + header]
    for i in infos:
        status = i.status if i.problem is None else f"{i.status} (bad manifest: {_cut(i.problem)})"
        rows.append(
            [i.run] * runs
            + [
                i.name.rsplit("/", 1)[-1],
                "-" if i.step is None else str(i.step),
                status,
                _format_label(i.format, i.layout),
                str(i.size) if args.bytes else human_bytes(i.size),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime)),
                ",".join(tiers(i)),
            ]
        )
    for h in only_memory:
        where = ",".join(elsewhere(h.step)) if h.complete else "memory"
        rows.append(
            [f"step-{h.step}", str(h.step), _memory_status(h), "quicksave", "-", "-", where]
        )
    for s in only_store:
        if s not in held:
            rows.append([f"step-{s}", str(s), "committed", "quicksave", "-", "-", "object-store"])
    _table(rows, out, right=(1 + runs, 4 + runs))
    return 0


def _memory_status(h) -> str:
    """A memory-only step's status: committed on every rank, or on how many."""
    return "committed" if h.complete else f"partial ({h.ranks} of {h.world_size} ranks)"


def _format_label(fmt: str, layout: str) -> str:
    """``quicksave``, ``dcp``, or ``quicksave (dcp layout)`` for a quicksave checkpoint
    whose files are DCP's (FORMAT.md §8)."""
    return f"{fmt} (dcp layout)" if fmt == "quicksave" and layout == "dcp" else fmt


def _cut(text: str, width: int = 60) -> str:
    """``text`` shortened for a table cell (``quicksave ls --json`` has it whole)."""
    return text if len(text) <= width else text[: width - 1] + "…"


# --------------------------------------------------------------------------- inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    from quicksave.tools.inspect_checkpoint import inspect_checkpoint

    s = inspect_checkpoint(args.checkpoint, allow_pickle=args.allow_pickle)
    out = sys.stdout
    if args.json:
        _print_json(s.to_json(), out)
        return 0
    size = (lambda n: str(n)) if args.bytes else human_bytes
    _say(f"checkpoint:  {s.path}", out)
    _say(f"format:      {_format_label(s.format, s.layout)}", out)
    _say(f"step:        {'-' if s.step is None else s.step}", out)
    _say(f"world size:  {'-' if s.world_size is None else s.world_size}", out)
    _say(
        f"totals:      {len(s.tensors)} tensors ({size(s.tensor_bytes)}), {len(s.objects)} "
        f"objects, {len(s.files)} files ({size(s.file_bytes)})",
        out,
    )
    if s.user_metadata:
        _say(f"user metadata: {json.dumps(s.user_metadata, sort_keys=True)}", out)
    if s.tensors:
        print(file=out)
        rows = [["TENSOR", "DTYPE", "SHAPE", "BYTES", "CHUNKS"]]
        rows += [
            [t.fqn, t.dtype, str(list(t.shape)), size(t.bytes), str(t.chunks)] for t in s.tensors
        ]
        _table(rows, out, right=(3, 4))
    if s.objects:
        print(file=out)
        rows = [["OBJECT", "TYPE", "VALUE"]] + [[o.fqn, o.type, o.preview] for o in s.objects]
        _table(rows, out)
    return 0


# --------------------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    from quicksave.cli.verify_cmd import cmd_verify as run  # one checkpoint, or each of a folder

    return run(args)


# --------------------------------------------------------------------------- convert
def cmd_convert(args: argparse.Namespace) -> int:
    from quicksave.tools.convert import convert

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    hf_options = {
        "--state": args.state,
        "--dtype": args.dtype,
        "--max-shard-size": args.max_shard_size,
        "--config": args.config,
    }
    if args.to == "hf":
        written = _export_hf(args, progress)
    elif given := [k for k, v in hf_options.items() if v is not None]:
        raise CheckpointError(f"{', '.join(given)}: only with --to hf")
    else:
        written = convert(args.checkpoint, args.out, args.to, progress=progress)
    _say(f"wrote {written} ({args.to})", sys.stdout)
    return 0


def _export_hf(args: argparse.Namespace, progress: bool) -> str:
    from quicksave.format.hf_layout import DEFAULT_MAX_SHARD_BYTES, parse_size
    from quicksave.tools.hf_export import export_hf

    size = args.max_shard_size
    return export_hf(
        args.checkpoint,
        args.out,
        state=args.state,
        dtype=args.dtype,
        max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if size is None else parse_size(size),
        config=args.config,  # a path: read by export_hf, as its config= takes it
        progress=progress,
    )


# --------------------------------------------------------------------------- demo, bench
def run_pass_through(name: str, rest: list[str]) -> int:
    """Run ``quicksave_tools.<name>.main(rest)``, imported only now (it may be absent).

    The command line is the one place where the library reaches the programs shipped
    beside it (:mod:`quicksave_tools`), by name and on demand."""
    module_name = f"quicksave_tools.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name in (module_name, "quicksave_tools"):
            raise CheckpointError(
                f"`quicksave {name}` is not available in this installation"
            ) from None
        raise CheckpointError(
            f"`quicksave {name}` needs the module {e.name!r}, which is not installed"
        ) from None
    entry: Callable[[list[str]], Any] | None = getattr(module, "main", None)
    if entry is None:
        raise CheckpointError(
            f"`quicksave {name}` is not available in this installation "
            f"({module_name} has no main())"
        )
    rc = entry(rest)
    return rc if isinstance(rc, int) else 0


# --------------------------------------------------------------------------- parser
def _progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    g.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show a progress bar"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``quicksave`` command (``demo``/``bench`` listed for
    help only: their arguments are passed through unparsed)."""
    from quicksave import __version__

    parser = argparse.ArgumentParser(
        prog="quicksave",
        description="Inspect, verify and convert quicksave checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"quicksave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ls",
        help="list the checkpoints in a folder (or in each run folder of it), by step",
        description="List the checkpoints in ROOT (or ROOT itself if it is one), and in "
        "the folders below it: given a parent of run folders or a bucket, each run's "
        "checkpoints (a RUN column names the folder).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--depth",
        type=int,
        default=DEFAULT_DEPTH,
        help=f"folder levels below ROOT searched for checkpoints (default {DEFAULT_DEPTH}: "
        "ROOT/RUN/step-N)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--bytes", action="store_true", help="exact sizes in bytes")
    p.add_argument(
        "--memory-root",
        default="/dev/shm",
        help="the tmpfs of the memory tier (MemoryTierConfig.root), whose steps of ROOT "
        "this node holds are listed too (TIERS column; default /dev/shm)",
    )
    p.add_argument(
        "--upload",
        metavar="URL",
        help="the object-store tier's URL (UploadTierConfig.url), whose committed steps are "
        "listed too (TIERS column: object-store)",
    )
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "inspect",
        help="show the tensors and values in a checkpoint",
        description="Show the tensors (fqn, dtype, shape, bytes, chunks) and values of a "
        "checkpoint, from its manifest only (nothing is unpickled; a stock DCP "
        "directory's .metadata pickle is read by a restricted unpickler).",
    )
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--bytes", action="store_true", help="exact sizes in bytes")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle a stock DCP directory's .metadata without restriction (runs code "
        "from the file: only for trusted checkpoints); without it only DCP's metadata "
        "classes are admitted",
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check every byte of a checkpoint (or of each checkpoint in a folder)",
        description="Check every byte of a quicksave checkpoint: manifest checksum, file "
        "sizes, header, chunk checksums, zero padding, no extra files. Given a folder "
        "of checkpoints (a run folder, a parent of runs, a bucket), each checkpoint "
        "`quicksave ls` lists is checked and reported in turn (uncommitted and stock "
        "DCP ones are skipped, and said so). Exit 0 if intact, 1 if any is corrupt "
        "or cannot be verified, 2 if there is no committed checkpoint to verify.",
    )
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _progress_flags(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "convert",
        help="write a checkpoint as torch.save, stock DCP, safetensors or Hugging Face",
        description="Write the full (unsharded) state of a quicksave checkpoint to OUT, which "
        "must not exist: one torch.save file, a stock DCP directory, one "
        "safetensors file, or a quicksave copy. --to hf writes the model only, as a "
        "directory that Hugging Face's from_pretrained loads (sharded safetensors and "
        "model.safetensors.index.json, keys without the state's name).",
    )
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("out", metavar="OUT")
    p.add_argument(
        "--to", required=True, choices=("torch", "dcp", "safetensors", "quicksave", "hf")
    )
    p.add_argument(
        "--state",
        metavar="NAME",
        help="hf: the state that holds the model (default: the one the manager recorded, "
        "or 'model')",
    )
    p.add_argument("--dtype", metavar="DTYPE", help="hf: cast floating tensors (e.g. bfloat16)")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="hf: the most bytes per shard (e.g. 5GB, 500MiB; default 5GB)",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="hf: a model config to write as config.json: a JSON file, or a model "
        "directory holding config.json",
    )
    _progress_flags(p)
    p.set_defaults(func=cmd_convert)

    for name, text in PASS_THROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``quicksave`` command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 ``verify`` found corruption, 2 an error.

    Example::

        main(["verify", "ckpt/step-100"])
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list[:1] == ["bench"] and "--storage" in args_list[1:]:
            rest = [a for a in args_list[1:] if a != "--storage"]
            return run_pass_through("bench.storage", rest)  # S3 benchmark (SeaweedFS)
        if args_list and args_list[0] in PASS_THROUGH:
            return run_pass_through(args_list[0], args_list[1:])
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as e:  # --help, --version, usage errors
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        return args.func(args)
    except CheckpointError as e:
        _say(f"quicksave: error: {e}", sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quicksave: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `quicksave ls | head`: the reader left, not an error
        try:  # keep the interpreter's final flush from failing again (Python docs' recipe)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except OSError as e:  # e.g. a folder that cannot be listed: a message, not a traceback
        where = f" [path={e.filename}]" if e.filename else ""
        _say(f"quicksave: error: {e.strerror or e}{where}", sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
