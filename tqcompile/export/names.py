"""Where each of a model's tensors goes in an exported checkpoint.

For a Hugging Face model, the names (and splits) are the ones its own `save_pretrained` writes:
transformers 5 holds MoE experts fused in memory (``mlp.experts.gate_up_proj``, (E, 2I, H)) but
saves them per expert under the names the engines load (Mixtral's
``block_sparse_moe.experts.3.w1.weight``, Qwen3-MoE's ``mlp.experts.3.gate_proj.weight``). We ask
transformers itself (`revert_weight_conversion`) by handing it *probe* tensors whose entries are
the row numbers of the real ones: what comes back names each output tensor and says which expert
and which rows of ours it holds, so quantized payloads and their scales are split exactly as the
float weight would be. Any other model keeps its `state_dict` names, experts stacked.

Model tensors are named canonically (`tqcompile.surgery.names`): a wrapped model (DDP,
torch.compile) is asked through the model inside, whose keys those are.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
from torch import nn

from tqcompile.surgery.names import unwrap

__all__ = ["Placement", "placements", "put_placed", "is_hf_model", "hf_model_from_config"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """One output tensor made from a model tensor: its name in the checkpoint, the expert it
    holds (None: all, or not an experts tensor) and the rows it holds (None: all)."""

    name: str
    expert: int | None = None
    rows: torch.Tensor | None = None


def is_hf_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel`, wrapped or not (imported only if transformers is)."""
    import sys

    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(unwrap(model), tf.PreTrainedModel)


def hf_model_from_config(config, **kwargs) -> nn.Module:
    """The model of a transformers config: the class its `architectures` names (a multimodal
    model's ``*ForConditionalGeneration``, which AutoModelForCausalLM refuses), else
    AutoModelForCausalLM's."""
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls._from_config(config, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs)


def _rows(shape: torch.Size) -> int:
    """Entries of a probe: one per weight row (per expert row for 3-D), one per element of any other
    tensor (below 2-D, or above 3-D: MiniMax's 4-D attention buffers failed the export)."""
    if len(shape) in (2, 3):
        return shape[0] * (shape[1] if len(shape) == 3 else 1)
    return max(1, torch.Size(shape).numel())


def _probe(shape: torch.Size, base: int) -> torch.Tensor:
    n = _rows(shape)
    ids = torch.arange(base, base + n, dtype=torch.float64)
    if len(shape) == 3:
        return ids.reshape(shape[0], shape[1], 1)
    if len(shape) == 2:
        return ids.reshape(-1, 1)
    return ids[: torch.Size(shape).numel()].reshape(shape)


def placements(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, list[Placement]]:
    """{canonical state_dict key: its output tensors} for the keys in `shapes` (see the module docstring)."""
    model = unwrap(model)
    if not is_hf_model(model):
        return {k: [Placement(k)] for k in shapes}
    from transformers.core_model_loading import revert_weight_conversion

    # Every key's probe holds its own range of ids (exact in float64), so each output tensor's
    # first entry says which key it came from, and the rest which expert and rows.
    # A tensor with no elements has no entries to trace: it keeps its name.
    out: dict[str, list[Placement]] = {k: [Placement(k)] for k, s in shapes.items() if torch.Size(s).numel() == 0}
    keys, bases, probes, base = [k for k in shapes if k not in out], [], {}, 0
    for k in keys:
        bases.append(base)
        probes[k] = _probe(shapes[k], base)
        base += _rows(shapes[k])
    back = revert_weight_conversion(model, dict(probes))
    out.update({k: [] for k in keys})
    for name, t in back.items():
        ids = t.reshape(-1).to(torch.int64)
        i = max(0, bisect.bisect_right(bases, int(ids[0])) - 1)
        src, shape = keys[i], shapes[keys[i]]
        local = ids - bases[i]
        if len(shape) < 2 or t.dim() == len(shape) and tuple(t.shape[:-1]) == tuple(shape[:-1]):
            out[src].append(Placement(name))  # renamed, whole
        elif len(shape) == 3:
            r = shape[1]
            expert = int(local[0]) // r
            if not bool((local // r == expert).all()):
                raise ValueError(f"tq.export: transformers writes {name!r} from several experts of {src!r}; cannot place it")
            out[src].append(Placement(name, expert, local - expert * r))
        else:
            full = local.numel() == shape[0] and bool((local == torch.arange(shape[0])).all())
            out[src].append(Placement(name, None, None if full else local))
    return out


def put_placed(dst: torch.Tensor, src: torch.Tensor, p: Placement, experts: bool, block: int, mismatch: list[str], what: str) -> None:
    """Write `src` where placement `p` took it from (the inverse of the export's `_split`):
    expert `p.expert`, rows `p.rows` (`block` > 1: one entry per `block` rows)."""
    d = dst[p.expert] if experts and p.expert is not None else dst
    rows = p.rows if p.rows is not None and d.dim() > 0 else None
    if rows is not None and block > 1:
        first, n = int(rows[0]), rows.numel()
        if first % block or n % block:
            mismatch.append(f"{what}: rows {first}..{first + n} do not align with {block}-row scale blocks")
            return
        rows = torch.arange(first // block, (first + n) // block)
    shape = tuple(d.shape) if rows is None else (rows.numel(), *d.shape[1:])
    if shape != tuple(src.shape):
        mismatch.append(f"{what}: checkpoint {tuple(src.shape)}, model {shape}")
    elif rows is None:
        d.copy_(src)
    else:
        d[rows.to(d.device)] = src.to(d.device, d.dtype)  # (a model made on a GPU: `load_exported(..., device=)`)
