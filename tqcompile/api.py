"""`tq.quantize`: the public entry point that turns a tensor into a QuantizedTensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tqcompile import ops
from tqcompile.groups import group_name_of
from tqcompile.quantizers import Quantizer
from tqcompile.quantizers.base import padded_shape, shape_error
from tqcompile.tensor import QuantizedTensor, quantize_usages

__all__ = ["quantize", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_amax_history(amax_history, quantizer: Quantizer) -> None:
    if not (quantizer.uses_tensor_amax() and not quantizer.hadamard_transformed()):
        raise ValueError(
            f"tq.quantize: amax_history (delayed scaling) needs a quantizer with a tensor-level amax and no transform, got {quantizer!r}"
        )
    if not isinstance(amax_history, torch.Tensor):
        raise TypeError(f"tq.quantize: amax_history must be a 1-D torch.float32 tensor, got {type(amax_history).__name__}")
    # An integer history would truncate the amaxes written into it, a bf16/fp16 one round them and give
    # low-precision scales: scales are computed in fp32 from fp32 amaxes.
    if amax_history.dtype != torch.float32 or amax_history.dim() != 1 or amax_history.numel() == 0:
        raise ValueError(
            f"tq.quantize: amax_history has dtype {amax_history.dtype} and shape {tuple(amax_history.shape)}; allowed: "
            "a non-empty 1-D torch.float32 tensor (e.g. torch.zeros(16))"
        )


def quantize(
    x: torch.Tensor,
    quantizer: Quantizer,
    *,
    amax_group: dist.ProcessGroup | str | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
    seed: torch.Tensor | None = None,
    amax_history: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize `x` with `quantizer`.

    Args:
        x: a float32, bfloat16 or float16 tensor (any strides; payloads come out contiguous).
        quantizer: how to quantize (`Float8Quantizer`, `MXQuantizer`, `NVFP4Quantizer`, `IntQuantizer`).
        amax_group: a ProcessGroup (or its name) whose ranks share the tensor-level amax: it is
            all-reduced (MAX) before scales are computed, and recorded on the result. Quantizers
            whose scales are all local (rowwise, blocks, MX) have no tensor-level amax: the group
            is recorded only.
        rowwise / columnwise: which usages to produce; columnwise quantizes ``x.reshape(-1, K).t()``.
        seed: int64 tensor ``[seed, offset]`` for stochastic rounding; drawn from torch's global
            generator when omitted.
        amax_history: delayed scaling: a 1-D fp32 buffer of past (group-reduced) amaxes. The scale
            comes from its max (the current amax on the first step, while it is all zeros), and the
            current amax is rolled into it in place. Only for quantizers with a tensor-level amax.
        amax: a static (calibrated) amax, used as given instead of one computed from `x`: a 0-dim
            fp32 tensor for quantizers with a tensor-level amax, or one amax per scaling unit
            (shape ``quantizer.scale_shape(x.shape)``) for ROWWISE / BLOCKWISE `Float8Quantizer`
            and `IntQuantizer`. Values beyond it saturate. MX scales come from each block and take
            none. It is not reduced over `amax_group` (reduce it before; `tq.calibrate` does).

    Example:
        >>> qx = tq.quantize(torch.randn(32, 64), tq.Float8Quantizer())
        >>> qx.dequantize().shape
        torch.Size([32, 64])
    """
    if isinstance(x, QuantizedTensor):
        raise TypeError(f"tq.quantize: x is already quantized ({x!r}); dequantize it first")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tq.quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(quantizer, type) and issubclass(quantizer, Quantizer):
        raise TypeError(f"tq.quantize: quantizer must be an instance; got the class {quantizer.__name__}, pass {quantizer.__name__}()")
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"tq.quantize: quantizer must be a tq.Quantizer (Float8Quantizer, ...), got {type(quantizer).__name__}")
    if not (rowwise or columnwise):
        raise ValueError("tq.quantize: ask for at least one usage (rowwise=True and/or columnwise=True)")
    # Errors about x itself: raised now in eager mode; under torch.compile, when the compiled code
    # runs, with a placeholder x traced in between (see tqcompile.ops.errors for why).
    if x.dtype not in SUPPORTED_DTYPES:
        message = (
            f"tq.quantize: x.dtype={x.dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16 "
            f"(cast first, e.g. x.float())"
        )
        x = ops.raise_error(TypeError, message, x, x.shape, torch.float32)
    # Functions, not methods: torch 2.11's Dynamo calls a quantizer's methods with constants only.
    if shape_error(quantizer, x.shape) is not None:
        shape = ops.static_shape(x.shape)  # a constant message under dynamic shapes too
        x = ops.raise_error(ValueError, shape_error(quantizer, shape), x, padded_shape(quantizer, shape))
    x_t = None
    if columnwise:
        if x.dim() < 1:
            raise ValueError("tq.quantize: columnwise usage needs a tensor with at least 1 dim")
        x_t = x.reshape(x.shape[:-1].numel(), x.shape[-1]).t()  # not reshape(-1, K): ambiguous when K == 0
        if shape_error(quantizer, x_t.shape) is not None:
            shape_t = ops.static_shape(x_t.shape)
            problem = shape_error(quantizer, shape_t)
            message = f"tq.quantize: columnwise usage quantizes the transpose, of shape {shape_t}: {problem}"
            padded_t = padded_shape(quantizer, shape_t)
            x = ops.raise_error(ValueError, message, x, None if padded_t is None else padded_t[::-1])
            x_t = x.t()
    if seed is not None and not isinstance(seed, torch.Tensor):
        raise TypeError(f"tq.quantize: seed must be an int64 tensor of shape (2,) [seed, offset], got {type(seed).__name__} {seed!r}")
    elif seed is not None and (seed.dtype != torch.int64 or seed.shape != (2,)):
        raise ValueError(f"tq.quantize: seed must be an int64 tensor of shape (2,) [seed, offset], got {seed.dtype} {tuple(seed.shape)}")

    if amax_history is not None:
        _check_amax_history(amax_history, quantizer)
    group_name = group_name_of(amax_group)
    if amax is not None:
        _check_static_amax(x, quantizer, amax, columnwise, amax_history)
    return quantize_usages(
        x, x_t, quantizer, rowwise=rowwise, columnwise=columnwise, seed=seed, group_name=group_name, amax_history=amax_history, amax=amax
    )


def _check_static_amax(x: torch.Tensor, q: Quantizer, amax: torch.Tensor, columnwise: bool, amax_history) -> None:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise TypeError(f"tq.quantize: amax must be a float32 tensor, got {getattr(amax, 'dtype', type(amax).__name__)}")
    if amax_history is not None:
        raise ValueError("tq.quantize: pass either a static amax or an amax_history (delayed scaling), not both")
    if not q.takes_static_amax():
        raise ValueError(
            f"tq.quantize: {q!r} computes each 32-element block's scale from the block itself; it takes no static amax"
        )
    if q.uses_tensor_amax():
        if amax.shape != ():
            raise ValueError(
                f"tq.quantize: {q!r} has a tensor-level amax; the static amax must be 0-dim, got shape {tuple(amax.shape)}"
            )
        if columnwise and q.hadamard_transformed():
            raise ValueError(
                f"tq.quantize: {q!r} transforms the last dim, so its columnwise usage needs its own amax; quantize without a static amax"
            )
        return
    want = q.scale_shape(x.shape)
    if tuple(amax.shape) != tuple(want):
        raise ValueError(
            f"tq.quantize: the static amax of {q!r} for x of shape {tuple(x.shape)} must have shape {tuple(want)} (one per scaling unit), got {tuple(amax.shape)}"
        )
    if columnwise:
        raise ValueError(
            f"tq.quantize: a per-unit static amax serves the rowwise usage only ({q!r}); quantize the transpose separately"
        )
