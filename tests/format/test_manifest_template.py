"""The writer's manifest template (``format.manifest.TensorsTemplate``): a manifest filled
from a skeleton encodes to the same bytes through the template as without it, whatever
the names, key paths, shapes, checksums and references; a template never fills what is
not its skeleton; the writer makes one from a skeleton seen twice and keeps it."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from quicksave.commit.parts import RankPart, manifest_from_parts
from quicksave.format.keys import DictKey
from quicksave.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    RankPlan,
    TensorEntry,
    TensorsTemplate,
    to_json_bytes,
)
from quicksave.worker.execute import Templates
from quicksave.worker.job import PickledOnce


def _skeleton(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """``tensors`` as their skeleton: no checksums, no references."""
    return {
        fqn: dataclasses.replace(
            t, chunks=tuple(dataclasses.replace(c, xxh3_64="", base=None) for c in t.chunks)
        )
        for fqn, t in tensors.items()
    }


def _random_manifest(rng: random.Random) -> Manifest:
    names = ["w", "é.ünï", 'q"uote\\d', "a\nb", "☃", "x" * 40, "0", "layers.3.attn"]
    tensors = {}
    for i in range(rng.randint(0, 12)):
        fqn = f"{rng.choice(names)}.{i}"
        dims = rng.randint(0, 3)
        shape = tuple(rng.randint(0, 1 << rng.choice((2, 10, 40))) for _ in range(dims))
        chunks = tuple(
            ChunkEntry(
                tuple(rng.randint(0, 9) for _ in shape),
                shape,
                rng.choice(["rank-00000-00.safetensors", "ränk-1.safetensors"]),
                4096 * rng.randint(0, 1 << 20),
                rng.randint(0, 1 << 45),
                f"{rng.getrandbits(64):016x}",
                rng.choice([None, None, rng.randint(0, 99)]),
            )
            for _ in range(rng.randint(0, 5))
        )
        path = rng.choice(
            [None, (fqn,), ("model", 3, fqn), ("opt", DictKey.of(7), DictKey.of(True), "s")]
        )
        tensors[fqn] = TensorEntry(rng.choice(["float32", "bfloat16", "int8"]), shape, chunks, path)
    return Manifest(
        step=100,
        world_size=rng.randint(1, 4),
        tensors=tensors,
        objects={"lr": ObjectEntry(0.5, ("opt", "lr")), "é": ObjectEntry([1, "☃", None])},
        files={"rank-00000-00.safetensors": FileEntry(1 << 30, "0" * 16, 0, 4096)},
        user_metadata={"run": "ü"},
        empty_dicts=(("state",),),
    )


@pytest.mark.parametrize("seed", range(40))
def test_a_template_encodes_a_filled_manifest_to_the_same_bytes(seed: int) -> None:
    m = _random_manifest(random.Random(seed))
    template = TensorsTemplate(_skeleton(m.tensors))
    assert to_json_bytes(m, template) == to_json_bytes(m)  # (not all valid: bytes only)


def test_a_template_of_a_dcp_layout_manifest_with_plans() -> None:
    m = dataclasses.replace(
        _random_manifest(random.Random(7)),
        tensors={"t": TensorEntry("int8", (4,), (ChunkEntry((0,), (4,), "f", 0, 4, "1" * 16),))},
        layout="dcp",
        plans=(RankPlan((), ("lr", "é")),),
    )
    assert to_json_bytes(m, TensorsTemplate(_skeleton(m.tensors))) == to_json_bytes(m)


def test_a_template_refuses_what_is_not_its_skeleton() -> None:
    m = _random_manifest(random.Random(3))
    while not any(t.chunks for t in m.tensors.values()):
        m = _random_manifest(random.Random(len(m.tensors) + 100))
    with pytest.raises(ValueError, match="skeleton"):
        TensorsTemplate(m.tensors)  # checksums filled: not a skeleton
    template = TensorsTemplate(_skeleton(m.tensors))
    fqn = next(f for f, t in m.tensors.items() if t.chunks)
    fewer = dict(m.tensors)
    fewer[fqn] = dataclasses.replace(m.tensors[fqn], chunks=m.tensors[fqn].chunks[1:])
    with pytest.raises(ValueError, match="not the template's"):
        to_json_bytes(dataclasses.replace(m, tensors=fewer), template)
    with pytest.raises(ValueError, match="not the template's"):
        to_json_bytes(
            dataclasses.replace(m, tensors={**m.tensors, "new": m.tensors[fqn]}), template
        )
    marker = {"\x00quicksave-checksum\x00": _skeleton(m.tensors)[fqn]}
    with pytest.raises(ValueError, match="marker"):
        TensorsTemplate(marker)


def _sent(d: dict) -> PickledOnce:
    """``d`` as a writer receives it in a job."""
    return pickle.loads(pickle.dumps(PickledOnce(d)))


def test_the_writer_makes_a_template_from_a_skeleton_seen_twice_and_keeps_it() -> None:
    m = _random_manifest(random.Random(11))
    skeleton = _skeleton(m.tensors)
    templates = Templates(keep=2)
    assert templates.of(skeleton) is None  # a plain dict: nothing names its content
    first, again = _sent(skeleton), _sent(skeleton)
    assert first == skeleton and first.blob == again.blob is not None
    assert templates.of(first) is None  # seen once: a plan that changes pays nothing
    made = templates.of(again)
    assert made is not None and templates.of(_sent(skeleton)) is made
    assert to_json_bytes(m, made) == to_json_bytes(m)
    others = [_sent({**skeleton, f"other{i}": next(iter(skeleton.values()))}) for i in range(3)]
    for other in others:
        templates.of(other)
        templates.of(other)
    assert templates.of(_sent(skeleton)) is None  # fell out of the latest two


@pytest.mark.parametrize("seed", range(12))
def test_saves_filled_one_after_another_take_what_did_not_change_and_encode_the_same(
    seed: int,
) -> None:
    """A writer fills manifest after manifest from one skeleton; each fill takes the
    previous fill's unchanged chunk and tensor entries (``previous``, the template's
    ``last``) and its text for them: the manifests and their bytes are those made
    from scratch, whatever changed (checksums, references, nothing, everything)."""
    rng = random.Random(seed)
    m = _random_manifest(rng)
    while sum(len(t.chunks) for t in m.tensors.values()) < 4:
        m = _random_manifest(rng)
    skeleton = Manifest(
        m.step, m.world_size, _skeleton(m.tensors), m.objects, m.files, m.user_metadata
    )
    keys = {}
    for fqn, t in skeleton.tensors.items():
        for i in range(len(t.chunks)):
            keys[f"{fqn}#{i}"] = (fqn, i)
    template = TensorsTemplate(skeleton.tensors)
    digests = {k: f"{rng.getrandbits(64):016x}" for k in keys}
    bases: dict[str, int] = {}
    kept_chunks = kept_tensors = 0
    for save in range(8):
        for k in rng.sample(sorted(keys), rng.randint(0, len(keys)) if save % 3 else 0):
            if rng.random() < 0.5:
                digests[k] = f"{rng.getrandbits(64):016x}"
            if rng.random() < 0.5:
                bases[k] = rng.randint(0, 99)
            else:
                bases.pop(k, None)
        part = [RankPart(0, dict(digests), {})]
        fresh = manifest_from_parts(skeleton, keys, part, "d", objects_in_parts=False, bases=bases)
        last = template.last
        filled = manifest_from_parts(
            skeleton, keys, part, "d", objects_in_parts=False, bases=bases, previous=last
        )
        assert filled == fresh
        for fqn, t in filled.tensors.items():
            was = last.get(fqn)
            if was is not None and was.chunks == fresh.tensors[fqn].chunks:
                assert t is was  # nothing of it changed: the same entry, not made again
                kept_tensors += 1
            kept_chunks += sum(
                a is b for a, b in zip(t.chunks, was.chunks if was else (), strict=False)
            )
        assert to_json_bytes(filled, template) == to_json_bytes(fresh)
        assert template.last is filled.tensors
    assert kept_chunks and kept_tensors  # (the seeds do reuse)
