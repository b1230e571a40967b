"""What the serving engines do with a quantized checkpoint, where tq must match it: the facts that
calibration and export both consult, read from the engines' loaders (vLLM 0.32, TensorRT-LLM).

- **Fused GEMMs.** vLLM and TensorRT-LLM load some sibling linear layers as one GEMM (vLLM's
  `packed_modules_mapping`): q/k/v, gate/up and the other families of `FUSED_SIBLINGS`, by the
  leaf names of their modules under one parent. The fused GEMM has one scheme: a checkpoint whose
  siblings are quantized differently is refused ("different quantization schemes for the
  shards"), and for NVFP4 one global scale, so calibration gives such siblings one weight amax
  (`tqcompile.calibration.fused`) and export warns where they differ (`fused_sibling_groups`).
- **MoE experts** run as one fused MoE with one scheme for gate, up and down.
- **The LM head** is built as a vocabulary-parallel embedding, not a linear layer
  (`builds_as_linear`): a format that targets layers by class must name a quantized head.

This module imports nothing of tqcompile, so every layer can ask it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FUSED_SIBLINGS", "fused_family", "fused_sibling_groups", "builds_as_linear"]

# Weights an engine fuses into one GEMM (vLLM's `packed_modules_mapping`: Llama-style, DeepSeek
# MLA, BERT, torchtitan), by the leaf name of their modules under one parent.
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("query", "key", "value"),
    ("wq", "wk", "wv"),
)


def fused_family(leaf: str) -> tuple[str, ...] | None:
    """The first `FUSED_SIBLINGS` family holding the leaf name `leaf`, or None: the family that
    one fused GEMM of the model serves it in (k_proj: q/k/v, where a q_proj is beside it)."""
    return next((f for f in FUSED_SIBLINGS if leaf in f), None)


def fused_sibling_groups(names: Iterable[str]) -> list[list[str]]:
    """Every group of `names` (canonical module names) that an engine may load as one GEMM: for each
    name leading a `FUSED_SIBLINGS` family (its first leaf), the members of that family present under
    the same parent, where there are two or more; in the order of `names`. Families overlap (q/k/v
    and k/v), so a name may be in two groups."""
    present = list(names)
    have = set(present)
    groups = []
    for name in present:
        parent, _, leaf = name.rpartition(".")
        for family in (f for f in FUSED_SIBLINGS if leaf == f[0]):
            members = [m for m in (f"{parent}.{x}" if parent else x for x in family) if m in have]
            if len(members) > 1:
                groups.append(members)
    return groups


def builds_as_linear(name: str) -> bool:
    """Whether the engines build the quantized layer `name` as a linear layer: all but the LM head
    (``lm_head``), which they build as a vocabulary-parallel embedding."""
    return name.rpartition(".")[2] != "lm_head"
