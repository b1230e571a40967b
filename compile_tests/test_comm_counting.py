"""`tq.testing.comm.count_collective_bytes` around compiled code with activation checkpointing.

One process (a world-size-1 gloo group): what is tested is the dispatch mode, not the wire.
"""

import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tqcompile.testing.comm import count_collective_bytes


def test_counts_around_compiled_checkpoint_with_a_random_op(tmp_path):
    # Was: NotImplementedError "no rule registered for HigherOrderOperator run_and_save_rng_state and
    # mode _CountingMode" (issue 15, item 4): a compiled forward that checkpoints a random op runs the
    # rng higher-order ops, which reached the counting mode without a rule.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 16)
        group = dist.group.WORLD.group_name

        def block(t):
            return F.dropout(lin(t), 0.5, training=True)

        def step(x):
            y = checkpoint(block, x, use_reentrant=False)
            return funcol.wait_tensor(funcol.all_reduce(y, "sum", group)).sum()

        counted = {}
        for backend in ("eager", "aot_eager"):
            fn = step if backend == "eager" else torch.compile(step, backend=backend, fullgraph=True)
            x = torch.randn(4, 16, requires_grad=True)
            with count_collective_bytes() as wire:
                fn(x).backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
            counted[backend] = (dict(wire.calls), dict(wire.bytes))
        # The all-reduce in forward and its gradient's all-reduce in backward, 4 x 16 fp32 each.
        assert counted["aot_eager"] == counted["eager"] == ({"all_reduce": 2}, {"all_reduce": 2 * 4 * 16 * 4})
    finally:
        dist.destroy_process_group()
