"""Incremental saves side by side in ``quicksave bench --training`` (:mod:`.training`):
per shape, each incremental method (``quicksave-incremental``, ``-counters``,
``-hashed``) against the full save of the same configuration (``quicksave-process``)
and against the save of the trainable state alone (``quicksave-trainable``), where
those ran too, as ratios with the issue's targets:

* bytes on disk per later save, full / incremental: ≥ 5× on the ``embedding-sparse``
  shapes;
* loop overhead per checkpoint, incremental / full: ≤ 1.05× on a shape whose every
  tensor changes at every step (nothing to skip: the cost of looking);
* loop overhead per checkpoint, incremental / trainable state alone: ≤ 1.2×, over all
  checkpoints and over the later ones (the first incremental save writes the whole
  base, once per run: over a bench's few checkpoints it weighs as much as the rest);
  and bytes on disk per later save / (the trainable state + the incremental
  manifest): ≤ 1.1× (a shape with frozen state: ``lora``); beside them, without a
  target, the loop time around each later save against the same run's own steps (no
  drift between runs) and the saves' own CPU, trainer + writer: what decides the loop
  ratio where the host's noise hides it (a loop ratio within the spread of the run's
  loops, without checkpoints and each compared method's own repeats, is reported
  *unresolved*, not met or missed);
* bytes on disk per later save / bytes of the state that changed since the previous
  save (shapes that count their changed rows; no target: what block tracking costs
  beyond the rows).

Pure computation on the shape reports of :mod:`.training_summary`, and their text.
"""

from __future__ import annotations

from typing import Any

from quicksave_tools.bench.savers import INCREMENTAL, TRAINABLE
from quicksave_tools.bench.shapes import SHAPES
from quicksave_tools.bench.training_summary import IN_RUN_WINDOW

__all__ = ["FULL", "incremental_rows", "incremental_table"]

FULL = "quicksave-process"  # the same configuration, every byte at every save
INCREMENTAL_METHODS = (INCREMENTAL, INCREMENTAL + "-counters", INCREMENTAL + "-hashed")
BYTES_FEWER = 5.0  # full / incremental bytes per save, on the sparse embedding shapes
SAME_OVERHEAD = 1.05  # incremental / full overhead where every tensor changes
TRAINABLE_OVERHEAD = 1.2  # incremental / trainable-state overhead (lora)
TRAINABLE_BYTES = 1.1  # incremental bytes / (trainable state + manifest) (lora)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _save_cpu_s(m: dict[str, Any]) -> float | None:
    """A method's CPU per save from its saves' own metrics (trainer + writer medians)."""
    trainer, writer = m.get("save_trainer_cpu_s_median"), m.get("save_worker_cpu_s_median")
    return trainer + writer if trainer is not None and writer is not None else None


def _row(
    shape: str,
    method: str,
    what: str,
    values: tuple[float | None, float | None],
    unit: str,
    cmp: str,
    limit: float | None,
    timing: bool = False,
    noise: float | None = None,
) -> dict[str, Any]:
    """One comparison: ``values`` (this, the other), their ratio, its target ``cmp``
    ``limit`` (None: shown, not checked). A timing ratio of a non-positive overhead is
    not a measurement (the machine's load moved), and never meets its target. A timing
    whose distance from its target (this against ``limit`` × the other) is within the
    host's ``noise`` (seconds per checkpoint: :func:`_noise_s`) is *unresolved*: neither
    met nor not (``met`` None, ``unresolved`` True), whatever the ratio reads."""
    value = _ratio(*values)
    this, other = values
    unresolved = False
    if value is None or limit is None or this is None or other is None:
        met = None
    elif timing and not (this > 0 and other > 0):
        met = False
    elif timing and noise is not None and abs(this - limit * other) < noise:
        met, unresolved = None, True
    else:
        met = value >= limit if cmp == "≥" else value <= limit
    return {
        "shape": shape,
        "method": method,
        "what": what,
        "values": list(values),
        "unit": unit,
        "value": value,
        "cmp": cmp,
        "limit": limit,
        "met": met,
        "unresolved": unresolved,
        "noise_s": noise if timing else None,
    }


def _noise_s(report: dict[str, Any], m: dict[str, Any], other: dict[str, Any]) -> float | None:
    """What this host's noise is worth per checkpoint of ``m`` set against ``other``:
    the widest spread (max − min) of the same run's loops, those without checkpoints
    and each method's own repeats, over ``m``'s checkpoints (None: no two loops of any).
    An overhead per checkpoint is a loop's time less theirs, over the checkpoints: a
    difference smaller than this is not measured."""
    n = m.get("checkpoints")
    groups = (report.get("baseline", {}).get("loop_s"), m.get("loop_s"), other.get("loop_s"))
    spreads = [max(g) - min(g) for g in groups if g and len(g) >= 2]
    if not spreads or not n:
        return None
    return max(spreads) / n


def incremental_rows(shape: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """The side-by-side rows of one shape's report (empty: no incremental method, or
    nothing to set it against)."""
    ms = report["methods"]
    ok = {n: m for n, m in ms.items() if "loop_median_s" in m}
    full, trainable = ok.get(FULL), ok.get(TRAINABLE)
    every = SHAPES[shape].every_tensor_changes if shape in SHAPES else True
    sparse = shape.startswith("embedding-sparse")
    rows = []
    for name in INCREMENTAL_METHODS:
        m = ok.get(name)
        if m is None:
            continue
        later, over = m.get("disk_later_median_bytes"), m.get("overhead_per_checkpoint_s")
        if full is not None:
            rows.append(
                _row(
                    shape,
                    name,
                    f"bytes on disk per later save: {FULL} / this",
                    (full.get("disk_later_median_bytes"), later),
                    "MB",
                    "≥",
                    BYTES_FEWER if sparse else None,
                )
            )
            rows.append(
                _row(
                    shape,
                    name,
                    f"loop overhead per checkpoint: this / {FULL}",
                    (over, full.get("overhead_per_checkpoint_s")),
                    "s",
                    "≤",
                    SAME_OVERHEAD if every else None,
                    timing=True,
                    noise=_noise_s(report, m, full),
                )
            )
        state = report.get("state", {}).get("bytes")
        frozen = bool(state and m.get("trainable_bytes") and m["trainable_bytes"] < state)
        if trainable is not None and frozen:  # (else the trainable state is the state)
            noise = _noise_s(report, m, trainable)
            rows.append(
                _row(
                    shape,
                    name,
                    f"loop overhead per checkpoint: this / {TRAINABLE}",
                    (over, trainable.get("overhead_per_checkpoint_s")),
                    "s",
                    "≤",
                    TRAINABLE_OVERHEAD,
                    timing=True,
                    noise=noise,
                )
            )
            rows.append(
                _row(
                    shape,
                    name,
                    "loop overhead per later checkpoint (after the first save, which writes "
                    f"the whole base): this / {TRAINABLE}",
                    (
                        m.get("steady_overhead_per_checkpoint_s"),
                        trainable.get("steady_overhead_per_checkpoint_s"),
                    ),
                    "s",
                    "≤",
                    TRAINABLE_OVERHEAD,
                    timing=True,
                    noise=noise,
                )
            )
            rows.append(
                _row(
                    shape,
                    name,
                    f"loop time around a later save (its step and the {IN_RUN_WINDOW - 1} after) "
                    f"beyond the same run's steps without one: this / {TRAINABLE}",
                    (
                        m.get("in_run_later_save_extra_median_s"),
                        trainable.get("in_run_later_save_extra_median_s"),
                    ),
                    "s",
                    "≤",
                    None,
                )
            )
            rows.append(
                _row(
                    shape,
                    name,
                    f"CPU per later save, trainer + writer (save metrics): this / {TRAINABLE}",
                    (_save_cpu_s(m), _save_cpu_s(trainable)),
                    "s",
                    "≤",
                    None,
                )
            )
            state, manifest = m.get("trainable_bytes"), m.get("manifest_later_median_bytes")
            rows.append(
                _row(
                    shape,
                    name,
                    "bytes on disk per later save / (trainable state + this manifest)",
                    (later, state + manifest if state and manifest else None),
                    "MB",
                    "≤",
                    TRAINABLE_BYTES,
                )
            )
        if m.get("changed_later_median_bytes"):
            rows.append(
                _row(
                    shape,
                    name,
                    "bytes on disk per later save / bytes of the state that changed "
                    f"(median {m['rows_touched_later_median']:.0f} rows looked up between saves)",
                    (later, m["changed_later_median_bytes"]),
                    "MB",
                    "≤",
                    None,
                )
            )
    return rows


def _value(x: float | None, unit: str) -> str:
    if x is None:
        return "–"
    return f"{x / 1e6:.2f} MB" if unit == "MB" else f"{x:.3f} s"


def incremental_table(rows: list[dict[str, Any]], block_kb: int | None) -> list[str]:
    """The rows as a Markdown table (empty without rows), with the block size used."""
    if not rows:
        return []
    block = f"{block_kb} KiB" if block_kb else "4096 KiB (the default)"
    lines = [
        f"Incremental saves side by side (IncrementalConfig.block_bytes {block}; medians "
        "over repeats, later saves: all but the first):",
        "",
        "| shape | method | ratio | values (this / other) | value | target | met |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        a, b = (_value(x, r["unit"]) for x in r["values"])
        value = "–" if r["value"] is None else f"{r['value']:.2f}×"
        limit = "–" if r["limit"] is None else f"{r['cmp']} {r['limit']}×"
        met = {None: "–", True: "yes", False: "NO"}[r["met"]]
        if r.get("unresolved"):
            met = f"unresolved (host noise ±{r['noise_s']:.3f} s per checkpoint)"
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['what']} | {a} / {b} | {value} | {limit} "
            f"| {met} |"
        )
    return lines
