"""Block sizes of the TPU ragged paged attention kernel, per TPU generation.

A program of ops/tpu_ragged_attention.py handles `block_q` query tokens of one sequence and one
kv head (block_q * G rows of the MXU tile) and walks that sequence's keys `pages_per_block`
pages at a time, each block one round of page DMAs (double-buffered). The table is data: the
sizes put the tile's rows near the MXU's width (128 on v5e, 256 on v6e) for prefill and keep
about 128-512 keys per DMA round. They are starting points chosen from the chips' published
MXU sizes and VMEM, not measured on hardware (no TPU was lent).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TpuAttentionBlocks:
    """Static block sizes of one kernel call."""

    block_q: int  # query tokens per program (one sequence's)
    pages_per_block: int  # pages per DMA round (one key block)


# generation -> (decode blocks: max_q_len == 1, prefill / mixed blocks); keys per DMA round
# are pages_per_block * page_size.
KEYS_PER_BLOCK = {"v5e": (512, 256), "v6e": (512, 512), "default": (256, 256)}
ROWS_PER_TILE = {"v5e": 128, "v6e": 256, "default": 128}
GENERATIONS = tuple(KEYS_PER_BLOCK)


def tpu_attention_blocks(generation: str, max_q_len: int, group: int, page_size: int,
                         table_width: int) -> TpuAttentionBlocks:
    """The block sizes for a TPU generation ("v5e", "v6e" or "default") and a call's shape.

    block_q: one token for decode-only steps, else the tile's rows / G (at least 1), at most
    max_q_len. pages_per_block: the generation's keys per round / page_size, at least 1 and at
    most the block table's width.
    """
    if generation not in KEYS_PER_BLOCK:
        raise ValueError(f"tpu_attention_blocks: generation {generation!r} must be one of "
                         f"{GENERATIONS}")
    if min(max_q_len, group, page_size, table_width) < 1:
        raise ValueError(f"tpu_attention_blocks: max_q_len {max_q_len}, group {group}, "
                         f"page_size {page_size} and table_width {table_width} must be >= 1")
    decode_keys, prefill_keys = KEYS_PER_BLOCK[generation]
    if max_q_len == 1:
        block_q, keys = 1, decode_keys
    else:
        block_q = min(max(ROWS_PER_TILE[generation] // group, 1), max_q_len)
        keys = prefill_keys
    pages = min(max(keys // page_size, 1), table_width)
    return TpuAttentionBlocks(block_q=block_q, pages_per_block=pages)
