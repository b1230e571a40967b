"""`torch.export` of quantized models: an ExportedProgram that `torch.export.save` and `load` round-trip.

Why a pass and not a method on the quantizer (torch 2.13, read in torch/_export/serde/serialize.py
and torch/export/pt2_archive/_package.py): a quantizer is a *value* opaque type, so export bakes it
into the graph as a literal argument of our ops, like an int. The graph serializer puts each such
literal in a side table under a made-up name (`_custom_obj_0`, ...), but `torch.export.save`
writes only `ExportedProgram.constants` into the archive (it serializes the graph with
`serialize_constants=False`) and drops that table, so `torch.export.load` fails with
`KeyError: '_custom_obj_0'`. Nothing on that path asks the object anything (no `__fx_repr__`,
`__reduce__` or `__obj_flatten__` call), so no method of ours can fix it.

What the archive does store are opaque objects in `ExportedProgram.constants`: it pickles them
(torch 2.13; pytorch PR #181676, April 2026). `lift_quantizers` moves each distinct value into
`constants`, as a custom-object input of the graph (the form export itself gives *reference*
opaque objects), and the plain torch calls then round-trip. Older archives (the pt2 writer before
that PR, so torch 2.11 by its date; not run here) refuse any constant that is neither a tensor nor
a TorchScript object, and `lift_quantizers` says so instead of producing a file that cannot load.
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import CustomObjArgument, InputKind, InputSpec
from torch.utils import _pytree as pytree

from tqcompile import _opaque
from tqcompile.distributed.fsdp import QuantizedWeight

__all__ = ["lift_quantizers"]


def _archive_stores_opaque_objects() -> bool:
    # The pt2 writer that pickles opaque constants names their files with this prefix; a torch
    # without it raises "Unsupported constant type" on save (see the module docstring).
    try:
        from torch.export.pt2_archive import constants
    except ImportError:
        return False
    return hasattr(constants, "OPAQUE_OBJ_FILENAME_PREFIX") and _opaque.CAN_TELL_VALUE_TYPES


def _is_lifted(value: object) -> bool:
    return _opaque.is_value_type(type(value))


def _refuse_nested_graphs(gm: torch.fx.GraphModule) -> None:
    """Values inside a higher-order op's subgraph (torch.cond, a wrapped grad mode) cannot become
    inputs of the top graph: refuse rather than write a file that fails to load."""
    for name, sub in gm.named_modules():
        if sub is gm or not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            found = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _is_lifted(a)]
            if found:
                raise ValueError(
                    f"lift_quantizers: node {node.name!r} of the subgraph {name!r} takes {found[0]!r}; only the top "
                    "graph's quantizers can be lifted. A grad-mode change inside forward (torch.no_grad()) exports as a "
                    "subgraph that program.run_decompositions() inlines: lift its result. torch.cond cannot be lifted."
                )


def _plain_parameters(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """The state dict with each `QuantizedWeight` (FSDP2's quantized-gather wrapper) replaced by
    the high-precision tensor it holds, as a Parameter. The wrapper passes every op through to
    that tensor, so the graph already reads it as that tensor; but ExportedProgram's own check
    refuses a parameter that is no `nn.Parameter`. (A QuantizedTensor parameter or buffer, real
    quantized weights, is stored and reloaded as it is.)"""
    state = dict(program.state_dict)
    for fqn, value in state.items():
        if isinstance(value, QuantizedWeight):
            (inner,), _ = value.__tensor_flatten__()
            state[fqn] = torch.nn.Parameter(getattr(value, inner).detach(), requires_grad=value.requires_grad)
    return state


def lift_quantizers(program: ExportedProgram) -> ExportedProgram:
    """A copy of `program` that `torch.export.save` / `torch.export.load` round-trip.

    Each distinct value-type opaque argument of the graph's ops (quantizers, recipes, enums) becomes
    one custom-object constant (`program.constants["lifted_IntQuantizer_0"]`, ...) read by a graph
    input; the ops, their other arguments and the results are unchanged. A `QuantizedWeight`
    parameter (from `tq.convert(..., fsdp_quantized_all_gather=True)`) becomes the high-precision
    Parameter it holds. Needs a torch whose `torch.export.save` stores opaque objects (2.13);
    raises a RuntimeError naming the version otherwise. `import tqcompile` before `torch.export.load`.

    Example:
        >>> ep = tq.lift_quantizers(torch.export.export(model, (x,)))
        >>> torch.export.save(ep, "model.pt2")
        >>> torch.export.load("model.pt2").module()(x)
    """
    if not isinstance(program, ExportedProgram):
        raise TypeError(f"lift_quantizers: program is a {type(program).__name__}; allowed: a torch.export.ExportedProgram")
    if not _archive_stores_opaque_objects():
        raise RuntimeError(
            f"lift_quantizers: torch.export.save of torch {torch.__version__} stores only tensors and TorchScript objects "
            "as constants, so a quantizer cannot be saved; needs torch >= 2.13. The ExportedProgram itself runs "
            "(program.module()) on this torch."
        )
    old = program.graph_module
    gm = copy.deepcopy(old)
    # deepcopy renames nodes that shadow Python builtins (a forward(input) gives `input_1`), which
    # the signature still names; export keeps the original names, and so do we.
    for a, b in zip(old.graph.nodes, gm.graph.nodes):
        b.name = a.name
    _refuse_nested_graphs(gm)
    signature = copy.deepcopy(program.graph_signature)
    constants = dict(program.constants)

    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = signature.input_specs
    # Custom-object inputs go after the lifted state and before the user's inputs, like export's own.
    at = next((i for i, s in enumerate(specs) if s.kind is InputKind.USER_INPUT), len(specs))
    anchor = placeholders[at] if at < len(placeholders) else next(n for n in graph.nodes if n.op != "placeholder")
    taken = {n.name for n in graph.nodes} | set(constants) | {s.target for s in specs if s.target}
    lifted: dict[object, torch.fx.Node] = {}

    def lift(value: object) -> object:
        if not _is_lifted(value):
            return value
        if value not in lifted:
            name = f"lifted_{type(value).__name__}_{len(lifted)}"
            while name in taken:
                name += "_"
            taken.add(name)
            class_fqn = _opaque.value_type_name(type(value))
            with graph.inserting_before(anchor):
                node = graph.placeholder(name)
            node.meta["val"] = CustomObjArgument(name=name, class_fqn=class_fqn)
            specs.insert(at + len(lifted), InputSpec(InputKind.CUSTOM_OBJ, CustomObjArgument(node.name, class_fqn), name))
            constants[name] = value
            lifted[value] = node
        return lifted[value]

    for node in graph.nodes:
        if node.op == "call_function":
            node.args = pytree.tree_map(lift, node.args)
            node.kwargs = pytree.tree_map(lift, node.kwargs)
    gm.recompile()
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=_plain_parameters(program),
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )
