"""GPTQ for one weight (issue 18, first part; `tq.calibrate` does not call it yet).

GPTQ (Frantar et al., 2022) quantizes a linear layer's weight one input column at a time and moves
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
of the layer's output error on its calibration inputs, ``H = 2 X^T X / n``. Here each column is
rounded by tq's own numerics, so the result is a weight the calibrated model computes with as it is:

- the scale of each scaling unit is fixed before its first column is quantized (per tensor and
  per row: from the whole weight; 1-D blocks along the input dim: from the block's columns as the
  earlier columns' errors have updated them; lazy-update blocks are whole scale blocks);
- a column is rounded with that unit's scale in the quantizer's own element arithmetic (Int / FP8:
  a ROWWISE copy of the quantizer with the unit's amax, ``x * (qmax / amax)``, rounded, clamped,
  times the reciprocal; MX: ``x / 2**e`` cast to the element format, times ``2**e``; NVFP4:
  ``e2m1(x * s_enc / s_blk) * (s_blk / s_enc)``);
- the function returns the rounded weight ``Q`` and the amaxes in the quantizer's static layout, so
  that ``fake_quantize(Q, quantizer, amax) == Q`` bit for bit.

MX and NVFP4 have no per-block static amax: tq recomputes each block's scale from ``Q``'s own block
max, which GPTQ's updates move after the scale was chosen. What that does:

- MX (E8M0 scale ``2**e``): ``Q``'s block max is at most the top code times ``2**e``, which gives
  back ``e``; a smaller max can only lower the exponent, to ``e' < e``, and each code times
  ``2**(e - e')`` is again a code (a power of two keeps the mantissa bits) unless it passes the
  element maximum. That happens only for E4M3 under the FLOOR rule, whose exponent puts the block
  max in [256, 512) while E4M3 stops at 448: a block whose largest code drops to 1.875 * 2**k (240,
  120, ...) would requantize it to 1.75 * 2**k. Such blocks (rare) are requantized, see below.
- NVFP4 (E4M3 block scale under the tensor scale ``s_enc``, which stays fixed: the returned amax is
  the starting weight's tensor amax): ``Q``'s block reproduces its scale only if its largest code is
  ±6. GPTQ's updates can pull the element that set the scale below 5 (code 4; measured on
  correlated inputs: about 1 block in 500, up to 1 in 60 with `act_order`). So while a block is rounded,
  a row whose block has no ±6 yet gets ±6 at the first column whose current magnitude is the
  largest of the block's columns still to come; its larger rounding error is then spread over the
  later columns like any other. Every block thus holds a ±6 without a second pass.
- With `act_order` (static groups) every block's scale comes from the starting weight, and a
  block's columns are visited out of order; the same two arguments hold.

A final check requantizes every block that would not reproduce itself; an MX block rounded to
nearest keeps its exponent, so it reproduces itself and the invariant holds for every output. (It
never fires for NVFP4: a block with a zero scale is all zero, every other one holds a ±6.)

A weight whose GPTQ result has a larger output error on the calibration inputs than round to
nearest (GPTQ is greedy: rare, on near-singular inputs) keeps the round-to-nearest result, so GPTQ
never does worse than `max` calibration on its own data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch

from tqcompile.calibration.algorithms import GPTQ
from tqcompile.calibration.fake_quant import fake_quantize, static_weight_amax
from tqcompile.formats import Format
from tqcompile.kernels import reference
from tqcompile.kernels.reference import nvfp4_tensor_scale, unit_amax
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, Quantizer

__all__: list[str] = []  # used by tq.calibrate once it offers algorithm="gptq"; nothing public yet

_ALLOWED = (
    "IntQuantizer or Float8Quantizer(E4M3) (TENSORWISE, ROWWISE along the input dim, or BLOCKWISE_1D), "
    "MXQuantizer, or NVFP4Quantizer with 1-D blocks, no Hadamard transform and round to nearest"
)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 X^T X / n`` (float64) of a layer's inputs `x` (..., in)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * x.T @ x / max(1, x.shape[0])


@functools.singledispatch
def _check(q: Quantizer) -> None:
    """Raise where GPTQ cannot round weights of `q`: registered per family; a family that does not
    say is not supported."""
    raise ValueError(f"GPTQ: weight quantizer {q!r} is not supported; allowed: {_ALLOWED}")


def _check_rows(q: Quantizer, ok: bool = True) -> None:
    # Int and FP8 are rounded column by column with a ROWWISE copy of the quantizer: their units
    # must lie along the input dim.
    gran, axis, _ = q.layout()
    if not ok or gran is Granularity.BLOCKWISE_2D or (gran is Granularity.ROWWISE and axis not in (-1, 1)):
        raise ValueError(f"GPTQ: weight quantizer {q!r} is not supported; allowed: {_ALLOWED}")


@_check.register(IntQuantizer)
def _(q: IntQuantizer) -> None:
    _check_rows(q)


@_check.register(Float8Quantizer)
def _(q: Float8Quantizer) -> None:
    _check_rows(q, ok=q.format is Format.E4M3)


@_check.register(MXQuantizer)
def _(q: Quantizer) -> None:
    return None


@_check.register(NVFP4Quantizer)
def _(q: NVFP4Quantizer) -> None:
    # 16x16 tiles span rows GPTQ rounds independently; a Hadamard weight is rounded in the rotated
    # basis, where this Hessian does not apply; stochastic rounding would not reproduce Q.
    bad = [f"{f}=True" for f in ("block_2d", "hadamard", "stochastic_rounding") if getattr(q, f)]
    if bad:
        raise ValueError(f"GPTQ: weight quantizer {q!r} is not supported ({', '.join(bad)}); allowed: {_ALLOWED}")


class _BlockScaled:
    """GPTQ's column rounding for block-scaled families (MX, NVFP4): each block's scale held fixed
    while its columns are rounded, in the element arithmetic of `reference.quantize` /
    `reference.dequantize`. Subclasses round one column (`_round`)."""

    def __init__(self, q: Quantizer, w: torch.Tensor, perm: torch.Tensor, act_order: bool, amax):
        self.q, self.block, self.act_order = q, q.layout()[2], act_order
        self.amax = amax  # NVFP4: the starting weight's tensor amax (or a fused group's), so s_enc stays; MX: None
        self.codec = q.element_format().codec
        self.top = self.codec.max_value
        # act_order visits columns out of order: static groups, every block's scale from the starting weight.
        blocks = w.split(self.block, dim=1)
        self.scales = torch.cat([self._scale(c) for c in blocks], 1) if act_order else w.new_zeros(w.shape[0], len(blocks))
        # Where each block's columns come in the visiting order (`perm`), and which rows' blocks hold a ±6 (NVFP4 pins one).
        self.visits = torch.argsort(perm).reshape(len(blocks), self.block).sort(dim=1).values
        self.topped = torch.zeros(w.shape[0], len(blocks), dtype=torch.bool, device=w.device)

    def _scale(self, cols: torch.Tensor) -> torch.Tensor:
        """(out, 1) fp32 scale tq picks for the block `cols` (out, block): MX ``2**e``, NVFP4 ``s_blk``."""
        return reference.quantize(cols, self.q, self.amax, None)[1].float()

    def round_column(self, w: torch.Tensor, w1: torch.Tensor, i1: int, i: int, j: int) -> torch.Tensor:
        """Column `i` of the lazy batch ``w1 = w[:, i1:i2]`` (visited columns of the weight `w`, in
        visiting order), which is weight column `j`, rounded: (out, 1)."""
        b = j // self.block
        if not self.act_order and j % self.block == 0:
            # The block's scale from its columns as the earlier errors left them (they are in order).
            self.scales[:, b] = self._scale(w1[:, i : i + self.block]).reshape(-1)
        return self._round(w, w1, i1, i, b, w1[:, i : i + 1], self.scales[:, b : b + 1])

    def _round(self, w, w1, i1: int, i: int, b: int, col: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _MXColumns(_BlockScaled):
    """MX: ``x / 2**e`` rounded by the element codec, times ``2**e``."""

    def _round(self, w, w1, i1, i, b, col, scale):
        return self.codec.round(col / scale) * scale


class _NVFP4Columns(_BlockScaled):
    """NVFP4: ``e2m1(x * s_enc / s_blk) * (s_blk / s_enc)``, with a ±6 pinned in every block (module docstring)."""

    def __init__(self, q: NVFP4Quantizer, w, perm, act_order, amax):
        super().__init__(q, w, perm, act_order, amax)
        self.s_enc = nvfp4_tensor_scale(self.amax, q)

    def _round(self, w, w1, i1, i, b, col, scale):
        v = torch.where(scale == 0, torch.zeros_like(col), col * self.s_enc / scale)
        codes = self.codec.round(v)
        # A row without a ±6 yet takes one at the largest of the block's columns still to come (their
        # current values: in this lazy batch, or in `w`, which lacks only this batch's pending update).
        rest = self.visits[b][self.visits[b] > i1 + i]
        i2 = i1 + w1.shape[1]
        rest = torch.cat((w1[:, rest[rest < i2] - i1], w[:, rest[rest >= i2]]), 1).abs()
        largest = col.abs() >= rest.amax(1, keepdim=True) if rest.shape[1] else torch.ones_like(col, dtype=torch.bool)
        pin = ~self.topped[:, b : b + 1] & largest & (scale > 0)
        codes = torch.where(pin, torch.copysign(torch.full_like(v, self.top), v), codes)
        self.topped[:, b : b + 1] |= codes.abs() == self.top
        return codes * (scale / self.s_enc)


@functools.singledispatch
def _block_columns(q: Quantizer, w, perm, act_order: bool, amax) -> _BlockScaled | None:
    """GPTQ's column rounding of a block-scaled family, registered per family; None: the family
    rounds a column with a ROWWISE copy of its quantizer under the column's unit amax (Int, FP8)."""
    return None


_block_columns.register(MXQuantizer, _MXColumns)
_block_columns.register(NVFP4Quantizer, _NVFP4Columns)


@contextlib.contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _inverse_cholesky(h: torch.Tensor, perm: torch.Tensor, dampening: float) -> tuple[torch.Tensor, float] | None:
    """Upper Cholesky factor U (float32) of the inverse of the dampened Hessian ``h + d I`` with its
    rows and columns in the order `perm`, and the ``d`` added; None if it stays singular after
    raising the dampening tenfold twice.

    Factored in float32, as llmcompressor does, and in float64 only where float32's Cholesky fails:
    float64 changed no measurable result (the same codes on tests/test_gptq_llmcompressor.py's
    fixture) and took twice the time and memory (at intermediate 14336 a float64 matrix is 1.6 GB).
    At most two matrices of h's size live at once besides `h` (the reordered copy, its factor)."""
    mean_diag = h.diagonal().mean().clamp(min=1e-12)
    # With J the reversal, J H J = L L^T gives H^-1 = U^T U for the upper U = J L^-1 J: one Cholesky
    # and one triangular inverse, where the inverse then its Cholesky took two more factorisations'
    # work. J comes with the reordering: `rev` gathers J P H P^T J in one copy.
    rev = perm.flip(0)
    for damp in (dampening, dampening * 10, dampening * 100):
        added = float(damp * mean_diag)
        for dtype in (torch.float32, torch.float64):
            damped = h.to(dtype)[rev.unsqueeze(1), rev]
            damped.diagonal().add_(added)
            # LAPACK leaves the factor column-major: the upper factor's transpose is L row-major, so
            # U's rows, which GPTQ's steps read one by one, are contiguous (a strided row cost 8x).
            upper, info = torch.linalg.cholesky_ex(damped, upper=True)
            del damped
            if int(info) == 0:
                lower = upper.mT
                _invert_lower_(lower)
                return lower.flip(0, 1).float(), added
            del upper
    return None


def _invert_lower_(m: torch.Tensor, leaf: int = 256) -> None:
    """Replace the lower-triangular `m` by its inverse, in place, by halves:
    ``[[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``, the corner from two triangular solves
    before A and C are inverted. That is LAPACK's trtri (n^3/3 flops), which torch does not offer;
    solving against the identity takes n^3 (measured at 4096, one thread: 0.55 s against 1.25 s in
    float64, 6e-15 relative apart)."""
    n = m.shape[0]
    if n <= leaf:
        m.copy_(torch.linalg.solve_triangular(m, torch.eye(n, dtype=m.dtype, device=m.device), upper=False))
        return
    k = n // 2
    a, b, c = m[:k, :k], m[k:, :k], m[k:, k:]
    b.copy_(torch.linalg.solve_triangular(c, torch.linalg.solve_triangular(a, b, upper=False, left=False), upper=False).neg_())
    _invert_lower_(a, leaf)
    _invert_lower_(c, leaf)


def _damped_error(d: torch.Tensor, hinv: torch.Tensor) -> float:
    """``tr(D H D^T)`` for the rows of `d` (out, in) under the dampened Hessian ``H = (U^T U)^-1``
    that `hinv` = U factors: ``|D U^-1|^2``, one triangular solve (out * in^2 flops), the same H
    GPTQ's own steps measure their error on."""
    return _squares(torch.linalg.solve_triangular(hinv, d, upper=True, left=False))


def _below(d: torch.Tensor, hinv: torch.Tensor, added: float, error: float, rows: int = 512) -> bool:
    """Whether ``tr(D H D^T)`` for the undampened ``H = (U^T U)^-1 - added I`` is below `error`. Each
    row's share is >= 0, so the rows are solved a chunk at a time until their sum reaches `error`:
    GPTQ's error, which round to nearest's usually passes well before its last row."""
    total = 0.0
    for chunk in d.split(rows):
        total += _damped_error(chunk, hinv) - added * _squares(chunk)
        if total >= error:
            return False
    return True


def _squares(t: torch.Tensor) -> float:
    """The sum of `t`'s squares, accumulated in float64 without a float64 copy of `t`."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2


@dataclasses.dataclass(frozen=True)
class _Result:
    q: torch.Tensor
    amax: torch.Tensor | None
    how: str
    requantized_blocks: int  # MX / NVFP4 blocks the final check requantized (0 for the other formats)


def gptq_quantize(
    weight: torch.Tensor,
    h: torch.Tensor,
    quantizer: Quantizer,
    config: GPTQ | None = None,
    *,
    name: str = "weight",
    tensor_amax: torch.Tensor | None = None,
    own_hessian: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """GPTQ-round `weight` (out, in) for inputs with Hessian `h` (in, in).

    Returns (Q, amax, how): Q the rounded weight (weight's dtype) with ``fake_quantize(Q, quantizer,
    amax) == Q``; amax in the quantizer's static layout (0-dim, (out, 1) or (out, in / block); the
    starting weight's tensor amax for NVFP4; None for MX, whose scales all come from Q's blocks);
    `how` "gptq", or "rtn" where GPTQ was not better, or the Hessian stayed singular or is zero
    (all-zero inputs) (both warned).

    `tensor_amax`: for NVFP4, the tensor-level amax to hold (at least the weight's own): the max
    over the weights an engine fuses into one GEMM (q/k/v), which share one global scale.
    `own_hessian`: the caller hands `h` (float64) over and keeps no reference: it is changed, and
    freed once GPTQ has its factor
    instead of copied (a Hessian at intermediate 14336 is 1.6 GB).
    """
    if tensor_amax is not None and not quantizer.has_global_scale():
        raise ValueError(f"gptq_quantize: tensor_amax is for NVFP4 weights; {quantizer!r} has none to hold")
    # In a list that `_gptq` empties: a local here would keep the matrix alive to the end.
    held = [h if own_hessian else h.double().clone()]
    del h
    r = _gptq(weight, held, quantizer, config or GPTQ(), name, tensor_amax)
    return r.q, r.amax, r.how


def _gptq(weight: torch.Tensor, h: torch.Tensor | list[torch.Tensor], quantizer: Quantizer, config: GPTQ, name: str, held_amax=None) -> _Result:
    _check(quantizer)
    gran = quantizer.layout()[0]
    quantizer.check_shape(weight.shape)
    w = weight.detach().float().clone()
    out_f, in_f = w.shape
    # Changed in place: `gptq_quantize` passes a copy unless the caller handed it over, in a list
    # emptied here so that no frame above keeps it alive once its factor is taken.
    h = (h.pop() if isinstance(h, list) else h).double()
    dead = h.diagonal() == 0  # inputs always zero: any weight there is free; make them zero
    if bool(dead.all()):
        # No input ever non-zero: the data says nothing about the weight, and zeroing all of it (its
        # amax too) throws the layer away for data that does reach it (held-out relative output error
        # 0.98 vs round to nearest's 0.0035 on tests/test_gptq.py's layer). Keep it, rounded to nearest.
        warnings.warn(
            f"GPTQ: the calibration inputs of {name!r} are all zero (its Hessian is zero: no information); "
            "it is rounded to nearest instead",
            stacklevel=3,
        )
        return _rtn(weight, quantizer, torch.zeros_like(dead), held_amax)
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(h.diagonal(), descending=True) if config.act_order else torch.arange(in_f, device=w.device)
    start_amax = held_amax if held_amax is not None else static_weight_amax(w, quantizer)
    blocked = _block_columns(quantizer, w, perm, config.act_order, start_amax)
    rows = None if blocked is not None else dataclasses.replace(quantizer, granularity=Granularity.ROWWISE, axis=-1)
    rounder = None if rows is None else _column_rounder(rows)
    block = quantizer.layout()[2]
    if blocked is not None:
        amax = blocked.amax
    elif gran is Granularity.TENSORWISE:
        amax = tensor_amax(w, quantizer)
    elif gran is Granularity.ROWWISE:
        amax = unit_amax(w, quantizer)
    else:
        amax = unit_amax(w, quantizer) if config.act_order else w.new_zeros(quantizer.scale_shape(w.shape))  # static groups with act_order

    def col_amax(j: int) -> torch.Tensor:
        if gran is Granularity.TENSORWISE:
            return amax.reshape(1, 1).expand(out_f, 1)
        return amax if gran is Granularity.ROWWISE else amax[:, j // block : j // block + 1]

    w = w[:, perm]
    factor = _inverse_cholesky(h, perm, config.dampening)
    del h  # its factor serves from here on (the comparison with round to nearest too)
    if factor is None:
        warnings.warn(
            f"GPTQ: the Hessian of {name!r} stays singular after dampening x100; it is rounded to nearest instead", stacklevel=3
        )
        return _rtn(weight, quantizer, dead, held_amax)
    hinv, added = factor
    order = perm.tolist()  # a Python int a column: int(perm[j]) costs a tensor index each
    # With E the steps' errors (`err`), W - Q = E U, so tr((W - Q) H (W - Q)^T) = |E|^2 on the dampened
    # H = (U^T U)^-1: GPTQ's output error comes with its steps, where it cost an (out, in) x (in, in) product.
    own_error = 0.0
    qw = torch.zeros_like(w)
    # Lazy blocks hold whole 1-D scale blocks, so a block's columns are all up to date when its scale is chosen.
    step = -(-config.block_size // block) * block if gran is Granularity.BLOCKWISE_1D else config.block_size
    for i1 in range(0, in_f, step):
        i2 = min(i1 + step, in_f)
        # The lazy batch is held transposed (`w1t`, `q1t`, `errt`: a column a contiguous row; `w1` its
        # (out, cols) view): the per-column update, rounding and stores then touch contiguous memory
        # (1.3-1.6x faster per batch at 512-1408 rows, the same arithmetic), and its rounded columns
        # are written into qw at once: a column of qw is `in` floats apart row to row.
        w1t = w[:, i1:i2].T.contiguous()
        w1, q1t, errt = w1t.T, w.new_zeros(i2 - i1, out_f), w.new_zeros(i2 - i1, out_f)
        h1 = hinv[i1:i2, i1:i2]
        with _one_thread():  # tiny per-column ops: thread hand-offs cost more than they give (measured 100x on 2 busy cores)
            for i in range(i2 - i1):
                j = order[i1 + i]
                col = w1[:, i : i + 1]
                if blocked is not None:
                    qc = blocked.round_column(w, w1, i1, i, j)
                else:
                    if gran is Granularity.BLOCKWISE_1D and not config.act_order and j % block == 0:
                        # The block's scale from its columns as the earlier errors left them (they are in order).
                        amax[:, j // block] = unit_amax(w1[:, i : i + block], rows).reshape(amax[:, j // block].shape)
                        rounder.amax_changed(j // block)
                    qc = rounder(col, col_amax(j), j // block)
                q1t[i] = qc[:, 0]
                e = (col[:, 0] - qc[:, 0]) / h1[i, i]
                w1t[i:] -= h1[i, i:, None] * e
                errt[i] = e
        qw[:, i1:i2] = q1t.T
        err = errt.T.contiguous()  # as before: the product and the sum below see the same layout
        w[:, i2:].addmm_(err, hinv[i1:i2, i2:], alpha=-1)  # in place: no (out, in) temporary a block (1.8x at 4096 x 14336)
        own_error += _squares(err)
    q = torch.empty_like(qw)
    q[:, perm] = qw
    moved = 0
    if blocked is not None:
        q, moved = _requantize_moved_blocks(q, quantizer, amax)
    rtn = _rtn(weight, quantizer, dead, held_amax)
    # Both errors without the dampening (the output error on the calibration inputs), the same H for both.
    live = weight.detach().float().masked_fill(dead, 0.0)[:, perm]
    d, d_rtn = live - q[:, perm], live - rtn.q.float()[:, perm]
    error = (_damped_error(d, hinv) if moved else own_error) - added * _squares(d)
    if _below(d_rtn, hinv, added, error):
        return dataclasses.replace(rtn, requantized_blocks=moved)
    return _Result(q.to(weight.dtype), amax.reshape(()) if gran is Granularity.TENSORWISE else amax, "gptq", moved)


class _RoundRows:
    """A column rounded with a ROWWISE copy of the quantizer under its unit's amax (FP8): the
    reference kernels, called per column."""

    def __init__(self, rows: Quantizer):
        self.rows = rows

    def amax_changed(self, unit: int) -> None:
        """Unit `unit`'s amax was set anew (nothing held here)."""

    def __call__(self, col: torch.Tensor, amax: torch.Tensor, unit: int) -> torch.Tensor:
        # Two copies of the column: 4-bit payloads pack pairs (the element arithmetic is per element).
        return _round_rows(col.expand(-1, 2), self.rows, amax)[:, :1]


class _IntColumns(_RoundRows):
    """Int: each unit's scales computed once, kept until `amax_changed` says the unit's amax was
    set (the in-order path sets a group's amax as its first column comes), and every column rounded
    in the reference's arithmetic under them (`IntQuantizer.reference_round`: bit for bit
    `_round_rows`, a third of its time on a 512-wide weight). Activation order visits the groups
    in turns: computed when the unit changed, the scales were recomputed for 84% of the columns."""

    def __init__(self, rows: Quantizer):
        super().__init__(rows)
        self.scales: dict[int, tuple] = {}

    def amax_changed(self, unit: int) -> None:
        self.scales.pop(unit, None)

    def __call__(self, col, amax, unit):
        scales = self.scales.get(unit)
        if scales is None:
            scales = self.scales[unit] = self.rows.reference_unit_scales(amax)
        return self.rows.reference_round(col, *scales)


@functools.singledispatch
def _column_rounder(rows: Quantizer) -> _RoundRows:
    """How GPTQ rounds one column of an amax-scaled family (`rows`: its ROWWISE copy), per family."""
    return _RoundRows(rows)


_column_rounder.register(IntQuantizer, _IntColumns)


def _round_rows(cols: torch.Tensor, rows: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """``fake_quantize(cols, rows, amax)``'s forward: the reference kernels `tq.quantize` and
    `dequantize` run, called directly. Per column, the custom-op dispatch, argument checks and
    autograd wrapper around them cost a quarter of GPTQ's time (measured on a 512 x 512 weight:
    INT4 g128 114 -> 84 ms, INT8 per row 89 -> 62 ms, FP8 per row 91 -> 65 ms; results identical)."""
    data, scale_inv = reference.quantize(cols, rows, amax, None)
    return reference.dequantize(data, scale_inv, None, rows, torch.float32)


def _requantize_moved_blocks(q: torch.Tensor, quantizer: Quantizer, amax: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Replace each block of `q` whose scale tq would recompute differently by its requantization
    (a block rounded to nearest reproduces itself); returns the result and how many blocks moved."""
    block = quantizer.layout()[2]
    fq = fake_quantize(q, quantizer, amax)
    moved = (fq != q).unflatten(-1, (-1, block)).any(-1)
    return torch.where(moved.repeat_interleave(block, -1), fq, q), int(moved.sum())


def _rtn(weight: torch.Tensor, quantizer: Quantizer, dead: torch.Tensor, held_amax=None) -> _Result:
    """Round to nearest with `max` amaxes (what `tq.calibrate` gives; an NVFP4 amax held), dead inputs zeroed."""
    w = weight.detach().float() * (~dead).float()
    amax = held_amax if held_amax is not None else static_weight_amax(w, quantizer)
    return _Result(fake_quantize(w, quantizer, amax=amax).to(weight.dtype), amax, "rtn", 0)
