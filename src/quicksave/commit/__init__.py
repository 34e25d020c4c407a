"""Commit: a checkpoint becomes visible all at once, or not at all, and leaves the same
way. The strategy of a location (:mod:`.strategy`; rename on a filesystem, manifest last
on an object store) is chosen once by :func:`strategy_for` / :func:`open_strategy`;
:mod:`.kinds` says what a name is, :mod:`.parts` how ranks' writers commit without
gathering, :mod:`.manifest_reader` reads the commit record back.
"""

from quicksave.commit.choose import (
    classify,
    open_strategy,
    strategy_class,
    strategy_for,
)
from quicksave.commit.kinds import (
    COMMITTED,
    QUARANTINE_MARK,
    TMP_MARK,
    CheckpointKind,
    final_name,
    is_temp_name,
    kind_of,
    new_token,
)
from quicksave.commit.strategy import CommitStrategy, metadata_has_footer

__all__ = [
    "COMMITTED",
    "QUARANTINE_MARK",
    "TMP_MARK",
    "CheckpointKind",
    "CommitStrategy",
    "classify",
    "final_name",
    "is_temp_name",
    "kind_of",
    "metadata_has_footer",
    "new_token",
    "open_strategy",
    "strategy_class",
    "strategy_for",
]
