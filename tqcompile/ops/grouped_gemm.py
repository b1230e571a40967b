"""Grouped (MoE) quantization and GEMM ops whose shapes never depend on the routing.

A token-choice MoE hands the experts T tokens sorted by expert plus per-expert token counts
(``m_splits``) that change every step. These ops take the counts as a tensor, as the cumulative
ends of each expert's segment (``ends[e] = m_0 + ... + m_e``, the `offs` of `torch._grouped_mm`),
so every output shape is a function of T, the number of experts E and the quantizer only: one
compiled graph serves every routing.

Two layouts of a grouped operand (payload, scale_inv, amax):

- **rowwise** (fprop's and dgrad's token operand): the (T, C) tensor quantized along C, expert
  e's tokens in rows ``ends[e-1]:ends[e]``. The weights use it too, as (E*N, K) with E equal
  segments of N rows. Only the per-expert tensor-level values are "grouped": a tensorwise
  `scale_inv` and NVFP4's `amax` have shape (E,); rowwise and block scales keep their usual shape.
- **columnwise** (wgrad's operands, quantized along the tokens): the (C, Tc) transpose, each
  expert's tokens starting at a multiple of the quantizer's block along the tokens (32 for MX,
  16 for NVFP4, 128 for 1x128 FP8, a packed group for sub-byte elements (2 for 4-bit), 1 otherwise), the gaps zero, so
  no block mixes two experts. Tc is the static worst case ``(T + E*(block-1)) // block * block``
  (T itself when block is 1). A tensorwise `scale_inv` and NVFP4's `amax` have shape (E,), a
  rowwise (per expert and row) `scale_inv` shape (E, C, 1), block scales their usual shape.

Cost of the padding: at most E*(block-1) extra token columns in each wgrad operand, i.e. for
E=8 experts, 8*31 = 248 extra columns for MXFP8 and 8*127 = 1016 for FP8 1x128 blocks, each
column C bytes of payload (C/2 for FP4) plus its scales, and in the wgrad GEMM's reduction up to
block-1 extra (zero) tokens per expert, as a per-expert GEMM on padded operands would have. The
quantize op also builds the padded transpose in high precision, a transient (C, Tc) buffer.

Every op here has a reference kernel in plain torch (`tqcompile.kernels.reference` does the
element math, so the numerics are exactly a per-expert `tq.quantize` / `gemm_tn`'s) and a fake
kernel. Data-dependent slicing happens only inside the real kernels, which are opaque to the
compiler.

GEMMs: `torch._grouped_mm` runs on CPU in torch 2.13 (every stride a multiple of 16 bytes) and,
in fp32, equals one matmul per expert bit for bit there, so the emulation (dequantize to fp32,
grouped matmul) uses it. `torch._scaled_grouped_mm` has no CPU kernel in torch 2.13 (CUDA
only: SM90+, E4M3 operands with rowwise fp32 scales, bf16 output, K and N multiples of 16); on
CPU the FP8 tensorwise/rowwise GEMMs run one `torch._scaled_mm` per expert inside the kernel, as
`tq.nn.linear` does, so they equal the per-expert loop bit for bit. On CUDA's Hopper/Blackwell
(`cuda_grouped_gemms`), fprop and dgrad run one `torch._scaled_grouped_mm` (E4M3 per tensor or
per row) or one bf16 `torch._grouped_mm` (high precision, and the fake-quantized experts of
`tq.calibrate`), no host sync; weight gradients and other GPUs run the per-expert loop.
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.kernels import reference
from tqcompile.kernels.reference import transformed
from tqcompile.ops.gemm import gemm_tn
from tqcompile.ops.inductor import (
    dequantize_decomposes,
    quantize_decomposes,
    register_decomposition,
    register_inductor_decompositions,
)
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.quantizers.scaling import finite_abs

__all__ = [
    "token_multiple",
    "equal_ends",
    "expert_ids",
    "padded_tokens",
    "grouped_amax",
    "grouped_quantize",
    "grouped_gemm_tn",
    "grouped_mm_wgrad",
    "grouped_dequantize",
    "grouped_mm",
    "grouped_scale_shape",
]

_BLOCKS = (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D)


# ---------------------------------------------------------------------------------------------
# Layout (static shapes; plain torch)
# ---------------------------------------------------------------------------------------------
def token_multiple(q: Quantizer) -> int:
    """Where each expert's tokens start in the columnwise layout: a multiple of this."""
    gran, _, block = q.layout()
    if gran in _BLOCKS:
        return block
    return q.element_format().pack_elements


def padded_tokens(num_tokens, num_experts: int, multiple: int):
    """Length of the columnwise layout: the worst case of the per-expert padding (works on SymInts)."""
    if multiple == 1:
        return num_tokens
    return (num_tokens + num_experts * (multiple - 1)) // multiple * multiple


def _counts(ends: torch.Tensor) -> torch.Tensor:
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _padded_ends(ends: torch.Tensor, multiple: int) -> torch.Tensor:
    if multiple == 1:
        return ends
    return ((_counts(ends) + multiple - 1) // multiple * multiple).cumsum(0)


def equal_ends(num_experts: int, rows: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Segment ends of `num_experts` equal segments of `rows` (stacked expert weights, a fixed capacity)."""
    return torch.arange(1, num_experts + 1, device=device, dtype=dtype) * rows


def expert_ids(ends: torch.Tensor, length) -> torch.Tensor:
    """Expert of each of `length` positions (tokens) given the segment `ends`; positions past the
    last end go to the last expert (they are padding: zeros). Static shapes."""
    pos = torch.arange(length, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, pos, right=True).clamp(max=ends.numel() - 1)  # out of place: it runs in decompositions


def _column_positions(ends: torch.Tensor, num_tokens, multiple: int) -> torch.Tensor:
    """Column of each token (in token order) in the padded columnwise layout."""
    if multiple == 1:
        return torch.arange(num_tokens, device=ends.device, dtype=ends.dtype)
    pends = _padded_ends(ends, multiple)
    shift = (pends - _counts(pends)) - (ends - _counts(ends))  # padded start - start, per expert
    return torch.arange(num_tokens, device=ends.device, dtype=ends.dtype) + shift[expert_ids(ends, num_tokens)]


def _columnwise_layout(x: torch.Tensor, ends: torch.Tensor, multiple: int) -> torch.Tensor:
    """The (C, Tc) padded transpose of the (T, C) tokens (see the module docstring)."""
    t, c = x.shape
    if multiple == 1:
        return x.t()
    out = x.new_zeros(c, padded_tokens(t, ends.numel(), multiple))
    return out.index_copy_(1, _column_positions(ends, t, multiple), x.t())


def grouped_scale_shape(q: Quantizer, shape: tuple[int, ...], num_experts: int, columnwise: bool) -> tuple[int, ...]:
    """Shape of a grouped operand's `scale_inv`, for a layout of `shape` (see the module docstring)."""
    gran = q.layout()[0]
    if gran is Granularity.TENSORWISE:
        return (num_experts,)
    if gran is Granularity.ROWWISE and columnwise:
        return (num_experts, shape[0], 1)
    return tuple(q.scale_shape(shape))


def _check_ends(ends: torch.Tensor, num_tokens: int | None, what: str) -> None:
    """Reject counts that are negative or do not sum to the token count (None: not known here).
    Checked where it costs no device sync (a CPU tensor); elsewhere bad counts give undefined results."""
    if ends.device.type != "cpu" or ends.numel() == 0:
        return
    counts = _counts(ends)
    if bool((counts < 0).any()) or (num_tokens is not None and int(ends[-1]) != num_tokens):
        total = "" if num_tokens is None else f" summing to the number of tokens {num_tokens}"
        raise ValueError(f"{what}: m_splits={counts.tolist()} must be non-negative per-expert token counts{total}")


def _segment_amax(per_position: torch.Tensor, ids: torch.Tensor, num_experts: int, dim: int = 0) -> torch.Tensor:
    """Max of `per_position` over each expert's positions along `dim` (0 for an expert with none)."""
    shape = list(per_position.shape)
    shape[dim] = num_experts
    index = ids.view([-1 if d == dim else 1 for d in range(per_position.dim())]).expand_as(per_position)
    return per_position.new_zeros(shape).scatter_reduce(dim, index, per_position, "amax", include_self=True)  # out of place: decompositions


def _per_expert_scale_inv(q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """The scale_inv the reference gives a tensor (or row) whose amax is `amax`, elementwise: the
    reference's own code on a zero tensor of the amax's shape, so the formula lives in one place."""
    row_q = dataclasses.replace(q, granularity=Granularity.ROWWISE, axis=-1)
    return reference.quantize(torch.zeros_like(amax), row_q, amax, None)[1]


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("tqcompile::grouped_amax", mutates_args=())
def grouped_amax(x: torch.Tensor, quantizer: Quantizer, ends: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """Per-expert tensor-level amax (fp32, shape (E,)) of the (T, C) tokens `x` grouped by `ends`,
    after the quantizer's transform in the rowwise or the columnwise layout (0 for an expert with
    no tokens). A scatter_reduce over token -> expert ids: static shapes."""
    _check_ends(ends, x.shape[0], "grouped_amax")
    return _grouped_amax(x, quantizer, ends, columnwise)


def _grouped_amax(x: torch.Tensor, quantizer: Quantizer, ends: torch.Tensor, columnwise: bool) -> torch.Tensor:
    num_experts = ends.numel()
    if columnwise and quantizer.hadamard_transformed():
        # The transform mixes tokens within a block: take the amax in the padded layout.
        multiple = token_multiple(quantizer)
        a = finite_abs(transformed(_columnwise_layout(x, ends, multiple), quantizer))
        ids = expert_ids(_padded_ends(ends, multiple), a.shape[1])
        per_position = a.amax(0) if a.shape[0] else a.new_zeros(a.shape[1])
    else:
        a = finite_abs(transformed(x, quantizer))
        ids = expert_ids(ends, a.shape[0])
        per_position = a.amax(1) if a.shape[1] else a.new_zeros(a.shape[0])
    return _segment_amax(per_position, ids, num_experts)


@grouped_amax.register_fake
def _grouped_amax_fake(x, quantizer, ends, columnwise):
    register_inductor_decompositions()  # traced: hand inductor the decompositions (tqcompile.ops.inductor)
    return x.new_empty((ends.shape[0],), dtype=torch.float32)


def _grouped_amax_decomposition(x, quantizer, ends, columnwise):
    """Inductor's, for the rowwise layout of the fusable quantizers (`quantize_decomposes`): the
    reference, so the amax fuses with the producer of `x` (an experts GEMM's input, per call)."""
    if columnwise or not quantize_decomposes(x, quantizer) or quantizer.hadamard_transformed():
        return NotImplemented
    return _grouped_amax(x, quantizer, ends, columnwise)


register_decomposition("grouped_amax", _grouped_amax_decomposition)


@torch.library.custom_op("tqcompile::grouped_quantize", mutates_args=())
def grouped_quantize(
    x: torch.Tensor,
    quantizer: Quantizer,
    ends: torch.Tensor,
    amax: torch.Tensor | None,
    seed: torch.Tensor | None,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale_inv) of the (T, C) tokens `x` grouped by `ends`, each expert with its own
    scales, in the rowwise or the padded columnwise layout (module docstring). `amax` is the
    (group-reduced) per-expert amax from `grouped_amax`, for quantizers with a tensor-level amax."""
    _check_ends(ends, x.shape[0], "grouped_quantize")
    return _grouped_quantize(x, quantizer, ends, amax, seed, columnwise)


def _grouped_quantize(x, quantizer: Quantizer, ends: torch.Tensor, amax, seed, columnwise: bool):
    num_experts = ends.numel()
    gran, axis, _ = quantizer.layout()
    multiple = token_multiple(quantizer)
    xs = _columnwise_layout(x, ends, multiple) if columnwise else x
    seg_dim = 1 if columnwise else 0
    ids = expert_ids(_padded_ends(ends, multiple) if columnwise else ends, xs.shape[seg_dim])
    if quantizer.has_global_scale() and (columnwise or gran is Granularity.BLOCKWISE_2D):
        # Block scales under a global scale (NVFP4) need the amax per block, the elements per element: one tensor cannot
        # broadcast to both when the expert segments run along the blocks (columnwise) or across
        # the tiles (16x16 weight tiles), so quantize each expert's segment on its own.
        return _quantize_per_segment(xs, quantizer, _padded_ends(ends, multiple) if columnwise else ends, amax, seed, seg_dim)
    if quantizer.uses_tensor_amax():
        # Each position gets its expert's amax, broadcast along the other dim: the reference's
        # elementwise math then equals a per-expert quantize with that expert's scalar amax.
        amax_pos = amax[ids].unsqueeze(1 - seg_dim)
        if gran is Granularity.TENSORWISE:
            row_q = dataclasses.replace(quantizer, granularity=Granularity.ROWWISE, axis=-1)
            data = reference.quantize(xs, row_q, amax_pos, seed)[0]
            return data, _per_expert_scale_inv(quantizer, amax)
        return reference.quantize(xs, quantizer, amax_pos, seed)  # NVFP4: block scales under the per-expert amax
    if gran is Granularity.ROWWISE and columnwise:
        # One scale per (row, expert): the row's amax over that expert's tokens.
        row_amax = _segment_amax(finite_abs(transformed(xs, quantizer)), ids, num_experts, dim=1)  # (C, E)
        data = reference.quantize(xs, quantizer, row_amax[:, ids], seed)[0]
        return data, _per_expert_scale_inv(quantizer, row_amax).t().unsqueeze(-1).contiguous()
    # Rowwise along C, and blocks (which never cross an expert's segment): the usual quantize.
    return reference.quantize(xs, quantizer, None, seed)


def _quantize_per_segment(xs, q: Quantizer, ends: torch.Tensor, amax: torch.Tensor, seed, dim: int):
    bounds = [0, *ends.tolist(), xs.shape[dim]]
    amaxes = [*amax.unbind(), amax.new_zeros(())]  # the tail past the last expert is zeros
    datas, scales = [], []
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = xs.narrow(dim, lo, hi - lo)
        # Disjoint random streams per segment: offset the counter by the elements before it.
        part_seed = None if seed is None else seed + torch.tensor([0, lo * xs.shape[1 - dim]], device=seed.device)
        d, si = reference.quantize(part, q, amaxes[e], part_seed)
        datas.append(d)
        scales.append(si)
    return torch.cat(datas, dim), torch.cat(scales, dim)


@grouped_quantize.register_fake
def _grouped_quantize_fake(x, quantizer, ends, amax, seed, columnwise):
    register_inductor_decompositions()  # traced: hand inductor the decompositions (tqcompile.ops.inductor)
    t, c = x.shape
    num_experts = ends.shape[0]
    shape = (c, padded_tokens(t, num_experts, token_multiple(quantizer))) if columnwise else (t, c)
    payload = x.new_empty(quantizer.payload_shape(shape), dtype=quantizer.element_format().storage_dtype)
    scale_inv = x.new_empty(grouped_scale_shape(quantizer, shape, num_experts, columnwise), dtype=quantizer.scale_dtype())
    return payload, scale_inv


def _grouped_quantize_decomposition(x, quantizer, ends, amax, seed, columnwise):
    """Inductor's, for the rowwise layout of the fusable quantizers (per-expert tensor scales, or
    one per token; no stochastic rounding): the reference, fused with its input's producer (a
    deployed W8A8 / FP8 experts GEMM quantizes its input on every call)."""
    if columnwise or seed is not None or not quantize_decomposes(x, quantizer) or quantizer.hadamard_transformed():
        return NotImplemented
    return _grouped_quantize(x, quantizer, ends, amax, seed, columnwise)


register_decomposition("grouped_quantize", _grouped_quantize_decomposition)


def _dequantize_grouped(
    data,
    scale_inv,
    amax,
    q: Quantizer,
    ends: torch.Tensor,
    num_tokens: int,
    columnwise: bool,
    unpad: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values (in `dtype`) of a grouped operand: (T, C) rowwise; (C, Tc) columnwise in its padded
    layout, or with `unpad` (C, T) in token order (the padding dropped after dequantizing, so a
    transform's inverse sees whole blocks)."""
    gran = q.layout()[0]
    multiple = token_multiple(q) if columnwise else 1
    seg_dim = 1 if columnwise else 0
    length = q.logical_shape(data.shape)[seg_dim]
    ids = expert_ids(_padded_ends(ends, multiple), length)
    if gran is Granularity.TENSORWISE:
        scale_inv = scale_inv[ids].unsqueeze(1 - seg_dim)
    elif gran is Granularity.ROWWISE and columnwise:
        scale_inv = scale_inv.squeeze(-1).t()[:, ids]  # (C, Tc): each column its expert's row scales
    if amax is not None:
        amax = amax[ids].unsqueeze(1 - seg_dim)
    out = reference.dequantize(data, scale_inv, amax, q, dtype)
    if unpad and multiple > 1:
        out = out.index_select(1, _column_positions(ends, num_tokens, multiple))
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D or 3-D) with a row stride that is a multiple of 16 bytes, as `torch._grouped_mm` wants."""
    per = 16 // t.element_size()
    if t.stride(-1) == 1 and t.stride(-2) % per == 0 and (t.dim() == 2 or t.stride(0) % per == 0):
        return t
    cols = -(-t.shape[-1] // per) * per
    buf = t.new_zeros(*t.shape[:-1], cols)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


def cuda_grouped_gemms(device: torch.device) -> bool:
    """Whether `device` runs CUDA's grouped GEMMs, `torch._grouped_mm` (bf16) and
    `torch._scaled_grouped_mm` (FP8 E4M3, rowwise fp32 scales): Hopper and Blackwell data-centre
    GPUs (SM 9.0 / 10.0) in torch's build; run on an H200 (docs/gpu.md)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] in (9, 10)


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=ends)` semantics: a (T, K) @ b (E, K, N) -> (T, N) with
    token segments, or a (N, T) @ b (T, K) -> (E, N, K) with segments along T.

    `torch._grouped_mm` for fp32 on CPU (bit for bit one matmul per expert there; it wants
    16-byte strides, hence `_aligned`) and for bf16 token segments on CUDA's Hopper/Blackwell (one
    launch, no host sync: its bf16 kernel, not a matmul per expert; the segments along T of a
    weight gradient keep the loop, as that kernel wants them 16-byte aligned); otherwise one
    matmul per expert: measured on CPU, its bf16 path differs from a bf16 matmul in the last bit."""
    num_experts = ends.numel()
    if a.device.type == "cpu" and num_experts and a.dtype is torch.float32:
        out_cols = b.shape[-1]
        if out_cols * a.element_size() % 16 == 0 and a.shape[-1] > 0:
            return torch._grouped_mm(_aligned(a), _aligned(b.transpose(-2, -1)).transpose(-2, -1), offs=ends.to(torch.int32))
    if num_experts and b.dim() == 3 and a.dtype is b.dtype is torch.bfloat16 and cuda_grouped_gemms(a.device) and 0 not in a.shape:
        return torch._grouped_mm(_aligned(a), _aligned(b.transpose(-2, -1)).transpose(-2, -1), offs=ends.to(torch.int32))
    bounds = [0, *ends.tolist()]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for e in range(num_experts):
            if bounds[e + 1] > bounds[e]:
                out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ b[e]
        return out
    out = a.new_zeros(num_experts, a.shape[0], b.shape[-1])
    for e in range(num_experts):
        if bounds[e + 1] > bounds[e]:
            out[e] = a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]]
    return out


def _scaled_family(a_q: Quantizer, b_q: Quantizer) -> bool:
    return a_q.scaled_mm_operand() and b_q.scaled_mm_operand()


def _segment(data, scale_inv, amax, q: Quantizer, e: int, lo: int, hi: int, columnwise: bool):
    """Expert e's (payload, scale_inv, amax) in the layout of a per-expert `tq.quantize`
    (tensorwise or rowwise quantizers: no padding, no packing)."""
    if q.layout()[0] is Granularity.TENSORWISE:
        s = scale_inv[e]
    else:
        s = scale_inv[e] if columnwise else scale_inv[lo:hi]
    d = data[:, lo:hi] if columnwise else data[lo:hi]
    return d, s, None if amax is None else amax[e]


def scaled_grouped_mm_applies(a_q: Quantizer, b_q: Quantizer, k: int, n: int, device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether CUDA's `torch._scaled_grouped_mm` computes fprop/dgrad of grouped `a_q` tokens and
    (E, N, K) `b_q` weights: E4M3 both, each per tensor (per expert) or per row along K, bf16
    out, K and N multiples of 16, on Hopper/Blackwell."""
    if not (a_q.scaled_mm_operand() and b_q.scaled_mm_operand()) or out_dtype is not torch.bfloat16:
        return False
    if a_q.element_format().name != "E4M3" or b_q.element_format().name != "E4M3" or k % 16 or n % 16:
        return False
    for q in (a_q, b_q):
        gran, axis, _ = q.layout()
        if not (gran is Granularity.TENSORWISE or (gran is Granularity.ROWWISE and axis % 2 == 1)):
            return False
    return cuda_grouped_gemms(device)


def _row_scales(scale_inv: torch.Tensor, q: Quantizer, ends: torch.Tensor, rows: int) -> torch.Tensor:
    """Each of `rows` grouped rows' fp32 scale: its expert's (per tensor) or its own (per row)."""
    if q.layout()[0] is Granularity.TENSORWISE:
        return scale_inv.reshape(-1).float()[expert_ids(ends, rows)]
    return scale_inv.reshape(-1).float()


def scaled_grouped_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, ends: torch.Tensor, out_dtype) -> torch.Tensor:
    """``a_e @ b_e.T`` per expert in one `torch._scaled_grouped_mm`: `a` (T, K) E4M3 tokens sorted
    by expert, a fp32 scale a row (T,); `b` E4M3 weights, (E, N, K) or (E*N, K), a fp32 scale a
    row (E, N). Within the FP8 GEMM's accumulation bound (tests/test_cuda.py)."""
    num_experts, n = scale_b.shape
    w = b.view(num_experts, n, -1).transpose(-2, -1)  # (E, K, N), column-major per expert
    return torch._scaled_grouped_mm(a, w, scale_a, scale_b, offs=ends.to(torch.int32), out_dtype=out_dtype)


def _scaled_grouped_mm(a_data, a_scale_inv, a_q, b_data, b_scale_inv, b_q, ends, out_dtype) -> torch.Tensor:
    """fprop/dgrad: grouped tokens and stacked weights, each row's scale its expert's or its own."""
    num_experts = ends.numel()
    n = b_data.shape[0] // num_experts
    w_ends = equal_ends(num_experts, n, ends.device, ends.dtype)
    scale_a = _row_scales(a_scale_inv, a_q, ends, a_data.shape[0])
    scale_b = _row_scales(b_scale_inv, b_q, w_ends, b_data.shape[0]).view(num_experts, n)
    return scaled_grouped_mm(a_data, scale_a, b_data, scale_b, ends, out_dtype)


def _scaled_family_gemm(a_data, a_scale_inv, a_amax, a_q, b_data, b_scale_inv, b_amax, b_q, ends, wgrad, out_dtype):
    # On CUDA's Hopper/Blackwell, fprop/dgrad of E4M3 per-tensor/per-row operands: one
    # `torch._scaled_grouped_mm`. Otherwise one `gemm_tn` per expert (`torch._scaled_mm` where it
    # applies, as in `tq.nn.linear`), so the result is the per-expert loop's bit for bit.
    num_experts = ends.numel()
    k = a_data.shape[1]
    if not wgrad and num_experts and a_data.shape[0] and scaled_grouped_mm_applies(a_q, b_q, k, b_data.shape[0] // num_experts, a_data.device, out_dtype):
        return _scaled_grouped_mm(a_data, a_scale_inv, a_q, b_data, b_scale_inv, b_q, ends, out_dtype)
    bounds = [0, *ends.tolist()]
    if wgrad:
        out = a_data.new_zeros(num_experts, a_data.shape[0], b_data.shape[0], dtype=out_dtype)
    else:
        n = b_data.shape[0] // num_experts
        out = a_data.new_zeros(a_data.shape[0], n, dtype=out_dtype)
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue  # no tokens: an empty output slice, or a zero weight gradient
        a = _segment(a_data, a_scale_inv, a_amax, a_q, e, lo, hi, wgrad)
        if wgrad:
            b = _segment(b_data, b_scale_inv, b_amax, b_q, e, lo, hi, True)
            out[e] = gemm_tn(*a, a_q, *b, b_q, out_dtype)
        else:
            b = _segment(b_data, b_scale_inv, b_amax, b_q, e, e * n, (e + 1) * n, False)
            out[lo:hi] = gemm_tn(*a, a_q, *b, b_q, out_dtype)
    return out


@torch.library.custom_op("tqcompile::grouped_gemm_tn", mutates_args=())
def grouped_gemm_tn(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_amax: torch.Tensor | None,
    a_quantizer: Quantizer,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_amax: torch.Tensor | None,
    b_quantizer: Quantizer,
    ends: torch.Tensor,
    wgrad: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The three GEMMs of grouped linear layers, per expert ``a_e @ b_e.T`` (as `gemm_tn`):

    - ``wgrad=False`` (fprop, dgrad): `a` the (T, K) rowwise grouped tokens, `b` the (E*N, K)
      stacked per-expert weights (rowwise, E segments of N rows); out (T, N).
    - ``wgrad=True``: `a` (N, Ta) and `b` (K, Tb), both columnwise grouped (each with its own
      padding); out (E, N, K), zero for an expert with no tokens.

    The output shape depends on T, N, K and E only, never on `ends`."""
    _check_ends(ends, None if wgrad else a_data.shape[0], "grouped_gemm_tn")
    # As in `gemm_tn`: the emulation's fp32 matmul must not run under the caller's autocast.
    with torch.autocast(a_data.device.type, enabled=False):
        if _scaled_family(a_quantizer, b_quantizer):
            return _scaled_family_gemm(
                a_data, a_scale_inv, a_amax, a_quantizer, b_data, b_scale_inv, b_amax, b_quantizer, ends, wgrad, out_dtype
            )
        num_experts = ends.numel()
        if wgrad:
            num_tokens = int(ends[-1]) if num_experts else 0
            multiple = token_multiple(a_quantizer)
            # Operands padded alike multiply in their padded layout (the padding adds zeros, or,
            # after a Hadamard transform's inverse, the same noise a padded per-expert GEMM sees);
            # otherwise both go back to token order.
            unpad = token_multiple(b_quantizer) != multiple
            a = _dequantize_grouped(a_data, a_scale_inv, a_amax, a_quantizer, ends, num_tokens, True, unpad)  # (N, Tc)
            b = _dequantize_grouped(b_data, b_scale_inv, b_amax, b_quantizer, ends, num_tokens, True, unpad)  # (K, Tc)
            seg_ends = ends if unpad else _padded_ends(ends, multiple)
            return _grouped_matmul(a, b.t(), seg_ends).to(out_dtype)
        a = _dequantize_grouped(a_data, a_scale_inv, a_amax, a_quantizer, ends, a_data.shape[0], False)  # (T, K)
        n = b_data.shape[0] // max(num_experts, 1)
        w_ends = equal_ends(num_experts, n, ends.device, ends.dtype)
        b = _dequantize_grouped(b_data, b_scale_inv, b_amax, b_quantizer, w_ends, b_data.shape[0], False)  # (E*N, K)
        return _grouped_matmul(a, b.view(num_experts, n, -1).transpose(1, 2), ends).to(out_dtype)


@grouped_gemm_tn.register_fake
def _grouped_gemm_tn_fake(
    a_data, a_scale_inv, a_amax, a_quantizer, b_data, b_scale_inv, b_amax, b_quantizer, ends, wgrad, out_dtype
):
    num_experts = ends.shape[0]
    if wgrad:
        return a_data.new_empty((num_experts, a_data.shape[0], b_data.shape[0]), dtype=out_dtype)
    return a_data.new_empty((a_data.shape[0], b_data.shape[0] // num_experts), dtype=out_dtype)


@torch.library.custom_op("tqcompile::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """High-precision wgrad of grouped linear layers: per expert ``dy_e.T @ x_e`` (dy (T, N), x
    (T, K), segments by `ends`) in dy's dtype, then cast to `out_dtype`; out (E, N, K)."""
    _check_ends(ends, dy.shape[0], "grouped_mm_wgrad")
    with torch.autocast(dy.device.type, enabled=False):  # as tq.nn.linear's high-precision wgrad
        return _grouped_matmul(dy.t(), x.to(dy.dtype), ends).to(out_dtype)


@grouped_mm_wgrad.register_fake
def _grouped_mm_wgrad_fake(dy, x, ends, out_dtype):
    return dy.new_empty((ends.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tqcompile::grouped_dequantize", mutates_args=())
def grouped_dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    amax: torch.Tensor | None,
    quantizer: Quantizer,
    ends: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The (T, C) values, in `out_dtype`, of rowwise grouped tokens from `grouped_quantize`
    (`amax`: the per-expert amax it was given); each expert's tokens equal a per-expert
    ``tq.quantize(x_e, quantizer, amax=amax[e]).dequantize()``. Fake quantization of grouped
    tokens (`tq.calibrate`'s experts) is this after `grouped_quantize`."""
    num_tokens = quantizer.logical_shape(data.shape)[0]
    _check_ends(ends, num_tokens, "grouped_dequantize")
    return _dequantize_grouped(data, scale_inv, amax, quantizer, ends, num_tokens, False, dtype=out_dtype)


@grouped_dequantize.register_fake
def _grouped_dequantize_fake(data, scale_inv, amax, quantizer, ends, out_dtype):
    register_inductor_decompositions()  # traced: hand inductor the decompositions (tqcompile.ops.inductor)
    return data.new_empty(quantizer.logical_shape(data.shape), dtype=out_dtype)


def _grouped_dequantize_decomposition(data, scale_inv, amax, quantizer, ends, out_dtype):
    """Inductor's: the reference, each row's per-expert scale gathered by `ends`, where dequantize
    decomposes (a deployed MoE's packed experts are dequantized on every call)."""
    if not dequantize_decomposes(data, scale_inv, quantizer):
        return NotImplemented
    return _dequantize_grouped(data, scale_inv, amax, quantizer, ends, quantizer.logical_shape(data.shape)[0], False, dtype=out_dtype)


register_decomposition("grouped_dequantize", _grouped_dequantize_decomposition)


@torch.library.custom_op("tqcompile::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """High-precision grouped linear without bias: per expert e, ``x_e @ weight[e].T`` for the
    (T, K) tokens `x` sorted by expert (segments by `ends`) and the (E, N, K) `weight`; out (T, N)
    in x's dtype, zero rows for no token. Differentiable (dgrad is this op on the transposed
    weight, wgrad `grouped_mm_wgrad`); the GEMM of fake-quantized experts (`tq.calibrate`), which
    `torch._grouped_mm` cannot be under compile on CPU (its fake kernel refuses fp32)."""
    _check_ends(ends, x.shape[0], "grouped_mm")
    with torch.autocast(x.device.type, enabled=False):
        return _grouped_matmul(x, weight.to(x.dtype).transpose(1, 2), ends)


@grouped_mm.register_fake
def _grouped_mm_fake(x, weight, ends):
    return x.new_empty((x.shape[0], weight.shape[1]))


def _grouped_mm_setup(ctx, inputs, output):
    x, weight, ends = inputs
    ctx.save_for_backward(x, weight, ends)


def _grouped_mm_backward(ctx, dy):
    x, weight, ends = ctx.saved_tensors
    dx = grouped_mm(dy, weight.transpose(1, 2).contiguous(), ends) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(dy, x, ends, weight.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
