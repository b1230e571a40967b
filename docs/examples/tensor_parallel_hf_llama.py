"""Train a Hugging Face Llama with tensor + sequence parallelism over two processes, quantized.

Run:  torchrun --standalone --nproc-per-node=2 docs/examples/tensor_parallel_hf_llama.py [recipe]

`parallelize_llama` is the plan docs/tensor_parallel.md explains ("Hugging Face models"); the
multi-process tests import it from here. The model is built from a config (no download), the
lm_head stays in high precision, and the losses are checked against a single-process run of the
same quantized model at the end, on every rank.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import tqcompile as tq


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard a converted `LlamaForCausalLM` (or a model of the same layout: Qwen3, Mistral) over `tp_mesh`.

    The sequence is split at the first decoder layer's input, not at the embedding's output: HF
    builds `position_ids` and the rotary embedding from the length of the embedding's output, which
    must be the whole sequence. Attention reads the head count from its input's shape, so q, k and v
    get their input through `QuantizedSequenceParallelInput` (gathered once, quantized, with the
    whole sequence's shape) rather than each gathering it with `ColwiseParallel(input_layouts=Shard(1))`.
    """
    T = tq.distributed
    parallelize_module(
        model.model.layers[0],
        tp_mesh,
        T.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True),
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "input_layernorm": T.SequenceParallel(use_local_output=True),
                "self_attn": T.QuantizedSequenceParallelInput(),  # HF passes hidden_states= by keyword
                "self_attn.q_proj": T.ColwiseParallel(),
                "self_attn.k_proj": T.ColwiseParallel(),
                "self_attn.v_proj": T.ColwiseParallel(),
                "self_attn.o_proj": T.RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": T.SequenceParallel(use_local_output=True),
                "mlp": T.QuantizedSequenceParallelInput(),
                "mlp.gate_proj": T.ColwiseParallel(),
                "mlp.up_proj": T.ColwiseParallel(),
                "mlp.down_proj": T.RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(model.model.norm, tp_mesh, T.SequenceParallel(use_local_output=True))
    # A high-precision lm_head: torch's style gathers the sequence, and the logits over the vocabulary.
    parallelize_module(model.lm_head, tp_mesh, T.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    return model


def tiny_llama(seed: int = 0) -> nn.Module:
    """A two-layer Llama built from a config (4 heads, 2 key/value heads), fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
    )
    torch.manual_seed(seed)  # the same initial weights on every rank
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def keep_lm_head(module: nn.Module, fqn: str) -> bool:
    """`tq.convert`'s filter: every linear layer but the lm_head."""
    return "lm_head" not in fqn


def main() -> None:
    recipe = tq.recipes.get(sys.argv[1] if len(sys.argv) > 1 else "mxfp8")
    dist.init_process_group("gloo")  # CPU; use "nccl" (and device="cuda") on GPUs
    torch.set_num_threads(1)
    try:
        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        single = tq.convert(tiny_llama(), recipe, filter_fn=keep_lm_head)
        model = parallelize_llama(copy.deepcopy(single), tp_mesh)
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))  # the same batch on every rank
        losses = {}
        for name, m in (("tp", model), ("single", single)):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            losses[name] = []
            for _ in range(3):
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
        if dist.get_rank() == 0:
            print(f"{recipe.name}: TP={tp_mesh.size()} losses {losses['tp']}, single process {losses['single']}")
        torch.testing.assert_close(torch.tensor(losses["tp"]), torch.tensor(losses["single"]), rtol=1e-3, atol=0)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
