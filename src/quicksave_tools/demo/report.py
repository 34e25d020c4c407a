"""The demo's report: the summary table and the checkpoint listing.

Reads the JSON results the training children wrote (see :mod:`quicksave_tools.demo.train`);
never touches a checkpoint's contents, only names, commit status and sizes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TextIO

from quicksave.commit import CheckpointKind, classify

if TYPE_CHECKING:
    from quicksave_tools.demo.config import DemoConfig

RUNS = ("reference", "interrupted", "resumed")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _mean_max(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"mean {sum(values) / len(values):.4f}, max {max(values):.4f}"


def _per_checkpoint(record: dict[str, Any]) -> str:
    """One checkpoint's costs from the manager's metrics record."""
    status = record.get("status") or "committed"
    return (
        f"blocking {_s(record.get('blocking_s'))} s, staging {_s(record.get('staging_s'))} s, "
        f"durable {_s(record.get('durable_s'))} s"
        + ("" if status == "committed" else f" ({status.replace('_', ' ')})")
    )


def _n_full(result: dict[str, Any]) -> int:
    return sum(c.get("kind", "full") == "full" for c in result["checkpoints"])


def compare(reference: dict[str, Any], resumed: dict[str, Any]) -> dict[str, bool]:
    """Which of the final states agree exactly (floats compared with ``==``).

    Example:
        >>> compare({"final_loss": 1.5, "losses": [1.5], "params_sha256": "a",
        ...          "optimizer_sha256": "b"},
        ...         {"final_loss": 1.5, "losses": [1.5], "params_sha256": "a",
        ...          "optimizer_sha256": "b"})["bit_exact"]
        True
    """
    checks = {
        "final_loss": reference["final_loss"] == resumed["final_loss"],
        "losses": reference["losses"] == resumed["losses"],
        "params": reference["params_sha256"] == resumed["params_sha256"],
        "optimizer": reference["optimizer_sha256"] == resumed["optimizer_sha256"],
    }
    checks["bit_exact"] = all(checks.values())
    return checks


def summarize(
    cfg: DemoConfig, results: dict[str, dict[str, Any]], wall: dict[str, float], out: TextIO
) -> bool:
    """Print the summary table of a finished demo.

    Args:
        cfg: the demo settings.
        results: each run's result (see :func:`quicksave_tools.demo.train.train`), by run name;
            the interrupted one also has ``killed_at``, ``committed_at_kill`` and
            ``leftovers_at_kill``.
        wall: wall seconds of each run.
        out: where to print.

    Returns:
        Whether the resumed run is bit-exact with the reference.
    """
    ref, intr, res = (results[r] for r in RUNS)
    saves = [c for r in (intr, res) for c in r["checkpoints"] if c.get("kind", "full") == "full"]
    blocking = [c["blocking_s"] for c in saves]
    nbytes = [c["bytes"] for c in saves]
    checks = compare(ref, res)
    m = ref["model"]
    n_ref = len(ref["losses"])
    same_steps = sum(a == b for a, b in zip(ref["losses"], res["losses"], strict=False))
    rows: list[tuple[str, str]] = [
        ("model", f"TinyLM {ref['num_params'] / 1e6:.2f} M params: {m['n_layers']} layers, "
                  f"d {m['d_model']}, {m['n_heads']} heads, ctx {m['context']}, "
                  f"vocab {m['vocab_size']}"),
        ("data", f"{ref['corpus_chars'] / 1e3:.0f} K chars of shipped text, char-level"),
        ("steps", f"{cfg.steps} (checkpoint every {cfg.interval}, keep "
                  f"{cfg.keep or 'all'}, async_mode {cfg.async_mode})"),
        ("checkpoints written", f"{len(saves)} ({_n_full(intr)} before the kill, "
                                f"{_n_full(res)} after the resume)"),
    ]  # fmt: skip
    if saves:
        durable = [c.get("durable_s") for c in saves if c.get("durable_s") is not None]
        rows += [
            ("blocking s / ckpt", _mean_max(blocking)),
            ("staging s / ckpt", _mean_max(
                [c["staging_s"] for c in saves if c.get("staging_s") is not None])),
            ("durable s / ckpt", _mean_max(durable) + " (time until committed)"),
            ("bytes / ckpt", _fmt_bytes(sum(nbytes) / len(nbytes))),
        ]  # fmt: skip
        if durable and len(durable) == len(saves):
            rows.append(("write GB/s", f"{sum(nbytes) / max(sum(durable), 1e-9) / 1e9:.3f} "
                                       "(bytes / time until committed)"))  # fmt: skip
        else:
            rows.append(("write GB/s", f"{sum(nbytes) / max(sum(blocking), 1e-9) / 1e9:.3f} "
                                       "(bytes / blocking time)"))  # fmt: skip
        rows += [
            (f"  step {c['step']:>5}", _per_checkpoint(c))
            for run in (intr, res)
            for c in run["checkpoints"]
            if c.get("kind", "full") == "full"
        ]
    leftovers = intr["leftovers_at_kill"]
    rows += [
        ("restore s", f"{res['restore_s']:.4f}" if res["restore_s"] is not None else "n/a"),
        ("kill step", f"{intr['killed_at']} (SIGKILL; committed then: "
                      f"{', '.join(intr['committed_at_kill']) or 'none'}; half-written: "
                      f"{', '.join(leftovers) or 'none'})"),
        ("resumed from step", str(res["resumed_from"])),
        ("final loss", f"reference {ref['final_loss']!r} | resumed {res['final_loss']!r}"),
        ("loss history", f"{same_steps}/{n_ref} steps identical"
                         + ("" if len(res["losses"]) == n_ref else
                            f" (lengths {n_ref} vs {len(res['losses'])})")),
        ("params sha256", f"reference {ref['params_sha256'][:16]} | resumed "
                          f"{res['params_sha256'][:16]}"),
        ("optimizer sha256", f"reference {ref['optimizer_sha256'][:16]} | resumed "
                             f"{res['optimizer_sha256'][:16]}"),
        ("wall s", ", ".join(f"{r} {wall[r]:.1f}" for r in RUNS)),
        ("bit-exact", "yes" if checks["bit_exact"] else
         "no (" + ", ".join(k for k, ok in checks.items() if not ok and k != "bit_exact")
         + " differ)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\nquicksave demo: summary", file=out)
    print("-" * 72, file=out)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}", file=out)
    print("-" * 72, file=out)
    return checks["bit_exact"]


def list_checkpoints(folder: str, out: TextIO) -> None:
    """Print every entry of the checkpoint folder with its commit status and size.

    Args:
        folder: the manager's checkpoint folder.
        out: where to print.
    """
    print(f"\ncheckpoints in {folder}:", file=out)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not names:
        print("  (none)", file=out)

    def order(name: str) -> tuple[str, int]:
        head, _, num = name.rpartition("-")
        return (head, int(num)) if num.isdigit() else (name, -1)

    for name in sorted(names, key=order):
        path = os.path.join(folder, name)
        kind = classify(path)
        status = "committed" if kind is CheckpointKind.QUICKSAVE else kind.value
        files = len(os.listdir(path)) if os.path.isdir(path) else 1
        print(
            f"  {name:<24} {status:<12} {_dir_size(path) / 1e6:>8.2f} MB  {files} files", file=out
        )
