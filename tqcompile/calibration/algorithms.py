"""The calibration algorithms `tq.calibrate(algorithm=...)` accepts, as frozen value objects.

Two families:

- *scale search* for static amaxes: "max", "percentile", "mse" (strings; see `tq.calibrate`);
- *weight transforms* that change the model's float weights before they are rounded:
  `SmoothQuant` and `AWQ` (per-input-channel scales folded into the op that produces the layer's
  input) and `GPTQ` (rounding with error feedback). The strings "smoothquant", "awq" and "gptq"
  select their defaults.

An ordered combination is a tuple or list, run in order: at most one smoothing transform
(SmoothQuant or AWQ), GPTQ after it, and at most one scale search (which applies to the static
activation amaxes, and to weights GPTQ does not round). ``("smoothquant", "gptq")`` is
llmcompressor's usual W8A8 recipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["GPTQ", "AWQ", "SmoothQuant", "Algorithm", "AlgorithmPlan", "parse_algorithm", "SCALE_SEARCH"]

SCALE_SEARCH = ("max", "percentile", "mse")
AWQ_LOSSES = ("hessian", "output")


def _check_int(owner: str, name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: an int >= {low}")


def _check_float(owner: str, name: str, value, low: float, high: float, *, closed: bool = False) -> None:
    ok = isinstance(value, float | int) and not isinstance(value, bool)
    ok = ok and (low <= value <= high if closed else low < value < high)
    if not ok:
        interval = f"[{low}, {high}]" if closed else f"({low}, {high})"
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: a number in {interval}")


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name}={value!r} is not allowed; allowed: True or False")


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """GPTQ (Frantar et al., 2022): each weight is rounded one input column at a time, and each
    column's rounding error is moved onto the columns not yet rounded, weighted by the inverse
    Hessian ``2 X^T X / n`` of the layer's calibration inputs.

    Args:
        block_size: columns per lazy-update block (rounded up to whole scale blocks).
        dampening: added to the Hessian's diagonal, as a fraction of its mean; raised tenfold
            twice if the Hessian stays singular, then the weight is rounded to nearest (warned).
        act_order: round columns by decreasing Hessian diagonal (static groups: scales stay per
            contiguous block of columns, so export and kernels are unchanged).
    """

    block_size: int = 128
    dampening: float = 0.01
    act_order: bool = True

    def __post_init__(self) -> None:
        _check_int("GPTQ", "block_size", self.block_size, 1)
        _check_float("GPTQ", "dampening", self.dampening, 0.0, 1.0)
        _check_bool("GPTQ", "act_order", self.act_order)


@dataclasses.dataclass(frozen=True)
class AWQ:
    """AWQ (Lin et al., 2023): per-input-channel scales ``s``, searched on the calibration data,
    multiply the weight's input channels (``W diag(s)``) and divide the op that produces the
    layer's input (a norm's weight, or the previous linear's output rows), so salient channels
    lose less to rounding; then a per-scale-unit clipping search of the weight.

    Args:
        grid: candidate exponents ``r = i / grid`` (i = 0 .. grid-1) of
            ``s = mean|x|^r / mean|w|^(1-r)`` (or ``mean|x|^r`` without `duo_scaling`); the
            identity (no scaling) is always a candidate too, so AWQ never does worse than none on
            its data.
        duo_scaling: divide by the weight's per-channel mean magnitude as well.
        clip: search a clipping ratio per scale unit after scaling.
        clip_grid: clipping ratios tried, evenly from 1 down to ``1 - max_shrink``.
        max_shrink: the largest fraction of a unit's amax the clipping may remove.
        loss: what a candidate scale is scored by. "hessian" (the default): the summed output
            error of the layers that share the input, ``sum tr(D H Dᵀ)`` from their Hessians (no
            forward run). "output": for layers that share an input (q/k/v, gate/up), the mean
            squared error of their lowest common parent module's output (the attention, the MLP)
            on every calibration batch, as llmcompressor scores them: the error as the block
            passes it on (through the softmax, the activation, o_proj or down_proj), for
            ``grid + 1`` runs of each parent a batch (their calls are recorded in the statistics
            pass) and the parents' inputs and outputs held while the group is calibrated. A
            single layer's fold is scored by its Hessian either way (its own output error: the
            same objective). Measured equal to "hessian" on docs/ptq.md's two models.
    """

    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    loss: str = "hessian"

    def __post_init__(self) -> None:
        _check_int("AWQ", "grid", self.grid, 1)
        _check_bool("AWQ", "duo_scaling", self.duo_scaling)
        _check_bool("AWQ", "clip", self.clip)
        _check_int("AWQ", "clip_grid", self.clip_grid, 1)
        _check_float("AWQ", "max_shrink", self.max_shrink, 0.0, 1.0)
        if self.loss not in AWQ_LOSSES:
            raise ValueError(f"AWQ: loss={self.loss!r} is not allowed; allowed: {', '.join(map(repr, AWQ_LOSSES))}")

    def __repr__(self) -> str:
        # The default loss is left out: the text `tq.quant_state` records stays what it was before `loss` existed.
        shown = [f.name for f in dataclasses.fields(self) if f.name != "loss" or self.loss != "hessian"]
        return f"AWQ({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"


@dataclasses.dataclass(frozen=True)
class SmoothQuant:
    """SmoothQuant (Xiao et al., 2022): per-input-channel scales
    ``s = max|x|^alpha / max|w|^(1 - alpha)`` move activation outliers into the weights
    (``W diag(s)``, input divided by ``s`` in the op that produces it), so both quantize to 8 bits.

    Args:
        alpha: migration strength in [0, 1]: 0 leaves activations as they are, 1 moves all of
            their range into the weights.
        linear_folds: also smooth the layers whose input a previous linear produces (down_proj
            through ``act(gate) * up`` into up_proj's rows, o_proj into v_proj's). False (the
            default): only the layers that read a norm's output (q/k/v, gate/up, an MoE's experts),
            as the SmoothQuant paper's own code and llmcompressor's mappings do; measured on
            docs/ptq.md's Llama, the down_proj fold lowered the KL from the float model slightly but
            raised the perplexity above llmcompressor's (docs/ptq.md).
    """

    alpha: float = 0.5
    linear_folds: bool = False

    def __post_init__(self) -> None:
        _check_float("SmoothQuant", "alpha", self.alpha, 0.0, 1.0, closed=True)
        _check_bool("SmoothQuant", "linear_folds", self.linear_folds)


Algorithm = GPTQ | AWQ | SmoothQuant
_BY_NAME = {"gptq": GPTQ, "awq": AWQ, "smoothquant": SmoothQuant}
_ALLOWED = (
    "'max', 'percentile', 'mse', 'gptq', 'awq', 'smoothquant', a tq.GPTQ / tq.AWQ / tq.SmoothQuant, or an ordered tuple of them"
)


@dataclasses.dataclass(frozen=True)
class AlgorithmPlan:
    """What `tq.calibrate` runs: the weight transforms in order, and the scale search."""

    scale_search: str = "max"
    smoothing: AWQ | SmoothQuant | None = None
    gptq: GPTQ | None = None

    @property
    def transforms(self) -> tuple[Algorithm, ...]:
        return tuple(a for a in (self.smoothing, self.gptq) if a is not None)

    def describe(self) -> str:
        """A stable text form, kept in `tq.quant_state` (e.g. ``"SmoothQuant(alpha=0.5) + GPTQ(...) + max"``)."""
        return " + ".join([*map(repr, self.transforms), self.scale_search])


def parse_algorithm(algorithm: str | Algorithm | Sequence[str | Algorithm], who: str = "tq.calibrate") -> AlgorithmPlan:
    """Check `algorithm` and put it in running order (raises ValueError naming what is allowed)."""
    items = list(algorithm) if isinstance(algorithm, list | tuple) else [algorithm]
    if not items:
        raise ValueError(f"{who}: algorithm={algorithm!r} is empty; allowed: {_ALLOWED}")
    search, smoothing, gptq = None, None, None
    for item in items:
        if isinstance(item, str) and item in _BY_NAME:
            item = _BY_NAME[item]()
        if isinstance(item, str) and item in SCALE_SEARCH:
            if search is not None:
                raise ValueError(f"{who}: algorithm={algorithm!r} names two scale searches ({search!r}, {item!r}); allowed: one")
            search = item
        elif isinstance(item, AWQ | SmoothQuant):
            if smoothing is not None:
                raise ValueError(
                    f"{who}: algorithm={algorithm!r} names two smoothing transforms ({smoothing!r}, {item!r}); allowed: one "
                    "of AWQ or SmoothQuant"
                )
            if gptq is not None:
                raise ValueError(
                    f"{who}: algorithm={algorithm!r} puts {type(item).__name__} after GPTQ; smoothing must come first "
                    "(it would move GPTQ's rounded weights off their grid)"
                )
            smoothing = item
        elif isinstance(item, GPTQ):
            if gptq is not None:
                raise ValueError(f"{who}: algorithm={algorithm!r} names GPTQ twice; allowed: once")
            gptq = item
        else:
            raise ValueError(f"{who}: algorithm={item!r} is not allowed; allowed: {_ALLOWED}")
    return AlgorithmPlan(search or "max", smoothing, gptq)
