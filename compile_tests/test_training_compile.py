"""Full training steps of the demo GPT under `torch.compile(fullgraph=True)`, for every recipe.

`test_training_step_compiles_fullgraph`: the compiled model's forward and loss under bf16
autocast with its AOTAutograd-compiled backward, and an eager AdamW step. For each recipe: zero
graph breaks, one graph and no recompile over all steps (the optimizer changing the weights in
place must not invalidate a guard), a loss that goes down when fitting one fixed batch, and
losses equal to the same steps run eagerly (aot_eager: bit for bit; inductor: the first loss,
within bf16 rounding). `test_whole_training_step_fullgraph_with_compiled_optimizer`: the same with
the AdamW step compiled too (`tq.optim.compile_optimizer_step`), as `tqcompile demo` runs it.

Cost on a 2-core CPU: one aot_eager compile per recipe of a 1-layer model on 128 tokens, plus
two inductor compiles (the code inductor generates around the custom ops) and one MoE compile.
"""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile.demo.model import GPT, GPTConfig, quantize_model
from tqcompile.testing.compile import CompileCounter

TINY = GPTConfig(n_layer=1, d_model=128, n_head=4, mlp_hidden=512, seq_len=128)
# 128 tokens per step (1 x 128): the smallest count every recipe's blocks divide.
BATCH = 1
STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small tensors: one thread is as fast on an idle 2-core machine, and on a busy one OpenMP's
    # waiting threads made 2-thread steps many times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(cfg: GPTConfig, recipe: tq.Recipe | None) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    return model if recipe is None else quantize_model(model, recipe)


def _data(cfg: GPTConfig, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: GPT, forward, cfg: GPTConfig, steps: int = STEPS, device: str = "cpu") -> list[float]:
    """`steps` AdamW steps on one fixed batch; reseeds torch's generator first, because NVFP4's
    stochastic rounding draws its seeds there and eager and compiled runs must draw the same."""
    x, y = _data(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _check_compiled_training(recipe: tq.Recipe, backend: str, cfg: GPTConfig = TINY) -> None:
    model = _model(cfg, recipe)
    counter = CompileCounter(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    losses = _train(model, compiled, cfg)

    assert counter.graph_breaks == 0, counter.break_reasons
    # One graph from step 1 on: any later (re)compile would add a graph.
    assert counter.frame_count == 1 and counter.recompiles == 0, counter
    # Fitting one batch at lr 3e-3: a working forward/backward/step lowers the loss at once.
    assert losses[-1] < losses[0] - 0.1, losses

    eager_model = _model(cfg, recipe)
    eager_losses = _train(eager_model, eager_model, cfg)
    if backend == "aot_eager":
        # aot_eager runs the same kernels as eager (the custom ops', and aten's for the rest of the
        # graph, with autocast's casts made explicit): every loss must be equal, bit for bit.
        assert losses == eager_losses
    else:
        # Inductor generates its own code for the bf16/fp32 element-wise work between the GEMMs
        # (norms, GELU, softmax, the loss), keeping fused intermediates in fp32 where eager rounds
        # them to bf16; the first loss (before any weight update) may differ by bf16's unit
        # roundoff, 2**-8, relative. Later losses are not compared: Adam's first updates are
        # about lr * sign(grad), so a rounding difference in a near-zero gradient flips a step.
        torch.testing.assert_close(losses[0], eager_losses[0], rtol=2.0**-8, atol=0.0)


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_training_step_compiles_fullgraph(name: str) -> None:
    _check_compiled_training(tq.recipes.get(name), "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8_tensorwise", "mxfp8"])
def test_training_step_compiles_with_inductor(name: str) -> None:
    _check_compiled_training(tq.recipes.get(name), "inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs it)")
@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_training_step_compiles_with_inductor_on_cuda(name: str) -> None:
    """On CUDA (the Triton quantize kernels, `torch._scaled_mm` for FP8 per tensor / per row): one
    graph, no break or recompile, the loss goes down, and the first loss equals the CPU's eager one
    within bf16's unit roundoff (the same quantized values: the Triton kernels equal the reference
    bit for bit; the GEMMs and element-wise work sum and round in other orders)."""
    torch._dynamo.reset()  # an earlier test in the process compiled the same forward: not a recompile here
    model = _model(TINY, tq.recipes.get(name)).to("cuda")
    counter = CompileCounter("inductor")
    losses = _train(model, torch.compile(model, backend=counter, fullgraph=True), TINY, device="cuda")
    assert counter.graph_breaks == 0, counter.break_reasons
    assert counter.frame_count == 1 and counter.recompiles == 0, counter
    assert losses[-1] < losses[0] - 0.1, losses
    cpu_model = _model(TINY, tq.recipes.get(name))
    torch.testing.assert_close(losses[0], _train(cpu_model, cpu_model, TINY, steps=1)[0], rtol=2.0**-8, atol=0.0)


def test_moe_training_step_compiles_fullgraph() -> None:
    # 4 experts, capacity factor 2: each expert takes 64 of the 128 tokens, two MX blocks of 32.
    cfg = GPTConfig(n_layer=1, d_model=128, n_head=4, mlp_hidden=512, seq_len=128, n_experts=4)
    model = _model(cfg, tq.recipes.mxfp8())
    assert isinstance(model.blocks[0].mlp.w_in, tq.nn.GroupedLinear)
    assert not isinstance(model.blocks[0].mlp.router, tq.nn.Linear)
    _check_compiled_training(tq.recipes.mxfp8(), "aot_eager", cfg)


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_whole_training_step_fullgraph_with_compiled_optimizer(name: str) -> None:
    """Forward, backward *and* the AdamW step under `fullgraph=True` (the step through
    `tq.optim.compile_optimizer_step`, since torch.optim's own wrapper breaks the graph on
    purpose): two graphs, no break, no recompile over all steps, and the loss goes down.
    Losses are not compared with eager here: AOTAutograd decomposes AdamW's foreach ops, which
    rounds differently from eager's fused kernels."""
    model = _model(TINY, tq.recipes.get(name))
    counter = CompileCounter("aot_eager")
    forward = torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3))
    step = tq.optim.compile_optimizer_step(opt, backend=counter, fullgraph=True)
    x, y = _data(TINY)
    torch.manual_seed(2)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert counter.graph_breaks == 0, counter.break_reasons
    assert counter.frame_count == 2 and counter.recompiles == 0, counter
    assert losses[-1] < losses[0] - 0.1, losses
