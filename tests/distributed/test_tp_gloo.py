"""Tensor and sequence parallelism of converted layers: two CPU ranks over gloo.

One spawn runs every check (starting processes and compiling are the slow part); a failing rank
writes its traceback and makes the test fail at once, and the whole spawn runs under a deadline.
What each rank checks:

1. scales with a planted outlier in the shard the *other* rank holds, bit for bit equal to the
   single-process quantization: sequence-split activations (quantized, then all-gathered),
   N-split gradients, colwise (N-split) and rowwise (K-split) weights, rowwise scales along a
   sharded K; and that the local-only quantization would differ (the checks can fail);
2. bytes on the wire of the sequence-parallel all-gather, counted at the collective;
3. one shared quantized gather serving q, k and v, equal to the single-process layers, eager and
   compiled;
4. parity: a few AdamW steps of the demo GPT with TP=2 + SP against one process, every recipe;
5. compile: the TP blocks compiled with fullgraph=True: no graph breaks, no recompiles;
6. bad input: a group this rank is not in, shards that cut blocks, wrong meshes and styles.

(TP=2 inside stock FSDP2 on a 2-D mesh runs in the four-rank spawn of test_tp_fsdp_gloo.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import tqcompile as tq
from tqcompile.demo import GPT, GPTConfig, parallelize_gpt, quantize_model
from tqcompile.distributed import tp_comm
from tqcompile.testing import run_checks, run_ranks
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

WORLD = 2
DEADLINE_S = 600
# Every per-rank size a multiple of 128, so every recipe's blocks (128x128 weight tiles included) stay whole.
CFG = GPTConfig(n_layer=2, seq_len=256, d_model=256, n_head=4, mlp_hidden=512)
BATCH = 2

QUANTIZERS = {
    "fp8_tensorwise": tq.Float8Quantizer(),
    "fp8_rowwise": tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE, power_of_two_scale=True),
    "fp8_1x128": tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_1D, power_of_two_scale=True),
    "fp8_128x128": tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_2D, power_of_two_scale=True),
    "mxfp8": tq.MXQuantizer(scale_rounding=tq.ScaleRounding.RCEIL),
    "nvfp4": tq.NVFP4Quantizer(),
    "nvfp4_16x16": tq.NVFP4Quantizer(block_2d=True),
    "nvfp4_hadamard": tq.NVFP4Quantizer(hadamard=True, hadamard_seed=3),
}


PARITY_RECIPES = [n for n in tq.recipes.RECIPES if n != "nvfp4"]


# --- helpers ---------------------------------------------------------------------------------------
def _inner(qt) -> dict[str, torch.Tensor]:
    return {n: getattr(qt, n) for n in qt.__tensor_flatten__()[0]}


def _slice_of(ref, split_dim: int, rank: int) -> dict[str, torch.Tensor]:
    """The part of the single-process quantization `ref` that the rank holding chunk `rank` of
    `split_dim` must have: every inner tensor chunked along that dim of its usage, except scales
    that are whole along it (tensor amaxes/scales, per-row scales along the split)."""
    out, q = {}, ref.quantizer
    for name, t in _inner(ref).items():
        d = split_dim if not name.endswith("_t") else 1 - split_dim
        flat = name == "_scale_inv_t" and q.flat_columnwise_scale()  # chunked as (K, R // block)
        if flat:
            t = t.view(q.scale_shape(q.logical_shape(ref._data_t.shape)))
        out[name] = t if t.dim() == 0 or t.shape[d] == 1 else t.chunk(WORLD, dim=d)[rank]
        if flat:
            out[name] = out[name].reshape(-1)
    return out


def _planted(shape, seed: int, where: tuple[int, int]) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x[where] = 300.0  # an outlier in the other rank's shard
    return x


class _CollectiveBytes(TorchDispatchMode):
    """Counts the bytes each rank sends into all-gathers (what goes on the wire), by dtype."""

    def __init__(self):
        super().__init__()
        self.gathers: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.gathers.append((args[0].dtype, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(b for _, b in self.gathers)


# --- 1. scales with a planted outlier ----------------------------------------------------------------
def _check_scales(rank: int, group: str) -> None:
    other = 1  # the outlier sits in rank 1's shard: rank 0 can only get it through the reduction
    # Sequence-split activations (b, s, K) and sequence-split gradients: rank r holds s/2 positions
    # of every sequence; quantized on the shard, then all-gathered quantized.
    b, s, k = 2, 256, 256
    full = _planted((b, s, k), 1, (1, other * s // 2 + 7, 5))
    local = full.chunk(WORLD, dim=1)[rank].reshape(-1, k)
    for name, q in QUANTIZERS.items():
        if name.endswith("16x16") or name.endswith("128x128"):
            continue  # weight formats
        ref = tq.quantize(full.reshape(-1, k), q, rowwise=True, columnwise=True)
        shard = tp_comm.quantize_shard(local, q, group, 0, rowwise=True, columnwise=True)
        gathered = tp_comm.all_gather_tokens([shard], group, WORLD, b)[0]
        assert_bitwise_equal(_inner(gathered), _inner(ref), f"activation {name} gathered")
        assert gathered.amax_group_name == group
        if q.uses_tensor_amax() and rank == 0:
            unreduced = tq.quantize(local, q)
            assert not torch.equal(unreduced._amax, ref._amax), f"{name}: the outlier must be in the other shard"

    # Weights: colwise (split on N, dim 0) and rowwise (split on K, dim 1); gradients of a colwise
    # layer's output (split on N, dim 1 of dy).
    n = 256
    cases = [
        ("colwise weight", 0, (n, k), (other * n // 2 + 3, 9)),
        ("rowwise weight (K sharded)", 1, (n, k), (11, other * k // 2 + 3)),
        ("output gradient (N sharded)", 1, (512, n), (40, other * n // 2 + 1)),
    ]
    for what, split, shape, where in cases:
        full = _planted(shape, 2, where)
        local = full.chunk(WORLD, dim=split)[rank]
        for name, q in QUANTIZERS.items():
            ref = tq.quantize(full, q, rowwise=True, columnwise=True)
            shard = tp_comm.quantize_shard(local, q, group, split, rowwise=True, columnwise=True)
            assert_bitwise_equal(_inner(shard), _slice_of(ref, split, rank), f"{what} {name}")
            if name == "fp8_rowwise" and rank == 0:
                # Per-row scales along the sharded dim: without the reduction they would differ.
                lone = tq.quantize(local, q, rowwise=True, columnwise=True)
                usage = "_scale_inv" if split == 1 else "_scale_inv_t"
                assert not torch.equal(getattr(lone, usage), _slice_of(ref, split, rank)[usage]), what


# --- 2. bytes on the wire -----------------------------------------------------------------------------
def _colwise_layer(recipe: tq.Recipe, mesh, d: int = 256) -> nn.Module:
    torch.manual_seed(5)
    layer = tq.convert(nn.Sequential(nn.Linear(d, d, bias=False)), recipe)[0]
    return parallelize_module(layer, mesh, tq.distributed.ColwiseParallel(input_layouts=Shard(1)))


def _check_bytes(rank: int, mesh) -> dict:
    x = torch.randn(BATCH, 128, 256, generator=torch.Generator().manual_seed(6 + rank))
    bf16 = x.numel() * 2
    ratios = {}
    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4"):
        layer = _colwise_layer(tq.recipes.get(name), mesh)
        with torch.no_grad(), _CollectiveBytes() as fwd:
            layer(x)
        assert len(fwd.gathers) == 1 and {dt for dt, _ in fwd.gathers} == {torch.uint8}, fwd.gathers
        xg = x.clone().requires_grad_()
        with _CollectiveBytes() as step:
            layer(xg).sum().backward()
        ratios[name] = (fwd.total / bf16, step.total / bf16)
    bound = {"nvfp4": 0.30}
    for name, (forward, _) in ratios.items():
        assert forward <= bound.get(name, 0.55), f"{name}: the forward all-gather moved {forward:.3f}x the bytes of bf16"
    # Tensorwise FP8 derives wgrad's columnwise input by transposing: nothing more is gathered.
    assert ratios["fp8_tensorwise"][1] == ratios["fp8_tensorwise"][0]
    return ratios


# --- 3. one quantized gather for q, k and v ---------------------------------------------------------
class _QKV(nn.Module):
    """Three projections of one input and an output projection: attention's communication pattern
    (the mixing is elementwise, so each rank's slice of features is self-contained)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b = x.shape[0]  # module code reading the shape runs unchanged on the gathered input
        h = F.gelu(self.q(x)) * self.k(x) + self.v(x)
        return self.o(h.reshape(b, -1, h.shape[-1]))


def _qkv_pair(recipe, mesh, shared: bool):
    torch.manual_seed(7)
    ref = tq.convert(_QKV(256), recipe)
    tp = copy.deepcopy(ref)
    if shared:
        parallelize_module(tp, mesh, tq.distributed.QuantizedSequenceParallelInput())
        plan = {p: tq.distributed.ColwiseParallel() for p in "qkv"}
    else:
        plan = {p: tq.distributed.ColwiseParallel(input_layouts=Shard(1)) for p in "qkv"}
    plan["o"] = tq.distributed.RowwiseParallel(output_layouts=Shard(1))
    return ref, parallelize_module(tp, mesh, plan)


def _check_shared_gather(rank: int, mesh) -> dict:
    counts = {}
    for name in ("fp8_tensorwise", "mxfp8", "nvfp4"):
        recipe = tq.recipes.get(name) if name != "nvfp4" else tq.recipes.nvfp4(stochastic_rounding=False)
        full = torch.randn(BATCH, 256, 256, generator=torch.Generator().manual_seed(8))
        results = {}
        for shared in (True, False):
            ref, tp = _qkv_pair(recipe, mesh, shared)
            x_ref = full.clone().requires_grad_()
            y_ref = ref(x_ref)
            y_ref.square().sum().backward()
            x = full.chunk(WORLD, dim=1)[rank].clone().requires_grad_()
            with _CollectiveBytes() as wire:
                y = tp(x)
                y.square().sum().backward()
            torch.testing.assert_close(y, y_ref.chunk(WORLD, dim=1)[rank], rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(x.grad, x_ref.grad.chunk(WORLD, dim=1)[rank], rtol=2e-6, atol=2e-6)
            for (pn, p_ref), (_, p) in zip(ref.named_parameters(), tp.named_parameters()):
                torch.testing.assert_close(
                    p.grad.full_tensor(), p_ref.grad, rtol=2e-6, atol=2e-6, msg=lambda m, pn=pn, name=name: f"{name} {pn}: {m}"
                )
            results[shared] = (len(wire.gathers), y.detach())
        # The shared gather moves x once for all three projections (plus o's gradient gather).
        assert results[True][0] < results[False][0], (name, results[True][0], results[False][0])
        torch.testing.assert_close(results[True][1], results[False][1], rtol=0, atol=0)
        counts[name] = (results[True][0], results[False][0])

    # Compiled: the shared gather (a pre-hook) and its consumers in one graph, no breaks, no
    # recompiles. (`module.compile()` would trace the hook and forward as two frames, with the
    # gathered QuantizedTensors passing between them as graph output and input.)
    ref, tp = _qkv_pair(tq.recipes.fp8_tensorwise(), mesh, True)
    counter = CompileCounter("aot_eager")
    step_fn = torch.compile(lambda x: tp(x), backend=counter, fullgraph=True)
    for step in range(2):
        x = torch.randn(BATCH, 128, 256, generator=torch.Generator().manual_seed(9 + step)).requires_grad_()
        step_fn(x).sum().backward()
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), (
        counter.frame_count,
        counter.recompiles,
        counter.break_reasons,
    )
    return counts


# --- 4. parity with the single-process run ------------------------------------------------------------
def _batches(steps: int):
    g = torch.Generator().manual_seed(10)
    return [
        (torch.randint(0, 256, (BATCH, CFG.seq_len), generator=g), torch.randint(0, 256, (BATCH, CFG.seq_len), generator=g))
        for _ in range(steps)
    ]


def _train(model, batches, counter=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    losses = []
    for tokens, targets in batches:
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_parity(rank: int, mesh, steps: int = 3) -> dict:
    batches = _batches(steps)
    worst = {}
    for name in PARITY_RECIPES + ["nvfp4_rne"]:
        recipe = tq.recipes.nvfp4(stochastic_rounding=False) if name == "nvfp4_rne" else tq.recipes.get(name)
        torch.manual_seed(0)
        ref = quantize_model(GPT(CFG), recipe)
        tp = parallelize_gpt(copy.deepcopy(ref), mesh)
        ref_losses, tp_losses = _train(ref, batches), _train(tp, batches)
        loss_diff = max((abs(a - b) / b).item() for a, b in zip(tp_losses, ref_losses))
        param_diff = max(_rel_norm(_full(p), q) for p, q in zip(tp.parameters(), ref.parameters()))
        worst[name] = (loss_diff, param_diff)
        # Both runs quantize the same values with the same scales; only the fp32 order of the TP
        # partial sums differs (within the bound _check_summation_bound checks). Downstream, an
        # element that lies within that difference of a rounding boundary of the next quantizer
        # moves by one step of its format (1/8 for E4M3, 1/4 for E5M2 gradients): that, not the
        # fp32 difference itself, is what the model-level numbers below measure
        # (docs/tensor_parallel.md, "Parity"; measured: loss <= 2.3e-4, parameters <= 1.0e-2).
        assert loss_diff <= 1e-3, f"{name}: losses differ by {loss_diff:.2e} relative (TP {tp_losses}, single {ref_losses})"
        assert param_diff <= 3e-2, f"{name}: parameters differ by {param_diff:.2e} (relative norm) after {steps} steps"
    return worst


def _check_summation_bound(rank: int, mesh) -> dict:
    """The one thing TP changes: the fp32 order of the partial sums over the split dim. Both runs
    multiply the same quantized operands, so each result is within Higham's dot-product bound
    gamma_n * (|a| @ |b|), gamma_n = n*u / (1 - n*u), u = 2**-24, of the exact product, and the two
    runs within twice that of each other (n: the reduction length plus the partial-sum additions
    and the scalings)."""
    worst = {}
    u = 2.0**-24
    d = 256
    for name in PARITY_RECIPES + ["nvfp4_rne"]:
        recipe = tq.recipes.nvfp4(stochastic_rounding=False) if name == "nvfp4_rne" else tq.recipes.get(name)
        torch.manual_seed(11)
        ref = tq.convert(nn.Sequential(nn.Linear(d, d, bias=False)), recipe)[0]
        row = parallelize_module(copy.deepcopy(ref), mesh, tq.distributed.RowwiseParallel())
        col = parallelize_module(copy.deepcopy(ref), mesh, tq.distributed.ColwiseParallel())
        x = torch.randn(BATCH, 128, d, generator=torch.Generator().manual_seed(12))
        dy = torch.randn(BATCH, 128, d, generator=torch.Generator().manual_seed(13))
        # fprop of a rowwise layer: y is a partial sum over the K shards.
        y_ref = ref(x)
        y_tp = row(x.chunk(WORLD, dim=-1)[rank])
        xq = tq.quantize(x.reshape(-1, d), recipe.fprop_input).dequantize()
        wq = tq.quantize(ref.weight.detach(), recipe.fprop_weight).dequantize()
        gamma = (d + 8) * u / (1 - (d + 8) * u)
        bound = 2 * gamma * (xq.abs() @ wq.abs().t())
        err_y = ((y_tp - y_ref).reshape(-1, d).abs() / bound).max().item()
        # dgrad of a colwise layer: dx is a partial sum over the N shards (replicated input).
        x_ref = x.clone().requires_grad_()
        ref(x_ref).backward(dy)
        x_col = x.clone().requires_grad_()
        col(x_col).backward(dy.chunk(WORLD, dim=-1)[rank])
        dyq = tq.quantize(dy.reshape(-1, d), recipe.dgrad_grad).dequantize()
        wtq = tq.quantize(ref.weight.detach(), recipe.dgrad_weight, rowwise=False, columnwise=True).dequantize()
        bound_dx = 2 * gamma * (dyq.abs() @ wtq.abs())
        err_dx = ((x_col.grad - x_ref.grad).reshape(-1, d).abs() / bound_dx).max().item()
        worst[name] = (err_y, err_dx)
        assert err_y <= 1 and err_dx <= 1, (
            f"{name}: TP differs from single-process by {err_y:.2f} / {err_dx:.2f} of the fp32 bound (y / dx)"
        )
    return worst


# --- 5. compile ---------------------------------------------------------------------------------------
def _check_compile(rank: int, mesh) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = parallelize_gpt(quantize_model(GPT(CFG), tq.recipes.fp8_tensorwise()), mesh)
    eager = copy.deepcopy(model)
    counter = CompileCounter("aot_eager")
    for block in model.blocks:  # compile the blocks after sharding them
        block.compile(backend=counter, fullgraph=True)
    batches = _batches(3)
    compiled_losses, eager_losses = _train(model, batches), _train(eager, batches)
    # aot_eager decomposes RMSNorm, GELU and attention into other fp32 orders: the same bound as parity.
    for a, b in zip(compiled_losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=0)
    return counter.frame_count, counter.recompiles, counter.graph_breaks


# --- 6. bad input -------------------------------------------------------------------------------------
def _check_bad_input(rank: int, mesh) -> None:
    only_rank0 = dist.new_group(ranks=[0])
    x = torch.randn(128, 256)
    if rank == 1:
        with pytest.raises(ValueError, match="not a member of the process group"):
            tp_comm.quantize_shard(x, QUANTIZERS["fp8_tensorwise"], only_rank0, 0)
    # A K shard of 64 cuts fp8_blockwise's 128-element blocks.
    layer = tq.nn.Linear(128, 256, bias=False, recipe=tq.recipes.fp8_blockwise())
    with pytest.raises(
        ValueError,
        match=r"holds 64 elements along the split dim \(of 128\).*blocks of its rowwise Float8Quantizer.*multiple of 128 per rank",
    ):
        parallelize_module(layer, mesh, tq.distributed.RowwiseParallel())
    # An N shard of 8 cuts MX... no: MX blocks run along K; NVFP4's 16x16 weight tiles along N.
    layer = tq.nn.Linear(256, 16, bias=False, recipe=tq.recipes.nvfp4())
    with pytest.raises(ValueError, match=r"holds 8 elements.*16-element blocks"):
        parallelize_module(layer, mesh, tq.distributed.ColwiseParallel())
    # A sequence shard that cuts the 32-blocks MXFP8 takes along the tokens for wgrad.
    layer = _colwise_layer(tq.recipes.mxfp8(), mesh)
    with pytest.raises(
        ValueError,
        match=r"splits the sequence \(token\) dimension over 2 ranks, so each rank holds 16 tokens.*32-element blocks of its "
        r"columnwise MXQuantizer.*multiple of tp_degree x block = 2 x 32 = 64 \(pad the sequence",
    ):
        layer(torch.randn(1, 16, 256, requires_grad=True))
    with pytest.raises(ValueError, match="input_layouts=Shard"):
        parallelize_module(
            tq.nn.Linear(256, 256, recipe=tq.recipes.mxfp8()), mesh, tq.distributed.ColwiseParallel(input_layouts=Shard(2))
        )
    with pytest.raises(TypeError, match="use ColwiseParallel"):
        parallelize_module(tq.nn.Linear(256, 256, recipe=tq.recipes.mxfp8()), mesh, tq.distributed.SequenceParallel())
    with pytest.raises(ValueError, match="delayed scaling"):
        parallelize_module(tq.convert(_QKV(256), tq.recipes.fp8_delayed()), mesh, tq.distributed.QuantizedSequenceParallelInput())
    mesh2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="1-D tensor-parallel mesh"):
        parallelize_module(tq.nn.Linear(256, 256, recipe=tq.recipes.mxfp8()), mesh2d, tq.distributed.ColwiseParallel())


# --- DCP of a fused ColwiseParallel layer (fused_chunks=3: its DTensor is placed _StridedShard) -------
def _fused_model(seed: int, tp_mesh=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A converted fused-projection layer and an AdamW with state (one step taken)."""
    torch.manual_seed(seed)
    model = tq.convert(nn.Sequential(nn.Linear(128, 384)), tq.recipes.mxfp8())
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, {"0": tq.distributed.ColwiseParallel(fused_chunks=3)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(32, 128)).float().square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor, whole (gathered from its DTensor)."""
    out = {f"param/{n}": _full(p).detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = _full(v).clone() if v.dim() else v.clone()
    return out


def _check_fused_checkpoint(rank: int, mesh, out_dir: str) -> dict[str, torch.Tensor]:
    """Load the parent's 1-process checkpoint into TP2 fused (bit for bit), then save from TP2 fused
    (for the parent to load into 1 process) and load it back into TP2 fused; returns the saved full state."""
    model, opt = _fused_model(1, mesh)
    tq.distributed.checkpoint.load(model, opt, f"{out_dir}/fused_one")
    expected = torch.load(f"{out_dir}/fused_one.pt")
    got = _full_state(model, opt)
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for k in expected:
        assert_bitwise_equal(got[k], expected[k])
    model(torch.randn(32, 128)).float().square().sum().backward()
    opt.step()
    tq.distributed.checkpoint.save(model, opt, f"{out_dir}/fused_tp")
    saved = _full_state(model, opt)
    model, opt = _fused_model(3, mesh)  # and back into TP2 fused
    tq.distributed.checkpoint.load(model, opt, f"{out_dir}/fused_tp")
    for k, v in _full_state(model, opt).items():
        assert_bitwise_equal(v, saved[k])
    return saved


# --- the spawn ----------------------------------------------------------------------------------------
def _rank_checks(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group().group_name
    checks = [
        ("scales", lambda: _check_scales(rank, group)),
        ("bad_input", lambda: _check_bad_input(rank, mesh)),
        ("bytes", lambda: _check_bytes(rank, mesh)),
        ("shared", lambda: _check_shared_gather(rank, mesh)),
        ("summation_bound", lambda: _check_summation_bound(rank, mesh)),
        ("parity", lambda: _check_parity(rank, mesh)),
        ("compile", lambda: _check_compile(rank, mesh)),
        ("fused_checkpoint", lambda: _check_fused_checkpoint(rank, mesh, out_dir)),
    ]
    torch.save(run_checks(rank, checks), f"{out_dir}/rank{rank}.pt")


def test_tensor_parallel_two_ranks(tmp_path):
    model, opt = _fused_model(0)  # a 1-process checkpoint for the ranks to load into TP2 fused
    tq.distributed.checkpoint.save(model, opt, tmp_path / "fused_one")
    torch.save(_full_state(model, opt), tmp_path / "fused_one.pt")
    ranks = run_ranks(_rank_checks, WORLD, tmp_path, deadline_s=DEADLINE_S)
    model, opt = _fused_model(2)  # and the ranks' TP2 fused checkpoint into 1 process, bit for bit
    tq.distributed.checkpoint.load(model, opt, tmp_path / "fused_tp")
    got = _full_state(model, opt)
    assert got.keys() == ranks[0]["fused_checkpoint"].keys()
    for k, v in ranks[0]["fused_checkpoint"].items():
        assert_bitwise_equal(got[k], v)
    for r, res in enumerate(ranks):
        assert res["compile"] == (CFG.n_layer, 0, 0), f"rank {r}: (graphs, recompiles, graph breaks) = {res['compile']}"
    assert ranks[0]["parity"] == ranks[1]["parity"], "every rank computes the same loss"
    print("\nTP parity (max relative loss diff, max relative param-norm diff):", ranks[0]["parity"])
    print("TP vs single-process GEMM difference / fp32 bound (y, dx):", ranks[0]["summation_bound"])
    print("SP all-gather bytes / bf16 (forward, training step):", ranks[0]["bytes"])
    print("all-gathers per step, shared vs per layer:", ranks[0]["shared"])
    print("seconds per check (rank 0):", {k: round(v, 1) for k, v in ranks[0]["timings"].items()})
