"""Where a per-input-channel scale can be folded (SmoothQuant, AWQ), found on the model itself.

A layer ``y = x W^T`` gets ``W diag(s)``; its input must then become ``x / s``. That division is
folded into the op that produces `x`, so the model computes exactly what it computed before:

- a norm (any module with a 1-D ``weight`` of the channel count whose output is the layer's input,
  e.g. `nn.LayerNorm`, `nn.RMSNorm`, Hugging Face's ``LlamaRMSNorm``): its weight (and bias) is
  divided by ``s``; every module that reads the same output with a 2-D weight (all of q/k/v; a MoE
  router, kept in high precision, beside the experts) has its input columns multiplied by ``s``;
- a previous linear whose output reaches the layer through ops that are linear per channel (v_proj
  through attention into o_proj, up_proj through ``act(gate) * up`` into down_proj): its output rows
  (and bias) are divided by ``s``.

Candidates come from one recorded forward call (which norm produced the storage a layer reads;
which linears of the right width ran before it), and each candidate is *proved* on that call's
inputs: the fold is applied with random power-of-two scales (2^-6 .. 2^6), which scale every
product and sum exactly, and the model's outputs must stay bit for bit the same (then it is
undone, exactly). A candidate the proof rejects (another op reads the norm's output; a non-linear
op in between; a model whose output is random) is not used, and the layer is reported unsmoothed.
The folds with the scales actually chosen are checked once more on the same inputs, a group's all
together and, only where that fails, each on its own (within the rounding of the folded weights'
dtype, `fold_tolerance`; `tqcompile.calibration.smoothing`), which catches an op that is linear
only over part of the range (a clamp whose bound the probe scales never reached).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from tqcompile.surgery.names import canonical_modules

__all__ = ["Fold", "FoldRecorder", "apply_fold", "prove_fold", "fold_tolerance", "same_outputs", "outputs"]


@dataclasses.dataclass
class Fold:
    """One scale ``s`` shared by `consumers` (quantized layers, given as (E?, out, in) weight views)
    and `passive` (other modules reading the same input: their 2-D weight's columns are scaled too),
    divided out of `producer`: a norm ("norm") or a linear's output rows ("linear")."""

    producer: nn.Module
    producer_name: str
    kind: str  # "norm" or "linear"
    consumers: list  # units (fake-quantized modules) whose weights are quantized
    passive: list[nn.Module]


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() > 0 else None


class FoldRecorder:
    """Hooks that record, for the model's first forward call only: which modules with a 1-D weight
    produced the storage that each module with a 2-D weight (and each experts module) read, and the
    order in which those readers ran.

    The producers' outputs are kept alive until `remove`, so the allocator cannot hand their
    storage to another tensor during that call: a storage match is a real read of that output."""

    def __init__(self, model: nn.Module, root: nn.Module, units: list, input_module: Callable[[object], nn.Module]):
        self.read_from: dict[int, list[tuple[nn.Module, str]]] = {}
        self.order: dict[int, int] = {}
        self._alive: dict[int, list[tuple[torch.Tensor, nn.Module, str]]] = {}
        self._calls = 0
        self._handles = [root.register_forward_pre_hook(self._root)]
        self._names = {id(m): n for n, m in canonical_modules(model)}
        watched: dict[int, nn.Module] = {}
        for _, m in canonical_modules(model):
            w = m._parameters.get("weight")
            if w is not None and w.dim() == 1:
                self._handles.append(m.register_forward_hook(self._out_hook))
            elif w is not None and w.dim() == 2:
                watched[id(m)] = m
        for u in units:
            watched[id(input_module(u))] = input_module(u)
        for m in watched.values():
            self._handles.append(m.register_forward_pre_hook(self._in_hook))

    def _root(self, *_):
        self._calls += 1

    def _out_hook(self, module, _args, out):
        ptr = _storage(out)
        if self._calls == 1 and ptr is not None:
            self._alive.setdefault(ptr, []).append((out, module, self._names.get(id(module), type(module).__name__)))

    def _in_hook(self, module, args):
        if self._calls == 1 and id(module) not in self.order and args:
            ptr = _storage(args[0])
            self.order[id(module)] = len(self.order)
            self.read_from[id(module)] = [(m, n) for _, m, n in self._alive.get(ptr, [])]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._alive.clear()


def apply_fold(fold: Fold, s: torch.Tensor, weight_of: Callable[[object], torch.Tensor], save: Callable) -> None:
    """Divide the producer's output channels by `s` and multiply every reader's input columns by it."""
    with torch.no_grad():
        p = fold.producer
        params = [p._parameters.get("weight"), p._parameters.get("bias")]
        for t in params:
            if t is None:
                continue
            save(t)
            t.div_((s if t.dim() == 1 else s.unsqueeze(1)).to(t.dtype))
        for u in fold.consumers:
            w = weight_of(u)
            save(w)
            w.mul_(s.to(w.dtype))
        for m in fold.passive:
            w = m._parameters["weight"]
            save(w)
            w.mul_(s.to(w.dtype))


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _tensors(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


def same_outputs(out, baseline: list[torch.Tensor], tol: float) -> bool:
    """Whether `out` equals `baseline` (bit for bit with ``tol == 0``, else within a relative L2 of `tol`)."""
    got = _tensors(out)
    if not got or len(got) != len(baseline) or any(a.shape != b.shape for a, b in zip(got, baseline)):
        return False
    if tol == 0:
        return all(torch.equal(a, b) for a, b in zip(got, baseline))
    diff = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(got, baseline))
    norm = sum(float(b.double().square().sum()) for b in baseline)
    return math.isfinite(diff) and diff <= tol * tol * max(norm, 1e-30)


def prove_fold(fold: Fold, run: Callable[[], object], baseline: list[torch.Tensor], weight_of, channels: int, seed: int) -> bool:
    """Whether folding into `fold.producer` leaves the model's outputs bit for bit unchanged (proved
    with power-of-two scales from 2^-6 to 2^6, then undone exactly; see the module docstring). The
    wide range catches ops that are linear only over part of it (a clamp, a saturating activation)."""
    g = torch.Generator().manual_seed(seed)
    device = fold.producer._parameters["weight"].device
    exps = torch.randint(1, 7, (channels,), generator=g) * torch.where(torch.rand(channels, generator=g) < 0.5, -1, 1)
    r = (2.0 ** exps.float()).to(device)
    try:
        apply_fold(fold, r, weight_of, lambda t: None)
        ok = same_outputs(run(), baseline, 0.0)
    finally:
        apply_fold(fold, 1.0 / r, weight_of, lambda t: None)
    return ok


def fold_tolerance(fold: Fold, weight_of) -> float:
    """How far a fold with real-valued scales may move the model's outputs (relative L2): each folded
    weight is rounded once more in its dtype, so a few of its ulps (1e-4 at least, for float32)."""
    dtypes = [fold.producer._parameters["weight"].dtype, *(weight_of(u).dtype for u in fold.consumers)]
    return max(1e-4, 4 * max(torch.finfo(d).eps for d in dtypes))


def outputs(out) -> list[torch.Tensor]:
    """The tensors of a model's output (tuples, lists, dicts and Hugging Face's ModelOutput)."""
    return [t.detach().clone() for t in _tensors(out)]
