"""`tqcompile demo --fsdp N --tp M`: the demo's runs, sharded over N x M processes.

Each run (bf16, then each recipe) starts from the same weights and sees the same global batches
as the single-process demo. The model is built and converted on every rank, then sharded by
`tqcompile.distributed.parallelize.parallelize` (TP, per-block `torch.compile(fullgraph=True)`,
FSDP2 with bf16 all-gathers). Data parallel rank r of N takes rows [r*B/N, (r+1)*B/N) of each
batch of B sequences, so the loss printed (averaged over ranks) is the global batch's loss. The
AdamW step runs eagerly (it updates sharded DTensor parameters).

What is counted on the wire: the bytes all-gathered per step on rank 0 (FSDP2's weight
all-gathers, forward and backward; TP's sequence-parallel activation all-gathers), measured on
the second step with `tqcompile.testing.comm.count_collective_bytes`. The bf16 row is the
reference: the same model gathered in bf16.

Started by `run` (spawns the processes itself, gloo on CPU) or, under `torchrun`, by joining the
group it made (NCCL when the device is CUDA). Only rank 0 prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tqcompile as tq
import tqcompile.distributed as tqd
from tqcompile.demo import (
    BASELINE,
    DemoConfig,
    RunResult,
    _batch,
    _fmt_table,
    _lr_factor,
    _sync,
    batch_offsets,
    final_window,
    fresh_model,
    load_corpus,
)
from tqcompile.distributed.launch import process_group, spawn, under_torchrun
from tqcompile.distributed.parallelize import parallelize
from tqcompile.models.gpt import GPT
from tqcompile.testing.comm import count_collective_bytes
from tqcompile.testing.compile import CompileCounter

__all__ = ["ShardedRunResult", "train_sharded", "run_sharded_demo", "format_sharded_table", "run"]


@dataclasses.dataclass
class ShardedRunResult(RunResult):
    """A `RunResult` plus what rank 0 all-gathered in one training step."""

    all_gather_bytes: int = 0
    all_gather_calls: int = 0


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
    name = BASELINE if recipe is None else recipe.name
    result = ShardedRunResult(name)
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup_steps, cfg.steps))
    # Where FSDP2 gathers quantized, its amaxes for the next step in one batched all-reduce
    # (optional and bit-identical). A temporary seam: `precompute_scales` arrives with the FSDP2
    # quantized all-gather; until then there is nothing to precompute.
    precompute = getattr(tqd, "precompute_scales", None) if recipe is not None and fsdp > 1 else None
    rows = slice(dp_rank * cfg.batch_size // fsdp, (dp_rank + 1) * cfg.batch_size // fsdp)
    world = dist.get_world_size()
    for step, offs in enumerate(offsets):
        x, y = (t[rows].to(device) for t in _batch(data, offs, cfg.seq_len))
        _sync(device)
        start = time.perf_counter()
        with count_collective_bytes() if step == 1 else contextlib.nullcontext() as wire:
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
            except torch._dynamo.exc.Unsupported as e:
                result.error = f"graph break: {str(e).splitlines()[0]}"
                result.graph_breaks = max(1, counter.graph_breaks)
                return result
        opt.step()
        if precompute is not None:
            precompute(model)
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # every rank's loss: dp ranks differ, tp ranks agree
        loss_value = mean_loss.item() / world
        result.step_times_s.append(time.perf_counter() - start)
        result.losses.append(loss_value)
        if wire is not None:
            result.all_gather_bytes, result.all_gather_calls = wire.bytes["all_gather"], wire.calls["all_gather"]
        if progress is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            progress(f"[{name:>20}] step {step:4d}/{cfg.steps}  loss {loss_value:.4f}  {1000 * result.step_times_s[-1]:8.1f} ms")
        if not math.isfinite(loss_value):
            result.error = f"loss became {loss_value} at step {step}"
            break
    result.graph_breaks, result.graphs, result.recompiles = counter.graph_breaks, counter.frame_count, counter.recompiles
    return result


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
    torch.manual_seed(cfg.seed)
    init_state = {k: v.clone() for k, v in GPT(cfg.model_config()).state_dict().items()}
    return [train_sharded(r, cfg, init_state, data, offsets, fsdp, tp, progress) for r in (None, *recipe_objs)]


def format_sharded_table(results: Sequence[ShardedRunResult], cfg: DemoConfig, fsdp: int, tp: int) -> str:
    """The demo's table for a sharded run, with the bytes all-gathered per step against bf16."""
    mc = cfg.model_config()
    layout = (
        " x ".join(p for p in ((f"FSDP2 {fsdp}" if fsdp > 1 else ""), (f"TP {tp} (+SP)" if tp > 1 else "")) if p) or "1 process"
    )
    backend = dist.get_backend() if dist.is_initialized() else "?"
    head = [
        f"model: GPT {mc.n_layer} layers, d_model {mc.d_model}; {cfg.batch_size}x{cfg.seq_len} tokens/step (global), "
        f"{cfg.steps} steps, AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine), seed {cfg.seed}",
        f"layout: {layout} = {fsdp * tp} processes, {backend}, {cfg.device}; torch {torch.__version__}; "
        + ("TP styles, then " if tp > 1 else "")
        + f"blocks compiled fullgraph=True (backend={cfg.backend!r})"
        # Only an FSDP2 layout shards and gathers weights: a TP-only run must not claim it does.
        + ("; then fully_shard: FSDP2 gathers in bf16 unless the recipe gathers quantized" if fsdp > 1 else ""),
        "",
    ]
    base = next((r for r in results if r.name == BASELINE and r.error is None and r.losses), None)
    header = (
        "recipe",
        "final loss",
        "vs bf16",
        "step ms",
        "1st step s",
        "gathered MB/step",
        "vs bf16 bytes",
        "graph breaks",
        "recompiles",
    )
    rows, notes = [], []
    for r in results:
        if r.error is not None:
            rows.append((r.name, "-", "-", "-", "-", "-", "-", str(r.graph_breaks), "-"))
            notes.append(f"{r.name}: not run: {r.error}")
            continue
        gap = "-" if base is None or r is base else f"{r.final_loss() - base.final_loss():+.4f}"
        ratio = "-" if base is None or not base.all_gather_bytes else f"{r.all_gather_bytes / base.all_gather_bytes:.2f}x"
        step_ms = f"{r.step_ms():.1f}" if len(r.step_times_s) > 1 else "-"
        rows.append(
            (
                r.name,
                f"{r.final_loss():.4f}",
                gap,
                step_ms,
                f"{r.first_step_s():.1f}",
                f"{r.all_gather_bytes / 1e6:.3f}",
                ratio,
                str(r.graph_breaks),
                str(r.recompiles),
            )
        )
    window = final_window(cfg.steps)
    foot = [
        "",
        f"final loss: mean of the last {window} step{'s' if window != 1 else ''}; step ms: median wall time after the first "
        "step; 1st step: includes compiling forward, backward and the optimizer step",
        "gathered MB/step: bytes all-gathered by rank 0 in step 2 (forward + backward; FSDP2 weights, TP activations), "
        "counted at the collective; vs bf16 bytes: that over the bf16 run's",
    ]
    return "\n".join(head + [_fmt_table(header, rows)] + foot + notes)


def _worker(rank: int, world_size: int, recipes: Sequence[str], cfg: DemoConfig, fsdp: int, tp: int, status) -> None:
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else None
    results = run_sharded_demo(recipes, cfg, fsdp, tp, progress)
    if rank == 0:
        print(format_sharded_table(results, cfg, fsdp, tp), flush=True)
        status.put(1 if any(r.error is not None and r.graph_breaks for r in results) else 0)


def run(
    recipes: Sequence[str], cfg: DemoConfig, fsdp: int, tp: int, *, threads: int | None = 1, timeout_s: float = 3600.0
) -> int:
    """Run the sharded demo and return the exit status: under `torchrun`, as this rank of its
    group; otherwise in fsdp x tp processes started here (gloo on CPU). Rank 0 prints the table."""
    check_layout(cfg, fsdp, tp)
    if under_torchrun():
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        with process_group(backend):
            if cfg.device.startswith("cuda"):
                import os

                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            progress = (lambda line: print(line, file=sys.stderr, flush=True)) if dist.get_rank() == 0 else None
            results = run_sharded_demo(recipes, cfg, fsdp, tp, progress)
            if dist.get_rank() == 0:
                print(format_sharded_table(results, cfg, fsdp, tp), flush=True)
            return 1 if any(r.error is not None and r.graph_breaks for r in results) else 0
    if cfg.device != "cpu":
        raise ValueError(f"device {cfg.device!r}: the demo starts its own processes on cpu only; on CUDA, run it under torchrun")
    status = torch.multiprocessing.get_context("spawn").SimpleQueue()
    spawn(_worker, fsdp * tp, (list(recipes), cfg, fsdp, tp, status), timeout_s=timeout_s, threads=threads)
    return status.get()
