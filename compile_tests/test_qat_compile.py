"""A compiled QAT step: no graph break, and equal to eager bit for bit (the compiled side of tests/test_qat.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.testing import CompileCounter, assert_bitwise_equal


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 32, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        h = F.relu(self.conv(x)).mean(-1)
        return self.fc2(self.norm(F.relu(self.fc1(h))))


@pytest.mark.parametrize("config", ["int8", "nvfp4"])
def test_compiled_qat_step_has_no_graph_break_and_equals_eager(config):
    torch.manual_seed(0)
    model = Net()
    data = [torch.randn(4, 16, 16) for _ in range(2)]
    tq.calibrate(model, getattr(tq.configs, config)(), lambda m: [m(x) for x in data], progress=False)
    eager = Net()
    eager.load_state_dict(model.state_dict())
    tq.restore(eager, tq.quant_state(model))
    torch.compiler.reset()  # Net.forward compiled by the other parameter would count as a recompile
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(2):
        x, target = torch.randn(4, 16, 16), torch.randn(4, 16)
        loss_c = F.mse_loss(compiled(x), target)
        loss_e = F.mse_loss(eager(x), target)
        loss_c.backward()
        loss_e.backward()
        assert_bitwise_equal(loss_c.detach(), loss_e.detach())
        for p, pe in zip(model.parameters(), eager.parameters()):
            assert_bitwise_equal(p.grad, pe.grad)
        with torch.no_grad():
            for p, pe in zip(model.parameters(), eager.parameters()):
                p -= 0.01 * p.grad
                pe -= 0.01 * pe.grad
                p.grad = pe.grad = None
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0)
