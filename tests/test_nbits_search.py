"""The searched scales of an int8/int4 target's symmetric blocks (nbits.blockwise_nbits_searched):
read back through the contrib op's specification and ONNX Runtime, and compared with a reference
quantizer that sweeps single scales densely."""

from __future__ import annotations

import numpy as np
import pytest

from qpcbuild.backends.onnxruntime.nbits import blockwise_nbits, blockwise_nbits_searched

from helpers_nbits import ort_matmul_nbits, spec_dequantize


def brute_force_block_error(block: np.ndarray, bits: int, trials: int = 4000) -> float:
    """The smallest squared error of `block` rounded to nearest on the signed grid
    -2^(bits-1)..2^(bits-1)-1 times one scale, over a dense sweep of scales of either sign
    (a reference quantizer written without the searched one's ratios or least squares)."""
    wide = 1 << (bits - 1)
    top = float(np.abs(block).max())
    if top == 0:
        return 0.0
    steps = np.linspace(top / (4 * wide), 2 * top / wide, trials)
    steps = np.concatenate([steps, -steps])[:, None]
    q = np.clip(np.rint(block[None, :] / steps), -wide, wide - 1)
    return float(((q * steps - block[None, :]) ** 2).sum(-1).min())


@pytest.mark.parametrize("bits,block", [(4, 32), (4, 128), (8, 32)])
def test_searched_scales_read_as_the_spec_says_and_near_the_best_scale(bits, block):
    rng = np.random.default_rng(bits * block)
    k, n = 2 * block + 16, 12  # the last block padded
    w = rng.normal(size=(k, n)).astype(np.float32)
    w[:block, 3] = 0.0  # an all-zero block
    packed, scales = blockwise_nbits_searched(w, bits, block)
    assert packed.shape == (n, -(-k // block), block * bits // 8)
    deq = spec_dequantize(packed, scales, bits, k)
    assert np.all(deq[:block, 3] == 0.0)
    x = rng.normal(size=(3, k)).astype(np.float32)
    np.testing.assert_allclose(ort_matmul_nbits(x, packed, scales, k, n, bits, 0, block),
                               x.astype(np.float64) @ deq, rtol=1e-4, atol=1e-4)
    # within a few percent of the best single scale per block that a dense sweep finds (on a
    # fine 8-bit grid the sweep also finds lucky alignments of 32 values: no bound there), and
    # well below absmax rounding onto -(2^(bits-1) - 1)..2^(bits-1) - 1 (blockwise_nbits)
    absmax = spec_dequantize(*blockwise_nbits(w, bits, block), bits, k)
    padded = np.zeros((-(-k // block) * block, n), np.float32)
    padded[:k] = w
    ours = theirs = plain = 0.0
    for col in range(n):
        for b in range(0, k, block):
            ours += float(((deq[b:b + block, col] - w[b:b + block, col]) ** 2).sum())
            plain += float(((absmax[b:b + block, col] - w[b:b + block, col]) ** 2).sum())
            theirs += brute_force_block_error(padded[b:b + block, col], bits)
    assert bits == 8 or ours <= 1.06 * theirs
    assert ours < (0.85 if bits == 4 else 0.95) * plain


def test_the_searched_reference_rejects_absmax_rounding():
    """The bounds above are not loose: absmax onto -7..7 misses the best scale by far more."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(128, 8)).astype(np.float32)
    deq = spec_dequantize(*blockwise_nbits(w, 4, 128), 4, 128)
    plain = float(((deq - w) ** 2).sum())
    best = sum(brute_force_block_error(w[:, c], 4) for c in range(8))
    assert plain > 1.1 * best
