"""Manifest helpers for tests."""

from __future__ import annotations

import dataclasses

from quicksave.format.manifest import Manifest, to_json_bytes

FILLED_DIGEST = "0123456789abcdef"


def committed_json(skeleton: Manifest) -> bytes:
    """The JSON a planning skeleton becomes once committed: every chunk checksum, empty
    in the skeleton, filled in (with a fixed digest) as the coordinator's commit does;
    a manifest with empty checksums is refused by the reader."""
    tensors = {
        fqn: dataclasses.replace(
            t, chunks=tuple(dataclasses.replace(c, xxh3_64=FILLED_DIGEST) for c in t.chunks)
        )
        for fqn, t in skeleton.tensors.items()
    }
    return to_json_bytes(dataclasses.replace(skeleton, tensors=tensors))
