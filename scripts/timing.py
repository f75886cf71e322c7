"""Timing of jitted device work the way it runs in a step: calls queued, one sync."""
from __future__ import annotations

import statistics
import time

import jax


def time_per_call(fn, args, calls: int, runs: int, queue: int) -> float:
    """Seconds per call of the work in `fn(*args)`, which itself runs `calls` of them.

    fn is jitted and run once untimed (compilation); then, `runs` times, it is queued `queue`
    times and synchronized once: the median of wall time / (queue x calls). The ~30 us dispatch
    of a jitted call is thus spread over many calls, as in a step that runs the work per layer.
    """
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        out = None
        for _ in range(queue):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / (queue * calls))
    return statistics.median(samples)
