"""`Int4PackedCPUTensor`: an INT4 weight (or INT3 / INT2, in 4 bits) in the layout the CPU INT4
kernel reads, and nothing else.

``torch._weight_int4pack_mm_for_cpu`` reads unsigned codes ``c + 8`` (tq's INT4 codes ``c`` are
-7..7 or, on the FULL grid, -8..7, so the kernel's zero point is 0) in its own order: ``torch._convert_weight_to_int4pack_for_cpu``
of an (N, K) weight gives (N, K / 2) bytes holding, for each 64 rows ``r`` and each column ``k``,
32 bytes whose low nibbles are rows ``r..r+31`` and high nibbles rows ``r+32..r+63`` (measured on
torch 2.13; `unpack` inverts it and tests/test_deploy.py checks it against the op on every run).
Keeping tq's own nibble order beside it would double the weight's bytes, converting per call would
read it three times; so the deployed weight holds the kernel's bytes only, and `dequantize` (what
`state_dict` readers, `tq.export` and the exact path need) undoes the permutation.

Its scales are the kernel's too: ``_scale_inv`` holds (K / block, N, 2) scales and zero points
(all 0) in the weight's dtype, as the kernel reads them, so a call does no work on the weight
(tq's fp32 scales kept beside them would add 4 bytes a block, and casting them per call measured
~8% of INT4 decode). The deployed weight is therefore ``c * bf16(scale)`` where the calibrated
model's is ``bf16(c * scale)`` (for a bf16 model): `dequantize` returns the former, the kernel's
weight. Only the ops a parameter needs are supported (detach, clone, ``to`` on the CPU, ``copy_``
from another of its kind); any other raises, naming it.
"""

from __future__ import annotations

import torch

from tqcompile.quantizers import Quantizer
from tqcompile.quantizers.scaling import saturate
from tqcompile.tensor import _HANDLERS, QuantizedTensor

__all__ = ["Int4PackedCPUTensor", "pack", "unpack", "scales_and_zeros"]

aten = torch.ops.aten
_ROW_BLOCK = 64


def pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """tq's INT4 / INT3 / INT2 payload of an (N, K) weight -> the CPU kernel's (N, K / 2) bytes
    (narrower codes take the kernel's 4 bits: ``c + 8`` is 6..9 for INT2, 4..11 for INT3). An
    (E, N, K) experts weight packs expert by expert into (E, N, K / 2)."""
    codec = q.element_format().codec
    codes = codec.signed(codec.unpack(payload)).to(torch.int32) + 8
    if codes.dim() == 3:
        return torch.stack([torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in codes])
    return torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def _unsigned_codes(packed: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's (..., N, K / 2) bytes -> the (..., N, K) unsigned codes ``c + 8`` (uint8) in row order."""
    *lead, n, half = packed.shape
    p = packed.reshape(-1, n // _ROW_BLOCK, half * 2, _ROW_BLOCK // 2)
    return torch.cat((p & 15, p >> 4), 3).permute(0, 1, 3, 2).reshape(*lead, n, half * 2)


def unpack(packed: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The CPU kernel's (..., N, K / 2) bytes -> tq's payload of `q` (every code of its grid, -8 included)."""
    codec = q.element_format().codec
    return codec.pack(codec.encode(_unsigned_codes(packed).float() - 8, *q.code_range()))


def scales_and_zeros(qt: QuantizedTensor, block: int) -> torch.Tensor:
    """The INT4 kernels' (K / block, N, 2) scales and zeros of `qt`'s (N, K) weight, in its dtype
    ((E, K / block, N, 2) for an (E, N, K) experts weight). The kernels (CPU and CUDA alike)
    compute ``(c + 8 - 8) * scale + zero``: an asymmetric unit's zero point z is
    ``zero = -z * scale``; one scale per row is repeated over the row's blocks."""
    per_unit = qt._scale_inv if qt.quantizer.has_zero_point() else torch.stack((qt._scale_inv, torch.zeros_like(qt._scale_inv)), -1)
    scale, zero = per_unit[..., 0], -per_unit[..., 1] * per_unit[..., 0]
    sz = torch.stack((scale, zero), -1).repeat_interleave(qt.shape[-1] // block // scale.shape[-1], -2)
    return sz.transpose(-3, -2).to(qt.orig_dtype).contiguous()


_OPS = (aten.detach.default, aten.alias.default, aten.clone.default, aten.copy_.default, aten._to_copy.default, aten.is_pinned.default)


class Int4PackedCPUTensor(QuantizedTensor):
    """An (N, K) INT4 weight quantized in blocks along K, its payload in the CPU INT4 kernel's
    layout (module docstring), or an (E, N, K) experts weight holding each expert's (N, K) so
    (``_data`` (E, N, K / 2), ``_scale_inv`` (E, K / block, N, 2)). Made by `from_quantized`; read
    by `tqcompile.deploy.kernels` and `tqcompile.deploy.experts_mm`."""

    _DEVICE = "cpu"  # the device type whose kernel reads this layout

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, block: int) -> Int4PackedCPUTensor:
        """`qt`'s (N, K) INT4 weight for the kernel's blocks of `block` (its own 1-D blocks, or,
        for one scale per row, the row's scale repeated over its K / block kernel blocks)."""
        return cls(qt.shape, qt.quantizer, qt.orig_dtype, None, _data=cls._pack(qt._data, qt.quantizer), _scale_inv=scales_and_zeros(qt, block))

    @staticmethod
    def _pack(payload: torch.Tensor, q: Quantizer) -> torch.Tensor:
        return pack(payload, q)

    def _payload(self) -> torch.Tensor:
        """tq's payload of the weight (its codes in tq's own layout)."""
        return unpack(self._data, self.quantizer)

    @property
    def block_size(self) -> int:
        """The kernel's block size (the quantizer's 1-D block; for one scale per row, what
        `tqcompile.deploy.kernels.int4_kernel_block` chose)."""
        return self.shape[-1] // self._scale_inv.shape[-3]

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return Int4PackedCPUTensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the kernel computes with: ``(u - 8) * scale + zero`` in fp32 of the kernel's
        unsigned codes u, scales and zeros (``-zero_point * scale`` rounded to the weight's dtype;
        0 for a symmetric weight), saturated to `dtype`. Read off the kernel's bytes directly, not
        through tq's payload: measured on a (2816, 1024) weight, one thread, 3-5 ms against 41 ms
        (the kernels' prefill path dequantizes it per call, `tqcompile.deploy.kernels`)."""
        *lead, n, k = self.shape
        dtype = dtype or self.orig_dtype
        blocks = self._scale_inv.shape[-3]  # (..., K / block, N, 2) scales and zeros
        u = self._unsigned_codes().reshape(*lead, n, blocks, k // blocks)
        if not self.quantizer.has_zero_point() and self._scale_inv.dtype == dtype:
            # (u - 8) * scale rounds once in `dtype` as in fp32 (a 4-bit code times a scale of
            # `dtype` is exact in fp32); the zeros are 0. Half the bytes of fp32 temporaries.
            scale = self._scale_inv[..., 0].transpose(-2, -1).reshape(*lead, n, blocks, 1)
            return ((u.to(dtype) - 8) * scale).reshape(*lead, n, k)
        sz = self._scale_inv.float()
        scale = sz[..., 0].transpose(-2, -1).reshape(*lead, n, blocks, 1)
        zero = sz[..., 1].transpose(-2, -1).reshape(*lead, n, blocks, 1)
        return saturate(((u.float() - 8) * scale + zero).reshape(*lead, n, k), dtype)

    def _unsigned_codes(self) -> torch.Tensor:
        """The (..., N, K) unsigned codes ``c + 8`` (uint8) in row order, read off the kernel's bytes."""
        return _unsigned_codes(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.orig_dtype}, {self.quantizer!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, dev = cls.__name__, cls._DEVICE
        if func not in _OPS:
            raise NotImplementedError(
                f"{name} does not support {func}: it holds the {dev.upper()} INT4 kernel's packed layout; "
                "call .dequantize() for the weight, or deploy from the calibrated model again (tq.compress)"
            )
        if func is aten._to_copy.default and torch.device(kwargs.get("device") or dev).type != dev:
            raise NotImplementedError(
                f"{name}.to(device={kwargs['device']}): its layout is the {dev.upper()} kernel's; move the calibrated "
                "model to the device and run tq.compress there"
            )
        if func is aten.copy_.default and not isinstance(args[1], cls):
            raise NotImplementedError(f"{name}.copy_ from {type(args[1]).__name__}: load a state_dict saved from a deployed model (tq.compress)")
        return _HANDLERS[func](func, args, kwargs)
