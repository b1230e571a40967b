"""Hugging Face models under `torch.compile(fullgraph=True)` (aot_eager), as `tests/test_hf_newuser.py`
runs them eagerly: the token-count error of a converted layer names it, compiled as in eager mode,
and naming the layers costs no recompile.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter


def tiny_bert() -> nn.Module:
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=32,
    )
    return BertForSequenceClassification(cfg)


def _error(fn, *args, **kwargs) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs).logits.sum().backward()
    return info.value


def test_token_count_error_names_the_pooler_under_fullgraph_compile():
    torch.manual_seed(0)
    model = tq.convert(tiny_bert(), tq.recipes.mxfp8())
    ids = torch.randint(1, 64, (2, 16))  # the pooler sees 2 tokens
    want = _error(model, input_ids=ids)
    assert isinstance(want, ValueError) and str(want).startswith("linear 'bert.pooler.dense': ")
    counter = CompileCounter("aot_eager")
    got = _error(torch.compile(model, backend=counter, fullgraph=True), input_ids=ids)
    assert type(got) is ValueError, f"{type(got).__name__}: {str(got)[:300]}"
    assert str(got) == str(want)
    assert counter.graph_breaks == 0


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_layer_names_cost_no_recompile_when_blocks_compile_one_by_one():
    """Each converted layer knows its own name, but reads it only to format an error: read on every
    call, the name was a constant Dynamo guards on, and each block after the first recompiled (measured:
    4 blocks, 3 recompiles)."""
    torch.manual_seed(0)
    model = tq.convert(nn.Sequential(*(Block() for _ in range(4))), tq.recipes.mxfp8())
    assert [b.fc1.tq_fqn for b in model] == ["0.fc1", "1.fc1", "2.fc1", "3.fc1"]
    counter = CompileCounter("aot_eager")
    for block in model:
        block.compile(backend=counter, fullgraph=True)
    for _ in range(2):
        model(torch.randn(64, 64, requires_grad=True)).sum().backward()
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter
    # A bad token count in block 2 still names block 2's layer (the error graph reads the name).
    with pytest.raises(ValueError, match=r"^linear '2.fc1': .*\(33 tokens = batch x sequence\)"):
        model[2](torch.randn(33, 64, requires_grad=True))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_blockwise"])
def test_inference_under_no_grad_takes_any_token_count_compiled(recipe):
    """Under no_grad only fprop runs (blocked along the features): 65 tokens compile and run, and
    match eager bit for bit; with grad mode on the compiled call raises as eager does."""
    torch.manual_seed(0)
    layer = tq.nn.Linear(128, 128, recipe=tq.recipes.get(recipe))
    x = torch.randn(5, 13, 128)  # 65 tokens: a multiple of no block
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    assert counter.graph_breaks == 0
    with pytest.raises(ValueError, match=r"\(65 tokens = batch x sequence\)"):
        compiled(x)
