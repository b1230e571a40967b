"""`MXPackedTensor`: a deployed MX weight (MXFP8, MXFP6, MXFP4) whose E8M0 block scales are held
as their bits in uint8.

No CPU kernel reads MX weights, so a deployed MX layer dequantizes its packed weight on every call
(`tqcompile.deploy.kernels`, "dequantize"). Under ``torch.compile`` inductor can generate that
dequantization (`tqcompile.ops.inductor`) only if no buffer it reads is a ``float8_e8m0fnu``
tensor: its CPU backend has no C++ type for that dtype (measured, torch 2.13: ``KeyError:
torch.float8_e8m0fnu`` for a graph input, even when the first op views it as uint8), so a weight
holding its scales in that dtype kept the opaque op, a dozen eager passes a call. Holding the same
bytes as uint8 (``float8_e8m0fnu`` is an 8-bit exponent, its bits are its value) lets the whole
dequantization compile into one loop: E8M0 decodes arithmetically from the bits (`E8M0Codec`), so
the result is the calibrated model's weight bit for bit.

It is a `QuantizedTensor` in every other respect: ``dequantize`` passes the uint8 bits to
``tqcompile::dequantize``, which takes them in place of the E8M0 tensor; `scale_e8m0` gives the
scales in their own dtype. Only the ops a parameter needs are supported (detach, clone, ``to``,
``copy_``); a ``copy_`` from a `QuantizedTensor` of the same quantizer whose scales are E8M0 (a
state_dict saved before this class existed) views them as their bits.
"""

from __future__ import annotations

import torch

from tqcompile.formats import Format
from tqcompile.formats.codec import pack_codes, unpack_codes
from tqcompile.quantizers.scaling import saturate
from tqcompile.tensor import _HANDLERS, QuantizedTensor

__all__ = ["MXPackedTensor", "MXFP4PackedTensor", "mx_packed", "holds_e8m0_scales"]

aten = torch.ops.aten
_E8M0 = torch.float8_e8m0fnu
_OPS = (
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten.is_pinned.default,
)


def holds_e8m0_scales(qt: QuantizedTensor) -> bool:
    """A rowwise-only QuantizedTensor whose scales are E8M0 (an MX quantizer's)."""
    return qt.quantizer.scale_dtype() == _E8M0 and qt._data is not None and qt._data_t is None


class MXPackedTensor(QuantizedTensor):
    """A deployed MX weight, its E8M0 scales as uint8 bits (module docstring). Made by `from_quantized`."""

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor) -> MXPackedTensor:
        """`qt`'s payload and scales (the same storage, the scales viewed as uint8)."""
        if not holds_e8m0_scales(qt):
            raise ValueError(f"{cls.__name__}.from_quantized: {qt!r} is not a rowwise MX tensor (E8M0 scales)")
        bits = qt._scale_inv if qt._scale_inv.dtype == torch.uint8 else qt._scale_inv.view(torch.uint8)
        return cls(qt.shape, qt.quantizer, qt.orig_dtype, None, _data=cls._payload_of(qt), _scale_inv=bits, _amax=qt._amax)

    @staticmethod
    def _payload_of(qt: QuantizedTensor) -> torch.Tensor:
        return _tq_order(qt._data) if isinstance(qt, MXFP4PackedTensor) else qt._data

    @property
    def scale_e8m0(self) -> torch.Tensor:
        """The block scales in their own dtype (``float8_e8m0fnu``), a view of the bits."""
        return self._scale_inv.view(_E8M0)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return MXPackedTensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.orig_dtype}, {self.quantizer!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _OPS:
            raise NotImplementedError(
                f"{cls.__name__} does not support {func}: it is a deployed MX weight (tq.compress); call .dequantize() "
                "for the weight, or deploy from the calibrated model again"
            )
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if not isinstance(src, QuantizedTensor):
                raise NotImplementedError(
                    f"{cls.__name__}.copy_ from {type(src).__name__}: load a state_dict saved from a deployed model (tq.compress)"
                )
            # Its scales as bits, its payload in the destination's order (`type(dst)`: torch dispatches
            # a mix of the two classes to the subclass's handler, whatever the destination).
            if type(src) is not type(dst) and isinstance(dst, MXPackedTensor) and holds_e8m0_scales(src):
                src = type(dst).from_quantized(src)
            return _HANDLERS[func](func, (dst, src), kwargs)
        return _HANDLERS[func](func, args, kwargs)


def _codes(split: torch.Tensor) -> torch.Tensor:
    """The codes in element order of a payload in split order: its two halves."""
    return torch.cat((split & 15, split >> 4), -1)


def _split_order(payload: torch.Tensor) -> torch.Tensor:
    """tq's 4-bit payload (byte j: elements 2j low, 2j + 1 high) -> byte j: elements j low and
    j + K/2 high, along the last dim (K elements)."""
    codes = unpack_codes(payload, 4)
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).contiguous()


def _tq_order(split: torch.Tensor) -> torch.Tensor:
    """The inverse of `_split_order`."""
    return pack_codes(_codes(split), 4).contiguous()


class MXFP4PackedTensor(MXPackedTensor):
    """A deployed MXFP4 weight (E2M1 elements): `MXPackedTensor`, its payload bytes in another
    order, each row's byte j holding elements j (low nibble) and j + K/2 (high): the codes are the
    two halves ``data & 15`` and ``data >> 4``, which inductor unpacks and decodes in one vectorized
    loop. In tq's order (elements 2j and 2j + 1) it writes a buffer per nibble and 16x16 transposes
    and decodes with strided stores (measured: a GPT-OSS-shaped decode step's 4 routed experts,
    gate/up, 11.3 -> 3.8 ms, one thread, torch 2.13). `dequantize` computes what
    ``tqcompile::dequantize`` computes from tq's payload (the same decode and scales, bit for bit)."""

    @staticmethod
    def _payload_of(qt: QuantizedTensor) -> torch.Tensor:
        return qt._data if isinstance(qt, MXFP4PackedTensor) else _split_order(qt._data)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return MXFP4PackedTensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._decode(self._data, self._scale_inv, dtype or self.orig_dtype)

    def dequantize_at(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``index`` of the leading dim (an experts weight's routed experts),
        equal to those rows of `dequantize`."""
        return self._decode(self._data[index], self._scale_inv[index], self.orig_dtype)

    def _decode(self, data: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`reference.dequantize` (the quantizer's dequantization, then saturation) on the codes in
        element order, the two halves of the bytes."""
        codes = _codes(data)
        return saturate(self.quantizer.dequantize_codes(codes, bits, codes.shape), dtype)


def mx_packed(qt: QuantizedTensor) -> MXPackedTensor:
    """A rowwise MX `qt` as the deployed class for its element: `MXFP4PackedTensor` for E2M1
    (its payload in split order), `MXPackedTensor` otherwise."""
    cls = MXFP4PackedTensor if qt.quantizer.element_format() is Format.E2M1 else MXPackedTensor
    return cls.from_quantized(qt)
