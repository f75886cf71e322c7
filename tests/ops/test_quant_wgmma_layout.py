"""ops/quant_wgmma_layout.py and the bit tricks of ops/quant_wgmma.py's inline conversion,
on any backend: a numpy model of each PTX instruction the pair conversions use, run on every
code, and the K order they imply (a permutation inside each block, matching what the model of
the conversion produces).
"""
from __future__ import annotations

import numpy as np
import pytest

from ops import quant_wgmma_layout as layout


# ---- numpy models of the PTX instructions used by the conversions ---------------------------

def lop3(a, b, c, lut):
    """PTX lop3.b32: bit i of the result is lut[(a_i << 2) | (b_i << 1) | c_i] (a = 0xF0, b = 0xCC,
    c = 0xAA)."""
    out = np.zeros_like(a)
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1).astype(np.uint32) << bit
    return out


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of (b:a)."""
    both = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(both[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4)).astype(np.uint32)


def bf16x2(word):
    """The two bf16 halves of uint32 words as float32 (low, high)."""
    lo = ((word & 0xFFFF) << 16).view(np.float32)
    hi = (word & 0xFFFF0000).view(np.float32)
    return lo, hi


def test_int4_pair_instructions_give_codes_minus_eight():
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    for j in range(4):  # _int4_pairs: shr, lop3 0xEA ((a & b) | c), sub.bf16x2 of 136
        t = lop3(words >> np.uint32(4 * j), np.uint32(0x000F000F), np.uint32(0x43004300), 0xEA)
        lo, hi = bf16x2(t)
        np.testing.assert_array_equal(lo - 136, ((words >> (4 * j)) & 0xF).astype(np.float32) - 8)
        np.testing.assert_array_equal(hi - 136,
                                      ((words >> (4 * j + 16)) & 0xF).astype(np.float32) - 8)


def test_int8_pair_instructions_give_codes_minus_128():
    words = np.random.default_rng(1).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    words[:256] = np.arange(256, dtype=np.uint32) * 0x01010101  # every byte value
    for j, sel in enumerate((0x4140, 0x4342)):  # _int8_pairs: prmt, and, lop3 0x6A, sub
        s0 = prmt(words, np.uint32(0x43), sel)
        s1 = s0 & np.uint32(0xFF7FFF7F)
        s2 = lop3(s0, np.uint32(0xFF80FF80), np.uint32(0x00800080), 0x6A)
        (a_lo, a_hi), (b_lo, b_hi) = bf16x2(s1), bf16x2(s2)
        for half, (a, b) in enumerate(((a_lo, b_lo), (a_hi, b_hi))):
            code = ((words >> (8 * (2 * j + half))) & 0xFF).astype(np.float32)
            np.testing.assert_array_equal(a - b, code - 128)


@pytest.mark.parametrize("bits", [4, 8])
def test_k_order_matches_the_register_conversion(bits):
    """Column c of the converted tile, as the WGMMA layout places it (thread t = lane mod 4
    holds columns 2t + 8j + h of register j), holds the code of K position order[c]."""
    k = 256
    order = layout.wgmma_k_order(bits, k)
    assert sorted(order.tolist()) == list(range(k))
    span, per_word = (32, 8) if bits == 4 else (16, 4)
    for block in range(k // span):
        for t in range(4):  # the K positions of thread t's loaded word (UPCAST layouts)
            first = 8 * t if bits == 4 else 8 * (t % 2) + 4 * (t // 2)
            word_k = block * span + first + np.arange(per_word)
            for j in range(per_word // 2):
                pair = (j, j + 4) if bits == 4 else (2 * j, 2 * j + 1)  # slots converted
                for h in range(2):
                    c = block * span + 8 * j + 2 * t + h
                    assert order[c] == word_k[pair[h]]
