"""What must hold before a model is changed, checked in one place for `tq.convert`,
`tq.calibrate`, `tq.restore` and `tq.export`: its layers are not sharded yet, its tensors hold
values (not meta), and which of its modules compute with a child's weight without calling the
child (a quantizer put on that child would never run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from torch import nn

from tqcompile.surgery.names import canonical_modules

__all__ = ["check_not_sharded", "check_not_meta", "register_weight_reader", "weight_reads", "WeightReads"]


def check_not_sharded(who: str, what: str, name: str, module: nn.Module, fix: str) -> None:
    """Refuse a module whose own parameters fully_shard or parallelize_module already made DTensors,
    naming the first one, before anything is changed.

    Converting, calibrating or restoring a sharded layer failed far from the cause: FSDP2's lazy
    init raised "'QuantizedWeight' object has no attribute '_local_tensor'" at the first forward,
    DTensor dispatch "got mixed torch.Tensor and DTensor", torch's TP styles have no sharding rule
    for the tqcompile ops, and amaxes taken from shards are not the whole weight's. `fix`: the
    supported order (the unsharded model first, then shard)."""
    from torch.distributed.tensor import DTensor

    for p_name, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"{who}: {what} {name!r} is already sharded: its {p_name} is a DTensor with placements "
                f"{tuple(param.placements)} (made by fully_shard or parallelize_module). {fix}"
            )


def check_not_meta(model: nn.Module, who: str, fix: str) -> None:
    """Refuse a model with a parameter or buffer on the meta device (shapes, no values), naming the
    first one: a meta tensor fails far from the cause ("Tensor.item() cannot be called on meta
    tensors"). `fix`: what to do instead."""
    for name, module in canonical_modules(model):
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is not None and t.is_meta:
                    full = f"{name}.{key}" if name else key
                    if _offloaded(module):
                        raise ValueError(
                            f"{who}: {kind} {full!r} is offloaded by accelerate (a device_map that put weights on the CPU or disk "
                            "keeps their values outside the module, which holds a meta placeholder); load the model onto one "
                            "device without offloading, or quantize the checkpoint one weight at a time: "
                            "tq.quantize_checkpoint(path, out, config) (docs/ptq.md)"
                        )
                    raise ValueError(
                        f"{who}: {kind} {full!r} is on the meta device (a shape without values: the model was built under "
                        f"torch.device('meta') or loaded with device_map='meta'); {fix}"
                    )


def _offloaded(module: nn.Module) -> bool:
    """Whether accelerate's hook offloads the module's weights (`device_map` with CPU or disk offload:
    its AlignDevicesHook, alone or in a SequentialHook, has ``offload`` set)."""
    hook = getattr(module, "_hf_hook", None)
    return any(getattr(h, "offload", False) for h in (hook, *getattr(hook, "hooks", ())) if h is not None)


@dataclasses.dataclass(frozen=True)
class WeightReads:
    """A class of modules whose own forward computes with some children's weights instead of
    calling those children.

    `children(module)`: {child name: where the module reads that child's weight}. `always`: the
    module never calls those children (`nn.MultiheadAttention` and its ``out_proj``); False: only on
    some path (`nn.TransformerEncoderLayer`'s inference fast path), which a converter can turn off.
    `advice`: what a user can do instead, where no converter replaces the reads."""

    cls: type
    children: Callable[[nn.Module], dict[str, str]]
    always: bool = True
    advice: str = ""

    def runs_own_forward(self, module: nn.Module) -> bool:
        """Whether `module` runs the registered class's forward (a subclass overriding it may read anything)."""
        return type(module).forward is self.cls.forward


_READERS: dict[type, WeightReads] = {}


def register_weight_reader(
    cls: type, children: Callable[[nn.Module], dict[str, str]], *, always: bool = True, advice: str = ""
) -> None:
    """Record that modules of `cls` (and its subclasses) compute with the weights of the children
    `children(module)` names, as {child name: where}, instead of calling them (see `WeightReads`)."""
    _READERS[cls] = WeightReads(cls, children, always, advice)


def _reads_of(module: nn.Module) -> WeightReads | None:
    for cls in type(module).__mro__:
        if cls in _READERS:
            return _READERS[cls]
    return None


def weight_reads(modules: dict[str, nn.Module]) -> Iterator[tuple[str, nn.Module, WeightReads]]:
    """(name, module, its `WeightReads`) of every module of `modules` ({name: module}) registered as reading children's weights."""
    for name, module in modules.items():
        reads = _reads_of(module)
        if reads is not None:
            yield name, module, reads


# torch's own readers (see tqcompile.nn.attention, whose converters replace these reads).
register_weight_reader(
    nn.MultiheadAttention,
    lambda m: {"out_proj": "nn.MultiheadAttention.forward reads out_proj.weight (F.multi_head_attention_forward)"},
    advice="build the attention from nn.Linear projections to quantize it",
)
register_weight_reader(
    nn.TransformerEncoderLayer,
    lambda m: dict.fromkeys(
        ("self_attn", "linear1", "linear2"),
        "its inference fast path (eval() under no_grad) passes it to torch._transformer_encoder_layer_fwd",
    ),
    always=False,
)
