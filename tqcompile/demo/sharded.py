"""`tqcompile demo --fsdp N --tp M`: the demo's runs, sharded over N x M processes.

Each run (bf16, then each recipe) starts from the same weights and sees the same global batches
as the single-process demo, in the same training loop (`tqcompile.demo.training.train_loop`). The
model is built and converted on every rank, then sharded by `tqcompile.demo.parallel.parallelize`
(TP, per-block `torch.compile(fullgraph=True)`, FSDP2 with bf16 all-gathers). Data parallel rank
r of N takes rows [r*B/N, (r+1)*B/N) of each batch of B sequences, so the loss reported (averaged
over ranks) is the global batch's loss. The AdamW step runs eagerly (it updates sharded DTensor
parameters).

What is counted on the wire: the bytes all-gathered per step on rank 0 (FSDP2's weight
all-gathers, forward and backward; TP's sequence-parallel activation all-gathers), measured on
the second step with `tqcompile.testing.comm.count_collective_bytes`. The bf16 row is the
reference: the same model gathered in bf16.

Started by `run`: in processes it starts itself with `tq.testing.distributed.spawn` (gloo on CPU),
or, under `torchrun`, as the rank torchrun made (NCCL when the device is CUDA). Rank 0 reports
progress through the caller's `progress` and returns the results; the caller prints the table and
draws the picture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tqcompile as tq
import tqcompile.distributed as tqd
from tqcompile.demo.parallel import parallelize
from tqcompile.demo.training import (
    BASELINE,
    DemoConfig,
    RunResult,
    batch_offsets,
    fresh_model,
    initial_state,
    load_corpus,
    lr_schedule,
    train_loop,
)
from tqcompile.testing.comm import count_collective_bytes
from tqcompile.testing.compile import CompileCounter
from tqcompile.testing.distributed import spawn

__all__ = [
    "ShardedRunResult",
    "check_layout",
    "train_sharded",
    "run_sharded_demo",
    "run",
    "under_torchrun",
    "init_from_torchrun",
    "process_group_backend",
    "layout_name",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclasses.dataclass
class ShardedRunResult(RunResult):
    """A `RunResult` plus what rank 0 all-gathered in one training step."""

    all_gather_bytes: int = 0
    all_gather_calls: int = 0


def under_torchrun() -> bool:
    """True when this process was started by `torchrun` (its RANK, WORLD_SIZE and LOCAL_RANK are set)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def layout_name(fsdp: int, tp: int) -> str:
    """The layout in words, e.g. "FSDP2 2 x TP 2 (+SP) = 4 processes"."""
    parts = [p for p in ((f"FSDP2 {fsdp}" if fsdp > 1 else ""), (f"TP {tp} (+SP)" if tp > 1 else "")) if p]
    return f"{' x '.join(parts) or '1 process'} = {fsdp * tp} processes"


def process_group_backend(cfg: DemoConfig) -> str:
    """The process group backend a sharded demo runs on: NCCL on CUDA, gloo on CPU."""
    return "nccl" if cfg.device.startswith("cuda") else "gloo"


@contextlib.contextmanager
def init_from_torchrun(cfg: DemoConfig) -> Iterator[None]:
    """Join the process group whose environment `torchrun` set (and, on CUDA, take this rank's
    device), and destroy the group on exit, whatever happened inside."""
    dist.init_process_group(process_group_backend(cfg))
    try:
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        yield
    finally:
        dist.destroy_process_group()


def check_layout(cfg: DemoConfig, fsdp: int, tp: int) -> None:
    """Raise ValueError, naming the value, for a layout the demo model cannot take."""
    for name, n in (("fsdp", fsdp), ("tp", tp)):
        if n < 1:
            raise ValueError(f"--{name} {n}; allowed: an integer >= 1")
    if cfg.batch_size % fsdp:
        raise ValueError(
            f"--fsdp {fsdp} must divide the batch of {cfg.batch_size} sequences (each data-parallel rank takes its share)"
        )
    mc = cfg.model_config()
    if tp > 1 and (mc.n_head % tp or cfg.seq_len % tp):
        raise ValueError(f"--tp {tp} must divide the {mc.n_head} heads and the sequence length {cfg.seq_len}")
    if tp > 1 and cfg.n_experts:
        raise ValueError("--tp > 1 with --moe: tensor parallelism of MoE blocks is not supported; use --tp 1 or a dense MLP")


def train_sharded(
    recipe: tq.Recipe | None,
    cfg: DemoConfig,
    init_state: dict[str, torch.Tensor],
    data: torch.Tensor,
    offsets: torch.Tensor,
    fsdp: int,
    tp: int,
    progress: Callable[[str], None] | None = None,
) -> ShardedRunResult:
    """One run of the demo on this rank of an fsdp x tp process group (already initialised)."""
    result = ShardedRunResult(BASELINE if recipe is None else recipe.name)
    device = torch.device(cfg.device)
    mesh = init_device_mesh(device.type, (fsdp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model, result.error = fresh_model(cfg, init_state, recipe)
    if result.error is not None:
        return result
    model.to(device)
    torch.compiler.reset()  # each run compiles afresh and counts its own graphs
    counter = CompileCounter(cfg.backend) if cfg.backend is not None else CompileCounter("eager")
    try:
        parallelize(model, mesh, backend=counter if cfg.backend is not None else None)
    except ValueError as e:  # a recipe this layout cannot serve (e.g. a shard that would cut a scaling block)
        result.error = str(e)
        return result
    # foreach=False: the 2-D layout mixes parameters on the dp mesh and on the dp x tp mesh.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    sched = lr_schedule(opt, cfg)
    # Where FSDP2 gathers quantized, its amaxes for the next step in one batched all-reduce
    # (optional and bit-identical).
    precompute = recipe is not None and fsdp > 1

    def step_fn(step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with count_collective_bytes() if step == 1 else contextlib.nullcontext() as wire:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
        if wire is not None:
            result.all_gather_bytes, result.all_gather_calls = wire.bytes["all_gather"], wire.calls["all_gather"]
        opt.step()
        if precompute:
            tqd.precompute_scales(model)
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def mean_over_ranks(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's loss: dp ranks differ, tp ranks agree
        return total.item() / dist.get_world_size()

    rows = slice(dp_rank * cfg.batch_size // fsdp, (dp_rank + 1) * cfg.batch_size // fsdp)
    # No CPU time: a rank's CPU time says little while it waits for its peers.
    return train_loop(
        result, step_fn, cfg, data, offsets, counter, rows=rows, loss_value=mean_over_ranks, cpu_time=False, progress=progress
    )


def run_sharded_demo(
    recipes: Sequence[str], cfg: DemoConfig, fsdp: int, tp: int, progress: Callable[[str], None] | None = None
) -> list[ShardedRunResult]:
    """On this rank of an initialised fsdp x tp process group: the bf16 run, then one per recipe."""
    check_layout(cfg, fsdp, tp)
    if dist.get_world_size() != fsdp * tp:
        raise ValueError(f"--fsdp {fsdp} x --tp {tp} = {fsdp * tp} processes, but the process group has {dist.get_world_size()}")
    recipe_objs = [tq.recipes.get(name) for name in recipes]
    data = load_corpus()
    offsets = batch_offsets(data.numel(), cfg)
    init_state = initial_state(cfg)
    return [train_sharded(r, cfg, init_state, data, offsets, fsdp, tp, progress) for r in (None, *recipe_objs)]


def _rank_runs(
    rank: int,
    world_size: int,
    recipes: Sequence[str],
    cfg: DemoConfig,
    fsdp: int,
    tp: int,
    out: str,
    progress: Callable[[str], None] | None,
) -> None:
    """One spawned rank: run the demo; rank 0 reports progress and saves the results to `out`."""
    progress = progress if rank == 0 else None
    if progress is not None:
        progress(f"{world_size} processes up (gloo process group); building and converting the model on each ...")
    results = run_sharded_demo(recipes, cfg, fsdp, tp, progress)
    if rank == 0:
        torch.save(results, out)


def run(
    recipes: Sequence[str],
    cfg: DemoConfig,
    fsdp: int,
    tp: int,
    *,
    threads: int | None = 1,
    timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
) -> list[ShardedRunResult] | None:
    """Run the sharded demo; return rank 0's results (None on the other ranks of a torchrun).

    Under `torchrun`: as this rank of its group. Otherwise in fsdp x tp processes started here
    (`tq.testing.distributed.spawn`, gloo, CPU only), each with `threads` torch threads. Rank 0
    calls `progress` with each line of progress (a module-level function: the ranks are spawned).
    Raises ValueError, before any process starts, for a layout the model cannot take."""
    check_layout(cfg, fsdp, tp)
    if under_torchrun():
        with init_from_torchrun(cfg):
            results = run_sharded_demo(recipes, cfg, fsdp, tp, progress if dist.get_rank() == 0 else None)
            return results if dist.get_rank() == 0 else None
    if cfg.device != "cpu":
        raise ValueError(f"device {cfg.device!r}: the demo starts its own processes on cpu only; on CUDA, run it under torchrun")
    with tempfile.TemporaryDirectory(prefix="tqcompile-demo-") as tmp:
        out = str(Path(tmp, "results.pt"))
        spawn(_rank_runs, fsdp * tp, (list(recipes), cfg, fsdp, tp, out, progress), timeout_s=timeout_s, threads=threads)
        return torch.load(out, weights_only=False)
