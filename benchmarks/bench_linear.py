"""Linear layer forward + backward time per recipe, against a bf16 `nn.Linear` (and torchao's float8
training, when torchao is installed).

Prints one row per (shape, layer): the best time of one forward + backward (y = layer(x);
y.backward(dy)) in milliseconds and its ratio to bf16. M is the token count, K the in-features,
N the out-features; every recipe's blocks divide the default shapes. Without CUDA the quantized
GEMMs run as their CPU emulation (dequantize to fp32 and matmul) or CPU `torch._scaled_mm`, so
CPU times say what the emulation costs, not what the hardware formats gain.

    python benchmarks/bench_linear.py                                   # default shapes for the device
    python benchmarks/bench_linear.py --shapes 4096x4096x4096 --compile # torch.compile each layer (inductor)
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import tqcompile as tq


def _time_ms(fn, reps: int, cuda: bool) -> float:
    """Best wall time of `fn()` over `reps` runs in milliseconds, after two warm-up calls (the first
    compiles). The minimum, not the median: it is the run least disturbed by other work on the
    machine, which on a shared CPU box is most of the noise."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def _torchao_convert():
    """torchao's float8 training conversion (tensorwise), or None with the reason it is unavailable."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        return None, f"torchao is not importable ({e}): its float8 row is skipped"
    return convert_to_float8_training, None


def _step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=None, help="MxKxN shapes (default: GPU 4096x4096x4096 8192x8192x8192, CPU 256x256x256 1024x1024x1024)")
    parser.add_argument("--recipes", nargs="+", default=list(tq.recipes.RECIPES), choices=list(tq.recipes.RECIPES))
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default: GPU 20, CPU 5)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) every layer (inductor) before timing")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    reps = args.reps or (20 if cuda else 5)
    default_shapes = ["4096x4096x4096", "8192x8192x8192"] if cuda else ["256x256x256", "1024x1024x1024"]
    shapes = [tuple(int(d) for d in s.split("x")) for s in (args.shapes or default_shapes)]
    dtype = torch.bfloat16

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'CPU'}, {torch.get_num_threads()} threads")
    print(f"bf16 inputs and weights, forward + backward, best of {reps} runs, {'compiled (inductor)' if args.compile else 'eager'}")
    torchao_convert, torchao_note = _torchao_convert()
    if torchao_note:
        print(torchao_note)
    print()

    header = f"{'M x K x N':>16}  {'layer':<24} {'ms':>10} {'x bf16':>8}"
    print(header)
    print("-" * len(header))
    for m, k, n in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, k, generator=g, device=device).to(dtype).requires_grad_()
        dy = torch.randn(m, n, generator=g, device=device).to(dtype)
        torch.manual_seed(0)
        base = nn.Linear(k, n, device=device, dtype=dtype)

        layers: list[tuple[str, nn.Module]] = [("bf16 nn.Linear", base)]
        if torchao_convert is not None:
            layers.append(("torchao float8", torchao_convert(nn.Sequential(copy.deepcopy(base)))))
        for name in args.recipes:
            layer = tq.nn.Linear(k, n, recipe=tq.recipes.get(name), device=device, dtype=dtype)
            layer.load_state_dict(base.state_dict())
            layers.append((name, layer))

        bf16_ms = None
        for label, layer in layers:
            run_layer = torch.compile(layer, fullgraph=True) if args.compile else layer
            try:
                ms = _time_ms(_step(run_layer, x, dy), reps, cuda)
            except Exception as e:  # a benchmark reports what it could not run and goes on
                print(f"{f'{m}x{k}x{n}':>16}  {label:<24} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            bf16_ms = bf16_ms or ms
            print(f"{f'{m}x{k}x{n}':>16}  {label:<24} {ms:>10.2f} {ms / bf16_ms:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
