"""The OCP MX 6-bit element formats (MXFP6): E2M3 and E3M2, no infinities, no NaN.

E2M3: sign, 2 exponent bits (bias 1), 3 mantissa bits; subnormals m/8; largest 7.5, emax 2.
E3M2: sign, 3 exponent bits (bias 3), 2 mantissa bits; subnormals m/16; largest 28, emax 4.
Codes carry the sign in bit 5; four codes pack into three bytes, little-endian (element i at bit
6i of the 24-bit group), the layout of compressed-tensors' ``mxfp6-pack-quantized``. Both are MX
element formats: ``tq.MXQuantizer(tq.Format.E2M3)`` is MXFP6 (docs/numerics/mxfp6.md).
"""

from tqcompile.formats.floats import SmallFloatCodec
from tqcompile.formats.format import Format, register_codec

__all__: list[str] = []

register_codec(Format.E2M3, SmallFloatCodec.of(ebits=2, mbits=3), mx_element=True)
register_codec(Format.E3M2, SmallFloatCodec.of(ebits=3, mbits=2), mx_element=True)
