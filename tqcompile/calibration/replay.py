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

The cached streams live in memory: one group's input per batch (batch x tokens x hidden in the
model's dtype), replaced by its output as the chain advances.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tqcompile.surgery.names import canonical_modules

__all__ = ["Chain", "chains", "capture", "replay", "first_output"]

_CACHE_ARGS = {"past_key_values": None, "past_key_value": None, "use_cache": False, "layer_past": None}


@dataclasses.dataclass
class Chain:
    """Consecutive decoder layers (group indices `first`..`last` of the group list) and, once
    captured, per batch: the stream (the first layer's hidden-state input) and each layer's other
    arguments."""

    first: int
    modules: list[nn.Module]
    streams: list[torch.Tensor] = dataclasses.field(default_factory=list)
    calls: list[list[tuple[tuple, dict, bool]]] = dataclasses.field(default_factory=list)  # per layer, per batch

    @property
    def last(self) -> int:
        return self.first + len(self.modules) - 1

    def release(self) -> None:
        """Free the cached inputs (the chain's last layer is done)."""
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


def capture(chain: Chain, run_pass) -> bool:
    """Run `run_pass()` (one pass of the user's loop) recording the chain's inputs; False (nothing
    kept) where the model does not hand each layer's output to the next one unchanged."""
    n = len(chain.modules)
    calls: list[list] = [[] for _ in range(n)]
    streams: list[torch.Tensor] = []
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
    if not ok[0] or not streams or any(len(c) != len(streams) for c in calls):
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
