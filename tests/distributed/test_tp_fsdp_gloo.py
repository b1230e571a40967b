"""TP x FSDP2 on a 2-D mesh, and HSDP on a 2x2 mesh: one spawn of four CPU ranks over gloo.

The model is a gated MLP: a fused ColwiseParallel fc1 (its weight stacks the gate and the up
projection, `fused_chunks=2`, so TP places it `_StridedShard` and FSDP2 shards that TP-local piece
again along its rows) and a RowwiseParallel fc2 (weight split on K). Each rank checks:

1. scales with a planted outlier that only rank 3 holds (the other dp *and* tp coordinate): the
   weights FSDP2 gathers quantized, both usages, equal the single-process quantization's TP-local
   slice bit for bit (tensor amaxes over both groups, per-row scales over a TP-split K, per-column
   amaxes of the columnwise usage over dp and a TP-split N), and the gather did not
   fall back to high precision; a shard that cuts 128x128 blocks warns and gathers in high precision;
2. parity: a few AdamW steps against one process for every recipe (nvfp4 with round-to-nearest
   gradients), and the gathered weight's recorded amax group (the TP group);
3. bytes: FSDP2's weight all-gather over the dp dim, against the same model gathered in bf16;
4. compile: blocks compiled fullgraph (aot_eager) before fully_shard: no graph break, and no new
   graph or recompile after step 1;
5. DCP: the fp8_delayed run (fused fc1, which FSDP2 also shards) saved with tq.distributed.checkpoint
   on the 2-D mesh; the parent loads it into one process (parameters, optimizer state and amax
   histories bit for bit), and the ranks load a one-process checkpoint (1 -> TP2xFSDP2, bit for bit);
6. HSDP on a 2x2 (replicate x shard) mesh: losses equal one process; the amax group is the shard dim's;
7. test_tp_gloo.py's GPT with TP=2 inside stock FSDP2=2 (its own test below): losses follow one process.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_tp_gloo import CFG as GPT_CFG
from test_tp_gloo import _batches as _gpt_batches
from test_tp_gloo import _train as _gpt_train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import tqcompile as tq
from tqcompile.demo import GPT, parallelize_gpt, quantize_model
from tqcompile.testing import count_collective_bytes, run_checks, run_ranks
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

WORLD = 4
# test_tp_gloo.py's GPT run with TP=2 inside FSDP2=2 (recipe -> blocks compiled first).
GPT_RECIPES = {"mxfp8": False, "fp8_tensorwise": True}
D, HIDDEN, TOKENS = 256, 256, (2, 128)
STEPS = 3


def _recipe(name: str) -> tq.Recipe:
    return tq.recipes.nvfp4(stochastic_rounding=False) if name == "nvfp4_rne" else tq.recipes.get(name)


RECIPES = [n for n in tq.recipes.RECIPES if n != "nvfp4"] + ["nvfp4_rne"]


class MLP(nn.Module):
    """Gated (fc1 stacks [gate; up]: a fused ColwiseParallel weight) or plain (GELU)."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(D, 2 * HIDDEN if gated else HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        if self.gated:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(gated), MLP(gated)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.float().pow(2).mean()


def _model(recipe: tq.Recipe, quantized_all_gather: bool = True, gated: bool = True) -> Net:
    torch.manual_seed(0)
    return tq.convert(Net(gated), recipe, fsdp_quantized_all_gather=quantized_all_gather)


def _shard(model: Net, mesh, compile_with=None, mp=None, **fsdp_kwargs) -> Net:
    """TP on mesh["tp"], then compile each block, then FSDP2 on mesh["dp"] (the torchtitan order)."""
    chunks = 2 if model.blocks[0].gated else 1
    plan = {"fc1": tq.distributed.ColwiseParallel(fused_chunks=chunks), "fc2": tq.distributed.RowwiseParallel()}
    kwargs = fsdp_kwargs if mp is None else {"mp_policy": mp, **fsdp_kwargs}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        if compile_with is not None:
            block.compile(backend=compile_with, fullgraph=True)
        fully_shard(block, mesh=mesh["dp"], **kwargs)
    fully_shard(model, mesh=mesh["dp"], **kwargs)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*TOKENS, D, generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, batches, opt=None, on_step=None) -> list[float]:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, x in enumerate(batches):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i)
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return getattr(t, "_tensor", t)  # a QuantizedWeight's high-precision tensor


def _local_pair(p: torch.Tensor, ref: torch.Tensor, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's piece of the 2-D-sharded `p`, the same piece of the single-process `ref`).

    Local pieces, not `full_tensor()`: FSDP2 describes its dim-0 shard of a fused (`_StridedShard`)
    TP weight with placements whose global view is not the weight (see checkpoint.save)."""
    if not isinstance(p, DTensor):
        return p, ref
    local = p._local_tensor
    tp_placement = p.placements[-1]
    chunks = getattr(tp_placement, "split_factor", 1)
    piece = _tp_slice(ref, tp_placement.dim, mesh["tp"].get_local_rank(), chunks)
    return getattr(local, "_tensor", local), piece.chunk(2, dim=0)[mesh["dp"].get_local_rank()]


# --- 1. planted outlier ------------------------------------------------------------------------------
def _tp_slice(t: torch.Tensor, dim: int, tp_rank: int, chunks: int) -> torch.Tensor:
    """The TP-local piece of a single-process inner tensor `t` split on `dim` (strided for fused chunks)."""
    if t.dim() == 0 or t.shape[dim] == 1:
        return t  # whole along the split: a tensor scale, or per-row scales along a split K
    return torch.cat([c.chunk(2, dim=dim)[tp_rank] for c in t.chunk(chunks, dim=dim)], dim=dim)


def _check_planted_outlier(rank: int, mesh) -> dict:
    tp_rank = mesh["tp"].get_local_rank()
    checked = {}
    for name in ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4_rne", "fp8_blockwise"):
        recipe = _recipe(name)
        model = _model(recipe)
        with torch.no_grad():
            # Rank 3 (dp 1, tp 1) holds fc1 rows in its TP half's second FSDP half, and fc2's K half 1.
            model.blocks[0].fc1.weight[2 * HIDDEN - 3, 5] = 300.0
            model.blocks[0].fc2.weight[D - 2, HIDDEN - 7] = -300.0
        single = copy.deepcopy(model)
        # Not resharded after forward: one gather brings both usages (the columnwise one with its
        # per-column amaxes reduced over dp, and over tp for the colwise fc1).
        _shard(model, mesh, reshard_after_forward=False)
        q = recipe.fprop_weight
        model.blocks[0].unshard()
        for layer, dim, chunks in (("fc1", 0, 2), ("fc2", 1, 1)):
            gathered = getattr(model.blocks[0], layer).weight.to_local()
            assert isinstance(gathered, tq.QuantizedTensor), f"{name} {layer}: gathered {type(gathered).__name__}"
            assert gathered.amax_group_name == mesh["tp"].get_group().group_name
            ref = tq.quantize(getattr(single.blocks[0], layer).weight.detach(), q, rowwise=True, columnwise=True)
            want = {}
            for n in ("_data", "_scale_inv", "_data_t", "_scale_inv_t"):
                t, flat = getattr(ref, n), n == "_scale_inv_t" and q.flat_columnwise_scale()
                if flat:  # a columnwise usage keeps 1-D block scales flat: sliced as (K, N // block)
                    t = t.view(q.scale_shape(q.logical_shape(ref._data_t.shape)))
                t = _tp_slice(t, dim if not n.endswith("_t") else 1 - dim, tp_rank, chunks)
                want[n] = t.reshape(-1) if flat else t
            assert_bitwise_equal({n: getattr(gathered, n) for n in want}, want, f"{name} {layer}")
            if q.uses_tensor_amax():
                assert torch.equal(gathered._amax, ref._amax), f"{name} {layer}: amax {gathered._amax} vs {ref._amax}"
        model.blocks[0].reshard()
        checked[name] = True
    return checked


def _check_cut_blocks(rank: int, mesh) -> bool:
    """A 2-D shard that cuts blocks follows the 1-D rule: a warning naming the layer, a high-precision
    gather, and the TP layer quantizes the gathered piece itself (the same result)."""
    torch.manual_seed(2)
    single = tq.convert(nn.Sequential(nn.Linear(D, D, bias=False)), tq.recipes.fp8_blockwise(), fsdp_quantized_all_gather=True)
    model = copy.deepcopy(single)
    parallelize_module(model[0], mesh["tp"], tq.distributed.ColwiseParallel())
    fully_shard(model, mesh=mesh["dp"])
    x = _batches()[0]
    with pytest.warns(tq.distributed.QuantizedAllGatherWarning, match=r"shards of 64 rows, which cut its 128x128 blocks"):
        y = model(x)
    assert_bitwise_equal(y, single(x).chunk(2, dim=-1)[mesh["tp"].get_local_rank()], "cut blocks: output")
    return True


# --- 2. parity, 4. compile, 5. DCP ----------------------------------------------------------------------
def _check_parity(rank: int, mesh) -> dict:
    batches = _batches()
    worst = {}
    for name in RECIPES:
        recipe = _recipe(name)
        ref = _model(recipe)
        counter = CompileCounter("aot_eager") if name in ("fp8_tensorwise", "mxfp8") else None
        model = _shard(copy.deepcopy(ref), mesh, compile_with=counter)
        ref_losses = _train(ref, batches)
        marks = []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def mark(step: int, marks=marks, counter=counter) -> None:
            marks.append((counter.frame_count, counter.recompiles) if counter else (0, 0))

        losses = _train(model, batches, opt, on_step=mark)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_diff = max(
            ((a - b).norm() / b.norm()).item()
            for a, b in (_local_pair(p, q, mesh) for p, q in zip(model.parameters(), ref.parameters()))
        )
        # The same quantized operands; only the fp32 order of TP's partial sums differs, which can move
        # an element next to a rounding boundary of the next quantizer by one step (the TP test's bound).
        assert loss_diff <= 1e-3, f"{name}: losses {losses} vs single process {ref_losses}"
        assert param_diff <= 3e-2, f"{name}: parameters differ by {param_diff:.2e} (relative norm)"
        worst[name] = (loss_diff, param_diff)
        if counter is not None:
            # Step 1 compiles each block (the second block's graph counts as a recompile of the same
            # code: a guard on the module); later steps must add nothing.
            worst[name + " compile"] = (
                marks[0][0] > 0,
                marks[-1][0] - marks[0][0],
                marks[-1][1] - marks[0][1],
                counter.graph_breaks,
            )
    return worst


def _pieces(model, opt) -> dict:
    """{name: (this rank's local piece, its TP split dim or None, fused chunks)} of the model state and the
    optimizer's tensor state (keys as `_snapshot`'s). Local pieces: a fused fc1 weight's placements do
    not describe it (`full_tensor()` misorders its rows); the parent slices the same piece out of a
    one-process state (`_piece_of`)."""

    def piece(v):
        if not isinstance(v, DTensor):
            return v.detach().clone(), None, 1
        local, tp = v._local_tensor, v.placements[-1]
        return getattr(local, "_tensor", local).detach().clone(), tp.dim, getattr(tp, "split_factor", 1)

    out = {f"model/{k}": piece(v) for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out.update({f"optim/{i}.{k}": piece(v) for k, v in opt.state[p].items() if torch.is_tensor(v)})
    return out


def _piece_of(ref: torch.Tensor, tp_dim, chunks: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece (mesh (dp, tp) = divmod(rank, 2)) of the one-process tensor `ref`."""
    if tp_dim is None:
        return ref
    dp_rank, tp_rank = divmod(rank, 2)
    return _tp_slice(ref, tp_dim, tp_rank, chunks).chunk(2, dim=0)[dp_rank]


def _odd_fused(seed: int) -> nn.Sequential:
    """A layer whose fused TP-local rows FSDP2 splits unevenly: fused_chunks=3, 9 rows per tp rank (dp shards 5, 4)."""
    torch.manual_seed(seed)
    return tq.convert(nn.Sequential(nn.Linear(32, 18)), tq.recipes.fp8_tensorwise(), fsdp_quantized_all_gather=False)


def _shard_odd(model: nn.Sequential, mesh) -> nn.Sequential:
    parallelize_module(model[0], mesh["tp"], tq.distributed.ColwiseParallel(fused_chunks=3))
    return fully_shard(model, mesh=mesh["dp"])


def _check_dcp(rank: int, out_dir: str) -> tuple[dict, dict]:
    """fp8_delayed (amax histories) trained on the 2-D mesh, saved with DCP; returns the pieces it held.
    Gated blocks: fc1 is a fused ColwiseParallel weight that FSDP2 shards again (checkpoint.save
    gathers it over dp by hand), fc2 a plain RowwiseParallel one.
    On a mesh made again (as the sharded demo does per run): its tp sub-mesh may resolve to a group
    of another name than the DTensor spec's; the gathered weight must record the layer's own."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _shard(_model(tq.recipes.fp8_delayed()), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, _batches()[:2], opt)
    tq.distributed.checkpoint.save(model, opt, f"{out_dir}/ckpt")
    held = _pieces(model, opt)
    # A 3-D mesh (HSDP x TP) with such a fused placement is not handled: refused, naming the parameter.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    fused = [Replicate(), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)]
    lin = nn.Linear(4, 8, bias=False)
    lin.weight = nn.Parameter(DTensor.from_local(torch.zeros(2, 4), mesh3, fused, run_check=False, shape=(8, 4), stride=(4, 1)))
    with pytest.raises(ValueError, match=r"'weight' is placed .* on a 3-D mesh.*fused_chunks=1"):
        tq.distributed.checkpoint.save(lin, None, f"{out_dir}/refused")

    # One process (saved by the test before the spawn) -> TP2xFSDP2.
    model = _shard(_model(tq.recipes.fp8_delayed()), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tq.distributed.checkpoint.load(model, opt, f"{out_dir}/single")
    loaded = _pieces(model, opt)

    # Uneven dp shards (padded for the gather): saved here (the parent loads it), and 1 -> TP2xFSDP2.
    odd = _shard_odd(_odd_fused(0), mesh)
    assert odd[0].weight._local_tensor.shape[0] == (5, 4)[mesh["dp"].get_local_rank()]
    tq.distributed.checkpoint.save(odd, None, f"{out_dir}/odd")
    odd = _shard_odd(_odd_fused(1), mesh)
    tq.distributed.checkpoint.load(odd, None, f"{out_dir}/odd_single")
    for n, (got, dim, chunks) in _pieces(odd[0], torch.optim.SGD(odd.parameters())).items():
        if n.startswith("model/"):
            want = _piece_of(getattr(_odd_fused(2)[0], n[len("model/") :]).detach(), dim, chunks, rank)
            assert_bitwise_equal(got, want, f"uneven fused {n} loaded from one process")
    return held, loaded


# --- 3. bytes -------------------------------------------------------------------------------------------
def _weight_gather_bytes(recipe: tq.Recipe, mesh, quantized: bool) -> int:
    """Bytes all-gathered in one training step (after the first, which also compares fingerprints).
    The model's input is replicated, so its only all-gathers are FSDP2's over the dp dim."""
    model = _shard(_model(recipe, quantized), mesh, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = _batches()[0]
    model(x).backward()
    with count_collective_bytes() as wire:
        model(x).backward()
    return wire.bytes["all_gather"]


def _check_bytes(rank: int, mesh) -> dict:
    bf16 = _weight_gather_bytes(tq.recipes.fp8_tensorwise(), mesh, quantized=False)
    out = {"bf16": bf16}
    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_delayed", "mxfp8", "nvfp4_rne"):
        out[name] = _weight_gather_bytes(_recipe(name), mesh, quantized=True) / bf16
    return out


# --- 6. HSDP --------------------------------------------------------------------------------------------
def _check_hsdp(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    batches = _batches()
    out = {}
    for name in ("fp8_tensorwise", "mxfp8"):
        ref = _model(_recipe(name))
        model = copy.deepcopy(ref)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.blocks[0].unshard()
        group = model.blocks[0].fc1.weight.amax_group_name
        model.blocks[0].reshard()
        assert group == mesh["shard"].get_group().group_name, f"{name}: amax group {group}"
        ref_losses, losses = _train(ref, batches), _train(model, batches)
        # Each rank holds whole rows and the same batch as one process: the same sums in the same order.
        assert losses == ref_losses, f"HSDP {name}: {losses} vs single process {ref_losses}"
        out[name] = losses
    return out


def _rank_checks(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    checks = [
        *[
            (f"gpt_tp_inside_fsdp2_{name}", lambda n=name, c=compiled: _check_gpt_tp_inside_fsdp2(mesh, n, c))
            for name, compiled in GPT_RECIPES.items()
        ],
        ("outlier", lambda: _check_planted_outlier(rank, mesh)),
        ("cut_blocks", lambda: _check_cut_blocks(rank, mesh)),
        ("parity", lambda: _check_parity(rank, mesh)),
        ("dcp", lambda: _check_dcp(rank, out_dir)),
        ("bytes", lambda: _check_bytes(rank, mesh)),
        ("hsdp", lambda: _check_hsdp(rank)),
    ]
    torch.save(run_checks(rank, checks), f"{out_dir}/rank{rank}.pt")


def _check_gpt_tp_inside_fsdp2(mesh, name: str, compiled: bool) -> tuple:
    """test_tp_gloo.py's GPT, one recipe, TP=2 inside stock `fully_shard` on the dp dim (the same
    batch on both dp ranks; its blocks compiled first when `compiled`): the losses against the
    single-process run, and the compile counts after step 1."""
    torch.compiler.reset()  # the counts below are this check's alone, as in a process of its own
    batches = _gpt_batches(2)
    cfg = dataclasses.replace(GPT_CFG, n_layer=1)
    torch.manual_seed(0)
    ref = quantize_model(GPT(cfg), tq.recipes.get(name))
    model = parallelize_gpt(copy.deepcopy(ref), mesh["tp"])
    counter = CompileCounter("aot_eager")
    for block in model.blocks:  # compile, then shard: the torchtitan order
        if compiled:
            block.compile(backend=counter, fullgraph=True)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ref_losses = _gpt_train(ref, batches)
    losses = _gpt_train(model, batches[:1])  # SGD keeps no state: two calls are two steps
    graphs_after_step_1 = counter.frame_count
    losses += _gpt_train(model, batches[1:])
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=0)  # the bound of _check_parity
    new_graphs = counter.frame_count - graphs_after_step_1
    return (
        [x.item() for x in losses],
        (graphs_after_step_1 > 0, new_graphs, counter.recompiles, counter.graph_breaks),
    )


def _snapshot(model, opt) -> tuple[dict, dict]:
    """Full (unsharded) copies of the model's state dict and the optimizer's tensor state."""
    state = {k: _full(v).clone() for k, v in model.state_dict().items()}
    optim = {
        f"{i}.{k}": _full(v).clone()
        for i, p in enumerate(model.parameters())
        for k, v in opt.state[p].items()
        if torch.is_tensor(v)
    }
    return state, optim


def _load_single_process(path: Path) -> tuple[dict, dict]:
    model = _model(tq.recipes.fp8_delayed())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batches()[0]).backward()  # creates the optimizer state that the load fills
    opt.step()
    opt.zero_grad()
    tq.distributed.checkpoint.load(model, opt, path)
    state, optim = _snapshot(model, opt)
    return state, optim


def _single_process_checkpoint(path: Path) -> tuple[dict, dict]:
    """A one-process fp8_delayed model trained 2 steps, saved for the ranks to load."""
    model = _model(tq.recipes.fp8_delayed(), quantized_all_gather=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, _batches()[1:], opt)
    tq.distributed.checkpoint.save(model, opt, path)
    return _snapshot(model, opt)


def _check_pieces(ranks: list, which: int, state: dict, optim: dict, what: str) -> None:
    """Every rank's pieces (`_check_dcp`'s `which` result) equal the same pieces of a one-process state."""
    whole = {**{f"model/{k}": v for k, v in state.items()}, **{f"optim/{k}": v for k, v in optim.items()}}
    assert any("amax_history" in k for k in whole) and any("exp_avg_sq" in k for k in whole)
    for r, rr in enumerate(ranks):
        pieces = rr["dcp"][which]
        assert pieces.keys() == whole.keys(), f"rank {r} {what}: keys {sorted(pieces.keys() ^ whole.keys())}"
        got = {k: t for k, (t, _, _) in pieces.items()}
        want = {k: _piece_of(whole[k], dim, chunks, r) for k, (_, dim, chunks) in pieces.items()}
        assert_bitwise_equal(got, want, f"rank {r}: {what}")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[list, Path, tuple[dict, dict]]:
    """One spawn of four ranks for both tests (starting four processes is a large part of either):
    (the ranks' results, their directory, the one-process checkpoint they loaded)."""
    tmp_path = tmp_path_factory.mktemp("tp_fsdp")
    single = _single_process_checkpoint(tmp_path / "single")
    tq.distributed.checkpoint.save(_odd_fused(2), None, tmp_path / "odd_single")
    return run_ranks(_rank_checks, WORLD, tmp_path, deadline_s=600), tmp_path, single


def test_tp_x_fsdp2_and_hsdp_four_ranks(spawned):
    start = time.perf_counter()
    ranks, tmp_path, single = spawned
    res = ranks[0]
    for name in RECIPES:
        assert all(r["parity"][name][0] == res["parity"][name][0] for r in ranks), f"{name}: ranks' losses differ"
    for name in ("fp8_tensorwise", "mxfp8"):
        for r, rr in enumerate(ranks):
            counts = rr["parity"][name + " compile"]
            assert counts == (True, 0, 0, 0), (
                f"rank {r} {name}: (compiled, new graphs after step 1, recompiles, breaks) = {counts}"
            )
    limits = {"fp8_tensorwise": 0.55, "fp8_rowwise": 0.55, "fp8_delayed": 0.55, "mxfp8": 0.55, "nvfp4_rne": 0.30}
    for name, limit in limits.items():
        assert res["bytes"][name] <= limit, f"{name}: weight all-gather {res['bytes'][name]:.3f}x bf16 (limit {limit})"
    # DCP TP2xFSDP2 -> 1: what the 4 ranks held (fused fc1 included), loaded into one process, bit for bit.
    _check_pieces(ranks, 0, *_load_single_process(tmp_path / "ckpt"), "saved state, loaded into one process")
    # DCP 1 -> TP2xFSDP2 (fused fc1): every rank's pieces are the one-process state's.
    _check_pieces(ranks, 1, *single, "one-process checkpoint loaded")
    odd = _odd_fused(3)
    tq.distributed.checkpoint.load(odd, None, tmp_path / "odd")
    assert_bitwise_equal(dict(odd.state_dict()), dict(_odd_fused(0).state_dict()), "uneven fused: TP2xFSDP2 -> one process")
    print("\nTP2xFSDP2 parity (max relative loss diff, max relative param-norm diff):", {k: v for k, v in res["parity"].items()})
    print("weight all-gather bytes / bf16:", {k: round(v, 3) if k != "bf16" else v for k, v in res["bytes"].items()})
    print("seconds per check (rank 0):", {k: round(v, 1) for k, v in res["timings"].items()})
    print(f"test total: {time.perf_counter() - start:.1f} s")


def test_tensor_parallel_with_fsdp2_on_a_2d_mesh(spawned):
    """TP=2 inside, stock `fully_shard` on the dp dim outside: the losses follow the single-process
    run; blocks compiled before sharding keep no breaks (its checks run in the spawn above)."""
    ranks = [{name: r[f"gpt_tp_inside_fsdp2_{name}"] for name in GPT_RECIPES} for r in spawned[0]]
    for r, res in enumerate(ranks):
        assert res == ranks[0], f"rank {r} disagrees with rank 0: {res} vs {ranks[0]}"
        # Compiled in step 1 (FSDP2's hooks around the block are traced as frames of their own),
        # then nothing new: no graphs, no recompiles, no graph breaks.
        counts = res["fp8_tensorwise"][1]
        assert counts == (True, 0, 0, 0), f"rank {r}: (compiled, new graphs after step 1, recompiles, graph breaks) = {counts}"
    print("\nTP=2 x FSDP2=2 losses:", ranks[0])
