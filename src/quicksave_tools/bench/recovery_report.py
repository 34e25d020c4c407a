"""The report of ``quicksave bench --recovery``: one shape's results summarized
(:func:`summarize`: medians over the fresh jobs, the ratios side by side) and the short
text table printed on stderr (:func:`format_table`).

Ratios (``ratios``; a figure is ``None`` where a side is unavailable):

* ``vs_floor`` — each restore's time to fully restored and time to first step over its
  tier's floor: local folders over the cold 4-thread ``pread``, the memory tier over the
  memory floor (copy + xxh3), the object store over the parallel GETs;
* ``memory_speedup`` — the memory tier's time to fully restored against quicksave's from
  local disk and from the object store (how many times faster);
* ``first_step_over_fully_restored`` — per restore;
* the loop part's ``extra_s_per_step`` against none and ``over_floor``: the memory
  tier's extra per step over the floor copy's at the same interval.
"""

from __future__ import annotations

import statistics
from typing import Any

FLOOR_OF = {  # restore method -> (floor, its figure)
    "quicksave-disk": ("disk", "pread_s"),
    "dcp": ("disk", "pread_s"),
    "torch_checkpointing": ("disk", "pread_s"),
    "quicksave-memory": ("memory", "seconds"),
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


def _loops(loops: dict[str, Any]) -> dict[str, Any]:
    if not loops or "unavailable" in loops:
        return loops
    runs, steps = loops["runs"], loops["steps"]
    base = runs.get("none", {}).get("loop_s")
    extra: dict[str, float | None] = {}
    for name, r in runs.items():
        if name != "none" and base is not None and "loop_s" in r:
            extra[name] = (r["loop_s"] - base) / steps
    n = loops["every"]
    over = {
        f"every-{k}": _ratio(extra.get(f"memory-every-{k}"), extra.get(f"floor-every-{k}"))
        for k in (1, n)
    }
    return {**loops, "extra_s_per_step": extra, "over_floor": over}


def summarize(
    shape: str,
    saved: dict[str, Any],
    floors: dict[str, Any],
    restores: dict[str, list[dict[str, Any]]],
    loops: dict[str, Any],
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
    }
    problems = [f"{m}: {r['failed']}" for m, r in summary.items() if "failed" in r]
    problems += [
        f"{m}: not bit-exact ({', '.join(r['wrong']) or 'digests differ between reads'})"
        for m, r in summary.items()
        if "bit_exact" in r and not r["bit_exact"]
    ]
    problems += [
        f"loop {name}: {r['failed']}" for name, r in loops.get("runs", {}).items() if "failed" in r
    ]
    tiers = summary.get("quicksave-memory", {}).get("tiers", ["memory"])
    if tiers != ["memory"]:
        problems.append(f"quicksave-memory: restored from {', '.join(tiers)}, not memory")
    return {
        "shape": shape,
        "bytes": saved["bytes"],
        "tensors": saved["tensors"],
        "saves": saved["saves"],
        "floors": floors,
        "restores": summary,
        "raw_restores": restores,
        "loop": _loops(loops),
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
        vs, fs = shape["ratios"]["vs_floor"], shape["ratios"]["first_step_over_fully_restored"]
        for m, r in shape["restores"].items():
            why = _why(r)
            if why:
                lines.append(f"{m:<24}{why}")
                continue
            lines.append(
                f"{m:<24}{_s(r['fully_restored_s']):>8}{_s(r['time_to_first_step_s']):>9}"
                f"{_x(vs.get(m, {}).get('fully_restored')):>10}{_x(fs.get(m)):>10}"
                f"{_s(r['setup_s']):>8}"
                f"  {'yes' if r['bit_exact'] else 'NO':<9}  {','.join(r.get('tiers', [])) or '-'}"
            )
        speed = shape["ratios"]["memory_speedup"]
        lines.append(
            f"memory tier faster than disk {_x(speed['vs_disk'])}, than object store "
            f"{_x(speed['vs_object_store'])}"
        )
        loop = shape["loop"]
        if "unavailable" in loop:
            lines.append(f"loop overhead: {_why(loop)}")
        elif loop:
            parts = [f"{k} {_s(v)}" for k, v in loop["extra_s_per_step"].items()]
            lines.append(f"loop extra s/step vs none ({loop['steps']} steps): " + ", ".join(parts))
            unavailable = [k for k, r in loop["runs"].items() if _why(r)]
            if unavailable:
                lines.append(f"  unavailable/failed: {', '.join(unavailable)}: "
                             f"{_why(loop['runs'][unavailable[0]])}")  # fmt: skip
            lines.append("  memory tier over floor: " + ", ".join(
                f"{k} {_x(v)}" for k, v in loop["over_floor"].items()))  # fmt: skip
        for p in shape["problems"]:
            lines.append(f"PROBLEM {p}")
    return "\n".join(lines)
