"""The quantized GEMM, and the amax-history update of delayed scaling.

All three GEMMs of a linear layer are written in one "TN" form, ``out = a @ b.T`` with both
operands quantized along the reduction dim K (their last dim):

- fprop  y  = x  @ W.T : a = x rowwise (M, K),    b = W rowwise (N, K)
- dgrad  dx = dy @ W   : a = dy rowwise (M, N),   b = W columnwise (K, N)
- wgrad  dW = dy.T @ x : a = dy columnwise (N, M), b = x columnwise (K, M)

so one op serves them all. It uses `torch._scaled_mm` where that applies (FP8 tensorwise or
rowwise scales), and otherwise an explicit emulation: dequantize both operands to fp32 and matmul
(MX, NVFP4, FP8 blocks, INT). On CPU (torch 2.13) `_scaled_mm` equals the emulation up to fp32
summation order: bit for bit where the sums are exact, otherwise within fp32 accumulation error
(some shapes sum in another order and differ by an ulp; measured in tests/test_gemm_ops.py).

Overflow: the emulation dequantizes with saturation (`reference.dequantize`), so a finite input
never becomes ±Inf in an operand. On CPU, FP8 tensorwise/rowwise pairs do not call
`torch._scaled_mm`: `reference.fp8_gemm_cpu` computes what CPU `_scaled_mm` computes, in the same order (bit
for bit equal to it where it is finite), with the saturating dequantize (finite where it would
overflow), in plain torch ops that inductor can fuse. CUDA keeps `torch._scaled_mm`.
"""

from __future__ import annotations

import torch

from tqcompile.kernels import reference
from tqcompile.ops.inductor import register_inductor_decompositions
from tqcompile.quantizers import Granularity, Quantizer


def _scaled_mm_applies(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_q: Quantizer,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_q: Quantizer,
    out_dtype: torch.dtype,
) -> bool:
    if not (a_q.scaled_mm_operand() and b_q.scaled_mm_operand()):
        return False
    # An empty operand (e.g. an MoE expert given no tokens): torch._scaled_mm rejects the (0, 1)
    # rowwise scale, whose stride is (1, 0); the emulation returns the empty/zero product.
    if 0 in (*a_data.shape, *b_data.shape):
        return False
    (a_gran, a_axis, _), (b_gran, b_axis, _) = a_q.layout(), b_q.layout()
    grans = {a_gran, b_gran}
    rowwise = grans == {Granularity.ROWWISE}
    if not (grans == {Granularity.TENSORWISE} or (rowwise and a_axis % 2 == 1 and b_axis % 2 == 1)):
        return False
    if a_data.device.type != "cuda":
        return False  # on CPU `reference.fp8_gemm_cpu` computes these pairs (see its docstring)
    # CUDA's FP8 GEMMs: K and N multiples of 16 (M is padded: `_scaled_mm_padded`), not both E5M2;
    # rowwise wants E4M3 and bf16 out.
    dims_ok = a_data.shape[1] % 16 == 0 and b_data.shape[0] % 16 == 0
    a_fmt, b_fmt = a_q.element_format().name, b_q.element_format().name
    both_e5m2 = a_fmt == b_fmt == "E5M2"
    if rowwise:
        return dims_ok and a_fmt == b_fmt == "E4M3" and out_dtype is torch.bfloat16
    return dims_ok and not both_e5m2


def _scaled_mm_padded(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype) -> torch.Tensor:
    """`torch._scaled_mm` of ``a @ b.T``, `a`'s rows padded with zeros (and scales of 1) to a
    multiple of 16 and the padding's rows dropped: a decode step's few tokens run the FP8 GEMM too
    (each output row depends on its own row of `a` only)."""
    m = a_data.shape[0]
    pad = -m % 16
    # cuBLAS reads a scale through its pointer and refuses one that is not 16-byte aligned
    # (CUBLAS_STATUS_NOT_SUPPORTED, H200, torch 2.11): an expert's scale viewed out of an (E,) tensor.
    a_scale_inv = a_scale_inv if a_scale_inv.data_ptr() % 16 == 0 else a_scale_inv.clone()
    b_scale_inv = b_scale_inv if b_scale_inv.data_ptr() % 16 == 0 else b_scale_inv.clone()
    if pad:
        a_data = torch.nn.functional.pad(a_data.view(torch.uint8), (0, 0, 0, pad)).view(a_data.dtype)  # byte 0: +0.0
        if a_scale_inv.dim() == 2:  # one scale a row
            a_scale_inv = torch.nn.functional.pad(a_scale_inv, (0, 0, 0, pad), value=1.0)
    out = torch._scaled_mm(a_data, b_data.t(), scale_a=a_scale_inv, scale_b=b_scale_inv.t(), out_dtype=out_dtype)
    return out[:m] if pad else out


@torch.library.custom_op("tqcompile::gemm_tn", mutates_args=())
def gemm_tn(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_amax: torch.Tensor | None,
    a_quantizer: Quantizer,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_amax: torch.Tensor | None,
    b_quantizer: Quantizer,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T`` of two 2-D quantized operands, both quantized along their last dim (K)."""
    # In eager mode a custom op's kernel runs under the caller's autocast, which would make the
    # fp32 emulation's matmul (and CPU `_scaled_mm`, which matmuls inside) bf16, and differ from the
    # compiled graph, whose kernels run without it.
    with torch.autocast(a_data.device.type, enabled=False):
        if reference.fp8_pair_on_cpu(a_data, a_quantizer, b_data, b_quantizer):
            return reference.fp8_gemm_cpu(a_data, a_scale_inv, a_quantizer, b_data, b_scale_inv, b_quantizer, out_dtype)
        if _scaled_mm_applies(a_data, a_scale_inv, a_quantizer, b_data, b_scale_inv, b_quantizer, out_dtype):
            return _scaled_mm_padded(a_data, a_scale_inv, b_data, b_scale_inv, out_dtype)
        a = reference.dequantize(a_data, a_scale_inv, a_amax, a_quantizer, torch.float32)
        b = reference.dequantize(b_data, b_scale_inv, b_amax, b_quantizer, torch.float32)
        return (a @ b.t()).to(out_dtype)


@gemm_tn.register_fake
def _gemm_tn_fake(a_data, a_scale_inv, a_amax, a_quantizer, b_data, b_scale_inv, b_amax, b_quantizer, out_dtype):
    register_inductor_decompositions()
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


@torch.library.custom_op("tqcompile::amax_history_update", mutates_args=("history",))
def amax_history_update(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Delayed scaling: return the amax to scale with now (the max of the history window, or the
    current amax while the history is still all zeros, i.e. on the first step), then roll the
    history one place and write the current amax at index 0.

    `history` (L,) with a scalar `amax`; or (L, E) with an (E,) `amax`, one window per column
    (per expert, for grouped experts), returning (E,)."""
    window = history.amax(0)
    used = torch.where(window > 0, window, amax.to(history.dtype))
    history.copy_(torch.roll(history, 1, 0))
    history[0] = amax
    return used


@amax_history_update.register_fake
def _amax_history_update_fake(history, amax):
    return history.new_empty(history.shape[1:])


@torch.library.custom_op("tqcompile::int8_weight_only_mm", mutates_args=())
def int8_weight_only_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ codesᵀ) * scale`` in x's dtype: (M, K) activations, an (N, K) int8 weight's codes,
    its (N,) fp32 scales. The exact products summed in fp32, scaled in fp32, rounded once; on CUDA
    a Triton kernel that reads the int8 weight (`tqcompile.kernels.triton.int8_mm`), elsewhere
    this reference."""
    return ((x.float() @ codes.float().t()) * scale).to(x.dtype)


@int8_weight_only_mm.register_fake
def _int8_weight_only_mm_fake(x, codes, scale):
    return x.new_empty((x.shape[0], codes.shape[0]))


@int8_weight_only_mm.register_kernel("cuda")
def _int8_weight_only_mm_cuda(x, codes, scale):
    from tqcompile.kernels.triton.int8_mm import int8_weight_only_mm as triton_kernel  # Triton only where CUDA runs

    return triton_kernel(x, codes, scale)
