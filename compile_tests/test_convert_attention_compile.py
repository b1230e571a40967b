"""Converted nn.MultiheadAttention and TransformerEncoderLayer compiled with fullgraph=True equal
eager bit for bit, in training and in inference: the compiled side of tests/test_convert_attention.py."""

from __future__ import annotations

import torch
from test_convert_attention import RECIPE, E, H
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal


def test_compiled_mha_and_encoder_layer_equal_eager_without_graph_breaks():
    torch.manual_seed(0)
    mha = tq.convert(nn.MultiheadAttention(E, H, kdim=40, vdim=40, add_bias_kv=True, batch_first=True), RECIPE)
    layer = tq.convert(nn.TransformerEncoderLayer(E, H, 128, dropout=0.0, batch_first=True), RECIPE)
    q, kv = torch.randn(2, 16, E, requires_grad=True), torch.randn(2, 24, 40)
    kpm = torch.zeros(2, 24, dtype=torch.bool)
    kpm[1, -4:] = True
    src = torch.randn(2, 16, E, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(16)

    def step(mha, layer):
        out, weights = mha(q, kv, kv, key_padding_mask=kpm)
        y = layer(src, src_mask=mask, is_causal=True)
        (out.square().mean() + weights.sum() + y.square().mean()).backward()
        return out, weights, y

    counter = CompileCounter("aot_eager")
    compiled = step(torch.compile(mha, backend=counter, fullgraph=True), torch.compile(layer, backend=counter, fullgraph=True))
    grads = [p.grad.clone() for p in (*mha.parameters(), *layer.parameters(), q, src)]
    for p in (*mha.parameters(), *layer.parameters(), q, src):
        p.grad = None
    eager = step(mha, layer)
    assert counter.frame_count == 2 and counter.graph_breaks == 0 and counter.recompiles == 0
    assert_bitwise_equal(compiled, eager)
    assert_bitwise_equal(grads, [p.grad for p in (*mha.parameters(), *layer.parameters(), q, src)])
    # Inference (eval + no_grad, where the float encoder layer takes its fused fast path) compiles too.
    layer.eval()
    with torch.no_grad():
        inference = torch.compile(layer, backend=counter, fullgraph=True)(src, src_key_padding_mask=kpm[:, :16])
        assert_bitwise_equal(inference, layer(src, src_key_padding_mask=kpm[:, :16]))
    assert counter.graph_breaks == 0
