"""`linear`: the quantized linear layer as one autograd.Function (the three GEMMs are explained
in `tqcompile.recipes`).

What forward hands to backward is one typed object, `_LinearCtx`, plus the tensors saved with
`save_for_backward`:

- for dgrad: the weight's columnwise usage when fprop and dgrad share the weight quantizer
  (quantized once in forward), else the high-precision weight (a parameter: no extra memory);
- for wgrad: the input's columnwise usage, quantized in forward (1 byte or less per element
  instead of 2-4), or the high-precision input when the recipe runs wgrad in high precision.
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile import ops
from tqcompile.api import SUPPORTED_DTYPES, quantize
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


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe, amax_group, backward: bool, hist_x, hist_w, hist_dy):
        r = recipe
        # Build what backward needs only when it will run: `backward` is False under no_grad
        # (needs_input_grad does not see grad mode, and forward always runs without it).
        need_dgrad, need_wgrad = backward and ctx.needs_input_grad[0], backward and ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        x_shared = need_wgrad and r.wgrad_input == r.fprop_input
        qx = quantize(x2, r.fprop_input, amax_group=amax_group, columnwise=x_shared, amax_history=hist_x)
        if isinstance(weight, QuantizedTensor):
            # --- FSDP2 quantized all-gather (tq.distributed.fsdp): the weight arrives quantized,
            # with its usages for fprop and dgrad; its delayed-scaling history was rolled there.
            w_shared, qw = need_dgrad, weight
        else:
            w_shared = need_dgrad and r.dgrad_weight == r.fprop_weight
            qw = quantize(weight, r.fprop_weight, columnwise=w_shared, amax_history=hist_w)
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
        ctx.save_for_backward(saved_w, saved_x, hist_dy)
        ctx.args = _LinearCtx(r, amax_group, x.shape, x.dtype, w_shared, bias is not None)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        a: _LinearCtx = ctx.args
        r = a.recipe
        saved_w, saved_x, hist_dy = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dy_shared = r.wgrad_grad == r.dgrad_grad
        qdy = quantize(dy2, r.dgrad_grad, amax_group=a.amax_group, columnwise=dy_shared, amax_history=hist_dy)

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
        return dx, dw, db, None, None, None, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    amax_group: str | None = None,
    amax_histories: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with every GEMM operand quantized as `recipe` says.

    Args:
        x: (..., in_features), float32/bfloat16/float16.
        weight: (out_features, in_features).
        amax_group: name of the group whose ranks share activation and gradient amaxes (the
            tensor-parallel group); passed to `tq.quantize` at each point of use.
        amax_histories: delayed scaling buffers (input, weight, grad) for recipes with
            `amax_history_len` > 0; `tq.nn.Linear` owns and passes them.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"linear: recipe must be a tq.Recipe (e.g. tq.recipes.fp8_tensorwise()), got {type(recipe).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"linear: input dtype {x.dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input last dim {x.shape[-1]} does not match weight in_features {weight.shape[-1]}")
    if isinstance(weight, QuantizedTensor) and not (weight.quantizer == recipe.fprop_weight == recipe.dgrad_weight):
        raise ValueError(
            f"linear: a quantized weight ({weight!r}) must use recipe {recipe.name!r}'s fprop and dgrad weight quantizer"
        )
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    reason = recipe.unsupported_reason(weight.shape[-1], weight.shape[0], x.numel() // max(x.shape[-1], 1), backward=backward)
    if reason:
        raise ValueError(f"linear: recipe {recipe.name!r} cannot serve this call: {reason}")
    if recipe.amax_history_len and amax_histories is None:
        raise ValueError(f"linear: recipe {recipe.name!r} uses delayed scaling; pass amax_histories (tq.nn.Linear owns them)")
    hist_x, hist_w, hist_dy = amax_histories if recipe.amax_history_len else (None, None, None)
    return _QuantizedLinear.apply(x, weight, bias, recipe, amax_group, backward, hist_x, hist_w, hist_dy)
