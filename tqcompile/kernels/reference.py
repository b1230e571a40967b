"""Reference kernels in plain torch. They *define* tqcompile's numerics; every other kernel must
match them bit for bit (payload bytes and scales).

Conventions, used everywhere:
- `scale` multiplies high precision into the format; `scale_inv = 1 / scale` dequantizes.
- Everything is computed in fp32. Amaxes ignore non-finite values (NaN, ±Inf), so scales are
  always finite; ±Inf saturates to ±max; NaN stays NaN in FP8 payloads and becomes 0 in formats
  with no NaN encoding (E2M1, INT8, INT4). Exception: an NVFP4 block whose finite amax gives a
  zero E4M3 block scale has nothing to scale by, so all its elements (±Inf included) encode 0.
- Dequantization saturates: a product ``q * scale_inv`` beyond the output dtype's largest finite
  value returns that value (NaN stays NaN), so no finite input ever dequantizes to ±Inf. Only the
  top of a range needs it: the largest element can round *up* to a grid point whose product with
  scale_inv exceeds the dtype (power-of-two FP8 scales and MX RCEIL at 2**128 for an fp32 amax near
  its max, or 65536 for fp16's 65504; INT8's 127 * scale_inv, an ulp above fp32's max). Every
  product that was finite is unchanged bit for bit (stated in each docs/numerics page).
- Round to nearest, ties to even, unless a quantizer asks for stochastic rounding.
"""

from __future__ import annotations

import math

import torch

from tqcompile.formats import E2M1_VALUES, Format
from tqcompile.quantizers import (
    Float8Quantizer,
    Granularity,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    Quantizer,
    ScaleRounding,
)

__all__ = [
    "tensor_amax",
    "unit_amax",
    "quantize",
    "dequantize",
    "fp8_pair_on_cpu",
    "fp8_gemm_cpu",
    "e2m1_encode",
    "e2m1_decode",
    "tensor_scale_inv",
    "nvfp4_tensor_scale",
    "int_values",
    "hadamard_matrix",
    "uniform_hash",
]

_NVFP4_ENC = Format.E4M3.max_value * Format.E2M1.max_value  # 448 * 6
_MASK32 = 0xFFFFFFFF
_FP32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------
def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


def _unit_amax(a: torch.Tensor, layout: tuple[Granularity, int, int]) -> torch.Tensor:
    """Amax of each scaling unit of the (non-negative) tensor `a`, in the quantizer's scale shape."""
    gran, axis, block = layout
    if gran is Granularity.TENSORWISE:
        return a.amax() if a.numel() else a.new_zeros(())
    if gran is Granularity.ROWWISE:
        if a.shape[axis] == 0:
            return a.new_zeros(a.shape[: axis % a.dim()] + (1,) + a.shape[axis % a.dim() + 1 :])
        return a.amax(dim=axis, keepdim=True)
    if gran is Granularity.BLOCKWISE_1D:
        blocks = a.unflatten(-1, (a.shape[-1] // block, block))
        return blocks.amax(-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    blocks = a.unflatten(-1, (a.shape[-1] // block, block)).unflatten(-3, (a.shape[-2] // block, block))
    return blocks.amax((-3, -1)) if blocks.numel() else blocks.new_zeros(blocks.shape[:-3] + blocks.shape[-2:-1])


def _expand(scale: torch.Tensor, shape: torch.Size, layout: tuple[Granularity, int, int]) -> torch.Tensor:
    """Broadcast a per-unit tensor back to the element shape."""
    gran, _, block = layout
    if gran in (Granularity.TENSORWISE, Granularity.ROWWISE):
        return scale
    if gran is Granularity.BLOCKWISE_1D:
        scale = scale.reshape(*shape[:-1], shape[-1] // block)  # a columnwise usage's scales are flat
        return scale.unsqueeze(-1).expand(*scale.shape, block).reshape(shape)
    return scale[..., :, None, :, None].expand(*scale.shape[:-2], scale.shape[-2], block, scale.shape[-1], block).reshape(shape)


def _pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """Round positive normal fp32 values down to a power of two by clearing the mantissa bits."""
    return (x.view(torch.int32) & 0x7F800000).view(torch.float32)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8, last dim even) two to a byte, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def uniform_hash(seed: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1): element i gets hash(seed[0], seed[1] + i).

    `seed` is an int64 tensor ``[seed, offset]``. Pure integer arithmetic with every product
    below 2**63, so any device (and a Triton kernel) reproduces it bit for bit.
    """
    seed = seed.to(device=device, dtype=torch.int64)
    h = (torch.arange(numel, device=device, dtype=torch.int64) + seed[1]) & _MASK32
    h = h ^ ((seed[0] & 0x7FFFFFFF) * 0x2C1B3C6D & _MASK32)
    for _ in range(3):
        h = ((h >> 16) ^ h) * 0x045D9F3B & _MASK32
    h = (h >> 16) ^ h
    return (h >> 8).to(torch.float32) * (2.0**-24)


def hadamard_matrix(seed: int, device: torch.device | None = None) -> torch.Tensor:
    """The 16x16 random Hadamard transform ``diag(signs) @ H16 / 4`` (orthogonal)."""
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    bits = (uniform_hash(torch.tensor([seed, 0]), 16, torch.device("cpu")) < 0.5).float()
    signs = 1.0 - 2.0 * bits
    return (signs[:, None] * h / 4.0).to(device)


def _hadamard(x: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    m = hadamard_matrix(seed, x.device)
    if inverse:
        m = m.t()
    # Eager custom-op kernels run under the caller's autocast, which would make this matmul bf16.
    with torch.autocast(x.device.type, enabled=False):
        return (x.unflatten(-1, (x.shape[-1] // 16, 16)) @ m).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Element formats
# ---------------------------------------------------------------------------------------------
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_sign(v: torch.Tensor) -> torch.Tensor:
    """Bit 3 from v's IEEE sign bit (so -0.0 stays -0 and quantize(dequantize(q)) == q); NaN has none."""
    return (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code (uint8, sign in bit 3): nearest, ties to even mantissa, saturating at 6.
    NaN encodes as 0; the sign is kept for values that round to zero (-0.01 -> -0)."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, t in enumerate(_E2M1_THRESHOLDS):
        # A tie goes to the even code: up from an odd code i, down from an even one.
        up = (mag >= t) if i % 2 == 1 else (mag > t)
        code = code + up.to(torch.uint8)  # out of place: inductor traces this function (ops/inductor.py)
    return code | _e2m1_sign(v)


def _e2m1_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """E2M1 with stochastic rounding: up with probability (|v| - lo) / (hi - lo)."""
    grid = torch.tensor(E2M1_VALUES, device=v.device)
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=6.0)
    lo_code = (mag.unsqueeze(-1) >= grid[1:]).sum(-1)
    hi_code = (lo_code + 1).clamp(max=7)
    lo, hi = grid[lo_code], grid[hi_code]
    gap = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    up = u.reshape(v.shape) < (mag - lo) / gap
    code = torch.where(up, hi_code, lo_code).to(torch.uint8)
    return code | _e2m1_sign(v)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=code.device)
    return lut[code.long()]


def _cast_float8(v: torch.Tensor, fmt: Format) -> torch.Tensor:
    m = fmt.max_value
    # Every NaN encodes as +NaN (0x7F). Which sign bit torch leaves on a NaN is path-dependent: a
    # GPU multiply returns +NaN, a CPU one keeps its operand's sign, and CPU fp16 -> fp32 keeps it
    # on its vectorized path only (a 1-element -NaN fp16 tensor came out 0x7F, a 64-element one 0xFF).
    v = torch.where(torch.isnan(v), math.nan, v)
    return v.clamp(-m, m).to(fmt.torch_dtype)


def _div_scalar(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` rounded once on every device. (CUDA torch divides by a Python scalar as a
    multiply by its rounded reciprocal, which can be an ulp off; a same-device tensor divisor is a
    true division there and on the CPU.)"""
    return torch.div(t, t.new_full((), divisor))


def _e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """E8M0 (stored as float8_e8m0fnu) -> fp32 power of two, built from the bits (2**-127 is subnormal)."""
    bits = code.view(torch.uint8).to(torch.int32)
    normal = (bits << 23).view(torch.float32)
    return torch.where(bits == 0, torch.full_like(normal, 2.0**-127), normal)


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize, per family
# ---------------------------------------------------------------------------------------------
def _prepare(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    # Contiguous fp32: payloads and scales come out contiguous whatever the input strides.
    xf = x.float().contiguous()
    if q.hadamard_transformed():
        xf = _hadamard(xf, q.hadamard_seed)
    return xf


def tensor_amax(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The tensor-level amax (fp32, 0-dim) over finite values, after any transform `q` applies."""
    return _unit_amax(_finite_abs(_prepare(x, q)), (Granularity.TENSORWISE, -1, 1))


def unit_amax(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The amax of each scaling unit of `x` (fp32, shape ``q.scale_shape(x.shape)``) over finite
    values, after any transform: exactly the amax a dynamic `quantize(x, q, None, ...)` scales with
    for Float8 / Int quantizers, so passing it back as a static amax reproduces that call."""
    return _unit_amax(_finite_abs(_prepare(x, q)), q.layout())


def _scale_from_amax(amax: torch.Tensor, fmt_max: float, eps: float, power_of_two: bool) -> torch.Tensor:
    # torch.div, not `fmt_max / tensor`: Python's reflected division runs as reciprocal-then-multiply,
    # which rounds twice and is one ulp off the fp32 quotient (TE's __fdiv_rn) for about 1 amax in 4.
    scale = torch.div(fmt_max, amax.clamp(min=eps))
    return _pow2_floor(scale) if power_of_two else scale


def tensor_scale_inv(amax: torch.Tensor, q: Float8Quantizer | IntQuantizer) -> torch.Tensor:
    """The `scale_inv` a Float8 / Int quantizer stores for the static amax `amax` (any unit shape):
    ``1 / (fmt_max / max(amax, amax_epsilon))``, the scale rounded to a power of two first if the
    quantizer asks. What serving formats store as a static scale (they multiply by it)."""
    return 1.0 / _scale_from_amax(amax.float(), q.element_format().max_value, q.amax_epsilon, getattr(q, "power_of_two_scale", False))


def nvfp4_tensor_scale(amax: torch.Tensor, q: NVFP4Quantizer) -> torch.Tensor:
    """NVFP4's tensor-level encode scale ``s_enc = 448 * 6 / max(amax, amax_epsilon)``, rounded once
    (as in `_scale_from_amax`): compressed-tensors' global scale, ModelOpt's reciprocal."""
    return torch.div(_NVFP4_ENC, amax.float().clamp(min=q.amax_epsilon))


def int_values(data: torch.Tensor, q: IntQuantizer) -> torch.Tensor:
    """The signed integer values (int8) of an Int payload: INT4's two-a-byte nibbles unpacked."""
    if q.format is not Format.INT4:
        return data
    nib = _unpack_nibbles(data).to(torch.int16)
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def _quantize_scaled(xf, q, amax, fmt_max, eps, power_of_two=False):
    if amax is None:
        amax = _unit_amax(_finite_abs(xf), q.layout())
    scale = _scale_from_amax(amax, fmt_max, eps, power_of_two)
    return xf * _expand(scale, xf.shape, q.layout()), 1.0 / scale


def _mx_exponent(amax: torch.Tensor, q: MXQuantizer) -> torch.Tensor:
    """Unbiased block exponent e (int32), clamped to E8M0's range [-127, 127]."""
    if q.scale_rounding is ScaleRounding.FLOOR:
        mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
        e = (exp - 1) - q.format.emax
        nonzero = amax > 0
    else:
        ratio = _div_scalar(amax, q.format.max_value)
        mant, exp = torch.frexp(ratio)
        e = torch.where(mant == 0.5, exp - 1, exp)
        # A tiny amax whose ratio underflows to 0 gets the smallest scale, like an all-zero block.
        nonzero = ratio > 0
    e = torch.where(nonzero, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def quantize(
    x: torch.Tensor, q: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (any float dtype and strides) with `q`. Returns (payload, scale_inv) where
    scale_inv has `q.scale_shape(x.shape)` and dtype `q.scale_dtype()`. `amax` is the tensor-level
    amax for quantizers that use one (`q.uses_tensor_amax()`), already group-reduced."""
    data, scale_inv = _quantize(_prepare(x, q), q, amax, seed)
    return data.contiguous(), scale_inv.contiguous()


def _quantize(xf, q, amax, seed):
    if isinstance(q, Float8Quantizer):
        v, scale_inv = _quantize_scaled(xf, q, amax, q.format.max_value, q.amax_epsilon, q.power_of_two_scale)
        return _cast_float8(v, q.format), scale_inv
    if isinstance(q, IntQuantizer):
        qmax = q.format.max_value
        v, scale_inv = _quantize_scaled(xf, q, amax, qmax, q.amax_epsilon)
        ints = torch.nan_to_num(v, nan=0.0).clamp(-qmax, qmax).round().to(torch.int8)
        if q.format is Format.INT4:
            return _pack_nibbles(ints.view(torch.uint8) & 0xF), scale_inv
        return ints, scale_inv
    if isinstance(q, MXQuantizer):
        e = _mx_exponent(_unit_amax(_finite_abs(xf), q.layout()), q)
        scale_e8m0 = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        v = xf / _expand(_e8m0_decode(scale_e8m0), xf.shape, q.layout())
        if q.format is Format.E2M1:
            return _pack_nibbles(e2m1_encode(v)), scale_e8m0
        return _cast_float8(v, q.format), scale_e8m0
    if isinstance(q, NVFP4Quantizer):
        if amax is None:
            raise ValueError("NVFP4 quantize needs the tensor amax (tensor_amax(x, q), group-reduced)")
        s_enc = nvfp4_tensor_scale(amax, q)
        blk_amax = _unit_amax(_finite_abs(xf), q.layout())
        s_blk = (_div_scalar(blk_amax, Format.E2M1.max_value) * s_enc).clamp(max=Format.E4M3.max_value).to(torch.float8_e4m3fn)
        s_blk_f = _expand(s_blk.float(), xf.shape, q.layout())
        v = torch.where(s_blk_f == 0, torch.zeros_like(xf), xf * s_enc / s_blk_f)
        if q.stochastic_rounding:
            if seed is None:
                raise ValueError("NVFP4Quantizer(stochastic_rounding=True) needs a seed tensor [seed, offset]")
            codes = _e2m1_stochastic(v, uniform_hash(seed, v.numel(), v.device))
        else:
            codes = e2m1_encode(v)
        return _pack_nibbles(codes), s_blk
    raise TypeError(f"no reference kernel for quantizer type {type(q).__name__}")


def _saturate(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `out` cast to `dtype`, values beyond its finite range clamped to ±its max (NaN kept).

    Clamping before the cast, not after: fp32 -> bf16/fp16 rounds a value just above the target's
    max up to Inf. Values within range are untouched, so this changes only results that were ±Inf.
    """
    # The product is computed in fp32, so a wider dtype (float64) saturates at fp32's max too.
    big = min(torch.finfo(dtype).max, _FP32_MAX)
    return out.clamp(-big, big).to(dtype)


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None, q: Quantizer, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize`: payload and scales back to `dtype`, saturating at its largest
    finite value (see the module docstring: a finite payload never dequantizes to ±Inf)."""
    shape = torch.Size(q.logical_shape(data.shape))
    if isinstance(q, Float8Quantizer):
        out = data.float() * _expand(scale_inv, shape, q.layout())
    elif isinstance(q, IntQuantizer):
        out = int_values(data, q).float() * _expand(scale_inv, shape, q.layout())
    elif isinstance(q, MXQuantizer):
        vals = e2m1_decode(_unpack_nibbles(data)) if q.format is Format.E2M1 else data.float()
        out = vals * _expand(_e8m0_decode(scale_inv), shape, q.layout())
    elif isinstance(q, NVFP4Quantizer):
        s_enc = nvfp4_tensor_scale(amax, q)
        # The block's effective scale first, then one product: what compressed-tensors' decompressor
        # and the engines that load its checkpoints compute (`q * (weight_scale / weight_global_scale)`),
        # so an exported NVFP4 weight dequantizes there bit for bit as here.
        out = e2m1_decode(_unpack_nibbles(data)) * (_expand(scale_inv.float(), shape, q.layout()) / s_enc)
        if q.hadamard:
            out = _hadamard(out, q.hadamard_seed, inverse=True)
    else:
        raise TypeError(f"no reference kernel for quantizer type {type(q).__name__}")
    return _saturate(out, dtype)


# ---------------------------------------------------------------------------------------------
# The CPU FP8 GEMM (what CPU `torch._scaled_mm` computes), used by `tqcompile::gemm_tn` on CPU
# and handed to inductor as its decomposition (`tqcompile.ops.inductor`)
# ---------------------------------------------------------------------------------------------
def fp8_pair_on_cpu(a_data: torch.Tensor, a_q: Quantizer, b_data: torch.Tensor, b_q: Quantizer) -> bool:
    """FP8 operands with tensorwise scales, or rowwise scales along K, on the CPU: the pairs CPU
    `torch._scaled_mm` serves, which `fp8_gemm_cpu` computes instead."""
    if a_data.device.type != "cpu" or not (isinstance(a_q, Float8Quantizer) and isinstance(b_q, Float8Quantizer)):
        return False
    if 0 in (*a_data.shape, *b_data.shape):
        return False
    grans = {a_q.granularity, b_q.granularity}
    return grans == {Granularity.TENSORWISE} or (grans == {Granularity.ROWWISE} and a_q.axis % 2 == 1 and b_q.axis % 2 == 1)


def fp8_gemm_cpu(a_data, a_scale_inv, a_q, b_data, b_scale_inv, b_q, out_dtype) -> torch.Tensor:
    """``a @ b.T`` for an `fp8_pair_on_cpu` pair, computed as CPU `torch._scaled_mm` computes it
    (torch 2.13, `_scaled_mm_out_cpu_emulated`): each operand upcast to fp32 and multiplied by its
    scale, b transposed into a contiguous (K, N) matrix, one fp32 matmul, one cast. So it equals
    `_scaled_mm` bit for bit (same products, same BLAS call, same summation order) wherever that is
    finite; its dequantize saturates, so where `_scaled_mm` overflows to Inf this stays finite.
    Plain torch ops: inductor fuses the upcasts and scales (`tqcompile.ops.inductor`), which the
    opaque `_scaled_mm` runs as separate passes on every call."""
    a = dequantize(a_data, a_scale_inv, None, a_q, torch.float32)
    b = dequantize(b_data, b_scale_inv, None, b_q, torch.float32).t().contiguous()
    return torch.matmul(a, b).to(out_dtype)
