"""QAT on the models of tests/test_ptq_newuser.py (which they never saw while being written): it
learns, and compiles to one graph without breaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ptq_newuser import batches, build

import tqcompile as tq
from tqcompile.testing import CompileCounter


@pytest.mark.parametrize("kind", ["cnn", "lm", "moe"])
def test_unseen_models_qat_learns_and_compiles_without_breaks(kind):
    model = build(kind)
    x = batches(kind, 1, 1)[0]
    tq.calibrate(model, tq.configs.fp8(), lambda m: m(x), progress=False)
    model.train()
    with torch.no_grad():
        target = torch.randn_like(model(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    losses = []
    for step in range(6):
        opt.zero_grad()
        loss = F.mse_loss((model if step < 3 else compiled)(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0)
    if kind == "lm":
        assert model.lm_head.weight is model.emb.weight  # tying survives conversion and training
