"""Replaying decoder layers on cached inputs, so a sequential weight transform runs each layer a
constant number of times per batch instead of the whole model once per layer.

`tq.calibrate`'s weight transforms (GPTQ, AWQ, SmoothQuant) calibrate group by group, each group on
the outputs of the earlier groups as transformed and rounded (`tqcompile.calibration.transforms`).
Running ``forward_loop`` once per group costs L whole-model passes for L decoder layers: quadratic
in depth. A *chain* is a run of groups that are consecutive elements of one ``ModuleList`` (the
decoder layers) where the model hands each layer's output straight to the next one. For a chain,
one pass of ``forward_loop`` captures, per batch, the first layer's input (the residual stream) and
every layer's other arguments (masks, position embeddings: references to the tensors the model made,
shared between layers), and gives the first layer its statistics; then each later layer runs on its
cached inputs once to collect the statistics of its transform, and each layer but the last once,
transformed and rounded, to compute the next layer's inputs: 3 runs a layer per batch. The model's
own hand-off is checked while capturing, not assumed: each layer's input must be the very tensor
the previous layer returned (object identity, on every call); where it is not (an op between the
layers, a layer skipped), the chain falls back to whole-model passes, as before. A layer's KV
cache argument is dropped while replaying (``past_key_values=None``, ``use_cache=False``): filling
a cache does not change a full-sequence forward's output.

The cached streams (one group's input per batch: batch x tokens x hidden in the model's dtype,
replaced by its output as the chain advances) live in a `StreamCache`: in memory up to a bound the
user sets (``cache_bytes``), beyond it in files, read back memory-mapped.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import tempfile

import torch
from torch import nn

from tqcompile.surgery.names import canonical_modules

__all__ = ["Chain", "StreamCache", "chains", "capture", "replay", "first_output"]

_CACHE_ARGS = {"past_key_values": None, "past_key_value": None, "use_cache": False, "layer_past": None}


class StreamCache:
    """The cached hidden-state inputs of the current layer, one per calibration batch: the first
    ones in memory while their bytes stay within `max_bytes` (None: no bound, all in memory), the
    rest each in a file of `directory` (a temporary directory, made when first needed), read back
    memory-mapped, so resident memory holds the bound plus the batch being computed. A replaced
    file is written beside the old one and renamed over it: a tensor still mapped from the old one
    stays valid."""

    def __init__(self, max_bytes: int | None = None, directory: str | None = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"tq.calibrate: cache_bytes={max_bytes!r} is not allowed; allowed: None (no bound) or bytes >= 0 (int, or a string such as '2GB')")
        self.max_bytes, self._parent = max_bytes, directory
        self._held: list[torch.Tensor | None] = []  # in memory, or None: on disk
        self._dir: str | None = None
        self._bytes = 0
        self._names = itertools.count()
        self.spilled = 0  # batches written to disk (for reports and tests)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self):
        return (self[b] for b in range(len(self)))

    def _file(self, b: int) -> str:
        return os.path.join(self._dir, f"batch-{b}.pt")

    def _spill(self, b: int, t: torch.Tensor) -> None:
        if self._dir is None:
            if self._parent is not None:
                os.makedirs(self._parent, exist_ok=True)
            self._dir = tempfile.mkdtemp(prefix="tq-layer-inputs-", dir=self._parent)
        tmp = os.path.join(self._dir, f".{next(self._names)}.tmp")
        torch.save(t.detach().cpu().contiguous(), tmp)
        os.replace(tmp, self._file(b))

    def append(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.max_bytes is None or self._bytes + size <= self.max_bytes:
            self._held.append(t)
            self._bytes += size
        else:
            self._held.append(None)
            self._spill(len(self._held) - 1, t)
            self.spilled += 1

    def __getitem__(self, b: int) -> torch.Tensor:
        t = self._held[b]
        return t if t is not None else torch.load(self._file(b), mmap=True, weights_only=True)

    def __setitem__(self, b: int, t: torch.Tensor) -> None:
        if self._held[b] is not None:
            self._bytes += t.numel() * t.element_size() - self._held[b].numel() * self._held[b].element_size()
            self._held[b] = t
        else:
            self._spill(b, t)

    def close(self) -> None:
        """Drop every batch and remove the files."""
        self._held, self._bytes = [], 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@dataclasses.dataclass
class Chain:
    """Consecutive decoder layers (group indices `first`..`last` of the group list) and, once
    captured, per batch: the stream (the first layer's hidden-state input) and each layer's other
    arguments."""

    first: int
    modules: list[nn.Module]
    streams: StreamCache | list[torch.Tensor] = dataclasses.field(default_factory=list)
    calls: list[list[tuple[tuple, dict, bool]]] = dataclasses.field(default_factory=list)  # per layer, per batch

    @property
    def last(self) -> int:
        return self.first + len(self.modules) - 1

    def release(self) -> None:
        """Free the cached inputs (the chain's last layer is done)."""
        if isinstance(self.streams, StreamCache):
            self.streams.close()
        self.streams, self.calls = [], []


def chains(model: nn.Module, group_names: list[str]) -> list[Chain]:
    """The chains among the groups (by name, in order): runs of two or more consecutive elements of
    one ``ModuleList``."""
    modules = dict(canonical_modules(model))
    found: list[Chain] = []
    prev = None  # (parent name, index) of the previous group, if it was a list element
    for i, name in enumerate(group_names):
        parent, _, idx = name.rpartition(".")
        here = (parent, int(idx)) if idx.isdigit() and isinstance(modules.get(parent), nn.ModuleList) else None
        if here is not None and prev is not None and here == (prev[0], prev[1] + 1) and found and found[-1].last == i - 1:
            found[-1].modules.append(modules[name])
        elif here is not None:
            found.append(Chain(i, [modules[name]]))
        prev = here
    return [c for c in found if len(c.modules) > 1]


def _stream(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, bool]:
    """(the hidden-state input, whether it came positionally)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], True
    h = kwargs.get("hidden_states")
    return (h, False) if isinstance(h, torch.Tensor) else (None, False)


def _output_stream(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def capture(chain: Chain, run_pass, streams: StreamCache | None = None) -> bool:
    """Run `run_pass()` (one pass of the user's loop) recording the chain's inputs (the streams into
    `streams`, a new unbounded `StreamCache` by default); False (nothing kept) where the model does
    not hand each layer's output to the next one unchanged."""
    n = len(chain.modules)
    calls: list[list] = [[] for _ in range(n)]
    streams = StreamCache() if streams is None else streams
    last_out: list = [None] * n
    ok = [True]

    def pre(i):
        def hook(_m, args, kwargs):
            x, positional = _stream(args, kwargs)
            if x is None or (i > 0 and x is not last_out[i - 1]):
                ok[0] = False
                return
            rest = args[1:] if positional else args
            # Not the KV cache the model filled: holding every batch's would keep every layer's keys and values.
            kept = {k: (_CACHE_ARGS[k] if k in _CACHE_ARGS else v) for k, v in kwargs.items() if k != "hidden_states"}
            calls[i].append((rest, kept, positional))
            if i == 0:
                streams.append(x.detach().clone())

        return hook

    def post(i):
        def hook(_m, _args, out):
            last_out[i] = _output_stream(out)
            if last_out[i] is None:
                ok[0] = False

        return hook

    handles = [m.register_forward_pre_hook(pre(i), with_kwargs=True) for i, m in enumerate(chain.modules)]
    handles += [m.register_forward_hook(post(i)) for i, m in enumerate(chain.modules)]
    try:
        run_pass()
    finally:
        for h in handles:
            h.remove()
    if not ok[0] or not len(streams) or any(len(c) != len(streams) for c in calls):
        streams.close()
        return False
    chain.streams, chain.calls = streams, calls
    return True


def _call(module: nn.Module, stream: torch.Tensor, call: tuple[tuple, dict, bool]):
    rest, kwargs, positional = call
    return module(stream, *rest, **kwargs) if positional else module(*rest, hidden_states=stream, **kwargs)


def first_output(chain: Chain, index: int):
    """The chain's layer `index` on the first cached batch (what a smoothing fold is proved on)."""
    return _call(chain.modules[index], chain.streams[0], chain.calls[index][0])


def replay(chain: Chain, index: int, advance: bool) -> None:
    """Run the chain's layer `index` on every cached batch; with `advance`, its outputs become the
    cached streams (the next layer's inputs)."""
    module = chain.modules[index]
    with torch.no_grad():
        for b, stream in enumerate(chain.streams):
            out = _output_stream(_call(module, stream, chain.calls[index][b]))
            if advance:
                chain.streams[b] = out.detach()
