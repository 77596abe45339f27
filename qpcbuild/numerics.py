"""The card's number formats on the CPU: OCP Microscaling (MX) v1.0 MXFP6 (E2M3) and MXINT8.

Cloud AI compresses matmul weights to MXFP6 (`-mxfp6-matmul`) and keeps the KV cache in MXINT8
(`custom_io.yaml` Precision mxint8). This module quantizes and dequantizes numpy arrays to those
formats so that the ONNX Runtime backend can emulate them (`compile/ort_graph.py`) and tests and
`qpcbuild bench --numerics` can measure what they do to acceptance and logits.

The rules implemented (OCP Microscaling Formats (MX) Specification v1.0, sections 5 and 6.3):

* A block is 32 consecutive elements along one axis (the reduction axis K of a [K, N] matmul
  weight; head_dim for a KV vector). A length that is not a multiple of 32 ends in a shorter
  block with its own scale (the same as padding with zeros, which never change a block's max).
* Shared scale X = 2^e, stored as E8M0 (biased exponent e + 127, 0..254; 255 = NaN), with
  e = floor(log2(max_i |v_i|)) - emax_elem, clamped to [-127, 127]. emax_elem is 2 for FP6
  E2M3 (its largest power of two, 4) and 0 for INT8. An all-zero block gets e = -127.
  floor(log2(.)) is taken from the float's exponent bits (np.frexp), so it is exact.
* Elements P_i = v_i / X (exact: X is a power of two), rounded to the element grid with round
  to nearest, ties to even, and saturated to the largest element magnitude:
  - FP6 E2M3: 1 sign, 2 exponent (bias 1), 3 mantissa bits, subnormals, no Inf/NaN codes.
    Magnitudes: m/8 (exponent field 0, m = 0..7) and 2^(E-1) (1 + m/8) (E = 1..3), i.e.
    every multiple of 1/8 in [0, 2), of 1/4 in [2, 4) and of 1/2 in [4, 7.5]. Max 7.5.
  - INT8 (MXINT8): a signed 8-bit fixed-point number with 6 fractional bits, k/64. We use the
    symmetric range k in [-127, 127] (max 1 63/64), as the spec's reference library
    (microsoft/microxcaling: int8 has emax 0 and max_norm 127/64) clamps; the code -128 (-2.0)
    is never produced.
* NaN/Inf policy: a block holding a NaN or an infinity decodes to NaN in every element (its
  scale is the E8M0 NaN, 255). The exporter already refuses weights holding NaN or infinity, so
  this matters only for KV values of a model that overflowed. (torchao saturates an infinity
  to 7.5 X instead; the OCP spec leaves conversion of infinities to the implementation.)

What may differ on the card (Qualcomm does not publish it): the rounding mode (the reference
library's default is round half away from zero; torchao and this module round half to even),
the scale selection (OCP's floor rule here; some implementations round the max up first, e.g.
torchao's RCEIL/EVEN modes), whether the INT8 element uses -128, how a partial block is padded,
and the fp16 steps around them: the card compiles with `-convert-to-fp16`, so weights may be
rounded to fp16 before MXFP6 (that changes a result only for a value within half an fp16 ulp of
an MXFP6 rounding midpoint, or outside fp16's range) and activations, KV values included, are
fp16; the emulation keeps float32 activations and models only the two storage formats.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_MIN, SCALE_MAX = -127, 127  # unbiased E8M0 exponents (254 is the largest finite code)

FP6_E2M3 = "fp6_e2m3"
INT8 = "int8"
EMAX = {FP6_E2M3: 2, INT8: 0}
ELEM_MAX = {FP6_E2M3: 7.5, INT8: 127 / 64}
# Names recorded in manifests.
WEIGHT_FORMAT = "mxfp6-e2m3-block32"
KV_FORMAT = "mxint8-block32"


def _to_blocks(x: np.ndarray, axis: int) -> tuple[np.ndarray, tuple, int]:
    """x with `axis` moved last, zero-padded to a multiple of BLOCK, as [..., nblocks, BLOCK]
    float64 (every float32 value and every v / 2^e below is exact in float64)."""
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    n = x.shape[-1]
    nb = -(-n // BLOCK)
    if nb * BLOCK != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (nb * BLOCK - n,))], axis=-1)
    return x.reshape(x.shape[:-1] + (nb, BLOCK)), x.shape[:-1], n


def _from_blocks(b: np.ndarray, lead: tuple, n: int, axis: int) -> np.ndarray:
    return np.moveaxis(b.reshape(lead + (-1,))[..., :n], -1, axis)


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2(a)) for finite a > 0, exactly (frexp: a = m 2^p with m in [0.5, 1))."""
    _, p = np.frexp(a)
    return p.astype(np.int64) - 1


def shared_exponents(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(unbiased exponent e per block, mask of non-finite blocks)."""
    amax = np.max(np.abs(blocks), axis=-1)  # NaN propagates
    bad = ~np.isfinite(amax)
    safe = np.where(bad | (amax == 0), 1.0, amax)
    e = _floor_log2(safe) - EMAX[fmt]
    e = np.where(amax == 0, SCALE_MIN, e)
    return np.clip(e, SCALE_MIN, SCALE_MAX), bad


def round_elements(p: np.ndarray, fmt: str) -> np.ndarray:
    """Scaled elements P = v / X onto the element grid: nearest, ties to even, saturating."""
    if fmt == INT8:
        return np.clip(np.rint(p * 64.0), -127, 127) / 64.0
    if fmt != FP6_E2M3:
        raise ValueError(f"unknown MX element format '{fmt}'")
    mag = np.abs(p)
    # Spacing of the E2M3 grid around |P|: 1/8 below 2 (subnormals and exponent 1), then
    # 1/4 in [2, 4) and 1/2 from 4 on.
    binade = np.clip(_floor_log2(np.where(mag > 0, mag, 1.0)), 0, 2)
    step = np.ldexp(1.0, binade - 3)
    q = np.rint(p / step) * step
    return np.clip(q, -ELEM_MAX[fmt], ELEM_MAX[fmt])


def quantize(x: np.ndarray, fmt: str, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """x -> (E8M0 scale codes uint8 [..., nblocks] along `axis` moved last, element values
    float64 in the same [..., nblocks, 32] layout; padding elements are 0)."""
    blocks, _, _ = _to_blocks(x, axis)
    e, bad = shared_exponents(blocks, fmt)
    with np.errstate(invalid="ignore"):
        elems = round_elements(blocks / np.ldexp(1.0, e)[..., None], fmt)
    elems = np.where(bad[..., None], np.nan, elems)
    codes = np.where(bad, E8M0_NAN, e + E8M0_BIAS).astype(np.uint8)
    return codes, elems


def dequantize(codes: np.ndarray, elems: np.ndarray) -> np.ndarray:
    """Block values (codes, elems as `quantize` returns them) -> float64 [..., nblocks, 32]."""
    scale = np.where(codes == E8M0_NAN, np.nan,
                     np.ldexp(1.0, codes.astype(np.int64) - E8M0_BIAS))
    return elems * scale[..., None]


def mx_round(x: np.ndarray, fmt: str, axis: int = -1) -> np.ndarray:
    """Quantize-dequantize: x's values as the MX format holds them, float32, x's shape."""
    x = np.asarray(x)
    blocks, lead, n = _to_blocks(x, axis)
    codes, elems = quantize(x, fmt, axis)
    return _from_blocks(dequantize(codes, elems), lead, n, axis).astype(np.float32)


def mxfp6_weight(w: np.ndarray) -> np.ndarray:
    """A [K, N] matmul weight (x @ W) on the MXFP6 grid, blocks of 32 along K."""
    return mx_round(w, FP6_E2M3, axis=0)


# ---------------------------------------------------------------- FP6 E2M3 codes
def fp6_e2m3_encode(values: np.ndarray, negative: np.ndarray | None = None) -> np.ndarray:
    """Element values on the E2M3 grid -> 6-bit codes (sign << 5 | exponent << 3 | mantissa).
    `negative` gives the sign bit of zeros (a negative value that rounds to 0 keeps its sign)."""
    v = np.asarray(values, dtype=np.float64)
    mag = np.abs(v)
    if np.any(mag > 7.5) or np.any(~np.isfinite(v)):
        raise ValueError("not an E2M3 value")
    exp = np.where(mag < 1, 0, _floor_log2(np.where(mag >= 1, mag, 1.0)) + 1)
    mant = np.where(exp == 0, mag * 8, (mag / np.ldexp(1.0, exp - 1) - 1) * 8)
    if np.any(mant != np.round(mant)):
        raise ValueError("value not on the E2M3 grid")
    sign = np.signbit(v) if negative is None else np.asarray(negative, bool)
    return (sign.astype(np.uint8) << 5 | exp.astype(np.uint8) << 3
            | mant.astype(np.uint8)).astype(np.uint8)


def fp6_e2m3_decode(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, dtype=np.int64)
    sign = np.where(c & 0x20, -1.0, 1.0)
    exp, mant = (c >> 3) & 0x3, c & 0x7
    mag = np.where(exp == 0, mant / 8.0, np.ldexp(1.0 + mant / 8.0, exp - 1))
    return sign * mag


def fp6_e2m3_grid() -> np.ndarray:
    """Every E2M3 value (64 codes), ascending, with -0 and +0 both present."""
    return np.sort(fp6_e2m3_decode(np.arange(64)))


# ---------------------------------------------------------------- MXFP6 in MatMulNBits' layout
def mxfp6_int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] weight's MXFP6 values in com.microsoft.MatMulNBits' 8-bit layout, exactly:
    every E2M3 value is a multiple of 1/8 in [-7.5, 7.5], so 8 P is an integer in [-60, 60] and
    the block's value is (q - 128) (X / 8). Returns uint8 [N, ceil(K/32), 32] (zero point 128)
    and float32 scales [N * ceil(K/32)]."""
    codes, elems = quantize(np.asarray(w, np.float32), FP6_E2M3, axis=0)  # [N, nb], [N, nb, 32]
    if np.any(codes == E8M0_NAN):
        raise ValueError("weight holds NaN or infinity")
    q = (np.rint(elems * 8) + 128).astype(np.uint8)
    scale = np.ldexp(1.0, codes.astype(np.int64) - E8M0_BIAS - 3).astype(np.float32)
    return q, scale.reshape(-1)
