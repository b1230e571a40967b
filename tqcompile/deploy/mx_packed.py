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

from tqcompile.tensor import _HANDLERS, QuantizedTensor

__all__ = ["MXPackedTensor", "holds_e8m0_scales"]

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
            raise ValueError(f"MXPackedTensor.from_quantized: {qt!r} is not a rowwise MX tensor (E8M0 scales)")
        return cls(
            qt.shape,
            qt.quantizer,
            qt.orig_dtype,
            None,
            _data=qt._data,
            _scale_inv=qt._scale_inv.view(torch.uint8),
            _amax=qt._amax,
        )

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
            if not isinstance(src, cls) and holds_e8m0_scales(src):
                src = cls.from_quantized(src)
            return _HANDLERS[func](func, (dst, src), kwargs)
        return _HANDLERS[func](func, args, kwargs)
