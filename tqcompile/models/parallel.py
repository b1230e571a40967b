"""`parallelize_gpt`: the tensor/sequence-parallel plan of the demo GPT, read top to bottom.

Per block (Megatron-style, with sequence parallelism): the norms run on sequence shards; the
fused q/k/v projection and the MLP's first layer are column-parallel (their sequence-split input
is all-gathered quantized); the attention and MLP output projections are row-parallel (their
partial sums are reduce-scattered back to sequence shards). Each rank keeps n_head / tp heads.
The embeddings stay replicated; the first block's input is split along the sequence; the final
norm is sequence parallel and the high-precision lm_head column-parallel with a replicated output,
so every rank computes the whole loss.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from tqcompile.distributed.tensor_parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from tqcompile.models.gpt import GPT

__all__ = ["parallelize_gpt"]


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> GPT:
    """Shard `model` (converted or not) over the 1-D `tp_mesh`, in place, and return it.

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
        parallelize_module(block, tp_mesh, plan)
        block.attn.n_head = cfg.n_head // world
    top = {"lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        top.update(
            {
                "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True),
                "norm": SequenceParallel(),
            }
        )
    parallelize_module(model, tp_mesh, top)
    return model
