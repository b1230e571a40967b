"""Triton building blocks that reproduce `tqcompile.kernels.reference` bit for bit.

Every rounding step of the reference is rebuilt here from operations whose result is fixed by
IEEE 754 (or is pure integer arithmetic), so that a GPU and the Triton interpreter produce the
same bits as torch on the CPU:

- **fp32 -> FP8 is integer code.** We never use Triton's float8 casts. The interpreter's
  downcast (triton 3.9, `_convert_float`) is wrong; measured with a one-line cast kernel:
  e4m3 1.96 -> 1.0 and 1.9375 -> 1.0 (the mantissa carry into the exponent is dropped; torch
  gives 2.0), 1.0625 -> 1.125 (ties round half-up; torch rounds to even: 1.0), and subnormals
  are off (0.0146484375 -> 0.013671875, torch 0.015625; 0.003 -> 2**-9, torch 2**-8); e5m2
  likewise (1.875 -> 1.0, 1.125 -> 1.25). `fp8_code` rounds to nearest-even on the fp32 bits
  exactly like c10's `fp8e4m3fn_from_fp32_value` / `fp8e5m2_from_fp32_value`, which torch's
  `.to(float8)` runs on CPU and CUDA alike, and encodes every NaN as 0x7F as the reference does.
- **Division is fp64 division rounded to fp32.** Triton's fp32 `/` lowers to the approximate
  `div.full.f32` on NVIDIA, and `tl.math.div_rn` calls libdevice `__nv_fdiv_rn`, which Triton
  links with nvvm-reflect-ftz on by default, so it flushes subnormal results (only recent Triton
  exempts it, triton-lang/triton#8557). fp64 `/` lowers to IEEE `div.rn.f64`; the quotient of two fp32 numbers rounded
  first to fp64 (53 bits >= 2 * 24 + 2) and then to fp32 equals the once-rounded fp32
  quotient, subnormal results included (double rounding is innocuous at that precision). The
  interpreter does the same arithmetic in numpy. Divisions happen once per scaling unit, not
  per element, except NVFP4's per-element ``x * s_enc / s_blk``.
- **No fused multiply-add can change a result**: no product here feeds an addition, and the
  kernels launch with `enable_fp_fusion=False` besides, which pins `mul.rn.f32` in the PTX.
- **Plain fp32 multiplies keep subnormals**: Triton's ftz setting only reaches libdevice
  calls, not `mul.f32` (triton-lang/triton#5735), and we call no libdevice function.
  `tests/test_triton_kernels.py` compiles every kernel for sm_90 and checks these claims in the PTX.
- **NaN handling by select**, never by `tl.maximum`/`tl.minimum`, whose NaN behaviour differs
  between hardware min/max and numpy: `torch.clamp` lets NaN through, and so does
  ``where(v > hi, hi, where(v < lo, lo, v))``.
- **Amaxes are integer maxima of the fp32 bit patterns of |x|** (non-negative floats order like
  their bits), with ±Inf and NaN replaced by 0 first, as the reference's `_finite_abs` does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_f32(ptr, offs, mask, IN_BF16: tl.constexpr):
    """Load elements as fp32. bf16 arrives as an int16 view and is widened by a shift (exact,
    and independent of how the interpreter emulates bf16)."""
    if IN_BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def finite_abs_bits(v):
    """fp32 bits of |v| with ±Inf and NaN mapped to 0 (`reference._finite_abs`)."""
    u = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(u < 0x7F800000, u, 0)


@triton.jit
def bits_to_f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def div_rn(num, den):
    """fp32 ``num / den`` rounded once to nearest-even (see the module docstring)."""
    return (num.to(tl.float64) / den.to(tl.float64)).to(tl.float32)


@triton.jit
def rdiv_rn(NUM: tl.constexpr, den):
    """fp32 ``NUM / den`` for a constant NUM (exact in fp32), rounded once."""
    return (NUM / den.to(tl.float64)).to(tl.float32)


@triton.jit
def div_const_rn(num, DEN: tl.constexpr):
    """fp32 ``num / DEN`` for a constant DEN (exact in fp32), rounded once."""
    return (num.to(tl.float64) / DEN).to(tl.float32)


@triton.jit
def clamp_min(a, lo):
    """`torch.clamp(a, min=lo)`: NaN stays NaN."""
    return tl.where(a < lo, lo, a)


@triton.jit
def fp8_scales(amax, eps, FMT_MAX: tl.constexpr, POW2: tl.constexpr):
    """(scale, scale_inv) of `tqcompile.quantizers.scaling.scale_from_amax` and ``1.0 / scale``."""
    scale = rdiv_rn(FMT_MAX, clamp_min(amax, eps))
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale_inv = rdiv_rn(1.0, scale)
    return scale, scale_inv


@triton.jit
def fp8_code(v, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """``clamp(v, -FMT_MAX, FMT_MAX).to(float8)`` as a uint8 code: round to nearest-even; every
    NaN -> 0x7F whatever its sign bit (`reference._cast_float8`)."""
    v = tl.where(v > FMT_MAX, FMT_MAX, tl.where(v < -FMT_MAX, -FMT_MAX, v))
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    u = bits & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MBITS
    # Normal FP8 range: re-bias the exponent, then round the dropped mantissa bits to even;
    # a carry out of the mantissa correctly bumps the exponent.
    normal = (u + ((BIAS - 127) << 23) + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)) >> DROP
    # Subnormal FP8 range: the code is |v| / 2**(1 - BIAS - MBITS) rounded to an integer
    # (nearest, ties to even) from the 24-bit significand. A code of 2**MBITS is the smallest
    # normal, which the encoding gets right without a special case.
    e = u >> 23
    sig = (u & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = (151 - BIAS - MBITS) - tl.maximum(e, 1)
    shift = tl.minimum(tl.maximum(shift, 1), 31)  # lanes outside the subnormal range are discarded
    q = sig >> shift
    rem = sig - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(u >= ((128 - BIAS) << 23), normal, sub) | sign
    return tl.where(u > 0x7F800000, 0x7F, code).to(tl.uint8)


@triton.jit
def e2m1_sign(v):
    """`reference._e2m1_sign`: bit 3 from v's sign bit, none for NaN."""
    negative = (v.to(tl.int32, bitcast=True) < 0) & (v == v)
    return negative.to(tl.int32) << 3


@triton.jit
def e2m1_code(v):
    """`reference.e2m1_encode`: nearest E2M1 code, ties to the even code, saturating; NaN -> 0;
    the sign bit comes from v's IEEE sign bit except for NaN (so -0.0 stays -0)."""
    mag = tl.abs(v)
    code = (mag > 0.25).to(tl.int32)
    code += (mag >= 0.75).to(tl.int32)
    code += (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32)
    code += (mag > 2.5).to(tl.int32)
    code += (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    return code | e2m1_sign(v)


@triton.jit
def e4m3_decode(code):
    """float8_e4m3fn code (int32, 0..0x7E, non-negative) -> fp32, exactly."""
    exp = code >> 3
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    subnormal = man.to(tl.float32) * 0.001953125  # man * 2**-9, exact
    return tl.where(exp > 0, normal, subnormal)


@triton.jit
def mx_exponent(amax, RCEIL: tl.constexpr, EMAX: tl.constexpr, FMT_MAX: tl.constexpr):
    """`reference._mx_exponent`: the unbiased E8M0 exponent (int32) of each block amax.

    FLOOR is ``frexp(amax)[1] - 1 - emax``, read off the exponent field (a subnormal amax clamps
    to -127 either way). RCEIL is ``ceil(log2(r))`` of ``r = amax / FMT_MAX`` rounded to fp32,
    also from r's bits; for a subnormal r the clamp leaves only -126 (r > 2**-127) or -127, and
    r == 0 (an amax that underflows the division) gives -127, as an all-zero block does.
    """
    if RCEIL:
        r = div_const_rn(amax, FMT_MAX)
        rb = r.to(tl.int32, bitcast=True)
        rexp = rb >> 23
        e_normal = rexp - 127 + ((rb & 0x7FFFFF) != 0).to(tl.int32)
        e_subnormal = tl.where(rb > 0x400000, -126, -127)
        e = tl.where(rexp > 0, e_normal, tl.where(rb == 0, -127, e_subnormal))
    else:
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX
    e = tl.where(amax > 0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def pow2_neg(e):
    """2**-e as fp32 from its bits. Exact and normal for e in [-127, 126]; no MX rule produces
    e = 127 (FLOOR tops out at 127 - emax, RCEIL at ceil(log2(fp32_max / 6)) = 126)."""
    return ((127 - e) << 23).to(tl.float32, bitcast=True)
