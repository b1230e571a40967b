"""`linear`: the quantized linear layer as one autograd.Function for every layout. The three GEMMs
are explained in `tqcompile.recipes`; where each operand lives (this process, a tensor-parallel
shard) is asked of the operand sources of `tqcompile.nn.operands`.

Forward hands backward one typed object, `_LinearBwdArgs` (holding the call's `LinearFwdArgs`),
and saves: for dgrad, what `WeightSource.operands` keeps (W's columnwise usage, or W itself) or
FSDP2's gathered QuantizedTensor; for wgrad, x's columnwise usage quantized in forward (1 byte or
less per element instead of 2-4; see `ActivationSource.operands`), or x itself for a
high-precision wgrad.

dy is quantized for a GEMM only where that GEMM runs: for dgrad where x needs a gradient (or
delayed scaling rolls dy's history), for wgrad where W needs one and the recipe quantizes wgrad.
A stochastically rounded quantize that a compiled backward drops as dead code would still draw
from torch's generator in eager mode, and every later draw would differ.

Delayed scaling rolls all three amax histories in backward: forward quantizes from copies (the op
rolls the copy, whose index 0 then holds this call's amax, group-reduced where the operand is), so
a recomputed forward (activation checkpointing, eager or compiled) sees the histories the original
saw and quantizes bit for bit the same. The amaxes reach backward as a saved tensor; the buffers
travel on `ctx` (as saved tensors, their version check would fail when a layer is called again
before this backward). A weight FSDP2 gathered quantized had its history rolled by the gather.
"""

from __future__ import annotations

import dataclasses

import torch

from tqcompile import ops
from tqcompile.nn._checks import linear_input_error
from tqcompile.nn.base import QuantizedModule
from tqcompile.nn.operands import ActivationSource, Gemm, WeightSource, qgemm
from tqcompile.ops.errors import raise_error
from tqcompile.recipes import Recipe
from tqcompile.tensor import QuantizedTensor

__all__ = ["linear", "qgemm"]

_LOCAL_ACTIVATION, _LOCAL_WEIGHT = ActivationSource(), WeightSource()


@dataclasses.dataclass(frozen=True)
class LinearFwdArgs:
    """One call of the quantized linear: its recipe, where its operands live, and what it keeps."""

    # No object defaults: torch 2.11's Dynamo cannot build a default that is a dataclass instance
    # when it traces the constructor ("SourcelessBuilder ... ActivationSource"); callers pass all three.
    recipe: Recipe
    input: ActivationSource
    weight: WeightSource
    output: ActivationSource
    backward: bool = True  # keep what backward needs: grad mode is on and x or W requires grad
    update_histories: bool = True  # delayed scaling: roll the histories in backward (False: eval mode)
    what: str = "linear"  # the layer, for error messages


@dataclasses.dataclass(frozen=True)
class _LinearBwdArgs:
    fwd: LinearFwdArgs
    input_shape: torch.Size
    input_dtype: torch.dtype
    input_batch: int  # what the input source needs of x's shape in backward (`ActivationSource.batch`)
    output_batch: int
    weight_quantized: bool  # the saved weight carries dgrad's columnwise usage (else quantized in backward)
    has_bias: bool


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, given_fprop, given_wgrad, args: LinearFwdArgs, hist_x, hist_w, hist_dy):
        # given_fprop/given_wgrad: x's operands, quantized (and gathered) before for several layers;
        # x is then only the anchor its gradient flows back through.
        r, xs, ys = args.recipe, args.input, args.output
        # Build what backward needs only when it will run: `backward` is False under no_grad
        # (needs_input_grad does not see grad mode, and forward always runs without it).
        need_dgrad, need_wgrad = args.backward and ctx.needs_input_grad[0], args.backward and ctx.needs_input_grad[1]
        hp_wgrad = r.wgrad_input is None
        next_x, next_w = (None, None) if hist_x is None else (hist_x.clone(), hist_w.clone())
        in_batch = xs.batch(x.shape)
        if given_fprop is not None:  # (never a high-precision wgrad: `QuantizedSequenceParallelInput` refuses it)
            qx, x_col = given_fprop, given_wgrad
        else:
            x2 = x.reshape(-1, x.shape[-1])
            col, what = need_wgrad and not hp_wgrad, f"{args.what} input"
            qx, x_col = xs.operands(x2, r.fprop_input, r.wgrad_input, row=True, col=col, amax_history=next_x, batch=in_batch, what=what, defer_col=True)
        saved_x = (None, None) if not need_wgrad else (x2, None) if hp_wgrad else (qx if x_col is None else None, x_col)

        gathered = isinstance(weight, QuantizedTensor)  # by FSDP2, quantized, with the usages this pass needs
        if gathered:
            qw, saved_w, w_quantized = weight, weight, need_dgrad
        else:
            qw, saved_w, w_quantized = args.weight.operands(weight, r.fprop_weight, r.dgrad_weight, dgrad=need_dgrad, amax_history=next_w)
        lead = xs.gathered_lead(x.shape)
        out_batch = ys.batch(torch.Size((*lead, x.shape[-1])))
        out_lead = ys.scattered_lead(lead)
        y = ys.reduce(xs.gemm(Gemm.FPROP, qx, qw, x.dtype), out_batch)
        if bias is not None:
            y = y + bias.to(y.dtype)

        current_amaxes = None if next_x is None else torch.stack((next_x[0], next_w[0]))
        ctx.save_for_backward(saved_w, *saved_x, current_amaxes)
        ctx.histories = (hist_x, None if gathered else hist_w, hist_dy)
        ctx.args = _LinearBwdArgs(args, x.shape, x.dtype, in_batch, out_batch, w_quantized, bias is not None)
        # An output of the input's rank returns `y` itself: a view (even a same-shape reshape) would
        # be a view output of the layer, and FSDP2 warns on every forward that it skips a view's hooks.
        out_shape = (*out_lead, y.shape[-1])
        return y if tuple(y.shape) == out_shape else y.reshape(out_shape)

    @staticmethod
    def backward(ctx, dy):
        a: _LinearBwdArgs = ctx.args
        r, xs, ys = a.fwd.recipe, a.fwd.input, a.fwd.output
        saved_w, x_row, x_col, current_amaxes = ctx.saved_tensors
        hist_x, hist_w, hist_dy = ctx.histories
        if hist_dy is not None and not a.fwd.update_histories:
            hist_dy = hist_dy.clone()  # eval mode: scale dy from its history, leave the history as it is
        if hist_x is not None and a.fwd.update_histories:
            ops.amax_history_update(hist_x, current_amaxes[0])
            if hist_w is not None:  # None: an FSDP2-gathered weight, whose gather rolled it
                ops.amax_history_update(hist_w, current_amaxes[1])
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        quant_wgrad = need_wgrad and r.wgrad_grad is not None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = ys.bias_grad(dy2.sum(0)) if a.has_bias and ctx.needs_input_grad[2] else None
        want_row, what = need_dgrad or hist_dy is not None, f"{a.fwd.what} output gradient"
        qdy, qdy_col = ys.operands(
            dy2, r.dgrad_grad, r.wgrad_grad, row=want_row, col=quant_wgrad, amax_history=hist_dy, batch=a.output_batch, what=what
        )
        dx = dw = None
        if need_dgrad:
            qw_t = a.fwd.weight.dgrad_operand(saved_w, r.dgrad_weight, a.weight_quantized)
            dx = xs.reduce(xs.gemm(Gemm.DGRAD, qdy, qw_t, a.input_dtype), a.input_batch).reshape(a.input_shape)
        if quant_wgrad:
            qdy_t = ys.wgrad_operand(qdy, qdy_col, a.output_batch, deferred=False)
            qx_t = xs.wgrad_operand(x_row, x_col, a.input_batch, deferred=True)
            dw = xs.gemm(Gemm.WGRAD, qdy_t, qx_t, saved_w.dtype)
        elif need_wgrad:
            dy_full, x_full = ys.gather_hp(dy2, a.output_batch), xs.gather_hp(x_row, a.input_batch)
            # Eager runs this backward outside the forward's autocast, while AOTAutograd traces it
            # inside: without this, compiled training would do this matmul in bf16, eager in fp32.
            with torch.autocast(dy2.device.type, enabled=False):
                dw = (dy_full.t() @ x_full.to(dy_full.dtype)).to(saved_w.dtype)
        return dx, dw, db, None, None, None, None, None, None


def apply_linear(x, weight, bias, args: LinearFwdArgs, histories=None, given=(None, None), input_error=None) -> torch.Tensor:
    """Run the quantized linear `args` describes, after the checks every layout shares.

    `histories`: the delayed-scaling buffers (input, weight, grad) or None; `given`: x's operands
    quantized before (fprop, wgrad), x then being the anchor of their gradient; `input_error`: an
    (exception type, message) the caller found in its own checks."""
    error, r = input_error, args.recipe
    if error is None and isinstance(weight, QuantizedTensor):  # gathered by FSDP2
        if not (weight.quantizer == r.fprop_weight == r.dgrad_weight):
            message = f"{args.what}: a quantized weight ({weight!r}) must use recipe {r.name!r}'s fprop and dgrad weight quantizer"
        else:  # weight.rowwise_not_gathered: a recomputed forward reads a usage the gather left unfilled
            message = args.weight.gathered_error(weight, args.what) or weight.rowwise_not_gathered
        error = None if message is None else (ValueError, message)
    if error is not None:
        # Raises now in eager mode; under torch.compile, when the compiled code runs, so the user
        # sees this message rather than Dynamo's "Observed exception" (tqcompile.ops.errors).
        lead = args.output.scattered_lead(args.input.gathered_lead(x.shape))
        return raise_error(*error, like=x, shape=(*lead, weight.shape[0]))
    hist_x, hist_w, hist_dy = histories if r.amax_history_len and histories is not None else (None, None, None)
    return _Linear.apply(x, weight, bias, *given, args, hist_x, hist_w, hist_dy)


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
    return layer_linear(
        x, weight, bias, recipe, amax_group=amax_group, amax_histories=amax_histories, update_amax_histories=update_amax_histories
    )


def layer_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    amax_group: str | None = None,
    amax_histories: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    update_amax_histories: bool = True,
    layer: QuantizedModule | None = None,
) -> torch.Tensor:
    """`linear` as a layer calls it: `layer` is the calling module, whose name in the model
    `tq.convert` converted (`QuantizedModule.tq_fqn`) the call's errors name."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"linear: recipe must be a tq.Recipe (e.g. tq.recipes.fp8_tensorwise()), got {type(recipe).__name__}")
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    input_error = linear_input_error(x, weight, recipe, backward, layer)
    if input_error is None and recipe.amax_history_len and amax_histories is None:
        raise ValueError(f"linear: recipe {recipe.name!r} uses delayed scaling; pass amax_histories (tq.nn.Linear owns them)")
    side = _LOCAL_ACTIVATION if amax_group is None else ActivationSource(amax_group)
    args = LinearFwdArgs(recipe, side, _LOCAL_WEIGHT, side, backward, update_amax_histories)
    return apply_linear(x, weight, bias, args, amax_histories, input_error=input_error)
