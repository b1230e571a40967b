"""A layer `tq.convert` reports converted runs its GEMMs quantized: counted, per layer, in training
and in inference (eval + no_grad, where torch's transformer layers take fused fast paths).

A TorchDispatchMode sees every op that runs, custom ops included: it counts the quantized GEMMs
(`tqcompile::gemm_tn`) that run inside each module's forward, and records every float GEMM that
reads a converted layer's weight (which would mean that layer's GEMM ran in high precision).
Modules are tracked with *global* forward hooks: hooks on the modules themselves would turn
TransformerEncoderLayer's fast path off and hide the very thing this checks.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tqcompile as tq
from tqcompile.demo.model import GPT, GPTConfig, is_quantized_layer, quantize_model

aten = torch.ops.aten
# Every aten op a float linear, attention or fused transformer layer can reach its weight through.
FLOAT_GEMMS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.addbmm.default,
    aten.mv.default,
    aten.addmv.default,
    aten._addmm_activation.default,
    aten._native_multi_head_attention.default,
    aten._transformer_encoder_layer_fwd.default,
}
WEIGHT_NAMES = ("weight", "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


class GemmCounter(TorchDispatchMode):
    """Counts `tqcompile::gemm_tn` calls per running module; records float GEMMs on converted weights."""

    def __init__(self, model: nn.Module, converted: list[str]):
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        modules = dict(model.named_modules())
        self.weights = {}  # storage address -> "layer.weight"
        for name in converted:
            for w in WEIGHT_NAMES:
                t = getattr(modules[name], w, None)
                if isinstance(t, torch.Tensor):
                    self.weights[t.untyped_storage().data_ptr()] = f"{name}.{w}"
        self.stack: list[str] = []
        self.calls: collections.Counter[str] = collections.Counter()
        self.quantized: collections.Counter[str] = collections.Counter()  # gemm_tn calls inside each module's forward
        self.quantized_total = 0
        self.float_reads: list[tuple[str, str]] = []

    def __enter__(self):
        def pre(module, args):
            name = self.names.get(id(module))
            if name is not None:
                self.stack.append(name)
                self.calls[name] += 1

        def post(module, args, out):
            if self.names.get(id(module)) is not None:
                self.stack.pop()

        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.tqcompile.gemm_tn.default:
            self.quantized_total += 1
            self.quantized.update(set(self.stack))
        elif func in FLOAT_GEMMS:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.weights:
                    self.float_reads.append((str(func), self.weights[t.untyped_storage().data_ptr()]))
        return func(*args, **kwargs)


class CrossAttentionBlock(nn.Module):
    """An MHA model: cross-attention with kdim/vdim and bias_kv, self-attention, an MLP."""

    def __init__(self):
        super().__init__()
        self.cross = nn.MultiheadAttention(64, 4, kdim=32, vdim=48, add_bias_kv=True, batch_first=True)
        self.self_attn = nn.MultiheadAttention(64, 4, add_zero_attn=True)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    def forward(self, x, memory_k, memory_v):
        x = x + self.cross(x, memory_k, memory_v, need_weights=False)[0]
        y = x.transpose(0, 1)
        x = x + self.self_attn(y, y, y)[0].transpose(0, 1)
        return x + self.mlp(x)


def _padding_mask(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -3:] = True
    return mask


def _models():
    """name -> (model, inputs); each small, each with the layers torch reads weights of directly."""
    torch.manual_seed(0)
    src, tgt = torch.randn(4, 16, 64), torch.randn(4, 12, 64)
    kpm = _padding_mask(4, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "enable_nested_tensor is True, but ..." notes
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), num_layers=2)
        transformer = nn.Transformer(64, 4, 1, 1, 128, dropout=0.0, batch_first=True)
    return {
        "encoder": (encoder, (src,), dict(src_key_padding_mask=kpm)),
        "decoder_layer": (
            nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, norm_first=True),
            (tgt.transpose(0, 1), src.transpose(0, 1)),
            dict(tgt_mask=causal, memory_key_padding_mask=kpm),
        ),
        "transformer": (transformer, (src, tgt), dict(tgt_mask=causal, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)),
        "mha_block": (CrossAttentionBlock(), (torch.randn(4, 12, 64), torch.randn(4, 16, 32), torch.randn(4, 16, 48)), {}),
        "mlp": (nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)), (src,), {}),
        "gpt_moe": (GPT(GPTConfig(seq_len=32, n_layer=1, n_experts=4)), (torch.randint(0, 256, (4, 32)),), {}),
    }


def _convert(name, model, recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of these models is left in high precision
        if name == "gpt_moe":
            quantize_model(model, recipe)  # the model's own conversion: lm_head and router stay high precision
            return [
                p.name
                for p in tq.nn.conversion_plan(model, recipe, filter_fn=is_quantized_layer)
                if p.action == "already converted"
            ]
        plan = tq.nn.conversion_plan(model, recipe)
        tq.convert(model, recipe)
    return [p.name for p in plan if p.action == "convert"]


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", list(_models()))
def test_every_layer_reported_converted_runs_quantized(name):
    model, args, kwargs = _models()[name]
    recipe = tq.recipes.fp8_tensorwise()
    converted = _convert(name, model, recipe)
    assert converted, "something was converted"
    for train in (True, False):
        model.train(train)
        counter = GemmCounter(model, converted)
        with torch.set_grad_enabled(train), counter:
            out = _output(model(*args, **kwargs))
            forward_gemms = counter.quantized_total
            if train:
                out.float().square().mean().backward()
        mode = "training" if train else "eval + no_grad"
        not_quantized = {
            n: (counter.calls[n], counter.quantized[n]) for n in converted if counter.quantized[n] < max(counter.calls[n], 1)
        }
        assert not not_quantized, f"{name}, {mode}: reported converted, but (forward calls, quantized GEMMs) = {not_quantized}"
        assert not counter.float_reads, f"{name}, {mode}: float GEMMs read converted weights: {sorted(set(counter.float_reads))}"
        if train:
            # dgrad and wgrad of each converted GEMM run quantized too (dgrad only where the input needs a gradient).
            assert forward_gemms < counter.quantized_total - forward_gemms <= 2 * forward_gemms


def test_the_counter_sees_float_gemms_on_converted_weights():
    """The check above can fail: a module that reads a converted weight itself is caught."""

    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            return x @ self.proj.weight.t()  # never calls self.proj

    model = tq.convert(ReadsWeight(), tq.recipes.fp8_tensorwise())
    counter = GemmCounter(model, ["proj"])
    with counter:
        model(torch.randn(8, 64))
    assert counter.calls["proj"] == 0 and counter.quantized["proj"] == 0
    assert counter.float_reads == [("aten.mm.default", "proj.weight")]
