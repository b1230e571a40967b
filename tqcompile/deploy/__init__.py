"""The deployment form of a calibrated model: packed weights run by real kernels (`tq.compress`).

See docs/deploy.md: what runs a real kernel where (`linear_kernel`), what is still dequantized
per call and why, and the measured speed and memory (benchmarks/bench_inference.py).
"""

from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.deploy.int4_cuda import Int4PackedCUDATensor
from tqcompile.deploy.kernels import KERNELS, experts_kernel, linear_kernel  # KERNELS, FALLBACKS: importable, not advertised
from tqcompile.deploy.modules import FALLBACKS, DeployedLayer, compress, deployed_layers
from tqcompile.deploy.mx_packed import MXFP4PackedTensor, MXPackedTensor

__all__ = ["compress", "deployed_layers", "DeployedLayer", "linear_kernel", "experts_kernel", "Int4PackedCPUTensor", "Int4PackedCUDATensor", "MXPackedTensor", "MXFP4PackedTensor", "quantized_kv_cache", "kv_cache_bytes"]

# The FP8 KV cache subclasses Hugging Face's cache classes: imported on first use, so that
# tqcompile imports without transformers.
_KV_CACHE = ("quantized_kv_cache", "kv_cache_bytes", "FP8DynamicLayer", "FP8StaticLayer")


def __getattr__(name: str):
    if name in _KV_CACHE:
        from tqcompile.deploy import kv_cache

        return getattr(kv_cache, name)
    raise AttributeError(f"module 'tqcompile.deploy' has no attribute {name!r}")
