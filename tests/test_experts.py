"""`tq.convert` on MoE experts as users' models hold them (tqcompile/nn/experts.py): Hugging Face
Mixtral, Qwen3-MoE and GPT-OSS built from configs, and a torchtitan-style `GroupedExperts`.

What is checked: the routing we run equals the model's own (with float GEMMs put back in); every
expert GEMM of forward and backward runs quantized (op counts: no float grouped GEMM left in a
converted experts module), for every recipe; routers and convolutions are reported, not silent.
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
from moe_models import HF_MOE_KINDS, TitanMoEModel, experts_modules, tiny_hf_moe
from torch.utils._python_dispatch import TorchDispatchMode

import tqcompile as tq
from tqcompile.nn.experts import QuantizedExperts
from tqcompile.testing.numerics import sqnr

aten = torch.ops.aten
RECIPES = list(tq.recipes.RECIPES)
MODELS = (*HF_MOE_KINDS, "torchtitan")
# Ops that compute a float GEMM, and the quantized grouped GEMM.
FLOAT_GEMMS = {"aten._grouped_mm", "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "transformers.grouped_mm_fallback"}
QUANTIZED = "tqcompile.grouped_gemm_tn"


def build(kind: str, **kw) -> torch.nn.Module:
    return TitanMoEModel(**kw) if kind == "torchtitan" else tiny_hf_moe(kind, **kw)


def run(model: torch.nn.Module, kind: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "torchtitan":
        return model(torch.randn(2, 64, model.inp.in_features, generator=g))
    return model(torch.randint(0, 128, (2, 64), generator=g)).logits


def convert_quietly(model, recipe, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tq.nn.ConversionWarning)
        return tq.convert(model, recipe, **kw)


class ExpertOps(TorchDispatchMode):
    """Counts the ops that run inside experts modules' forward and backward (by the op's name)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _float_gemm(self, index, x, counts):
    """The experts GEMM in float, as the model itself computes it (for checking our routing)."""
    g = self.tq_experts_layout.gemms[index]
    w = self._parameters[g.weight]
    w = w.transpose(1, 2) if g.transposed else w
    ends = counts.cumsum(0)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)
    for e, (lo, hi) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        out[lo:hi] = x[lo:hi] @ w[e].t() + (0 if g.bias is None else self._parameters[g.bias][e])
    return out


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_our_routing_equals_the_models_own(kind, implementation, monkeypatch):
    if kind == "torchtitan" and implementation == "eager":
        pytest.skip("torchtitan's GroupedExperts has one implementation")
    kw = {} if kind == "torchtitan" else {"experts_implementation": implementation}
    model = build(kind, **kw)
    with torch.no_grad():
        ref = run(model, kind)
        convert_quietly(model, tq.recipes.mxfp8(), filter_fn=lambda m, fqn: fqn.endswith("experts"))
        monkeypatch.setattr(QuantizedExperts, "_expert_gemm", _float_gemm)
        ours = run(model, kind)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", MODELS)
def test_plan_converts_experts_and_reports_routers(kind):
    model = build(kind)
    plan = {p.name: p for p in tq.nn.conversion_plan(model, tq.recipes.fp8_rowwise())}
    experts = [n for n, _ in experts_modules(model)]
    assert experts and all(plan[n].action == "convert" for n in experts), plan
    routers = [p for p in plan.values() if "MoE router" in p.reason]
    assert len(routers) == len(experts) and all(p.action == "skip" for p in routers)
    with pytest.warns(tq.nn.ConversionWarning, match="MoE router"):
        tq.convert(model, tq.recipes.fp8_rowwise())
    assert all(tq.nn.is_converted(m) for _, m in experts_modules(model))
    # The state_dict keys stay the float model's.
    assert set(model.state_dict()) == set(build(kind).state_dict())


def test_unrecognised_3d_parameters_and_convolutions_are_reported():
    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 32, 32))

        def forward(self, x):
            return torch.einsum("eij,tj->ti", self.w, x)

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 4, 4), torch.nn.Flatten(), Stacked(), torch.nn.Linear(32, 32))
    plan = {p.name: p for p in tq.nn.conversion_plan(model, tq.recipes.fp8_tensorwise())}
    assert plan["0"].action == "skip" and "convolution" in plan["0"].reason
    assert plan["2"].action == "skip" and "3-D parameters ['w']" in plan["2"].reason
    assert plan["3"].action == "convert"
    # What filter_fn excludes is the user's choice: not reported.
    plan = tq.nn.conversion_plan(model, tq.recipes.fp8_tensorwise(), filter_fn=lambda m, fqn: fqn == "3")
    assert [p.name for p in plan] == ["3"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_every_expert_gemm_runs_quantized(kind, recipe):
    # 128 features: every recipe's blocks fit (fp8_blockwise's are 128 wide).
    float_model = build(kind, dim=128) if kind == "torchtitan" else build(kind, hidden=128, intermediate=128)
    model = copy.deepcopy(float_model)
    r = tq.recipes.get(recipe)
    convert_quietly(model, r)
    experts = [m for _, m in experts_modules(model)]
    gemms_per_module = len(experts[0].tq_experts_layout.gemms)
    ops_by_module = []
    for m in experts:
        counter = ExpertOps()
        # (A hook that returns a value replaces the module's inputs or output: return None.)
        m.register_forward_pre_hook(lambda *_, c=counter: None if c.__enter__() else None)
        m.register_forward_hook(lambda *_, c=counter: None if c.__exit__(None, None, None) else None)
        ops_by_module.append(counter)
    model.train()
    out = run(model, kind)
    assert torch.isfinite(out).all()
    for c in ops_by_module:  # forward: one quantized grouped GEMM per expert GEMM, nothing in float
        assert c.counts[QUANTIZED] == gemms_per_module, c.counts
        assert not FLOAT_GEMMS & set(c.counts), c.counts
    # Backward, over the whole model: dgrad and wgrad of each expert GEMM quantized (the
    # hp-wgrad recipe's wgrad is its float grouped op, by design); the float GEMMs left are the
    # dense layers' and routers' (not expert weights).
    with ExpertOps() as bwd:
        out.float().pow(2).mean().backward()
    hp_wgrad = r.wgrad_input is None
    n = gemms_per_module * len(experts)
    assert bwd.counts[QUANTIZED] == n * (1 if hp_wgrad else 2), bwd.counts
    assert bwd.counts["tqcompile.grouped_mm_wgrad"] == (n if hp_wgrad else 0)
    assert bwd.counts["aten._grouped_mm"] == 0 and bwd.counts["transformers.grouped_mm_fallback_backward"] == 0
    for _, m in experts_modules(model):
        for p in m.parameters(recurse=False):
            assert p.grad is not None and torch.isfinite(p.grad).all()
    # The quantized model stays close to the float one (a floor per element format).
    with torch.no_grad():
        ref = run(float_model, kind)
        got = run(model.eval(), kind)
    floor = 9.0 if recipe.startswith("nvfp4") else 18.0
    assert sqnr(got, ref) > floor


def test_training_loss_tracks_float():
    """A few AdamW steps of a tiny Mixtral in mxfp8: the loss follows the float run's."""
    losses = {}
    for name in ("float", "mxfp8"):
        model = tiny_hf_moe("mixtral").train()
        if name != "float":
            convert_quietly(model, tq.recipes.mxfp8(), filter_fn=lambda m, fqn: "lm_head" not in fqn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 128, (4, 32), generator=g)
        losses[name] = []
        for _ in range(4):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["mxfp8"][-1] < losses["mxfp8"][0]
    gaps = [abs(a - b) / b for a, b in zip(losses["mxfp8"], losses["float"])]
    assert max(gaps) < 0.02, (losses, gaps)


# Models the experts code was not written against: shared experts (Qwen2-MoE), a router that is an
# nn.Linear one level down (HunYuan: mlp.gate.wg), a router subclassing nn.Linear (PhiMoE), OLMoE.
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    shared_expert_intermediate_size=64,
)  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen2_moe", "olmoe", "hunyuan_v1_moe", "phimoe"])
def test_other_hf_moe_models_convert_and_report_their_routers(model_type):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    for k, v in TINY.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    plan = tq.nn.conversion_plan(model, tq.recipes.fp8_rowwise())
    routers = [p.name for p in plan if "MoE router" in p.reason]
    with pytest.warns(tq.nn.ConversionWarning, match="MoE router"):
        tq.convert(model, tq.recipes.fp8_rowwise(), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    experts = experts_modules(model)
    assert len(experts) == 2 and all(tq.nn.is_converted(m) for _, m in experts)
    assert len(routers) == 2 and not any(tq.nn.is_converted(dict(model.named_modules())[r]) for r in routers)
    with torch.no_grad():
        assert sqnr(model(ids).logits, ref) > 20
    model.train()(ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for _, m in experts for p in m.parameters(recurse=False))


def test_delayed_scaling_keeps_one_history_window_per_expert():
    model = TitanMoEModel()
    float_state = copy.deepcopy(model.state_dict())
    convert_quietly(model, tq.recipes.fp8_delayed(amax_history_len=4))
    experts = model.blocks[0].experts
    hist = {n: b for n, b in experts.named_buffers() if n.startswith("amax_history_")}
    assert len(hist) == 9 and all(b.shape == (4, 4) and b.dtype == torch.float32 for b in hist.values())
    # A float checkpoint loads strictly: the histories start at zeros (the first-step state).
    model.load_state_dict(float_state, strict=True)
    model.train()
    run(model, "torchtitan").float().pow(2).mean().backward()
    # Each expert's window holds its own amax: the weight's per-expert max |w|.
    torch.testing.assert_close(experts.amax_history_w1_weight[0], experts.w1.detach().abs().amax((1, 2)), rtol=0, atol=0)
    assert (experts.amax_history_w2_grad[0] > 0).any() and (experts.amax_history_w1_input[1] == 0).all()
    before = {n: b.clone() for n, b in hist.items()}
    model.eval()
    run(model, "torchtitan").float().pow(2).mean().backward()  # eval mode: scaled from the histories, not rolled
    assert all(torch.equal(before[n], experts.get_buffer(n)) for n in hist)
    # The histories are in the state_dict, and come back.
    state = copy.deepcopy(model.state_dict())
    assert "blocks.0.experts.amax_history_w2_grad" in state
    fresh = convert_quietly(TitanMoEModel(), tq.recipes.fp8_delayed(amax_history_len=4))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.blocks[0].experts.amax_history_w1_input, experts.amax_history_w1_input)
