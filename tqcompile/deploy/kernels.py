"""Which kernel a deployed (packed) linear layer runs, and the kernels themselves.

One rule, `linear_kernel`, chooses per layer from the weight's quantizer, the input's quantizer
(None: weight-only), the weight's shape and the device (docs/support.md, "Deployed models"):

| kernel          | device | weight                         | input                          | call                                   |
|-----------------|--------|--------------------------------|--------------------------------|----------------------------------------|
| ``int_mm``      | CPU    | INT8, one scale per row        | INT8 per tensor or per token   | ``torch._int_mm`` (int32 sums)         |
| ``int8pack_mm`` | CPU    | INT8, one scale per row        | none (weight-only)             | ``torch._weight_int8pack_mm``          |
|                 |        |                                |                                | (M <= 64)                              |
| ``int4pack_mm`` | CPU    | INT4 (INT3, INT2 held in 4     | none (weight-only)             | ``torch._weight_int4pack_mm_for_cpu``  |
|                 |        | bits) in blocks of 32-256 of K,|                                | (M <= 128)                             |
|                 |        | or per row (K % 32 == 0)       |                                |                                        |
| ``int_mm``      | CUDA   | INT8, one scale per row        | INT8 per tensor or per token   | ``torch._int_mm`` (K, N % 8; M <= 16   |
|                 |        |                                |                                | padded to 32 rows)                     |
| ``int4pack_mm`` | CUDA   | INT4 (INT3, INT2) as on CPU,   | none (weight-only), bfloat16   | ``torch._weight_int4pack_mm``          |
|                 |        | N % 8 == 0, K % 32 == 0        |                                | (tinygemm, M <= 256)                   |
| ``scaled_mm``   | CUDA   | FP8, per tensor or per row     | FP8, per tensor or per row     | ``tqcompile::gemm_tn`` (`_scaled_mm`)  |
| ``dequantize``  | any    | anything else                  | anything                       | dequantized weight, ``F.linear``       |

The weight-only kernels are matrix-vector kernels: a call of more tokens than the M bound
(prefill) runs ``F.linear`` on the dequantized weight (`_WEIGHT_ONLY_MAX_M`).

An experts GEMM ((E, N, K) weights) takes the CPU rows of this table (``int_mm``, ``int8pack_mm``,
``int4pack_mm``) where its dense (N, K) layer would, called per expert with rows, the bound
applying per expert (`experts_kernel`, `tqcompile.deploy.experts_mm`); on CUDA's Hopper and
Blackwell, FP8 E4M3 experts (per tensor or per row, both operands, bfloat16) run
``scaled_grouped_mm``, one ``torch._scaled_grouped_mm`` for all experts (each row's scale its
expert's or its own; K, N % 16); every other experts GEMM dequantizes its routed experts.

``int8_triton`` (CUDA, INT8 weight-only: ``tqcompile::int8_weight_only_mm``, a Triton kernel that
reads the int8 weight, `tqcompile.kernels.triton.int8_mm`) is within its bound on an H200 but
slower than bf16 there at every size (docs/gpu.md), so the rule does not choose it: a layer runs
it where its ``tq_kernel`` is set to it (benchmarks/bench_cuda_kernels.py does, to time it).

``dequantize`` computes exactly what the calibrated model computes (the same quantize and
dequantize ops): bit for bit. The integer kernels sum in another order and with other scale
roundings (``_weight_int8pack_mm`` and the INT4 kernel take their scales in the activation dtype;
``_int_mm`` sums the integer codes exactly and scales in fp32); the difference to the calibrated
model is measured per format in tests/test_deploy.py and stated in docs/deploy.md.

The kernels are aten ops with meta kernels, called in the module's forward: fullgraph compile
traces them without a graph break, inductor calls them as external kernels (a custom op around
them measured ~7% slower INT4 decode: each call goes back through Python) and fuses the
activation's quantization (the decomposed `tqcompile::quantize`, `tqcompile.ops.inductor`) and
the output scaling of ``int_mm`` around them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tqcompile import ops
from tqcompile.formats import Format
from tqcompile.ops.grouped_gemm import scaled_grouped_mm_applies
from tqcompile.quantizers import Granularity, Quantizer

__all__ = ["KERNELS", "linear_kernel", "experts_kernel", "packed_linear", "weight_only_mm", "INT4_BLOCKS", "int4_kernel_block"]

KERNELS = ("int_mm", "int8pack_mm", "int4pack_mm", "scaled_mm", "scaled_grouped_mm", "int8_triton", "dequantize")
# The most tokens a call of CUDA's INT4 kernel takes; more run the dequantized weight through
# F.linear (tensor cores). Measured on an H200 (torch 2.11, a 14336 x 4096 bf16 layer): tinygemm
# 22-24 us at M = 1 (1.7-1.9x bf16's 40 us), 72 us at M = 16, 1036 us at M = 256 and 16.4 ms at
# M = 4096 (bf16: 50 us, 600 us). (CUDA's `_weight_int8pack_mm` is not used: a one-thread-per-
# output loop, 287 us at M = 1 and 2144 us at M = 16 on the same layer.)
_CUDA_INT4_MAX_M = 256
# The CPU's weight-only kernels are matrix-vector kernels too (their time grows linearly with the
# tokens: 0.55x bf16 at prefill); above these token counts a call runs F.linear on the dequantized
# weight instead (bf16 GEMM). Measured on this project's 2-core AMD EPYC (AVX-512, no AMX), one
# thread, torch 2.13, (2816, 1024) and (1024, 2816) bf16 layers, eager and compiled: INT8 at 64
# tokens 2.1-2.4 ms kernel against 1.2-2.3 ms dequantized (1.9x faster at 256); INT4 at 128 tokens
# 4.2-4.8 ms against 3.6-4.6 ms (1.5x faster at 256). The INT8 weight dequantizes exactly as the
# calibrated model's (bit for bit its layer); the INT4 one is the kernel's weight.
_WEIGHT_ONLY_MAX_M = {("cpu", "int8pack_mm"): 64, ("cpu", "int4pack_mm"): 128, ("cuda", "int4pack_mm"): _CUDA_INT4_MAX_M}
_WEIGHT_ONLY = ("int8pack_mm", "int4pack_mm", "int8_triton")
# Group sizes the CPU INT4 kernel takes (torch 2.11-2.14: 32, 64, 128, 256).
INT4_BLOCKS = (32, 64, 128, 256)


def _int8_rows(q: Quantizer | None) -> bool:
    """INT8 with one scale per row of the (N, K) weight (per output channel), no zero point (the
    INT8 kernels take none)."""
    if q is None or q.element_format() is not Format.INT8 or q.has_zero_point():
        return False
    gran, axis, _ = q.layout()
    return gran is Granularity.ROWWISE and axis == -1


def _int8_activation(q: Quantizer | None) -> bool:
    """INT8 activations with one scale per tensor or per token (a row of the (M, K) input)."""
    if q is None or q.element_format() is not Format.INT8:
        return False
    gran, axis, _ = q.layout()
    return gran is Granularity.TENSORWISE or (gran is Granularity.ROWWISE and axis == -1)


def int4_kernel_block(q: Quantizer, k: int) -> int | None:
    """The block size the CPU INT4 kernel runs an INT4 weight of input dim `k` with: its own 1-D
    block, or for one scale per row the largest kernel block dividing `k` (every block of a row
    then carries the row's scale: the same weight). None where the kernel takes none."""
    gran, _, block = q.layout()
    if gran is Granularity.ROWWISE:
        return next((b for b in reversed(INT4_BLOCKS) if k % b == 0), None)
    return block if block in INT4_BLOCKS else None


def _int4_grain(q: Quantizer) -> str:
    gran, _, block = q.layout()
    return "one scale per output channel" if gran is Granularity.ROWWISE else f"blocks of {block}"


def _int4_weight_only(weight_q: Quantizer, input_q: Quantizer | None) -> bool:
    gran, axis, _ = weight_q.layout()
    fmt = weight_q.element_format()
    return fmt.is_int and fmt.bits <= 4 and input_q is None and axis == -1 and gran in (Granularity.BLOCKWISE_1D, Granularity.ROWWISE)


def _int4_kernel(weight_q: Quantizer, n: int, k: int, device: str, dtype: torch.dtype) -> tuple[str, str]:
    """The INT4 weight-only row of the rule: the device's INT4 kernel where its shape rules hold."""
    name, block = weight_q.element_format().name, int4_kernel_block(weight_q, k)
    where = "the CPU INT4 kernel" if device == "cpu" else "CUDA's INT4 kernel (tinygemm)"
    if device == "cuda" and dtype != torch.bfloat16:
        return "dequantize", f"{name} weight-only in {dtype}: {where} takes bfloat16 activations only"
    if block is None:
        return "dequantize", f"{name} {_int4_grain(weight_q)} on K={k}: {where} takes blocks of {INT4_BLOCKS}"
    n_mult = 64 if device == "cpu" else 8  # blocks are multiples of 32: CUDA's K % 32 holds with K % block
    if n % n_mult or k % block:
        return "dequantize", f"{name} weight of shape {(n, k)}: {where} wants N % {n_mult} == 0 and K % {block} == 0"
    why = f"{name} weight-only, {_int4_grain(weight_q)}" + (f" (as blocks of {block})" if weight_q.layout()[0] is Granularity.ROWWISE else "")
    return "int4pack_mm", why + ("" if weight_q.element_format().bits == 4 else ": its codes in the INT4 kernel's 4 bits")


def linear_kernel(
    weight_q: Quantizer, input_q: Quantizer | None, shape: tuple[int, int], device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> tuple[str, str]:
    """(kernel, why) for a linear layer of (N, K) weight `shape` quantized by `weight_q`, whose
    input is quantized by `input_q` (None: weight-only), on `device`, in the model's `dtype`
    (the weight's: CUDA's INT4 kernel takes bfloat16 only). See the module docstring."""
    n, k = shape
    kind = torch.device(device).type
    gran = weight_q.layout()[0]
    if kind == "cpu":
        if _int8_rows(weight_q) and _int8_activation(input_q):
            return "int_mm", "INT8 weights per channel and INT8 activations: integer GEMM"
        if _int8_rows(weight_q) and input_q is None:
            return "int8pack_mm", "INT8 weight-only per channel"
        if _int4_weight_only(weight_q, input_q):
            return _int4_kernel(weight_q, n, k, kind, dtype)
    elif kind == "cuda":
        if _int8_rows(weight_q) and _int8_activation(input_q) and k % 8 == 0 and n % 8 == 0:
            return "int_mm", "INT8 weights per channel and INT8 activations: integer GEMM"
        if _int4_weight_only(weight_q, input_q):
            return _int4_kernel(weight_q, n, k, kind, dtype)
        if input_q is not None and weight_q.scaled_mm_operand() and input_q.scaled_mm_operand():
            grans = {gran, input_q.layout()[0]}
            if grans <= {Granularity.TENSORWISE, Granularity.ROWWISE} and len(grans) == 1:
                return "scaled_mm", "FP8 per tensor or per row on both operands: torch._scaled_mm"
    why = "no kernel for this format on this device: the dequantized weight and F.linear (exact)"
    return "dequantize", why


def experts_kernel(
    weight_q: Quantizer, input_q: Quantizer | None, shape: tuple[int, int, int], device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> tuple[str, str]:
    """(kernel, why) for a deployed experts GEMM of (E, N, K) weight `shape`: the CPU's integer
    kernels (INT8 weight-only, INT4 weight-only, W8A8) where `linear_kernel` gives one to a dense
    (N, K) layer of the same quantizers, called per routed expert (`tqcompile.deploy.experts_mm`);
    FP8 E4M3 experts on CUDA's Hopper/Blackwell ``scaled_grouped_mm`` (one
    ``torch._scaled_grouped_mm`` over every expert); otherwise ``dequantize`` (the routed
    experts' packed weights dequantized per call)."""
    kernel, why = linear_kernel(weight_q, input_q, shape[1:], device, dtype)
    if torch.device(device).type == "cpu" and kernel in ("int8pack_mm", "int4pack_mm", "int_mm"):
        return kernel, f"{why}: one kernel call per expert with rows"
    _, n, k = shape
    if input_q is not None and scaled_grouped_mm_applies(input_q, weight_q, k, n, torch.device(device), dtype):
        return "scaled_grouped_mm", "FP8 E4M3 per tensor or per row, bfloat16, on Hopper/Blackwell: one torch._scaled_grouped_mm"
    return "dequantize", "experts GEMM: no per-expert kernel for this format on this device; the routed experts' packed weights dequantized per call (exact)"


def weight_only_mm(x: torch.Tensor, weight, kernel_scale: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """``x @ W.T`` of the (M, K) activations and an INT8 (``int8pack_mm``: (N, K) int8 codes, with
    `kernel_scale` the (N,) scales in the activation dtype; ``int8_triton``: the weight's own
    codes and fp32 scales) or INT4 (``int4pack_mm``: an `Int4PackedCPUTensor`, the kernel's bytes
    and scales) weight.

    The scales are stored as the kernels read them (`tq.compress`): inductor's lowering of
    ``_weight_int8pack_mm`` asserts when its scales are a fused pointwise node, such as a cast
    (measured, torch 2.13), and a cast per call costs time. A cast happens here only when the
    activations' dtype is not the weight's (autocast)."""
    x = x.contiguous()
    if kernel == "int8pack_mm":
        s = kernel_scale if kernel_scale.dtype == x.dtype else kernel_scale.to(x.dtype)
        return torch._weight_int8pack_mm(x, weight._data, s)
    if kernel == "int4pack_mm" and x.device.type == "cuda":  # bfloat16 only: another dtype (autocast) goes through it
        y = torch._weight_int4pack_mm(x.to(torch.bfloat16), weight._data, weight.block_size, weight._scale_inv)
        return y.to(x.dtype)
    if kernel == "int4pack_mm":
        s = weight._scale_inv if weight._scale_inv.dtype == x.dtype else weight._scale_inv.to(x.dtype)
        return torch._weight_int4pack_mm_for_cpu(x, weight._data, weight.block_size, s)
    if kernel == "int8_triton":  # the codes and the calibrated fp32 scales, as the weight holds them
        return ops.int8_weight_only_mm(x, weight._data, weight._scale_inv.reshape(-1))
    raise ValueError(f"weight_only_mm: kernel={kernel!r}; allowed: {_WEIGHT_ONLY}")


def _quantized_input(x2: torch.Tensor, input_quantizer):
    """The (M, K) input quantized as the calibrated model's input quantizer quantizes it."""
    from tqcompile.tensor import quantize_usages

    q = input_quantizer.quantizer
    return quantize_usages(x2, None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=input_quantizer.amax)


def packed_linear(
    x: torch.Tensor, weight, bias: torch.Tensor | None, input_quantizer, kernel: str, kernel_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x W^T + b`` of a deployed layer: `weight` is its packed QuantizedTensor (an
    `Int4PackedCPUTensor` for ``int4pack_mm``), `input_quantizer` the calibrated input
    `TensorQuantizer` (disabled: weight-only), `kernel` what `linear_kernel` chose and
    `kernel_scale` the INT8 weight-only kernel's (N,) scales."""
    if kernel == "dequantize":
        return F.linear(input_quantizer(x), weight.dequantize(), bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if kernel in _WEIGHT_ONLY:
        most = _WEIGHT_ONLY_MAX_M.get((x.device.type, kernel))
        if most is not None and x2.shape[0] > most:  # a GEMM wins above (tensor cores on CUDA)
            return F.linear(x, weight.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
        y = weight_only_mm(x2, weight, kernel_scale, kernel)
    elif kernel == "int_mm":
        xq = _quantized_input(x2, input_quantizer)
        codes, m = xq._data, x2.shape[0]
        if x.device.type == "cuda" and m <= 16:  # CUDA's _int_mm wants M > 16: zero rows, their sums dropped
            codes = F.pad(codes, (0, 0, 0, 32 - m))
        acc = torch._int_mm(codes, weight._data.t())[:m]
        y = (acc.float() * xq._scale_inv.reshape(-1, 1) * weight._scale_inv.reshape(1, n)).to(x.dtype)
    elif kernel == "scaled_mm":
        xq = _quantized_input(x2, input_quantizer)
        y = ops.gemm_tn(xq._data, xq._scale_inv, xq._amax, xq.quantizer, weight._data, weight._scale_inv, weight._amax, weight.quantizer, x.dtype)
    else:
        raise ValueError(f"packed_linear: kernel={kernel!r} is not one of {KERNELS}")
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)
