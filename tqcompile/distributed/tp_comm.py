"""Shard-aware quantization and quantized collectives: the pieces the tensor-parallel styles use.

`quantize_shard` quantizes one rank's piece of a tensor split over a group so that the result is
exactly the matching slice of quantizing the whole tensor in one process (payload and scales bit
for bit). What has to be reduced over the group depends on the scaling unit:

- a tensor-level amax (tensorwise FP8/INT, NVFP4's fp32 scale): MAX all-reduced (`tq.quantize`'s
  `amax_group`);
- per-row scales whose rows run *along* the split dim (e.g. rowwise FP8 of a K-sharded operand):
  the per-row amaxes are MAX all-reduced, and the op is given them;
- blocks (1x128, 128x128, MX 32, NVFP4 16 / 16x16) along the split dim: nothing to reduce, but
  each shard must hold whole blocks, which `check_shard` enforces with an error naming the fix.

`all_gather_tokens` all-gathers QuantizedTensors split along their token dim (sequence
parallelism) in one collective: payloads and the scales that differ between ranks go on the wire
as `uint8` bytes (gloo cannot move float8: "Invalid scalar type"); scales that are equal on every
rank after the reduction (tensorwise, or rowwise along the tokens) stay local.

Tokens are ordered batch-major, as a (batch, seq, features) activation flattens: rank r holds
positions [r * s, (r + 1) * s) of every sequence, so a gather interleaves the ranks' pieces per
batch row. Blocks along the tokens must then not straddle sequences: the per-rank sequence
length `s` must be a multiple of the block.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from tqcompile import ops
from tqcompile.api import quantize
from tqcompile.groups import all_reduce_amax
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.tensor import QuantizedTensor

# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

__all__ = [
    "quantize_shard",
    "check_shard",
    "all_gather_tokens",
    "all_gather_seq",
    "reduce_scatter_seq",
    "all_reduce_sum",
]

_ROW, _COL = "rowwise", "columnwise"


_INNER = ("_data", "_scale_inv", "_amax", "_data_t", "_scale_inv_t", "_amax_t")


def _inner(qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    # Attribute reads, not QuantizedTensor._inner(): Dynamo treats a method call on a tensor
    # returning a dict as a torch op returning a non-tensor, and refuses it.
    return {n: getattr(qt, n) for n in _INNER if getattr(qt, n) is not None}


def _rebuild(qt: QuantizedTensor, shape, **inner) -> QuantizedTensor:
    return QuantizedTensor(shape, qt.quantizer, qt.orig_dtype, qt.amax_group_name, **inner)


def _split_in_usage(split_dim: int, usage: str) -> int:
    """The dim of the usage's 2-D tensor that is split: rowwise is x (M, K), columnwise x.t() (K, M)."""
    return split_dim if usage == _ROW else 1 - split_dim


def check_shard(q: Quantizer, local_len: int, world: int, split_dim: int, usage: str, what: str, *, tokens: bool = False) -> None:
    """Raise a ValueError if a shard of `local_len` elements along `split_dim` would cut a block of `q`.

    `tokens`: the split is sequence parallelism's, along the sequence (token) dimension, so the
    message says to change the sequence length (or pad it) rather than the layer's size."""
    gran, _, block = q.layout()
    blocked = {Granularity.BLOCKWISE_1D: (1,), Granularity.BLOCKWISE_2D: (0, 1)}.get(gran, ())
    if _split_in_usage(split_dim, usage) in blocked and local_len % block:
        if tokens:
            raise ValueError(
                f"{what}: tensor parallelism splits the sequence (token) dimension over {world} ranks, so each rank holds "
                f"{local_len} tokens (of a sequence length {local_len * world}), which cuts the {block}-element blocks of "
                f"its {usage} {type(q).__name__} ({gran.name}); use a sequence length that is a multiple of tp_degree x block "
                f"= {world} x {block} = {block * world} (pad the sequence to it), or a recipe without such blocks"
            )
        raise ValueError(
            f"{what}: each of the {world} tensor-parallel shards holds {local_len} elements along the split dim "
            f"(of {local_len * world}), which cuts the {block}-element blocks of its {usage} {type(q).__name__} "
            f"({gran.name}); every shard must hold whole blocks: make that size a multiple of {block} per rank "
            f"({block * world} in all, e.g. by padding) or use a TP degree that divides it into whole blocks"
        )


def _rows_reduced(q: Quantizer, split_dim: int, usage: str) -> bool:
    gran, axis, _ = q.layout()
    return gran is Granularity.ROWWISE and axis % 2 == _split_in_usage(split_dim, usage)


def _finite_row_amax(x: torch.Tensor, axis: int) -> torch.Tensor:
    # The reference kernel's per-unit amax (fp32 |x| with non-finite values as 0); max is exact, so
    # reducing these over ranks gives the whole tensor's per-row amax bit for bit.
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device)).amax(dim=axis, keepdim=True)


def quantize_shard(
    x: torch.Tensor,
    quantizer: Quantizer,
    group_name: str,
    split_dim: int,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    seed: torch.Tensor | None = None,
    amax_history: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize this rank's piece `x` (2-D) of a tensor split along `split_dim` over `group_name`.

    The result equals the slice of `tq.quantize(full, quantizer, rowwise=..., columnwise=...)`
    that this rank holds, bit for bit (blocks along the split dim must be whole: see `check_shard`).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_shard: expected a 2-D tensor, got shape {tuple(x.shape)}")
    usages = [u for u, on in ((_ROW, rowwise), (_COL, columnwise)) if on]
    reduced = [u for u in usages if _rows_reduced(quantizer, split_dim, u)]
    plain = [u for u in usages if u not in reduced]
    inner: dict[str, torch.Tensor] = {}
    if plain:
        qt = quantize(
            x,
            quantizer,
            amax_group=group_name,
            rowwise=_ROW in plain,
            columnwise=_COL in plain,
            seed=seed,
            amax_history=amax_history,
        )
        inner.update(_inner(qt))
    for usage in reduced:
        xu = x if usage == _ROW else x.t()
        axis = quantizer.layout()[1] % 2
        row_amax = all_reduce_amax(_finite_row_amax(xu, axis), group_name)
        # The reference kernel scales with the amax it is given, per row for ROWWISE quantizers
        # (Triton's `supports` sends such calls to it); the per-row amax is not kept on the tensor,
        # whose `_amax` is the tensor-level one.
        data, scale_inv = ops.quantize(xu, quantizer, row_amax, seed)
        suffix = "" if usage == _ROW else "_t"
        inner["_data" + suffix], inner["_scale_inv" + suffix] = data, scale_inv
    return QuantizedTensor(x.shape, quantizer, x.dtype, group_name, **inner)


def columnwise_from_rowwise(qt: QuantizedTensor) -> QuantizedTensor:
    """The columnwise usage of a 2-D QuantizedTensor whose quantizer `columnwise_is_byte_transpose()`, from its rowwise usage."""
    return _rebuild(qt, qt.shape, _data_t=qt._data.t().contiguous(), _scale_inv_t=qt._scale_inv, _amax_t=qt._amax)


# --- sequence-dim collectives -------------------------------------------------------------------
def _gathered(name: str, q: Quantizer) -> bool:
    """Whether inner tensor `name` differs between ranks split along the tokens (and is gathered)."""
    if name.startswith("_data"):
        return True
    if name.startswith("_amax"):
        return False
    gran, axis, _ = q.layout()
    mdim = 1 if name.endswith("_t") else 0  # the token dim: rows of x, columns of x.t()
    if gran is Granularity.TENSORWISE:
        return False
    if gran is Granularity.ROWWISE:
        return axis % 2 != mdim  # rows along the tokens were reduced: equal on every rank
    return True


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _from_bytes(b: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return (b if like.dtype == torch.uint8 else b.view(like.dtype)).reshape(shape)


def _interleave(t: torch.Tensor, world: int, mdim: int, batch: int) -> torch.Tensor:
    """(world, a, b) pieces, one per rank -> the tensor along the tokens (dim `mdim`), batch-major."""
    piece = t.shape[1:]
    if mdim == 0:
        t = t.reshape(world, batch, piece[0] // batch, piece[1]).permute(1, 0, 2, 3)
        return t.reshape(world * piece[0], piece[1])
    t = t.reshape(world, piece[0], batch, piece[1] // batch).permute(1, 2, 0, 3)
    return t.reshape(piece[0], world * piece[1])


def _gather_pieces(pieces: list[tuple[torch.Tensor, int]], group_name: str, world: int, batch: int) -> list[torch.Tensor]:
    """All-gather 2-D tensors split along (their dim `mdim`) the tokens, in one uint8 collective."""
    flat = [_to_bytes(t) for t, _ in pieces]
    sizes = [f.numel() for f in flat]
    buf = funcol.wait_tensor(_all_gather(torch.cat(flat), 0, group_name)).reshape(world, sum(sizes))
    out = []
    for (t, mdim), part in zip(pieces, buf.split(sizes, dim=1)):
        rows = _from_bytes(part.contiguous(), t, (world, *t.shape))
        out.append(_interleave(rows, world, mdim, batch))
    return out


def all_gather_tokens(qts: list[QuantizedTensor], group_name: str, world: int, batch: int) -> list[QuantizedTensor]:
    """All-gather 2-D QuantizedTensors whose rows (tokens, `batch`-major) are split over the group,
    in one collective. Their token-split quantization must come from `quantize_shard(split_dim=0)`."""
    pieces, where = [], []
    for i, qt in enumerate(qts):
        q = qt.quantizer
        for name, t in _inner(qt).items():
            if _gathered(name, q):
                if name == "_scale_inv_t" and q.flat_columnwise_scale():  # gathered as (K, T // block)
                    t = t.view(q.scale_shape(q.logical_shape(qt._data_t.shape)))
                pieces.append((t, 1 if name.endswith("_t") else 0))
                where.append((i, name))
    gathered = _gather_pieces(pieces, group_name, world, batch)
    inners = [_inner(qt) for qt in qts]
    for (i, name), t in zip(where, gathered):
        flat = name == "_scale_inv_t" and qts[i].quantizer.flat_columnwise_scale()
        inners[i][name] = t.reshape(-1) if flat else t
    return [_rebuild(qt, (world * qt.shape[0], qt.shape[1]), **inner) for qt, inner in zip(qts, inners)]


def all_gather_seq(x: torch.Tensor, group_name: str, world: int, batch: int) -> torch.Tensor:
    """High-precision all-gather of a 2-D tensor split along its (batch-major) token rows."""
    return _gather_pieces([(x, 0)], group_name, world, batch)[0]


def reduce_scatter_seq(x: torch.Tensor, group_name: str, world: int, batch: int) -> torch.Tensor:
    """SUM reduce-scatter of a 2-D (tokens, features) tensor to this rank's part of each sequence."""
    m, n = x.shape
    x = x.reshape(batch, world, m // (batch * world), n).transpose(0, 1).reshape(m, n)
    return funcol.wait_tensor(_reduce_scatter(x.contiguous(), "sum", 0, group_name))


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))
