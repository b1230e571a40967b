"""Reference kernels in plain torch. They *define* tqcompile's numerics; every other kernel must
match them bit for bit (payload bytes and scales).

The math lives with what it belongs to: each element format's codec in `tqcompile.formats`
(encode / decode / pack), the scaling-unit geometry in `tqcompile.quantizers.geometry`, and each
quantizer family's scale rule in its own module (`tqcompile.quantizers.fp8`, `integer`, `mx`,
`nvfp4`: `reference_quantize` / `reference_dequantize`). This module is the entry point the ops
call, and states the conventions they all follow:

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

import torch

from tqcompile.formats import Format
from tqcompile.quantizers import Quantizer, geometry
from tqcompile.quantizers.nvfp4 import hadamard_matrix, nvfp4_tensor_scale, uniform_hash
from tqcompile.quantizers.scaling import finite_abs, saturate, scale_from_amax

__all__ = [
    "tensor_amax",
    "unit_amax",
    "transformed",
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

def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code (uint8, sign in bit 3): nearest, ties to even mantissa, saturating at 6.
    NaN encodes as 0; the sign is kept for values that round to zero (-0.01 -> -0)."""
    return Format.E2M1.codec.encode(v)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8) -> fp32 value."""
    return Format.E2M1.codec.decode(code)


def transformed(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """`x` as contiguous fp32 after the transform `q` applies (NVFP4's Hadamard; else unchanged).
    Contiguous: payloads and scales come out contiguous whatever the input strides."""
    return q.reference_transform(x.float().contiguous())


def tensor_amax(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The tensor-level amax (fp32, 0-dim) over finite values, after any transform `q` applies."""
    return geometry.unit_amax(finite_abs(transformed(x, q)), geometry.TENSOR)


def unit_amax(x: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The amax of each scaling unit of `x` (fp32, shape ``q.scale_shape(x.shape)``) over finite
    values, after any transform: exactly the amax a dynamic `quantize(x, q, None, ...)` scales with
    for Float8 / Int quantizers, so passing it back as a static amax reproduces that call."""
    return q.reference_unit_amax(transformed(x, q))


def tensor_scale_inv(amax: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The `scale_inv` a Float8 / Int quantizer stores for the static amax `amax` (any unit shape):
    ``1 / (fmt_max / max(amax, amax_epsilon))``, the scale rounded to a power of two first if the
    quantizer asks. What serving formats store as a static scale (they multiply by it)."""
    return 1.0 / scale_from_amax(amax.float(), q.scale_max(), q.amax_epsilon, getattr(q, "power_of_two_scale", False))


def int_values(data: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The signed integer values (int8) of an Int payload: INT4's two-a-byte nibbles unpacked."""
    codec = q.element_format().codec
    return codec.signed(codec.unpack(data))


def quantize(
    x: torch.Tensor, q: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (any float dtype and strides) with `q`. Returns (payload, scale_inv) where
    scale_inv has `q.scale_shape(x.shape)` and dtype `q.scale_dtype()`. `amax` is the tensor-level
    amax for quantizers that use one (`q.uses_tensor_amax()`), already group-reduced."""
    data, scale_inv = q.reference_quantize(transformed(x, q), amax, seed)
    return data.contiguous(), scale_inv.contiguous()


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None, q: Quantizer, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize`: payload and scales back to `dtype`, saturating at its largest
    finite value (see the module docstring: a finite payload never dequantizes to ±Inf)."""
    shape = torch.Size(q.logical_shape(data.shape))
    return saturate(q.reference_dequantize(data, scale_inv, amax, shape), dtype)


# ---------------------------------------------------------------------------------------------
# The CPU FP8 GEMM (what CPU `torch._scaled_mm` computes), used by `tqcompile::gemm_tn` on CPU
# and handed to inductor as its decomposition (`tqcompile.ops.inductor`)
# ---------------------------------------------------------------------------------------------
def fp8_pair_on_cpu(a_data: torch.Tensor, a_q: Quantizer, b_data: torch.Tensor, b_q: Quantizer) -> bool:
    """FP8 operands with tensorwise scales, or rowwise scales along K, on the CPU: the pairs CPU
    `torch._scaled_mm` serves, which `fp8_gemm_cpu` computes instead."""
    if a_data.device.type != "cpu" or not (a_q.scaled_mm_operand() and b_q.scaled_mm_operand()):
        return False
    if 0 in (*a_data.shape, *b_data.shape):
        return False
    (a_gran, a_axis, _), (b_gran, b_axis, _) = a_q.layout(), b_q.layout()
    grans = {a_gran, b_gran}
    return grans == {geometry.Granularity.TENSORWISE} or (grans == {geometry.Granularity.ROWWISE} and a_axis % 2 == 1 and b_axis % 2 == 1)


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
