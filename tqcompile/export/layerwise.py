"""Calibration with data of a model whose weights stay on disk, one decoder layer in memory at a
time (`tq.quantize_checkpoint(..., data=...)`).

The model is built with its parameters on the meta device (its buffers, such as rotary tables,
computed) and converted as `tq.calibrate` converts it. Then:

1. capture: the parameters outside the decoder layers (embeddings, final norm, head) are read, and
   each calibration batch runs the model with its decoder layers stood in for by recorders that
   hold no weights: they keep the first layer's hidden-state input and every layer's other
   arguments (masks, position embeddings, as `tqcompile.calibration.replay` keeps them) and stop the
   model at its last layer (nothing after it runs). The parameters outside the layers are then
   dropped again unless a pass at the end needs them;
2. layer by layer: the layer's weights are read from the checkpoint; its weight transforms (GPTQ,
   AWQ, SmoothQuant) run on its cached inputs as `tq.calibrate`'s replay runs them
   (`tqcompile.calibration.transforms.run_group`); its activation amaxes are recorded while it
   computes the next layer's inputs (one more run first for "percentile" / "mse": the histogram
   needs the max); its amaxes are finalised; the weights a transform changed are written to a
   scratch checkpoint; and its parameters go back to the meta device;
3. outside the layers: weight amaxes from the weights; where a quantizer there has a static
   activation amax, one more pass of the data with the layers stood in for by their cached final
   outputs.

Every stage computes on the tensors `tq.calibrate` computes on, so the result equals
`tq.calibrate` of the loaded model with the same data and algorithm, and the export equals its
export byte for byte (tests/test_quantize_checkpoint_data.py). Memory: one layer's weights and
statistics, the parameters outside the layers during the capture, and the cached layer inputs
(bounded by `cache_bytes`, the rest in files).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tqcompile.calibration import replay
from tqcompile.calibration.algorithms import Algorithm
from tqcompile.calibration.layer_stats import Context, tied_parameters, unit_records
from tqcompile.calibration.modules import convert_module
from tqcompile.calibration.observers import attach_amax_observers, detach_observers
from tqcompile.calibration.passes import reduce_stats
from tqcompile.calibration.pipeline import (
    describe,
    finalize,
    plan,
    quantizers_of,
    scale_search_of,
    start_activation_stats,
    start_histograms,
    static_activations,
    to_convert,
    uses_histogram,
)
from tqcompile.calibration.record import CalibrationRecord, set_record
from tqcompile.calibration.transforms import run_group, transform_units
from tqcompile.export.files import CheckpointFiles
from tqcompile.export.meta import parameters_on_meta  # noqa: F401  (re-exported: its home before meta.py)
from tqcompile.export.readers import trim_heap
from tqcompile.export.safetensors_io import ShardedWriter
from tqcompile.surgery.names import canonical_modules
from tqcompile.surgery.plan import apply

__all__ = ["parameters_on_meta", "calibrate_layerwise", "Overlay"]


class _Stop(Exception):
    """The capture has what it needs from this batch (raised by the last decoder layer's stand-in)."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, list) of the model's decoder layers: the ``ModuleList`` holding the most parameters."""
    best = None
    for name, m in canonical_modules(model):
        if isinstance(m, nn.ModuleList) and len(m):
            n = sum(p.numel() for p in m.parameters())
            if best is None or n > best[2]:
                best = (name, m, n)
    if best is None:
        raise ValueError(
            f"tq.quantize_checkpoint: {type(model).__name__} has no nn.ModuleList of decoder layers to calibrate one at a time; "
            "load the model and use tq.calibrate"
        )
    return best[0], best[1]


class _Weights:
    """Reads modules' parameters from the checkpoint (`read(name, meta placeholder)`) into the model
    and puts the meta placeholders back. A parameter two modules hold (a tied head) is loaded once
    for both."""

    def __init__(self, model: nn.Module, read: Callable[[str, torch.Tensor], torch.Tensor]):
        self.read = read
        self._meta: dict[int, tuple[torch.Tensor, str, list[tuple[nn.Module, str]]]] = {}
        for name, mod in canonical_modules(model):
            for key, p in mod._parameters.items():
                if p is not None:
                    self._meta.setdefault(id(p), (p, f"{name}.{key}" if name else key, []))[2].append((mod, key))
        self._loaded: dict[int, int] = {}  # id(loaded parameter) -> id(its meta placeholder)

    def load(self, modules: Sequence[nn.Module]) -> None:
        """Read the parameters `modules` hold themselves (not their children's)."""
        for mod in modules:
            for p in list(mod._parameters.values()):
                if p is not None and p.is_meta and id(p) in self._meta:
                    meta, name, holders = self._meta[id(p)]
                    value = nn.Parameter(self.read(name, meta), requires_grad=False)
                    for m, k in holders:
                        m._parameters[k] = value
                    self._loaded[id(value)] = id(meta)

    def release(self, modules: Sequence[nn.Module]) -> None:
        for mod in modules:
            for p in list(mod._parameters.values()):
                if p is not None and id(p) in self._loaded:
                    meta, _, holders = self._meta[self._loaded.pop(id(p))]
                    for m, k in holders:
                        m._parameters[k] = meta
        trim_heap()

    def name_of(self, p: torch.Tensor) -> str:
        return self._meta[self._loaded[id(p)]][1]


class Overlay:
    """The weights a transform changed, written to a scratch directory (one safetensors file a
    layer) and read back by name; `read` gives them, and everything else from `base`."""

    def __init__(self, directory: str, base: Callable[[str, torch.Tensor], torch.Tensor]):
        self.directory, self.base = directory, base
        self._files: dict[str, CheckpointFiles] = {}

    def write(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        where = os.path.join(self.directory, part)
        os.makedirs(where)
        writer = ShardedWriter(where, 1 << 62)
        for name, t in tensors.items():
            writer.add(name, t)
        writer.finish()
        files = CheckpointFiles(where)
        self._files.update({name: files for name in tensors})

    def read(self, name: str, value: torch.Tensor) -> torch.Tensor:
        files = self._files.get(name)
        return files.get(name) if files is not None else self.base(name, value)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _Changed:
    """What a transform changed (the undo log's interface: the checkpoint on disk is the original,
    so nothing is copied, only noted)."""

    def __init__(self):
        self.ids: set[int] = set()

    def save(self, t: torch.Tensor) -> None:
        self.ids.add(id(t._base if t._base is not None else t))


def _run_model(model: nn.Module, batch) -> None:
    if isinstance(batch, torch.Tensor):
        model(batch)
    else:
        model(**batch)


def check_batches(data) -> list:
    """The calibration batches as a list (they are run more than once)."""
    if isinstance(data, torch.Tensor) or not isinstance(data, Sequence) or not len(data):
        raise TypeError(
            f"tq.quantize_checkpoint: data must be a non-empty list of batches (each a tensor of token ids, or a dict of "
            f"the model's keyword arguments), got {type(data).__name__}"
        )
    for i, b in enumerate(data):
        if not isinstance(b, torch.Tensor | dict):
            raise TypeError(f"tq.quantize_checkpoint: data[{i}] is a {type(b).__name__}; allowed: a tensor of token ids or a dict of keyword arguments")
    return list(data)


@contextlib.contextmanager
def _stand_ins(layers: nn.ModuleList, forward: Callable[[int, tuple, dict], torch.Tensor]):
    """Every decoder layer computes ``forward(index, args, kwargs)`` instead of itself (its hooks
    still run)."""
    for i, layer in enumerate(layers):
        layer.forward = lambda *a, _i=i, **kw: forward(_i, a, kw)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _capture(model: nn.Module, layers: nn.ModuleList, batches: list, cache: replay.StreamCache) -> replay.Chain:
    chain = replay.Chain(0, list(layers))
    last = len(layers) - 1

    def record(i, args, kwargs):
        if i == last:
            raise _Stop
        return _hidden(args, kwargs)

    def run_pass():
        for b in batches:
            try:
                _run_model(model, b)
            except _Stop:
                continue
            raise RuntimeError("tq.quantize_checkpoint: the model returned without calling its last decoder layer")

    with torch.no_grad(), _stand_ins(layers, record):
        ok = replay.capture(chain, run_pass, cache)
    if not ok:
        raise ValueError(
            "tq.quantize_checkpoint: the model does not hand each decoder layer's output straight to the next one (an op "
            "between layers, or layers returning tuples), so its layers cannot be calibrated one at a time from their cached "
            "inputs; load the model and use tq.calibrate"
        )
    return chain


def _outer_pass(model: nn.Module, layers: nn.ModuleList, batches: list, chain: replay.Chain) -> None:
    """One pass of the data through what lies outside the decoder layers: the first layer returns
    the batch's cached output of the last one, the others hand their input on."""
    seen = [0]

    def stand_in(i, args, kwargs):
        if i:
            return _hidden(args, kwargs)
        seen[0] += 1
        return chain.streams[seen[0] - 1]

    with torch.no_grad(), _stand_ins(layers, stand_in):
        for b in batches:
            _run_model(model, b)


def _record_activations(planned: list, observers: dict, groups, searches: dict, run_once: Callable[[bool], None]) -> None:
    """Record the static activation amaxes of the `planned` units (their `observers`) on the data
    `run_once` runs (its argument: whether this is the last run); a second run fills the
    histograms of the quantizers whose search (`searches`) is "percentile" / "mse"."""
    hist = any(uses_histogram(t) and searches[t] != "max" for t in quantizers_of(planned))
    run_once(not hist)
    mine = [observers[t] for t in quantizers_of(planned)]
    reduce_stats([o.stat_max for o in mine if o.stat_max is not None], groups)
    if hist:
        hist_observers = start_histograms(planned, observers, searches)
        run_once(True)
        reduce_stats([o.hist for o in hist_observers], groups, op=torch.distributed.ReduceOp.SUM)


def calibrate_layerwise(
    model: nn.Module,
    read: Callable[[str, torch.Tensor], torch.Tensor],
    config,
    batches: list,
    algo: Algorithm,
    percentile: float,
    *,
    scratch: str,
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    amax_groups: Sequence = (),
    progress: bool = True,
    kv_scale_search: str | None = None,
) -> Overlay:
    """Convert and calibrate `model` (parameters on the meta device, read by `read`) one decoder
    layer at a time on `batches`; returns the `Overlay` whose `read` gives the transformed weights
    and the checkpoint's others (see the module docstring)."""
    from tqdm.auto import tqdm

    groups = tuple(amax_groups)
    planned = to_convert(plan(model, config))
    apply(planned, lambda d: convert_module(d.module, d.name, d.using, config.ste))
    observers = attach_amax_observers([p.module for p in planned])
    searches = {t: scale_search_of(t, algo.scale_search, kv_scale_search) for t in quantizers_of(planned)}
    lname, layers = decoder_layers(model)
    prefix = f"{lname}."
    inside: list[list] = [[] for _ in layers]
    outer = []
    for p in planned:
        rest = p.name[len(prefix) :] if p.name.startswith(prefix) else None
        if rest is not None and rest.split(".", 1)[0].isdigit():
            inside[int(rest.split(".", 1)[0])].append(p)
        else:
            outer.append(p)
    if algo.transforms and transform_units(outer):
        name = transform_units(outer)[0][0]
        raise ValueError(
            f"tq.quantize_checkpoint: {algo.describe()} would transform {name!r}, which lies outside the decoder layers "
            f"({lname}) that are calibrated one at a time; exclude it (QuantRule(name={name!r}, weight=False)), or load the "
            "model and use tq.calibrate"
        )
    weights = _Weights(model, read)
    os.makedirs(scratch, exist_ok=True)
    overlay = Overlay(tempfile.mkdtemp(prefix="tq-scratch-", dir=scratch), read)
    in_layers = {id(m) for m in layers.modules()}
    outer_modules = [m for m in model.modules() if id(m) not in in_layers]
    changed = _Changed()
    records = unit_records([(p.name, p.module) for p in planned])
    ctx = Context(model, model, None, algo, groups, progress, changed, records, tied_parameters(model), torch.device("cpu"))
    chain = None
    try:
        weights.load(outer_modules)
        chain = _capture(model, layers, batches, replay.StreamCache(cache_bytes, cache_dir))
        outer_data = static_activations(outer)
        if not outer_data:
            weights.release(outer_modules)
        bar = tqdm(total=len(layers), desc=f"calibrating {lname} ({algo.describe()})", unit=" layer", disable=not progress)
        for i, layer in enumerate(layers):
            weights.load(list(layer.modules()))
            units = [u for _, u in transform_units(inside[i])]
            if algo.transforms and units:
                ctx.fold_runner = lambda i=i: replay.first_output(chain, i)
                try:
                    run_group(ctx, units, f"{algo.describe()}: layer {i}", lambda i=i: replay.replay(chain, i, advance=False), layer)
                finally:
                    ctx.fold_runner = None
                ctx.finish(units)
            start_activation_stats(inside[i], observers)
            _record_activations(inside[i], observers, groups, searches, lambda last, i=i: replay.replay(chain, i, advance=last))
            finalize(inside[i], observers, algo.scale_search, percentile, groups, records, kv_scale_search)
            overlay.write(f"{i}", {weights.name_of(p): p.detach() for p in layer.parameters() if id(p) in changed.ids})
            weights.release(list(layer.modules()))
            bar.update(1)
        bar.close()
        if outer:
            weights.load(outer_modules)
            start_activation_stats(outer, observers)
            if outer_data:
                _record_activations(outer, observers, groups, searches, lambda last: _outer_pass(model, layers, batches, chain))
            finalize(outer, observers, algo.scale_search, percentile, groups, None, kv_scale_search)
        weights.release(outer_modules)
    except BaseException:
        detach_observers(observers)
        overlay.close()
        raise
    finally:
        if chain is not None:
            chain.release()
    set_record(model, [p.module for p in planned], CalibrationRecord(config, describe(algo, searches), float(percentile)))
    return overlay
