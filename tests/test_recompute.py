"""`tq.distributed.recompute_in_backward` and the structural detection of activation checkpointing
that decides what FSDP2's backward all-gather brings (the multi-process behaviour is in
tests/distributed/test_fsdp_recompute_gloo.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import tqcompile as tq
from tqcompile.distributed.recompute import will_recompute_forward


def _blocks() -> nn.Sequential:
    block = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return tq.convert(nn.Sequential(block, nn.Sequential(nn.Linear(32, 32))), tq.recipes.mxfp8())


def test_checkpoint_wrappers_on_the_path_are_found():
    model = _blocks()
    fc1 = model[0][0]
    assert not will_recompute_forward(fc1, [model])
    model[0] = checkpoint_wrapper(model[0])
    assert will_recompute_forward(fc1, [model]), "a CheckpointWrapper between the FSDP module and the layer"
    assert will_recompute_forward(fc1, [model[0]]), "the FSDP module itself wrapped"
    assert not will_recompute_forward(model[1][0], [model]), "a layer beside the wrapper is not recomputed"
    assert not will_recompute_forward(fc1, [model[1]]), "a layer outside the FSDP module"

    compiled = _blocks()
    fc1 = compiled[0][0]
    compiled[0] = torch.compile(checkpoint_wrapper(compiled[0]), backend="aot_eager")  # torchtitan order; not run
    assert will_recompute_forward(fc1, [compiled[0]]), "looked through torch.compile's _orig_mod"

    composable = _blocks()
    composable_checkpoint(composable[0][2])
    assert will_recompute_forward(composable[0][2], [composable]), "the composable checkpoint on the layer"
    assert not will_recompute_forward(composable[0][0], [composable])


def test_recompute_in_backward_marks_converted_layers():
    model = _blocks()
    assert tq.distributed.recompute_in_backward(model[0]) == 2
    assert will_recompute_forward(model[0][0], []) and will_recompute_forward(model[0][2], [])
    assert not will_recompute_forward(model[1][0], [model])
    assert tq.distributed.recompute_in_backward(model[0], enabled=False) == 2
    assert not will_recompute_forward(model[0][0], [model])


def test_recompute_in_backward_bad_input():
    with pytest.raises(ValueError, match=r"Sequential holds no layer converted by tq.convert; call it after tq.convert"):
        tq.distributed.recompute_in_backward(nn.Sequential(nn.Linear(8, 8)))
    with pytest.raises(TypeError, match="module must be an nn.Module, got Tensor"):
        tq.distributed.recompute_in_backward(torch.zeros(2))
