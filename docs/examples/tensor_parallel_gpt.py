"""Train the demo GPT with tensor + sequence parallelism over two processes, quantized.

Run:  torchrun --standalone --nproc-per-node=2 docs/examples/tensor_parallel_gpt.py [recipe]

Each rank holds half of every quantized weight (and half of each sequence between the
blocks); every scale is reduced over the TP group, so the losses match a single-process run of
the same model (checked at the end, on every rank).
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tqcompile as tq
from tqcompile.demo import GPT, GPTConfig, parallelize_gpt, quantize_model


def main() -> None:
    recipe = tq.recipes.get(sys.argv[1] if len(sys.argv) > 1 else "mxfp8")
    dist.init_process_group("gloo")  # CPU; use "nccl" (and device="cuda") on GPUs
    torch.set_num_threads(1)
    try:
        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        cfg = GPTConfig(n_layer=1, seq_len=256, d_model=256, n_head=4, mlp_hidden=512)
        torch.manual_seed(0)  # the same initial weights on every rank
        single = quantize_model(GPT(cfg), recipe)
        model = parallelize_gpt(copy.deepcopy(single), tp_mesh)
        for block in model.blocks:  # compile after sharding, block by block
            block.compile(backend="aot_eager", fullgraph=True)

        g = torch.Generator().manual_seed(1)  # the same batch on every rank
        tokens, targets = (torch.randint(0, 256, (2, cfg.seq_len), generator=g) for _ in range(2))
        losses = {}
        for name, m in (("tp", model), ("single", single)):
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            losses[name] = []
            for _ in range(2):
                loss = m(tokens, targets)
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
