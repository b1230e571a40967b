"""The NVFP4 family: E2M1 elements in 16-element blocks (or 16x16 tiles) with E4M3 block scales
under an fp32 tensor-level scale, optionally with stochastic rounding and a random Hadamard
transform (docs/numerics/nvfp4.md)."""

from __future__ import annotations

import dataclasses

import torch

from tqcompile.formats import Format
from tqcompile.quantizers import geometry
from tqcompile.quantizers.base import Quantizer, register_family
from tqcompile.quantizers.geometry import Granularity
from tqcompile.quantizers.scaling import div_scalar, finite_abs

__all__ = ["NVFP4Quantizer", "NVFP4_ENC", "nvfp4_tensor_scale", "uniform_hash", "hadamard_matrix", "hadamard"]

NVFP4_ENC = Format.E4M3.max_value * Format.E2M1.max_value  # 448 * 6
_MASK32 = 0xFFFFFFFF


def uniform_hash(seed: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1): element i gets hash(seed[0], seed[1] + i).

    `seed` is an int64 tensor ``[seed, offset]``. Pure integer arithmetic with every product
    below 2**63, so any device (and a Triton kernel) reproduces it bit for bit.
    """
    seed = seed.to(device=device, dtype=torch.int64)
    h = (torch.arange(numel, device=device, dtype=torch.int64) + seed[1]) & _MASK32
    h = h ^ ((seed[0] & 0x7FFFFFFF) * 0x2C1B3C6D & _MASK32)
    for _ in range(3):
        h = ((h >> 16) ^ h) * 0x045D9F3B & _MASK32
    h = (h >> 16) ^ h
    return (h >> 8).to(torch.float32) * (2.0**-24)


def hadamard_matrix(seed: int, device: torch.device | None = None) -> torch.Tensor:
    """The 16x16 random Hadamard transform ``diag(signs) @ H16 / 4`` (orthogonal)."""
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    bits = (uniform_hash(torch.tensor([seed, 0]), 16, torch.device("cpu")) < 0.5).float()
    signs = 1.0 - 2.0 * bits
    return (signs[:, None] * h / 4.0).to(device)


def hadamard(x: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    """Each 16-element block of the last dim of `x` times `hadamard_matrix(seed)` (or its inverse)."""
    m = hadamard_matrix(seed, x.device)
    if inverse:
        m = m.t()
    # Eager custom-op kernels run under the caller's autocast, which would make this matmul bf16.
    with torch.autocast(x.device.type, enabled=False):
        return (x.unflatten(-1, (x.shape[-1] // 16, 16)) @ m).flatten(-2)


def nvfp4_tensor_scale(amax: torch.Tensor, q: NVFP4Quantizer) -> torch.Tensor:
    """NVFP4's tensor-level encode scale ``s_enc = 448 * 6 / max(amax, amax_epsilon)``, rounded once
    (as in `scaling.scale_from_amax`): compressed-tensors' global scale, ModelOpt's reciprocal."""
    return torch.div(NVFP4_ENC, amax.float().clamp(min=q.amax_epsilon))


@register_family
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 elements in 16-element blocks (or 16x16 tiles with `block_2d`, for weights)
    with E4M3 block scales under an fp32 tensor-level scale ``s_enc = 448 * 6 / amax``.

    `stochastic_rounding` rounds elements up with probability equal to their distance from the
    lower neighbour (seeded: pass `seed=` to `tq.quantize`). `hadamard` multiplies each
    16-element block of the last dim by a 16x16 Hadamard matrix / 4 with a sign vector drawn
    from `hadamard_seed`; both operands of a GEMM must use it, so it cancels in the product.
    Without `hadamard`, `hadamard_seed` is reset to 0 (it cannot change the result).
    """

    block_2d: bool = False
    stochastic_rounding: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0
    amax_epsilon: float = 1e-12

    BLOCK = 16  # a class constant: no annotation, so not a dataclass field

    def __post_init__(self) -> None:
        self._check_bool("block_2d", "stochastic_rounding", "hadamard")
        self._check_int("hadamard_seed", 0)
        self._check_epsilon(NVFP4_ENC)
        if not self.hadamard:
            self._canonicalize("hadamard_seed")

    def element_format(self) -> Format:
        return Format.E2M1

    def layout(self) -> geometry.Layout:
        return (Granularity.BLOCKWISE_2D if self.block_2d else Granularity.BLOCKWISE_1D), -1, self.BLOCK

    def uses_tensor_amax(self) -> bool:
        return True

    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def needs_seed(self) -> bool:
        return self.stochastic_rounding

    def hadamard_transformed(self) -> bool:
        return self.hadamard

    def reference_transform(self, xf: torch.Tensor) -> torch.Tensor:
        return hadamard(xf, self.hadamard_seed) if self.hadamard else xf

    def reference_quantize(self, xf, amax, seed) -> tuple[torch.Tensor, torch.Tensor]:
        if amax is None:
            raise ValueError("NVFP4 quantize needs the tensor amax (tensor_amax(x, q), group-reduced)")
        elements = Format.E2M1.codec
        s_enc = nvfp4_tensor_scale(amax, self)
        blk_amax = geometry.unit_amax(finite_abs(xf), self.layout())
        s_blk = (div_scalar(blk_amax, elements.max_value) * s_enc).clamp(max=Format.E4M3.max_value).to(torch.float8_e4m3fn)
        s_blk_f = geometry.expand(s_blk.float(), xf.shape, self.layout())
        v = torch.where(s_blk_f == 0, torch.zeros_like(xf), xf * s_enc / s_blk_f)
        if self.stochastic_rounding:
            if seed is None:
                raise ValueError("NVFP4Quantizer(stochastic_rounding=True) needs a seed tensor [seed, offset]")
            codes = elements.encode_stochastic(v, uniform_hash(seed, v.numel(), v.device))
        else:
            codes = elements.encode(v)
        return elements.pack(codes), s_blk

    def reference_dequantize(self, data, scale_inv, amax, shape) -> torch.Tensor:
        elements = Format.E2M1.codec
        s_enc = nvfp4_tensor_scale(amax, self)
        # The block's effective scale first, then one product: what compressed-tensors' decompressor
        # and the engines that load its checkpoints compute (`q * (weight_scale / weight_global_scale)`),
        # so an exported NVFP4 weight dequantizes there bit for bit as here.
        out = elements.decode(elements.unpack(data)) * (geometry.expand(scale_inv.float(), shape, self.layout()) / s_enc)
        if self.hadamard:
            out = hadamard(out, self.hadamard_seed, inverse=True)
        return out
