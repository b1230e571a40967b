"""Bytes all-gathered per training step and step time, per recipe and parallel layout, against bf16.

Trains the demo GPT (`tqcompile.demo.sharded`: blocks compiled with fullgraph=True, then
`fully_shard`; TP with sequence parallelism) for a few steps in each layout and prints, per
recipe, what rank 0 all-gathered in one step (FSDP2 weights forward + backward, TP activations),
counted at the collective by `tq.testing.comm.count_collective_bytes`, and the median step time
after the first (compiling) step, each against the bf16 run of the same layout.

On CPU it starts the processes itself (gloo): FSDP2=2, TP=2 and TP2xFSDP2=4. Under torchrun it
runs the one layout its processes make (NCCL on CUDA):

    python benchmarks/bench_distributed.py                          # CPU, all three layouts
    python benchmarks/bench_distributed.py --recipes all --steps 12
    torchrun --nproc-per-node 4 benchmarks/bench_distributed.py --tp 2 --device cuda

A recipe a layout cannot serve (e.g. a shard that would cut a scaling block) is a row that says
why. CPU step times measure gloo and the CPU emulation of the formats, not what the
hardware formats gain.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import tqcompile as tq
from tqcompile.demo import DEFAULT_RECIPES, DemoConfig
from tqcompile.demo.report import _fmt_table
from tqcompile.demo.sharded import ShardedRunResult, run, under_torchrun

LAYOUTS = {"FSDP2=2": (2, 1), "TP=2": (1, 2), "TP2xFSDP2=4": (2, 2)}


def _rows(layout: str, results: list[ShardedRunResult]) -> list[tuple[str, ...]]:
    base = results[0]
    rows = []
    for r in results:
        if r.error is not None:
            rows.append(
                (layout, r.name, "-", "-", "-", "-", str(r.graph_breaks), "-", f"not run: {r.error.split(' (')[0].split(':')[0]}")
            )
            continue
        mb = r.all_gather_bytes / 1e6
        ratio = f"{r.all_gather_bytes / base.all_gather_bytes:.2f}x" if base.all_gather_bytes else "-"
        ms = r.step_ms()
        rows.append(
            (
                layout,
                r.name,
                f"{mb:.3f}",
                ratio,
                f"{ms:.1f}",
                f"{ms / base.step_ms():.2f}x",
                str(r.graph_breaks),
                str(r.recompiles),
                "",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated names, or all (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default: %(default)s)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"CPU layouts to run, from {', '.join(LAYOUTS)}")
    parser.add_argument("--tp", type=int, default=1, help="under torchrun: the TP degree (FSDP2 gets WORLD_SIZE / tp)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    recipes = list(tq.recipes.RECIPES) if args.recipes == "all" else [n for n in args.recipes.split(",") if n]
    for name in recipes:
        tq.recipes.get(name)  # a bad name fails here, before any process starts
    backend = "inductor" if args.device == "cuda" else "aot_eager"
    cfg = DemoConfig(steps=args.steps, device=args.device, backend=backend)
    header = ("layout", "recipe", "gathered MB/step", "vs bf16", "step ms", "vs bf16", "graph breaks", "recompiles", "note")
    rows = []
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        fsdp, tp = world // args.tp, args.tp
        results = run(recipes, cfg, fsdp, tp)
        if results is None:  # not rank 0
            return
        rows += _rows(f"FSDP2={fsdp} TP={tp}", results)
    else:
        torch.set_num_threads(1)
        for layout in args.layouts.split(","):
            if layout not in LAYOUTS:
                parser.error(f"--layouts: {layout!r}; allowed: {', '.join(LAYOUTS)}")
            fsdp, tp = LAYOUTS[layout]
            print(f"{layout}: bf16 + {', '.join(recipes)}, {cfg.steps} steps each ...", file=sys.stderr, flush=True)
            rows += _rows(layout, run(recipes, cfg, fsdp, tp, threads=1))
    print(
        f"torch {torch.__version__}, {args.device}, backend {backend}, demo GPT {cfg.batch_size}x{cfg.seq_len} tokens/step, {cfg.steps} steps"
    )
    print(_fmt_table(header, rows))
    print("gathered MB/step: rank 0, one step (forward + backward); step ms: median after the first step")


if __name__ == "__main__":
    main()
