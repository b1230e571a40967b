"""Quantize throughput: the reference kernels against the Triton kernels.

Prints one table row per (shape, quantizer): reference ms, Triton ms, the Triton kernel's
effective bandwidth (input read + payload and scales written, in GB/s) and whether its output
equals the reference's bit for bit. Without CUDA it says so and times the reference on the CPU.

    python benchmarks/bench_quantize.py                      # bf16 inputs, default shapes
    python benchmarks/bench_quantize.py --dtype float32 --shapes 4096x4096 8192x8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tqcompile.formats import Format
from tqcompile.kernels import reference
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer, ScaleRounding

QUANTIZERS: list[tuple[str, Quantizer]] = [
    ("fp8 e4m3 tensorwise", Float8Quantizer()),
    ("fp8 e4m3 rowwise", Float8Quantizer(granularity=Granularity.ROWWISE)),
    ("fp8 e4m3 1x128", Float8Quantizer(granularity=Granularity.BLOCKWISE_1D)),
    ("fp8 e4m3 1x128 pow2", Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, power_of_two_scale=True)),
    ("fp8 e4m3 128x128", Float8Quantizer(granularity=Granularity.BLOCKWISE_2D)),
    ("fp8 e5m2 rowwise", Float8Quantizer(Format.E5M2, Granularity.ROWWISE)),
    ("mxfp8 e4m3 floor", MXQuantizer(Format.E4M3, ScaleRounding.FLOOR)),
    ("mxfp8 e4m3 rceil", MXQuantizer(Format.E4M3, ScaleRounding.RCEIL)),
    ("mxfp4 floor", MXQuantizer(Format.E2M1, ScaleRounding.FLOOR)),
    ("nvfp4 1x16", NVFP4Quantizer()),
    ("nvfp4 16x16 sr", NVFP4Quantizer(block_2d=True, stochastic_rounding=True)),
]


def _time_ms(fn, reps: int, cuda: bool) -> float:
    """Median wall time of `fn()` in milliseconds (CUDA events on a GPU)."""
    fn()  # warm-up (compiles the Triton kernel on first use)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bytes_moved(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> int:
    return x.numel() * x.element_size() + data.numel() * data.element_size() + scale.numel() * scale.element_size()


def _same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    def bits(t):
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])

    return all(u.shape == v.shape and u.dtype == v.dtype and torch.equal(bits(u), bits(v)) for u, v in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="MxK shapes (default: GPU 4096x4096 8192x8192 16384x8192, CPU 1024x1024)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default: GPU 50, CPU 3)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype)
    shapes = [
        tuple(int(d) for d in s.split("x"))
        for s in (args.shapes or (["4096x4096", "8192x8192", "16384x8192"] if cuda else ["1024x1024"]))
    ]
    reps = args.reps or (50 if cuda else 3)
    device = torch.device("cuda" if cuda else "cpu")

    print(f"torch {torch.__version__}", end="")
    if cuda:
        import triton

        from tqcompile.kernels.triton import quantize as triton_quantize

        print(f", triton {triton.__version__}, device {torch.cuda.get_device_name()}")
    else:
        print(", device CPU")
        print("CUDA is unavailable: timing the reference kernels only (Triton kernels need a GPU).")
    print(f"input dtype {dtype}, median of {reps} runs\n")

    header = f"{'shape':>12}  {'quantizer':<22} {'reference ms':>13} {'triton ms':>10} {'GB/s':>8}  {'bit-exact':>9}"
    print(header)
    print("-" * len(header))
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in shapes:
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for name, q in QUANTIZERS:
            amax = reference.tensor_amax(x, q) if q.uses_tensor_amax() else None
            seed = torch.tensor([1, 2], device=device) if q.needs_seed() else None
            ref_ms = _time_ms(lambda: reference.quantize(x, q, amax, seed), reps, cuda)  # noqa: B023
            row = f"{'x'.join(map(str, shape)):>12}  {name:<22} {ref_ms:>13.3f}"
            if cuda and triton_quantize.supports(x, q, amax, seed):
                out = triton_quantize.quantize(x, q, amax, seed)
                tri_ms = _time_ms(lambda: triton_quantize.quantize(x, q, amax, seed), reps, cuda)  # noqa: B023
                gbps = _bytes_moved(x, *out) / (tri_ms * 1e-3) / 1e9
                exact = _same_bits(out, reference.quantize(x, q, amax, seed))
                row += f" {tri_ms:>10.3f} {gbps:>8.0f}  {'yes' if exact else 'NO':>9}"
            else:
                row += f" {'-':>10} {'-':>8}  {'-':>9}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
