"""Every call by which quicksave talks to other ranks through ``torch.distributed``.

No other module calls a collective (``tests/test_layering.py`` holds the package to
that): a function elsewhere whose name does not say it talks to other ranks cannot, and
each cross-rank step of a save or a load is one named call here, made by orchestration
code (the engine, the manager, the NVRx-compatible queue, the integrations).

Every function is a collective of ``group`` (None: the default group): **every rank of
the group must call it, in the same order**, or the job deadlocks; except the point to
point ones (``exchange_*``), which a pair of ranks calls, each naming the other. Integers travel as
one small int64 tensor on the group's device (CUDA for NCCL groups, else CPU); Python
objects are pickled by ``torch.distributed`` and must be small.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

Op = Literal["min", "max", "sum"]
_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def group_device(group: Any = None) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ints(values: Sequence[int], group: Any) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=group_device(group))


def all_reduce_ints(values: Sequence[int], op: Op, group: Any = None) -> list[int]:
    """Element-wise ``op`` of every rank's ``values`` (the same length on every rank)."""
    t = _ints(values, group)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return [int(v) for v in t.tolist()]


class PendingInts:
    """An all-reduce started by :func:`all_reduce_ints_async`; :meth:`wait` gives its
    result (once the slowest rank has contributed)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self._work = work
        self._tensor = tensor

    def wait(self) -> list[int]:
        self._work.wait()
        return [int(v) for v in self._tensor.tolist()]


def all_reduce_ints_async(values: Sequence[int], op: Op, group: Any = None) -> PendingInts:
    """:func:`all_reduce_ints` started without waiting for the other ranks."""
    t = _ints(values, group)
    return PendingInts(dist.all_reduce(t, op=_OPS[op], group=group, async_op=True), t)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank in the group."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` on the group rank ``dst`` (indexed by rank), None elsewhere."""
    me = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(obj, out, group=group, group_dst=dst)
    return out


def scatter_object(payloads: list[Any] | None, src: int, group: Any = None) -> Any:
    """This rank's element of ``payloads``, which the group rank ``src`` passes (one per
    rank, indexed by rank; None on the other ranks)."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, payloads, group=group, group_src=src)
    return out[0]


def barrier(group: Any = None) -> None:
    """Wait until every rank of the group is here."""
    dist.barrier(group=group)


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """The group rank ``src``'s ``obj`` on every rank (the other ranks pass anything,
    e.g. None)."""
    out: list[Any] = [obj]
    dist.broadcast_object_list(out, group=group, group_src=src)
    return out[0]


def new_gloo_group(ranks: Sequence[int] | None, timeout_s: float) -> Any:
    """A new gloo group over the global ``ranks`` (None: the world) whose operations give
    up after ``timeout_s``. Creating a group is collective: every rank of the world calls
    it, in the same order as its other group creations."""
    return dist.new_group(
        ranks=None if ranks is None else list(ranks),
        backend="gloo",
        timeout=timedelta(seconds=timeout_s),
    )


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def exchange_tensors(
    sends: Sequence[torch.Tensor],
    send_to: int | None,
    recvs: Sequence[torch.Tensor],
    recv_from: int | None,
    group: Any,
    tag: int = 0,
    landed: Callable[[int], None] | None = None,
) -> None:
    """Point to point, not a collective of the whole group: send ``sends`` to the group
    rank ``send_to`` and receive ``recvs`` (filled in place, their sizes agreed
    beforehand) from the group rank ``recv_from``, all at once; returns when every
    transfer is done. ``send_to`` must make the matching call with this rank as its
    ``recv_from`` (same tensors' sizes, same ``tag``), and so must ``recv_from``;
    a peer that never does fails this call after the group's timeout (a
    ``RuntimeError``). The ``i``-th tensor travels with tag ``tag + i``.

    ``landed(i)``, if given, runs on this thread as soon as ``recvs[i]`` is in, in
    order, while the later ones still travel (a check of each as it lands); what it
    raises is raised once every transfer is done, so that the peer's calls match."""
    sent = []
    if send_to is not None:
        for i, t in enumerate(sends):
            sent.append(dist.isend(t, group=group, group_dst=send_to, tag=tag + i))
    received = []
    if recv_from is not None:
        for i, t in enumerate(recvs):
            received.append(dist.irecv(t, group=group, group_src=recv_from, tag=tag + i))
    failed: BaseException | None = None
    for i, work in enumerate(received):
        work.wait()
        if landed is not None and failed is None:
            try:
                landed(i)
            except Exception as e:  # noqa: BLE001 - raised below, the transfers done
                failed = e
    for work in sent:
        work.wait()
    if failed is not None:
        raise failed


def exchange_objects(
    obj: Any, send_to: int | None, recv_from: int | None, group: Any, tag: int = 0
) -> Any:
    """Point to point (as :func:`exchange_tensors`): send the JSON value ``obj`` to the
    group rank ``send_to`` and return the one ``recv_from`` sends (None without
    ``recv_from``). Two transfers each way: the length, then the bytes (tags ``tag``
    and ``tag + 1``)."""
    data = json.dumps(obj).encode()
    length_in = torch.zeros(1, dtype=torch.int64)
    length_out = torch.tensor([len(data)], dtype=torch.int64)
    exchange_tensors([length_out], send_to, [length_in], recv_from, group, tag)
    payload_in = torch.empty(int(length_in.item()), dtype=torch.uint8)
    payload_out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    exchange_tensors([payload_out], send_to, [payload_in], recv_from, group, tag + 1)
    if recv_from is None:
        return None
    return json.loads(payload_in.numpy().tobytes())
