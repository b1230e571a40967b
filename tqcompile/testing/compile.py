"""Compile assertions: count what torch.compile did with a function, and read the graphs it traced.

Typical use in a test::

    from tqcompile.testing.compile import CompileCounter, assert_no_graph_breaks

    out = assert_no_graph_breaks(lambda x: tq.quantize(x, q).dequantize(), x)

    counter = CompileCounter()  # a torch.compile backend (aot_eager underneath by default)
    f = torch.compile(fn, backend=counter, fullgraph=True)
    f(x, q)
    f(x, dataclasses.replace(q))  # an equal quantizer
    assert counter.frame_count == 1 and counter.recompiles == 0

Dynamo keeps global caches and counters: call `torch.compiler.reset()` between independent
checks (Dynamo stops compiling a function after `torch._dynamo.config.recompile_limit` recompiles
and silently runs it eagerly, which `CompileCounter` shows as missing graphs).

Private torch APIs are used here and nowhere else in tqcompile, because no public API gives the
same information. Checked on torch 2.13.0:

- `torch._dynamo.utils.counters["graph_break"]`: a Counter of graph-break reasons, bumped once per
  break (`torch._dynamo.explain` would give the same, but it resets every Dynamo cache first);
- `torch._guards.CompileContext.current_compile_id()`: inside a backend, `frame_compile_id > 0`
  says Dynamo is compiling a frame it had compiled before, i.e. a recompile;
- `torch._dynamo.backends.registry.lookup_backend`: a backend name to its callable;
- `torch._dynamo.backends.common.aot_autograd`: builds a backend that hands the AOTAutograd
  forward/backward graphs (aten-level, after functionalization) to our compilers.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tqcompile.tensor import QuantizedTensor

__all__ = ["CompileCounter", "AotGraphRecorder", "assert_no_graph_breaks", "assert_bitwise_equal", "graph_code"]

Backend = str | Callable[..., Any]


def _graph_break_counts() -> collections.Counter[str]:
    from torch._dynamo.utils import counters

    return collections.Counter(counters["graph_break"])


def _is_recompile() -> bool:
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return compile_id is not None and (compile_id.frame_compile_id or 0) > 0


def _lookup_backend(backend: Backend) -> Callable[..., Any]:
    if callable(backend):
        return backend
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(backend)


class CompileCounter:
    """A torch.compile backend that counts and keeps the Dynamo graphs it is given, then hands them on.

    Attributes:
        graphs: the Dynamo FX graphs compiled through this backend, in order.
        frame_count: ``len(graphs)``; with ``fullgraph=True``, the number of (re)compiles.
        recompiles: how many of those graphs were recompiles of a frame Dynamo had compiled before.
        graph_breaks / break_reasons: Dynamo graph breaks since this counter was made (or `clear`ed),
            over every compiled function in the process, not only those using this backend.

    Example:
        >>> counter = CompileCounter("aot_eager")
        >>> f = torch.compile(fn, backend=counter, fullgraph=True)
        >>> f(x); f(x)
        >>> counter.frame_count, counter.recompiles
        (1, 0)
    """

    def __init__(self, backend: Backend = "aot_eager") -> None:
        self.backend = backend
        self._compile = _lookup_backend(backend)
        self.clear()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm)
        self.recompiles += _is_recompile()
        return self._compile(gm, example_inputs)

    def clear(self) -> None:
        """Forget the graphs, recompiles and graph breaks seen so far."""
        self.graphs: list[torch.fx.GraphModule] = []
        self.recompiles = 0
        self._breaks_at_start = _graph_break_counts()

    @property
    def frame_count(self) -> int:
        return len(self.graphs)

    @property
    def break_reasons(self) -> list[str]:
        """One entry per graph break since the counter was made, each Dynamo's message for it."""
        return list((_graph_break_counts() - self._breaks_at_start).elements())

    @property
    def graph_breaks(self) -> int:
        return len(self.break_reasons)

    def __repr__(self) -> str:
        return f"CompileCounter(backend={self.backend!r}, frame_count={self.frame_count}, recompiles={self.recompiles}, graph_breaks={self.graph_breaks})"


def assert_no_graph_breaks(fn: Callable[..., Any], *args: Any, backend: Backend = "aot_eager", **kwargs: Any) -> Any:
    """Compile `fn`, call it with `args`/`kwargs`, and return the compiled result; raise an
    AssertionError listing Dynamo's reasons if it did not trace into exactly one graph.

    `fn` is compiled with ``fullgraph=False`` so that every break is collected and reported,
    rather than only the first, as ``fullgraph=True`` would.

    Example:
        >>> out = assert_no_graph_breaks(lambda x: tq.quantize(x, tq.MXQuantizer()).dequantize(), x)
    """
    counter = CompileCounter(backend)
    result = torch.compile(fn, backend=counter, fullgraph=False)(*args, **kwargs)
    if counter.graph_breaks or counter.frame_count != 1:
        reasons = "\n".join(f"  - {r}" for r in counter.break_reasons) or "  (none recorded)"
        raise AssertionError(
            f"{getattr(fn, '__qualname__', fn)} compiled into {counter.frame_count} graph(s) with {counter.graph_breaks} "
            f"graph break(s); expected 1 graph and 0 breaks. Reasons:\n{reasons}\n"
            "0 graphs can mean Dynamo hit its recompile limit for this function: call torch.compiler.reset() first. "
            "Run with TORCH_LOGS=graph_breaks for the user-code stack of each break."
        )
    return result


class AotGraphRecorder:
    """A torch.compile backend like ``aot_eager`` that also keeps the AOTAutograd graphs.

    `forward_graphs` / `backward_graphs` hold the aten-level graphs after functionalization: what a
    code generator such as inductor would see. Use `graph_code` to print one stably for a golden.

    Example:
        >>> rec = AotGraphRecorder()
        >>> torch.compile(fn, backend=rec, fullgraph=True)(x)
        >>> print(graph_code(rec.forward_graphs[0]))
    """

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward_graphs: list[torch.fx.GraphModule] = []
        self.backward_graphs: list[torch.fx.GraphModule] = []

        def recorder(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
            def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
                graphs.append(gm)
                return make_boxed_func(gm.forward)

            return compile_graph

        self._backend = aot_autograd(fw_compiler=recorder(self.forward_graphs), bw_compiler=recorder(self.backward_graphs))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return self._backend(gm, example_inputs)


_SOURCE_COMMENT = re.compile(r"^\s*#")


def graph_code(gm: torch.fx.GraphModule) -> str:
    """The graph's readable code with node shapes and dtypes, stripped of what varies between runs
    and checkouts (source-location comments, blank lines, the module's class name)."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not _SOURCE_COMMENT.match(ln)]
    if lines and lines[0].startswith("class "):
        lines[0] = "class GraphModule(torch.nn.Module):"
    return "\n".join(lines) + "\n"


# Element-wise bit patterns: a same-size integer view keeps NaN payloads and -0.0 distinct.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise_equal(actual: Any, expected: Any, path: str = "result") -> None:
    """Assert that `actual` (e.g. a compiled run's output) equals `expected` (the eager run's) bit for bit.

    Tensors must agree in type, dtype, shape and every element's bits (so NaN == NaN and
    0.0 != -0.0). QuantizedTensors must agree in shape, quantizer, original dtype, amax group
    name, and in each inner payload/scale/amax tensor. Tuples, lists and dicts are compared item
    by item; anything else with ``==``. The AssertionError names the first differing item by path.
    """
    if isinstance(expected, QuantizedTensor):
        if not isinstance(actual, QuantizedTensor):
            raise AssertionError(f"{path}: expected a QuantizedTensor, got {type(actual).__name__}")
        for name in ("shape", "quantizer", "orig_dtype", "amax_group_name"):
            if getattr(actual, name) != getattr(expected, name):
                raise AssertionError(f"{path}.{name}: {getattr(actual, name)!r} != {getattr(expected, name)!r}")
        actual_inner, expected_inner = actual.__tensor_flatten__()[0], expected.__tensor_flatten__()[0]
        if actual_inner != expected_inner:
            raise AssertionError(f"{path}: inner tensors {actual_inner} != {expected_inner}")
        for name in expected_inner:
            assert_bitwise_equal(getattr(actual, name), getattr(expected, name), f"{path}.{name}")
    elif isinstance(expected, torch.Tensor):
        if type(actual) is not type(expected):
            raise AssertionError(f"{path}: expected a {type(expected).__name__}, got {type(actual).__name__}")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise AssertionError(f"{path}: {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}")
        bits_a, bits_e = (_bits(t) for t in (actual, expected))
        differ = bits_a != bits_e
        if differ.any():
            first = tuple(int(i) for i in differ.nonzero()[0])
            raise AssertionError(
                f"{path}: {int(differ.sum())} of {differ.numel()} elements differ in their bits; "
                f"first at {first}: {actual[first]!r} != {expected[first]!r}"
            )
    elif isinstance(expected, (tuple, list)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{path}: {type(actual).__name__} of {len(actual)} != {type(expected).__name__} of {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise AssertionError(f"{path}: keys {sorted(actual)} != {sorted(expected)}")
        for k in expected:
            assert_bitwise_equal(actual[k], expected[k], f"{path}[{k!r}]")
    elif actual != expected:
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t
    if t.element_size() not in _BITS_DTYPE or t.is_complex():
        raise TypeError(f"assert_bitwise_equal does not handle {t.dtype} tensors")
    return t.view(_BITS_DTYPE[t.element_size()])
