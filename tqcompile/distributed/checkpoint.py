"""`torch.distributed.checkpoint` (DCP) save and load of converted models, sharded or not.

A converted model's state dict has exactly `nn.Linear`'s keys, and `save` writes the
high-precision tensors the FSDP2 weight wrapper (`QuantizedWeight`) holds, so DCP reshards it like
any model: a
checkpoint saved by FSDP2 on 2 ranks loads into 1 process and the other way round. What DCP cannot
check is that the checkpoint was made for the same quantization: `save` adds one entry, the recipe
of every converted layer by canonical name (the model's `LayerSpec`s, `tqcompile.surgery`), and
`load` compares it before it loads anything else.

A fused `ColwiseParallel` tensor (`fused_chunks` > 1 on a 1-D TP mesh, placed `_StridedShard`, which
DCP's planner rejects) is saved as a `(chunks, N/chunks, ...)` tensor split plainly on dim 1, holding
the same local rows; `load` maps it back into a fused TP layout or a plain tensor, and reads a plain
checkpoint into a fused layout. On a 2-D (dp, tp) mesh, where FSDP2 also shards such a tensor and places it
`(_StridedShard(0), _StridedShard(0))` (a layout whose global view is not the tensor), `save` first
all-gathers its dp shards by hand and writes the TP-local tensor the same way (each tp rank's rows once,
the dp ranks holding the same chunk); `load` reads the TP-local rows and keeps this dp rank's.

Every collective happens inside `dcp.save`/`dcp.load` and torch's state-dict helpers, except those dp
all-gathers, which `save` runs on every rank in the state dict's order before `dcp.save`.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map_only

from tqcompile.distributed.fsdp import QuantizedWeight
from tqcompile.nn.base import is_converted
from tqcompile.surgery.names import canonical_renamer
from tqcompile.surgery.specs import layer_specs

# Also importable, for tq.export reading a checkpoint one tensor at a time: FUSED_CHUNKS_KEY, dcp_call.
__all__ = ["save", "load", "quantization_metadata", "CheckpointMismatchError"]

_KEY = "tqcompile_quantization"
# The entry `save` adds: {state path: chunks} of the fused ColwiseParallel tensors it stacked (see above).
FUSED_CHUNKS_KEY = "tqcompile_fused_chunks"


class CheckpointMismatchError(ValueError):
    """A checkpoint made for another model or another quantization recipe."""


def quantization_metadata(model: nn.Module) -> dict[str, str]:
    """{layer name: its recipe's repr} for every converted layer of `model`, by canonical name."""
    return {spec.layer: repr(spec.recipe) for spec in layer_specs(model) if spec.recipe is not None}


# The names checkpoints written before canonical names hold: wrapper components removed from the raw
# names by string, as whole components (which also dropped a user's own component named "module"), and
# before that as substrings (which cut a user's "encoder.submodule.fc" into "encoder.subfc"). `load`
# matches a checkpoint saved under either.
_WRAPPER_COMPONENTS = ("_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _components_removed(fqn: str) -> str:
    return ".".join(c for c in fqn.split(".") if c not in _WRAPPER_COMPONENTS)


def _substrings_removed(fqn: str) -> str:
    for component in _WRAPPER_COMPONENTS:
        fqn = fqn.replace(f"{component}.", "")
    return fqn


def _older_metadata(model: nn.Module, rename) -> dict[str, str]:
    """`quantization_metadata` under an older naming of the raw module names."""
    return {rename(name): repr(m.recipe) for name, m in model.named_modules() if is_converted(m)}


def _plain(value):
    """The high-precision tensor a `QuantizedWeight` (or a DTensor of one) holds, sharing its storage,
    so the files hold plain tensors that any process can load (with `weights_only=True`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedWeight):
        return DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value._tensor if isinstance(value, QuantizedWeight) else value


def _check_describable(model: nn.Module) -> None:
    """Refuse, before any collective, a fused parameter sharded again on a mesh of more than 2 dims.

    FSDP2 on the dp dim of a weight that a fused `ColwiseParallel` (`fused_chunks` > 1, placed
    `_StridedShard(0)` over TP) already splits on dim 0 places it `(_StridedShard(0), _StridedShard(0))`
    (torch 2.13), whose global view is not the weight; `save` and `load` handle that 2-D (dp, tp) case
    by hand (`_dp_fused`). A 3-D mesh (HSDP x TP) is not handled. Every rank holds the same
    parameters, so every rank raises here alike."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    rename = canonical_renamer(model)
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or len(p.placements) < 3:
            continue
        inner = p.placements[-1]
        if isinstance(inner, _StridedShard) and any(getattr(pl, "dim", None) == inner.dim for pl in p.placements[:-1]):
            raise ValueError(
                f"checkpoint: parameter {rename(name)!r} is placed {p.placements} on a {p.device_mesh.ndim}-D mesh: a fused "
                "ColwiseParallel weight (fused_chunks > 1) sharded again on dim 0 checkpoints on a 2-D (dp, tp) mesh only. "
                "Parallelize that layer with fused_chunks=1 (separate projections), or use a 2-D mesh"
            )


def _fused_chunks(value) -> int:
    """How many projections a fused `ColwiseParallel` tensor (1-D mesh, `_StridedShard(0)`) stacks; 1 otherwise."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(value, DTensor) and len(value.placements) == 1 and isinstance(value.placements[0], _StridedShard):
        if value.placements[0].dim == 0:
            return value.placements[0].split_factor
    return 1


def _dp_fused(value) -> int:
    """How many projections a fused `ColwiseParallel` tensor that FSDP2 also shards on a 2-D (dp, tp)
    mesh stacks (placed `(Shard or _StridedShard(0), _StridedShard(0))`); 1 otherwise."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(value, DTensor) or len(value.placements) != 2 or value.device_mesh.ndim != 2:
        return 1
    dp, tp = value.placements
    if isinstance(tp, _StridedShard) and tp.dim == 0 and getattr(dp, "dim", None) == 0:
        return tp.split_factor
    return 1


def _tp_local(value, chunks: int, local: torch.Tensor):
    """The TP-local tensor `local` (rows of this tp rank) as a 1-D fused DTensor on `value`'s tp sub-mesh,
    replicated over dp (DCP writes a chunk that several ranks hold once)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = value.device_mesh
    if mesh.mesh_dim_names is None:
        raise ValueError(f"checkpoint: a fused tensor placed {value.placements} on a mesh without dim names; name them")
    tp_mesh = mesh[mesh.mesh_dim_names[1]]
    placement = _StridedShard(0, split_factor=chunks)
    return DTensor.from_local(local, tp_mesh, [placement], run_check=False, shape=value.shape, stride=value.stride())


def _dp_rows(value) -> tuple[int, int, int]:
    """(TP-local rows, this dp rank's first row, its row count): FSDP2 chunks dim 0 like `torch.chunk`."""
    mesh = value.device_mesh
    rows = value.shape[0] // mesh.size(1)
    per = -(-rows // mesh.size(0))
    first = min(per * mesh.get_local_rank(0), rows)
    return rows, first, min(per, rows - first)


def _gather_dp(value, chunks: int):
    """All-gather a 2-D fused tensor's dp shards over the dp group by hand (padded to equal size), giving
    the TP-local tensor as a 1-D fused DTensor. Not `full_tensor()`/`redistribute`: their layout is wrong."""
    import torch.distributed as dist

    local = value._local_tensor
    mesh = value.device_mesh
    rows, _, count = _dp_rows(value)
    per = -(-rows // mesh.size(0))
    padded = local.new_zeros((per, *local.shape[1:]))
    padded[:count].copy_(local.detach())
    parts = [torch.empty_like(padded) for _ in range(mesh.size(0))]
    dist.all_gather(parts, padded, group=mesh.get_group(0))
    return _tp_local(value, chunks, torch.cat(parts)[:rows].contiguous())


def _stacked(value, chunks: int):
    """A fused tensor as the (chunks, N/chunks, ...) DTensor placed plainly `Shard(1)`, sharing its storage.

    DCP cannot plan `_StridedShard(0, split_factor=chunks)` (measured on torch 2.13: its planner sees
    overlapping chunks), but each rank's local rows are, per fused projection, one contiguous block, so
    the same local data is an ordinary `Shard(1)` of the stacked view. The checkpoint then holds the
    weight in its global row order, whatever the TP degree."""
    from torch.distributed.tensor import DTensor, Shard

    local = value.to_local()
    shape = torch.Size((chunks, value.shape[0] // chunks, *value.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    stacked = local.view(chunks, -1, *local.shape[1:])
    return DTensor.from_local(stacked, value.device_mesh, [Shard(1)], run_check=False, shape=shape, stride=stride)


def _entries(state: dict):
    """(path, container, key) of every tensor of a model/optimizer state dict pair, path as a string."""
    for fqn in state.get("model", {}):
        yield f"model/{fqn}", state["model"], fqn
    for fqn, per_param in state.get("optim", {}).get("state", {}).items():
        for k in per_param:
            yield f"optim/{fqn}/{k}", per_param, k


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_id: str | os.PathLike) -> None:
    """Save `model` (and `optimizer`) with DCP, sharded as they are, plus the quantization metadata.

    Call it on every rank. Example:
        >>> tq.distributed.checkpoint.save(model, optimizer, "ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp

    _check_describable(model)
    state = {"model": get_model_state_dict(model), _KEY: json.dumps(quantization_metadata(model), sort_keys=True)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    state = tree_map_only(torch.Tensor, _plain, state)
    fused = {}
    for path, container, key in _entries(state):  # the same order on every rank: the dp gathers match
        chunks, dp_chunks = _fused_chunks(container[key]), _dp_fused(container[key])
        if dp_chunks > 1:  # TP x FSDP2: gathered over dp, then stacked like the 1-D case
            chunks, container[key] = dp_chunks, _gather_dp(container[key], dp_chunks)
        if chunks > 1:
            fused[path] = chunks
            container[key] = _stacked(container[key], chunks)
    state[FUSED_CHUNKS_KEY] = json.dumps(fused, sort_keys=True)
    dcp_call(dcp.save, state, checkpoint_id)


def dcp_call(call, state: dict, checkpoint_id) -> None:
    """`dcp.save` or `dcp.load`, told `no_dist` when there is no process group. DCP then warns on
    every call that it is "assuming the intent is to save/load in a single process", even when told
    so (torch 2.13): one process is a layout `save`/`load` support, not a guess, so that note is
    dropped here, and only here."""
    one_process = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with warnings.catch_warnings():
        if one_process:
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        call(state, checkpoint_id=checkpoint_id, no_dist=one_process)


def _check(saved: dict[str, str], current: dict[str, str], checkpoint_id) -> None:
    problems = []
    for name in sorted(saved.keys() | current.keys()):
        if name not in current:
            problems.append(f"layer {name!r} is quantized in the checkpoint ({saved[name]}) but not in the model")
        elif name not in saved:
            problems.append(f"layer {name!r} is quantized in the model ({current[name]}) but not in the checkpoint")
        elif saved[name] != current[name]:
            problems.append(f"layer {name!r}: checkpoint recipe {saved[name]}, model recipe {current[name]}")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointMismatchError(
            f"checkpoint {str(checkpoint_id)!r} was saved for another quantization of this model:\n  {shown}\n"
            "Convert the model with the checkpoint's recipe (tq.convert) before loading, or load into the model it was saved from."
        )


def load(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_id: str | os.PathLike, *, strict: bool = True
) -> None:
    """Load a checkpoint written by `save` into `model` (and `optimizer`), in whatever layout they
    now have (FSDP2 on any number of ranks, or one process). Raises `CheckpointMismatchError` if
    the checkpoint's converted layers or recipes differ from the model's, before loading anything.

    Example:
        >>> tq.distributed.checkpoint.load(model, optimizer, "ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    meta = {_KEY: "", FUSED_CHUNKS_KEY: ""}
    try:
        dcp_call(dcp.load, meta, checkpoint_id)
    except Exception:  # written before fused tensors were stacked (it holds none), or not by `save`
        meta = {_KEY: ""}
        _load_metadata(meta, checkpoint_id)
        meta[FUSED_CHUNKS_KEY] = "{}"
    saved_layers, current = json.loads(meta[_KEY]), quantization_metadata(model)
    if saved_layers.keys() != current.keys():  # maybe an older checkpoint's names
        for rename in (_components_removed, _substrings_removed):
            older = _older_metadata(model, rename)
            if saved_layers.keys() == older.keys():
                current = older
                break
    _check(saved_layers, current, checkpoint_id)
    saved_fused = json.loads(meta[FUSED_CHUNKS_KEY])
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    # DCP loads into `target`, whose tensors share storage with `state`'s (views), except where a
    # fused layout differs on the two sides: then the whole tensor is read and sliced afterwards.
    target = {k: (dict(v) if k == "model" else v) for k, v in state.items()}
    if "optim" in target:
        target["optim"] = {**target["optim"], "state": {f: dict(d) for f, d in target["optim"].get("state", {}).items()}}
    gathered, dp_fused = [], []
    for path, container, key in _entries(target):
        value = container[key]
        chunks, saved = _fused_chunks(value), saved_fused.get(path, 1)
        dp_chunks = _dp_fused(value)
        if dp_chunks > 1:  # TP x FSDP2: read the TP-local rows (fused or whole), keep this dp rank's afterwards
            value = _plain(value)
            rows = torch.empty((value.shape[0] // value.device_mesh.size(1), *value.shape[1:]), dtype=value.dtype)
            tmp = _tp_local(value, dp_chunks, rows.to(value._local_tensor.device))
            if saved == dp_chunks:
                container[key] = _stacked(tmp, dp_chunks)
            else:
                container[key] = torch.empty(value.shape, dtype=value.dtype, device=tmp._local_tensor.device)
                gathered.append((tmp, container[key], dp_chunks))
            dp_fused.append((value, tmp))
        elif chunks > 1 and saved == chunks:
            container[key] = _stacked(value, chunks)
        elif chunks > 1:  # saved unfused (one process): read the whole tensor, keep this rank's rows
            container[key] = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
            gathered.append((value, container[key], chunks))
        elif saved > 1 and isinstance(value, DTensor):
            raise ValueError(
                f"checkpoint.load: {path!r} was saved from a fused ColwiseParallel layer (fused_chunks={saved}) and is "
                f"placed {value.placements} here; load it into one process or into ColwiseParallel(fused_chunks={saved})"
            )
        elif saved > 1:  # a plain tensor here: read the stacked rows into a view of it
            container[key] = _plain(value).view(saved, -1, *value.shape[1:])
    dcp_call(dcp.load, target, checkpoint_id)
    with torch.no_grad():
        for value, full, chunks in gathered:
            world, rank = value.device_mesh.size(), value.device_mesh.get_local_rank()
            rows = full.view(chunks, world, -1, *full.shape[1:])[:, rank]
            value.to_local().copy_(rows.reshape(value.to_local().shape))
        for value, tmp in dp_fused:
            _, first, count = _dp_rows(value)
            value._local_tensor.copy_(tmp._local_tensor[first : first + count])
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _load_metadata(meta: dict, checkpoint_id) -> None:
    """Load `meta`'s keys, or say the checkpoint was not written by `save`."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp_call(dcp.load, meta, checkpoint_id)
    except Exception as e:  # DCP's error for a missing key is long; say what is missing
        if _KEY in str(e) or "Missing key" in str(e):
            raise CheckpointMismatchError(
                f"checkpoint {str(checkpoint_id)!r} has no tqcompile quantization metadata; it was not written by "
                "tq.distributed.checkpoint.save (load it with torch.distributed.checkpoint directly)"
            ) from e
        raise
