"""When ``CheckpointManager`` saves: its save policy, asked with its clock, and, where the
ranks' answers can differ, the ranks' agreement on that answer.

Call order (every rank, the same steps): build once with the manager
(:meth:`SaveSchedule.agree_across` right after, on every rank alike, when several ranks
checkpoint together) → per ``save(step)``: :meth:`SaveSchedule.due` → after a checkpoint
was written, :meth:`SaveSchedule.saved`.

One rank, or a step-based policy: every rank decides alike, no collective. A time-based
policy with several ranks: the ranks' votes are combined by
:class:`~quicksave.manager.interval.IntervalAgreement` (one asynchronous all-reduce on
the checkpoint group every ``interval_check_steps`` steps); forced saves (``force``,
``last_step``) are taken alike by every rank without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from quicksave.manager.config import CheckpointConfig
from quicksave.manager.interval import IntervalAgreement, agree_any_due, needs_agreement
from quicksave.manager.policies import EveryNSeconds, EveryNSteps, SavePolicy


class SaveSchedule:
    """The manager's "is a save due at this step" (see the module docstring).

    Args:
        config: ``interval`` / ``interval_type`` (the default policy) and
            ``interval_check_steps``.
        policy: replaces the policy built from ``config``.
        clock: monotonic seconds, passed to the policy.

    Attributes:
        policy: the :class:`SavePolicy` asked.
        agreement: the ranks' agreement, or None where every rank decides alike.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        policy: SavePolicy | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.policy: SavePolicy = policy or default_save_policy(config)
        self.clock = clock
        self.agreement: IntervalAgreement | None = None

    def agree_across(self, group: Callable[[], dist.ProcessGroup | None]) -> None:
        """Several ranks: if the policy's answers can differ between ranks, vote on the
        checkpoint group (``group()`` gives it; creating it is collective, so every
        rank calls this alike). Nothing for step-based policies."""
        if needs_agreement(self.policy):
            votes = group()
            self.agreement = IntervalAgreement(
                self.config.interval_check_steps, lambda due: agree_any_due(due, votes)
            )

    def due(self, step: int, forced: bool) -> bool:
        """Whether ``step`` saves, alike on every rank (``forced``: ``force`` or the
        last step, which every rank passes alike)."""
        decision = self.policy.should_save(step, self.clock(), forced)
        if self.agreement is None:
            return decision
        return self.agreement.decide(step, decision, forced)

    def saved(self, step: int) -> None:
        """Tell the policy that ``step`` was written (it restarts its interval)."""
        self.policy.saved(step, self.clock())


def default_save_policy(config: CheckpointConfig) -> SavePolicy:
    """The policy of ``config.interval`` / ``config.interval_type``."""
    if config.interval_type == "seconds":
        return EveryNSeconds(config.interval)
    return EveryNSteps(int(config.interval))
