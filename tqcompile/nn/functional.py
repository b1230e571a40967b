"""`linear`: the quantized linear layer as one autograd.Function (the three GEMMs are explained
in `tqcompile.recipes`).

What forward hands to backward is one typed object, `_LinearCtx`, plus the tensors saved with
`save_for_backward`:

- for dgrad: the weight's columnwise usage when fprop and dgrad share the weight quantizer
  (quantized once in forward), else the high-precision weight (a parameter: no extra memory);
- for wgrad: the input's columnwise usage, quantized in forward (1 byte or less per element
  instead of 2-4), or the high-precision input when the recipe runs wgrad in high precision.

Delayed scaling rolls all three amax histories in backward, not the input's and weight's in
forward: forward only reads them, so a recomputed forward (activation checkpointing, eager or
compiled) sees the histories the original forward saw and quantizes bit for bit the same. The
forward's amaxes reach backward as a saved tensor; the buffers travel on `ctx` (not saved tensors,
whose version check would fail when a layer is called again before this backward).
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile import ops
from tqcompile.api import quantize
from tqcompile.nn._checks import linear_input_error
from tqcompile.ops.errors import raise_error
from tqcompile.recipes import Recipe
from tqcompile.tensor import QuantizedTensor

__all__ = ["linear", "qgemm"]


def qgemm(a: QuantizedTensor, a_columnwise: bool, b: QuantizedTensor, b_columnwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``a_usage @ b_usage.T`` for two 2-D quantized operands (see `tqcompile.ops.gemm`)."""
    return ops.gemm_tn(*a.usage(a_columnwise), a.quantizer, *b.usage(b_columnwise), b.quantizer, out_dtype)


@dataclasses.dataclass(frozen=True)
class _LinearCtx:
    recipe: Recipe
    amax_group: str | None
    input_shape: torch.Size
    input_dtype: torch.dtype
    weight_quantized: bool  # saved weight is a QuantizedTensor (columnwise) rather than the parameter
    has_bias: bool
    update_histories: bool


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, recipe: Recipe, amax_group, backward: bool, update_histories: bool, hist_x, hist_w, hist_dy
    ):
        r = recipe
        # Build what backward needs only when it will run: `backward` is False under no_grad
        # (needs_input_grad does not see grad mode, and forward always runs without it).
        need_dgrad, need_wgrad = backward and ctx.needs_input_grad[0], backward and ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        x_shared = need_wgrad and r.wgrad_input == r.fprop_input
        # Delayed scaling: quantize from copies of the histories (the op rolls the copy, which then holds
        # this call's amax at index 0); the buffers themselves roll in backward (see the module docstring).
        next_x, next_w = (None, None) if hist_x is None else (hist_x.clone(), hist_w.clone())
        qx = quantize(x2, r.fprop_input, amax_group=amax_group, columnwise=x_shared, amax_history=next_x)
        if isinstance(weight, QuantizedTensor):
            # --- FSDP2 quantized all-gather (tq.distributed.fsdp): the weight arrives quantized, with
            # its usages for fprop and dgrad; the gather scaled it from, and rolled, its history, so
            # backward leaves that one alone.
            w_shared, qw = need_dgrad, weight
            hist_w = None
        else:
            w_shared = need_dgrad and r.dgrad_weight == r.fprop_weight
            qw = quantize(weight, r.fprop_weight, columnwise=w_shared, amax_history=next_w)
        y = qgemm(qx, False, qw, False, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)

        saved_w = qw if qw is weight else qw.keep_usages(rowwise=False, columnwise=True) if w_shared else weight
        if not need_wgrad:
            saved_x = None
        elif r.wgrad_input is None:
            saved_x = x2
        elif x_shared:
            saved_x = qx.keep_usages(rowwise=False, columnwise=True)
        else:
            saved_x = quantize(x2, r.wgrad_input, amax_group=amax_group, rowwise=False, columnwise=True)
        current_amaxes = None if hist_x is None else torch.stack((next_x[0], next_w[0]))
        ctx.save_for_backward(saved_w, saved_x, current_amaxes)
        # The buffers themselves are not saved tensors: backward mutates them, and a second call of the
        # layer before this backward (a shared layer, microbatches in flight) would then fail autograd's
        # version check.
        ctx.histories = (hist_x, hist_w, hist_dy)
        ctx.args = _LinearCtx(r, amax_group, x.shape, x.dtype, w_shared, bias is not None, update_histories)
        # A 2-D input returns `y` itself: a view (even a same-shape reshape) would be a view output of
        # the layer, and FSDP2 warns on every forward that it skips a view's all-gather hooks.
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        a: _LinearCtx = ctx.args
        r = a.recipe
        saved_w, saved_x, current_amaxes = ctx.saved_tensors
        hist_x, hist_w, hist_dy = ctx.histories
        if hist_dy is not None and not a.update_histories:
            hist_dy = hist_dy.clone()  # eval mode: scale from the history, leave it as it is
        dy2 = dy.reshape(-1, dy.shape[-1])
        dy_shared = r.wgrad_grad == r.dgrad_grad
        # dgrad's dy only where it is used: a stochastically rounded quantize that a compiled backward
        # drops as dead code would still draw from torch's generator in eager mode, and every later
        # draw would differ (a first layer, whose input needs no grad, then got another wgrad seed).
        qdy = None
        if ctx.needs_input_grad[0] or dy_shared or hist_dy is not None:
            qdy = quantize(dy2, r.dgrad_grad, amax_group=a.amax_group, columnwise=dy_shared, amax_history=hist_dy)
        if hist_x is not None and a.update_histories:
            ops.amax_history_update(hist_x, current_amaxes[0])
            if hist_w is not None:  # None: an FSDP2-gathered weight, whose gather rolled it
                ops.amax_history_update(hist_w, current_amaxes[1])

        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qw_t = saved_w if a.weight_quantized else quantize(saved_w, r.dgrad_weight, rowwise=False, columnwise=True)
            dx = qgemm(qdy, False, qw_t, True, a.input_dtype).reshape(a.input_shape)
        if ctx.needs_input_grad[1]:
            w_dtype = saved_w.dtype
            if r.wgrad_grad is None:
                # Eager runs this backward outside the forward's autocast, while AOTAutograd traces it
                # inside: without this, compiled training would do this matmul in bf16, eager in fp32.
                with torch.autocast(dy2.device.type, enabled=False):
                    dw = (dy2.t() @ saved_x.to(dy2.dtype)).to(w_dtype)
            else:
                qdy_t = qdy if dy_shared else quantize(dy2, r.wgrad_grad, amax_group=a.amax_group, rowwise=False, columnwise=True)
                dw = qgemm(qdy_t, True, saved_x, True, w_dtype)
        if a.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    amax_group: str | None = None,
    amax_histories: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    update_amax_histories: bool = True,
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with every GEMM operand quantized as `recipe` says.

    Args:
        x: (..., in_features), float32/bfloat16/float16.
        weight: (out_features, in_features).
        amax_group: name of the group whose ranks share activation and gradient amaxes (the
            tensor-parallel group); passed to `tq.quantize` at each point of use.
        amax_histories: delayed scaling buffers (input, weight, grad) for recipes with
            `amax_history_len` > 0; `tq.nn.Linear` owns and passes them. Every GEMM scales from
            the max of its operand's history (the current amax while it is all zeros). The call's
            amaxes are rolled in once, in its backward: a forward that is recomputed (activation
            checkpointing) or never backpropagated leaves them as they are.
        update_amax_histories: False: scale from the histories but never roll them (what
            `tq.nn.Linear` passes in eval mode).
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"linear: recipe must be a tq.Recipe (e.g. tq.recipes.fp8_tensorwise()), got {type(recipe).__name__}")
    if isinstance(weight, QuantizedTensor) and not (weight.quantizer == recipe.fprop_weight == recipe.dgrad_weight):
        raise ValueError(
            f"linear: a quantized weight ({weight!r}) must use recipe {recipe.name!r}'s fprop and dgrad weight quantizer"
        )
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    error = linear_input_error(x, weight, recipe, backward)
    if error is None and isinstance(weight, QuantizedTensor) and getattr(weight, "_rowwise_not_gathered", None):
        # An FSDP2-gathered weight whose backward all-gather left the rowwise usage unfilled, read by a
        # recomputed forward (tqcompile.distributed.fsdp): never a silently wrong result.
        error = (ValueError, weight._rowwise_not_gathered)
    if error is not None:
        # Raises now in eager mode; under torch.compile, when the compiled code runs, so the user
        # sees this message rather than Dynamo's "Observed exception" (tqcompile.ops.errors).
        return raise_error(*error, like=x, shape=(*x.shape[:-1], weight.shape[0]))
    if recipe.amax_history_len and amax_histories is None:
        raise ValueError(f"linear: recipe {recipe.name!r} uses delayed scaling; pass amax_histories (tq.nn.Linear owns them)")
    hist_x, hist_w, hist_dy = amax_histories if recipe.amax_history_len else (None, None, None)
    return _QuantizedLinear.apply(x, weight, bias, recipe, amax_group, backward, update_amax_histories, hist_x, hist_w, hist_dy)
