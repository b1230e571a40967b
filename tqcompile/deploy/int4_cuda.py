"""`Int4PackedCUDATensor`: an INT4 weight (or INT3 / INT2, in 4 bits) in the layout CUDA's INT4
kernel (tinygemm, ``torch._weight_int4pack_mm``) reads.

The kernel reads unsigned codes ``c + 8`` with the same (K / block, N, 2) scales and zeros as the
CPU kernel (`tqcompile.deploy.int4_cpu.scales_and_zeros`: ``(c + 8 - 8) * scale + zero``), but
its own tiled layout: ``torch._convert_weight_to_int4pack`` of (N, K / 2) bytes, two codes a byte
(the even column in the high nibble: measured on an H200, the other order's product is wrong),
gives an int32 tensor of shape (N / 8, K / (16 * ikt), 32, ikt / 2) for the m16n8k16 tensor-core
tiles (``ikt``, the inner K tiles, 8, 4 or 2). Word ``[nt, ko, t, j]`` holds four bytes ``v_i``
of row ``8 nt + t // 4``, at byte columns ``(ko * ikt + 2 j) * 8 + 8 (i // 2) + 4 (i % 2) + t % 4``:
their high nibbles in bits ``4 i``, their low nibbles in bits ``16 + 4 i`` (read from the
conversion kernel, torch 2.11; `pack_words` writes it in torch ops and tests/test_cuda.py checks
it against the kernel's). `unpack` inverts it, so the deployed weight holds the kernel's words
only and `dequantize` still reads tq's codes.

The kernel takes bfloat16 activations only (torch 2.11-2.14), blocks of 32, 64, 128 or 256 along
K, N % 8 == 0 and K % 32 == 0 (`tqcompile.deploy.kernels.linear_kernel` checks).
"""

from __future__ import annotations

import torch

from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.quantizers import Quantizer

__all__ = ["Int4PackedCUDATensor", "pack", "unpack", "pack_words", "inner_k_tiles"]


def inner_k_tiles(k: int) -> int:
    """The most 16-wide K tiles (8, 4 or 2) the kernel packs together for input dim `k`
    (`k` % 32 == 0)."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def _pairs(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """(N, K / 2) bytes of unsigned codes ``c + 8``, the even column in the high nibble."""
    codec = q.element_format().codec
    codes = (codec.signed(codec.unpack(payload)).to(torch.int16) + 8).to(torch.uint8)
    return (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()


def _tiles(n: int, k: int, ikt: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (N, K / 2) bytes as [n tile, row in tile, K super tile, j, i // 2, i % 2, t % 4], and
    the order that makes them [n tile, K super tile, t (row * 4 + t % 4), j, i]."""
    return (n // 8, 8, k // (16 * ikt), ikt // 2, 2, 2, 4), (0, 2, 1, 6, 3, 4, 5)


def pack_words(pairs: torch.Tensor, ikt: int) -> torch.Tensor:
    """The kernel's int32 words of (N, K / 2) code bytes, computed in torch ops (any device)."""
    n, k = pairs.shape[0], pairs.shape[1] * 2
    shape, order = _tiles(n, k, ikt)
    v = pairs.reshape(shape).permute(order).reshape(n // 8, k // (16 * ikt), 32, ikt // 2, 4).to(torch.int64)
    shifts = torch.arange(4, device=pairs.device) * 4
    words = (((v >> 4) << shifts) | ((v & 15) << (shifts + 16))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """tq's INT4 / INT3 / INT2 payload of an (N, K) weight on a CUDA device -> the kernel's words."""
    pairs = _pairs(payload, q)
    return torch._convert_weight_to_int4pack(pairs, inner_k_tiles(pairs.shape[1] * 2))


def unpack(words: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The kernel's words -> tq's payload of `q` (every code of its grid, -8 included)."""
    nt, ks, _, half = words.shape
    ikt = half * 2
    n, k = nt * 8, ks * 16 * ikt
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(4, device=words.device) * 4
    w = w.unsqueeze(-1)
    v = ((w >> shifts) & 15) << 4 | ((w >> (shifts + 16)) & 15)  # [nt, ks, t, j, i]
    shape, order = _tiles(n, k, ikt)
    inverse = [order.index(d) for d in range(len(order))]
    permuted = [shape[d] for d in order]
    pairs = v.reshape(permuted).permute(inverse).reshape(n, k // 2)
    unsigned = torch.stack((pairs >> 4, pairs & 15), -1).reshape(n, k)
    codec = q.element_format().codec
    return codec.pack(codec.encode(unsigned.float() - 8, *q.code_range()))


class Int4PackedCUDATensor(Int4PackedCPUTensor):
    """An (N, K) INT4 weight quantized in blocks along K, its payload in CUDA's INT4 kernel's
    layout (module docstring), its scales and zeros the kernel's (bfloat16). Made by
    `from_quantized`; read by `tqcompile.deploy.kernels`; `dequantize` computes, in torch ops,
    the weight the kernel computes with."""

    _DEVICE = "cuda"

    @staticmethod
    def _pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
        return pack(payload, q)

    def _payload(self) -> torch.Tensor:
        return unpack(self._data, self.quantizer)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return Int4PackedCUDATensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def _unsigned_codes(self) -> torch.Tensor:
        """The (N, K) unsigned codes ``u = c + 8`` (uint8) in row order, read straight off the
        words' bytes (little-endian: the high nibbles of v0..v3 in bytes 0-1, the low ones in
        bytes 2-3), one pass, no payload; `dequantize` (the CPU class's) computes
        ``(u - 8) * scale + zero`` in fp32 from them: bit for bit the kernel's weight (tests/test_cuda.py)."""
        n, k = self.shape
        words = self._data
        nt, ks, _, half = words.shape
        b = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
        hi = torch.stack((b[..., 0] & 15, b[..., 0] >> 4, b[..., 1] & 15, b[..., 1] >> 4), -1)
        lo = torch.stack((b[..., 2] & 15, b[..., 2] >> 4, b[..., 3] & 15, b[..., 3] >> 4), -1)
        return torch.stack((hi, lo), -1).reshape(nt, ks, 8, 4, half, 2, 2, 2).permute(0, 2, 1, 4, 5, 6, 3, 7).reshape(n, k)
