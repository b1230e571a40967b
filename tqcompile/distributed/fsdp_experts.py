"""What one FSDP2 quantized all-gather of a converted experts module's 3-D weight moves, and the pure
functions that pack a shard and unpack the gathered buffers (the 3-D counterpart of `fsdp_layout`;
`tqcompile.distributed.fsdp` runs the hooks).

FSDP2 shards dim 0, the experts: each rank holds whole experts, and every expert is quantized with
its own scales (`tq.nn.grouped.quantize_expert_weight`), so a rank quantizes its experts alone (no
amax collective at all) into exactly the bytes a single process gets for them. Per gather a rank
packs the usages the pass needs, as the grouped GEMMs read them: fprop's (E*N, K) operand and / or
dgrad's per-expert transposes (E*K, N), payload, scales and (NVFP4) per-expert amaxes, in one
uint8 buffer; the gathered buffers concatenate along the experts into a `GroupedQuantizedTensor`
(`tqcompile.tensor`) in the parameter's stored shape: for a transposed layout (E, in, out),
GPT-OSS's, fprop's operand is the columnwise usage, which ``transpose(1, 2)`` makes rowwise.

Which usages travel is decided as for 2-D weights (`fsdp._gather_usages`); a tensorwise FP8 weight
moves fprop's only, dgrad's being its per-expert transpose under the same scale. Experts that do not
divide evenly over the ranks are gathered in high precision (same numerics, more bytes).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tqcompile.nn.grouped import quantize_expert_weight
from tqcompile.ops.grouped_gemm import grouped_scale_shape
from tqcompile.quantizers import Quantizer

__all__: list[str] = []  # used by tqcompile.distributed's FSDP2 code; nothing public

_U8 = torch.uint8
_ROW = ("_data", "_scale_inv", "_amax")
_COL = ("_data_t", "_scale_inv_t", "_amax_t")


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """What one gather of a stored (E, A, B) expert weight sharded over `world` ranks moves."""

    quantizer: Quantizer
    shape: tuple[int, int, int]
    world: int
    transposed: bool  # stored (E, in, out): fprop's operand is the columnwise usage
    fprop: bool
    dgrad: bool
    buffer_bytes: int  # per rank, equal in every gather of this weight
    high_precision: bool = False

    @property
    def experts(self) -> int:  # per rank (padded)
        return math.ceil(self.shape[0] / self.world)

    def gemm_shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the GEMM weight."""
        e, a, b = self.shape
        return (e, b, a) if self.transposed else (e, a, b)

    def parts(self, experts: int, fprop: bool, dgrad: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(inner name, shape, dtype) of the usages asked for, over `experts` experts, in buffer order."""
        q, (_, n, k) = self.quantizer, self.gemm_shape()
        out = []
        for is_dgrad, wanted in ((False, fprop), (True, dgrad)):
            if not wanted:
                continue
            rows, cols = (k, n) if is_dgrad else (n, k)
            names = _ROW if is_dgrad == self.transposed else _COL  # fprop's is rowwise unless transposed
            shape = (experts * rows, cols)
            out.append((names[0], q.payload_shape(shape), q.element_format().storage_dtype))
            out.append((names[1], grouped_scale_shape(q, shape, experts, False), q.scale_dtype()))
            if q.has_global_scale():  # the grouped GEMM dequantizes NVFP4 with the per-expert amax
                out.append((names[2], (experts,), torch.float32))
        return out


def derives_dgrad(q: Quantizer) -> bool:
    """dgrad's operand is fprop's, transposed per expert, under the same per-expert scale
    (`Quantizer.columnwise_is_byte_transpose`: one scale, one byte per element)."""
    return q.columnwise_is_byte_transpose()


def nbytes(parts) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in parts)


def pack(shard: torch.Tensor, plan: ExpertsPlan) -> torch.Tensor:
    """This rank's experts (stored layout, param dtype), quantized in the usages `plan` moves, as one flat uint8 buffer."""
    gemm = shard.transpose(1, 2) if plan.transposed else shard
    packed = []
    for dgrad, wanted in ((False, plan.fprop), (True, plan.dgrad)):
        if wanted:
            data, scale_inv, amax = quantize_expert_weight(gemm, plan.quantizer, dgrad=dgrad)
            parts = (data, scale_inv, amax) if plan.quantizer.has_global_scale() else (data, scale_inv)
            packed.extend(t.contiguous().view(_U8).reshape(-1) for t in parts)
    buf = torch.cat(packed)
    return torch.cat((buf, buf.new_zeros(plan.buffer_bytes - buf.numel()))) if buf.numel() < plan.buffer_bytes else buf


def unpack(gathered: torch.Tensor, plan: ExpertsPlan) -> dict[str, torch.Tensor]:
    """The `GroupedQuantizedTensor`'s inner tensors from every rank's buffer (rank after rank): each part
    concatenates along the experts; dgrad's usage is transposed from fprop's where `derives_dgrad`."""
    per_rank = gathered.view(_U8).view(plan.world, -1)
    got, offset = {}, 0
    # Every part's dim 0 counts experts (or their rows): rank after rank is expert after expert.
    for name, shape, dtype in plan.parts(plan.experts, plan.fprop, plan.dgrad):
        size = nbytes([(name, shape, dtype)])
        got[name] = per_rank[:, offset : offset + size].contiguous().view(dtype).view(plan.world * shape[0], *shape[1:])
        offset += size
    if plan.fprop and not plan.dgrad and derives_dgrad(plan.quantizer):
        e, n, k = plan.gemm_shape()
        src, dst = (_COL, _ROW) if plan.transposed else (_ROW, _COL)
        data = got[src[0]]
        got[dst[0]] = data.view(_U8).view(e, n, k).transpose(1, 2).reshape(e * k, n).view(data.dtype)
        got[dst[1]] = got[src[1]]
    return {name: t.contiguous().clone() for name, t in got.items()}
