"""The deployment form of a calibrated model: packed weights run by real kernels (`tq.compress`).

See docs/deploy.md: what runs a real kernel where (`linear_kernel`), what is still dequantized
per call and why, and the measured speed and memory (benchmarks/bench_inference.py).
"""

from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.deploy.kernels import KERNELS, linear_kernel  # KERNELS, FALLBACKS: importable, not advertised
from tqcompile.deploy.modules import FALLBACKS, DeployedLayer, compress, deployed_layers

__all__ = ["compress", "deployed_layers", "DeployedLayer", "linear_kernel", "Int4PackedCPUTensor"]
