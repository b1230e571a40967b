"""Hand-computed worked examples, one or more per format family.

Every expected byte, code and scale below was worked out by hand from the format specs and the
reference table of docs/numerics/ (the arithmetic is in the comments); none comes from calling the
library. The same numbers are written up in docs/numerics/*.md. If the library and a comment
disagree, re-check the comment's arithmetic first, then the reference kernel.

Bit layouts used in the comments:
- E4M3: s eeee mmm, bias 7, max 448 = 1.75 * 2^8 = 0x7E, NaN 0x7F / 0xFF, no Inf.
- E5M2: s eeeee mm, bias 15, max 57344 = 1.75 * 2^15 = 0x7B.
- E8M0: eeeeeeee, bias 127, value 2^(byte - 127).
- E2M1 codes: s eem, magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (sign is bit 3).
- 4-bit payloads: two elements a byte, element 2i in the low nibble, element 2i+1 in the high one.
"""

from __future__ import annotations

import torch

import tqcompile as tq

F32 = torch.float32


def _bytes(t: torch.Tensor) -> list[int]:
    """The raw storage bytes of a one-byte-per-element tensor, in row-major order."""
    return t.contiguous().view(torch.uint8).flatten().tolist()


def _row(values: list[float], length: int) -> list[float]:
    """`values` followed by zeros up to `length` (blocks are 16 or 32 wide; most entries are 0)."""
    return values + [0.0] * (length - len(values))


# ---------------------------------------------------------------------------------------------
# FP8 (Float8Quantizer)
# ---------------------------------------------------------------------------------------------
def test_e4m3_tensorwise_rne_ties_and_nearest():
    x = torch.tensor([1.0, -2.0, 0.265625, 0.296875, 3.5, 0.3])
    qx = tq.quantize(x, tq.Float8Quantizer())
    # amax = 3.5, scale = 448 / 3.5 = 128 (exact), scale_inv = 1/128.
    # x * 128 = [128, -256, 34, 38, 448, 38.4]; E4M3 steps in [32, 64) are 4 apart:
    #   128  = 1.0 * 2^7   -> 0 1110 000 = 0x70
    #   -256 = -1.0 * 2^8  -> 1 1111 000 = 0xF8
    #   34: tie of 32 (mantissa 000, even) and 36 (001)  -> 32 = 0 1100 000 = 0x60
    #   38: tie of 36 (001) and 40 (010, even)           -> 40 = 0 1100 010 = 0x62
    #   448  = 1.75 * 2^8  -> 0 1111 110 = 0x7E (amax maps exactly onto the max)
    #   38.4 (0.3 is not representable): nearest is 40  -> 0x62
    assert _bytes(qx._data) == [0x70, 0xF8, 0x60, 0x62, 0x7E, 0x62]
    assert qx._data.dtype == torch.float8_e4m3fn
    assert torch.equal(qx._scale_inv, torch.tensor(1 / 128, dtype=F32))
    assert torch.equal(qx._amax, torch.tensor(3.5))
    # Dequantize: q / 128.
    assert torch.equal(qx.dequantize(), torch.tensor([1.0, -2.0, 0.25, 0.3125, 3.5, 0.3125]))


def test_e5m2_tensorwise():
    x = torch.tensor([1.0, -2.0, 1.125, 1.375, 3.5, 0.3])
    qx = tq.quantize(x, tq.Float8Quantizer(format=tq.Format.E5M2))
    # amax = 3.5, scale = 57344 / 3.5 = 16384 = 2^14 (exact). Two mantissa bits: steps of 0.25.
    #   1.0   -> 2^14                          -> 0 11101 00 = 0x74
    #   -2.0  -> -2^15                         -> 1 11110 00 = 0xF8
    #   1.125 * 2^14: tie of 1.0 (00, even) and 1.25 (01)   -> 1.0 * 2^14 = 0x74
    #   1.375 * 2^14: tie of 1.25 (01) and 1.5 (10, even)   -> 1.5 * 2^14 = 0 11101 10 = 0x76
    #   3.5   -> 1.75 * 2^15 = 57344 (max)     -> 0 11110 11 = 0x7B
    #   0.3 * 2^14 = 4915.2 = 1.2 * 2^12: nearest 1.25 * 2^12 -> 0 11011 01 = 0x6D
    assert _bytes(qx._data) == [0x74, 0xF8, 0x74, 0x76, 0x7B, 0x6D]
    assert qx._data.dtype == torch.float8_e5m2
    assert torch.equal(qx._scale_inv, torch.tensor(2.0**-14))
    assert torch.equal(qx.dequantize(), torch.tensor([1.0, -2.0, 1.0, 1.5, 3.5, 0.3125]))


def test_e4m3_power_of_two_scale():
    x = torch.tensor([3.0, 1.0])
    # Plain: 448 / 3 = 149.3333...; the fp32 neighbours are 149.33332824707031 (5.1e-6 below) and
    # 149.33334350585938 (1.0e-5 above), so scale = 149.33332824707031 (the correctly rounded
    # quotient; reciprocal-then-multiply would give the upper one). 3 * scale = 448 - 2^-16, a tie
    # in fp32 that rounds to the even 448 -> 0x7E; 1 * scale = 149.33: E4M3 steps in [128, 256) are
    # 16 apart, nearest 144 = 1.125 * 2^7 -> 0 1110 001 = 0x71.
    plain = tq.quantize(x, tq.Float8Quantizer())
    assert _bytes(plain._data) == [0x7E, 0x71]
    assert torch.equal(plain._scale_inv, torch.tensor(1 / 149.33332824707031, dtype=F32))
    # power_of_two_scale: 149.33 rounds DOWN to 128 = 2^7, so nothing can saturate.
    #   3 * 128 = 384 = 1.5 * 2^8 -> 0 1111 100 = 0x7C;  1 * 128 -> 0x70.
    p2 = tq.quantize(x, tq.Float8Quantizer(power_of_two_scale=True))
    assert _bytes(p2._data) == [0x7C, 0x70]
    assert torch.equal(p2._scale_inv, torch.tensor(1 / 128))
    assert torch.equal(p2.dequantize(), x)


def test_e4m3_saturation_of_inf():
    # Amax ignores non-finite values: amax = 1, scale = 448. +-Inf clamps to +-448 (0x7E / 0xFE);
    # NaN stays NaN (E4M3's NaN is 0x7F).
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0])
    qx = tq.quantize(x, tq.Float8Quantizer())
    assert _bytes(qx._data) == [0x7E, 0xFE, 0x7F, 0x7E]
    assert torch.equal(qx._scale_inv, torch.tensor(1 / 448))


def test_e4m3_rowwise():
    x = torch.tensor([[1.0, -4.0], [0.5, 0.3]])
    qx = tq.quantize(x, tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE))
    # Row 0: amax 4,   scale 448/4 = 112:  1 -> 112 = 1.75 * 2^6 -> 0 1101 110 = 0x6E;  -4 -> -448 = 0xFE.
    # Row 1: amax 0.5, scale 448/0.5 = 896: 0.5 -> 448 = 0x7E;
    #        0.3 -> 268.8; steps of 32 in [256, 512), nearest 256 = 2^8 -> 0 1111 000 = 0x78.
    assert _bytes(qx._data) == [0x6E, 0xFE, 0x7E, 0x78]
    assert torch.equal(qx._scale_inv, torch.tensor([[1 / 112], [1 / 896]], dtype=F32))


def test_e4m3_1x128_blocks():
    x = torch.zeros(1, 256)
    x[0, :128] = 1.0
    x[0, 5] = 2.0
    x[0, 128] = 0.875
    x[0, 129] = 0.1
    qx = tq.quantize(x, tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_1D, block_size=128))
    # Block 0 (elements 0..127): amax 2, scale 224. 1 -> 224 = 1.75 * 2^7 -> 0 1110 110 = 0x76; 2 -> 448 = 0x7E.
    # Block 1 (128..255): amax 0.875, scale 512. 0.875 -> 448 = 0x7E;
    #   0.1 -> 51.2; steps of 4 in [32, 64), nearest 52 = 1.625 * 2^5 -> 0 1100 101 = 0x65; zeros -> 0x00.
    expected = [0x76] * 128
    expected[5] = 0x7E
    expected += [0x7E, 0x65] + [0x00] * 126
    assert _bytes(qx._data) == expected
    assert torch.equal(qx._scale_inv, torch.tensor([[1 / 224, 1 / 512]], dtype=F32))


def test_e4m3_2d_blocks():
    x = torch.tensor([[1.0, 2.0, 0.5, 0.25], [-4.0, 3.0, 0.125, 0.1]])
    qx = tq.quantize(x, tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_2D, block_size=2))
    # Tile 0 (columns 0-1): amax 4, scale 112.
    #   1 -> 112 = 0x6E;  2 -> 224 = 0x76;  -4 -> -448 = 0xFE;
    #   3 -> 336: tie of 320 (1.25 * 2^8, mantissa 010 even) and 352 (011) -> 320 = 0 1111 010 = 0x7A.
    # Tile 1 (columns 2-3): amax 0.5, scale 896.
    #   0.5 -> 448 = 0x7E;  0.25 -> 224 = 0x76;  0.125 -> 112 = 0x6E;
    #   0.1 -> 89.6; steps of 8 in [64, 128), nearest 88 = 1.375 * 2^6 -> 0 1101 011 = 0x6B.
    assert _bytes(qx._data) == [0x6E, 0x76, 0x7E, 0x76, 0xFE, 0x7A, 0x6E, 0x6B]
    assert torch.equal(qx._scale_inv, torch.tensor([[1 / 112, 1 / 896]], dtype=F32))


# ---------------------------------------------------------------------------------------------
# MX (MXQuantizer): 32-element blocks, E8M0 scales
# ---------------------------------------------------------------------------------------------
def _mx_example() -> torch.Tensor:
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([500.0, 1.0, -17.0])
    x[1, :2] = torch.tensor([3.0, 1.0])
    return x


def test_mxfp8_floor_saturates_where_rceil_does_not():
    qx = tq.quantize(_mx_example(), tq.MXQuantizer(scale_rounding=tq.ScaleRounding.FLOOR))
    # Block 0: amax 500, floor(log2 500) = 8, e = 8 - emax(E4M3) 8 = 0 -> scale 2^0, E8M0 byte 127 = 0x7F.
    #   500 / 1 = 500 > 448: saturates to 448 = 0x7E.  1 -> 1.0 * 2^0 = 0 0111 000 = 0x38.
    #   -17: steps of 2 in [16, 32), tie of 16 (000, even) and 18 (001) -> -16 = 1 1011 000 = 0xD8.
    # Block 1: amax 3, floor(log2 3) = 1, e = 1 - 8 = -7 -> byte 120 = 0x78.
    #   3 * 2^7 = 384 = 0x7C;  1 * 2^7 = 128 = 0x70.
    assert _bytes(qx._scale_inv) == [0x7F, 0x78]
    assert qx._scale_inv.dtype == torch.float8_e8m0fnu
    assert _bytes(qx._data[:, :3]) == [0x7E, 0x38, 0xD8, 0x7C, 0x70, 0x00]
    assert torch.equal(qx.dequantize()[:, :3], torch.tensor([[448.0, 1.0, -16.0], [3.0, 1.0, 0.0]]))


def test_mxfp8_rceil():
    qx = tq.quantize(_mx_example(), tq.MXQuantizer(scale_rounding=tq.ScaleRounding.RCEIL))
    # Block 0: e = ceil(log2(500 / 448)) = ceil(0.158) = 1 -> scale 2, byte 128 = 0x80.
    #   500 / 2 = 250; steps of 16 in [128, 256), nearest 256 = 2^8 -> 0 1111 000 = 0x78 (no saturation).
    #   1 / 2 = 0.5 -> 0 0110 000 = 0x30.
    #   -17 / 2 = -8.5: steps of 1 in [8, 16), tie of 8 (000, even) and 9 -> -8 = 1 1010 000 = 0xD0.
    # Block 1: e = ceil(log2(3 / 448)) = ceil(-7.22) = -7: the same as FLOOR here -> 0x78, 0x7C, 0x70.
    assert _bytes(qx._scale_inv) == [0x80, 0x78]
    assert _bytes(qx._data[:, :3]) == [0x78, 0x30, 0xD0, 0x7C, 0x70, 0x00]
    assert torch.equal(qx.dequantize()[:, :3], torch.tensor([[512.0, 1.0, -16.0], [3.0, 1.0, 0.0]]))


def test_mxfp8_e5m2_floor_and_rceil():
    x = torch.zeros(1, 32)
    x[0, 0] = 500.0
    # FLOOR: e = 8 - emax(E5M2) 15 = -7 (byte 120): 500 * 2^7 = 64000 > 57344 -> saturates, 0x7B.
    floor = tq.quantize(x, tq.MXQuantizer(format=tq.Format.E5M2))
    assert _bytes(floor._scale_inv) == [120]
    assert _bytes(floor._data[:, :1]) == [0x7B]
    # RCEIL: e = ceil(log2(500 / 57344)) = ceil(-6.84) = -6 (byte 121): 500 * 64 = 32000;
    # steps of 4096 in [16384, 32768), nearest 32768 = 2^15 -> 0 11110 00 = 0x78.
    rceil = tq.quantize(x, tq.MXQuantizer(format=tq.Format.E5M2, scale_rounding=tq.ScaleRounding.RCEIL))
    assert _bytes(rceil._scale_inv) == [121]
    assert _bytes(rceil._data[:, :1]) == [0x78]


def _mxfp4_example() -> torch.Tensor:
    return torch.tensor(
        [
            _row([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -1.25, -6.0, 0.5, 0.3], 32),
            _row([0.75, -0.1], 32),
        ]
    )


def test_mxfp4_floor_ties_saturation_and_nibble_order():
    qx = tq.quantize(_mxfp4_example(), tq.MXQuantizer(format=tq.Format.E2M1))
    # Block 0: amax 7, floor(log2 7) = 2, e = 2 - emax(E2M1) 2 = 0 -> scale 1, byte 127.
    #   ties to the even code: 0.25 -> 0 (code 0), 0.75 -> 1 (2), 1.25 -> 1 (2), 1.75 -> 2 (4),
    #   2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6); 7 saturates to 6 (7); -1.25 -> -1 (8|2 = 0xA);
    #   -6 -> 0xF; 0.5 -> code 1; 0.3 -> nearest 0.5, code 1.
    #   Bytes (element 2i low nibble, 2i+1 high): 0x20, 0x42, 0x64, 0x76, 0xFA, 0x11, then zeros.
    # Block 1: amax 0.75, floor(log2 0.75) = -1, e = -1 - 2 = -3 -> scale 1/8, byte 124.
    #   0.75 * 8 = 6 -> code 7;  -0.1 * 8 = -0.8 -> nearest 1, code 0xA.  Byte: 0x7 | 0xA << 4 = 0xA7.
    assert _bytes(qx._scale_inv) == [127, 124]
    assert qx._data.dtype == torch.uint8 and qx._data.shape == (2, 16)
    assert qx._data.tolist() == [
        [0x20, 0x42, 0x64, 0x76, 0xFA, 0x11] + [0] * 10,
        [0xA7] + [0] * 15,
    ]
    expected = torch.tensor(
        [
            _row([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -6.0, 0.5, 0.5], 32),
            _row([0.75, -0.125], 32),
        ]
    )
    assert torch.equal(qx.dequantize(), expected)


def test_mxfp4_rceil():
    qx = tq.quantize(_mxfp4_example(), tq.MXQuantizer(format=tq.Format.E2M1, scale_rounding=tq.ScaleRounding.RCEIL))
    # Block 0: e = ceil(log2(7 / 6)) = ceil(0.22) = 1 -> scale 2, byte 128. Elements / 2:
    #   0.125 -> 0 (0), 0.375 -> 0.5 (1), 0.625 -> 0.5 (1), 0.875 -> 1 (2), 1.25 -> 1 (2),
    #   1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), -0.625 -> -0.5 (0x9), -3 -> 0xD,
    #   0.25 -> 0 (tie, even code 0), 0.15 -> 0 (0).
    #   Bytes: 0x10, 0x21, 0x42, 0x64, 0xD9, 0x00.
    # Block 1: 0.75 / 6 = 2^-3 exactly, so e = -3 (no rounding up of an exact power of two): as FLOOR.
    assert _bytes(qx._scale_inv) == [128, 124]
    assert qx._data.tolist() == [
        [0x10, 0x21, 0x42, 0x64, 0xD9, 0x00] + [0] * 10,
        [0xA7] + [0] * 15,
    ]


def test_mxfp6_e2m3_and_e3m2():
    # docs/numerics/mxfp6.md. One block: [3, 0.3, -1.0625, 0.1875, 7.8], then zeros; amax 7.8.
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([3.0, 0.3, -1.0625, 0.1875, 7.8])
    # E2M3 FLOOR: floor(log2 7.8) = 2, e = 2 - emax 2 = 0, byte 127. 3 = 1.5 * 2^1: exponent 2, mantissa 4,
    #   code 0b10100 = 20; 0.3 -> subnormal 0.25 (code 2); -1.0625 ties 1.0 / 1.125 -> 1.0 (even mantissa), 0x20 | 8 = 40;
    #   0.1875 ties 0.125 / 0.25 -> 0.25 (code 2); 7.8 saturates to 7.5 (code 31).
    #   Group 20, 2, 40, 2 -> word 20 | 2 << 6 | 40 << 12 | 2 << 18 = 0x0A8094 -> bytes 0x94, 0x80, 0x0A.
    qx = tq.quantize(x, tq.MXQuantizer(tq.Format.E2M3))
    assert _bytes(qx._scale_inv) == [127]
    assert qx._data.shape == (1, 24) and qx._data[0, :6].tolist() == [0x94, 0x80, 0x0A, 31, 0, 0]
    assert qx.dequantize()[0, :5].tolist() == [3.0, 0.25, -1.0, 0.25, 7.5]
    # E2M3 RCEIL: e = ceil(log2(7.8 / 7.5)) = 1, byte 128; halves 1.5 (12), 0.15 (-> 0.125, 1), -0.53125 (-> -0.5, 36),
    #   0.09375 (-> 0.125, 1), 3.9 (-> 4, exponent 3 mantissa 0: 24). Group 12, 1, 36, 1 -> 0x06404C -> 0x4C, 0x40, 0x06.
    qx = tq.quantize(x, tq.MXQuantizer(tq.Format.E2M3, tq.ScaleRounding.RCEIL))
    assert _bytes(qx._scale_inv) == [128]
    assert qx._data[0, :6].tolist() == [0x4C, 0x40, 0x06, 24, 0, 0]
    # E3M2 FLOOR: e = 2 - emax 4 = -2, byte 125; 4x = 12 (1.5 * 2^3: 26), 1.2 (-> 1.25: 13), -4.25 (-> -4: 32 | 20 = 52),
    #   0.75 (10), 31.2 (saturates at 28: 31). Group 26, 13, 52, 10 -> 0x2B435A -> 0x5A, 0x43, 0x2B.
    qx = tq.quantize(x, tq.MXQuantizer(tq.Format.E3M2))
    assert _bytes(qx._scale_inv) == [125]
    assert qx._data[0, :6].tolist() == [0x5A, 0x43, 0x2B, 31, 0, 0]
    assert qx.dequantize()[0, :5].tolist() == [3.0, 0.3125, -1.0, 0.1875, 7.0]


# ---------------------------------------------------------------------------------------------
# NVFP4 (NVFP4Quantizer): 16-element blocks, E4M3 block scales, fp32 tensor scale
# ---------------------------------------------------------------------------------------------
def test_nvfp4_1d():
    x = torch.tensor([_row([12.0, -5.0, 1.5, 7.0, 0.5, 3.0], 16) + _row([1.0, 0.5, -0.25, 0.1], 16)])
    qx = tq.quantize(x, tq.NVFP4Quantizer())
    # Tensor: amax 12, s_enc = 2688 / 12 = 224.
    # Block 0: amax 12, s_blk = e4m3(12 / 6 * 224) = e4m3(448) = 448 (0x7E).
    #   v = x * 224 / 448 = x / 2: 6 (code 7), -2.5 (tie 2|3 -> 2, code 0xC), 0.75 (tie -> 1, code 2),
    #   3.5 (tie 3|4 -> 4, code 6), 0.25 (tie -> 0, code 0), 1.5 (code 3).
    #   Bytes: 0xC7, 0x62, 0x30, then zeros.
    # Block 1: amax 1, s_blk = e4m3(224 / 6 = 37.33); steps of 4 in [32, 64) -> 36 = 1.125 * 2^5 = 0x61.
    #   v = x * 224 / 36 = x * 6.22: 6.22 saturates (code 7), 3.11 -> 3 (5), -1.56 -> -1.5 (0xB),
    #   0.62 -> 0.5 (1). Rounding the block scale down pushed the block amax past 6: it saturates.
    #   Bytes: 0x57, 0x1B, then zeros.
    assert qx._data.tolist() == [[0xC7, 0x62, 0x30, 0, 0, 0, 0, 0, 0x57, 0x1B, 0, 0, 0, 0, 0, 0]]
    assert qx._scale_inv.dtype == torch.float8_e4m3fn
    assert _bytes(qx._scale_inv) == [0x7E, 0x61]
    assert torch.equal(qx._amax, torch.tensor(12.0))
    # Dequantize: code value * s_blk / s_enc = * 2 in block 0, * 36/224 in block 1.
    deq = qx.dequantize()
    assert torch.equal(deq[0, :6], torch.tensor([12.0, -4.0, 2.0, 8.0, 0.0, 3.0]))
    assert torch.equal(deq[0, 16:20], torch.tensor([6.0, 3.0, -1.5, 0.5]) * 36.0 / 224.0)


def test_nvfp4_2d_tiles():
    x = torch.zeros(16, 32)
    x[15, 0] = 12.0
    x[3, 20] = 1.0
    qx = tq.quantize(x, tq.NVFP4Quantizer(block_2d=True))
    # s_enc = 224 as above. Tile (0, 0) (rows 0-15, columns 0-15) has amax 12 -> s_blk 448 (0x7E);
    # tile (0, 1) has amax 1 -> s_blk 36 (0x61). Codes: 12 * 224 / 448 = 6 -> 7; 1 * 224 / 36 = 6.22 -> 7.
    assert qx._scale_inv.shape == (1, 2)
    assert _bytes(qx._scale_inv) == [0x7E, 0x61]
    # Element (15, 0) is the low nibble of byte (15, 0); element (3, 20) the low nibble of byte (3, 10).
    assert qx._data[15, 0].item() == 0x07
    assert qx._data[3, 10].item() == 0x07
    assert qx._data.count_nonzero().item() == 2


# ---------------------------------------------------------------------------------------------
# INT8 / INT4 (IntQuantizer)
# ---------------------------------------------------------------------------------------------
def test_int8_tensorwise_round_half_even():
    x = torch.tensor([1.0, 3.0, 5.0, -3.0, 254.0, -7.0])
    qx = tq.quantize(x, tq.IntQuantizer())
    # amax 254, scale = 127 / 254 = 0.5, scale_inv 2.
    # x * 0.5 = [0.5, 1.5, 2.5, -1.5, 127, -3.5] -> half to even: [0, 2, 2, -2, 127, -4].
    assert qx._data.dtype == torch.int8
    assert qx._data.tolist() == [0, 2, 2, -2, 127, -4]
    assert torch.equal(qx._scale_inv, torch.tensor(2.0))
    assert torch.equal(qx.dequantize(), torch.tensor([0.0, 4.0, 4.0, -4.0, 254.0, -8.0]))


def test_int8_per_channel():
    x = torch.tensor([[254.0, 1.0, 3.0], [0.5, -0.25, 0.1]])
    qx = tq.quantize(x, tq.IntQuantizer(granularity=tq.Granularity.ROWWISE))
    # Row 0: scale 127 / 254 = 0.5: [127, 0.5 -> 0, 1.5 -> 2].
    # Row 1: scale 127 / 0.5 = 254: [127, -63.5 -> -64 (even), 25.4 -> 25].
    assert qx._data.tolist() == [[127, 0, 2], [127, -64, 25]]
    assert torch.equal(qx._scale_inv, torch.tensor([[2.0], [1 / 254]], dtype=F32))


def test_int4_tensorwise_twos_complement_nibbles():
    x = torch.tensor([1.0, 3.0, 5.0, -3.0, 14.0, -7.0, -14.0, 0.6])
    qx = tq.quantize(x, tq.IntQuantizer(format=tq.Format.INT4))
    # amax 14, scale = 7 / 14 = 0.5, scale_inv 2.
    # x * 0.5 = [0.5, 1.5, 2.5, -1.5, 7, -3.5, -7, 0.3] -> [0, 2, 2, -2, 7, -4, -7, 0].
    # Two's complement nibbles: 0x0, 0x2, 0x2, 0xE, 0x7, 0xC, 0x9, 0x0;
    # bytes (low nibble first): 0x20, 0xE2, 0xC7, 0x09. -8 (0x8) is never produced: symmetric range.
    assert qx._data.dtype == torch.uint8
    assert qx._data.tolist() == [0x20, 0xE2, 0xC7, 0x09]
    assert torch.equal(qx._scale_inv, torch.tensor(2.0))
    assert torch.equal(qx.dequantize(), torch.tensor([0.0, 4.0, 4.0, -4.0, 14.0, -8.0, -14.0, 0.0]))
