"""tq.calibration.weight_only around a compiled model: fullgraph, no graph break, one recompile
for the weight-only graph and none after it, however often the block is entered (Dynamo guards on
each quantizer: leaving the block finds the first graph again), and each graph equal to eager bit
for bit. The eager side: tests/test_weight_only.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tqcompile as tq
from tqcompile.testing import CompileCounter, assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_models import tiny_hf_moe  # noqa: E402

pytest.importorskip("transformers")


def test_weight_only_around_a_compiled_moe_model_compiles_once_per_view():
    # Mixtral: Linear units and the experts' grouped GEMMs; bf16 (the experts' grouped_mm refuses fp32 under compile).
    model = tiny_hf_moe("mixtral", layers=1, use_cache=False).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    tq.calibrate(model, tq.configs.fp8(), lambda m: m(ids), progress=False)
    with torch.no_grad():
        eager = model(ids).logits
        with tq.calibration.weight_only(model):
            eager_weight_only = model(ids).logits
    assert not torch.equal(eager, eager_weight_only)

    counter = CompileCounter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for target in (model, compiled, compiled):  # either handle switches the same quantizers
            assert_bitwise_equal(compiled(ids).logits, eager)
            with tq.calibration.weight_only(target):
                assert_bitwise_equal(compiled(ids).logits, eager_weight_only)
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (2, 1, 0), counter.break_reasons
