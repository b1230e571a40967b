"""The tensor-parallel quantized linear: colwise and rowwise, as autograd.Functions on local shards.

Data flow (the three GEMMs are explained in `tqcompile.recipes`; "split" means which dim of the
2-D operand is divided over the TP group, and so which scales `quantize_shard` reduces):

Colwise: W (N/tp, K) sharded on N; y (M, N/tp) stays sharded.
    fprop   x: replicated input, quantized whole (nothing to reduce); or sequence-sharded
               (M/tp, K): quantized on the shard with the amax over the TP group, then
               all-gathered *quantized* (uint8 payload + scales) -> (M, K)
            W: split on N: tensor amax over TP; 128x128 / 16x16 tiles need N/tp whole tiles
    dgrad   dy (M, N/tp): split on N: amax / per-row (along N) amaxes over TP
            W columnwise (K, N/tp): per-row amaxes along N over TP
            dx = dy @ W is a partial sum over the N shards: all-reduced (replicated input) or
               reduce-scattered to the sequence shards, in high precision (a sum of separately
               quantized partial sums is not the single-process result)
    wgrad   dy columnwise (N/tp, M): rows whole; tensor amax over TP
            x columnwise (K, M): gathered with fprop's all-gather (quantized on the shard with
               per-row amaxes along M over TP), derived by transposing the gathered rowwise
               payload where that is exact (tensorwise FP8), or gathered in high precision in
               backward when the recipe's wgrad is high precision
Rowwise: W (N, K/tp) sharded on K; x (M, K/tp) sharded on K; y partial over K shards.
    fprop   x, W: split on K: amax / per-row (along K) amaxes over TP; blocks need K/tp whole
            y: all-reduced (replicated output) or reduce-scattered to sequence shards, high precision
    dgrad   dy: replicated (quantized whole), or sequence-sharded: quantized on the shard with
               the amax over TP and all-gathered quantized (both usages in one collective)
            W columnwise (K/tp, N): rows whole; tensor amax over TP
    wgrad   x columnwise (K/tp, M): rows whole; tensor amax over TP

So each rank quantizes exactly what the single-process run quantizes; only the fp32 summation
order of the partial sums (dx of colwise, y of rowwise) differs.
"""

from __future__ import annotations

import torch

from tqcompile import ops
from tqcompile.api import quantize
from tqcompile.distributed import tp_comm as comm
from tqcompile.nn.functional import qgemm
from tqcompile.recipes import Recipe
from tqcompile.tensor import QuantizedTensor

__all__ = ["colwise_linear", "rowwise_linear", "gather_input", "SequenceGatheredInput", "REPLICATE", "SEQUENCE"]

REPLICATE, SEQUENCE = "replicate", "sequence"


class SequenceGatheredInput:
    """An activation all-gathered along the sequence once, quantized, for several colwise consumers.

    What `QuantizedSequenceParallelInput` hands a module in place of its input: the gathered
    fprop operand (`fprop`, rowwise `recipe.fprop_input`), the gathered wgrad operand (`wgrad`,
    columnwise `recipe.wgrad_input`, or None where it is the transposed fprop payload), and
    `anchor`, a zero-strided tensor of the gathered shape through which the consumers' input
    gradients flow back (autograd sums them; one reduce-scatter sends the sum to the shards).
    `shape`, `dtype`, `device` and `dim()` are the gathered activation's, so module code that
    reads them (``b, s, d = x.shape``) runs unchanged.
    """

    def __init__(self, anchor: torch.Tensor, fprop: QuantizedTensor, wgrad: QuantizedTensor | None) -> None:
        self.anchor, self.fprop, self.wgrad = anchor, fprop, wgrad

    @property
    def shape(self) -> torch.Size:
        return self.anchor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def dim(self) -> int:
        return self.anchor.dim()

    def size(self, dim: int | None = None):
        return self.anchor.shape if dim is None else self.anchor.shape[dim]


def _batch_seq(shape: torch.Size, seq_dim: int) -> tuple[int, int]:
    if seq_dim % len(shape) != len(shape) - 2:
        raise ValueError(
            f"sequence parallel: the sequence dim ({seq_dim}) must be the one before the features; got shape {tuple(shape)}"
        )
    return shape[:-2].numel(), shape[-2]


def _quantize_gather(x2, recipe: Recipe, group, world, batch, seq_local, what, want_wgrad, hist_x, defer_wgrad):
    """Quantize the token shard x2 (M/tp, K) for fprop (and wgrad) and all-gather it quantized.

    Returns (gathered fprop operand, wgrad operand): the wgrad operand is None where it is the
    transposed fprop payload (tensorwise FP8); otherwise it is quantized on the shard now and,
    with `defer_wgrad`, returned unsent (backward gathers it: the forward gathers only what the
    forward GEMM needs), else gathered in the same collective as the fprop operand."""
    r = recipe
    comm.check_shard(r.fprop_input, seq_local, world, 0, "rowwise", f"{what} input", tokens=True)
    qx = comm.quantize_shard(x2, r.fprop_input, group, 0, amax_history=hist_x)
    qxw = None
    if want_wgrad and not (r.wgrad_input == r.fprop_input and comm.transposable(r.fprop_input)):
        comm.check_shard(r.wgrad_input, seq_local, world, 0, "columnwise", f"{what} input", tokens=True)
        qxw = comm.quantize_shard(x2, r.wgrad_input, group, 0, rowwise=False, columnwise=True)
    if qxw is None or defer_wgrad:
        return comm.all_gather_tokens([qx], group, world, batch)[0], qxw
    return tuple(comm.all_gather_tokens([qx, qxw], group, world, batch))


def _weight_operand(weight, recipe: Recipe, group: str, split_dim: int, need_dgrad: bool, next_w, what: str):
    """(fprop operand, whether it also carries dgrad's columnwise usage, whether FSDP2 gathered it).

    A `QuantizedTensor` is the weight FSDP2 all-gathered quantized on a 2-D mesh
    (`tqcompile.distributed.fsdp_tp`): its amaxes were reduced over the FSDP and the TP group, and
    it holds the usages this pass needs, so it is used as it is (quantizing it again would be
    wrong, not just slow). Anything else is the high-precision local shard, quantized here."""
    r = recipe
    if isinstance(weight, QuantizedTensor):
        if not (weight.quantizer == r.fprop_weight == r.dgrad_weight):
            raise ValueError(
                f"{what}: the gathered weight was quantized with {weight.quantizer!r}; recipe {r.name!r} wants "
                f"{r.fprop_weight!r} for fprop and {r.dgrad_weight!r} for dgrad"
            )
        if weight.amax_group_name != group:
            raise ValueError(
                f"{what}: the gathered weight's amaxes were reduced over group {weight.amax_group_name!r}, not over "
                f"this layer's TP group {group!r}; its scales would not be the single-process ones"
            )
        if getattr(weight, "_rowwise_not_gathered", None):  # a recomputed forward (tqcompile.distributed.recompute)
            raise ValueError(weight._rowwise_not_gathered)
        return weight, need_dgrad, True
    w_shared = need_dgrad and r.dgrad_weight == r.fprop_weight
    return (
        comm.quantize_shard(weight, r.fprop_weight, group, split_dim, columnwise=w_shared, amax_history=next_w),
        w_shared,
        False,
    )


def _wgrad_operand(qx_gathered: QuantizedTensor, qw_gathered: QuantizedTensor | None) -> QuantizedTensor:
    return qw_gathered if qw_gathered is not None else comm.columnwise_from_rowwise(qx_gathered)


def _history_copies(hist_x, hist_w):
    # Delayed scaling, as `tq.nn.functional.linear` does it: forward quantizes from copies of the
    # histories (the op rolls the copy, whose index 0 is then this call's group-reduced amax); the
    # buffers themselves roll in backward, so a recomputed forward sees what the original saw.
    return (None, None) if hist_x is None else (hist_x.clone(), hist_w.clone())


def _current_amaxes(next_x, next_w):
    return None if next_x is None else torch.stack((next_x[0], next_w[0]))


def _roll_histories(histories, current_amaxes, update: bool):
    """Roll the input and weight histories (training only); return the gradient's history to quantize
    dy with (a copy in eval mode, so it scales from the history without rolling it)."""
    hist_x, hist_w, hist_dy = histories
    if hist_dy is not None and not update:
        hist_dy = hist_dy.clone()
    if hist_x is not None and update:
        ops.amax_history_update(hist_x, current_amaxes[0])
        if hist_w is not None:  # None: an FSDP2-gathered weight, whose gather rolled it
            ops.amax_history_update(hist_w, current_amaxes[1])
    return hist_dy


class _ColwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        shared_fprop,
        shared_wgrad,
        recipe: Recipe,
        group,
        world,
        mode,
        seq_dim,
        what,
        backward,
        update,
        hist_x,
        hist_w,
        hist_dy,
    ):
        r = recipe
        need_dgrad, need_wgrad = backward and ctx.needs_input_grad[0], backward and ctx.needs_input_grad[1]
        hp_wgrad = r.wgrad_input is None
        next_x, next_w = _history_copies(hist_x, hist_w)
        batch = seq_local = 0
        saved_x = saved_xw = None
        out_lead = x.shape[:-1]
        if shared_fprop is not None:  # gathered once for several consumers; x is the anchor
            qx, qxw = shared_fprop, shared_wgrad
            saved_x, saved_xw = (qx, qxw) if need_wgrad else (None, None)
        elif mode == SEQUENCE:
            batch, seq_local = _batch_seq(x.shape, seq_dim)
            out_lead = (*x.shape[:-2], seq_local * world)
            x2 = x.reshape(-1, x.shape[-1])
            qx, qxw = _quantize_gather(x2, r, group, world, batch, seq_local, what, need_wgrad and not hp_wgrad, next_x, True)
            if need_wgrad:
                # Keep only what wgrad reads: the gathered rowwise payload (transposed there) or the local
                # columnwise shard (gathered there), or the high-precision shard.
                saved_x, saved_xw = (x2, None) if hp_wgrad else ((qx, None) if qxw is None else (None, qxw))
        else:  # replicated input: every rank holds all of x, so quantizing it whole is the single-process quantization
            x2 = x.reshape(-1, x.shape[-1])
            x_shared = need_wgrad and r.wgrad_input == r.fprop_input
            qx = quantize(x2, r.fprop_input, columnwise=x_shared, amax_history=next_x)
            if need_wgrad:
                if hp_wgrad:
                    saved_x = x2
                elif x_shared:
                    saved_x = qx.keep_usages(rowwise=False, columnwise=True)
                else:
                    saved_x = quantize(x2, r.wgrad_input, rowwise=False, columnwise=True)
        qw, w_shared, gathered = _weight_operand(weight, r, group, 0, need_dgrad, next_w, what)
        y = qgemm(qx, False, qw, False, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved_w = qw if gathered else qw.keep_usages(rowwise=False, columnwise=True) if w_shared else weight
        ctx.save_for_backward(saved_w, saved_x, saved_xw, _current_amaxes(next_x, next_w))
        # Not saved tensors: backward mutates them (see nn.functional). A gathered weight's history
        # was rolled by its gather.
        ctx.histories = (hist_x, None if gathered else hist_w, hist_dy)
        ctx.args = (r, group, world, mode, shared_fprop is not None, batch, x.shape, x.dtype, w_shared, bias is not None, update)
        return y.reshape(*out_lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        r, group, world, mode, shared, batch, x_shape, x_dtype, w_shared, has_bias, update = ctx.args
        saved_w, saved_x, saved_xw, current_amaxes = ctx.saved_tensors
        hist_dy = _roll_histories(ctx.histories, current_amaxes, update)
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_wgrad = ctx.needs_input_grad[1]
        dy_shared = need_wgrad and r.wgrad_grad == r.dgrad_grad
        # dy is split on N: its amax (and per-row amaxes along N) are reduced over the TP group.
        qdy = comm.quantize_shard(dy2, r.dgrad_grad, group, 1, columnwise=dy_shared, amax_history=hist_dy)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qw_t = saved_w if w_shared else comm.quantize_shard(saved_w, r.dgrad_weight, group, 0, rowwise=False, columnwise=True)
            dx2 = qgemm(qdy, False, qw_t, True, x_dtype)  # a partial sum over the N shards
            if shared:
                dx = dx2.reshape(x_shape)
            elif mode == SEQUENCE:
                dx = comm.reduce_scatter_seq(dx2, group, world, batch).reshape(x_shape)
            else:
                dx = comm.all_reduce_sum(dx2, group).reshape(x_shape)
        if need_wgrad:
            w_dtype = saved_w.dtype
            if r.wgrad_grad is None:
                x_full = comm.all_gather_seq(saved_x, group, world, batch) if mode == SEQUENCE and not shared else saved_x
                with torch.autocast(dy2.device.type, enabled=False):
                    dw = (dy2.t() @ x_full.to(dy2.dtype)).to(w_dtype)
            else:
                qdy_t = qdy if dy_shared else comm.quantize_shard(dy2, r.wgrad_grad, group, 1, rowwise=False, columnwise=True)
                if shared:
                    qx_t = _wgrad_operand(saved_x, saved_xw)
                elif mode == SEQUENCE:  # the local columnwise shard quantized in forward, gathered now
                    qx_t = _wgrad_operand(
                        saved_x, None if saved_xw is None else comm.all_gather_tokens([saved_xw], group, world, batch)[0]
                    )
                else:
                    qx_t = saved_x
                dw = qgemm(qdy_t, True, qx_t, True, w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None, None, None


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, recipe: Recipe, group, world, mode, seq_dim, what, backward, update, hist_x, hist_w, hist_dy
    ):
        r = recipe
        need_dgrad, need_wgrad = backward and ctx.needs_input_grad[0], backward and ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        next_x, next_w = _history_copies(hist_x, hist_w)
        # x and W are split on K: amaxes and per-row amaxes along K are reduced over the TP group.
        x_shared = need_wgrad and r.wgrad_input == r.fprop_input
        qx = comm.quantize_shard(x2, r.fprop_input, group, 1, columnwise=x_shared, amax_history=next_x)
        if not need_wgrad:
            saved_x = None
        elif r.wgrad_input is None:
            saved_x = x2
        elif x_shared:
            saved_x = qx.keep_usages(rowwise=False, columnwise=True)
        else:
            saved_x = comm.quantize_shard(x2, r.wgrad_input, group, 1, rowwise=False, columnwise=True)
        qw, w_shared, gathered = _weight_operand(weight, r, group, 1, need_dgrad, next_w, what)
        y2 = qgemm(qx, False, qw, False, x.dtype)  # a partial sum over the K shards
        if mode == SEQUENCE:
            batch, seq_full = _batch_seq(x.shape, seq_dim)
            if seq_full % world:
                raise ValueError(
                    f"{what}: sequence parallelism splits the sequence (token) dimension over {world} ranks, but the sequence "
                    f"length {seq_full} is not divisible by the TP degree {world}; use a multiple of {world} (pad the sequence)"
                )
            y2 = comm.reduce_scatter_seq(y2, group, world, batch)
            out_shape = (*x.shape[:-2], seq_full // world, y2.shape[-1])
        else:
            batch = 0
            y2 = comm.all_reduce_sum(y2, group)
            out_shape = (*x.shape[:-1], y2.shape[-1])
        if bias is not None:
            y2 = y2 + bias.to(y2.dtype)
        saved_w = qw if gathered else qw.keep_usages(rowwise=False, columnwise=True) if w_shared else weight
        ctx.save_for_backward(saved_w, saved_x, _current_amaxes(next_x, next_w))
        ctx.histories = (hist_x, None if gathered else hist_w, hist_dy)
        ctx.args = (r, group, world, mode, batch, x.shape, x.dtype, w_shared, bias is not None, what, update)
        return y2.reshape(out_shape)

    @staticmethod
    def backward(ctx, dy):
        r, group, world, mode, batch, x_shape, x_dtype, w_shared, has_bias, what, update = ctx.args
        saved_w, saved_x, current_amaxes = ctx.saved_tensors
        hist_dy = _roll_histories(ctx.histories, current_amaxes, update)
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = None
        if has_bias and ctx.needs_input_grad[2]:
            # The bias was added after the reduction: with sequence-sharded outputs each rank sees
            # part of the tokens, so its bias gradient is summed over the group.
            db = comm.all_reduce_sum(dy2.sum(0), group) if mode == SEQUENCE else dy2.sum(0)
        need_wgrad = ctx.needs_input_grad[1]
        quant_wgrad = need_wgrad and r.wgrad_grad is not None
        dy_shared = quant_wgrad and r.wgrad_grad == r.dgrad_grad
        qdy_t = None
        if mode == SEQUENCE:
            # dy arrives split along the sequence: quantize the shard (amax over TP) and all-gather
            # it quantized, both usages in one collective.
            seq_local = dy.shape[-2]
            comm.check_shard(r.dgrad_grad, seq_local, world, 0, "rowwise", f"{what} output gradient", tokens=True)
            qdy = comm.quantize_shard(dy2, r.dgrad_grad, group, 0, amax_history=hist_dy)
            qts = [qdy]
            if quant_wgrad and not (dy_shared and comm.transposable(r.dgrad_grad)):
                comm.check_shard(r.wgrad_grad, seq_local, world, 0, "columnwise", f"{what} output gradient", tokens=True)
                qts.append(comm.quantize_shard(dy2, r.wgrad_grad, group, 0, rowwise=False, columnwise=True))
            gathered = comm.all_gather_tokens(qts, group, world, batch)
            qdy = gathered[0]
            if quant_wgrad:
                qdy_t = _wgrad_operand(qdy, gathered[1] if len(gathered) > 1 else None)
            if need_wgrad and r.wgrad_grad is None:
                dy2 = comm.all_gather_seq(dy2, group, world, batch)
        else:
            # Replicated output: every rank holds all of dy, so it is quantized whole.
            qdy = quantize(dy2, r.dgrad_grad, columnwise=dy_shared, amax_history=hist_dy)
            if quant_wgrad:
                qdy_t = qdy if dy_shared else quantize(dy2, r.wgrad_grad, rowwise=False, columnwise=True)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qw_t = saved_w if w_shared else comm.quantize_shard(saved_w, r.dgrad_weight, group, 1, rowwise=False, columnwise=True)
            dx = qgemm(qdy, False, qw_t, True, x_dtype).reshape(x_shape)
        if need_wgrad:
            w_dtype = saved_w.dtype
            if r.wgrad_grad is None:
                with torch.autocast(dy2.device.type, enabled=False):
                    dw = (dy2.t() @ saved_x.to(dy2.dtype)).to(w_dtype)
            else:
                dw = qgemm(qdy_t, True, saved_x, True, w_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None


class _AnchorGrad(torch.autograd.Function):
    """The gradient path of a shared gather: forward makes a zero-strided tensor of the gathered
    shape; backward reduce-scatters the consumers' summed input gradient to the sequence shards."""

    @staticmethod
    def forward(ctx, x, full_shape, group, world, batch):
        ctx.args = (group, world, batch, x.shape)
        return x.new_zeros(()).expand(full_shape)

    @staticmethod
    def backward(ctx, g):
        group, world, batch, shape = ctx.args
        return comm.reduce_scatter_seq(g.reshape(-1, g.shape[-1]), group, world, batch).reshape(shape), None, None, None, None


def gather_input(x: torch.Tensor, recipe: Recipe, group: str, world: int, seq_dim: int, what: str) -> SequenceGatheredInput:
    """Quantize a sequence-sharded activation once and all-gather it quantized, for several consumers."""
    batch, seq_local = _batch_seq(x.shape, seq_dim)
    full_shape = (*x.shape[:-2], seq_local * world, x.shape[-1])
    need_wgrad = torch.is_grad_enabled()
    qx, qxw = _quantize_gather(
        x.detach().reshape(-1, x.shape[-1]), recipe, group, world, batch, seq_local, what, need_wgrad, None, False
    )
    anchor = (
        _AnchorGrad.apply(x, full_shape, group, world, batch)
        if x.requires_grad and torch.is_grad_enabled()
        else x.new_zeros(()).expand(full_shape)
    )
    return SequenceGatheredInput(anchor, qx, qxw)


def colwise_linear(x, weight, bias, recipe, group, world, mode, seq_dim, what, histories, update_histories=True) -> torch.Tensor:
    """y = x @ W.T + b with W (and b) sharded on the output features (see the module docstring)."""
    hist = histories or (None, None, None)
    if isinstance(x, SequenceGatheredInput):
        if x.fprop.quantizer != recipe.fprop_input:
            raise ValueError(
                f"{what}: the shared gathered input was quantized with {x.fprop.quantizer!r}, but this layer's recipe {recipe.name!r} wants {recipe.fprop_input!r}"
            )
        anchor = x.anchor
        backward = torch.is_grad_enabled() and (anchor.requires_grad or weight.requires_grad)
        return _ColwiseLinear.apply(
            anchor, weight, bias, x.fprop, x.wgrad, recipe, group, world, mode, seq_dim, what, backward, update_histories, *hist
        )
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _ColwiseLinear.apply(
        x, weight, bias, None, None, recipe, group, world, mode, seq_dim, what, backward, update_histories, *hist
    )


def rowwise_linear(x, weight, bias, recipe, group, world, mode, seq_dim, what, histories, update_histories=True) -> torch.Tensor:
    """y = x @ W.T + b with x and W sharded on the input features, y reduced (see the module docstring)."""
    if isinstance(x, SequenceGatheredInput):
        raise TypeError(
            f"{what}: a shared gathered input (QuantizedSequenceParallelInput) feeds ColwiseParallel layers only, not RowwiseParallel"
        )
    hist = histories or (None, None, None)
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _RowwiseLinear.apply(x, weight, bias, recipe, group, world, mode, seq_dim, what, backward, update_histories, *hist)
