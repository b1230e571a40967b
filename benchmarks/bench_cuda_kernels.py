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
    rows += grouped_probes()

    def e5m2_rows(rows_: int):
        g = torch.randn(rows_, k, device=dev).to(e5m2)
        torch._scaled_mm(g, b, one, one, out_dtype=torch.bfloat16)

    for r in (16, 32, 48):
        rows.append((f"_scaled_mm E5M2 x E4M3, per tensor, M={r}", _probe(lambda r=r: e5m2_rows(r))))
    return rows


def _rel(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"relative error {float((got.float() - want).norm() / want.norm()):.1e}"


def grouped_probes() -> list[tuple[str, str]]:
    """The grouped GEMMs an experts layer could call: bf16 `torch._grouped_mm` (what transformers'
    "grouped_mm" experts run) and FP8 per-row `torch._scaled_grouped_mm`, four experts of 16, 0,
    48 and 64 rows (offsets as the segment ends)."""
    dev, e, n, k = "cuda", 4, 256, 512
    offs = torch.tensor([16, 16, 64, 128], device=dev, dtype=torch.int32)
    x = torch.randn(128, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16)
    seg = torch.repeat_interleave(torch.arange(e, device=dev), torch.diff(offs, prepend=offs.new_zeros(1)))
    want = torch.einsum("mk,mnk->mn", x.float(), w.float()[seg])

    def bf16():
        return _rel(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), want)

    def fp8_rowwise():
        e4m3 = torch.float8_e4m3fn
        sx = x.float().abs().amax(-1) / 448
        sw = w.float().abs().amax(-1) / 448  # (E, N)
        xq = (x.float() / sx[:, None]).to(e4m3)
        wq = (w.float() / sw[..., None]).to(e4m3)
        exact = torch.einsum("mk,mnk->mn", xq.float() * sx[:, None], (wq.float() * sw[..., None])[seg])
        got = torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sx, sw, offs=offs, out_dtype=torch.bfloat16)
        return _rel(got, exact) + " vs the quantized operands' exact product"

    return [
        ("torch._grouped_mm bf16 (experts, offsets)", _probe(bf16)),
        ("torch._scaled_grouped_mm FP8 per row (experts)", _probe(fp8_rowwise)),
    ]


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
    timed = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events = sorted(timed, key=lambda e: e.self_device_time_total, reverse=True)[:4]
    top = "; ".join(f"{e.key[:70]} {e.self_device_time_total / 2:.0f} us" for e in events)
    total = sum(e.self_device_time_total for e in timed) / 2
    launches = sum(e.count for e in timed) / 2
    PROFILED.append(f"| {name} | {launches:.0f} kernels, {total:.0f} us on the GPU: {top} |")


def cudagraph_rows() -> None:
    """µs of one M = 1 call of the gate/up layer per preset: eager, compiled, and compiled with
    ``mode="reduce-overhead"`` (CUDA graphs: the launches replayed, no Python between kernels)."""
    n, k = SHAPES[0]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    print("\nOne call at M = 1 (µs): eager / compiled / compiled with CUDA graphs\n\n| variant | eager | compiled | reduce-overhead |\n|---|---|---|---|")
    for preset in (None, "int8 (W8A8 static)", "int4_weight_only g128", "fp8 (per tensor)", "fp8 per row, dynamic"):
        try:
            layer, _, _ = _layer(n, k, preset)
            with torch.no_grad():
                times = [_time_us(lambda f=layer: f(x))]
                for mode in ("default", "reduce-overhead"):
                    torch._dynamo.reset()
                    fn = torch.compile(layer, fullgraph=True, dynamic=False, mode=mode)
                    for _ in range(3):
                        fn(x)
                    times.append(_time_us(lambda f=fn: f(x)))
        except Exception as e:  # one variant failing must not hide the others' figures
            print(f"| {preset or 'bf16'} | failed: {_first_line(e)} |")
            continue
        print(f"| {preset or 'bf16'} | {' | '.join(f'{t:.1f}' for t in times)} |")


def decode_profiles() -> None:
    """The CUDA kernels of one M = 1 call of the gate/up layer per FP8 / W8A8 preset, eager and
    compiled (inductor): where the time of a decode step goes."""
    n, k = SHAPES[0]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for preset in ("fp8 (per tensor)", "fp8 per row, dynamic", "int8 (W8A8 static)"):
        layer, _, _ = _layer(n, k, preset)
        with torch.no_grad():
            _profile(f"{preset}, M = 1 eager", layer, x)
            torch._dynamo.reset()
            fn = torch.compile(layer, fullgraph=True, dynamic=False)
            _profile(f"{preset}, M = 1 compiled", fn, x)
    print("\nThe CUDA kernels of one call at M = 1 (top three by time)\n\n| variant | kernels |\n|---|---|")
    print("\n".join(PROFILED))
    PROFILED.clear()


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


def native_timings(m: int = 4096) -> None:
    """The native GEMMs alone at gate/up's (N, K) and M tokens (operands made beforehand: no
    quantization in the figure): bf16 F.linear, FP8 `_scaled_mm` per row, FP8 1x128 x 128x128
    blocks through `F.scaled_mm` (tq's `fp8_blockwise` today emulates it), and the experts' grouped
    GEMMs over 8 experts of M/8 rows each (bf16 `_grouped_mm`, FP8 per-row `_scaled_grouped_mm`)."""
    n, k = SHAPES[0]
    dev, e4m3 = "cuda", torch.float8_e4m3fn
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    xq, wq = x.to(e4m3), w.to(e4m3)
    rows = [("bf16 F.linear", lambda: F.linear(x, w))]
    sx, sw = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    rows.append(("FP8 _scaled_mm per row", lambda: torch._scaled_mm(xq, wq.t(), sx, sw, out_dtype=torch.bfloat16)))

    def blockwise():
        from torch.nn.functional import ScalingType

        ba = torch.ones(k // 128, m, device=dev).t()
        bb = torch.ones(n // 128, k // 128, device=dev).t()
        return F.scaled_mm(xq, wq.t(), ba, ScalingType.BlockWise1x128, bb, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

    rows.append(("FP8 F.scaled_mm 1x128 x 128x128", blockwise))
    e = 8
    we = torch.randn(e, n // 4, k, device=dev, dtype=torch.bfloat16)  # 8 experts of N/4 rows: the bf16 layer's bytes x 2
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (m // e)
    weq, swe = we.to(e4m3), torch.ones(e, n // 4, device=dev)
    rows.append(("bf16 _grouped_mm, 8 experts (N/4 each)", lambda: torch._grouped_mm(x, we.transpose(-2, -1), offs=offs)))
    rows.append((
        "FP8 _scaled_grouped_mm per row, 8 experts",
        lambda: torch._scaled_grouped_mm(xq, weq.transpose(-2, -1), sx.view(-1), swe, offs=offs, out_dtype=torch.bfloat16),
    ))
    print(f"\nNative GEMMs alone, (N, K) = {(n, k)}, M = {m} (µs, median, L2 flushed)\n")
    print("| GEMM | µs | TFLOP/s |\n|---|---|---|")
    for name, fn in rows:
        try:
            fn()
            us = _time_us(fn)
        except Exception as e:  # a refusal is the row's answer
            print(f"| {name} | refused: {_first_line(e)} | - |")
            continue
        flops = 2 * m * k * (n if "experts" not in name else n // 4)
        print(f"| {name} | {us:.1f} | {flops / us / 1e6:.0f} |")


EXPERT_PRESETS = ("int8", "int8_dynamic", "int4_weight_only", "int8_weight_only", "fp8", "mxfp4_weight_only", "nvfp4")


def experts_table(tokens: tuple[int, ...] = (1, 32, 4096), compiled: tuple[str, ...] = (), profile: bool = False) -> None:
    """One Mixtral-8x7B MoE block (8 experts, 4096 -> 14336 -> 4096, top 2), bf16 on the GPU; its
    experts alone calibrated with ``max`` per preset and `tq.compress`-ed: the experts GEMMs'
    kernel and µs a call of the block at T tokens against bf16 (transformers' grouped_mm experts)."""
    import copy

    import transformers

    cfg = transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().model.layers[0].mlp
    xs = {t: torch.randn(1, t, 4096, device="cuda", dtype=torch.bfloat16) for t in tokens}
    keep = tq.calibration.QuantRule.disable(module_types=(nn.Linear,), must_match=False)
    print(f"\nMixtral-8x7B MoE block (8 experts top 2), bf16, µs a call at T = {', '.join(map(str, tokens))} tokens\n")
    print("| experts | kernel | µs | × bf16 at T = 1 / max | experts GB | rel. error vs calibrated (T = 32) |\n|---|---|---|---|---|---|")
    ref_us = None
    for preset in (None, *EXPERT_PRESETS):
        try:
            block = base if preset is None else copy.deepcopy(base)
            err, kernel = "-", "grouped_mm (bf16)"
            if preset is not None:
                tq.calibrate(block, getattr(tq.configs, preset)().with_rules(keep), lambda b: b(xs[32]), progress=False)
                with torch.no_grad():
                    ref = block(xs[32])
                tq.compress(block)
                kernel = ", ".join(sorted({r.kernel for r in tq.deploy.deployed_layers(block)}))
                with torch.no_grad():
                    out = block(xs[32])
                err = f"{float((out.float() - ref.float()).norm() / ref.float().norm()):.1e}"
            comp = ""
            with torch.no_grad():
                us = [_time_us(lambda x=xs[t], f=block: f(x)) for t in tokens]
                if (preset or "bf16") in compiled:
                    torch._dynamo.reset()
                    fn = torch.compile(block, fullgraph=True, dynamic=False)
                    comp = "; compiled " + " / ".join(f"{_time_us(lambda x=xs[t], f=fn: f(x)):.0f}" for t in tokens)
            if profile:
                with torch.no_grad():
                    _profile(f"experts {preset or 'bf16'}, T = 1", block, xs[1])
            from tqcompile.deploy.modules import _bytes

            gb = sum(_bytes(p) for p in block.experts.parameters()) / 1e9
        except Exception as e:  # one variant failing must not hide the others' figures
            print(f"| {preset} | failed: {_first_line(e)} |")
            continue
        ref_us = ref_us or us
        print(
            f"| {preset or 'bf16'} | {kernel} | {' / '.join(f'{u:.0f}' for u in us)}{comp} | "
            f"{ref_us[0] / us[0]:.2f} / {ref_us[-1] / us[-1]:.2f} | {gb:.2f} | {err} |"
        )
        if block is not base:
            del block
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096], help="tokens per call")
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile(fullgraph=True) of each layer (first shape)")
    ap.add_argument("--profile", action="store_true", help="list the top CUDA kernels of each variant's eager call at the largest M")
    ap.add_argument("--experts", action="store_true", help="also time one Mixtral-8x7B MoE block per experts preset")
    ap.add_argument("--experts-compiled", nargs="*", default=[], help="experts presets (or bf16) also timed compiled")
    ap.add_argument("--profile-decode", action="store_true", help="profile FP8 and W8A8 layers at M = 1, eager and compiled")
    ap.add_argument("--cudagraphs", action="store_true", help="time M = 1 calls compiled with mode='reduce-overhead' too")
    ap.add_argument("--no-layers", action="store_true", help="skip the table of one layer per preset")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_kernels.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}\n")
    print("| entry point | result |\n|---|---|")
    for name, result in probes():
        print(f"| {name} | {result} |")
    native_timings()
    if args.experts:
        experts_table(compiled=tuple(args.experts_compiled), profile=args.profile_decode)
    if args.profile_decode:
        decode_profiles()
    if args.cudagraphs:
        cudagraph_rows()
    if not args.no_layers:
        layers(args.m, args.compiled, args.profile)
    if PROFILED:
        print(f"\nThe CUDA kernels of one eager call at M = {args.m[-1]}, first shape (torch.profiler: the top three by time)\n")
        print("| variant | kernels |\n|---|---|")
        print("\n".join(PROFILED))


if __name__ == "__main__":
    main()
