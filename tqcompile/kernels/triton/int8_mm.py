"""A Triton kernel for INT8 weight-only linear layers on CUDA: ``y = (x @ codesᵀ) * scale``.

torch has no fast CUDA kernel for it: ``torch._weight_int8pack_mm`` on CUDA is a loop of one
thread per output (measured on an H200, torch 2.11, a (14336, 4096) bf16 layer: 287 us at one
token, 7x bf16's 40 us), and F.linear on the dequantized weight writes and reads a bf16 copy of
it on every call. This kernel reads the weight once, as int8 bytes: each program loads a
(BLOCK_N, BLOCK_K) tile of codes and a (BLOCK_M, BLOCK_K) tile of activations, widens both to
fp32 in registers and runs ``tl.dot`` on them, summing in fp32; the fp32 per-channel scales
multiply the fp32 sums once at the end. For bf16 and fp16 activations the dot runs on the tensor
cores in TF32, which is exact here: TF32 keeps 11 significant bits, an int8 code has at most 8, a
bf16 value 8 and an fp16 value 11, so every product is exact; fp32 activations take the exact
fp32 ("ieee") dot. (Not bf16 operands: Triton's interpreter, which runs the CPU tests, computes a
bf16 ``tl.dot`` and an int8-to-bf16 cast wrongly, measured with Triton 3.9; TF32 costs nothing at
the few tokens a decode step has, where the weight's bytes set the time. For the same reason bf16
activations and outputs travel as their int16 bits: widened by a shift, rounded to nearest even by
integer arithmetic, as the quantize kernels do, `_numerics`.) So its result is the exact product
of the activations and the codes, summed in fp32, times the calibrated model's fp32 scales,
rounded once to the output dtype: within (K + 1) * 2**-24 of sum |x||w| plus half an ulp of the
output (tests/test_triton_kernels.py, interpreted).

It is written for decode (a few tokens a call: one BLOCK_M tile of 16 rows covers them; tl.dot
takes 16 rows at least) and stays correct for any M. Not yet measured on a GPU: the deployment
rule (`tqcompile.deploy.kernels.linear_kernel`) does not choose it until a lent GPU has timed it
against bf16 (`benchmarks/bench_cuda_kernels.py`, row "int8_weight_only, Triton").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["int8_weight_only_mm"]

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _int8_weight_only_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    DTYPE: tl.constexpr,
    IN_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x_offs = rm[:, None].to(tl.int64) * stride_xm + k[None, :]
        x_mask = (rm[:, None] < M) & (k[None, :] < K)
        if IN_BF16:  # bf16 as its int16 bits, widened by a shift (`_numerics.load_f32`)
            x = (tl.load(x_ptr + x_offs, mask=x_mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0)
        # Both operands as fp32 (module docstring: exact products), summed in fp32.
        acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision=PRECISION, out_dtype=tl.float32)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = acc * scale[None, :]
    y_offs = rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if IN_BF16:  # rounded to the nearest bf16 (ties to even) on its bits, stored as int16
        bits = y.to(tl.uint32, bitcast=True)
        tl.store(y_ptr + y_offs, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=y_mask)
    else:
        tl.store(y_ptr + y_offs, y.to(DTYPE), mask=y_mask)


def int8_weight_only_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, N) ``(x @ codesᵀ) * scale`` of (M, K) activations (bf16, fp16 or fp32), (N, K) int8
    codes and (N,) fp32 scales, in x's dtype (module docstring)."""
    if x.dtype not in _DTYPES or codes.dtype != torch.int8 or scale.dtype != torch.float32:
        raise TypeError(
            f"int8_weight_only_mm: x {x.dtype} (allowed: {list(_DTYPES)}), codes {codes.dtype} (int8), scale {scale.dtype} (float32)"
        )
    (m, k), n = x.shape, codes.shape[0]
    if codes.shape != (n, k) or scale.shape != (n,):
        raise ValueError(f"int8_weight_only_mm: x {tuple(x.shape)}, codes {tuple(codes.shape)}, scale {tuple(scale.shape)}; want (M, K), (N, K), (N,)")
    x, codes = x.contiguous(), codes.contiguous()
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty(m, n, dtype=torch.int16 if bf16 else x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    block_k = 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int8_weight_only_kernel[grid](
        x.view(torch.int16) if bf16 else x, codes, scale, y, m, n, k, x.stride(0), codes.stride(0), y.stride(0),
        DTYPE=_DTYPES[x.dtype], IN_BF16=bf16, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y.view(torch.bfloat16) if bf16 else y
