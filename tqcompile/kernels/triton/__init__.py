"""Triton (CUDA) kernels that match `tqcompile.kernels.reference` bit for bit.

`tqcompile.kernels.triton.quantize` holds the quantize kernels (`supports`, `quantize`);
`_numerics` the rounding building blocks they share. Importing a module here imports Triton,
which `tqcompile.ops` does only when an op runs on a CUDA tensor. On CPU tensors the kernels
run only through the Triton interpreter (the tests).
"""
