"""`Int4PackedCUDATensor`: an INT4 weight (or INT3 / INT2, in 4 bits) in the layout CUDA's INT4
kernel (tinygemm, ``torch._weight_int4pack_mm``) reads.

The kernel reads unsigned codes ``c + 8`` with the same (K / block, N, 2) scales and zeros as the
CPU kernel (`tqcompile.deploy.int4_cpu.scales_and_zeros`: ``(c + 8 - 8) * scale + zero``), but
its own tiled layout: ``torch._convert_weight_to_int4pack`` of (N, K / 2) bytes, two codes a byte
(the even column in the high nibble), gives an int32 tensor of shape
(N / 8, K / (16 * inner_k_tiles), 32, inner_k_tiles / 2) for the m16n8k16 tensor-core tiles.
The kernel takes bfloat16 activations only (torch 2.11-2.14), blocks of 32, 64, 128 or 256 along
K, N % 8 == 0 and K % 32 == 0 (`tqcompile.deploy.kernels.linear_kernel` checks).

The deployed weight holds the kernel's words only. `dequantize` asks the kernel itself for the
weight it computes with (the product of an identity matrix with the packed weight, in row blocks:
each output is one weight times 1.0, exact in bf16), so it needs no copy of the tile permutation.
"""

from __future__ import annotations

import torch

from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.quantizers import Quantizer

__all__ = ["Int4PackedCUDATensor", "pack", "inner_k_tiles"]

_EYE_ROWS = 1024  # rows of the identity multiplied at a time by `dequantize`


def inner_k_tiles(k: int) -> int:
    """The most 16-wide K tiles (8, 4 or 2) the kernel packs together for input dim `k`
    (`k` % 32 == 0)."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """tq's INT4 / INT3 / INT2 payload of an (N, K) weight on a CUDA device -> the kernel's words."""
    codec = q.element_format().codec
    codes = (codec.signed(codec.unpack(payload)).to(torch.int16) + 8).to(torch.uint8)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
    return torch._convert_weight_to_int4pack(pairs, inner_k_tiles(codes.shape[1]))


class Int4PackedCUDATensor(Int4PackedCPUTensor):
    """An (N, K) INT4 weight quantized in blocks along K, its payload in CUDA's INT4 kernel's
    layout (module docstring), its scales and zeros the kernel's (bfloat16). Made by
    `from_quantized`; read by `tqcompile.deploy.kernels`."""

    _DEVICE = "cuda"

    @staticmethod
    def _pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
        return pack(payload, q)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return Int4PackedCUDATensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (N, K) weight the kernel computes with, as the kernel dequantizes it (bfloat16)."""
        k = self.shape[1]
        eye = torch.eye(k, dtype=torch.bfloat16, device=self._data.device)
        rows = [torch._weight_int4pack_mm(eye[i : i + _EYE_ROWS], self._data, self.block_size, self._scale_inv) for i in range(0, k, _EYE_ROWS)]
        return torch.cat(rows).t().contiguous().to(dtype or self.orig_dtype)
