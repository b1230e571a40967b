"""Tensor- and sequence-parallel styles for converted models, used with the stock
`torch.distributed.tensor.parallel.parallelize_module`.

`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel` and `PrepareModuleInput` take the same
arguments as torch's styles of the same names (and subclass them). On a layer `tq.convert` made
quantized, the colwise/rowwise styles shard the weight as a DTensor (so `state_dict`, DCP and
`fully_shard` on another mesh dim see the global tensor) and run the layer on local shards with
explicit functional collectives (`tqcompile.distributed.tp_linear`): activations are quantized
*before* the sequence-parallel all-gather, and every amax a shard cannot see whole is reduced
over the TP group, so a TP run quantizes exactly what the single-process run quantizes. On any
other module they are torch's styles, unchanged (e.g. a high-precision lm_head).

Why local shards and not DTensor sharding strategies for the `tqcompile` ops: a DTensor rule per
op could not express the cross-op facts this needs (quantize with an amax reduced over the group,
*then* all-gather the quantized bytes; reduce per-row amaxes along a sharded K); the sharding
propagator would redistribute high-precision inputs before the op. Local shards with functional
collectives trace under `torch.compile(fullgraph=True)` (they are what DTensor lowers to anyway).

`QuantizedSequenceParallelInput` quantizes and all-gathers a sequence-sharded activation once for
several colwise consumers (separate q, k, v projections).
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as _tp
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from tqcompile.distributed import tp_comm
from tqcompile.distributed.agreement import check_ranks_agree, recipe_fact
from tqcompile.distributed.fsdp import QuantizedWeight
from tqcompile.distributed.tp_linear import (
    REPLICATE,
    SEQUENCE,
    SequenceGatheredInput,
    colwise_linear,
    gather_input,
    rowwise_linear,
)
from tqcompile.nn.base import is_converted
from tqcompile.nn.quantized_linear import Linear
from tqcompile.recipes import Recipe

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "QuantizedSequenceParallelInput",
    "SequenceGatheredInput",
]


@dataclasses.dataclass(frozen=True)
class _TPConfig:
    kind: str  # "colwise" or "rowwise"
    mode: str  # REPLICATE or SEQUENCE: the colwise input / the rowwise output
    seq_dim: int
    group: str
    world: int
    input_placement: Placement
    output_placement: Placement
    use_local_output: bool
    what: str


def _group(mesh: DeviceMesh, style: str) -> tuple[str, int]:
    if mesh.ndim != 1:
        raise ValueError(f"{style}: expected the 1-D tensor-parallel mesh (e.g. mesh['tp']), got a {mesh.ndim}-D mesh {mesh}")
    return mesh.get_group().group_name, mesh.size()


def _norm(p: Placement | None, default: Placement, ndim: int = 3) -> Placement:
    p = default if p is None else p
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim % ndim)
    return p


def _describe(module: nn.Module) -> str:
    return f"{type(module).__name__}(in_features={module.in_features}, out_features={module.out_features}, recipe={module.recipe.name})"


def _facts(module: nn.Module) -> dict[str, str]:
    """What ranks must agree on about a module they parallelize: its kind and shape, and the
    recipes of the converted layers in it (a style such as `QuantizedSequenceParallelInput` takes
    its recipe from them)."""
    kind = type(module).__name__
    if hasattr(module, "in_features"):
        kind += f"(in_features={module.in_features}, out_features={module.out_features})"
    recipes = sorted({recipe_fact(m.recipe) for m in module.modules() if is_converted(m)})
    return {"module": kind, "recipe": ", ".join(recipes) or "not converted"}


def _agree(style: _tp.ParallelStyle, module: nn.Module, mesh: DeviceMesh) -> None:
    """Before any collective: every rank applies the same style, with the same arguments, to the
    same kind of module converted the same way (`tqcompile.distributed.agreement`)."""
    if mesh.ndim != 1:
        return  # every style here refuses it, alike on every rank
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(style).items()) if not k.startswith("_"))
    facts = {"style": f"{type(style).__name__}({args})", **_facts(module)}
    what = f"{type(style).__name__} on {facts['module']}"
    check_ranks_agree(mesh.get_group(), "tensor-parallel", what, facts)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    p = getattr(module, name)
    if p is None:
        return
    if isinstance(p, DTensor):
        raise ValueError(f"{type(module).__name__}.{name} is already a DTensor ({p.placements}); parallelize each layer once")
    if isinstance(p, QuantizedWeight):
        # distribute_tensor returns a plain local tensor; keep the FSDP2 weight wrapper on the local
        # piece, so a later fully_shard on the dp mesh gathers it quantized (fsdp_tp).
        dt = distribute_tensor(p._tensor.detach(), mesh, [placement])
        local = QuantizedWeight(dt.to_local(), p.quantizer, p.layer)
        dt = DTensor.from_local(local, mesh, [placement], run_check=False, shape=dt.shape, stride=dt.stride())
    else:
        dt = distribute_tensor(p.detach(), mesh, [placement])
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


class _TPLinear:
    """Forward of a converted linear layer whose weight a TP style sharded (mixed in by class swap)."""

    _tp: _TPConfig
    _tp_mesh: DeviceMesh

    def forward(self, x):
        tp = self._tp
        if isinstance(x, DTensor):
            if tuple(x.placements) != (tp.input_placement,):
                raise ValueError(
                    f"{tp.what}: input is a DTensor placed {x.placements}; this style expects ({tp.input_placement},)"
                )
            x = x.to_local()
        weight = self.weight.to_local()
        bias = None if self.bias is None else self.bias.to_local()
        fn = colwise_linear if tp.kind == "colwise" else rowwise_linear
        # Delayed-scaling histories roll in training mode only (as in tq.nn.Linear); read `training`
        # only where it matters, so Dynamo guards on it only for delayed-scaling recipes.
        update = self.training if self.recipe.amax_history_len else True
        y = fn(x, weight, bias, self.recipe, tp.group, tp.world, tp.mode, tp.seq_dim, tp.what, self._histories(), update)
        if not tp.use_local_output:
            y = DTensor.from_local(y, self._tp_mesh, [tp.output_placement], run_check=False)
        return y


@functools.cache
def _tp_class(cls: type) -> type:
    return type(f"TensorParallel{cls.__name__}", (_TPLinear, cls), {"__module__": cls.__module__})


def _swap(module: nn.Module, config: _TPConfig, mesh: DeviceMesh) -> None:
    module.__class__ = _tp_class(type(module))
    module._tp = config
    module._tp_mesh = mesh


def _check(q, local_len, world, split_dim, usage, what):
    if q is not None:
        tp_comm.check_shard(q, local_len, world, split_dim, usage, what)


class ColwiseParallel(_tp.ColwiseParallel):
    """Shard a linear layer's weight (and bias) on the output features.

    Same arguments as torch's `ColwiseParallel`: `input_layouts` `Replicate()` (default: every rank
    holds the whole input) or `Shard(1)` (sequence parallel: the input is split along the sequence
    and all-gathered here, *quantized*); the output stays sharded on its last dim (`Shard(-1)`).
    On a module that is not a converted `tq.nn.Linear`, this is torch's style unchanged.

    `fused_chunks` (tqcompile only): the weight stacks that many projections on its output dim
    (a fused q/k/v weight: 3), and each rank takes its share of every one of them, so that a fused
    attention projection splits by heads. The DTensor is placed `_StridedShard(0, split_factor=...)`,
    so its global view is still the unsharded weight.

    Example (a runnable two-process script is in docs/tensor_parallel.md):
        >>> parallelize_module(model, tp_mesh, {"mlp.fc": tq.distributed.ColwiseParallel(input_layouts=Shard(1))})
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fused_chunks: int = 1,
    ):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if not isinstance(fused_chunks, int) or isinstance(fused_chunks, bool) or fused_chunks < 1:
            raise ValueError(f"ColwiseParallel: fused_chunks={fused_chunks!r}; allowed: an int >= 1")
        self.fused_chunks = fused_chunks
        self._input_layout, self._output_layout = input_layouts, output_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _agree(self, module, device_mesh)
        if not isinstance(module, Linear):
            if is_converted(module):
                raise TypeError(
                    f"ColwiseParallel: {type(module).__name__} is not supported (only tq.nn.Linear layers, and unconverted modules)"
                )
            if self.fused_chunks != 1:
                raise ValueError(
                    f"ColwiseParallel: fused_chunks={self.fused_chunks} is supported on converted tq.nn.Linear layers only, not {type(module).__name__}"
                )
            return super()._apply(module, device_mesh)
        group, world = _group(device_mesh, "ColwiseParallel")
        what = _describe(module)
        inp = _norm(self._input_layout, Replicate())
        out = _norm(self._output_layout, Shard(2))
        if out != Shard(2):
            raise ValueError(
                f"ColwiseParallel on {what}: output_layouts={self._output_layout!r}; allowed: Shard(-1) (the default)"
            )
        if isinstance(inp, Replicate):
            mode, seq_dim = REPLICATE, 1
        elif isinstance(inp, Shard) and inp.dim == 1:
            mode, seq_dim = SEQUENCE, 1
        else:
            raise ValueError(
                f"ColwiseParallel on {what}: input_layouts={self._input_layout!r}; allowed: Replicate() or Shard(1) (sequence parallel)"
            )
        chunks = self.fused_chunks
        if module.out_features % (chunks * world):
            raise ValueError(
                f"ColwiseParallel on {what}: out_features {module.out_features} is not divisible into {chunks} fused chunk(s) x {world} ranks"
            )
        n_local = module.out_features // (chunks * world)
        r = module.recipe
        _check(r.fprop_weight, n_local, world, 0, "rowwise", f"ColwiseParallel on {what}: weight")
        _check(r.dgrad_weight, n_local, world, 0, "columnwise", f"ColwiseParallel on {what}: weight")
        _check(r.dgrad_grad, n_local, world, 1, "rowwise", f"ColwiseParallel on {what}: output gradient")
        _check(r.wgrad_grad, n_local, world, 1, "columnwise", f"ColwiseParallel on {what}: output gradient")
        placement = Shard(0) if chunks == 1 else _StridedShard(0, split_factor=chunks)
        _distribute(module, "weight", device_mesh, placement)
        _distribute(module, "bias", device_mesh, placement)
        _swap(module, _TPConfig("colwise", mode, seq_dim, group, world, inp, Shard(2), self.use_local_output, what), device_mesh)
        return module


class RowwiseParallel(_tp.RowwiseParallel):
    """Shard a linear layer's weight on the input features; the bias is replicated.

    Same arguments as torch's `RowwiseParallel`: the input is split on its last dim (`Shard(-1)`,
    what a `ColwiseParallel` layer outputs); the partial output sums are all-reduced
    (`output_layouts=Replicate()`, the default) or reduce-scattered along the sequence
    (`Shard(1)`, sequence parallel), in high precision. Weight and input amaxes, and per-row
    scales along the sharded K, are reduced over the TP group. On a module that is not a converted
    `tq.nn.Linear`, this is torch's style unchanged.
    """

    def __init__(
        self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None, use_local_output: bool = True
    ):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._input_layout, self._output_layout = input_layouts, output_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _agree(self, module, device_mesh)
        if not isinstance(module, Linear):
            if is_converted(module):
                raise TypeError(
                    f"RowwiseParallel: {type(module).__name__} is not supported (only tq.nn.Linear layers, and unconverted modules)"
                )
            return super()._apply(module, device_mesh)
        group, world = _group(device_mesh, "RowwiseParallel")
        what = _describe(module)
        inp = _norm(self._input_layout, Shard(2))
        out = _norm(self._output_layout, Replicate())
        if inp != Shard(2):
            raise ValueError(f"RowwiseParallel on {what}: input_layouts={self._input_layout!r}; allowed: Shard(-1) (the default)")
        if isinstance(out, Replicate):
            mode = REPLICATE
        elif isinstance(out, Shard) and out.dim == 1:
            mode = SEQUENCE
        else:
            raise ValueError(
                f"RowwiseParallel on {what}: output_layouts={self._output_layout!r}; allowed: Replicate() or Shard(1) (sequence parallel)"
            )
        if module.in_features % world:
            raise ValueError(
                f"RowwiseParallel on {what}: in_features {module.in_features} is not divisible by the TP degree {world}"
            )
        k_local = module.in_features // world
        r = module.recipe
        _check(r.fprop_input, k_local, world, 1, "rowwise", f"RowwiseParallel on {what}: input")
        _check(r.wgrad_input, k_local, world, 1, "columnwise", f"RowwiseParallel on {what}: input")
        _check(r.fprop_weight, k_local, world, 1, "rowwise", f"RowwiseParallel on {what}: weight")
        _check(r.dgrad_weight, k_local, world, 1, "columnwise", f"RowwiseParallel on {what}: weight")
        _distribute(module, "weight", device_mesh, Shard(1))
        _distribute(module, "bias", device_mesh, Replicate())
        _swap(module, _TPConfig("rowwise", mode, 1, group, world, Shard(2), out, self.use_local_output, what), device_mesh)
        return module


class SequenceParallel(_tp.SequenceParallel):
    """torch's `SequenceParallel` (same arguments, same behaviour) for the high-precision modules
    between quantized layers (RMSNorm, LayerNorm, dropout): their parameters are replicated, their
    activations split along the sequence. A converted linear layer is refused: shard it with
    `ColwiseParallel` / `RowwiseParallel`, which handle sequence-split inputs and outputs.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _agree(self, module, device_mesh)
        if is_converted(module):
            raise TypeError(
                f"SequenceParallel: {type(module).__name__} is a quantized layer; use ColwiseParallel(input_layouts=Shard(1)) "
                "or RowwiseParallel(output_layouts=Shard(1)) for it"
            )
        return super()._apply(module, device_mesh)


class PrepareModuleInput(_tp.PrepareModuleInput):
    """torch's `PrepareModuleInput` (same arguments, same behaviour): it redistributes a module's
    high-precision inputs, e.g. `Replicate()` -> `Shard(1)` in front of the first sequence-parallel
    block. To quantize a sequence-split input once and all-gather it quantized for several
    consumers, use `QuantizedSequenceParallelInput`.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _agree(self, module, device_mesh)
        return super()._apply(module, device_mesh)


def _common_recipe(module: nn.Module) -> Recipe:
    recipes = {m.recipe for m in module.modules() if isinstance(m, Linear)}
    if len(recipes) != 1:
        names = sorted(r.name for r in recipes)
        raise ValueError(
            f"QuantizedSequenceParallelInput: {type(module).__name__} holds converted linear layers with recipes {names}; "
            "it needs exactly one (pass recipe= to say which its consumers use)"
        )
    return recipes.pop()


class QuantizedSequenceParallelInput(_tp.ParallelStyle):
    """Quantize a module's sequence-split input once and all-gather it quantized for all its consumers.

    Apply it to a module (e.g. attention) whose input arrives split along the sequence (dim
    `sequence_dim`) and whose converted linear layers that read it (q, k, v) are parallelized
    with `ColwiseParallel()` (replicated input, the default). The module then receives a
    `SequenceGatheredInput` instead of its input tensor: its `shape`/`dtype`/`device` are the
    gathered activation's, and the colwise layers take their operands from it, so the activation
    crosses the wire once, quantized (payload and scales as uint8), and its gradient is
    reduce-scattered once. The recipe is the one of the converted layers inside the module
    (or `recipe`). Recipes with delayed scaling (one amax history per layer) or a high-precision
    wgrad (which needs the high-precision input gathered) are refused: shard their consumers with
    `ColwiseParallel(input_layouts=Shard(1))` instead.

    The input is the module's first positional argument or, when it is called with keywords only
    (Hugging Face calls ``self_attn(hidden_states=..., ...)``), the keyword argument `input_kwarg`.
    """

    def __init__(self, *, sequence_dim: int = 1, recipe: Recipe | None = None, input_kwarg: str = "hidden_states"):
        super().__init__()
        if sequence_dim != 1:
            raise ValueError(f"QuantizedSequenceParallelInput: sequence_dim={sequence_dim}; allowed: 1 (batch, seq, features)")
        if not isinstance(input_kwarg, str) or not input_kwarg.isidentifier():
            raise ValueError(f"QuantizedSequenceParallelInput: input_kwarg={input_kwarg!r}; allowed: a keyword argument name")
        self.sequence_dim, self.recipe, self.input_kwarg = sequence_dim, recipe, input_kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _agree(self, module, device_mesh)
        group, world = _group(device_mesh, "QuantizedSequenceParallelInput")
        recipe = self.recipe or _common_recipe(module)
        if recipe.amax_history_len or recipe.wgrad_input is None:
            why = "delayed scaling (one amax history per layer)" if recipe.amax_history_len else "a high-precision wgrad"
            raise ValueError(
                f"QuantizedSequenceParallelInput: recipe {recipe.name!r} uses {why}; a shared quantized gather cannot serve it. "
                "Use ColwiseParallel(input_layouts=Shard(1)) on each consumer instead"
            )
        seq_dim, what = self.sequence_dim, f"QuantizedSequenceParallelInput on {type(module).__name__}"

        key = self.input_kwarg

        def gathered(x):
            if isinstance(x, DTensor):
                if tuple(x.placements) != (Shard(seq_dim),):
                    raise ValueError(f"{what}: input is a DTensor placed {x.placements}; expected (Shard({seq_dim}),)")
                x = x.to_local()
            return gather_input(x, recipe, group, world, seq_dim, what)

        def gather(mod, args, kwargs):
            if args:
                return (gathered(args[0]), *args[1:]), kwargs
            if key in kwargs:
                return args, {**kwargs, key: gathered(kwargs[key])}
            raise ValueError(
                f"{what}: the module got no positional argument and no keyword argument {key!r} (it got "
                f"{sorted(kwargs)}); pass the input first, or name its keyword with input_kwarg="
            )

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module
