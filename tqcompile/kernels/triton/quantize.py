"""Triton kernels for `tqcompile::quantize`, bit-exact with `tqcompile.kernels.reference.quantize`.

`supports(x, q, amax, seed)` says whether a kernel here covers a call; `quantize(...)` runs it.
The custom op calls them only for CUDA tensors; the tests run them on CPU tensors through the
Triton interpreter. How each rounding step is reproduced exactly is explained in `_numerics`.

Covered: FP8 (E4M3/E5M2) tensorwise (amax given or computed), rowwise along any axis, 1 x B and
B x B blocks, with or without power-of-two scales; MX (E4M3, E5M2, E2M1) with FLOOR or RCEIL
scales; NVFP4 in 16 or 16x16 blocks, with or without stochastic rounding. Not covered (the
reference runs): NVFP4 with the Hadamard transform (its 16x16 matmul sums in an order only the
reference's matmul defines), IntQuantizer, inputs other than fp32/bf16/fp16, empty tensors.

Every kernel reads the contiguous input once per pass and writes payload bytes and scales; the
layouts reduce to three shapes of work:

- rows: one scale per row of a (rows, row_len) view, which is rowwise along the last dim and,
  with row_len = B, every 1 x B block layout (FP8 blocks, MX, NVFP4 1D): block i of the
  flattened tensor is row i, and its scale sits at index i of the contiguous scale tensor;
- columns: rowwise along another axis, a (outer, axis, inner) view reduced over its middle dim;
- tiles: B x B blocks of the last two dims (FP8 BLOCKWISE_2D, NVFP4 16x16).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from tqcompile.formats import Format
from tqcompile.kernels.triton import _numerics as nx
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer, ScaleRounding
from tqcompile.quantizers.nvfp4 import NVFP4_ENC

__all__ = ["supports", "quantize"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The MX element formats with a kernel here, and which: FP8 elements share one kernel (constants
# from the codec), E2M1 has its own. Other registered MX element formats run the reference.
_MX_KERNELS = {Format.E4M3: "fp8", Format.E5M2: "fp8", Format.E2M1: "fp4"}
# Elements one program handles: large enough to hide memory latency on a GPU, small enough to
# stay in registers (and few programs keep the interpreter fast).
_TILE = 4096


# ---------------------------------------------------------------------------------------------
# FP8 kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, n, IN_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = nx.load_f32(x_ptr, offs, offs < n, IN_BF16)
    tl.store(partial_ptr + tl.program_id(0), nx.bits_to_f32(tl.max(nx.finite_abs_bits(x), axis=0)))


@triton.jit
def _fp8_tensorwise_kernel(
    x_ptr, amax_ptr, out_ptr, scale_inv_ptr, n, eps,
    IN_BF16: tl.constexpr, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # Every program derives the same scale from the amax; program 0 publishes scale_inv.
    scale, scale_inv = nx.fp8_scales(tl.load(amax_ptr), eps, FMT_MAX, POW2)
    x = nx.load_f32(x_ptr, offs, mask, IN_BF16)
    tl.store(out_ptr + offs, nx.fp8_code(x * scale, FMT_MAX, MBITS, BIAS), mask=mask)
    if pid == 0:
        tl.store(scale_inv_ptr, scale_inv)


@triton.jit
def _fp8_rows_kernel(
    x_ptr, out_ptr, scale_inv_ptr, n_rows, row_len, eps,
    IN_BF16: tl.constexpr, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_C)
    base = rows[:, None] * row_len
    if ONE_CHUNK:
        mask = row_ok[:, None] & (cols[None, :] < row_len)
        x = nx.load_f32(x_ptr, base + cols[None, :], mask, IN_BF16)
        amax = nx.bits_to_f32(tl.max(nx.finite_abs_bits(x), axis=1))
        scale, scale_inv = nx.fp8_scales(amax, eps, FMT_MAX, POW2)
        tl.store(out_ptr + base + cols[None, :], nx.fp8_code(x * scale[:, None], FMT_MAX, MBITS, BIAS), mask=mask)
    else:
        # Rows too long for registers: one pass for the amax, a second (mostly from L2) to quantize.
        amax_bits = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, row_len, BLOCK_C):
            mask = row_ok[:, None] & ((c0 + cols)[None, :] < row_len)
            x = nx.load_f32(x_ptr, base + (c0 + cols)[None, :], mask, IN_BF16)
            amax_bits = tl.maximum(amax_bits, tl.max(nx.finite_abs_bits(x), axis=1))
        scale, scale_inv = nx.fp8_scales(nx.bits_to_f32(amax_bits), eps, FMT_MAX, POW2)
        for c0 in range(0, row_len, BLOCK_C):
            mask = row_ok[:, None] & ((c0 + cols)[None, :] < row_len)
            x = nx.load_f32(x_ptr, base + (c0 + cols)[None, :], mask, IN_BF16)
            code = nx.fp8_code(x * scale[:, None], FMT_MAX, MBITS, BIAS)
            tl.store(out_ptr + base + (c0 + cols)[None, :], code, mask=mask)
    tl.store(scale_inv_ptr + rows, scale_inv, mask=row_ok)


@triton.jit
def _fp8_cols_kernel(
    x_ptr, out_ptr, scale_inv_ptr, n_outer, axis_len, n_inner, eps,
    IN_BF16: tl.constexpr, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    # x is (n_outer, axis_len, n_inner); one scale per (outer, inner) pair, reduced over the axis.
    inner_programs = tl.cdiv(n_inner, BLOCK_I)
    outer = (tl.program_id(0) // inner_programs).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O)
    inner = (tl.program_id(0) % inner_programs).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    unit_ok = (outer < n_outer)[:, None] & (inner < n_inner)[None, :]
    along = tl.arange(0, BLOCK_A)
    base = (outer * axis_len * n_inner)[:, None, None] + inner[None, None, :]
    amax_bits = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.int32)
    for a0 in range(0, axis_len, BLOCK_A):
        a = (a0 + along).to(tl.int64)[None, :, None]
        mask = unit_ok[:, None, :] & (a < axis_len)
        x = nx.load_f32(x_ptr, base + a * n_inner, mask, IN_BF16)
        amax_bits = tl.maximum(amax_bits, tl.max(nx.finite_abs_bits(x), axis=1))
    scale, scale_inv = nx.fp8_scales(nx.bits_to_f32(amax_bits), eps, FMT_MAX, POW2)
    for a0 in range(0, axis_len, BLOCK_A):
        a = (a0 + along).to(tl.int64)[None, :, None]
        mask = unit_ok[:, None, :] & (a < axis_len)
        x = nx.load_f32(x_ptr, base + a * n_inner, mask, IN_BF16)
        tl.store(out_ptr + base + a * n_inner, nx.fp8_code(x * scale[:, None, :], FMT_MAX, MBITS, BIAS), mask=mask)
    tl.store(scale_inv_ptr + outer[:, None] * n_inner + inner[None, :], scale_inv, mask=unit_ok)


@triton.jit
def _tile_offsets(
    n_tile_rows,
    n_cols,
    r0,
    B: tl.constexpr,
    ROWS: tl.constexpr,
    TR: tl.constexpr,
    TC: tl.constexpr,
    COLS: tl.constexpr,
    COL_STEP: tl.constexpr,
):
    """Offsets (TR, ROWS, TC, COLS) into rows r0 .. r0 + ROWS of a TR x TC group of B x B tiles,
    with their mask, and the tile ids (TR, TC) with theirs. Tile rows are counted across the batch
    (no tile straddles two matrices: their row count is a multiple of B). Column c of a tile is
    element c * COL_STEP (COL_STEP 2 visits the even elements of packed pairs)."""
    tiles_c = n_cols // B
    col_programs = tl.cdiv(tiles_c, TC)
    tile_r = (tl.program_id(0) // col_programs).to(tl.int64) * TR + tl.arange(0, TR)
    tile_c = (tl.program_id(0) % col_programs).to(tl.int64) * TC + tl.arange(0, TC)
    r = r0 + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    tile_ok = (tile_r < n_tile_rows)[:, None] & (tile_c < tiles_c)[None, :]
    mask = tile_ok[:, None, :, None] & (r < B)[None, :, None, None] & (c * COL_STEP < B)[None, None, None, :]
    row = tile_r[:, None, None, None] * B + r[None, :, None, None]
    col = tile_c[None, None, :, None] * B + (c * COL_STEP)[None, None, None, :]
    tile_id = tile_r[:, None] * tiles_c + tile_c[None, :]
    return row * n_cols + col, mask, tile_id, tile_ok


@triton.jit
def _fp8_tiles_kernel(
    x_ptr, out_ptr, scale_inv_ptr, n_tile_rows, n_cols, eps,
    IN_BF16: tl.constexpr, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
    B: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):  # fmt: skip
    # The scale of tile t sits at index t of the contiguous (…, M/B, K/B) scale tensor.
    offs, mask, tile_id, tile_ok = _tile_offsets(n_tile_rows, n_cols, 0, B, ROWS, TR, TC, BLOCK_B, 1)
    if ROWS == BLOCK_B:
        x = nx.load_f32(x_ptr, offs, mask, IN_BF16)
        amax = nx.bits_to_f32(tl.max(tl.max(nx.finite_abs_bits(x), axis=3), axis=1))
        scale, scale_inv = nx.fp8_scales(amax, eps, FMT_MAX, POW2)
        tl.store(out_ptr + offs, nx.fp8_code(x * scale[:, None, :, None], FMT_MAX, MBITS, BIAS), mask=mask)
    else:
        # Tiles too big for registers (128 x 128): one pass over row chunks for the amax, a second
        # (mostly from L1/L2) to quantize.
        amax_bits = tl.zeros([TR, TC], dtype=tl.int32)
        for r0 in range(0, B, ROWS):
            offs, mask, _, _ = _tile_offsets(n_tile_rows, n_cols, r0, B, ROWS, TR, TC, BLOCK_B, 1)
            x = nx.load_f32(x_ptr, offs, mask, IN_BF16)
            amax_bits = tl.maximum(amax_bits, tl.max(tl.max(nx.finite_abs_bits(x), axis=3), axis=1))
        scale, scale_inv = nx.fp8_scales(nx.bits_to_f32(amax_bits), eps, FMT_MAX, POW2)
        for r0 in range(0, B, ROWS):
            offs, mask, _, _ = _tile_offsets(n_tile_rows, n_cols, r0, B, ROWS, TR, TC, BLOCK_B, 1)
            x = nx.load_f32(x_ptr, offs, mask, IN_BF16)
            tl.store(out_ptr + offs, nx.fp8_code(x * scale[:, None, :, None], FMT_MAX, MBITS, BIAS), mask=mask)
    tl.store(scale_inv_ptr + tile_id, scale_inv, mask=tile_ok)


# ---------------------------------------------------------------------------------------------
# MX kernels: 32-element blocks of the last dim, E8M0 scales
# ---------------------------------------------------------------------------------------------
@triton.jit
def _mx_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, n_blocks,
    IN_BF16: tl.constexpr, FMT_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    EMAX: tl.constexpr, RCEIL: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    blocks = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = blocks < n_blocks
    offs = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = nx.load_f32(x_ptr, offs, ok[:, None], IN_BF16)
    e = nx.mx_exponent(nx.bits_to_f32(tl.max(nx.finite_abs_bits(x), axis=1)), RCEIL, EMAX, FMT_MAX)
    tl.store(out_ptr + offs, nx.fp8_code(x * nx.pow2_neg(e)[:, None], FMT_MAX, MBITS, BIAS), mask=ok[:, None])
    tl.store(scale_ptr + blocks, (e + 127).to(tl.uint8), mask=ok)


@triton.jit
def _mx_fp4_kernel(x_ptr, out_ptr, scale_ptr, n_blocks, IN_BF16: tl.constexpr, RCEIL: tl.constexpr, BLOCK_R: tl.constexpr):
    # Elements 2j and 2j+1 share byte j (low nibble first), so load them as two half blocks.
    blocks = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = blocks[:, None] < n_blocks
    pair = tl.arange(0, 16)[None, :]
    even = nx.load_f32(x_ptr, blocks[:, None] * 32 + 2 * pair, ok, IN_BF16)
    odd = nx.load_f32(x_ptr, blocks[:, None] * 32 + 2 * pair + 1, ok, IN_BF16)
    amax_bits = tl.maximum(tl.max(nx.finite_abs_bits(even), axis=1), tl.max(nx.finite_abs_bits(odd), axis=1))
    e = nx.mx_exponent(nx.bits_to_f32(amax_bits), RCEIL, 2, 6.0)  # E2M1: emax 2, max 6
    inv = nx.pow2_neg(e)[:, None]
    packed = nx.e2m1_code(even * inv) | (nx.e2m1_code(odd * inv) << 4)
    tl.store(out_ptr + blocks[:, None] * 16 + pair, packed.to(tl.uint8), mask=ok)
    tl.store(scale_ptr + blocks, (e + 127).to(tl.uint8), mask=blocks < n_blocks)


# ---------------------------------------------------------------------------------------------
# NVFP4: 16 (or 16x16) blocks of E2M1, E4M3 block scales under s_enc = 2688 / amax
# ---------------------------------------------------------------------------------------------
@triton.jit
def _uniform_hash(idx, seed, offset):
    """`reference.uniform_hash` for the int64 element indices `idx`."""
    h = (idx + offset) & 0xFFFFFFFF
    h = h ^ (((seed & 0x7FFFFFFF) * 0x2C1B3C6D) & 0xFFFFFFFF)
    h = (((h >> 16) ^ h) * 0x045D9F3B) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x045D9F3B) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x045D9F3B) & 0xFFFFFFFF
    h = (h >> 16) ^ h
    return (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24


@triton.jit
def _e2m1_grid(code):
    """E2M1 magnitude of a code in 0..7."""
    return tl.where(
        code < 4, code.to(tl.float32) * 0.5, tl.where(code == 4, 2.0, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))
    )


@triton.jit
def _e2m1_stochastic_code(v, u):
    """`reference._e2m1_stochastic`: up with probability (|v| - lo) / (hi - lo)."""
    mag = tl.abs(v)
    mag = tl.where(mag != mag, 0.0, mag)
    mag = tl.where(mag > 6.0, 6.0, mag)
    lo_code = (mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
    lo_code += (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32) + (mag >= 6.0).to(tl.int32)
    hi_code = tl.minimum(lo_code + 1, 7)
    lo = _e2m1_grid(lo_code)
    hi = _e2m1_grid(hi_code)
    gap = tl.where(hi > lo, hi - lo, 1.0)
    up = u < nx.div_rn(mag - lo, gap)
    code = tl.where(up, hi_code, lo_code)
    return code | nx.e2m1_sign(v)


@triton.jit
def _nvfp4_codes(x, s_enc, s_blk, idx, seed_ptr, STOCHASTIC: tl.constexpr):
    # reference: v = where(s_blk == 0, 0, x * s_enc / s_blk)
    v = nx.div_rn(x * s_enc, tl.where(s_blk == 0, 1.0, s_blk))
    v = tl.where(s_blk == 0, 0.0, v)
    if STOCHASTIC:
        return _e2m1_stochastic_code(v, _uniform_hash(idx, tl.load(seed_ptr), tl.load(seed_ptr + 1)))
    else:
        return nx.e2m1_code(v)


@triton.jit
def _nvfp4_block_scale(blk_amax, s_enc):
    """reference: s_blk = (blk_amax / 6 * s_enc).clamp(max=448).to(e4m3); returns (code, fp32 value)."""
    s = nx.div_const_rn(blk_amax, 6.0) * s_enc  # 6: E2M1's max
    code = nx.fp8_code(s, 448.0, 3, 7)  # E4M3; s >= 0, so the clamp at -448 is inert
    return code, nx.e4m3_decode(code.to(tl.int32) & 0x7F)


@triton.jit
def _nvfp4_rows_kernel(
    x_ptr, amax_ptr, seed_ptr, out_ptr, scale_ptr, n_blocks, eps,
    IN_BF16: tl.constexpr, ENC: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    blocks = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = blocks[:, None] < n_blocks
    pair = tl.arange(0, 8)[None, :]
    i_even = blocks[:, None] * 16 + 2 * pair
    even = nx.load_f32(x_ptr, i_even, ok, IN_BF16)
    odd = nx.load_f32(x_ptr, i_even + 1, ok, IN_BF16)
    s_enc = nx.rdiv_rn(ENC, nx.clamp_min(tl.load(amax_ptr), eps))
    blk_amax = nx.bits_to_f32(tl.maximum(tl.max(nx.finite_abs_bits(even), axis=1), tl.max(nx.finite_abs_bits(odd), axis=1)))
    code, s_blk = _nvfp4_block_scale(blk_amax, s_enc)
    lo = _nvfp4_codes(even, s_enc, s_blk[:, None], i_even, seed_ptr, STOCHASTIC)
    hi = _nvfp4_codes(odd, s_enc, s_blk[:, None], i_even + 1, seed_ptr, STOCHASTIC)
    tl.store(out_ptr + blocks[:, None] * 8 + pair, (lo | (hi << 4)).to(tl.uint8), mask=ok)
    tl.store(scale_ptr + blocks, code, mask=blocks < n_blocks)


@triton.jit
def _nvfp4_tiles_kernel(
    x_ptr, amax_ptr, seed_ptr, out_ptr, scale_ptr, n_tile_rows, n_cols, eps,
    IN_BF16: tl.constexpr, ENC: tl.constexpr, STOCHASTIC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):  # fmt: skip
    i_even, mask, tile_id, tile_ok = _tile_offsets(n_tile_rows, n_cols, 0, 16, 16, TR, TC, 8, 2)
    even = nx.load_f32(x_ptr, i_even, mask, IN_BF16)
    odd = nx.load_f32(x_ptr, i_even + 1, mask, IN_BF16)
    s_enc = nx.rdiv_rn(ENC, nx.clamp_min(tl.load(amax_ptr), eps))
    amax_bits = tl.maximum(
        tl.max(tl.max(nx.finite_abs_bits(even), axis=3), axis=1), tl.max(tl.max(nx.finite_abs_bits(odd), axis=3), axis=1)
    )
    code, s_blk = _nvfp4_block_scale(nx.bits_to_f32(amax_bits), s_enc)
    lo = _nvfp4_codes(even, s_enc, s_blk[:, None, :, None], i_even, seed_ptr, STOCHASTIC)
    hi = _nvfp4_codes(odd, s_enc, s_blk[:, None, :, None], i_even + 1, seed_ptr, STOCHASTIC)
    tl.store(out_ptr + i_even // 2, (lo | (hi << 4)).to(tl.uint8), mask=mask)
    tl.store(scale_ptr + tile_id, code, mask=tile_ok)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def supports(x: torch.Tensor, q: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None) -> bool:
    """True when a kernel here computes `reference.quantize(x, q, amax, seed)` (bit for bit).

    Calls that are malformed (bad shapes, a missing NVFP4 amax or seed) return False, so that
    the reference raises its own error.
    """
    if x.dtype not in _INPUT_DTYPES or x.numel() == 0:
        return False
    try:
        q.check_shape(x.shape)
    except ValueError:
        return False
    return _covers(q, x, amax, seed)


# Which calls each family's kernels cover, and how they launch: registered per family (a family
# without kernels here runs the reference).
@functools.singledispatch
def _covers(q: Quantizer, x: torch.Tensor, amax: torch.Tensor | None, seed: torch.Tensor | None) -> bool:
    return False


@_covers.register(Float8Quantizer)
def _(q: Float8Quantizer, x, amax, seed) -> bool:
    if amax is None:
        return True
    # The reference scales with a given amax even for local granularities; only the
    # tensorwise use of it is the op's contract.
    return q.granularity is Granularity.TENSORWISE and _is_scalar_f32(amax, x)


@_covers.register(MXQuantizer)
def _(q: MXQuantizer, x, amax, seed) -> bool:
    return q.format in _MX_KERNELS  # an MX element format without a kernel here runs the reference


@_covers.register(NVFP4Quantizer)
def _(q: NVFP4Quantizer, x, amax, seed) -> bool:
    if q.hadamard or amax is None or not _is_scalar_f32(amax, x):
        return False
    if q.stochastic_rounding:
        return seed is not None and seed.dtype == torch.int64 and seed.shape == (2,) and seed.device == x.device
    return True


def _is_scalar_f32(t: torch.Tensor, x: torch.Tensor) -> bool:
    # The reference's scale takes amax's shape and dtype; only a 0-dim fp32 amax gives the op's schema.
    return t.dtype == torch.float32 and t.dim() == 0 and t.device == x.device


def quantize(
    x: torch.Tensor, q: Quantizer, amax: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale_inv) of `x`, equal bit for bit to `reference.quantize(x, q, amax, seed)`.

    Runs on CUDA tensors, or on CPU tensors when Triton runs in interpreter mode. Check
    `supports(x, q, amax, seed)` first.
    """
    if not supports(x, q, amax, seed):
        raise ValueError(f"tqcompile Triton quantize does not cover {q!r} for a {x.dtype} tensor of shape {tuple(x.shape)}")
    x = x.contiguous()
    in_bf16 = x.dtype == torch.bfloat16
    xk = x.view(torch.int16) if in_bf16 else x
    payload = torch.empty(q.payload_shape(x.shape), dtype=q.element_format().storage_dtype, device=x.device)
    scale = torch.empty(q.scale_shape(x.shape), dtype=q.scale_dtype(), device=x.device)
    out_u8 = payload.view(torch.uint8)
    scale_k = scale if scale.dtype == torch.float32 else scale.view(torch.uint8)
    guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with guard:
        _launch(q, xk, in_bf16, amax, seed, out_u8, scale_k)
    return payload, scale


@functools.singledispatch
def _launch(q: Quantizer, xk, in_bf16: bool, amax, seed, out_u8, scale_k) -> None:
    raise TypeError(f"no Triton kernel for {type(q).__name__}")


def _fp8_consts(fmt: Format) -> tuple[float, int, int]:
    """(largest finite value, mantissa bits, exponent bias) of an FP8 element format, from its codec."""
    codec = fmt.codec
    return codec.max_value, codec.mbits, codec.bias


def _opts(elements: int) -> dict:
    """Launch options: warps for a program of `elements` elements, and no FMA contraction (no
    product here feeds an addition, so this only pins `mul.rn.f32` in the PTX)."""
    return {"num_warps": 8 if elements >= 4096 else 4, "enable_fp_fusion": False}


@_launch.register(Float8Quantizer)
def _launch_fp8(q: Float8Quantizer, xk, in_bf16, amax, seed, out_u8, scale_inv) -> None:
    fmt_max, mbits, bias = _fp8_consts(q.format)
    common = dict(IN_BF16=in_bf16, FMT_MAX=fmt_max, MBITS=mbits, BIAS=bias, POW2=q.power_of_two_scale)
    eps = q.amax_epsilon
    shape = xk.shape
    n = xk.numel()
    gran, axis, block = q.layout()
    if gran is Granularity.TENSORWISE:
        grid = (triton.cdiv(n, _TILE),)
        if amax is None:
            partial = torch.empty(grid[0], dtype=torch.float32, device=xk.device)
            _amax_partial_kernel[grid](xk, partial, n, IN_BF16=in_bf16, BLOCK=_TILE, **_opts(_TILE))
            amax = partial.amax()  # a max is exact: the partials combine in any order
        _fp8_tensorwise_kernel[grid](xk, amax, out_u8, scale_inv, n, eps, BLOCK=_TILE, **common, **_opts(_TILE))
    elif gran is Granularity.ROWWISE and math.prod(shape[axis % len(shape) + 1 :]) > 1:
        axis %= len(shape)
        outer, along, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])
        block_i = min(triton.next_power_of_2(inner), 128)
        block_a = min(triton.next_power_of_2(along), max(1, _TILE // block_i))
        block_o = min(triton.next_power_of_2(outer), max(1, _TILE // (block_i * block_a)))
        grid = (triton.cdiv(outer, block_o) * triton.cdiv(inner, block_i),)
        _fp8_cols_kernel[grid](
            xk, out_u8, scale_inv, outer, along, inner, eps,
            BLOCK_O=block_o, BLOCK_A=block_a, BLOCK_I=block_i, **common, **_opts(block_o * block_a * block_i),
        )  # fmt: skip
    elif gran in (Granularity.ROWWISE, Granularity.BLOCKWISE_1D):
        # Rowwise along the last dim, or along a dim followed only by size-1 dims: rows either way.
        row_len = shape[axis] if gran is Granularity.ROWWISE else block
        n_rows = n // row_len
        block_c = min(triton.next_power_of_2(row_len), _TILE)
        block_r = min(triton.next_power_of_2(n_rows), max(1, _TILE // block_c))
        grid = (triton.cdiv(n_rows, block_r),)
        _fp8_rows_kernel[grid](
            xk, out_u8, scale_inv, n_rows, row_len, eps,
            BLOCK_R=block_r, BLOCK_C=block_c, ONE_CHUNK=row_len <= block_c, **common, **_opts(block_r * block_c),
        )  # fmt: skip
    else:
        block_b = triton.next_power_of_2(block)
        rows = min(block_b, max(1, _TILE // block_b))  # rows of a tile per pass
        n_tile_rows, tiles_c = n // (shape[-1] * block), shape[-1] // block
        tc = min(triton.next_power_of_2(tiles_c), max(1, _TILE // (rows * block_b)))
        tr = min(triton.next_power_of_2(n_tile_rows), max(1, _TILE // (rows * block_b * tc)))
        grid = (triton.cdiv(n_tile_rows, tr) * triton.cdiv(tiles_c, tc),)
        _fp8_tiles_kernel[grid](
            xk, out_u8, scale_inv, n_tile_rows, shape[-1], eps,
            B=block, BLOCK_B=block_b, ROWS=rows, TR=tr, TC=tc, **common, **_opts(tr * tc * rows * block_b),
        )  # fmt: skip


@_launch.register(MXQuantizer)
def _launch_mx(q: MXQuantizer, xk, in_bf16, amax, seed, out_u8, scale_u8) -> None:
    n_blocks = xk.numel() // 32
    block_r = max(1, min(triton.next_power_of_2(n_blocks), _TILE // 32))
    grid = (triton.cdiv(n_blocks, block_r),)
    rceil = q.scale_rounding is ScaleRounding.RCEIL
    if _MX_KERNELS[q.format] == "fp4":
        _mx_fp4_kernel[grid](xk, out_u8, scale_u8, n_blocks, IN_BF16=in_bf16, RCEIL=rceil, BLOCK_R=block_r, **_opts(block_r * 32))
    else:
        fmt_max, mbits, bias = _fp8_consts(q.format)
        _mx_fp8_kernel[grid](
            xk, out_u8, scale_u8, n_blocks, IN_BF16=in_bf16, FMT_MAX=fmt_max, MBITS=mbits, BIAS=bias,
            EMAX=q.format.emax, RCEIL=rceil, BLOCK_R=block_r, **_opts(block_r * 32),
        )  # fmt: skip


@_launch.register(NVFP4Quantizer)
def _launch_nvfp4(q: NVFP4Quantizer, xk, in_bf16, amax, seed, out_u8, scale_u8) -> None:
    # Without stochastic rounding the seed pointer is never read; amax stands in for it.
    seed_k = seed if q.stochastic_rounding else amax
    common = dict(IN_BF16=in_bf16, ENC=NVFP4_ENC, STOCHASTIC=q.stochastic_rounding)
    if q.block_2d:
        n_tile_rows, tiles_c = xk.numel() // (xk.shape[-1] * 16), xk.shape[-1] // 16
        tc = min(triton.next_power_of_2(tiles_c), 16)
        tr = min(triton.next_power_of_2(n_tile_rows), max(1, 16 // tc))
        grid = (triton.cdiv(n_tile_rows, tr) * triton.cdiv(tiles_c, tc),)
        _nvfp4_tiles_kernel[grid](
            xk,
            amax,
            seed_k,
            out_u8,
            scale_u8,
            n_tile_rows,
            xk.shape[-1],
            q.amax_epsilon,
            TR=tr,
            TC=tc,
            **common,
            **_opts(tr * tc * 256),
        )
    else:
        n_blocks = xk.numel() // 16
        block_r = max(1, min(triton.next_power_of_2(n_blocks), _TILE // 16))
        grid = (triton.cdiv(n_blocks, block_r),)
        _nvfp4_rows_kernel[grid](
            xk, amax, seed_k, out_u8, scale_u8, n_blocks, q.amax_epsilon, BLOCK_R=block_r, **common, **_opts(block_r * 16)
        )
