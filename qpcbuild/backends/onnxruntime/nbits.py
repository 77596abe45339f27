"""MatMulNBits weights for the ONNX Runtime lowering (ort_graph.py): the layouts (block size,
symmetric or not, the activations' accuracy level, the LM head) and the blockwise quantizers
that fill them, as com.microsoft.MatMulNBits' spec lays the bytes out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
from onnx import helper

from ...export import MS
from ...export.builder import GraphBuilder

INT8_BLOCK = 32
WEIGHT_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class NbitsLayout:
    """How an int8/int4 lowering stores and multiplies its weights (com.microsoft.MatMulNBits):
    the block length along K, a symmetric grid (implicit zero point 2^(bits-1)) or an
    asymmetric one (a zero point per block), the kernel's accuracy_level (4: activations
    quantized to int8 per block, ORT's integer kernel; 0: float math on dequantized weights),
    and whether the LM head is quantized too (else a float32 MatMul). min_window: the fewest
    tokens every call of the graph carries (the runtime pads a lone token to that window), so
    a token's logits do not depend on whether it comes alone or in a verify window.
    scale_search: a symmetric block's scale is chosen by least squares over a few clipping
    ratios, on the whole signed grid (-8..7 for int4), instead of absmax onto -7..7
    (blockwise_nbits_searched)."""
    block_size: int = INT8_BLOCK
    symmetric: bool = True
    accuracy_level: int = 4
    quantize_head: bool = True
    min_window: int = 1
    scale_search: bool = False

    @property
    def window_step(self) -> int:
        """A multiple a target's every window is padded to. Measured with ONNX Runtime 1.32 on
        this CPU kind: with blocks longer than 32 the integer kernel runs a call's rows in
        pairs and an odd last row through a one-row kernel that rounds differently (1e-5 on one
        node), so only even windows give each row the same bits whatever its window; blocks of
        32 give them for any window of 2 or more."""
        return 2 if self.block_size > INT8_BLOCK and self.min_window > 1 else 1

    def changed(self) -> dict[str, int | bool]:
        """The fields that differ from LEGACY_NBITS: what a role's cache key records, so bundles
        built with the earlier layout keep their ids."""
        return {k: v for k, v in asdict(self).items() if v != getattr(LEGACY_NBITS, k)}


# The layout every int8/int4 role was built with before a target could be quantized; drafts
# keep it (fastest, and a draft's numerics change proposals only).
LEGACY_NBITS = NbitsLayout()
# A target needs each token's logits to be the same whether it comes alone (target-only decode)
# or in a verify window of K+1. MatMulNBits with int8 activations is row-independent (each row
# quantized on its own, the same integer kernel for 1 row as for many: bitwise equal rows), but
# GroupQueryAttention is not: a call of one token multiplies its attention probabilities by V
# through MLAS's single-row SGEMM kernel, a call of 2 or more through the packed kernel, and the
# two differ in the last bits. Float weights keep that at noise; int8 activations round it into
# logit differences up to 2.5 on SmolLM2, flipping greedy tokens. From 2 tokens a call on, each
# row comes out bitwise the same whatever the window (measured with 2, 3 and 5 on SmolLM2's
# int4 graph), so a target keeps the fast integer kernel and every call carries at least 2
# tokens (docs/weight-formats.md). Its scales are searched (blockwise_nbits_searched): the
# target's output is what the user gets, so its blocks take the closer fit.
TARGET_NBITS = NbitsLayout(min_window=2, scale_search=True)


def nbits_layout(role: str, block_size: int | None = None) -> NbitsLayout:
    """A role's layout; block_size: the recipe's onnxruntime.<role>_block_size (None: 32).
    Blocks longer than 32 take the asymmetric grid: measured on Qwen2.5-Coder-1.5B and
    SmolLM2-135M, blocks of 128 agree with the float32 target 2 to 7 points more often in top-1
    on the asymmetric grid than on the symmetric one, absmax or searched, at the same speed
    (benchmarks/nbits_kernels.py, docs/int4-layouts.md). A draft left at 32 keeps the earlier
    layout (and its bundles their ids)."""
    base = TARGET_NBITS if role == "target" else LEGACY_NBITS
    if block_size is None or block_size == INT8_BLOCK:
        return base
    return replace(base, block_size=block_size, symmetric=False, scale_search=False)


def blockwise_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] weights as MatMulNBits' 8-bit layout: uint8 [N, ceil(K/32), 32] with the implicit
    zero point 128, and float32 scales [N * ceil(K/32)]. Symmetric absmax per block of 32 along
    K, round half to even; a K that is not a multiple of 32 is padded with zeros."""
    return blockwise_nbits(w, 8)


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[K, N] as [N, ceil(K/block), block] along K, the last block padded with zeros."""
    k, n = w.shape
    blocks = -(-k // block)
    cols = np.zeros((n, blocks * block), np.float32)
    cols[:, :k] = w.T
    return cols.reshape(n, blocks, block)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (uint8, < 2^bits) along the last axis, two a byte for 4 bits, the even one low."""
    if bits == 8:
        return q
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def blockwise_nbits(w: np.ndarray, bits: int, block: int = INT8_BLOCK
                    ) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] weights as MatMulNBits' `bits`-bit layout (8 or 4): uint8 [N, ceil(K/block),
    block * bits / 8], codes packed low bits first along K, with the implicit zero point
    2^(bits-1); float32 scales [N * ceil(K/block)]. Symmetric absmax per block along K
    (codes -127..127 or -7..7 around the zero point), round half to even; a K that is not a
    multiple of the block is padded with zeros."""
    cols = _blocks(w, block)
    top = (1 << (bits - 1)) - 1
    scale = np.abs(cols).max(axis=-1) / top
    scale[scale == 0] = 1.0  # an all-zero block: any scale reproduces it
    q = (np.clip(np.rint(cols / scale[..., None]), -top, top) + top + 1).astype(np.uint8)
    return _pack(q, bits), scale.astype(np.float32).reshape(-1)


def blockwise_nbits_asymmetric(w: np.ndarray, bits: int, block: int = INT8_BLOCK
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As blockwise_nbits, on each block's own [min, max] range (all 2^bits codes used):
    value = (code - zero_point) * scale. Zero points uint8, packed as MatMulNBits reads them:
    per column ceil(blocks * bits / 8) bytes, low bits first ([N * that])."""
    cols = _blocks(w, block)
    top = (1 << bits) - 1
    lo = np.minimum(cols.min(axis=-1), 0.0)  # 0 stays on the grid (zero padding exact)
    hi = np.maximum(cols.max(axis=-1), 0.0)
    scale = (hi - lo) / top
    scale[scale == 0] = 1.0
    zero = np.clip(np.rint(-lo / scale), 0, top).astype(np.uint8)
    q = np.clip(np.rint(cols / scale[..., None]) + zero[..., None], 0, top).astype(np.uint8)
    return _pack(q, bits), scale.astype(np.float32).reshape(-1), _pack(zero, bits).reshape(-1)


# Where a block's extreme value may land, as a fraction of the grid's wide end (-8 for int4):
# 1.0 is absmax on the whole grid; smaller ratios clip the extreme to give the other values
# finer steps. With a least-squares scale per ratio and two rounds of refinement this cuts the
# squared error of Qwen2.5-Coder-1.5B's int4 blocks by 25-35% against absmax onto -7..7 (blocks
# of 32 and 128), and lands within 6% of the best single scale of a dense sweep on Gaussian
# blocks (tests/test_weight_formats.py).
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
REFINE_ROUNDS = 2
_SEARCH_COLUMNS = 2048  # columns quantized at a time: bounds the search's float32 temporaries


def _fit(cols: np.ndarray, step: np.ndarray, wide: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes rounded at `step`, their least-squares scale and its squared error, per block."""
    step = np.where(step == 0, 1.0, step)
    q = np.clip(np.rint(cols / step), -wide, wide - 1)
    qx = np.einsum("nbk,nbk->nb", q, cols)
    qq = np.einsum("nbk,nbk->nb", q, q)
    scale = np.where(qq > 0, qx / np.maximum(qq, 1e-30), 1.0)
    err = np.einsum("nbk,nbk->nb", cols, cols) - scale * qx  # |x - scale q|^2
    return q, scale.astype(np.float32), err


def blockwise_nbits_searched(w: np.ndarray, bits: int, block: int = INT8_BLOCK
                             ) -> tuple[np.ndarray, np.ndarray]:
    """As blockwise_nbits (same layout, implicit zero point 2^(bits-1)), with codes over the
    whole signed grid -2^(bits-1)..2^(bits-1)-1 and each block's scale searched: for every
    ratio r in CLIP_RATIOS the block is rounded with the step that puts its largest-magnitude
    value at r times the grid's wide end and the codes get their least-squares scale
    (sum(x q) / sum(q q)); the best of those is refined by rounding again at its own scale
    (REFINE_ROUNDS times, kept where the error falls). The block keeps the codes and scale of
    the smallest squared error."""
    k, n = w.shape
    wide = 1 << (bits - 1)
    codes, scales = [], []
    for start in range(0, n, _SEARCH_COLUMNS):
        cols = _blocks(w[:, start:start + _SEARCH_COLUMNS], block)
        extreme = np.take_along_axis(cols, np.abs(cols).argmax(-1)[..., None], -1)[..., 0]
        steps = [extreme / (-wide * r) for r in CLIP_RATIOS]  # the extreme's sign picks the end
        best_q = np.zeros(cols.shape, np.int8)
        best_scale = np.ones(extreme.shape, np.float32)
        best_err = np.full(extreme.shape, np.inf, np.float32)
        for step in steps + [None] * REFINE_ROUNDS:
            q, scale, err = _fit(cols, best_scale[..., None] if step is None else step[..., None],
                                 wide)
            better = err < best_err
            best_err[better], best_scale[better] = err[better], scale[better]
            best_q[better] = q[better]
        best_scale[best_scale == 0] = 1.0  # an all-zero block: any scale reproduces it
        codes.append(_pack((best_q.astype(np.int16) + wide).astype(np.uint8), bits))
        scales.append(best_scale)
    return np.concatenate(codes), np.concatenate(scales).reshape(-1)


def matmul_nbits(g: GraphBuilder, x: str, name: str, arr: np.ndarray, bits: int,
                 layout: NbitsLayout, out: str | None = None,
                 blocks: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    """x @ arr [K, N] as com.microsoft.MatMulNBits in `layout` (`blocks`: codes and scales
    already made, the MXFP6 grid's 8-bit blocks of 32)."""
    zero = None
    if blocks is not None:
        q, scale = blocks
    elif layout.symmetric and layout.scale_search:
        q, scale = blockwise_nbits_searched(arr, bits, layout.block_size)
    elif layout.symmetric:
        q, scale = blockwise_nbits(arr, bits, layout.block_size)
    else:
        q, scale, zero = blockwise_nbits_asymmetric(arr, bits, layout.block_size)
    inputs = [x, g.weight(f"{name}.q{bits}", q), g.weight(f"{name}.scale", scale)]
    if zero is not None:
        inputs.append(g.weight(f"{name}.zero_point", zero))
    out = out or g._name("matmul")
    g.nodes.append(helper.make_node(
        "MatMulNBits", inputs, [out], domain=MS, name=f"n{len(g.nodes)}_MatMulNBits",
        K=arr.shape[0], N=arr.shape[1], bits=bits,
        block_size=INT8_BLOCK if blocks is not None else layout.block_size,
        accuracy_level=layout.accuracy_level))
    return out
