"""A progress bar over bytes on stderr (tqdm, imported only when a bar is made), shared
by the commands that stream a whole checkpoint (``verify``, reading a full state)."""

from __future__ import annotations

import sys
from typing import Any


def byte_progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar over bytes on stderr (a no-op bar when not ``enabled``)."""
    from tqdm import tqdm  # imported lazily: most callers never draw a bar

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not enabled,
        desc=desc,
        leave=False,
    )
