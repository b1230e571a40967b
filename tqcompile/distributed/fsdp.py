"""FSDP2 all-gathers the weights of converted layers *quantized*.

Data flow, per converted weight and per all-gather (each rank holds rows [r*n, (r+1)*n) of the
(N, K) weight, n = ceil(N / world), the last shard zero-padded)::

    hp shard (optimizer's fp32 param)
      -> cast to the MixedPrecisionPolicy's param_dtype (what a bf16 all-gather would send)
      -> amaxes a shard cannot see whole, MAX-reduced over the FSDP shard group (one collective;
         none at all after `precompute_scales`): the tensor amax (FP8 tensorwise, NVFP4) or
         the per-column amax of a per-row-scaled weight's columnwise usage (FP8 rowwise)
      -> quantize the shard with them; scales local to a row or block stay local
      -> ONE flat uint8 buffer per rank: payload bytes + per-rank scale bytes (gloo cannot move
         float8 dtypes; FSDP concatenates it with the other params' bytes)
      == all-gather ==
      -> unpack every rank's slice, concatenate, drop the padding rows
      -> QuantizedTensor (recording the shard group's name), the unsharded parameter that the
         compiled block receives as a graph input; `tq.nn.Linear` uses it as its fprop and
         dgrad operand and returns the high-precision weight gradient.

What travels, per weight quantizer (fprop and dgrad must share it; see `quantized_all_gather_reason`):

- transposable scales (`Quantizer.columnwise_is_transpose`: tensorwise FP8, 128x128 FP8 blocks,
  NVFP4 16x16 tiles): the rowwise usage only; dgrad's columnwise usage is its exact transpose, made locally after the gather;
- scales along K only (FP8 rowwise, MX and 1x128 blocks): the forward gathers the rowwise usage,
  the backward re-gather the columnwise one, in equal-size buffers (FSDP fixes the buffer size at
  the first gather). A layer FSDP does not reshard after forward (`reshard_after_forward=False`,
  and the root module) is gathered once for both passes, so it moves both usages. A layer whose
  forward activation checkpointing recomputes in backward (`tqcompile.distributed.recompute`) gets
  both usages from the backward re-gather, as the recompute reads the rowwise one; a gather that
  leaves the rowwise usage unfilled marks the weight so that reading it raises (`_mark_rowwise`).

Which shard shapes keep blocks whole: FSDP shards dim 0 (N). Blocks along K (MX 32, 1x128,
NVFP4 1x16, FP8 rows) are always whole in the rowwise usage. A 2-D block (128x128, 16x16) or a
columnwise block along N (MX 32 and 1x128 in dgrad) needs the padded shard rows n to be a
multiple of its extent; otherwise the gather raises before any collective, naming the layer.

Who does what: `QuantizedWeight` passes every op through to the high-precision tensor it holds
and implements FSDP2's two all-gather hooks; `_gather_plan` (here) decides what a gather moves
from FSDP2's state, read only through `fsdp_state`; `fsdp_layout` holds that plan, the buffer
layout and the pure pack / unpack functions; `fsdp_amax` caches the reduced amaxes per weight
version (and rolls delayed scaling's history); `fsdp_tp` reduces them over a TP group too;
`recompute` says whether activation checkpointing re-runs a layer's forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from tqcompile.distributed.agreement import check_ranks_agree, recipe_fact
from tqcompile.distributed.fsdp_amax import WeightAmaxCache
from tqcompile.distributed.fsdp_experts import ExpertsPlan, derives_dgrad
from tqcompile.distributed.fsdp_experts import nbytes as experts_nbytes
from tqcompile.distributed.fsdp_experts import pack as experts_pack
from tqcompile.distributed.fsdp_experts import unpack as experts_unpack
from tqcompile.distributed.fsdp_layout import (
    USAGE_PARTS,
    _cut_blocks,
    _nbytes,
    _Plan,
    add_unfilled_usages,
    pack,
    padded_shard,
    poison,
    unpack,
)
from tqcompile.distributed.fsdp_state import ManagedParam, find_managed, local_tensor
from tqcompile.distributed.fsdp_tp import tp_split
from tqcompile.distributed.recompute import fix_recompute
from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import experts_layout
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer
from tqcompile.recipes import Recipe
from tqcompile.surgery.names import canonical_modules
from tqcompile.tensor import GroupedQuantizedTensor, QuantizedTensor

__all__ = [
    "QuantizedWeight",
    "QuantizedAllGatherWarning",
    "quantized_all_gather_reason",
    "enable_quantized_all_gather",
]

aten = torch.ops.aten
_U8 = torch.uint8
# Ops whose tensor results stay QuantizedWeight: what FSDP2 does to a parameter while sharding it
# (new_zeros, narrow/slice, chunk/split, view, copy_), what DTensor and `nn.Module.to` do, and what a
# state dict load does. Anything else (the math of an optimizer step, a quantize) returns plain tensors.
_PRESERVE = {
    aten.detach.default,
    aten.alias.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.clone.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


@functools.singledispatch
def gathers_quantized(q: Quantizer) -> bool:
    """Whether FSDP2 may all-gather weights of `q`'s family quantized (each shard's payload and
    scales, `fsdp_layout`): registered per family (FP8, MX, NVFP4); False for the others (INT)."""
    return False


@gathers_quantized.register(Float8Quantizer)
@gathers_quantized.register(MXQuantizer)
@gathers_quantized.register(NVFP4Quantizer)
def _(q: Quantizer) -> bool:
    return True


def quantized_all_gather_reason(recipe: Recipe) -> str | None:
    """Why FSDP2 cannot all-gather weights of `recipe` quantized (they are then gathered in high
    precision), or None if it can."""
    q = recipe.fprop_weight
    if recipe.dgrad_weight != q:
        return "fprop and dgrad use different weight quantizers; one gathered weight serves both only when they are equal"
    if not gathers_quantized(q):
        return f"{type(q).__name__} weights are not gathered quantized (FP8, MX and NVFP4 are)"
    gran, axis, _ = q.layout()
    if gran is Granularity.ROWWISE and axis % 2 != 1:
        return f"{q!r} scales along dim {axis}; only scales along K (axis=-1) are gathered quantized"
    if q.needs_seed() or q.hadamard_transformed():
        return f"{q!r} uses stochastic rounding or a Hadamard transform; its weight is quantized after the gather"
    return None


class QuantizedAllGatherWarning(UserWarning):
    """A weight FSDP2 all-gathers in high precision because its shards would cut scaling blocks."""


class QuantizedWeight(torch.Tensor):
    """The high-precision parameter of a converted layer, which FSDP2 all-gathers quantized.

    Every op passes through to the high-precision tensor it holds (the optimizer updates that
    tensor; outside FSDP2 the layer quantizes it as usual). FSDP2 calls `fsdp_pre_all_gather` /
    `fsdp_post_all_gather` and gives the layer a `QuantizedTensor` (see the module docstring).
    `tq.convert` makes these when a process group is initialized, or when asked with
    ``fsdp_quantized_all_gather=True``.
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, quantizer: Quantizer, layer: str = ""):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, quantizer: Quantizer, layer: str = ""):
        self._tensor = tensor
        self.quantizer = quantizer
        self.layer = layer
        self.amaxes = WeightAmaxCache()  # reduced amaxes per version of this weight (fsdp_amax)
        self._managed: ManagedParam | None = None  # found at the first gather (`managed_param`)
        self._buffer_bytes: int | None = None  # fixed by the first gather
        self._warned = False

    def __repr__(self) -> str:
        return f"QuantizedWeight({self._tensor!r}, quantizer={self.quantizer!r})"

    def __reduce_ex__(self, protocol):
        # Saved as the plain tensor it holds: a state dict saved with torch.save loads anywhere
        # (weights_only=True too), and loads back into a converted model through copy_.
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        # The quantizer only: Dynamo guards on this metadata, and the layer name (for messages)
        # would make every layer of one recipe a recompile.
        return ["_tensor"], self.quantizer

    @staticmethod
    def __tensor_unflatten__(inner, quantizer, outer_size, outer_stride):
        return QuantizedWeight(inner["_tensor"], quantizer)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # tree_leaves: collectives (a DTensor scatter) take lists of tensors.
        first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, QuantizedWeight))

        def unwrap(t):
            return t._tensor

        out = func(*tree_map_only(QuantizedWeight, unwrap, args), **tree_map_only(QuantizedWeight, unwrap, kwargs))
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, lambda t: QuantizedWeight(t, first.quantizer, first.layer), out)
        if func._schema.name.endswith("_"):  # in place (an optimizer step, a checkpoint load)
            for t in tree_leaves(args[:1]):
                if isinstance(t, QuantizedWeight):
                    t.amaxes.changed()  # the cached amaxes are stale
            return args[0] if isinstance(args[0], QuantizedWeight) else out
        return out

    # --- FSDP2 extension -------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy):
        """Quantize this shard (amaxes reduced over the shard group) into one uint8 buffer."""
        if len(outer_size) not in (2, 3):
            raise ValueError(
                f"tq FSDP2 quantized all-gather: layer {self.layer!r}: expected a 2-D weight (or a 3-D expert weight), "
                f"got {tuple(outer_size)}"
            )
        group = mesh.get_group()
        world = group.size()
        experts = len(outer_size) == 3
        plan = (_experts_gather_plan if experts else _gather_plan)(self, tuple(outer_size), world, module)
        if self._buffer_bytes is not None and self._buffer_bytes != plan.buffer_bytes:
            raise RuntimeError(
                f"tq FSDP2 quantized all-gather: layer {self.layer!r}: reshard_after_forward changed after the first "
                "all-gather, which changes what it moves; set it before the first forward"
            )
        if self._buffer_bytes is None:
            # Once per weight, before its first gather: ranks that quantize it differently would
            # exchange buffers of other layouts or sizes (a gloo abort), or train silently apart.
            facts = {
                "recipe": recipe_fact(getattr(module, "recipe", None)),
                "weight quantizer": repr(self.quantizer),
                "all-gather": f"quantized, {plan.buffer_bytes} bytes per rank",
            }
            check_ranks_agree(group, "FSDP2 all-gather", f"tq FSDP2 quantized all-gather: layer {self.layer!r}", facts)
        self._buffer_bytes = plan.buffer_bytes
        param_dtype = mp_policy.param_dtype or self.dtype
        if experts:  # whole experts on each rank, each with its own scales: no amax collective (fsdp_experts)
            if plan.high_precision:
                return (padded_shard(self._tensor, plan.experts, param_dtype),), (plan, param_dtype)
            return (experts_pack(self._tensor.detach().to(param_dtype), plan),), (plan, param_dtype)
        if plan.high_precision:
            return (padded_shard(self._tensor, plan.rows, param_dtype),), (plan, None, {}, None, param_dtype)
        group_name = group.group_name
        q = self.quantizer
        tensor_amax, column_amax = self.amaxes.reduced(q, self._tensor, group_name)
        row_amax = None
        if plan.tp is not None:
            tensor_amax, column_amax, row_amax = self.amaxes.over_tp(
                q, plan.tp, self._tensor, plan.rows, param_dtype, tensor_amax, column_amax
            )
        if tensor_amax is not None:
            # amax(x.to(bf16)) == bf16(amax(x)): rounding is monotonic, so the cached fp32 amax serves any param_dtype.
            tensor_amax = tensor_amax.to(param_dtype).float()
            hist = getattr(module, "amax_history_weight", None)
            if hist is not None and hist.numel():
                tensor_amax = self.amaxes.delayed(hist, tensor_amax, _in_backward(self))
        if column_amax is not None:
            column_amax = column_amax.to(param_dtype)
        n, k = plan.rows, outer_size[1]
        buf, scales = pack(padded_shard(self._tensor, n, param_dtype), plan, tensor_amax, column_amax, row_amax)
        # A 2-D weight records the TP group: the one the TP layer checks (its amaxes span both groups).
        meta = (plan, tensor_amax, scales, group_name if plan.tp is None else plan.tp.group, param_dtype)
        if outer_size[0] % world == 0:
            return (buf,), meta
        # Uneven shards: FSDP2 wants every all-gather input in the padded shard's shape, so the buffer
        # travels as that many (n, K) uint8 chunks (at most 2 bytes an element: gloo moves no int16).
        chunks = math.ceil(buf.numel() / (n * k))
        buf = torch.cat((buf, buf.new_zeros(chunks * n * k - buf.numel())))
        return tuple(buf.view(chunks, n, k).unbind(0)), meta

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out: torch.Tensor | None = None):
        """Unpack every rank's buffer into the unsharded QuantizedTensor (or refill `out`)."""
        if isinstance(metadata[0], ExpertsPlan):
            return _experts_post_all_gather(all_gather_outputs[0], *metadata, out)
        plan, tensor_amax, scales, group_name, _ = metadata
        world, (rows, k), q = plan.world, plan.shape, plan.quantizer
        # Each output holds every rank's input, rank after rank; uneven shards split one rank's buffer over several.
        gathered = (
            torch.cat([t.reshape(world, -1).view(_U8) for t in all_gather_outputs], 1)
            if len(all_gather_outputs) > 1
            else all_gather_outputs[0]
        )
        if out is not None:
            out = local_tensor(out)  # a DTensor on a 2-D (TP x FSDP) mesh: refill its local tensor
        if plan.high_precision:
            return _high_precision_result(gathered.view(-1, k)[:rows], out)
        got = unpack(gathered, plan, tensor_amax, scales)
        if out is not None:
            _refill(out, got)
            _mark_rowwise(out, plan, self.layer)
            return None
        add_unfilled_usages(got, plan, tensor_amax is not None, gathered.device)
        result = QuantizedTensor((rows, k), q, param_dtype, group_name, **got)
        _mark_rowwise(result, plan, self.layer)
        return result, list(result._inner().values())


def _high_precision_result(full: torch.Tensor, out: torch.Tensor | None):
    """What `fsdp_post_all_gather` returns for a weight gathered in high precision (`full`, a view of the gathered buffer)."""
    full = full.clone()
    if out is None:
        return full, [full]
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
        out.copy_(full)
    return None


def _refill(out: QuantizedTensor, got: dict[str, torch.Tensor]) -> None:
    """Copy a later gather's inner tensors `got` into the unsharded QuantizedTensor `out` (FSDP2
    frees and refills the same tensors); the usages it did not bring are poisoned (`fsdp_layout.poison`)."""
    dsts = {name: getattr(out, name) for name in got}
    # A refill is the same value autograd saved (the weight did not change since forward), so
    # keep the version counters, as FSDP2 does for its own all-gather outputs.
    stale = {name: getattr(out, name) for name in USAGE_PARTS if name not in got and getattr(out, name, None) is not None}
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(dsts.values()) + tuple(stale.values())):
        for name, t in got.items():
            dst = dsts[name]
            if dst.dim() and dst.element_size() == 1:
                dst.view(_U8).copy_(t.view(_U8))  # float8 / e8m0 payloads and scales: copy their bytes
            else:
                dst.copy_(t)
        for t in stale.values():
            poison(t)


def _experts_post_all_gather(gathered: torch.Tensor, plan: ExpertsPlan, param_dtype: torch.dtype, out: torch.Tensor | None):
    """`fsdp_post_all_gather` of a 3-D expert weight: a `GroupedQuantizedTensor` (`fsdp_experts`), or a refill of `out`."""
    if plan.high_precision:
        return _high_precision_result(gathered.view(-1, *plan.shape[1:])[: plan.shape[0]], out)
    got = experts_unpack(gathered, plan)
    if out is not None:
        _refill(out, got)
        return None
    # Every usage exists from the first gather on (FSDP2 refills these tensors); those not gathered are poisoned.
    for name, shape, dtype in plan.parts(plan.shape[0], True, True):
        if name not in got:
            got[name] = torch.empty(shape, dtype=dtype, device=gathered.device)
            poison(got[name])
    result = GroupedQuantizedTensor(plan.shape, plan.quantizer, param_dtype, None, **got)
    return result, list(result._inner().values())


def managed_param(weight: QuantizedWeight) -> ManagedParam | None:
    """The FSDP2 group and parameter managing `weight` (`fsdp_state`), looked up once."""
    if weight._managed is None:
        weight._managed = find_managed(weight)
    return weight._managed


def _managed_or_raise(weight: QuantizedWeight) -> ManagedParam:
    found = managed_param(weight)
    if found is None:
        raise RuntimeError(
            f"tq FSDP2 quantized all-gather: layer {weight.layer!r}: this weight is not the sharded parameter FSDP2 "
            "manages (FSDP2's CPU offload copies it before the gather, which is not supported); convert with "
            "fsdp_quantized_all_gather=False to offload"
        )
    return found


def _in_backward(weight: QuantizedWeight) -> bool:
    found = managed_param(weight)
    return found is not None and found.in_backward()


def _gather_plan(weight: QuantizedWeight, shape: tuple[int, int], world: int, module: nn.Module) -> _Plan:
    """What this gather of `weight` moves (`fsdp_layout._Plan`), from FSDP2's state and the layer."""
    q, layer = weight.quantizer, weight.layer
    found = _managed_or_raise(weight)
    tp = None
    if found.is_dtensor():
        # Tensor parallel x FSDP2 (tqcompile.distributed.fsdp_tp): a weight of a tqcompile TP layer
        # is gathered quantized with its amaxes also reduced over the TP group; any other DTensor
        # weight in high precision, quantized by its layer.
        tp = tp_split(found.tp_spec(), module)
        if tp is None:
            return _Plan(q, shape, world, False, False, 0, high_precision=True)
    if found.shard_dim() != 0:
        raise ValueError(
            f"tq FSDP2 quantized all-gather: layer {layer!r} is sharded on dim {found.shard_dim()}; only dim 0 (the default) is supported"
        )
    cut = _cut_blocks(q, shape, world, layer)
    if cut is not None:
        if not weight._warned:
            warnings.warn(f"tq FSDP2 quantized all-gather: {cut}", QuantizedAllGatherWarning, stacklevel=3)
            weight._warned = True
        return _Plan(q, shape, world, False, False, 0, high_precision=True)
    rowwise, columnwise, both = _gather_usages(q.columnwise_is_transpose(), found, module, layer)
    plan = _Plan(q, shape, world, rowwise, columnwise, 0, tp=tp)
    sizes = {"row": _nbytes(plan.parts(True, False)), "col": _nbytes(plan.parts(False, True))}
    sizes["row+col"] = sizes["row"] + sizes["col"]
    return dataclasses.replace(plan, buffer_bytes=max(sizes[b] for b in both))


def _gather_usages(transposable: bool, found: ManagedParam, module: nn.Module, layer: str) -> tuple[bool, bool, tuple[str, ...]]:
    """(rowwise, columnwise, every usage set this weight's gathers move) for this gather: the
    rowwise (fprop) usage in forward, the columnwise (dgrad) one in backward, both where one gather
    serves both passes; the rowwise only where the columnwise is its transpose (`transposable`)."""
    in_backward = found.in_backward()
    if transposable:
        return True, False, ("row",)
    if found.reshards_after_forward() and fix_recompute(module, found.modules(), layer):
        # Activation checkpointing re-runs the forward after the backward re-gather: it brings both usages.
        return True, in_backward, ("row", "row+col")
    if found.reshards_after_forward():
        return not in_backward, in_backward, ("row", "col")
    return True, True, ("row+col",)  # gathered once for forward and backward


def _experts_gather_plan(weight: QuantizedWeight, shape: tuple[int, int, int], world: int, module: nn.Module) -> ExpertsPlan:
    """What this gather of a converted experts module's 3-D `weight` moves (`fsdp_experts`)."""
    q, layer = weight.quantizer, weight.layer
    found = _managed_or_raise(weight)
    layout = getattr(module, "tq_experts_layout", None)
    gemm = None if layout is None else next((g for g in layout.gemms if g.weight == found.param_name()), None)
    if gemm is None or found.shard_dim() != 0 or found.is_dtensor():
        raise ValueError(
            f"tq FSDP2 quantized all-gather: {layer!r}: a 3-D weight is gathered quantized only as an expert weight "
            "of a converted experts module, sharded by fully_shard on dim 0 (the experts) over a 1-D mesh"
        )
    if shape[0] % world:
        if not weight._warned:
            warnings.warn(
                f"tq FSDP2 quantized all-gather: {layer!r}: its {shape[0]} experts do not divide over {world} ranks; it is "
                "all-gathered in high precision instead (same numerics, more bytes)",
                QuantizedAllGatherWarning,
                stacklevel=4,
            )
            weight._warned = True
        return ExpertsPlan(q, shape, world, gemm.transposed, False, False, 0, high_precision=True)
    fprop, dgrad, both = _gather_usages(derives_dgrad(q), found, module, layer)
    plan = ExpertsPlan(q, shape, world, gemm.transposed, fprop, dgrad, 0)
    sizes = {b: experts_nbytes(plan.parts(plan.experts, "row" in b, "col" in b)) for b in both}
    return dataclasses.replace(plan, buffer_bytes=max(sizes.values()))


def _mark_rowwise(weight: QuantizedTensor, plan: _Plan, layer: str) -> None:
    """Record on the gathered weight (`QuantizedTensor.rowwise_not_gathered`) whether this gather left
    its rowwise usage unfilled, as the error the quantized linear raises if a forward reads it anyway:
    a forward recomputed by activation checkpointing that `tqcompile.distributed.recompute` could not see.

    The field is tensor metadata: Dynamo guards on it, so a compiled forward called again on such a
    weight recompiles and raises, and a forward on a weight whose rowwise usage is there never sees it
    (no recompile between steps)."""
    if plan.rowwise or plan.high_precision:
        weight.rowwise_not_gathered = None
        return
    weight.rowwise_not_gathered = (
        f"tq FSDP2 quantized all-gather: layer {layer!r}: its forward ran during backward (activation checkpointing "
        f"recomputes it) and read the weight's rowwise usage, which FSDP2's backward all-gather did not bring: for "
        f"{plan.quantizer!r} the backward gathers only dgrad's columnwise usage, unless it knows the forward is "
        "recomputed. checkpoint_wrapper'd and composable-checkpoint'ed modules inside the FSDP2 unit are found "
        "automatically; for torch.utils.checkpoint.checkpoint called inside a forward, call "
        "tq.distributed.recompute_in_backward(module) on the checkpointed module before the first forward. Or "
        "fully_shard with reshard_after_forward=False, or tq.convert(..., fsdp_quantized_all_gather=False)."
    )


def enable_quantized_all_gather(module: nn.Module, layer: str = "", *, model: nn.Module | None = None) -> bool:
    """Make `module.weight` (a converted layer's) a `QuantizedWeight`, so FSDP2 gathers it
    quantized. Returns False, changing nothing, where its recipe cannot (`quantized_all_gather_reason`).

    The `QuantizedWeight` is a new Parameter, so wrapping a weight that other modules share (tied
    weights, e.g. an embedding and its output head) would untie it. This function sees only `module`:
    pass `model` (the model `module` belongs to) and a weight that `model` also holds under another
    module is kept plain (returns False, with a `QuantizedAllGatherWarning` naming the owners); its
    GEMMs still run quantized. `tq.convert` does this check itself.

    Example:
        >>> tq.distributed.enable_quantized_all_gather(model.lm_head, "lm_head", model=model)
    """
    owners = None if model is None else _parameter_owners(model)
    return _enable(module, layer, owners, "enable_quantized_all_gather")


def enable_converted_layers(model: nn.Module, layers: list[str]) -> int:
    """`enable_quantized_all_gather` for the converted layers named `layers` of `model` (what
    `tq.convert` does when asked to, or when a process group is initialized); how many it wrapped."""
    owners, modules = _parameter_owners(model), dict(canonical_modules(model))  # `layers` are tq.convert's canonical names
    return sum(_enable(modules[name], name, owners, "tq.convert") for name in layers)


def _enable(module: nn.Module, layer: str, owners: dict[int, list[tuple[str, nn.Module]]] | None, caller: str) -> bool:
    if not is_converted(module) or quantized_all_gather_reason(module.recipe) is not None:
        return False
    layout = experts_layout(module)
    if layout is None:
        return _wrap(module, "weight", 2, layer, owners, caller)
    if module.recipe.amax_history_len:
        return False  # delayed scaling rolls per-expert histories inside the grouped GEMM: gathered in high precision
    # A converted experts module: each of its 3-D expert weights (`fsdp_experts`).
    return any([_wrap(module, g.weight, 3, f"{layer}.{g.weight}", owners, caller) for g in layout.gemms])


def _wrap(module: nn.Module, name: str, dims: int, layer: str, owners, caller: str) -> bool:
    weight = getattr(module, name, None)
    if weight is None or weight.dim() != dims or isinstance(weight, QuantizedWeight):
        return False
    others = sorted({name for name, m in owners.get(id(weight), []) if m is not module}) if owners is not None else []
    if others:
        # A QuantizedWeight is a new Parameter: wrapping a tied weight would untie it (the embedding
        # would keep training its own copy), and the other owner could not read a quantized gather anyway.
        warnings.warn(
            f"{caller}: layer {layer or type(module).__name__!r}: its weight is shared with {', '.join(others)} (tied weights); kept plain so "
            "that it stays tied: FSDP2 all-gathers it in high precision (its GEMMs still run quantized)",
            QuantizedAllGatherWarning,
            stacklevel=3,
        )
        return False
    wrapped = QuantizedWeight(weight.data, module.recipe.fprop_weight, layer)
    setattr(module, name, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
    return True


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> every (name, owning module) under which `model` holds it (several for tied weights)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((f"{mod_name}.{p_name}" if mod_name else p_name, module))
    return owners
