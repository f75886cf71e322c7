"""Helpers over the device arrays a runner passes around: their abstract form for lowering a
program from shapes alone, and the copies of sampled tokens to the host."""
from __future__ import annotations

import jax
import numpy as np


def abstract_arrays(args: tuple) -> tuple:
    """args with every device array replaced by its shape, dtype and sharding (host numpy and
    static values kept): what lowering needs, without reading a buffer another thread may be
    donating."""
    def spec(a):
        if isinstance(a, jax.Array):  # an uncommitted array lowers as one without a sharding
            return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                        sharding=a.sharding if a.committed else None)
        return a
    return tuple(jax.tree.map(spec, a) for a in args)


def start_copies(results: tuple) -> tuple:
    """Starts copying sampled device arrays to the host (None entries skipped); returns them."""
    for r in results:
        if r is not None:
            r.copy_to_host_async()
    return results


def fetch_samples(results: tuple, num_rows: int) -> tuple:
    """The first num_rows rows of `sample_device`'s results as host numpy (waits for them)."""
    return tuple(None if r is None else np.asarray(r)[:num_rows] for r in results)
