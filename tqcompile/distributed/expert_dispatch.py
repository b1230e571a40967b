"""Expert parallelism for converted experts modules: experts sharded on dim 0 over an EP group,
tokens sent to the rank that holds their expert with all-to-alls (the shape of torchtitan's
`ExpertParallel`).

Per MoE layer and forward, on each of the W ranks of the EP group (E experts, E/W per rank; every
rank routes its own tokens, sorted by global expert, counts (E,))::

    counts (E,)  == all_to_all (E/W each) ==  received counts (W, E/W): source rank x local expert
    tokens (sorted by expert) == all_to_all (split by the owner of each expert) == received tokens,
      ordered (source rank, local expert) -> stable sort by local expert
    compute_local(tokens, counts per local expert)     every GEMM grouped, quantized per expert
    -> the inverse sort == all_to_all back ==  this rank's tokens, in the order they left

An expert's tokens from every rank meet on its owner, in rank order, so its per-expert scales
(weight, activations, gradients) are those a single process computes on the whole batch: no amax
is reduced across ranks. The token split sizes are data-dependent: the dispatch reads them on the
host (`.tolist()`, one device sync per layer). Under torch.compile they become unbacked SymInts and
the dispatch compiles with ``fullgraph=True`` inside the model's blocks, with no recompile for a new
routing (checked on torch 2.13 with aot_eager, forward and backward equal to eager bit for bit).

The expert weights become DTensors sharded `Shard(0)` on the EP mesh: the optimizer updates each
rank's experts, and `torch.distributed.checkpoint` (`tq.distributed.checkpoint`) saves them sharded
and loads them at any EP size. The rest of the model is replicated over the EP group (data
parallel): reduce its gradients as for data parallelism (FSDP2, DDP, or an all-reduce).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tqcompile.distributed.fsdp import QuantizedWeight
from tqcompile.nn.experts import QuantizedExperts, experts_layout
from tqcompile.surgery.names import canonical_modules

__all__ = ["ExpertParallelDispatch", "expert_parallel"]


@dataclasses.dataclass(frozen=True)
class _Routed:
    """What `combine` needs of a `dispatch`: the sort by local expert, and the split sizes."""

    perm: torch.Tensor
    sent: list[int]  # tokens this rank sent to each rank
    received: list[int]  # tokens this rank received from each rank


@dataclasses.dataclass(frozen=True)
class ExpertParallelDispatch:
    """The all-to-all token dispatch of one experts module sharded over an EP group (see the module
    docstring); `tq.distributed.expert_parallel` sets it as the module's `tq_dispatch`.

    `group_name`: the EP process group's name; `num_experts`: E, over all ranks."""

    group_name: str
    world: int
    num_experts: int

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Routed]:
        """(this rank's experts' tokens sorted by local expert, their int64 counts per local expert,
        the state `combine` needs) from this rank's tokens `x` sorted by global expert, `counts` (E,)."""
        local = self.num_experts // self.world
        # received[s, e]: how many tokens rank s sends to this rank's local expert e.
        received = all_to_all_single(counts.to(torch.int64), None, None, self.group_name).view(self.world, local)
        # Split sizes are host ints (all-to-all sizes are data-dependent): one sync per layer; compiled,
        # unbacked SymInts.
        sent = counts.view(self.world, local).sum(1).tolist()
        got = received.sum(1).tolist()
        tokens = all_to_all_single_autograd(x, got, sent, self.group_name)
        # Received tokens are ordered (source rank, local expert): a stable sort by local expert
        # puts every expert's tokens together, in rank order (a single process's order).
        expert = torch.arange(local, device=x.device).repeat(self.world)
        perm = torch.sort(torch.repeat_interleave(expert, received.reshape(-1)), stable=True)[1]
        return tokens[perm], received.sum(0), _Routed(perm, sent, got)

    def combine(self, y: torch.Tensor, routed: _Routed) -> torch.Tensor:
        """The outputs `y` of `dispatch`'s tokens, sent back to their ranks, in the order they left."""
        inverse = torch.empty_like(routed.perm)
        inverse[routed.perm] = torch.arange(routed.perm.numel(), device=routed.perm.device)
        return all_to_all_single_autograd(y[inverse], routed.sent, routed.received, self.group_name)


def expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every converted experts module of `model` (or `model` itself) over the 1-D `ep_mesh`:
    expert weights (and biases) become DTensors placed `Shard(0)`, each rank holding E / EP
    experts, and tokens reach their expert's rank through all-to-alls (module docstring). Returns `model`.

    Call it after `tq.convert` (the experts must be converted) and before building the optimizer,
    on every rank of the mesh with the same model: rank 0's expert weights are scattered.

    Example:
        >>> model = tq.convert(model, tq.recipes.mxfp8())
        >>> ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        >>> tq.distributed.expert_parallel(model, ep_mesh)
    """
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        raise ValueError(f"expert_parallel: ep_mesh must be a 1-D DeviceMesh, got {ep_mesh!r}")
    world = ep_mesh.size()
    found = 0
    for name, module in canonical_modules(model):
        if experts_layout(module) is None:
            continue
        if not isinstance(module, QuantizedExperts):
            raise TypeError(
                f"expert_parallel: experts module {name or '<root>'!r} ({type(module).__name__}) is not converted; "
                "call tq.convert(model, recipe) first (its routing then runs through tqcompile)"
            )
        if module.tq_dispatch is not None:
            raise ValueError(f"expert_parallel: experts module {name or '<root>'!r} is already expert-parallel")
        _shard_experts(module, name or "<root>", ep_mesh)
        num_experts = module._parameters[module.tq_experts_layout.gemms[0].weight].shape[0]
        module.tq_dispatch = ExpertParallelDispatch(ep_mesh.get_group().group_name, world, num_experts)
        found += 1
    if not found:
        raise ValueError(f"expert_parallel: {type(model).__name__} holds no experts module (3-D expert weights) to shard")
    return model


def _shard_experts(module: QuantizedExperts, name: str, mesh: DeviceMesh) -> None:
    world = mesh.size()
    names = [n for g in module.tq_experts_layout.gemms for n in (g.weight, g.bias) if n is not None]
    for p_name in names:
        p = module._parameters[p_name]
        if isinstance(p, DTensor):
            raise ValueError(f"expert_parallel: {name}.{p_name} is already a DTensor ({p.placements}); shard experts first")
        if p.shape[0] % world:
            raise ValueError(
                f"expert_parallel: {name}.{p_name} has {p.shape[0]} experts, not a multiple of the EP size {world}; "
                f"use an EP size that divides {p.shape[0]}"
            )
        # A weight tq.convert made FSDP2-gatherable (QuantizedWeight): EP shards the tensor it holds.
        plain = p._tensor if isinstance(p, QuantizedWeight) else p
        sharded = distribute_tensor(plain.detach(), mesh, [Shard(0)])
        module._parameters[p_name] = nn.Parameter(sharded, requires_grad=p.requires_grad)
    # Delayed scaling's (L, E) histories: one window per expert, sharded with the experts (DCP then
    # reshards them too); each rank rolls its experts' windows with the amaxes one process sees.
    for b_name in module._amax_history_names():
        module._buffers[b_name] = distribute_tensor(module._buffers[b_name], mesh, [Shard(1)])
