"""`tqcompile::experts_weight_only_mm` and `tqcompile::experts_int_mm`: a deployed experts GEMM on
the CPU's integer kernels.

The CPU has no grouped INT8 or INT4 kernel, but it has the kernels the dense layers run
(``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``, ``torch._int_mm``:
`tqcompile.deploy.kernels`).
A deployed experts GEMM whose weights they can read calls them once per expert that has rows,
on that expert's segment of the rows (sorted by expert, ``ends`` the segments' ends): a decoding
step of top-k routing makes at most k calls per GEMM and reads only those experts' packed bytes,
with no dequantized copy. A segment of more rows than the kernel's bound (prefill; the dense
layers' `_WEIGHT_ONLY_MAX_M`) runs ``F.linear`` on that expert's dequantized weight instead, as a
dense layer does: INT8 the calibrated weight, INT4 the kernel's. W8A8 (``_int_mm``) has no
bound: its int32 sums are exact at any size.

The segments are data (the routing), so the loop runs inside a custom op with a fake kernel:
``torch.compile(fullgraph=True)`` traces it as one opaque call (no graph break, no recompile per
routing). Its numerics are the dense kernels' (scales in the activation dtype; the bound is in
docs/deploy.md and checked per expert in tests/test_deploy_experts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.kernels import reference
from tqcompile.quantizers import Quantizer

__all__ = ["experts_weight_only_mm", "experts_int_mm", "EXPERTS_KERNELS"]

# The experts GEMMs with a kernel (CPU); every other experts GEMM dequantizes its routed experts.
EXPERTS_KERNELS = ("int8pack_mm", "int4pack_mm", "int_mm")
_WEIGHT_ONLY = ("int8pack_mm", "int4pack_mm")


def _expert_dequantized(data, kernel_scale, scale_inv, q: Quantizer, kernel: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s (N, K) weight for a GEMM: INT8 the calibrated weight (codes times fp32
    scales), INT4 the kernel's (`Int4PackedCPUTensor.dequantize`)."""
    if kernel == "int8pack_mm":
        return reference.dequantize(data[e], scale_inv[e], None, q, dtype)
    n, k = data.shape[1], data.shape[2] * 2
    return Int4PackedCPUTensor((n, k), q, kernel_scale.dtype, None, _data=data[e], _scale_inv=kernel_scale[e]).dequantize(dtype)


@torch.library.custom_op("tqcompile::experts_weight_only_mm", mutates_args=())
def experts_weight_only_mm(
    x: torch.Tensor,
    data: torch.Tensor,
    kernel_scale: torch.Tensor,
    scale_inv: torch.Tensor,
    quantizer: Quantizer,
    ends: torch.Tensor,
    kernel: str,
    max_m: int,
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ W_e^T`` for each expert e of a packed experts weight.

    Args:
        x: (R, K) rows sorted by expert; rows ``ends[e-1]:ends[e]`` go to expert e.
        data: ``int8pack_mm``: (E, N, K) int8 codes; ``int4pack_mm``: (E, N, K / 2) bytes in the
            CPU INT4 kernel's layout (`Int4PackedCPUTensor`).
        kernel_scale: what the kernel reads: (E, N) scales in the model's dtype (INT8), or
            (E, K / block, N, 2) scales and zeros (INT4).
        scale_inv: the INT8 weight's fp32 (E, N, 1) scales (its calibrated weight above
            `max_m` rows); unused for INT4.
        quantizer: the weight's quantizer.
        ends: (E,) cumulative ends of the experts' segments.
        kernel: ``int8pack_mm`` or ``int4pack_mm``.
        max_m: the most rows an expert's segment runs through the kernel; more run ``F.linear``
            on the expert's dequantized weight.
    """
    if kernel not in _WEIGHT_ONLY:
        raise ValueError(f"experts_weight_only_mm: kernel={kernel!r}; allowed: {_WEIGHT_ONLY}")
    n = data.shape[1]
    out = x.new_zeros(x.shape[0], n)
    # The kernels take their scales in x's dtype (a cast only under autocast, as a dense layer's).
    s = kernel_scale if kernel_scale.dtype == x.dtype else kernel_scale.to(x.dtype)
    block = data.shape[2] * 2 // kernel_scale.shape[1] if kernel == "int4pack_mm" else 0
    lo = 0
    for e, hi in enumerate(ends.tolist()):
        if hi > lo:
            xs = x[lo:hi].contiguous()
            if hi - lo > max_m:
                out[lo:hi] = F.linear(xs, _expert_dequantized(data, kernel_scale, scale_inv, quantizer, kernel, e, x.dtype))
            elif kernel == "int8pack_mm":
                out[lo:hi] = torch._weight_int8pack_mm(xs, data[e], s[e])
            else:
                out[lo:hi] = torch._weight_int4pack_mm_for_cpu(xs, data[e], block, s[e])
        lo = max(lo, hi)
    return out


@experts_weight_only_mm.register_fake
def _experts_weight_only_mm_fake(x, data, kernel_scale, scale_inv, quantizer, ends, kernel, max_m):
    return x.new_empty(x.shape[0], data.shape[1])


@torch.library.custom_op("tqcompile::experts_int_mm", mutates_args=())
def experts_int_mm(
    codes: torch.Tensor, row_scale: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8 experts: ``y[rows of e] = (codes @ data[e]^T) * row_scale * scale_inv[e]^T`` in `out_dtype`,
    each expert's int32 sums by ``torch._int_mm`` and scaled in fp32, as a dense ``int_mm`` layer
    (`tqcompile.deploy.kernels.packed_linear`).

    Args:
        codes: (R, K) int8 activation codes, rows sorted by expert.
        row_scale: (R, 1) fp32: each row's activation scale (its expert's, or its own per token).
        data: (E, N, K) int8 weight codes; scale_inv: their (E, N, 1) fp32 scales per row.
        ends: (E,) cumulative ends of the experts' segments.
    """
    n = data.shape[1]
    out = torch.zeros(codes.shape[0], n, dtype=out_dtype, device=codes.device)
    lo = 0
    for e, hi in enumerate(ends.tolist()):
        if hi > lo:
            acc = torch._int_mm(codes[lo:hi].contiguous(), data[e].t())
            out[lo:hi] = (acc.float() * row_scale[lo:hi] * scale_inv[e].reshape(1, n)).to(out_dtype)
        lo = max(lo, hi)
    return out


@experts_int_mm.register_fake
def _experts_int_mm_fake(codes, row_scale, data, scale_inv, ends, out_dtype):
    return codes.new_empty(codes.shape[0], data.shape[1], dtype=out_dtype)
