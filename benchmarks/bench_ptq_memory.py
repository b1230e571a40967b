"""Time and peak memory of `tq.calibrate` with the weight transforms (GPTQ, AWQ, SmoothQuant) on CPU.

The transforms keep per-layer statistics (a Hessian per layer, channel maxima and means), never the
activations: with `sequential=True` only one decoder layer's statistics live at a time, so the peak
does not grow with the number of calibration batches. This prints, for a Llama-style model built
from a config (no download) and a growing number of calibration batches, the seconds and the peak
resident memory above the level before `tq.calibrate`, beside what keeping one layer's inputs for
every batch would cost (what a pipeline that caches activations holds). Each run is a fresh process.

    PYTHONPATH=. python benchmarks/bench_ptq_memory.py [--sizes 512x4] [--batches 8 64]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from bench_export_memory import _model, _peak_during, in_fresh_process

import tqcompile as tq

SEQ, BATCH = 256, 4
RUNS = (
    ("max", "max", True),
    ("gptq", "gptq", True),
    ("gptq (sequential=False)", "gptq", False),
    ("awq", "awq", True),
    ("smoothquant + gptq (W8A8)", ("smoothquant", "gptq"), True),
)


def _measure(algorithm, sequential: bool, hidden: int, layers: int, batches: int, queue) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = _model(hidden, layers)
    data = [torch.randint(0, 8192, (BATCH, SEQ)) for _ in range(batches)]
    config = tq.configs.int8() if "smoothquant" in algorithm else tq.configs.int4_weight_only(128)

    def loop(m):
        for x in data:  # outputs dropped at once: the loop itself holds one batch's activations
            m(x)

    def run():
        tq.calibrate(model, config, loop, algorithm=algorithm, sequential=sequential, progress=False)

    peak, secs = _peak_during(run)
    queue.put((sum(p.numel() for p in model.parameters()), peak, secs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["512x4"], help="hidden x layers")
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 64], help=f"calibration batches of {BATCH}x{SEQ} tokens")
    args = parser.parse_args()
    mib = 2**20
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; resident memory sampled every 5 ms, each run in a fresh process")
    print("| model (hidden x layers) | fp32 model MiB | batches | one layer's inputs for all batches MiB | algorithm | s | peak above start MiB |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        hidden, layers = (int(v) for v in size.split("x"))
        for batches in args.batches:
            cached = batches * BATCH * SEQ * hidden * 4 / mib
            for label, algorithm, sequential in RUNS:
                n, peak, secs = in_fresh_process(_measure, algorithm, sequential, hidden, layers, batches)
                print(f"| {size} | {n * 4 / mib:.0f} | {batches} | {cached:.0f} | {label} | {secs:.1f} | {peak / mib:.0f} |", flush=True)


if __name__ == "__main__":
    main()
