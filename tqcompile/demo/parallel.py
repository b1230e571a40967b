"""Shard the demo GPT over a device mesh: `parallelize` (TP, compile, FSDP2, read top to bottom)
and `parallelize_gpt`, its tensor/sequence-parallel plan.

The order is the one FSDP2 and torch.compile need (torchtitan's):

1. tensor/sequence parallel (`parallelize_module`) over the mesh's "tp" dimension;
2. `torch.compile(fullgraph=True)` of each block (not of the whole model: measured on torch 2.13,
   compiling a whole FSDP2 model fails at FSDP's own pre-forward hook, converted or not);
3. `fully_shard` of each block, then of the root, over the "dp" dimension, gathering in bf16
   (`MixedPrecisionPolicy(param_dtype=bfloat16)`): FSDP's hooks run between the compiled blocks.

Which TP plan: a converted model gets `parallelize_gpt` (below), tqcompile's TP
styles (torch's own fail on converted layers: DTensor has no sharding strategy for the
`tqcompile` ops); the high-precision bf16 baseline gets the same layout with torch's styles (the
fused q/k/v split of tqcompile's `ColwiseParallel` serves converted layers only). Which FSDP
gather: stock `fully_shard`; converted layers gather quantized wherever `tq.distributed` provides
the weight wrapper (no call is needed here for that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp

from tqcompile.demo.model import GPT
from tqcompile.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from tqcompile.nn.base import is_converted

__all__ = ["parallelize", "parallelize_gpt", "mesh_dims"]


def mesh_dims(mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(dp mesh, tp mesh) of `mesh`, None for a dimension it lacks or of size 1.

    A 1-D mesh is data parallel unless its dimension is named "tp"; a 2-D mesh must name its
    dimensions ("dp", "tp")."""
    names = mesh.mesh_dim_names or (("dp",) if mesh.ndim == 1 else None)
    if names is None or not set(names) <= {"dp", "tp"} or len(set(names)) != mesh.ndim:
        raise ValueError(f"parallelize: mesh dimension names {mesh.mesh_dim_names}; allowed: ('dp',), ('tp',) or ('dp', 'tp')")

    def sub(name: str) -> DeviceMesh | None:
        if name not in names:
            return None
        m = mesh if mesh.ndim == 1 else mesh[name]
        return m if m.size() > 1 else None

    return sub("dp"), sub("tp")


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> GPT:
    """Shard `model` (converted or not) over the 1-D `tp_mesh` with tqcompile's TP styles, in place,
    and return it.

    Per block (Megatron-style, with sequence parallelism): the norms run on sequence shards; the
    fused q/k/v projection and the MLP's first layer are column-parallel (their sequence-split input
    is all-gathered quantized); the attention and MLP output projections are row-parallel (their
    partial sums are reduce-scattered back to sequence shards). Each rank keeps n_head / tp heads.
    The embeddings stay replicated; the first block's input is split along the sequence; the final
    norm is sequence parallel and the high-precision lm_head column-parallel with a replicated output,
    so every rank computes the whole loss.

    Call it after `tq.convert` / `quantize_model` and before compiling the blocks. Needs a dense
    MLP (no MoE), `n_head` divisible by the TP degree, and, with `sequence_parallel`, a sequence
    length divisible by it.
    """
    world = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_experts:
        raise ValueError(
            f"parallelize_gpt: MoE blocks (n_experts={cfg.n_experts}) have no tensor-parallel plan here; use n_experts=0"
        )
    if cfg.n_head % world:
        raise ValueError(f"parallelize_gpt: n_head={cfg.n_head} is not divisible by the TP degree {world}")
    seq = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        plan = {
            "attn.qkv": ColwiseParallel(input_layouts=seq, fused_chunks=3),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp.fc": ColwiseParallel(input_layouts=seq),
            "mlp.proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        torch_tp.parallelize_module(block, tp_mesh, plan)
        block.attn.n_head = cfg.n_head // world
    top = {"lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        top.update(
            {
                "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True),
                "norm": SequenceParallel(),
            }
        )
    torch_tp.parallelize_module(model, tp_mesh, top)
    return model


def _apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism: norms on sequence shards, q/k/v and MLP-in
    column-parallel, the output projections row-parallel (reduce-scattered back to sequence
    shards); embeddings replicated, the first block's input split along the sequence, the
    high-precision lm_head column-parallel with a replicated output (every rank has the loss)."""
    tp = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_experts:
        raise ValueError(
            f"parallelize: tensor parallelism of MoE blocks (n_experts={cfg.n_experts}) is not supported; use a dense MLP"
        )
    if cfg.n_head % tp or cfg.seq_len % tp:
        raise ValueError(f"parallelize: TP degree {tp} must divide n_head={cfg.n_head} and seq_len={cfg.seq_len}")
    if any(is_converted(m) for m in model.modules()):
        parallelize_gpt(model, tp_mesh)  # tqcompile's styles: activations gathered quantized
        return
    # The bf16 baseline, with torch's styles. Its ColwiseParallel gives each rank a contiguous
    # slice of the fused q/k/v weight's rows: reorder them so that slice is [q; k; v] of this
    # rank's heads (a permutation of output features: exact; the global qkv weight of this
    # layout is stored in that order). Torch's styles gather the sequence in high precision
    # before the attention and the MLP.
    for block in model.blocks:
        w = block.attn.qkv.weight
        with torch.no_grad():
            w.copy_(w.view(3, tp, -1, w.shape[1]).transpose(0, 1).reshape(w.shape))
    seq_in = torch_tp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    for block in model.blocks:
        plan = {
            "attn_norm": torch_tp.SequenceParallel(),
            "attn": seq_in,
            "attn.qkv": torch_tp.ColwiseParallel(),
            "attn.proj": torch_tp.RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": torch_tp.SequenceParallel(),
            "mlp": seq_in,
            "mlp.fc": torch_tp.ColwiseParallel(),
            "mlp.proj": torch_tp.RowwiseParallel(output_layouts=Shard(1)),
        }
        torch_tp.parallelize_module(block, tp_mesh, plan)
        block.attn.n_head = cfg.n_head // tp  # each rank runs its own heads
    top = {
        "blocks.0": torch_tp.PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "norm": torch_tp.SequenceParallel(),
        "lm_head": torch_tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    torch_tp.parallelize_module(model, tp_mesh, top)


def parallelize(model: GPT, mesh: DeviceMesh, *, backend: str | Callable[..., Any] | None = "aot_eager") -> GPT:
    """Shard `model` (a `tqcompile.demo.GPT`, converted or not) over `mesh`, in place, and return it.

    `mesh` is 1-D ("dp": FSDP2, or "tp": tensor + sequence parallel) or 2-D ("dp", "tp"). Call it
    after `quantize_model` and before building the optimizer. `backend` compiles each block with
    `fullgraph=True` (None: eager). Every rank must then run the same forward (the TP ranks of a
    dp rank the same tokens).

    Example (each of 2 processes, after `dist.init_process_group("gloo")`):
        >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        >>> model = parallelize(quantize_model(GPT(GPTConfig()), tq.recipes.mxfp8()), mesh)
    """
    if not isinstance(model, GPT):
        # Its TP plan and its blocks are the demo GPT's (model.cfg, model.blocks): another model
        # failed with "'Llama' object has no attribute 'blocks'".
        raise TypeError(
            f"parallelize: shards tqcompile.demo.GPT only, got {type(model).__name__}; for your own model, apply the "
            "same steps in this order: tq.convert, parallelize_module with tq.distributed's TP styles, torch.compile "
            "of each block (fullgraph=True), fully_shard of each block and then the root (docs/distributed.md)"
        )
    dp_mesh, tp_mesh = mesh_dims(mesh)
    # 1. Tensor parallel first: it replaces parameters with DTensors that FSDP then shards further.
    if tp_mesh is not None:
        _apply_tensor_parallel(model, tp_mesh)
    # 2. Compile each block (FSDP's hooks, added next, stay outside the compiled graphs).
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
    # 3. FSDP2: each block is its own all-gather unit, then the root (embeddings, norm, lm_head).
    if dp_mesh is not None:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model
