"""CUDA: which low-precision GEMMs this GPU's torch runs (probes), and tq's deployed layers against bf16.

Needs a CUDA GPU. Two tables:

1. **Probes**: each native entry point tq's formats could use, called on small operands; "ok" or
   the first line of the refusal. The INT4 probe also finds which nibble of a byte CUDA's
   ``_convert_weight_to_int4pack`` takes as the even column, by comparing the kernel's product
   with the dequantized weight's.
2. **Layers**: one linear layer at Llama-3-8B widths (gate/up: 4096 -> 14336, down: 14336 -> 4096),
   bf16, calibrated with ``max`` on 256 random rows and `tq.compress`-ed per preset: the kernel the
   rule chose, microseconds a call at M tokens (``triton.testing.do_bench``, L2 flushed between
   calls: the median), x bf16, the weight bytes, the bandwidth the M = 1 call reaches, and the
   deployed layer's relative L2 error against the calibrated (fake-quantized) layer at M = 256.
   ``--compiled`` adds ``torch.compile(fullgraph=True)`` (inductor) of each layer at M = 1 and
   the largest M, first shape only.

    python benchmarks/bench_cuda_kernels.py [--m 1 16 256 4096] [--compiled]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tqcompile as tq  # noqa: E402

SHAPES = ((14336, 4096), (4096, 14336))  # (N, K): gate/up, down of Llama-3-8B


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _probe(fn) -> str:
    try:
        out = fn()
        torch.cuda.synchronize()
        return "ok" + (f": {out}" if isinstance(out, str) else "")
    except Exception as e:  # a refusal is the answer the probe records
        return "refused: " + _first_line(e)


def probes() -> list[tuple[str, str]]:
    dev = "cuda"
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    m, n, k = 128, 256, 512
    a = torch.randn(m, k, device=dev).to(e4m3)
    b = torch.randn(n, k, device=dev).to(e4m3).t()  # (K, N), column-major
    one = torch.ones((), device=dev)
    rows = []
    rows.append(("_scaled_mm E4M3 x E4M3, per tensor", _probe(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))))
    rows.append(
        (
            "_scaled_mm E4M3, per row (M,1) x (1,N), bf16 out",
            _probe(lambda: torch._scaled_mm(a, b, torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev), out_dtype=torch.bfloat16)),
        )
    )
    rows.append(
        (
            "_scaled_mm E5M2 x E4M3, per tensor",
            _probe(lambda: torch._scaled_mm(a.float().to(e5m2), b, one, one, out_dtype=torch.bfloat16)),
        )
    )

    def blockwise():
        from torch.nn.functional import ScalingType

        sa = torch.ones(k // 128, m, device=dev).t()  # (M, K/128), M-major
        sb = torch.ones(n // 128, k // 128, device=dev).t()  # (K/128, N/128)
        F.scaled_mm(a, b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        return "F.scaled_mm BlockWise1x128 x BlockWise128x128"

    rows.append(("FP8 1x128 x 128x128 blocks (fp8_blockwise)", _probe(blockwise)))

    def mx():
        from torch.nn.functional import ScalingType, SwizzleType

        e8m0 = torch.float8_e8m0fnu
        sa = torch.full((m * k // 32,), 127, dtype=torch.uint8, device=dev).view(e8m0)
        sb = torch.full((n * k // 32,), 127, dtype=torch.uint8, device=dev).view(e8m0)
        s = SwizzleType.SWIZZLE_32_4_4
        F.scaled_mm(a, b, sa, ScalingType.BlockWise1x32, sb, ScalingType.BlockWise1x32, swizzle_a=s, swizzle_b=s, output_dtype=torch.bfloat16)

    rows.append(("MXFP8 (E8M0 scales, 1x32 blocks)", _probe(mx)))

    def nvfp4():
        from torch.nn.functional import ScalingType, SwizzleType

        fp4 = torch.float4_e2m1fn_x2
        a4 = torch.zeros(m, k // 2, dtype=torch.uint8, device=dev).view(fp4)
        b4 = torch.zeros(n, k // 2, dtype=torch.uint8, device=dev).view(fp4).t()
        sa = torch.ones(m * k // 16, device=dev).to(e4m3)
        sb = torch.ones(n * k // 16, device=dev).to(e4m3)
        s = SwizzleType.SWIZZLE_32_4_4
        F.scaled_mm(a4, b4, sa, ScalingType.BlockWise1x16, sb, ScalingType.BlockWise1x16, swizzle_a=s, swizzle_b=s, output_dtype=torch.bfloat16)

    rows.append(("NVFP4 (E4M3 scales, 1x16 blocks)", _probe(nvfp4)))
    ai = torch.randint(-128, 128, (32, k), dtype=torch.int8, device=dev)
    bi = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    rows.append(("_int_mm M=32", _probe(lambda: torch._int_mm(ai, bi.t()))))
    rows.append(("_int_mm M=1", _probe(lambda: torch._int_mm(ai[:1], bi.t()))))
    xs = torch.randn(4, k, device=dev, dtype=torch.bfloat16)

    def int8pack():
        got = torch._weight_int8pack_mm(xs, bi, torch.full((n,), 0.01, device=dev, dtype=torch.bfloat16))
        want = xs.float() @ bi.float().t() * 0.01
        return f"relative error {float((got.float() - want).norm() / want.norm()):.1e}"

    rows.append(("_weight_int8pack_mm (bf16)", _probe(int8pack)))

    def int4_nibbles():
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev)
        sz = torch.stack((torch.full((k // 128, n), 0.5, device=dev), torch.zeros(k // 128, n, device=dev)), -1).to(torch.bfloat16)
        want = xs.float() @ ((codes.float() - 8) * 0.5).t()
        found = []
        for name, pairs in (("even column high", codes[:, ::2] << 4 | codes[:, 1::2]), ("even column low", codes[:, 1::2] << 4 | codes[:, ::2])):
            packed = torch._convert_weight_to_int4pack(pairs.contiguous(), 8)
            got = torch._weight_int4pack_mm(xs, packed, 128, sz)
            err = float((got.float() - want).norm() / want.norm())
            found.append(f"{name} {err:.1e}")
        return ", ".join(found)

    rows.append(("_weight_int4pack_mm (tinygemm), nibble order", _probe(int4_nibbles)))
    return rows


def fp8_rowwise_dynamic() -> tq.calibration.QuantConfig:
    q = tq.Float8Quantizer(tq.Format.E4M3, tq.Granularity.ROWWISE)
    return tq.calibration.QuantConfig((tq.calibration.QuantRule(module_types=(nn.Linear,), input=q, weight=q),))


PRESETS = {
    "int8 (W8A8 static)": lambda: tq.configs.int8(),
    "int8_dynamic (W8A8)": lambda: tq.configs.int8_dynamic(),
    "int8_weight_only": lambda: tq.configs.int8_weight_only(),
    "int4_weight_only g128": lambda: tq.configs.int4_weight_only(),
    "fp8 (per tensor)": lambda: tq.configs.fp8(),
    "fp8 per row, dynamic": fp8_rowwise_dynamic,
    "mxfp8": lambda: tq.configs.mxfp8(),
    "nvfp4": lambda: tq.configs.nvfp4(),
}


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=10, rep=40, return_mode="median")


# Rows that run a preset's packed weight through another kernel than the rule's (`tq_kernel` set
# by hand): tinygemm against F.linear on the dequantized weight, and the Triton INT8 weight-only
# kernel (which the rule does not choose until these rows have timed it) against the rule's
# dequantize path.
FORCED = {
    "int4_weight_only g128, dequantize path": ("int4_weight_only g128", "dequantize"),
    "int8_weight_only, Triton": ("int8_weight_only", "int8_triton"),
}


def _layer(n: int, k: int, preset: str | None):
    """(layer, its deployed row, relative error against the calibrated layer) of `preset`; a
    `FORCED` row runs its base preset's packed weight through the kernel it names."""
    base, forced = FORCED.get(preset, (preset, None))
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(k, n, bias=False)).to("cuda", torch.bfloat16)
    if base is None:
        return layer, None, None
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    tq.calibrate(layer, PRESETS[base](), lambda mod: mod(x), progress=False)
    with torch.no_grad():
        ref = layer(x)
    tq.compress(layer)
    row = tq.deploy.deployed_layers(layer)[0]
    if forced is not None:
        layer[0].tq_kernel = forced
        row = dataclasses.replace(row, kernel=f"{forced} (forced)")
    with torch.no_grad():
        err = float((layer(x).float() - ref.float()).norm() / ref.float().norm())
    return layer, row, err


def _bytes(layer) -> int:
    from tqcompile.deploy.modules import _bytes

    return _bytes(layer[0].weight)


PROFILED: list[str] = []


def _profile(name: str, layer, x) -> None:
    """The three CUDA kernels that took the most time in two eager calls of `layer` on `x`."""
    from torch.profiler import ProfilerActivity, profile

    layer(x)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x)
        layer(x)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:3]
    top = "; ".join(f"{e.key[:70]} {e.self_device_time_total / 2:.0f} us" for e in events)
    PROFILED.append(f"| {name} | {top} |")


def layers(ms: list[int], compiled: bool, profile: bool = False) -> None:
    print(f"\n| shape (N, K) | variant | kernel | µs at M = {', '.join(map(str, ms))} | × bf16 at M = {ms[0]} / {ms[-1]} | weight MB | GB/s at M = {ms[0]} | rel. error vs calibrated |")
    print("|---|---|---|---|---|---|---|---|")
    for si, (n, k) in enumerate(SHAPES):
        base = None
        for preset in (None, *PRESETS, *FORCED):
            name = preset or "bf16"
            try:
                layer, row, err = _layer(n, k, preset)
                xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
                with torch.no_grad():
                    us = [_time_us(lambda x=xs[m], f=layer: f(x)) for m in ms]
                    comp = ""
                    if compiled and si == 0:
                        torch._dynamo.reset()
                        fn = torch.compile(layer, fullgraph=True, dynamic=False)
                        cus = [_time_us(lambda x=xs[m], f=fn: f(x)) for m in (ms[0], ms[-1])]
                        comp = f"; compiled {cus[0]:.1f} / {cus[-1]:.1f}"
            except Exception as e:  # one variant failing must not hide the others' figures
                print(f"| {(n, k)} | {name} | failed: {_first_line(e)} |")
                continue
            if base is None:
                base = us
            if profile and si == 0:
                with torch.no_grad():
                    _profile(name, layer, xs[ms[-1]])
            wb = _bytes(layer)
            kernel = row.kernel if row else "F.linear"
            print(
                f"| {(n, k)} | {name} | {kernel} | {' / '.join(f'{u:.1f}' for u in us)}{comp} | "
                f"{base[0] / us[0]:.2f} / {base[-1] / us[-1]:.2f} | {wb / 1e6:.1f} | {wb / us[0] / 1e3:.0f} | "
                f"{'-' if err is None else f'{err:.1e}'} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096], help="tokens per call")
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile(fullgraph=True) of each layer (first shape)")
    ap.add_argument("--profile", action="store_true", help="list the top CUDA kernels of each variant's eager call at the largest M")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_kernels.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}\n")
    print("| entry point | result |\n|---|---|")
    for name, result in probes():
        print(f"| {name} | {result} |")
    layers(args.m, args.compiled, args.profile)
    if PROFILED:
        print(f"\nThe CUDA kernels of one eager call at M = {args.m[-1]}, first shape (torch.profiler: the top three by time)\n")
        print("| variant | kernels |\n|---|---|")
        print("\n".join(PROFILED))


if __name__ == "__main__":
    main()
