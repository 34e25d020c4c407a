"""Campaigns that damage bytes on disk: 1. corruption of committed checkpoints, and
7. a torn newest checkpoint under resume and retention."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import faultkit
import torch
from campaign_checks import (
    SEED,
    captured_logs,
    check_folder,
)
from faultkit import Job, Replay, Result

# ====================================================================== 1. corruption

MUTATIONS = ("flip1", "run", "zero4k", "truncate", "append")


def corruption_state() -> dict[str, Any]:
    """Tensors of several dtypes and sizes (so data files have padding between chunks)
    and plain values (stored in the manifest)."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(1000, 37, generator=g),
        "h": torch.randn(333, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (5000,), generator=g),
        "b": torch.rand(777, generator=g) > 0.5,
        "s": torch.tensor(3.5),
        "d": torch.randn(64, 64, generator=g, dtype=torch.float64),
        "step": 1234,
        "name": "corrupt-me",
        "lr": [0.1, 0.01],
    }


def _regions(ckpt: Path) -> dict[str, list[tuple[int, int, str]]]:
    """Per data file: (start, end, kind) of its header and chunks (the rest is padding)."""
    m = json.loads((ckpt / "manifest.json").read_text())
    out: dict[str, list[tuple[int, int, str]]] = {}
    for name, entry in m["files"].items():
        if "data_start" in entry:
            out[name] = [(0, entry["data_start"], "header")]
    for t in m["tensors"].values():
        for c in t["chunks"]:
            out[c["file"]].append((c["offset"], c["offset"] + c["length"], "chunk"))
    return out


def _where(regions: list[tuple[int, int, str]] | None, offset: int) -> str:
    if regions is None:
        return "whole"
    for start, end, kind in regions:
        if start <= offset < end:
            return kind
    return "padding"


def mutate(
    path: Path, kind: str, rng: random.Random, span: tuple[int, int] | None = None
) -> tuple[int, str] | None:
    """Damage the file at ``path`` in place; returns (offset, description), or None if
    this kind cannot change this file (e.g. no non-zero page to zero). ``span``: the
    byte range a flip, run or zeroed page aims at (default: the whole file)."""
    data = bytearray(path.read_bytes())
    size = len(data)
    if kind == "append":
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4096)))
        path.write_bytes(bytes(data) + extra)
        return size, f"appended {len(extra)} bytes"
    if size == 0:
        return None
    if kind == "truncate":
        new = rng.randrange(size)
        if rng.random() < 0.3:
            new = new // 4096 * 4096  # a page boundary, as a lost tail would leave
        with open(path, "r+b") as f:
            f.truncate(new)
        return new, f"truncated {size} -> {new}"
    lo, hi = span if span is not None else (0, size)
    if kind == "flip1":
        at = rng.randrange(lo, hi)
        data[at] ^= rng.randint(1, 255)
        desc = f"byte {at} flipped"
    elif kind == "run":
        at = rng.randrange(lo, hi)
        n = min(rng.randint(2, 256), size - at)
        old = bytes(data[at : at + n])
        new_bytes = old
        while new_bytes == old:
            new_bytes = bytes(rng.randrange(256) for _ in range(n))
        data[at : at + n] = new_bytes
        desc = f"{n} bytes at {at} replaced"
    elif kind == "zero4k":
        first = lo // 4096 * 4096
        pages = [p for p in range(first, hi, 4096) if any(data[p : p + 4096])]
        if not pages:
            return None
        at = rng.choice(pages)
        end = min(at + 4096, size)
        data[at:end] = bytes(end - at)
        desc = f"page at {at} zeroed"
    else:
        raise ValueError(kind)
    path.write_bytes(bytes(data))
    return at, desc


def _spans(regions: list[tuple[int, int, str]], size: int) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of a data file by kind: header, chunk, padding (what lies between)."""
    spans: dict[str, list[tuple[int, int]]] = {"header": [], "chunk": [], "padding": []}
    pos = 0
    for start, end, kind in sorted(regions):
        if start > pos:
            spans["padding"].append((pos, start))
        spans[kind].append((start, end))
        pos = max(pos, end)
    if pos < size:
        spans["padding"].append((pos, size))
    return {k: v for k, v in spans.items() if v}


def _file_kind(name: str) -> str:
    return "data" if name.endswith(".safetensors") else name


def corruption(trials: int, rng: random.Random, work: Path) -> Result:
    """Campaign 1: damage one file of a committed checkpoint per trial; ``verify`` must
    flag every trial and ``load`` must refuse or give bit-exact values.

    Two source checkpoints: one written by ``quicksave.save`` (two data files, plain
    values in the manifest), one by a ``CheckpointManager`` in process mode (the async
    engine's file images). The trials first cover every (file, mutation) pair, then
    draw at random."""
    import quicksave
    from quicksave.errors import CheckpointError
    from quicksave.loading.verify import verify_checkpoint
    from quicksave.manager import CheckpointConfig, CheckpointManager

    res = Result(
        "corruption",
        must_be_zero=("verify_missed", "silent_wrong_load", "raw_exception"),
    )
    t0 = time.monotonic()
    src_save = work / "src-save"
    state = corruption_state()
    quicksave.save(state, src_save, step=1, thread_count=2)
    job = Job(SEED, 256)
    job.step(1)
    with CheckpointManager(
        CheckpointConfig(folder=str(work / "mgr"), interval=1, async_mode="process"), job.states()
    ) as m:
        m.save(1)
    src_mgr = work / "mgr" / "step-1"
    want_job = job.fingerprint()

    def load_save(path: Path) -> bool:
        out = faultkit.zeros_like(state)
        quicksave.load(out, path)
        return faultkit.same_bits(out, state)

    def load_mgr(path: Path) -> bool:
        fresh = Job(SEED + 1, 256)  # other values everywhere, so a skipped tensor shows
        quicksave.load(fresh.states(), path)
        return fresh.fingerprint() == want_job

    sources = [(src_save, load_save), (src_mgr, load_mgr)]
    for src, loader in sources:
        assert verify_checkpoint(src).ok and loader(src), f"source {src} is not intact"
    combos = [
        (s, name, kind)
        for s in range(len(sources))
        for name in sorted(os.listdir(sources[s][0]))
        for kind in MUTATIONS
    ]
    trial_dir = work / "trial"
    done = 0
    attempt = 0
    while done < trials:
        if attempt < len(combos):
            s, name, kind = combos[attempt]
        else:
            s = rng.randrange(len(sources))
            name = rng.choice(sorted(os.listdir(sources[s][0])))
            kind = rng.choice(MUTATIONS)
        attempt += 1
        src, loader = sources[s]
        shutil.rmtree(trial_dir, ignore_errors=True)
        shutil.copytree(src, trial_dir)
        regions = _regions(src).get(name)
        span = None
        if regions is not None and kind in ("flip1", "run", "zero4k"):
            # aim at header, chunk and padding bytes alike: each behaves differently
            spans = _spans(regions, (src / name).stat().st_size)
            span = rng.choice(spans[rng.choice(sorted(spans))])
        hit = mutate(trial_dir / name, kind, rng, span)
        if hit is None:
            continue
        done += 1
        offset, desc = hit
        where = kind if kind in ("truncate", "append") else _where(regions, offset)
        fkind = _file_kind(name)
        row = f"{fkind} {where}" if fkind == "data" else f"{fkind} {kind}"
        res.grow("trials")
        res.grow(f"trials[{kind}]")
        res.tally(row, "trials")
        label = f"{src.name}/{name} {desc} ({where})"
        try:
            report = verify_checkpoint(trial_dir)
            flagged = not report.ok
        except CheckpointError:
            flagged = True
        except Exception as e:  # noqa: BLE001 - counted as a bug
            res.violate("raw_exception", f"verify on {label}: {faultkit.describe(e)}")
            flagged = True
        if flagged:
            res.count("verify_flagged")
            res.tally(row, "verify flagged")
        else:
            res.violate("verify_missed", label)
            res.tally(row, "verify missed")
        try:
            correct = loader(trial_dir)
        except CheckpointError:
            res.count("load_refused")
            res.tally(row, "load refused")
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"load of {label}: {faultkit.describe(e)}")
            res.tally(row, "raw exception")
        else:
            if correct:
                res.count("load_correct")
                res.tally(row, "load correct")
            else:
                res.violate("silent_wrong_load", label)
                res.tally(row, "silent")
    res.require(res.size.get("trials") == trials, f"{res.size.get('trials')} of {trials} trials")
    res.seconds = time.monotonic() - t0
    return res


# ====================================================================== 7. torn newest

TEARS = ("delete-data", "truncate-data", "flip-chunk", "zero-page-data", "flip-manifest")


def tear(ckpt: Path, kind: str, rng: random.Random) -> str:
    """Damage a committed checkpoint so that it fails its checks."""
    data_files = sorted(ckpt.glob("rank-*.safetensors"))
    if kind == "delete-data":
        victim = rng.choice(data_files)
        victim.unlink()
        return f"deleted {victim.name}"
    if kind == "truncate-data":
        victim = rng.choice(data_files)
        size = victim.stat().st_size
        with open(victim, "r+b") as f:
            f.truncate(rng.randrange(size))
        return f"truncated {victim.name}"
    if kind == "flip-manifest":
        return "manifest: " + mutate(ckpt / "manifest.json", "flip1", rng)[1]  # type: ignore[index]
    regions = _regions(ckpt)
    name = rng.choice(sorted(regions))
    chunks = [r for r in regions[name] if r[2] == "chunk"]
    start, end, _ = rng.choice(chunks)
    path = ckpt / name
    data = bytearray(path.read_bytes())
    if kind == "flip-chunk":
        at = rng.randrange(start, end)
        data[at] ^= 0x01
    else:
        at = start + (rng.randrange(end - start) // 4096) * 4096
        page_end = min(at + 4096, end)
        if any(data[at:page_end]):
            data[at:page_end] = bytes(page_end - at)
        else:  # an all-zero page of a chunk: flip one bit instead
            data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return f"{kind} in {name} at {at}"


def torn_newest(trials: int, rng: random.Random, work: Path) -> Result:
    """Campaign 7: damage the newest committed checkpoint (sometimes the two newest) of
    a folder, then resume with a writing manager with ``keep_latest_k=1``.

    Checked: a read-only manager's ``load()`` falls back to the newest good step
    bit-exactly and moves nothing; the writer's ``load()`` does too, logging an error;
    while the next save is in flight and after it fails (its worker is SIGKILLed), the
    last good checkpoint is still there and verifies; once a save commits, retention
    keeps the new one."""
    from quicksave.errors import CheckpointError
    from quicksave.manager import CheckpointConfig, CheckpointManager

    res = Result(
        "torn_newest",
        must_be_zero=(
            "wrong_fallback", "wrong_values", "no_error_logged", "last_good_deleted",
            "read_only_moved", "raw_exception", "save_after_fallback_failed", "torn_commits",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 1024
    replay = Replay(SEED, kib)
    for t in range(trials):
        folder = work / f"torn-{t}"
        n = rng.randint(3, 5)
        job = Job(SEED, kib)
        with CheckpointManager(
            CheckpointConfig(folder=str(folder), interval=1, async_mode="disabled"), job.states()
        ) as m:
            for s in range(1, n + 1):
                job.step(s)
                m.save(s)
        depth = 2 if rng.random() < 0.3 else 1
        kinds = [rng.choice(TEARS) for _ in range(depth)]
        torn = list(range(n, n - depth, -1))
        descs = [tear(folder / f"step-{s}", k, rng) for s, k in zip(torn, kinds, strict=True)]
        good = n - depth
        label = f"trial {t}: steps 1..{n}, torn {torn} ({'; '.join(descs)})"
        for k in kinds:
            res.grow(f"tears[{k}]")
        res.grow("trials")
        try:
            ro_job = Job(SEED + 1, kib)
            with CheckpointManager(
                CheckpointConfig(folder=str(folder), read_only=True), ro_job.states()
            ) as ro:
                got = ro.load()
            if got != good or ro_job.fingerprint() != replay.fingerprint(good):
                res.violate("wrong_fallback", f"{label}: read-only load gave {got}")
            if any(not (folder / f"step-{s}").exists() for s in torn):
                res.violate("read_only_moved", label)
            job = Job(SEED + 1, kib)
            with captured_logs() as logs:
                m = CheckpointManager(
                    CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=1),
                    job.states(),
                )
                got = m.load()
            if got != good:
                res.violate("wrong_fallback", f"{label}: loaded {got}, newest good is {good}")
            elif job.fingerprint() != replay.fingerprint(good):
                res.violate("wrong_values", label)
            else:
                res.count("fell_back_correctly")
            if not any(r.levelno >= logging.ERROR for r in logs):
                res.violate("no_error_logged", label)
            res.count("quarantined", len(list(folder.glob("step-*.corrupt-*"))))
            # The next save: in flight, then failed (its worker killed): the last good
            # checkpoint must survive retention (keep_latest_k=1) throughout.
            job.step(good + 1)
            m.save(good + 1)
            if faultkit.verify_problems(str(folder / f"step-{good}")) != []:
                res.violate("last_good_deleted", f"{label}: while step {good + 1} in flight")
            # process mode: the manager has a writer with a worker (an AttributeError here
            # is a test that no longer reaches it, not a worker that is absent)
            faultkit.kill_quietly(m.session.writer.saver.worker_pid)
            errors = 0
            for s in range(good + 2, good + 6):
                job.step(s)
                try:
                    m.save(s)
                except CheckpointError:
                    errors += 1
                if faultkit.verify_problems(str(folder / f"step-{good}")) != [] and not [
                    r for r in m.metrics if r.status == "committed"
                ]:
                    res.violate("last_good_deleted", f"{label}: after a failed save")
            try:
                m.close()
            except CheckpointError:
                errors += 1
            res.count("failed_saves_after_kill", errors)
            committed = [r.step for r in m.metrics if r.status == "committed"]
            if not committed:
                res.violate("save_after_fallback_failed", label)
            else:
                remaining = [int(p.rsplit("-", 1)[1]) for p in faultkit.committed_dirs(folder)]
                if remaining != [committed[-1]]:
                    res.notes.append(f"{label}: kept {remaining}, newest commit {committed[-1]}")
            check_folder(res, folder, label)
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"{label}: {faultkit.describe(e)}")
    res.require(
        res.outcomes.get("failed_saves_after_kill", 0) > 0,
        "no save failed after its worker was killed: retention was never tested alone",
    )
    res.seconds = time.monotonic() - t0
    return res
