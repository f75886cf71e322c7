"""The read floor of a weight: how long the device takes to do nothing but read its bytes.

A decode product at one to sixteen rows is memory-bound: its time is the weight's bytes over the
bandwidth plus a fixed cost (the launch's ramp, the first loads' latency, the tail of the last
programs, a split-K sum). The bandwidth term shrinks four-fold from bf16 to INT4; the fixed cost
does not. So the speedup over bf16 that any INT4 product can reach on a shape is bounded by

    bf16 product time / (time to read the INT4 weight's bytes alone),

and on a small shape that bound can sit below a target however good the kernel is. This module
times that denominator the way bench_matmul times its products: XLA's sum of a uint32 array of
exactly the weight's bytes (codes, scales, offsets), `calls` distinct arrays per jitted program,
each reduced on its own; several reduction forms, the fastest kept. On an H200 XLA's reductions
read large arrays at 4.3-4.6 TB/s (docs/PERFORMANCE.md, thirtieth session), at or above the
copy rate, so this is a floor a product kernel could approach, not one it must stay above: a
kernel that reads better than XLA's reduction could beat it, which is why bench_matmul prints
it beside the products instead of asserting anything with it.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

# (name, words per row, axis): sums along rows of 256 or 4096 words, or down columns of 4096
READ_FORMS = (("rows256", 256, 1), ("rows4096", 4096, 1), ("cols4096", 4096, 0))


def word_rows(nbytes: int, words_per_row: int) -> int:
    """Rows of `words_per_row` uint32 words that hold at least `nbytes` bytes."""
    if nbytes <= 0:
        raise ValueError(f"read floor: nbytes must be positive, got {nbytes}")
    return -(-nbytes // (4 * words_per_row))


def read_program(calls: int, axis: int):
    """A program that reduces each of `calls` arrays (uint32 [rows, words]) along `axis`: every
    byte read once, outputs of rows (or words) uint32 values, a 1/words (or 1/rows) share of
    the bytes read."""
    def prog(arrays):
        return tuple(jnp.sum(arrays[c], axis=axis, dtype=jnp.uint32) for c in range(calls))
    return prog


def read_floor(name: str, nbytes: int, calls: int, time_fn) -> dict:
    """The fastest READ_FORMS read of `nbytes` bytes: a row {'impl': 'read_<name>', 'bytes',
    'form', 'us', 'TBps'} plus what `time_fn(prog, args) -> dict` adds (bench_matmul's
    `timed_row`-style timer: 'us' and, with device times, 'dev_us'); random words, never zeros.
    Each form is timed on its own arrays, freed before the next."""
    best = None
    for form, words, axis in READ_FORMS:
        rows = word_rows(nbytes, words)
        key = jax.random.key(zlib.crc32(f"{name}/{form}".encode()))  # the same in every run
        arrays = tuple(jax.random.bits(jax.random.fold_in(key, c), (rows, words), jnp.uint32)
                       for c in range(calls))
        read_bytes = rows * words * 4  # nbytes rounded up to whole rows (under 16 KiB more)
        row = {"impl": f"read_{name}", "bytes": read_bytes, "form": form,
               **time_fn(read_program(calls, axis), (arrays,))}
        del arrays
        if "us" not in row:
            continue
        row["TBps"] = read_bytes / row["us"] / 1e6
        if best is None or row.get("dev_us", row["us"]) < best.get("dev_us", best["us"]):
            best = row
    if best is None:
        raise RuntimeError(f"read floor of {name}: no reduction form ran")
    return best
