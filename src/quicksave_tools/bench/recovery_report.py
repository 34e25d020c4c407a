"""The report of ``quicksave bench --recovery``: one shape's results summarized
(:func:`summarize`: medians over the fresh jobs, the ratios side by side) and the short
text table printed on stderr (:func:`format_table`).

Ratios (``ratios``; a figure is ``None`` where a side is unavailable):

* ``vs_floor`` — each restore's time to fully restored and time to first step over its
  tier's floor: local folders over the cold 4-thread ``pread``, the memory tier over the
  memory floor (copy + xxh3), the restore from a peer's replica over the gloo
  send/recv of the same bytes (+ xxh3), the object store over the parallel GETs;
* ``peer_bytes`` — what the peer restore moved beside its floor: the state's bytes of
  the rank that fetched, its snapshot's file bytes, what its replication sent, and the
  floor's bytes (the same as the state's, else a problem);
* ``memory_speedup`` — the memory tier's time to fully restored against quicksave's from
  local disk and from the object store (how many times faster);
* ``first_step_starts_over_fully_restored`` — per restore, when the first training
  step starts (``load()`` returned: the model's weights are in place, its forward
  begins; optimizer state may still stream in) over the time to fully restored;
* ``first_step_over_fully_restored`` — per restore, the first step's end instead (its
  start plus its extra time over a steady step: the optimizer step waits for the state
  still streaming, so this is at least about the time to fully restored);
* the loop part (:func:`summarize_loops`, per loop shape): ``extra_s_per_step``
  against none, ``over_floor`` (the memory tier's extra per step over the floor copy's
  at the same interval) and ``step_over_floor_step`` (its whole step over the floor's).
"""

from __future__ import annotations

import statistics
from typing import Any

FLOOR_OF = {  # restore method -> (floor, its figure)
    "quicksave-disk": ("disk", "pread_s"),
    "quicksave-disk-whole": ("disk", "pread_s"),
    "dcp": ("disk", "pread_s"),
    "torch_checkpointing": ("disk", "pread_s"),
    "quicksave-memory": ("memory", "seconds"),
    "quicksave-peer": ("peer", "seconds"),
    "quicksave-object-store": ("object_store", "seconds"),
}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _restore(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's fresh jobs summarized (or why it has none)."""
    failed = [r["failed"] for r in rows if "failed" in r]
    if failed:
        return {"failed": failed[0]}
    if any("unavailable" in r for r in rows):
        return {"unavailable": next(r["unavailable"] for r in rows if "unavailable" in r)}
    full = [r for r in rows if r.get("pass") == "full"]
    first = [r for r in rows if r.get("pass") == "first_step"]
    out: dict[str, Any] = {
        "jobs": len(rows),
        "restore_s": _median(rows, "restore_s"),
        "setup_s": _median(rows, "setup_s"),
        "fully_restored_s": _median(full, "fully_restored_s"),
        # the first step starts (its forward) when load() returns; it ends once the
        # optimizer step had every state it waits for (its extra time over a steady one)
        "first_step_starts_s": _median(first, "restore_s"),
        "time_to_first_step_s": _median(first, "time_to_first_step_s"),
        "first_step_extra_s": _median(first, "first_step_extra_s"),
        "steady_step_s": _median(first, "steady_step_s"),
        "bit_exact": bool(full) and all(r.get("bit_exact") for r in full),
        "wrong": sorted({w for r in full for w in r.get("wrong", [])})[:5],
        "cached_before": max((r.get("cached_before") or 0.0 for r in rows), default=None),
    }
    tiers = sorted({str(r["tier"]) for r in rows if r.get("tier") is not None})
    if tiers:
        out["tiers"] = tiers
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _floor_s(floors: dict[str, Any], name: str, key: str) -> float | None:
    value = floors.get(name, {}).get(key)
    return value if isinstance(value, (int, float)) else None


def _paired_extra(runs: dict[str, list[dict[str, Any]]], name: str, steps: int) -> float | None:
    """``name``'s extra seconds per step over no checkpoint: the median over the rounds
    of its loop's time less the same round's loop without checkpoints (a round's noise
    hits both)."""
    pairs = zip(runs.get(name, []), runs.get("none", []), strict=False)
    diffs = [(a["loop_s"] - b["loop_s"]) / steps for a, b in pairs
             if "loop_s" in a and "loop_s" in b]  # fmt: skip
    return statistics.median(diffs) if diffs else None


def _shape_loops(loops: dict[str, Any], steps: int, every: int) -> dict[str, Any]:
    if "unavailable" in loops:
        return loops
    runs = loops["runs"]
    names = [n for n in runs if n != "none"]
    per_step = {n: _median(rows, "loop_s") for n, rows in runs.items()}
    per_step = {n: None if v is None else v / steps for n, v in per_step.items()}
    extra = {n: _paired_extra(runs, n, steps) for n in names}

    def memory_over_floor(figures: dict[str, float | None]) -> dict[str, float | None]:
        return {
            f"every-{k}": _ratio(figures.get(f"memory-every-{k}"), figures.get(f"floor-every-{k}"))
            for k in (1, every)
        }

    return {
        **loops,
        "step_s": per_step,
        "extra_s_per_step": extra,
        "over_floor": memory_over_floor(extra),
        "step_over_floor_step": memory_over_floor(per_step),
    }


def summarize_loops(loops: dict[str, Any]) -> dict[str, Any]:
    """The loop part per shape: each loop's median seconds per step (``step_s``), its
    extra per step over no checkpoint (``extra_s_per_step``), the memory tier's extra
    over the floor copy's at the same interval (``over_floor``) and its whole step over
    the floor's (``step_over_floor_step``); ``problems``: loops that failed."""
    if not loops:
        return loops
    steps, every = loops["steps"], loops["every"]
    shapes = {s: _shape_loops(r, steps, every) for s, r in loops["shapes"].items()}
    problems = [
        f"loop {shape} {name}: {row['failed']}"
        for shape, r in shapes.items()
        for name, rows in r.get("runs", {}).items()
        for row in rows
        if "failed" in row
    ]
    return {**loops, "shapes": shapes, "problems": problems}


def summarize(
    shape: str,
    saved: dict[str, Any],
    floors: dict[str, Any],
    restores: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """One shape's part of the report (see the module doc). ``problems`` lists the
    restores that failed or were not bit-exact (the exit code is 1 if any)."""
    summary = {m: _restore(rows) for m, rows in restores.items()}
    vs_floor: dict[str, dict[str, float | None]] = {}
    for method, row in summary.items():
        if "fully_restored_s" not in row:
            continue
        floor = _floor_s(floors, *FLOOR_OF[method])
        vs_floor[method] = {
            "fully_restored": _ratio(row["fully_restored_s"], floor),
            "first_step": _ratio(row["time_to_first_step_s"], floor),
        }
    memory = summary.get("quicksave-memory", {}).get("fully_restored_s")
    ratios = {
        "vs_floor": vs_floor,
        "memory_speedup": {
            "vs_disk": _ratio(summary.get("quicksave-disk", {}).get("fully_restored_s"), memory),
            "vs_object_store": _ratio(
                summary.get("quicksave-object-store", {}).get("fully_restored_s"), memory
            ),
        },
        "first_step_over_fully_restored": {
            m: _ratio(r.get("time_to_first_step_s"), r.get("fully_restored_s"))
            for m, r in summary.items()
            if "fully_restored_s" in r
        },
        "first_step_starts_over_fully_restored": {
            m: _ratio(r.get("first_step_starts_s"), r.get("fully_restored_s"))
            for m, r in summary.items()
            if "fully_restored_s" in r
        },
    }
    problems = [f"{m}: {r['failed']}" for m, r in summary.items() if "failed" in r]
    problems += [
        f"{m}: not bit-exact ({', '.join(r['wrong']) or 'digests differ between reads'})"
        for m, r in summary.items()
        if "bit_exact" in r and not r["bit_exact"]
    ]
    for method, tier in (("quicksave-memory", "memory"), ("quicksave-peer", "peer")):
        tiers = summary.get(method, {}).get("tiers", [tier])
        if tiers != [tier]:
            problems.append(f"{method}: restored from {', '.join(tiers)}, not {tier}")
    peer = saved["saves"].get("quicksave-peer", {})
    if "state_bytes" in peer:
        ratios["peer_bytes"] = {
            "state": peer["state_bytes"],
            "snapshot_files": peer["snapshot_bytes"],
            "replica_sent": peer["replica_sent_bytes"],
            "floor": floors.get("peer", {}).get("bytes"),
        }
        if ratios["peer_bytes"]["floor"] not in (None, peer["state_bytes"]):
            problems.append(
                f"peer floor sent {ratios['peer_bytes']['floor']} bytes, the peer "
                f"restore's state holds {peer['state_bytes']}"
            )
    return {
        "shape": shape,
        "bytes": saved["bytes"],
        "tensors": saved["tensors"],
        "saves": saved["saves"],
        "floors": floors,
        "restores": summary,
        "raw_restores": restores,
        "ratios": ratios,
        "problems": problems,
    }


def _s(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _x(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "-"


def _why(row: dict[str, Any]) -> str | None:
    for key in ("failed", "unavailable"):
        if key in row:
            return f"{key}: {str(row[key])[:90]}"
    return None


def format_table(report: dict[str, Any]) -> str:
    """The report as a short text table (seconds; ratios as ``x``; ``setup``: building
    the method's loader or manager before the restore, not counted in it)."""
    lines = [
        f"{report['cpus']} CPUs, load average {report['load_average']:.2f}, torch "
        f"{report['torch']}; object store: {report['object_store']}",
    ]
    for shape in report["shapes"]:
        if "failed" in shape:
            lines.append(f"{shape['shape']}: failed: {shape['failed']}")
            continue
        lines += ["", f"{shape['shape']}: {shape['bytes'] / 1e9:.2f} GB, {shape['tensors']} "
                  "tensors (model + AdamW)", f"{'floor':<34}{'seconds':>9}"]  # fmt: skip
        f = shape["floors"]
        for label, name, key in (
            ("memory: copy + xxh3", "memory", "seconds"),
            ("disk: 4-thread pread, cold", "disk", "pread_s"),
            ("disk: 4-thread O_DIRECT", "disk", "direct_s"),
            ("peer: gloo send/recv (+xxh3)", "peer", "seconds"),
            ("object store: 8 boto3 GETs", "object_store", "seconds"),
        ):
            why = _why(f.get(name, {}))
            lines.append(f"{label:<34}{why or _s(f.get(name, {}).get(key)):>9}")
        lines.append(
            f"{'restore':<24}{'fully':>8}{'1st step':>9}{'vs floor':>10}{'1st/fully':>10}"
            f"{'setup':>8}  bit-exact  tier"
        )
        lines.append(
            f"{'':<24}{'':>8}{'starts':>9}{'':>10}{'starts':>10}   (1st step: its start; "
            "the end of it as 'first_step_over_fully_restored' in the JSON)"
        )
        ratios = shape["ratios"]
        vs, fs = ratios["vs_floor"], ratios["first_step_starts_over_fully_restored"]
        for m, r in shape["restores"].items():
            why = _why(r)
            if why:
                lines.append(f"{m:<24}{why}")
                continue
            lines.append(
                f"{m:<24}{_s(r['fully_restored_s']):>8}{_s(r['first_step_starts_s']):>9}"
                f"{_x(vs.get(m, {}).get('fully_restored')):>10}{_x(fs.get(m)):>10}"
                f"{_s(r['setup_s']):>8}"
                f"  {'yes' if r['bit_exact'] else 'NO':<9}  {','.join(r.get('tiers', [])) or '-'}"
            )
        speed = shape["ratios"]["memory_speedup"]
        lines.append(
            f"memory tier faster than disk {_x(speed['vs_disk'])}, than object store "
            f"{_x(speed['vs_object_store'])}"
        )
        for p in shape["problems"]:
            lines.append(f"PROBLEM {p}")
    return "\n".join(lines + _loop_lines(report.get("loop", {})))


def _loop_lines(loop: dict[str, Any]) -> list[str]:
    if not loop:
        return []
    lines = ["", f"loop: s/step, median of {loop['repeats']} round(s) of {loop['steps']} steps; "
             "memory tier over floor: extra per step, and whole step"]  # fmt: skip
    for shape, r in loop["shapes"].items():
        if "unavailable" in r:
            lines.append(f"{shape:<12}{_why(r)}")
            continue
        parts = [f"{k} {_s(v)}" for k, v in r["step_s"].items()]
        lines.append(f"{shape:<12}" + ", ".join(parts))
        over = [f"{k} {_x(v)}" for k, v in r["over_floor"].items()]
        step = [f"{k} {_x(v)}" for k, v in r["step_over_floor_step"].items()]
        lines.append(f"{'':<12}extra over floor: {', '.join(over)}; step over floor step: "
                     + ", ".join(step))  # fmt: skip
    lines += [f"PROBLEM {p}" for p in loop["problems"]]
    return lines
