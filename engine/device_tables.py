"""Block tables that live on the device: a step reads its sequences' rows of a [rows, width]
table kept beside the KV cache instead of a [S, W] copy sent with every step.

The GPU attention kernel reads only each sequence's own pages, so a table as wide as the longest
context costs the device nothing; sent from the host it costs S x W x 4 bytes a step (8 MB for
256 sequences of 128k tokens), which is why host-sent tables are cut to power-of-two widths, one
compiled program each. Kept on the device, every step has the one width of the longest context
(no program per width, nothing compiled when a context first grows past one) and sends only the
index of each sequence's row and the entries that changed.

`DeviceTables.sync` compares a step's tables with a host mirror of the device's rows and sends
the differences as a scatter: pages a sequence gained, a row taken over by another request,
columns a row no longer holds (cleared, so every row is zero past its pages as on the host).
Rows of sequences that read no keys (kv_len 0: padding) are neither synced nor read. The
engine's rows carry the version of their row in engine.input_batch (bumped at each change): a
row whose version the device already holds is not compared again, so a step's host cost grows
with the rows that changed, not with S x W.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.step_batch import bucket
from ops.attention_tiles import kernel_takes_head_dim

# Entries per scatter program: one program shape; a step that changes more sends several.
WRITE_BLOCK = 1024


@functools.partial(jax.jit, donate_argnums=0)
def _write(tables, rows, cols, pages):
    # tables [R, W]; rows, cols, pages [WRITE_BLOCK] (rows == R: padding, dropped)
    return tables.at[rows, cols].set(pages, mode="drop")


def tables_on_device(kernels, head_dim: int) -> bool:
    """Whether a runner of these kernels (ops.kernel_choice.KernelBackends) keeps its tables
    on the device: where attention is the GPU kernel on one device, which reads only each
    sequence's pages. Not the jnp attention (the CPU's), which gathers the whole table; not a
    mesh, whose data shards split the tables (engine/sharded_runner.py); not yet the TPU
    kernel, which copies its sequence's table row to SMEM (unmeasured with full-width rows).
    A head_dim the kernel does not take runs the jnp attention too."""
    return (kernels.platform == "gpu" and kernels.attention == "pallas" and not kernels.mesh
            and kernel_takes_head_dim(head_dim))


class DeviceTables:
    """The device's block tables [rows, width] int32 and the host's mirror of them."""

    def __init__(self, rows: int, width: int):
        self.host = np.zeros((max(rows, 1), max(width, 1)), np.int32)  # [R, W] the mirror
        self.filled = np.zeros(self.host.shape[0], np.int32)  # [R] columns that may be nonzero
        self.versions = np.full(self.host.shape[0], -1, np.int64)  # [R] synced version (-1: none)
        self.device = jnp.asarray(self.host)
        self.entries_sent = 0  # table entries written to the device so far

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def sync(self, tables: np.ndarray, kv_lens: np.ndarray, slots: np.ndarray | None = None,
             versions: np.ndarray | None = None) -> np.ndarray:
        """Brings the device rows of a step's sequences to their tables; returns int32 [S], the
        row each sequence reads (0 for a sequence with kv_len 0, which reads none).

        tables int32 [S, W'] (zero past each sequence's pages); kv_lens int32 [S]; slots int32
        [S]: each sequence's row (engine.input_batch's slots; None: rows 0..S-1); versions
        int64 [S]: with slots, each row's version there (None: every row is compared). A table
        wider than the device's or a row past its rows grows it (a new width: new programs).
        """
        num_seqs, width = tables.shape
        slots = (np.arange(num_seqs, dtype=np.int32) if slots is None
                 else np.asarray(slots, np.int32))
        live = np.asarray(kv_lens) > 0  # [S]
        rows_read = np.where(live, slots, 0).astype(np.int32)  # [S]
        if not live.any():
            return rows_read
        self._grow(int(rows_read.max()) + 1, width)
        if versions is None:
            stale, versions = live, np.full(num_seqs, -1, np.int64)
        else:
            stale = live & (self.versions[rows_read] != versions)
        if not stale.any():
            return rows_read
        rows, step = slots[stale], tables[stale]  # [L], [L, W']
        at_row, at_col = np.nonzero(self.host[rows, :width] != step)  # [C] each
        writes = [(rows[at_row], at_col.astype(np.int32), step[at_row, at_col])]
        for row in rows[self.filled[rows] > width].tolist():  # columns this row no longer holds
            cols = width + np.flatnonzero(self.host[row, width:self.filled[row]])
            writes.append((np.full(len(cols), row, np.int32), cols.astype(np.int32),
                           np.zeros(len(cols), np.int32)))
        r, c, pages = (np.concatenate(parts) for parts in zip(*writes))
        if len(r):
            self.host[r, c] = pages
            self._send(r, c, pages)
        self.filled[rows] = width
        self.versions[rows] = versions[stale]
        return rows_read

    def compile(self) -> None:
        """Compiles the scatter ahead of time, from shapes alone (safe beside running steps,
        which donate the table)."""
        block = jax.ShapeDtypeStruct((WRITE_BLOCK,), jnp.int32)
        _write.lower(jax.ShapeDtypeStruct(self.host.shape, jnp.int32), block, block,
                     block).compile()

    def _send(self, rows: np.ndarray, cols: np.ndarray, pages: np.ndarray) -> None:
        """Scatters the entries to the device, WRITE_BLOCK at a time."""
        self.entries_sent += len(rows)
        out_of_range = self.host.shape[0]
        for start in range(0, len(rows), WRITE_BLOCK):
            block = slice(start, start + WRITE_BLOCK)
            count = len(rows[block])
            r = np.full(WRITE_BLOCK, out_of_range, np.int32)
            c = np.zeros(WRITE_BLOCK, np.int32)
            p = np.zeros(WRITE_BLOCK, np.int32)
            r[:count], c[:count], p[:count] = rows[block], cols[block], pages[block]
            self.device = _write(self.device, r, c, p)

    def _grow(self, rows: int, width: int) -> None:
        """Makes room for `rows` rows and `width` columns (powers of two past the current)."""
        old_rows, old_width = self.host.shape
        if rows <= old_rows and width <= old_width:
            return
        new_rows = old_rows if rows <= old_rows else max(bucket(rows), 2 * old_rows)
        new_width = old_width if width <= old_width else bucket(width)
        self.host = np.pad(self.host, ((0, new_rows - old_rows), (0, new_width - old_width)))
        self.filled = np.pad(self.filled, (0, new_rows - old_rows))
        self.versions = np.pad(self.versions, (0, new_rows - old_rows), constant_values=-1)
        self.device = jnp.asarray(self.host)
