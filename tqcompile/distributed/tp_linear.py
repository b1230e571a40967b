"""The tensor-parallel quantized linear: colwise and rowwise layouts as operand sources of the one
quantized linear Function (`tqcompile.nn.functional`; sources: `tqcompile.nn.operands`).

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

import dataclasses

import torch

from tqcompile.distributed import tp_comm as comm
from tqcompile.nn.functional import LinearFwdArgs, apply_linear
from tqcompile.nn.operands import ActivationSource, WeightSource
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


def _columnwise(row: QuantizedTensor | None, col: QuantizedTensor | None) -> QuantizedTensor:
    # No columnwise operand: it is the transposed (gathered) rowwise payload (`Quantizer.columnwise_is_byte_transpose`).
    return col if col is not None else comm.columnwise_from_rowwise(row)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureShard(ActivationSource):
    """Split on its features over the TP group (a colwise layer's y and dy, a rowwise layer's x):
    amaxes, and per-row amaxes along the features, are reduced over the group."""

    group: str = ""

    def quantize(self, t, q, *, rowwise=True, columnwise=False, amax_history=None):
        return comm.quantize_shard(t, q, self.group, 1, rowwise=rowwise, columnwise=columnwise, amax_history=amax_history)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replicated(ActivationSource):
    """Whole on every rank (a colwise layer's x, a rowwise layer's y): quantized whole, as in one
    process, while the GEMM that yields it (dgrad's dx, fprop's y) is a partial sum over the shards,
    all-reduced in high precision (a sum of separately quantized partial sums is not the one-process result)."""

    group: str = ""

    def reduce(self, partial, batch):
        return comm.all_reduce_sum(partial, self.group)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceShard(ActivationSource):
    """Split along the sequence over the TP group (sequence parallelism; a colwise layer's x, a
    rowwise layer's y): quantized on the shard with amaxes over the group and all-gathered quantized
    for the GEMMs, while the GEMM that yields it is reduce-scattered back to the shards."""

    group: str = ""
    world: int = 1
    seq_dim: int = 1
    what: str = ""

    def quantize(self, t, q, *, rowwise=True, columnwise=False, amax_history=None):
        return comm.quantize_shard(t, q, self.group, 0, rowwise=rowwise, columnwise=columnwise, amax_history=amax_history)

    def batch(self, shape):
        return _batch_seq(shape, self.seq_dim)[0]

    def gathered_lead(self, shape):
        return (*shape[:-2], _batch_seq(shape, self.seq_dim)[1] * self.world)

    def scattered_lead(self, lead):
        if lead[-1] % self.world:
            raise ValueError(
                f"{self.what}: sequence parallelism splits the sequence (token) dimension over {self.world} ranks, but the "
                f"sequence length {lead[-1]} is not divisible by the TP degree {self.world}; use a multiple of {self.world} "
                "(pad the sequence)"
            )
        return (*lead[:-1], lead[-1] // self.world)

    def operands(self, t2, q_row, q_col, *, row, col, amax_history, batch, what, defer_col=False):
        # Both usages in one collective; the columnwise one is the transposed rowwise payload where that
        # is exact, and with `defer_col` it stays on the shard until backward gathers it (forward gathers
        # only what the forward GEMM needs).
        seq_local = t2.shape[0] // batch
        transposed = col and q_col == q_row and q_row.columnwise_is_byte_transpose()
        qts, col_local = [], None
        if row or transposed:
            comm.check_shard(q_row, seq_local, self.world, 0, "rowwise", what, tokens=True)
            qts.append(self.quantize(t2, q_row, amax_history=amax_history))
        if col and not transposed:
            comm.check_shard(q_col, seq_local, self.world, 0, "columnwise", what, tokens=True)
            col_local = self.quantize(t2, q_col, rowwise=False, columnwise=True)
            if not defer_col:
                qts.append(col_local)
        gathered = comm.all_gather_tokens(qts, self.group, self.world, batch) if qts else []
        qa = gathered[0] if row or transposed else None
        return qa, gathered[-1] if col_local is not None and not defer_col else col_local

    def wgrad_operand(self, row, col, batch, deferred):
        if col is not None and deferred:
            return comm.all_gather_tokens([col], self.group, self.world, batch)[0]
        return _columnwise(row, col)

    def gather_hp(self, t2, batch):
        return comm.all_gather_seq(t2, self.group, self.world, batch)

    def reduce(self, partial, batch):
        return comm.reduce_scatter_seq(partial, self.group, self.world, batch)

    def bias_grad(self, db):
        # The bias was added after the reduce-scatter: each rank saw part of the tokens.
        return comm.all_reduce_sum(db, self.group)


@dataclasses.dataclass(frozen=True)
class SharedGather(ActivationSource):
    """A colwise layer's input that `gather_input` quantized and gathered once for several layers:
    its operands come as the Function's given tensors, and its gradient flows back through the
    anchor, whose backward reduce-scatters the consumers' sum."""

    def wgrad_operand(self, row, col, batch, deferred):
        return _columnwise(row, col)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightShard(WeightSource):
    """The weight split over the TP group on `split_dim` (0: N, a colwise layer; 1: K, a rowwise one)."""

    group: str = ""
    split_dim: int = 0

    def quantize(self, w, q, *, rowwise=True, columnwise=False, amax_history=None):
        return comm.quantize_shard(w, q, self.group, self.split_dim, rowwise=rowwise, columnwise=columnwise, amax_history=amax_history)

    def gathered_error(self, weight, what):
        # FSDP2 gathered it quantized on a 2-D mesh (`tqcompile.distributed.fsdp_tp`): its amaxes must
        # have been reduced over the TP group too, or its scales are not the single-process ones.
        group = weight.amax_group_name
        return None if group == self.group else (
            f"{what}: the gathered weight's amaxes were reduced over group {group!r}, not over this layer's TP group "
            f"{self.group!r}; its scales would not be the single-process ones"
        )


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
    source = SequenceShard(group=group, world=world, seq_dim=seq_dim, what=what)
    batch, full_shape = source.batch(x.shape), (*source.gathered_lead(x.shape), x.shape[-1])
    x2, r, grad = x.detach().reshape(-1, x.shape[-1]), recipe, torch.is_grad_enabled()
    qx, qxw = source.operands(x2, r.fprop_input, r.wgrad_input, row=True, col=grad, amax_history=None, batch=batch, what=f"{what} input")
    anchor = (
        _AnchorGrad.apply(x, full_shape, group, world, batch) if x.requires_grad and grad else x.new_zeros(()).expand(full_shape)
    )
    return SequenceGatheredInput(anchor, qx, qxw)


def _apply(x, weight, bias, recipe, sources, what: str, histories, update_histories: bool, given=(None, None)):
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    args = LinearFwdArgs(recipe, *sources, backward=backward, update_histories=update_histories, what=what)
    return apply_linear(x, weight, bias, args, histories, given)


def _whole_side(mode: str, group: str, world: int, seq_dim: int, what: str) -> ActivationSource:
    """The side of the layer that TP does not split on the features: replicated, or sequence-sharded."""
    return SequenceShard(group=group, world=world, seq_dim=seq_dim, what=what) if mode == SEQUENCE else Replicated(group=group)


def colwise_linear(x, weight, bias, recipe, group, world, mode, seq_dim, what, histories, update_histories=True) -> torch.Tensor:
    """y = x @ W.T + b with W (and b) sharded on the output features (see the module docstring)."""
    weight_, output = WeightShard(group=group, split_dim=0), FeatureShard(group=group)
    if not isinstance(x, SequenceGatheredInput):
        sources = (_whole_side(mode, group, world, seq_dim, what), weight_, output)
        return _apply(x, weight, bias, recipe, sources, what, histories, update_histories)
    if x.fprop.quantizer != recipe.fprop_input:
        raise ValueError(
            f"{what}: the shared gathered input was quantized with {x.fprop.quantizer!r}, but this layer's recipe {recipe.name!r} wants {recipe.fprop_input!r}"
        )
    return _apply(x.anchor, weight, bias, recipe, (SharedGather(), weight_, output), what, histories, update_histories, (x.fprop, x.wgrad))


def rowwise_linear(x, weight, bias, recipe, group, world, mode, seq_dim, what, histories, update_histories=True) -> torch.Tensor:
    """y = x @ W.T + b with x and W sharded on the input features, y reduced (see the module docstring)."""
    if isinstance(x, SequenceGatheredInput):
        raise TypeError(
            f"{what}: a shared gathered input (QuantizedSequenceParallelInput) feeds ColwiseParallel layers only, not RowwiseParallel"
        )
    sources = (FeatureShard(group=group), WeightShard(group=group, split_dim=1), _whole_side(mode, group, world, seq_dim, what))
    return _apply(x, weight, bias, recipe, sources, what, histories, update_histories)
