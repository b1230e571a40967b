"""Count the bytes a block of code moves through torch.distributed collectives.

Typical use (in a test, a benchmark or the sharded demo)::

    from tqcompile.testing.comm import count_collective_bytes

    with count_collective_bytes() as wire:
        loss = model(x, y)
        loss.backward()
    print(wire.bytes["all_gather"], wire.calls["all_gather"])

It is a `TorchDispatchMode`, like torch's `CommDebugMode`, which counts calls but not bytes. Every
collective reaches the dispatcher as an op of the `c10d` namespace (the in-place ops that
`torch.distributed.all_gather_into_tensor`, `all_gather_single`, FSDP2 and friends call) or of
`_c10d_functional` (functional collectives: DTensor redistribution, tensor parallel styles,
tqcompile's amax reductions). Both are counted, so eager hooks (FSDP2's all-gather runs outside
the compiled blocks) and collectives inside compiled graphs run by `aot_eager` are seen alike.

What a byte count means, per kind, on the calling rank: `all_gather`: the gathered output
(world size x the shard), in the dtype it travels as (FSDP2 and tqcompile send quantized payloads
as uint8 views); `reduce_scatter`: the full input; `all_reduce` and `broadcast`: the tensor;
`all_to_all`: the input. Asynchronous ops are counted when issued.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

__all__ = ["CollectiveBytes", "count_collective_bytes"]


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, Sequence) and not isinstance(t, str):
        return sum(_nbytes(x) for x in t)
    return 0


def _ops(namespace: str, names: Sequence[str]) -> dict[Any, str]:
    """{op overload packet: name} for those of `names` that this torch build has."""
    ns = getattr(torch.ops, namespace)
    found = {}
    for name in names:
        try:
            found[getattr(ns, name)] = name
        except (AttributeError, RuntimeError):  # an op this torch build lacks (older or newer torch)
            pass
    return found


# (kind, which argument or the output holds the tensor whose size we count)
_C10D = {  # in-place ops: the output buffers are arguments
    **{
        p: ("all_gather", 0)
        for p in _ops("c10d", ["_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"])
    },
    **{
        p: ("reduce_scatter", 1)
        for p in _ops("c10d", ["_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"])
    },
    **{p: ("all_reduce", 0) for p in _ops("c10d", ["allreduce_", "allreduce_coalesced_"])},
    **{p: ("all_to_all", 1) for p in _ops("c10d", ["alltoall_", "alltoall_base_"])},
    **{p: ("broadcast", 0) for p in _ops("c10d", ["broadcast_"])},
}
_FUNCTIONAL = {  # functional ops: -1 is the returned value, 0 the first argument
    **{
        p: ("all_gather", -1)
        for ns in ("_c10d_functional", "_c10d_functional_autograd")
        for p in _ops(ns, ["all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"])
    },
    **{
        p: ("reduce_scatter", 0)
        for ns in ("_c10d_functional", "_c10d_functional_autograd")
        for p in _ops(ns, ["reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"])
    },
    **{p: ("all_reduce", 0) for p in _ops("_c10d_functional", ["all_reduce", "all_reduce_coalesced"])},
    **{p: ("all_to_all", 0) for ns in ("_c10d_functional", "_c10d_functional_autograd") for p in _ops(ns, ["all_to_all_single"])},
    **{p: ("broadcast", 0) for p in _ops("_c10d_functional", ["broadcast"])},
}
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


@dataclasses.dataclass
class CollectiveBytes:
    """What `count_collective_bytes` saw: bytes and calls per kind of collective, on this rank."""

    bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=lambda: collections.defaultdict(set))

    def reset(self) -> None:
        """Forget everything counted so far (e.g. after a warm-up step)."""
        self.bytes.clear()
        self.calls.clear()
        self.dtypes.clear()

    def _add(self, kind: str, tensors: Any) -> None:
        self.bytes[kind] += _nbytes(tensors)
        self.calls[kind] += 1
        flat = tensors if isinstance(tensors, Sequence) else [tensors]
        for t in flat:
            for x in t if isinstance(t, Sequence) else [t]:
                if isinstance(x, torch.Tensor):
                    self.dtypes[kind].add(x.dtype)


class _CountingMode(TorchDispatchMode):
    # Higher-order ops reach `__torch_dispatch__` too, instead of failing with "no rule registered for
    # HigherOrderOperator ... and mode": a compiled forward with activation checkpointing around a
    # random op runs `run_and_save_rng_state` / `run_with_rng_state`, which carry no collective.
    supports_higher_order_operators = True

    def __init__(self, record: CollectiveBytes) -> None:
        super().__init__()
        self.record = record

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile traces (so Dynamo compiles as usual instead of skipping every
        # frame: "non-infra torch dispatch mode present"), on while compiled code runs.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # Let a wrapper subclass (DTensor, QuantizedTensor) run first: the collectives it
            # issues (DTensor's redistributions) then come back here as ops on plain tensors.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if isinstance(func, HigherOrderOperator):
            # It ran below this mode: a collective inside its subgraph is not seen here. The ones
            # compiled graphs hold (torch 2.11-2.13: the rng ops of checkpointing) have none.
            return out
        packet = getattr(func, "_overloadpacket", None)
        if packet in _C10D:
            kind, index = _C10D[packet]
            self.record._add(kind, args[index])
        elif packet in _FUNCTIONAL:
            kind, index = _FUNCTIONAL[packet]
            self.record._add(kind, out if index == -1 else args[index])
        return out


@contextmanager
def count_collective_bytes() -> Iterator[CollectiveBytes]:
    """Count, on this rank, the bytes and calls of every torch.distributed collective run inside
    the `with` block, per kind (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`,
    `broadcast`); see the module docstring for what is counted.

    Example (in each rank of a 2-process group)::

        with count_collective_bytes() as wire:
            dist.all_gather_into_tensor(out, torch.ones(1000))  # out: 2000 float32
        assert wire.bytes["all_gather"] == 8000
    """
    record = CollectiveBytes()
    with _CountingMode(record):
        yield record
