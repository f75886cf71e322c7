"""A step's inputs on the host: the ragged StepBatch, how it is built from rows, and the
power-of-two buckets that pick the compiled program it runs (plain numpy, no jax).

A step batch is ragged: N flat tokens belonging to S sequences (decode tokens and prefill chunks
mixed), with block tables W pages wide. N, S and W are padded up to power-of-two buckets, and so
is the number of sequences with more than one token (a static bound of the attention reference),
so the number of compiled programs stays small. A decode-only step is keyed (S, W); a step with
prefill tokens (N, S, W, P). `bucket_key` gives the program a batch runs.
"""
from __future__ import annotations

import dataclasses

import numpy as np

MIN_TOKEN_BUCKET = 16
MIN_PAGE_BUCKET = 4
MAX_SHORT_Q = 16  # speculative verification steps: at most this many tokens per sequence
# On a GPU or TPU the attention kernels read only each sequence's own pages (the TPU kernel
# copies only its sequence's table row to SMEM), so a block table wider than its sequences costs
# only its copy to the device. A runner that keeps its tables on the device (one GPU:
# engine/device_tables.py) copies none and runs every step at the longest context's width; one
# that sends them (a TPU, a mesh) pads its steps' tables to at least this many tokens' pages
# (one width, few programs, for every context up to it) and wider ones to a power of two (a
# step of 256 sequences with a 128k-token context's full table would copy 8 MB).
FIXED_WIDTH_TOKENS = 2048
# On the CPU the jnp attention gathers and scores every key a step's table holds: prefill steps
# pad their tables to at least this many tokens' pages (the first chunk of any prompt up to it
# shares one width) and wider ones to their own power of two, not to the whole context (a
# 42-token prompt of SmolLM2 reached its first token in 0.27 s with 2048-token tables, 0.14 s
# with these).
CPU_PREFILL_WIDTH_TOKENS = 512


@dataclasses.dataclass
class StepBatch:
    """One step's inputs, host numpy, unpadded (all int32).

    token_ids [N], positions [N], slot_mapping [N]; block_tables [S, W]; query_start_loc [S + 1];
    kv_lens [S]; logits_indices [S] (the flat index of each sequence's last token).
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    kv_lens: np.ndarray
    logits_indices: np.ndarray
    # A speculative verification step: the tokens per sequence its program holds (k + 1 of the
    # speculation, whatever each row proposed this time: one program per k, see bucket_key);
    # 0 for any other step.
    verify_len: int = 0
    # int32 [S]: each sequence's row of the persistent tables (engine.input_batch's slots),
    # which a runner with tables on the device keeps there (engine/device_tables.py); None:
    # rows 0..S-1.
    slots: np.ndarray | None = None
    # int64 [S]: with slots, each row's version (engine.input_batch.InputBatch.versions): a row
    # whose version the device has already synced is not compared again.
    table_versions: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)


def make_step_batch(rows, page_size: int) -> StepBatch:
    """Builds a ragged StepBatch from rows of (tokens to compute, first position, pages).

    A row computes its tokens at positions first, first + 1, ...; their K/V go to the slots of
    the row's pages (a position past the row's pages is not written: slot -1).
    """
    num_rows = len(rows)
    counts = np.fromiter((len(tokens) for tokens, _, _ in rows), np.int32, num_rows)
    firsts = np.fromiter((first for _, first, _ in rows), np.int32, num_rows)
    num_pages = np.fromiter((len(pages) for _, _, pages in rows), np.int32, num_rows)
    token_ids = np.fromiter((t for tokens, _, _ in rows for t in tokens), np.int32,
                            int(counts.sum()))
    tables = np.zeros((num_rows, max(int(num_pages.max(initial=0)), 1)), np.int32)
    for i, (_, _, pages) in enumerate(rows):
        tables[i, : len(pages)] = pages
    return step_batch_from_arrays(token_ids, counts, firsts, tables, num_pages, page_size)


def step_batch_from_arrays(token_ids: np.ndarray, counts: np.ndarray, firsts: np.ndarray,
                           tables: np.ndarray, num_pages: np.ndarray,
                           page_size: int) -> StepBatch:
    """The StepBatch of S rows given as arrays (vectorized over tokens: no Python per row).

    token_ids int32 [N] (the rows' tokens, concatenated); counts, firsts, num_pages int32 [S]:
    tokens computed, first position, pages held by each row; tables int32 [S, W >= the most
    pages of a row], zero past each row's pages (engine.input_batch keeps its rows so). The
    batch's block tables are cut to the widest row.
    """
    num_rows = len(counts)
    width = max(int(num_pages.max(initial=0)), 1)
    tables = np.ascontiguousarray(tables[:, :width], np.int32)
    start = np.zeros(num_rows + 1, np.int32)
    np.cumsum(counts, out=start[1:])
    row_of_token = np.repeat(np.arange(num_rows), counts)  # [N]
    positions = (firsts[row_of_token] + np.arange(start[-1], dtype=np.int32)
                 - start[:-1][row_of_token]).astype(np.int32)
    page_index = positions // page_size
    inside = page_index < num_pages[row_of_token]
    page = tables[row_of_token, np.minimum(page_index, width - 1)]
    slots = np.where(inside, page * page_size + positions % page_size, -1).astype(np.int32)
    return StepBatch(np.asarray(token_ids, np.int32), positions, slots, tables, start,
                     (firsts + counts).astype(np.int32), start[1:] - 1)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def bucket_key(num_tokens: int, num_seqs: int, width: int, max_q_len: int,
               num_prefill_seqs: int, max_seqs: int, max_width: int,
               verify_len: int = 0,
               count_prefill_seqs: bool = True) -> tuple[int, int, int, int, int]:
    """(N, S, W, max_q_len, max_prefill_seqs) of the program that runs such a batch.

    Decode-only steps (max_q_len 1) are keyed by the buckets of S and W. Speculative verification
    steps (verify_len k + 1, at most MAX_SHORT_Q, and no sequence computing more) by S, W and
    the bucket q of verify_len (N = S * q): rows that propose fewer tokens pad to it, so one
    program serves every round. Longer prefill steps pad S and W to their maxima (max_seqs,
    max_width) and the query bound to N, so they are keyed by N and the number of prefilling
    sequences alone: few programs, all compiled at start-up. Without count_prefill_seqs (an
    attention that reads the ragged batch as it is and takes no bound on them,
    ops.paged_attention.bounds_prefill_seqs) by N alone, the bound at its most.
    """
    if max_q_len <= 1:
        s = bucket(num_seqs)
        return s, s, bucket(width, MIN_PAGE_BUCKET), 1, 0
    if max_q_len <= verify_len <= MAX_SHORT_Q:
        s, q = bucket(num_seqs), bucket(verify_len)
        return s * q, s, bucket(width, MIN_PAGE_BUCKET), q, s
    n = bucket(num_tokens, MIN_TOKEN_BUCKET)
    return (n, bucket(max_seqs), bucket(max_width, MIN_PAGE_BUCKET), n,
            bucket(num_prefill_seqs) if count_prefill_seqs else bucket(max_seqs))


def table_widths(max_width: int, page_size: int, platform: str) -> tuple[int, int]:
    """(least block-table width of any step, least of a prefill step), in pages, for a runner
    of sequences up to max_width pages on `platform` (its kernels' platform). On the CPU decode
    steps take their own width's bucket and prefill steps CPU_PREFILL_WIDTH_TOKENS' pages or
    their own bucket, whichever is wider; on a GPU or TPU every step pads to
    FIXED_WIDTH_TOKENS' pages or its own bucket, whichever is wider."""
    if platform == "cpu":
        return 1, min(max_width, -(-CPU_PREFILL_WIDTH_TOKENS // page_size))
    floor = min(max_width, -(-FIXED_WIDTH_TOKENS // page_size))
    return floor, floor


def pad_to(a: np.ndarray, shape: tuple[int, ...], value: int) -> np.ndarray:
    out = np.full(shape, value, dtype=np.int32)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def padding_batch(q_lens, num_pages: int, verification: bool = False) -> StepBatch:
    """A step of sequences computing q_lens tokens each that reads and writes nothing (every
    length 0, every slot -1): it runs a program without touching the cache's contents. A
    verification step's verify_len is the longest of q_lens."""
    q_lens = np.asarray(q_lens, np.int32)
    num_seqs, num_tokens = len(q_lens), int(q_lens.sum())
    start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return StepBatch(token_ids=np.zeros(num_tokens, np.int32),
                     positions=np.zeros(num_tokens, np.int32),
                     slot_mapping=np.full(num_tokens, -1, np.int32),
                     block_tables=np.zeros((num_seqs, num_pages), np.int32),
                     query_start_loc=start, kv_lens=np.zeros(num_seqs, np.int32),
                     logits_indices=np.maximum(start[1:] - 1, 0),
                     verify_len=int(q_lens.max()) if verification else 0)
