"""AOTInductor of an exported quantized model: where inductor compiles our ops, the package is native code.

Inductor takes our reference kernels as decompositions where it can compile them (FP8/INT8 per
tensor or row, on CPU: tqcompile/ops/inductor.py), so the AOTInductor package calls no Python op
(no proxy-executor call in its wrapper) and equals eager bit for bit. INT4 groups, MX and NVFP4
stay extern kernels, whose quantizer argument AOTInductor cannot serialize (torch 2.13: "Unsupported
input type as_custom_obj for extern kernel tqcompile::quantize"; measured, in the serving docs).
"""

from __future__ import annotations

import zipfile

import torch
from torch import nn

import tqcompile as tq


def test_aotinductor_compiles_a_calibrated_int8_model_into_native_code(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()
    tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.randn(16, 64)), progress=False)
    x = torch.randn(8, 64)
    program = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    with zipfile.ZipFile(path) as archive:
        wrapper = "".join(archive.read(f).decode() for f in archive.namelist() if f.endswith("wrapper.cpp"))
    # Our ops were compiled (the generated kernels name the ops they fused) and none is called back.
    assert "tqcompile.quantize" in wrapper and "proxy_executor_call_function" not in wrapper
    with torch.no_grad():
        assert torch.equal(torch._inductor.aoti_load_package(path)(x), model(x))
