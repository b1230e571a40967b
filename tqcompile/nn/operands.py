"""Operand sources of the one quantized linear (`tqcompile.nn.functional`): where an operand lives
on this rank, how it is quantized, and what is reduced or gathered around its GEMMs.

The autograd Function runs the three GEMMs of `tqcompile.recipes` in one way for every layout;
what differs between a plain layer and a tensor-parallel shard is asked of three sources, frozen
values held by `LinearFwdArgs`:

- ``input`` (x): quantizes x for fprop (rowwise) and wgrad (columnwise), hands wgrad its operand in
  backward, and turns dgrad's result into dx (a colwise TP layer's dx is a partial sum over its
  N shards: all-reduced, or reduce-scattered to the sequence shards);
- ``weight`` (W): quantizes W for fprop and dgrad. A weight that FSDP2 all-gathered quantized
  arrives as a `QuantizedTensor` and is used as it is, whatever the source;
- ``output`` (y and dy): turns fprop's result into y (a rowwise TP layer's y is a partial sum over
  its K shards) and quantizes dy for dgrad and wgrad.

The base classes here are the single-process layout; `tqcompile.distributed.tp_linear` subclasses
them for TP shards. Sources hold no tensors (a compiled graph bakes them in as constants, and
Dynamo guards on them); tensors a source made earlier (a shared sequence gather) travel as the
Function's tensor arguments. Grouped MoE experts have a Function of their own
(`tqcompile.nn.grouped`: every operand quantized per expert token segment, the grouped GEMM ops),
whose weight operand is read, as here, from an FSDP2-gathered `GroupedQuantizedTensor` as it is
or quantized locally (`_weight_operand`); folding it into these sources is not done.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from tqcompile import ops
from tqcompile.api import quantize
from tqcompile.quantizers import Quantizer
from tqcompile.tensor import QuantizedTensor

__all__ = ["ActivationSource", "WeightSource", "Gemm", "qgemm"]


def qgemm(a: QuantizedTensor, a_columnwise: bool, b: QuantizedTensor, b_columnwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``a_usage @ b_usage.T`` for two 2-D quantized operands; ``*_columnwise`` picks the usage that
    is blocked along the GEMM's reduction dim (see `tqcompile.ops.gemm`). The linear names its GEMMs
    instead (`Gemm`): ``source.gemm(Gemm.DGRAD, qdy, qw, x.dtype)``."""
    return ops.gemm_tn(*a.usage(a_columnwise), a.quantizer, *b.usage(b_columnwise), b.quantizer, out_dtype)


class Gemm(enum.Enum):
    """The three GEMMs of a linear layer (`tqcompile.recipes`), valued by the usages of (a, b) they read."""

    FPROP = (False, False)  # y  = x · Wᵀ: rowwise x, rowwise W
    DGRAD = (False, True)  # dx = dy · W: rowwise dy, columnwise W
    WGRAD = (True, True)  # dW = dyᵀ · x: columnwise dy, columnwise x


@dataclasses.dataclass(frozen=True)
class ActivationSource:
    """An activation (the input x, or the output y with its gradient dy) held whole by this rank;
    `amax_group`: the ranks that share its amaxes (`tq.nn.functional.linear`'s `amax_group`)."""

    amax_group: str | None = None

    def quantize(self, t: torch.Tensor, q: Quantizer, *, rowwise: bool = True, columnwise: bool = False, amax_history=None):
        """`t` (2-D, this rank's tokens x features) quantized so that it is this rank's part of the whole's quantization."""
        return quantize(t, q, amax_group=self.amax_group, rowwise=rowwise, columnwise=columnwise, amax_history=amax_history)

    def batch(self, shape: torch.Size) -> int:
        """What backward needs of the activation's shape (sequence shards: the batch size)."""
        return 0

    def gathered_lead(self, shape: torch.Size) -> tuple[int, ...]:
        """The leading dims the GEMMs see of an input of `shape`; `scattered_lead` those of the output."""
        return tuple(shape[:-1])

    def scattered_lead(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return lead

    def operands(self, t2, q_row, q_col, *, row: bool, col: bool, amax_history, batch: int, what: str, defer_col=False):
        """(rowwise operand, columnwise operand) of the 2-D `t2` for the GEMMs that run.

        `row`: the rowwise one (fprop's x, dgrad's dy) with `q_row`, scaled from `amax_history`;
        `col`: the columnwise one (wgrad's x or dy) with `q_col`, quantized once with the rowwise
        where the quantizers are equal. A columnwise operand of None with `col` means "the
        transposed rowwise payload" and `defer_col` lets a source return it unsent (see
        `wgrad_operand`); whole activations never do either."""
        shared = row and col and q_col == q_row
        qa = self.quantize(t2, q_row, columnwise=shared, amax_history=amax_history) if row else None
        if shared:
            return qa, qa.keep_usages(rowwise=False, columnwise=True)
        return qa, self.quantize(t2, q_col, rowwise=False, columnwise=True) if col else None

    def wgrad_operand(self, row: QuantizedTensor | None, col: QuantizedTensor | None, batch: int, deferred: bool) -> QuantizedTensor:
        """wgrad's columnwise operand from what `operands` returned (`deferred`: with `defer_col`)."""
        return col

    def gather_hp(self, t2: torch.Tensor, batch: int) -> torch.Tensor:
        """The high-precision activation wgrad multiplies with (a high-precision wgrad recipe)."""
        return t2

    def reduce(self, partial: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's result from the GEMM it ran on its shards (dx on the input side, y on the output side)."""
        return partial

    def bias_grad(self, db: torch.Tensor) -> torch.Tensor:
        """The bias gradient from this rank's `dy.sum(0)`."""
        return db

    def gemm(self, gemm: Gemm, a, b, out_dtype: torch.dtype) -> torch.Tensor:
        """`gemm` on this activation's tokens (grouped experts would run one per token segment)."""
        return qgemm(a, gemm.value[0], b, gemm.value[1], out_dtype)


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """A weight held whole by this rank (a parameter, or FSDP2's unsharded one)."""

    def quantize(self, w: torch.Tensor, q: Quantizer, *, rowwise: bool = True, columnwise: bool = False, amax_history=None):
        """`w` quantized so that it is this rank's part of the whole weight's quantization."""
        return quantize(w, q, rowwise=rowwise, columnwise=columnwise, amax_history=amax_history)

    def operands(self, w: torch.Tensor, q_fprop: Quantizer, q_dgrad: Quantizer, *, dgrad: bool, amax_history):
        """(fprop's operand, what backward keeps for dgrad, whether that is quantized): W's columnwise
        usage where both GEMMs share the quantizer (quantized once), else W itself (a parameter:
        no extra memory), quantized by `dgrad_operand` in backward."""
        shared = dgrad and q_dgrad == q_fprop
        qw = self.quantize(w, q_fprop, columnwise=shared, amax_history=amax_history)
        return qw, qw.keep_usages(rowwise=False, columnwise=True) if shared else w, shared

    def dgrad_operand(self, saved: torch.Tensor, q_dgrad: Quantizer, quantized: bool):
        """dgrad's columnwise operand from what `operands` kept."""
        return saved if quantized else self.quantize(saved, q_dgrad, rowwise=False, columnwise=True)

    def gathered_error(self, weight: QuantizedTensor, what: str) -> str | None:
        """Why a weight FSDP2 gathered quantized cannot serve this source (None if it can)."""
        return None
