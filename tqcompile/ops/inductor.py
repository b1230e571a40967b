"""A way for inductor through the `tqcompile` custom ops, so it can fuse the quantize path.

The custom ops stay the traced interface: Dynamo, AOTAutograd with `aot_eager`, `opcheck` and the
graph goldens see `tqcompile::amax`, `tqcompile::quantize`, `tqcompile::dequantize` and
`tqcompile::gemm_tn` as single opaque nodes with fake kernels. Inductor alone is handed the
reference kernels of amax, quantize and dequantize as decompositions: the plain-torch code that
defines the numerics, traced into aten ops. Inductor then fuses the amax reduction, the scale, the
multiply, the clamp and the cast with the producer of `x` and with each other (and a dequantize
with its consumer), as it does torchao's plain-aten casts, instead of running opaque kernels that
each read the whole tensor. `gemm_tn` is handed over for FP8 tensorwise/rowwise pairs on CPU
(`tqcompile.kernels.reference.fp8_gemm_cpu`: CPU `_scaled_mm`'s own computation in plain torch), so the
operands' upcast and scale fuse too; the matmul stays an external kernel, the same BLAS call.

The numerics cannot drift from the eager kernels: a decomposition *is* the reference kernel.

Why a private API: inductor's decomposition table (`torch._inductor.decomposition.decompositions`,
what `select_decomp_table()` returns) is the only place inductor takes decompositions from; there
is no public registration for a custom op's inductor-only decomposition. Checked on torch 2.11 and
2.13. The registration runs when a `tqcompile` op is first traced (from its fake kernel), because
importing inductor costs ~1.7 s that eager and CPU-only users should not pay; by the time
anything is traced, Dynamo has imported it already (measured: 0 s extra after `torch._dynamo`).
On CUDA, FP8, MX and NVFP4 quantize stay opaque: their Triton kernels are faster than what inductor
generates from the reference. INT quantize and dequantize (no Triton kernel), and every amax of the
fusable layouts, are decomposed there too: the op would otherwise run the reference eagerly, op by
op (measured on an H200: a W8A8 layer's activation quantization and output scaling took 0.6 ms
beside a 0.55 ms INT8 GEMM at M = 4096).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from tqcompile.formats import Format
from tqcompile.kernels import reference
from tqcompile.quantizers import Granularity

__all__ = ["register_inductor_decompositions", "register_decomposition", "dequantize_decomposes", "quantize_decomposes"]


def _fusable(q) -> bool:
    """Quantizers whose reference kernel inductor compiles (torch 2.13, CPU): one fp32 scale per
    tensor or row (FP8 and INT). The block layouts stay opaque: measured, inductor's CPU backend
    has no C++ type for float8_e8m0fnu (MX scales: "missing from DTYPE_TO_CPP"), and its loop
    tiling asserts on the 1-D block reshapes of BLOCKWISE_1D FP8 and 1x16 NVFP4 when a graph
    quantizes a tensor and its transpose ("extra_indexing_ranges"). NVFP4's dequantize alone is
    decomposed too (`_dequantize_fusable`)."""
    return q.layout()[0] in (Granularity.TENSORWISE, Granularity.ROWWISE) and q.scale_dtype() == torch.float32


def _amax(x, quantizer):
    if not _fusable(quantizer):  # no Triton amax kernel: the reference on CUDA too
        return NotImplemented
    return reference.tensor_amax(x, quantizer)


def _on_cuda_only_int(t: torch.Tensor, quantizer) -> bool:
    """On CUDA, decompose only integer formats: FP8, MX and NVFP4 quantize have Triton kernels
    there, and an FP8 cast in inductor's Triton code needs FP8 hardware (sm_89+), which eager
    torch's dequantize does not; INT formats have no Triton kernel, and their reference is plain
    integer arithmetic."""
    return t.device.type != "cuda" or quantizer.element_format().is_int


def quantize_decomposes(x: torch.Tensor, quantizer) -> bool:
    """Whether inductor gets the reference quantization (and amax) of `x`: the fusable layouts
    (`_fusable`), on CUDA integer formats only."""
    return _fusable(quantizer) and _on_cuda_only_int(x, quantizer)


def _quantize(x, quantizer, amax, seed, flat_scale=False):
    if not quantize_decomposes(x, quantizer):
        return NotImplemented
    data, scale_inv = reference.quantize(x, quantizer, amax, seed)
    return data, scale_inv.reshape(-1) if flat_scale else scale_inv


def _dequantize_fusable(q, scale_inv: torch.Tensor) -> bool:
    """Dequantize decomposes for the fusable layouts, for integer groups (INT4 / INT8 codes with
    fp32 group scales: W4A16's weights, plain integer arithmetic; a deployed MoE's packed experts
    are dequantized on every call), for NVFP4's 1-D blocks (E2M1 codes, E4M3
    block scales: C++ types inductor has; its E2M1 decode is arithmetic under compile,
    `SmallFloatCodec.decode`) and for MX blocks whose E8M0 scales come as their uint8 bits (a
    deployed MX weight, `tqcompile.deploy.mx_packed`: an E8M0 buffer has no C++ type, the bits
    decode arithmetically, `E8M0Codec.decode`). A deployed weight (`tq.compress`) is dequantized on
    every call: measured on a (2816, 1024) NVFP4 weight, one thread, 12.3 ms opaque -> 2.6 ms
    decomposed. Their quantize stays opaque (the transposed-operand tiling assert above; no
    Hadamard transform either way)."""
    if _fusable(q):
        return True
    if q.layout()[0] is not Granularity.BLOCKWISE_1D or q.hadamard_transformed():
        return False
    nvfp4 = q.element_format() is Format.E2M1 and q.scale_dtype() == torch.float8_e4m3fn
    mx_bits = q.scale_dtype() == torch.float8_e8m0fnu and scale_inv.dtype == torch.uint8
    int_groups = q.element_format().is_int and q.scale_dtype() == torch.float32  # W4A16's groups: integer codes, fp32 scales
    return nvfp4 or mx_bits or int_groups


def dequantize_decomposes(data: torch.Tensor, scale_inv: torch.Tensor, quantizer) -> bool:
    """Whether inductor gets the reference dequantization of these operands (`_dequantize_fusable`;
    on CUDA integer formats only, which have no Triton dequantize kernel)."""
    return _dequantize_fusable(quantizer, scale_inv) and _on_cuda_only_int(data, quantizer)


def _dequantize(data, scale_inv, amax, quantizer, dtype):
    if not dequantize_decomposes(data, scale_inv, quantizer):
        return NotImplemented
    return reference.dequantize(data, scale_inv, amax, quantizer, dtype)


def _gemm_tn(a_data, a_scale_inv, a_amax, a_quantizer, b_data, b_scale_inv, b_amax, b_quantizer, out_dtype):
    if not reference.fp8_pair_on_cpu(a_data, a_quantizer, b_data, b_quantizer):
        return NotImplemented
    return reference.fp8_gemm_cpu(a_data, a_scale_inv, a_quantizer, b_data, b_scale_inv, b_quantizer, out_dtype)


# The sources whose code the decompositions are: the reference kernels, the quantizers' and formats'
# arithmetic, and this module's choice of what to decompose.
_NUMERICS_SOURCES = ("kernels/reference.py", "ops/inductor.py", "ops/grouped_gemm.py", "quantizers", "formats")
_PACKAGE = Path(__file__).resolve().parent.parent


def numerics_key(root: Path = _PACKAGE, sources: tuple[str, ...] = _NUMERICS_SOURCES) -> str:
    """A digest of the source files inductor's code for tq's ops is generated from."""
    digest = hashlib.sha256()
    for src in sources:
        path = root / src
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"tqcompile-numerics-{digest.hexdigest()[:16]}"


def _key_the_compile_caches() -> None:
    """Put `numerics_key` into torch's compile cache keys (`torch.compiler.config.cache_key_tag`,
    appended to the user's own tag). Inductor's FX graph cache keys a graph on torch's code and
    config, not on the decompositions it was handed: measured, with the cache warm from code that
    decomposes NVFP4's dequantization, the code before that change got the decomposed graph back
    (2.4 ms a call, where its own compile gives the opaque op's 12 ms); a changed reference kernel
    would come back with its old numerics the same way."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return
    tag = numerics_key()
    if tag not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}|{tag}" if config.cache_key_tag else tag


# Decompositions of ops defined in other modules of `tqcompile.ops` ({op name: function}), which add
# them with `register_decomposition` (this module imports none of them: they import it).
_OTHER_DECOMPOSITIONS: dict[str, object] = {}


def register_decomposition(op_name: str, fn) -> None:
    """Give inductor `fn` as the decomposition of ``torch.ops.tqcompile.<op_name>``, with the ones
    `register_inductor_decompositions` installs: called by the module defining the op, at its
    import (`import tqcompile` imports every such module, before anything is traced)."""
    if register_inductor_decompositions.cache_info().currsize:
        raise RuntimeError(
            f"register_decomposition({op_name!r}) after tq's decompositions were given to inductor: import the module "
            "defining the op before anything is compiled"
        )
    _OTHER_DECOMPOSITIONS[op_name] = fn


@functools.cache
def register_inductor_decompositions() -> None:
    """Give inductor the reference kernels of the `tqcompile` ops as decompositions (idempotent),
    and key torch's compile caches on their source (`_key_the_compile_caches`)."""
    _key_the_compile_caches()
    from torch._inductor import decomposition
    from torch._inductor.decomposition import decompositions
    from torch._inductor.lowering import make_fallback

    ops = torch.ops.tqcompile
    for op, fn in (
        (ops.amax.default, _amax),
        (ops.quantize.default, _quantize),
        (ops.dequantize.default, _dequantize),
        (ops.gemm_tn.default, _gemm_tn),
        *((getattr(ops, name).default, fn) for name, fn in _OTHER_DECOMPOSITIONS.items()),
    ):
        decompositions.setdefault(op, fn)
        # Where a decomposition declines (NotImplemented: not fusable, or not CPU) the op stays in the
        # graph and inductor calls its kernel, as for any custom op; it must be told that explicitly
        # once the op has a decomposition.
        make_fallback(op, override_decomp=True)
    # Inductor reads the table through `select_decomp_table()`, which returns a copy of it cached
    # at the first inductor compile of the process (`fast_random_decomps`, a `functools.cache`).
    # Where anything else was compiled with inductor before the first `tqcompile` op was traced
    # (a model without quantization, torchao's), that copy lacks the entries above, and every later
    # graph kept the ops opaque (benchmarks/bench_step.py's compiled fp8_tensorwise step measured
    # 1.6x slower in such a process). Dropping the cached copy makes the next compile build it
    # again, with them. Private, like the table; checked on torch 2.13
    # (compile_tests/test_inductor_fusion.py compiles another model first).
    cached = getattr(decomposition, "fast_random_decomps", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
