"""FailureLedger: save outcomes settled alike on every rank, the failed-save policy.

Pure: the ranks' reports are built by hand, as ``agree_reports`` would deliver them (the
same list, in rank order, on every rank); the multi-rank behaviour against a real store
is in tests/storage/test_store_outage.py.
"""

from __future__ import annotations

import pytest

from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.manager.failures import (
    Failure,
    FailureLedger,
    Report,
    checkpoint_name,
    step_of,
)
from quicksave.manager.records import SaveRecord


def err(step: int, text: str, rank: int = 0) -> CheckpointError:
    return CheckpointError(text, path=f"s3://b/run/step-{step}/rank-00000-00.bin", rank=rank)


def ranks(n: int, policy: str = "raise", limit: int = 3) -> list[FailureLedger]:
    return [FailureLedger(policy, limit, "s3://b/run") for _ in range(n)]


def settle_all(ledgers: list[FailureLedger]):
    reports = [ledger.report() for ledger in ledgers]  # what the all-gather gives each
    return [ledger.settle(reports) for ledger in ledgers]


def test_a_failure_seen_by_one_rank_is_raised_by_every_rank_with_the_lowest_ranks_error():
    r0, r1 = ranks(2)
    r1.failed((5, "full"), err(5, "upload failed: connection refused", rank=1))
    v0, v1 = settle_all([r0, r1])
    assert v0.raise_error is v1.raise_error  # the same object: the same error everywhere
    assert "connection refused" in str(v0.raise_error) and v0.raise_error.rank == 1
    # rank 0's own report of the same save, arriving later, is not raised again
    r0.failed((5, "full"), err(5, "commit failed: rank 1 is missing"))
    assert [v.raise_error for v in settle_all([r0, r1])] == [None, None]
    assert r0.total == r1.total == 1


def test_when_both_ranks_saw_it_the_lowest_rank_wins():
    r0, r1 = ranks(2)
    r0.failed((5, "full"), err(5, "rank 0's view"))
    r1.failed((5, "full"), err(5, "rank 1's view", rank=1))
    v0, v1 = settle_all([r0, r1])
    assert str(v0.raise_error) == str(v1.raise_error) and "rank 0's view" in str(v0.raise_error)
    assert len(v0.failures) == 1


def test_log_policy_counts_failures_in_a_row_and_raises_at_the_limit():
    r0, r1 = ranks(2, policy="log", limit=3)
    for n, step in enumerate((5, 10), start=1):
        r1.failed((step, "full"), err(step, "store down", rank=1))
        v0, v1 = settle_all([r0, r1])
        assert v0.raise_error is None and v1.raise_error is None
        assert (v0.consecutive, v1.consecutive, v0.total) == (n, n, n)
    r0.failed((15, "full"), err(15, "store down"))
    v0, v1 = settle_all([r0, r1])
    assert v0.raise_error is not None and str(v0.raise_error) == str(v1.raise_error)
    text = str(v0.raise_error)
    assert "3 saves in a row failed (step 5, step 10, step 15" in text
    assert "max_consecutive_failures=3" in text and "none since this job started" in text


def test_a_commit_any_rank_saw_resets_the_count_on_every_rank():
    r0, r1 = ranks(2, policy="log", limit=2)
    r0.failed((5, "full"), err(5, "down"))
    settle_all([r0, r1])
    r1.committed(10)  # only rank 1 polled it yet
    r0.failed((15, "full"), err(15, "down"))
    v0, v1 = settle_all([r0, r1])
    assert (v0.consecutive, v1.consecutive) == (1, 1) and v0.raise_error is None
    r0.failed((20, "full"), err(20, "down"))
    v0, _ = settle_all([r0, r1])
    assert v0.raise_error is not None and "newest committed checkpoint: step 10" in str(
        v0.raise_error
    )


def test_an_incompatible_state_raises_whatever_the_policy():
    (ledger,) = ranks(1, policy="log", limit=100)
    ledger.failed((3, "full"), IncompatibleStateError("a tensor cannot be saved", fqn="m.w"))
    verdict = ledger.settle([ledger.report()])
    assert isinstance(verdict.raise_error, IncompatibleStateError)


def test_a_step_saved_again_after_a_failure_is_judged_afresh():
    (ledger,) = ranks(1)
    ledger.failed((4, "full"), err(4, "first try"))
    assert ledger.settle([ledger.report()]).raise_error is not None
    ledger.failed((4, "full"), err(4, "a late duplicate"))
    assert ledger.settle([ledger.report()]).raise_error is None
    ledger.attempting((4, "full"))
    ledger.failed((4, "full"), err(4, "second try"))
    assert "second try" in str(ledger.settle([ledger.report()]).raise_error)


def test_several_failures_settled_at_once_are_one_error_naming_each():
    (ledger,) = ranks(1)
    ledger.failed((2, "full"), err(2, "two"))
    ledger.failed((4, "full"), err(4, "four"))
    error = ledger.settle([ledger.report()]).raise_error
    assert error is not None and "2 checkpoints were not committed (step-2, step-4)" in str(error)


def test_note_matches_errors_to_the_records_of_a_poll():
    (ledger,) = ranks(1, policy="log", limit=10)
    failed = SaveRecord(6, "full", "/ckpt/step-6", 0, 0.1, status="failed")
    committed = SaveRecord(4, "full", "/ckpt/step-4", 0, 0.1, status="committed")
    silent = SaveRecord(8, "full", "/ckpt/step-8", 0, 0.1, status="failed")
    error = CheckpointError("disk full", path="/ckpt/step-6.tmp-ab12cd/data")
    ledger.note([(0, committed), (1, failed), (2, silent)], [error])
    report = ledger.report()
    assert report.newest_committed == 4
    assert [f.key for f in report.failures] == [(6, "full"), (8, "full")]
    assert report.failures[0].error is error
    assert "step 8 was not committed" in str(report.failures[1].error)


def test_reports_without_failures_need_no_exchange():
    assert not Report(newest_committed=7).needs_exchange
    assert Report(failures=(Failure((None, "full"), CheckpointError("x")),)).needs_exchange


@pytest.mark.parametrize(
    ("path", "name", "key"),
    [
        ("s3://b/run/step-12/manifest.json", "step-12", (12, "full")),
        ("/ckpt/step-3.tmp-0a1b2c/rank-00000-00.bin", "step-3", (3, "full")),
        ("/ckpt/export-step-9", "export-step-9", (9, "export")),
        ("/ckpt", "ckpt", (None, "full")),
        (None, "?", (None, "full")),
    ],
)
def test_the_save_an_errors_path_belongs_to(path, name, key):
    assert checkpoint_name(path) == name
    assert step_of(path) == key
