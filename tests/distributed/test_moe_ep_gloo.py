"""Expert parallelism of converted MoE experts (`tq.distributed.expert_parallel`) on 2 gloo ranks,
against one process, and DCP checkpoints of an EP model at another EP size.

One spawn runs every check (`run_checks`: a failure names the check and the rank). Each rank runs
the single-process reference itself (same seeds: deterministic); under EP each rank routes its half
of the tokens.

Checks:
- experts: an experts module of each layout (Mixtral, GPT-OSS transposed with biases, torchtitan's
  GroupedExperts) and recipe, EP=2 against one process on both ranks' tokens (for torchtitan's,
  sorted by expert in the order the dispatch delivers them): outputs, input gradients and expert
  weight gradients equal bit for bit; no amax is reduced across ranks (no all-reduce at all);
- training: whole tiny HF models and a torchtitan-style model, every layer converted, 3 AdamW steps:
  the EP losses (each rank's summed loss over the global token count, added over the ranks; the
  replicated parameters' gradients summed over the ranks) equal the single-process losses within
  rtol 1e-5: the dense float layers run on half the batch, whose matmuls round differently;
- compile: each decoder layer, the dispatch's all-to-alls included, compiled with fullgraph=True
  (the split sizes read with `.tolist()` become unbacked SymInts): no graph break, one graph for
  both layers, no recompile across steps (new routings), equal to eager bit for bit;
- DCP: EP=2 -> one process and one process -> EP=2, model and optimizer, bit for bit; no
  collective while the state dict is traversed;
- errors: an unconverted experts module; an EP size that does not divide the experts.
Delayed scaling (torchtitan's layout, fp8_delayed) is an experts case: its (L, E) histories are
sharded with the experts, and each rank's windows equal one process's columns for its experts.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tqcompile as tq
from tqcompile.testing import run_checks, run_ranks
from tqcompile.testing.comm import count_collective_bytes
from tqcompile.testing.compile import CompileCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import TitanMoEModel, moe_batch, moe_loss, tiny_hf_moe  # noqa: E402

pytest.importorskip("transformers")

WORLD = 2
STEPS = 3
BATCH, SEQ = 4, 16  # 2 sequences per rank: 32 tokens, an MX block
TOKENS, HIDDEN, EXPERTS = 32, 64, 4  # per rank, for the experts-module checks
# Training converts every layer, the dense ones too: recipes whose activation scales are per token
# (rowwise, MX), as a dense tensorwise amax over half the batch (data parallel) differs from one
# over the whole. The experts check has fp8_tensorwise: per-expert scales see the same tokens.
# (layout, recipe): Mixtral's gated layout, GPT-OSS's transposed one with biases, torchtitan's.
EXPERTS_CASES = [
    ("mixtral", "fp8_tensorwise"),
    ("mixtral", "mxfp8"),
    ("gpt_oss", "fp8_rowwise"),
    ("titan", "mxfp8"),
    ("titan", "fp8_delayed"),
]
TRAIN_CASES = [("qwen3_moe", "mxfp8"), ("titan", "fp8_rowwise")]


def _model(kind: str, recipe: str, num_experts: int = EXPERTS):
    model = (
        TitanMoEModel(dim=HIDDEN, num_experts=num_experts)
        if kind == "titan"
        else tiny_hf_moe(kind, num_experts=num_experts).train()
    )
    return tq.convert(model, tq.recipes.get(recipe), filter_fn=lambda m, fqn: "lm_head" not in fqn)


def _first_experts(model):
    return model.blocks[0].experts if isinstance(model, TitanMoEModel) else model.model.layers[0].mlp.experts


def _expert_inputs(kind: str, rank: int):
    """(whole inputs, this rank's inputs, this rank's rows of the whole): random tokens routed to
    EXPERTS experts, rank 0's never to the last one (an expert that gets nothing from a rank).
    HF: (hidden, top-k ids, top-k weights); torchtitan: tokens sorted by expert and counts, the
    whole being every expert's tokens of rank 0, then of rank 1 (the order the dispatch delivers)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(WORLD, TOKENS, HIDDEN, generator=g)
    scores = torch.rand(WORLD, TOKENS, EXPERTS, generator=g)
    scores[0, :, -1] = -1.0
    mine = torch.arange(rank * TOKENS, (rank + 1) * TOKENS)
    if kind != "titan":
        ids, weights = scores.topk(2, dim=-1)[1], torch.rand(WORLD, TOKENS, 2, generator=g)
        whole = (x.flatten(0, 1), ids.flatten(0, 1), weights.flatten(0, 1))
        return whole, tuple(t[mine] for t in whole), mine
    ids = torch.sort(scores.argmax(-1), dim=-1)[0]  # each rank's tokens sorted by expert
    counts = torch.stack([torch.bincount(i, minlength=EXPERTS) for i in ids])
    order = [(e, r) for e in range(EXPERTS) for r in range(WORLD)]
    rows = {r: torch.cat([torch.nonzero(ids[r] == e).flatten() + r * TOKENS for e in range(EXPERTS)]) for r in range(WORLD)}
    whole_x = torch.cat([x[r][ids[r] == e] for e, r in order])
    position = torch.cat([torch.nonzero(ids[r] == e).flatten() + r * TOKENS for e, r in order])  # whole row -> (rank, token)
    inverse = torch.empty_like(position)
    inverse[position] = torch.arange(position.numel())
    return (whole_x, counts.sum(0)), (x[rank], counts[rank]), inverse[rows[rank]]


def _run_experts(experts, inputs, rank_rows=None):
    """Output, input gradient and parameter gradients of `experts` on `inputs` with a fixed output gradient."""
    x = inputs[0].clone().requires_grad_()
    out = experts(x, *inputs[1:])
    dy = torch.randn(WORLD * TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    (out * (dy if rank_rows is None else dy[rank_rows])).sum().backward()
    return out.detach(), x.grad, _grads(experts)


def _experts(rank: int, mesh) -> dict:
    out = {}
    for kind, recipe in EXPERTS_CASES:
        whole, local, rows = _expert_inputs(kind, rank)
        ref_experts = _first_experts(_model(kind, recipe))
        ref_out, ref_dx, ref_grads = _run_experts(ref_experts, whole)
        experts = _first_experts(tq.distributed.expert_parallel(_model(kind, recipe), mesh))
        with count_collective_bytes() as wire:
            ep_out, ep_dx, ep_grads = _run_experts(experts, local, rows)
        out[f"{kind}/{recipe}"] = {
            "output": torch.equal(ep_out, ref_out[rows]),
            "dx": torch.equal(ep_dx, ref_dx[rows]),
            "unequal grads": sorted(n for n in ref_grads if not torch.equal(ep_grads[n], ref_grads[n])),
            "collectives": dict(wire.calls),
            "local shape": tuple(experts._parameters[experts.tq_experts_layout.gemms[0].weight].to_local().shape),
            # Delayed scaling: this rank's history columns (its experts) against one process's.
            "unequal histories": sorted(
                n
                for n, b in experts.named_buffers()
                if n.startswith("amax_history_")
                and not torch.equal(b.to_local(), ref_experts.get_buffer(n).chunk(WORLD, dim=1)[rank])
            ),
            "histories rolled": all(
                bool((b.to_local()[0] > 0).any()) for n, b in experts.named_buffers() if n.startswith("amax_history_")
            ),
        }
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _train(model, kind: str, x, y, *, ep: bool, steps: int = STEPS, opt=None) -> list[float]:
    """AdamW losses (under EP: summed over the ranks, the replicated parameters' gradients too)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(steps):
        loss = moe_loss(model, kind, x, y, tokens=BATCH * SEQ)
        loss.backward()
        if ep:
            for p in model.parameters():
                if not isinstance(p, DTensor) and p.grad is not None:
                    dist.all_reduce(p.grad)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _mine(rank: int) -> slice:
    return slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)


def _training(rank: int, mesh) -> dict:
    out = {}
    for kind, recipe in TRAIN_CASES:
        x, y = moe_batch(kind, BATCH, SEQ, HIDDEN)
        single = _train(_model(kind, recipe), kind, x, y, ep=False)
        ep = _train(tq.distributed.expert_parallel(_model(kind, recipe), mesh), kind, x[_mine(rank)], y[_mine(rank)], ep=True)
        out[f"{kind}/{recipe}"] = (ep, single)
    return out


def _compile(rank: int, mesh) -> dict:
    x, y = moe_batch("mixtral", BATCH, SEQ, HIDDEN)
    x, y = x[_mine(rank)], y[_mine(rank)]
    eager = tq.distributed.expert_parallel(_model("mixtral", "mxfp8"), mesh)
    compiled = tq.distributed.expert_parallel(_model("mixtral", "mxfp8"), mesh)
    counter = CompileCounter("aot_eager")
    for layer in compiled.model.layers:  # whole decoder layers: attention, router, dispatch, experts
        layer.compile(backend=counter, fullgraph=True)
    a, b = _train(eager, "mixtral", x, y, ep=True), _train(compiled, "mixtral", x, y, ep=True)
    same = all(
        torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(eager.parameters(), compiled.parameters())
        if isinstance(p, DTensor)
    )
    return {
        "equal": a == b and same,
        "frames": counter.frame_count,
        "recompiles": counter.recompiles,
        "graph_breaks": counter.graph_breaks,
    }


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, whole, keyed by parameter name."""
    full = {f"model.{n}": (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                full[f"optim.{names[id(p)]}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return full


def _checkpoint(rank: int, mesh, out_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    x, y = moe_batch("gpt_oss", BATCH, SEQ, HIDDEN)
    out = {}
    # EP=2 -> one process: trained a step under EP, saved, loaded into a plain model on each rank.
    ep = tq.distributed.expert_parallel(_model("gpt_oss", "mxfp8"), mesh)
    ep_opt = torch.optim.AdamW(ep.parameters(), lr=1e-2, foreach=False)
    _train(ep, "gpt_oss", x[_mine(rank)], y[_mine(rank)], ep=True, steps=1, opt=ep_opt)
    with count_collective_bytes() as wire:
        get_model_state_dict(ep)
    out["traversal collectives"] = dict(wire.calls)
    tq.distributed.checkpoint.save(ep, ep_opt, f"{out_dir}/ep2")
    plain = _model("gpt_oss", "mxfp8")
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    _train(plain, "gpt_oss", x, y, ep=False, steps=1, opt=plain_opt)  # optimizer state to load into
    tq.distributed.checkpoint.load(plain, plain_opt, f"{out_dir}/ep2")
    a, b = _state(ep, ep_opt), _state(plain, plain_opt)
    out["ep2->1"] = (sorted(a) == sorted(b), sorted(k for k in a if k in b and not torch.equal(a[k], b[k])))
    # One process -> EP=2: the plain model (trained a step more) saved, loaded into a fresh EP model.
    _train(plain, "gpt_oss", x, y, ep=False, steps=1, opt=plain_opt)
    tq.distributed.checkpoint.save(plain, plain_opt, f"{out_dir}/ep1")
    ep = tq.distributed.expert_parallel(_model("gpt_oss", "mxfp8"), mesh)
    ep_opt = torch.optim.AdamW(ep.parameters(), lr=1e-2, foreach=False)
    _train(ep, "gpt_oss", x[_mine(rank)], y[_mine(rank)], ep=True, steps=1, opt=ep_opt)
    tq.distributed.checkpoint.load(ep, ep_opt, f"{out_dir}/ep1")
    a, b = _state(plain, plain_opt), _state(ep, ep_opt)
    out["ep1->2"] = (sorted(a) == sorted(b), sorted(k for k in a if k in b and not torch.equal(a[k], b[k])))
    return out


def _errors(rank: int, mesh) -> dict:
    def error(fn) -> str:
        try:
            fn()
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    return {
        "unconverted": error(lambda: tq.distributed.expert_parallel(tiny_hf_moe("mixtral"), mesh)),
        "indivisible": error(lambda: tq.distributed.expert_parallel(_model("titan", "mxfp8", num_experts=3), mesh)),
    }


def _checks(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    checks = [_experts, _training, _compile, _errors]
    named = [(c.__name__.lstrip("_"), functools.partial(c, rank, mesh)) for c in checks]
    results = run_checks(rank, [*named, ("checkpoint", functools.partial(_checkpoint, rank, mesh, out_dir))])
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_expert_parallel_two_ranks(tmp_path):
    ranks = run_ranks(_checks, WORLD, tmp_path, deadline_s=600, timeout_s=120)
    for rank, res in enumerate(ranks):
        for case, got in res["experts"].items():
            assert got["output"] and got["dx"], (rank, case)
            assert got["unequal grads"] == [], (rank, case)
            assert got["unequal histories"] == [] and got["histories rolled"], (rank, case)
            # Dispatch: counts and tokens there, tokens back; the same in backward. Gradients are
            # gathered (full_tensor) to compare; no amax all-reduce anywhere.
            assert got["collectives"].get("all_to_all") == 5 and "all_reduce" not in got["collectives"], (rank, case)
            assert got["local shape"][0] == EXPERTS // WORLD, (rank, case)
        for case, (ep, single) in res["training"].items():
            torch.testing.assert_close(torch.tensor(ep), torch.tensor(single), rtol=1e-5, atol=0, msg=case)
        # One graph serves both layers; three steps with new routings compile nothing more.
        assert res["compile"] == {"equal": True, "frames": 1, "recompiles": 0, "graph_breaks": 0}
        assert "is not converted; call tq.convert" in res["errors"]["unconverted"]
        assert "has 3 experts, not a multiple of the EP size 2" in res["errors"]["indivisible"]
        ckpt = res["checkpoint"]
        assert ckpt["traversal collectives"] == {}
        assert ckpt["ep2->1"] == (True, []) and ckpt["ep1->2"] == (True, [])


def _checks_four(rank: int, out_dir: str) -> None:
    """EP=4 <-> EP=2 (the 'ep' dim of a 2x2 mesh) <-> one process, model state through DCP."""
    ep4 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    ep2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"]
    x, y = moe_batch("titan", BATCH, SEQ, HIDDEN)

    def state(model) -> dict[str, torch.Tensor]:
        return {n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in model.state_dict().items()}

    def unequal(a, b) -> list[str]:
        return sorted(n for n in a if not torch.equal(a[n], b[n])) + sorted(set(a) ^ set(b))

    def run() -> dict:
        out = {}
        four = tq.distributed.expert_parallel(_model("titan", "fp8_rowwise"), ep4)
        _train(four, "titan", x[rank : rank + 1], y[rank : rank + 1], ep=True, steps=1)
        tq.distributed.checkpoint.save(four, None, f"{out_dir}/ep4")
        two = tq.distributed.expert_parallel(_model("titan", "fp8_rowwise"), ep2)
        tq.distributed.checkpoint.load(two, None, f"{out_dir}/ep4")
        one = _model("titan", "fp8_rowwise")
        tq.distributed.checkpoint.load(one, None, f"{out_dir}/ep4")
        out["ep4->2"], out["ep4->1"] = unequal(state(four), state(two)), unequal(state(four), state(one))
        with torch.no_grad():  # a state EP=4 never held, saved at EP=2 and loaded back at EP=4
            for p in two.parameters():
                p.mul_(2)
        tq.distributed.checkpoint.save(two, None, f"{out_dir}/ep2")
        tq.distributed.checkpoint.load(four, None, f"{out_dir}/ep2")
        out["ep2->4"] = unequal(state(two), state(four))
        return out

    torch.save(run_checks(rank, [("reshard", run)]), f"{out_dir}/rank{rank}.pt")


def test_expert_parallel_checkpoint_four_ranks(tmp_path):
    ranks = run_ranks(_checks_four, 4, tmp_path, deadline_s=600, timeout_s=120)
    for res in ranks:
        assert res["reshard"] == {"ep4->2": [], "ep4->1": [], "ep2->4": []}
