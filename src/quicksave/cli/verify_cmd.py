"""``quicksave verify``: one checkpoint, or each checkpoint of a folder.

Given a checkpoint, it is checked byte for byte
(:func:`quicksave.loading.verify.verify_checkpoint`).
Given a folder that is not one (a run folder, a parent of runs, a bucket), each
checkpoint ``quicksave ls`` lists there is checked in turn and reported on its own
line (:mod:`quicksave.tools.verify_folder`), then a summary. Exit status: 0 all verified
intact, 1 any corrupt or not verifiable, 2 nothing to verify (or an error).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from quicksave.cli.text import print_json, say
from quicksave.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    from quicksave.loading.catalog import CheckpointInfo
    from quicksave.loading.verify_report import VerifyReport
    from quicksave.tools.verify_folder import Verdict


def cmd_verify(args: argparse.Namespace) -> int:
    from quicksave.loading.verify import verify_checkpoint
    from quicksave.tools.verify_folder import folder_checkpoints

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    progress = progress and not args.json
    infos = folder_checkpoints(args.checkpoint)
    if infos is not None:
        return _verify_folder(args.checkpoint, infos, args.json, progress, sys.stdout)
    report = verify_checkpoint(args.checkpoint, progress=progress)
    if args.json:
        print_json(report_json(report), sys.stdout)
    else:
        say_report(report, sys.stdout)
    return 0 if report.ok else 1


def report_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "path": report.path,
        "ok": report.ok,
        "files_checked": report.files_checked,
        "bytes_checked": report.bytes_checked,
        "tensors": report.tensors,
        "objects": report.objects,
        "problems": [
            {"file": p.file, "fqn": p.fqn, "kind": p.kind, "message": p.message}
            for p in report.problems
        ],
    }


def say_report(report: VerifyReport, out: TextIO) -> None:
    """``OK <path>: ...``, or a ``CORRUPT`` line per problem and ``FAILED <path>: ...``."""
    if report.ok:
        say(
            f"OK {report.path}: {report.files_checked} files, {report.bytes_checked} bytes, "
            f"{report.tensors} tensors, {report.objects} objects verified",
            out,
        )
        return
    for p in report.problems:
        say(f"CORRUPT {p}", out)
    n = len(report.problems)
    say(f"FAILED {report.path}: {n} problem{'s' if n != 1 else ''}", out)


def _verify_folder(
    root: str, infos: list[CheckpointInfo], as_json: bool, progress: bool, out: TextIO
) -> int:
    from quicksave.storage import parse_location
    from quicksave.tools.verify_folder import verify_each

    url = parse_location(root, what="checkpoint folder").url
    verdicts: list[Verdict] = []
    for v in verify_each(infos, progress):
        verdicts.append(v)
        if as_json:
            continue
        if v.report is not None:
            say_report(v.report, out)
        elif v.skipped is not None:
            say(f"SKIP {v.info.path}: {v.skipped}", out)
        else:
            say(f"FAILED {v.info.path}: {v.error}", out)
        out.flush()  # each verdict as it comes: a folder may take long
    failed = sum(v.failed for v in verdicts)
    skipped = sum(v.skipped is not None for v in verdicts)
    checked = len(verdicts) - skipped
    if checked == 0:
        raise CheckpointNotFoundError(
            f"no committed quicksave checkpoint to verify in this folder ({skipped} "
            "skipped: uncommitted or stock DCP; `quicksave ls` lists them)",
            path=url,
        )
    if as_json:
        print_json(
            {
                "path": url,
                "ok": failed == 0,
                "verified": checked,
                "failed": failed,
                "skipped": skipped,
                "checkpoints": [_verdict_json(v) for v in verdicts],
            },
            out,
        )
    else:
        say(
            f"{'FAILED' if failed else 'OK'} {url}: {checked} checkpoint"
            f"{'s' if checked != 1 else ''} verified, {failed} failed, {skipped} skipped",
            out,
        )
    return 1 if failed else 0


def _verdict_json(v: Verdict) -> dict[str, Any]:
    if v.report is not None:
        result = "ok" if v.report.ok else "corrupt"
    else:
        result = "skipped" if v.skipped is not None else "error"
    doc: dict[str, Any] = {
        "name": v.info.name,
        "path": v.info.path,
        "step": v.info.step,
        "result": result,
        "reason": v.skipped or v.error,
    }
    if v.report is not None:
        doc["report"] = report_json(v.report)
    return doc
