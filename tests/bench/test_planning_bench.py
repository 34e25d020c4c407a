"""``quicksave bench --planning`` on a tiny simulated job: the report's structure, and
the global plan it times checked against a brute-force statement of the policy."""

from __future__ import annotations

import json
import math

import pytest

from quicksave.saving.rank_plans import global_plan
from quicksave_tools.bench import main as bench_main
from quicksave_tools.bench.planning import dcp_plans, simulated_plans


def test_planning_report_structure(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_main(["--planning", "--ranks", "8", "--tensors", "20", "--repeats", "1", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["ranks"] == 8 and report["config"]["tensors"] == 20
    assert report["items_per_rank"] == 22  # 20 tensors + 2 values
    q, d = report["quicksave"], report["dcp"]
    for part in (q, d):
        assert part["uncached_s"] > 0 and part["cached_s"] > 0
        assert part["plans_pickle_bytes"] > 0
        assert part["cached_over_uncached"] == pytest.approx(part["cached_s"] / part["uncached_s"])
    assert q["cached_collectives"] == 1
    # 12 sharded tensors: one chunk per rank each; 8 replicated: written once.
    assert q["chunks_held"] == 8 * 20
    assert q["chunks_written"] == 12 * 8 + 8
    assert report["quicksave_cached_vs_dcp_cached"] == pytest.approx(q["cached_s"] / d["cached_s"])
    assert any("not simulated" in n or "not run" in n for n in report["notes"])


def test_planning_text_report_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--planning", "--ranks", "4", "--tensors", "5", "--repeats", "1",
                       "--no-dcp"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "quicksave" in text and "cached/uncached" in text and "DCP" not in text.split("\n")[2]
    assert bench_main(["--planning", "--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err


def test_simulated_global_plan_matches_brute_force() -> None:
    ranks, tensors = 8, 20
    plans = simulated_plans(ranks, tensors)
    gp = global_plan(plans, thread_count=2)

    # Brute force: list every (chunk, holder) pair, then apply the policy literally.
    pairs = [(it, p.rank) for p in plans for it in p.items]
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for it, r in pairs:
        holders.setdefault(it.key, []).append(r)
        size[it.key] = it.nbytes
    load = [0] * ranks
    expected: list[set[str]] = [set() for _ in range(ranks)]
    for key, hs in holders.items():
        if len(hs) == 1:
            expected[hs[0]].add(key)
            load[hs[0]] += size[key]
    shared = [k for k, hs in holders.items() if len(hs) > 1]
    fqn_of = {it.key: (it.fqn, it.offsets, it.sizes) for it, _ in pairs}
    for key in sorted(shared, key=lambda k: (-size[k], fqn_of[k])):
        best = min(holders[key], key=lambda r: (load[r], r))
        expected[best].add(key)
        load[best] += size[key]

    got = [{e.item.key for f in lay.files for e in f.entries} for lay in gp.layouts]
    assert got == expected
    # The skeleton places every chunk of every tensor, tiling each tensor exactly.
    for fqn, t in gp.skeleton.tensors.items():
        assert sum(math.prod(c.sizes) for c in t.chunks) == math.prod(t.shape), fqn
    assert set(gp.skeleton.objects) == {"train.step"} | {f"rng.rank{r}" for r in range(ranks)}
    # DCP gets the same chunks (one write item per chunk and value of every rank).
    sp = dcp_plans(plans)
    assert [len(p.items) for p in sp] == [len(p.items) + len(p.objects) for p in plans]
