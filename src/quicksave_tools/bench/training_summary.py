"""The numbers of ``quicksave bench --training`` (:mod:`.training`): per shape, the
runs without checkpoints (``none``) become the baseline, each method's runs are
summarized against it (loop overhead per checkpoint, blocking, time to durable,
restore, CPU and memory; :func:`shape_report`), and the default mode is checked
against the acceptance targets (:func:`acceptance`). Pure computation on the runs'
result dicts, in the parent process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quicksave_tools.bench.shapes import SHAPES
from quicksave_tools.bench.training_loop import median

REFERENCE = "dcp.async_save-process"  # the best of PyTorch's own options
DEFAULT = "quicksave-process"  # CheckpointConfig's defaults: process worker, overlap


# what the report keeps of every run (for --json and --plot)
_RUN_KEYS = (
    "step_s",
    "save_s",
    "events",
    "loop_s",
    "drain_s",
    "calibration_step_s",
    "trainer_cpu_s",
    "workers_cpu_s",
    "setup_s",
    "fresh_restore_s",
    "fresh_setup_s",
)


def _paired_extra_s(run: dict[str, Any]) -> float | None:
    """Loop seconds beyond ``steps`` × the run's own median step time without
    checkpoints (measured in the same process)."""
    calib = median(run.get("calibration_step_s") or [])
    return None if calib is None else run["loop_s"] - len(run["step_s"]) * calib


def _extra_cpu_s(run: dict[str, Any]) -> float | None:
    """The trainer's CPU seconds over the loop beyond its steps at its calibration rate."""
    if not run.get("calibration_step_s") or "trainer_cpu_s" not in run:
        return None
    steady = len(run["step_s"]) * run["calibration_cpu_s"] / len(run["calibration_step_s"])
    return run["trainer_cpu_s"] - steady


@dataclass(frozen=True)
class _Baseline:
    """What the runs without checkpoints (``none``) of one shape give the methods'."""

    loop_s: float | None  # median loop seconds
    step_s: list[float]  # the median of every step (by its index in the loop)
    step_median_s: float | None  # the median step
    # Cold: what the paired estimates find without checkpoints (the loop's first
    # optimizer step allocates the optimizer's state, the calibration steps do not);
    # subtracted from the methods'. Warm: 0.
    paired_extra_s: float = 0.0
    cpu_extra_s: float = 0.0


def _baseline(nones: list[dict[str, Any]], cold: bool) -> _Baseline:
    steps = min(len(r["step_s"]) for r in nones)
    per_step = [median([r["step_s"][i] for r in nones]) for i in range(steps)]
    paired = [x for r in nones if (x := _paired_extra_s(r)) is not None]
    cpu = [x for r in nones if (x := _extra_cpu_s(r)) is not None]
    return _Baseline(
        median([r["loop_s"] for r in nones]),
        [x for x in per_step if x is not None],
        median([t for r in nones for t in r["step_s"]]),
        (median(paired) or 0.0) if cold else 0.0,
        (median(cpu) or 0.0) if cold else 0.0,
    )


def _save_extra_s(run: dict[str, Any], event: dict[str, Any], base: _Baseline) -> float | None:
    """Extra loop seconds around one save: its step (the save's blocking included) and
    the next one, against the same steps of the baseline; None for the loop's last step
    (its next step is the final wait)."""
    i = event["step"] - 1
    if i + 1 >= min(len(run["step_s"]), len(base.step_s)):
        return None
    return sum(run["step_s"][j] - base.step_s[j] for j in (i, i + 1))


def _steady_extra_s(run: dict[str, Any], base: _Baseline) -> float | None:
    """Extra loop seconds per later checkpoint: the loop after the first save's step
    and the next (the final drain included) against the same steps of the baseline,
    over the later saves. The first save of an incremental method writes everything
    (the base it refers to after); this is what each save after it costs."""
    events = run["events"]
    if len(events) < 2 or base.loop_s is None:
        return None
    cut = events[0]["step"] + 1  # (the first save's step and the next are left out)
    steps = run["step_s"]
    if cut >= min(len(steps), len(base.step_s)):
        return None
    tail = run["loop_s"] - sum(steps[:cut])
    base_tail = base.loop_s - sum(base.step_s[:cut])
    return (tail - base_tail) / (len(events) - 1)


IN_RUN_WINDOW = 3  # steps read around a save: its own (the save included) and the next two


def _in_run_extras_s(run: dict[str, Any]) -> list[float]:
    """Extra loop seconds around each later save against the same run's own steps: the
    save's step and the next ``IN_RUN_WINDOW - 1``, less as many times the median of
    the run's steps outside every such window (the first step left out too). Unlike
    the baseline's steps, the run's own do not drift with the host between runs (loops
    of one method 13.6–16.8 s apart on the 2-core bench machine)."""
    steps, events = run["step_s"], run["events"]
    windows = [range(e["step"] - 1, e["step"] - 1 + IN_RUN_WINDOW) for e in events]
    busy = {i for w in windows for i in w}
    quiet = [t for i, t in enumerate(steps) if i > 0 and i not in busy]
    ref = median(quiet)
    if ref is None:
        return []
    return [sum(steps[i] for i in w) - len(w) * ref for w in windows[1:] if w[-1] < len(steps)]


def _summarize(method: str, runs: list[dict], base: _Baseline) -> dict[str, Any]:
    ok = [r for r in runs if "failed" not in r and "unavailable" not in r]
    if not ok:
        bad = runs[0] if runs else {"failed": "not run"}
        key = "unavailable" if "unavailable" in bad else "failed"
        return {key: bad[key], **({"traceback": bad["traceback"]} if "traceback" in bad else {})}
    baseline_s = base.loop_s
    events = [r["events"] for r in ok]
    n_ckpt = len(events[0])
    loop = median([r["loop_s"] for r in ok])
    first = [ev[0]["blocking_s"] for ev in events if ev]
    later = [e["blocking_s"] for ev in events for e in ev[1:]]
    durable_first = [ev[0]["durable_s"] for ev in events if ev and ev[0]["durable_s"]]
    durable_later = [e["durable_s"] for ev in events for e in ev[1:] if e["durable_s"]]
    per_run = [(r["loop_s"] - baseline_s) / n_ckpt for r in ok] if n_ckpt and baseline_s else []
    first_vs_steady = [
        r["step_s"][0] / median(r["calibration_step_s"])
        for r in ok
        if r.get("calibration_step_s") and r["step_s"] and r.get("build") != "cold"
    ]
    first_vs_baseline = [r["step_s"][0] / base.step_s[0] for r in ok if r["step_s"] and base.step_s]
    first_extra = [
        x for r in ok if r["events"] and (x := _save_extra_s(r, r["events"][0], base)) is not None
    ]
    later_extra = [
        x for r in ok for e in r["events"][1:] if (x := _save_extra_s(r, e, base)) is not None
    ]
    first_extra_s, later_extra_s = median(first_extra), median(later_extra)
    close_vs_durable = [
        r["drain_s"] / r["events"][-1]["durable_s"]
        for r in ok
        if r["events"] and r["events"][-1].get("durable_s")
    ]
    trainer_cpu = [
        (x - base.cpu_extra_s) / n_ckpt for r in ok if n_ckpt and (x := _extra_cpu_s(r)) is not None
    ]
    workers_cpu = [r["workers_cpu_s"] / n_ckpt for r in ok if n_ckpt and "workers_cpu_s" in r]
    out: dict[str, Any] = {
        "loop_s": [r["loop_s"] for r in ok],
        "loop_median_s": loop,
        "checkpoints": n_ckpt,
        "overhead_per_checkpoint_runs_s": per_run,
        "first_step_vs_steady": median(first_vs_steady),
        "first_step_vs_steady_runs": first_vs_steady,
        "first_step_vs_baseline": median(first_vs_baseline),
        "first_save_extra_s": first_extra_s,
        "first_save_extra_runs_s": first_extra,
        "later_save_extra_median_s": later_extra_s,
        # the first save's extra loop time beyond a later one's, in steady steps
        "first_save_excess_steps": (
            (first_extra_s - later_extra_s) / base.step_median_s
            if first_extra_s is not None and later_extra_s is not None and base.step_median_s
            else None
        ),
        "close_vs_last_durable": median(close_vs_durable),
        "close_vs_last_durable_runs": close_vs_durable,
        "trainer_cpu_per_checkpoint_s": median(trainer_cpu),
        "workers_cpu_per_checkpoint_s": median(workers_cpu),
        "staging_bytes": max(r.get("staging_bytes", 0) for r in ok),
        "overhead_per_checkpoint_s": (
            (loop - baseline_s) / n_ckpt if n_ckpt and baseline_s is not None else None
        ),
        "steady_overhead_per_checkpoint_s": median(
            [x for r in ok if (x := _steady_extra_s(r, base)) is not None]
        ),
        "in_run_later_save_extra_median_s": median([x for r in ok for x in _in_run_extras_s(r)]),
        "paired_overhead_per_checkpoint_s": (
            median(
                [
                    (x - base.paired_extra_s) / n_ckpt
                    for r in ok
                    if (x := _paired_extra_s(r)) is not None
                ]
            )
            if n_ckpt
            else None
        ),
        "first_blocking_s": median(first),
        "later_blocking_median_s": median(later),
        "later_waited_for_previous_median_s": median(
            [e["waited_for_previous_s"] for ev in events for e in ev[1:]]
        ),
        "first_durable_s": median(durable_first),
        "later_durable_median_s": median(durable_later),
        "drain_median_s": median([r["drain_s"] for r in ok]),
        "setup_median_s": median([r.get("setup_s", 0.0) for r in ok]),
        "restore_s": [t for r in ok for t in r.get("restore_s", [])],
        "fresh_restore_s": [r["fresh_restore_s"] for r in ok if "fresh_restore_s" in r],
        "fresh_setup_s": [r["fresh_setup_s"] for r in ok if "fresh_setup_s" in r],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
        "worker_peak_rss_mib": max(r["worker_peak_rss_mib"] for r in ok),
        "final_loss": ok[0]["final_loss"],
        "runs": [{k: r[k] for k in _RUN_KEYS if k in r} for r in ok],
    }
    out["restore_median_s"] = median(out["restore_s"])
    out["fresh_restore_median_s"] = median(out["fresh_restore_s"])
    out.update(_disk_bytes(ok))
    if "manager_records" in ok[0]:
        out["manager_records"] = ok[0]["manager_records"]
        recs = [rec for r in ok for rec in r.get("manager_records", [])]
        for key in ("trainer_cpu_s", "worker_cpu_s"):
            values = [rec[key] for rec in recs if rec.get(key) is not None]
            out[f"save_{key}_median"] = median(values)
    return out


def _first_later(ok: list[dict], key: str) -> tuple[float | None, float | None]:
    """The first save's value of ``run[key]`` (a dict by step) and the later saves'
    median, over the runs."""
    by_step = [r[key] for r in ok if r.get(key)]
    ordered = [[d[k] for k in sorted(d, key=int)] for d in by_step]
    return median([o[0] for o in ordered]), median([x for o in ordered for x in o[1:]])


def _disk_bytes(ok: list[dict]) -> dict[str, Any]:
    """Bytes on disk per checkpoint: the first save's, the later ones' median (an
    incremental save's), and those against the trainable state's bytes; where the
    shape counts the rows it changes (``embedding-sparse``), the later saves' median of
    the bytes of the state that changed since the previous save, and of the rows."""
    first, later = _first_later(ok, "disk_bytes")
    if first is None:
        return {}
    trainable = ok[0].get("trainable_bytes")
    out = {
        "disk_first_bytes": first,
        "disk_later_median_bytes": later,
        "manifest_later_median_bytes": _first_later(ok, "manifest_bytes")[1],
        "trainable_bytes": trainable,
        "disk_later_vs_trainable": later / trainable if later and trainable else None,
        "disk_later_vs_first": later / first if later and first else None,
    }
    changed = _first_later(ok, "changed_bytes")[1]
    if changed is not None:
        rows = [e["rows_touched"] for r in ok for e in r["events"][1:] if "rows_touched" in e]
        out["changed_later_median_bytes"] = changed
        out["rows_touched_later_median"] = median(rows)
        out["disk_later_vs_changed"] = later / changed if later and changed else None
    return out


def shape_report(
    shape: str,
    methods: tuple[str, ...],
    build: str,
    results: dict[tuple[str, str], list[dict]],
) -> dict[str, Any]:
    """One shape's report: its state, the raw and floor numbers, the baseline and every
    method's summary against them (``build == "cold"``: the baseline's first-step cost
    is subtracted from the paired estimates).

    Raises:
        RuntimeError: the shape's ``raw`` or ``none`` run failed (nothing to compare with).
    """
    for needed in ("raw", "none"):
        bad = [r for r in results[(shape, needed)] if "failed" in r]
        if bad:
            raise RuntimeError(f"the {needed} run of {shape} failed: {bad[0]['failed']}")
    raw = results[(shape, "raw")][0]
    nones = results[(shape, "none")]
    baseline = [r["loop_s"] for r in nones]
    base = _baseline(nones, build == "cold")
    nbytes = raw["bytes"]
    summaries = {m: _summarize(m, results.get((shape, m), []), base) for m in methods}
    ref = summaries.get(REFERENCE, {}).get("overhead_per_checkpoint_s")
    paired_ref = summaries.get(REFERENCE, {}).get("paired_overhead_per_checkpoint_s")
    write_s, read_s = median(raw["write_s"]), median(raw["read_s"])
    floor_copy, floor_hash = median(raw["floor_copy_cpu_s"]), median(raw["floor_hash_cpu_s"])
    floor = floor_copy + floor_hash
    dcp_restore = summaries.get("dcp.save", {}).get("restore_median_s")
    # Training itself is not bit-reproducible across processes here (multi-threaded
    # reductions, e.g. EmbeddingBag's backward): the baseline runs end with a few
    # different losses, and a method must end with one of them.
    base_losses = sorted({r["final_loss"] for r in nones})
    for name, m in summaries.items():
        if "loop_median_s" not in m:
            continue
        over, dur, rest = m["overhead_per_checkpoint_s"], m["later_durable_median_s"], None
        m["overhead_vs_reference"] = over / ref if ref and over is not None else None
        m["overhead_vs_floor"] = over / floor if floor and over is not None else None
        paired = m["paired_overhead_per_checkpoint_s"]
        m["paired_overhead_vs_reference"] = (
            paired / paired_ref if paired_ref and paired is not None else None
        )
        m["first_vs_later_blocking"] = (
            m["first_blocking_s"] / m["later_blocking_median_s"]
            if m["later_blocking_median_s"]
            else None
        )
        m["write_gbps"] = nbytes / 1e9 / dur if dur else None
        m["durable_vs_raw_write"] = dur / write_s if dur else None
        m["staging_vs_state"] = m["staging_bytes"] / nbytes if m["staging_bytes"] else None
        fresh = m["fresh_restore_median_s"]
        others = [
            o["fresh_restore_median_s"]
            for n, o in summaries.items()
            if _library(n) != _library(name) and o.get("fresh_restore_median_s")
        ]
        m["fresh_restore_vs_others"] = fresh / min(others) if fresh and others else None
        rest = m["restore_median_s"]
        m["restore_gbps"] = nbytes / 1e9 / rest if rest else None
        m["restore_speedup_vs_dcp_load"] = dcp_restore / rest if rest and dcp_restore else None
        m["restore_vs_raw_read"] = rest / read_s if rest else None
        m["same_loss_as_baseline"] = m["final_loss"] in base_losses
    return {
        "about": SHAPES[shape].about,
        "state": {"params": raw["params"], "tensors": raw["tensors"], "bytes": nbytes},
        "raw": {
            k: raw.get(k)
            for k in (
                "write_s",
                "direct_s",
                "read_s",
                "copy_warm_s",
                "copy_fresh_s",
                "floor_copy_cpu_s",
                "floor_hash_cpu_s",
                "direct_unavailable",
            )
            if raw.get(k) is not None
        },
        "floor": {"copy_cpu_s": floor_copy, "hash_cpu_s": floor_hash, "cpu_s": floor},
        "baseline": {
            "loop_s": baseline,
            "loop_median_s": median(baseline),
            "step_s": nones[0]["step_s"],
            "step_median_s": base.step_median_s,
            "step_by_index_s": base.step_s,
            # cold: subtracted from the methods' paired estimates and CPU seconds
            "first_step_extra_s": base.paired_extra_s,
            "first_step_extra_cpu_s": base.cpu_extra_s,
            # what the paired estimate gives where there is nothing to find
            "paired_extra_s": [_paired_extra_s(r) for r in nones],
            "trainer_cpu_s": [r.get("trainer_cpu_s") for r in nones],
            "final_losses": base_losses,
        },
        "methods": summaries,
    }


# the acceptance targets of the default mode: (name, key in the method
# summary, limit); the first-step row depends on the build (see targets())
TARGETS = (
    (
        "loop overhead per checkpoint vs dcp.async_save (process), every save counted",
        "overhead_vs_reference",
        0.15,
    ),
    ("loop overhead per checkpoint vs the floor (memcpy + xxh3 CPU s)", "overhead_vs_floor", 2.5),
    ("first step after building the saver vs a steady step", "first_step_vs_steady", 1.2),
    (
        "first save's extra loop time (its step + the next) beyond a later save's, in steps",
        "first_save_excess_steps",
        0.5,
    ),
    ("close() wait vs the last save's time to durable", "close_vs_last_durable", 1.1),
    ("time to durable vs a raw write+fsync of the same bytes", "durable_vs_raw_write", 1.15),
    ("staging memory vs the state's bytes", "staging_vs_state", 1.05),
    (
        "restore into a fresh job vs the fastest other library's",
        "fresh_restore_vs_others",
        1.0,
    ),
)
_COLD_FIRST_STEP = (
    "first step after building the saver (the optimizer's first) vs the baseline's",
    "first_step_vs_baseline",
    1.2,
)


def targets(build: str) -> tuple[tuple[str, str, float], ...]:
    """The acceptance targets of a run whose savers were built ``build`` (cold: the
    first step is the optimizer's first for every method, baseline included, so it is
    compared with the baseline's first step, not with a steady one)."""
    if build != "cold":
        return TARGETS
    return tuple(_COLD_FIRST_STEP if t[1] == "first_step_vs_steady" else t for t in TARGETS)


def _library(method: str) -> str:
    """``quicksave-process`` → ``quicksave``, ``dcp.save`` → ``dcp``, ``torch.save`` →
    ``torch``: methods of one library are not compared with each other."""
    return method.split("-")[0].split(".")[0]


def acceptance(shape: str, report: dict[str, Any], build: str) -> list[dict[str, Any]]:
    m = report["methods"].get(DEFAULT, {})
    rows = []
    for what, key, limit in targets(build):
        value = m.get(key)
        rows.append(
            {
                "shape": shape,
                "target": what,
                "value": value,
                "unit": " steps" if key.endswith("_steps") else "×",
                "limit": limit,
                # a negative overhead is a baseline slower than the method: the machine's
                # load changed between runs, nothing was measured
                "met": value is not None
                and value <= limit
                and not (key.startswith("overhead") and value < 0),
            }
        )
    cpu = (m.get("save_trainer_cpu_s_median"), m.get("save_worker_cpu_s_median"))
    rows.append(
        {
            "shape": shape,
            "target": "CPU seconds per save in the save's metrics (trainer, worker)",
            "value": list(cpu),
            "limit": None,
            "met": all(c is not None for c in cpu),
        }
    )
    return rows
