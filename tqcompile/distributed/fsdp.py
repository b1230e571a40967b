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

- transposable scales (tensorwise FP8, 128x128 FP8 blocks, NVFP4 16x16 tiles): the rowwise usage
  only; dgrad's columnwise usage is its exact transpose, made locally after the gather;
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
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from tqcompile import ops
from tqcompile.distributed.agreement import check_ranks_agree, recipe_fact
from tqcompile.distributed.fsdp_layout import (
    _cut_blocks,
    _full_shapes,
    _itemsize,
    _nbytes,
    _Plan,
    _transposable,
    _transpose_payload,
)
from tqcompile.distributed.fsdp_tp import reduce_over_tp, tp_split
from tqcompile.distributed.groups import all_reduce_amax
from tqcompile.distributed.recompute import recomputed_in_backward
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer
from tqcompile.recipes import Recipe
from tqcompile.tensor import QuantizedTensor

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


def quantized_all_gather_reason(recipe: Recipe) -> str | None:
    """Why FSDP2 cannot all-gather weights of `recipe` quantized (they are then gathered in high
    precision), or None if it can."""
    q = recipe.fprop_weight
    if recipe.dgrad_weight != q:
        return "fprop and dgrad use different weight quantizers; one gathered weight serves both only when they are equal"
    if not isinstance(q, (Float8Quantizer, MXQuantizer, NVFP4Quantizer)):
        return f"{type(q).__name__} weights are not gathered quantized (FP8, MX and NVFP4 are)"
    gran, axis, _ = q.layout()
    if gran is Granularity.ROWWISE and axis % 2 != 1:
        return f"{q!r} scales along dim {axis}; only scales along K (axis=-1) are gathered quantized"
    if q.needs_seed() or getattr(q, "hadamard", False):
        return f"{q!r} uses stochastic rounding or a Hadamard transform; its weight is quantized after the gather"
    return None


class QuantizedAllGatherWarning(UserWarning):
    """A weight FSDP2 all-gathers in high precision because its shards would cut scaling blocks."""


def _fsdp_param_group_of(weight: QuantizedWeight) -> tuple[Any, Any] | None:
    """(FSDPParamGroup, FSDPParam) that manages `weight` as its sharded local tensor, or None.

    Private FSDP2 internals, in this one place: nothing public says whether the current gather is
    the forward's or the backward's, nor whether the backward will gather again
    (`reshard_after_forward`), and the two decide what a gather must carry. Checked on torch 2.13
    (`_fsdp_param_groups`) and 2.11 (`_fsdp_param_group`).
    """
    if weight._fsdp is not None:
        return weight._fsdp
    from torch.distributed._composable_state import _module_state_mapping

    for ref in list(_module_state_mapping.values()):
        state = ref()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                if fsdp_param._sharded_local_tensor is weight:
                    weight._fsdp = (group, fsdp_param)
                    return weight._fsdp
    return None


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
        self._fsdp = None
        self._updates = 0  # in-place updates seen (see __torch_dispatch__)
        # (version of _tensor, param dtype) -> amaxes; see `_amaxes`.
        self._amax_cache: tuple[int, torch.Tensor | None, torch.Tensor | None] | None = None
        self._forward_amax: tuple[int, torch.Tensor | None] | None = None
        self._buffer_bytes: int | None = None
        self._warned = False
        self._recomputed: bool | None = None  # see `_recomputed_in_backward`

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
            # The inner tensor's version counter does not move under __torch_dispatch__ (it runs below
            # ADInplaceOrView), so count updates here: they invalidate the cached amaxes.
            for t in tree_leaves(args[:1]):
                if isinstance(t, QuantizedWeight):
                    t._updates += 1
            return args[0] if isinstance(args[0], QuantizedWeight) else out
        return out

    # --- amaxes ---------------------------------------------------------------------------
    def _local_amaxes(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(tensor amax, per-column amax) of this shard in fp32, the parts `quantizer` needs."""
        q, w = self.quantizer, self._tensor
        tensor_amax = ops.amax(w, q) if q.uses_tensor_amax() else None
        column_amax = None
        if q.layout()[0] is Granularity.ROWWISE:
            a = w.detach().float().abs()
            column_amax = (
                torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(0) if a.shape[0] else a.new_zeros(a.shape[1])
            )
        return tensor_amax, column_amax

    def _set_amaxes(self, tensor_amax, column_amax) -> None:
        self._amax_cache = (self._updates, tensor_amax, column_amax)

    def _amaxes(self, group_name: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The group-reduced fp32 amaxes of the whole weight; reused while the weight is unchanged
        (its version counter, which every in-place update bumps), so a backward re-gather and a
        `precompute_scales` call cost no collective."""
        if self._amax_cache is not None and self._amax_cache[0] == self._updates:
            return self._amax_cache[1], self._amax_cache[2]
        t, c = self._local_amaxes()
        flat = [x.reshape(-1) for x in (t, c) if x is not None]
        if flat and group_name is not None:
            reduced = all_reduce_amax(torch.cat(flat), group_name)
            t, c = (reduced[0], reduced[1:]) if t is not None else (None, reduced)
            if c is not None and c.numel() == 0:
                c = None
        self._set_amaxes(t, c)
        return t, c

    # --- FSDP2 extension -------------------------------------------------------------------
    def _plan(self, shape, world, module) -> _Plan:
        q = self.quantizer
        found = _fsdp_param_group_of(self)
        if found is None:
            raise RuntimeError(
                f"tq FSDP2 quantized all-gather: layer {self.layer!r}: this weight is not the sharded parameter FSDP2 "
                "manages (FSDP2's CPU offload copies it before the gather, which is not supported); convert with "
                "fsdp_quantized_all_gather=False to offload"
            )
        group, fsdp_param = found
        tp = None
        if getattr(fsdp_param, "is_dtensor", False):
            # Tensor parallel x FSDP2 (tqcompile.distributed.fsdp_tp): a weight of a tqcompile TP layer
            # is gathered quantized with its amaxes also reduced over the TP group; any other DTensor
            # weight in high precision, quantized by its layer.
            tp = tp_split(fsdp_param, module)
            if tp is None:
                return _Plan(q, shape, world, False, False, 0, high_precision=True)
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError(
                f"tq FSDP2 quantized all-gather: layer {self.layer!r} is sharded on dim {fsdp_param.fsdp_placement.dim}; "
                "only dim 0 (the default) is supported"
            )
        cut = _cut_blocks(q, shape, world, self.layer)
        if cut is not None:
            if not self._warned:
                warnings.warn(f"tq FSDP2 quantized all-gather: {cut}", QuantizedAllGatherWarning, stacklevel=2)
                self._warned = True
            return _Plan(q, shape, world, False, False, 0, high_precision=True)
        in_backward = group._training_state.name == "PRE_BACKWARD"
        if _transposable(q):
            rowwise, columnwise, both = True, False, ("row",)
        elif group._reshard_after_forward and self._recomputed_in_backward(group, module):
            # Activation checkpointing re-runs the forward after the backward re-gather: it brings both usages.
            rowwise, columnwise = True, in_backward
            both = ("row", "row+col")
        elif group._reshard_after_forward:
            rowwise, columnwise = not in_backward, in_backward
            both = ("row", "col")
        else:  # gathered once for forward and backward
            rowwise = columnwise = True
            both = ("row+col",)
        plan = _Plan(q, shape, world, rowwise, columnwise, 0, tp=tp)
        sizes = {"row": _nbytes(plan.parts(True, False)), "col": _nbytes(plan.parts(False, True))}
        sizes["row+col"] = sizes["row"] + sizes["col"]
        return dataclasses.replace(plan, buffer_bytes=max(sizes[b] for b in both))

    def _recomputed_in_backward(self, group, module: nn.Module) -> bool:
        """Whether `module`'s forward runs again in backward inside this FSDP unit (see
        `tqcompile.distributed.recompute`); decided once, at the first gather, as FSDP2 fixes the
        buffer size there."""
        if self._recomputed is None:
            self._recomputed = recomputed_in_backward(module, group.modules)
        return self._recomputed

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy):
        """Quantize this shard (amaxes reduced over the shard group) into one uint8 buffer."""
        if len(outer_size) != 2:
            raise ValueError(
                f"tq FSDP2 quantized all-gather: layer {self.layer!r}: expected a 2-D weight, got {tuple(outer_size)}"
            )
        group = mesh.get_group()
        world = group.size()
        plan = self._plan(tuple(outer_size), world, module)
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
        if plan.high_precision:
            x = self._tensor.detach().to(param_dtype)
            if x.shape[0] < plan.rows:
                x = torch.cat((x, x.new_zeros(plan.rows - x.shape[0], x.shape[1])))
            return (x,), (plan, None, {}, None, param_dtype)
        group_name = group.group_name
        tensor_amax, column_amax = self._amaxes(group_name)
        row_amax = None
        if plan.tp is not None:
            tensor_amax, column_amax, row_amax = self._tp_amaxes(plan, param_dtype, tensor_amax, column_amax)
        if tensor_amax is not None:
            # amax(x.to(bf16)) == bf16(amax(x)): rounding is monotonic, so the cached fp32 amax serves any param_dtype.
            tensor_amax = tensor_amax.to(param_dtype).float()
            hist = getattr(module, "amax_history_weight", None)
            if hist is not None and hist.numel():
                tensor_amax = self._delayed(hist, tensor_amax, plan)
        if column_amax is not None:
            column_amax = column_amax.to(param_dtype)

        q, n, k = self.quantizer, plan.rows, outer_size[1]
        x = self._tensor.detach().to(param_dtype)
        if x.shape[0] < n:
            x = torch.cat((x, x.new_zeros(n - x.shape[0], k)))
        packed = []
        scales = {}
        if plan.rowwise:
            # row_amax: per-row scales along a TP-split K, given their TP-reduced amaxes (fsdp_tp).
            data, scale_inv = ops.quantize(x, q, tensor_amax if row_amax is None else row_amax, None)
            packed.append(data.view(_U8).reshape(-1))
            if any(name == "_scale_inv" for name, _, _ in plan.parts(True, False)):
                packed.append(scale_inv.view(_U8).reshape(-1))
            else:
                scales["_scale_inv"] = scale_inv
        if plan.columnwise:
            xt = x.t()
            if column_amax is not None:
                # Per-row scales of the transpose are per-column amaxes of the whole weight: plant the
                # reduced amax as an extra column, so the kernel's own row amax is the global one.
                data_t, scale_inv_t = ops.quantize(torch.cat((xt, column_amax[:, None]), 1), q, None, None)
                data_t = data_t[:, :n]
                scales["_scale_inv_t"] = scale_inv_t
            else:
                data_t, scale_inv_t = ops.quantize(xt, q, tensor_amax, None)
            packed.append(data_t.contiguous().view(_U8).reshape(-1))
            if "_scale_inv_t" not in scales:
                packed.append(scale_inv_t.view(_U8).reshape(-1))
        buf = torch.cat(packed) if packed else x.new_zeros(0, dtype=_U8)
        buf = torch.cat((buf, buf.new_zeros(plan.buffer_bytes - buf.numel()))) if buf.numel() < plan.buffer_bytes else buf
        # A 2-D weight records the TP group: the one the TP layer checks (its amaxes span both groups).
        meta = (plan, tensor_amax, scales, group_name if plan.tp is None else plan.tp.group, param_dtype)
        if outer_size[0] % world == 0:
            return (buf,), meta
        # Uneven shards: FSDP2 wants every all-gather input in the padded shard's shape, so the buffer
        # travels as that many (n, K) uint8 chunks (at most 2 bytes an element: gloo moves no int16).
        chunks = math.ceil(buf.numel() / (n * k))
        buf = torch.cat((buf, buf.new_zeros(chunks * n * k - buf.numel())))
        return tuple(buf.view(chunks, n, k).unbind(0)), meta

    def _tp_amaxes(self, plan: _Plan, param_dtype: torch.dtype, tensor_amax, column_amax):
        """The dp-reduced amaxes further reduced over the TP group (`fsdp_tp.reduce_over_tp`),
        cached like `_amaxes`, so a backward re-gather of an unchanged weight runs no collective."""
        key = (self._updates, param_dtype)
        cached = getattr(self, "_tp_amax_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        x = self._tensor.detach().to(param_dtype)
        if x.shape[0] < plan.rows:  # padding rows are zeros: they change no row or column amax
            x = torch.cat((x, x.new_zeros(plan.rows - x.shape[0], x.shape[1])))
        reduced = reduce_over_tp(self.quantizer, plan.tp, x, tensor_amax, column_amax)
        self._tp_amax_cache = (key, reduced)
        return reduced

    def _delayed(self, hist: torch.Tensor, amax: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Delayed scaling: the forward's gather rolls the weight's history once (as the layer does
        once per forward); a backward re-gather reuses the amax that forward scaled with."""
        found = _fsdp_param_group_of(self)
        in_backward = found is not None and found[0]._training_state.name == "PRE_BACKWARD"
        if in_backward and self._forward_amax is not None and self._forward_amax[0] == self._updates:
            return self._forward_amax[1]
        used = ops.amax_history_update(hist, amax)
        self._forward_amax = (self._updates, used)
        return used

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out: torch.Tensor | None = None):
        """Unpack every rank's buffer into the unsharded QuantizedTensor (or refill `out`)."""
        plan, tensor_amax, scales, group_name, _ = metadata
        world, (rows, k), q = plan.world, plan.shape, plan.quantizer
        # Each output holds every rank's input, rank after rank; uneven shards split one rank's buffer over several.
        gathered = (
            torch.cat([t.reshape(world, -1).view(_U8) for t in all_gather_outputs], 1)
            if len(all_gather_outputs) > 1
            else all_gather_outputs[0]
        )
        if plan.high_precision:
            full = gathered.view(-1, k)[:rows].clone()
            if out is not None:
                out = _local(out)  # a DTensor on a 2-D (TP x FSDP) mesh: refill its local tensor
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(full)
                return None
            return full, [full]
        if out is not None:
            out = _local(out)  # a DTensor on a 2-D (TP x FSDP) mesh: refill its local tensor
        per_rank = gathered.view(_U8).view(world, -1)
        got: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape, dtype in plan.parts(plan.rowwise, plan.columnwise):
            size = math.prod(shape) * _itemsize(dtype)
            chunk = per_rank[:, offset : offset + size].contiguous().view(dtype).view(world, *shape)
            offset += size
            full = _full_shapes(q, rows, k)[name]
            if name in ("_data", "_scale_inv"):  # rank blocks stack along dim 0
                got[name] = chunk.reshape(world * shape[0], shape[1])[: full[0]]
            else:  # the columnwise usage's dim 1 is the sharded one
                got[name] = chunk.permute(1, 0, 2).reshape(shape[0], world * shape[1])[:, : full[1]]
        got.update(scales)
        if tensor_amax is not None:
            got["_amax"] = tensor_amax
            if plan.columnwise or _transposable(q):
                got["_amax_t"] = tensor_amax
        if _transposable(q):
            got["_data_t"] = _transpose_payload(got["_data"], q)
            got["_scale_inv_t"] = got["_scale_inv"].t()
        if "_scale_inv_t" in got and q.flat_columnwise_scale():  # gathered as (K, N // block), kept flat
            got["_scale_inv_t"] = got["_scale_inv_t"].reshape(-1)
        got = {name: t.contiguous().clone() for name, t in got.items()}
        if out is not None:
            dsts = {name: getattr(out, name) for name in got}
            # A refill is the same value autograd saved (the weight did not change since forward), so
            # keep the version counters, as FSDP2 does for its own all-gather outputs.
            stale = {
                name: getattr(out, name) for name in _USAGE_PARTS if name not in got and getattr(out, name, None) is not None
            }
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(dsts.values()) + tuple(stale.values())):
                for name, t in got.items():
                    dst = dsts[name]
                    if dst.dim() and dst.element_size() == 1:
                        dst.view(_U8).copy_(t.view(_U8))  # float8 / e8m0 payloads and scales: copy their bytes
                    else:
                        dst.copy_(t)
                for t in stale.values():
                    _poison(t)
            _mark_rowwise(out, plan, self.layer)
            return None
        # Every usage exists from the first gather on, since FSDP2 frees and refills these same
        # tensors: a usage a pass does not gather stays unfilled there, and that pass does not read it.
        for name, shape in _full_shapes(q, rows, k).items():
            if name == "_scale_inv_t":
                shape = q.columnwise_scale_shape((k, rows))
            if name not in got and (tensor_amax is not None or not name.startswith("_amax")):
                dtype = (
                    torch.float32
                    if name.startswith("_amax")
                    else q.scale_dtype()
                    if "scale" in name
                    else q.element_format().storage_dtype
                )
                got[name] = torch.empty(shape, dtype=dtype, device=gathered.device)
                if name in _USAGE_PARTS:
                    _poison(got[name])
        result = QuantizedTensor((rows, k), q, param_dtype, group_name, **got)
        _mark_rowwise(result, plan, self.layer)
        return result, list(result._inner().values())


# A usage this gather did not bring holds NaN, not stale or uninitialised bytes (FSDP2 frees and
# refills these tensors). A forward recomputed after a backward re-gather gets both usages where
# `tqcompile.distributed.recompute` sees it coming, and raises where it reads an unfilled rowwise
# usage in Python (`_mark_rowwise`); what is left, a recompute inside a compiled backward graph that
# nothing declared, reads these NaN (which a ReLU's backward can still turn into zero gradients).
# 0xFF is NaN in E4M3, E5M2 and E8M0; NVFP4's E2M1 payload has no NaN, but its E4M3 block scales do,
# and fp32 scales are filled with NaN.
_USAGE_PARTS = ("_data", "_scale_inv", "_data_t", "_scale_inv_t")


def _poison(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.element_size() == 1:
            t.view(_U8).fill_(0xFF)
        else:
            t.fill_(float("nan"))


def _mark_rowwise(weight: QuantizedTensor, plan: _Plan, layer: str) -> None:
    """Record on the gathered weight whether this gather left its rowwise usage unfilled, as the
    error `tq.nn.functional.linear` raises if a forward reads it anyway: a forward recomputed by
    activation checkpointing that `tqcompile.distributed.recompute` could not see.

    The attribute exists only while it holds an error: Dynamo guards on its presence, so a compiled
    forward called again on such a weight recompiles and raises, and a forward on a weight whose
    rowwise usage is there never sees it (no recompile between steps)."""
    if plan.rowwise or plan.high_precision:
        weight.__dict__.pop("_rowwise_not_gathered", None)
        return
    weight._rowwise_not_gathered = (
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
    recipe = getattr(module, "recipe", None)
    weight = getattr(module, "weight", None)
    if recipe is None or weight is None or weight.dim() != 2 or isinstance(weight, QuantizedWeight):
        return False
    if quantized_all_gather_reason(recipe) is not None:
        return False
    if model is not None:
        others = sorted(
            f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, m in model.named_modules(remove_duplicate=False)
            if m is not module
            for p_name, p in m.named_parameters(recurse=False)
            if p is weight
        )
        if others:
            warnings.warn(
                f"enable_quantized_all_gather: layer {layer or type(module).__name__!r}: its weight is shared with "
                f"{', '.join(others)} (tied weights); kept plain so that it stays tied (FSDP2 gathers it in high "
                "precision, its GEMMs still run quantized)",
                QuantizedAllGatherWarning,
                stacklevel=2,
            )
            return False
    module.weight = nn.Parameter(QuantizedWeight(weight.data, recipe.fprop_weight, layer), requires_grad=weight.requires_grad)
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def _is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
