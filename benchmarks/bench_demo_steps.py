"""The demo's step times under one load: bf16 and each recipe compiled as `tqcompile demo` compiles
them, stepped in turn (one step of each, round after round), so that a busy machine slows each
alike; prints the median wall and CPU time per step after the first (compiling) one.

`tqcompile demo` trains its runs one after the other, so on a shared machine each meets a
different load; this compares them at the same moments.

    python benchmarks/bench_demo_steps.py                      # bf16, fp8_tensorwise, mxfp8, nvfp4; 40 steps
    python benchmarks/bench_demo_steps.py --recipes mxfp8 --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tqcompile as tq
from tqcompile.demo import DEFAULT_RECIPES, DemoConfig
from tqcompile.demo.training import _batch, batch_offsets, fresh_model, initial_state, load_corpus, lr_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated names (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run, the first one compiling (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the demo on CPU
    cfg = DemoConfig(steps=args.steps)
    data = load_corpus()
    offsets = batch_offsets(data.numel(), cfg)
    init = initial_state(cfg)
    runs = {}
    for name in ("bf16", *[n for n in args.recipes.split(",") if n]):
        model, error = fresh_model(cfg, init, None if name == "bf16" else tq.recipes.get(name))
        if error is not None:
            parser.error(f"{name}: {error}")
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(cfg.lr), betas=(0.9, 0.95), weight_decay=0.0)
        step = tq.optim.compile_optimizer_step(opt, backend=cfg.backend, fullgraph=True)
        runs[name] = (torch.compile(model, backend=cfg.backend, fullgraph=True), step, opt, lr_schedule(opt, cfg), [], [])
    for i, offs in enumerate(offsets):
        x, y = _batch(data, offs, cfg.seq_len)
        for compiled, opt_step, opt, sched, wall, cpu in runs.values():
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(x, y)
            loss.backward()
            opt_step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            if i > 0:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
    print(f"torch {torch.__version__}, cpu, 1 thread, backend {cfg.backend}; {cfg.steps - 1} timed steps per run, in turn")
    for name, (*_, wall, cpu) in runs.items():
        print(f"{name:>15}  wall {1000 * statistics.median(wall):7.1f} ms  cpu {1000 * statistics.median(cpu):7.1f} ms")


if __name__ == "__main__":
    main()
