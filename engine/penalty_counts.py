"""The token counts that repetition, presence and frequency penalties read, kept on the device.

A penalized row needs to know which tokens its prompt holds and how often each output token
came. Sent with every step, those histories cost S x L ids and a host pass over every token a
step, and they need every output token on the host, so a penalized request would keep the
engine from overlapping a step with the previous one's samples. Instead each input-batch slot
(engine/input_batch.py) owns a row of an int32 [R, V] table beside the KV cache: a request's
prompt and outputs are written once, when it takes its slot, and from then on the sampler
counts each token it draws for the row in the same program (engine.sampling.sample_penalized).

An entry is the token's output count, plus PROMPT_FLAG where the prompt holds it. A slot's row
is only meaningful while a penalized request holds it: other rows may gather stray counts
(a token drawn after its request stopped), and a new owner's history write clears the row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.device_arrays import abstract_arrays
from engine.sampling import PROMPT_FLAG
from engine.step_batch import bucket

# Tokens per history write: one program shape; a longer history is written in several.
WRITE_CHUNK = 2048


@functools.partial(jax.jit, donate_argnums=0)
def _write_history(counts, slot, tokens, clear, outputs):
    """counts int32 [R, V]; slot int32 []; tokens int32 [WRITE_CHUNK] (V or more: padding,
    dropped); clear: zero the row first; outputs: the tokens are outputs (counted), else prompt
    tokens (flagged)."""
    row = jnp.where(clear, 0, counts[slot])  # [V]
    flagged = row.at[tokens].set(
        jnp.take(row, tokens, mode="fill", fill_value=0) | PROMPT_FLAG, mode="drop")
    counted = row.at[tokens].add(1, mode="drop")
    return counts.at[slot].set(jnp.where(outputs, counted, flagged))


class PenaltyCounts:
    """The device's count table [rows, vocab] int32 (rows: input-batch slots).

    place: puts a host array where the sampler reads it (the step's logits' placement). The
    table's abstract form is taken when it is made, so that a compile thread never reads an
    array a step is donating.
    """

    def __init__(self, rows: int, vocab: int, place=jnp.asarray):
        self.vocab, self._place = vocab, place
        self._set(place(np.zeros((bucket(max(rows, 1)), vocab), np.int32)))

    def _set(self, device: jax.Array) -> None:
        self.device = device
        # the table's shape, dtype and placement, for lowering programs that take it
        self.abstract = abstract_arrays((device,))[0]
        self._write_compiled = False

    @property
    def rows(self) -> int:
        return self.device.shape[0]

    def write(self, slot: int, prompt, output) -> None:
        """Sets slot's row to a request's history: prompt token ids flagged, output token ids
        counted (WRITE_CHUNK at a time)."""
        if slot >= self.rows:  # an input batch grown past its capacity: grows too
            grown = np.zeros((bucket(slot + 1), self.vocab), np.int32)
            grown[: self.rows] = np.asarray(self.device)
            self._set(self._place(grown))
        clear = True
        for ids, outputs in ((prompt, False), (output, True)):
            ids = np.asarray(ids, np.int32)
            for start in range(0, len(ids), WRITE_CHUNK):
                self._write(slot, ids[start: start + WRITE_CHUNK], clear, outputs)
                clear = False
        if clear:  # no tokens at all
            self._write(slot, np.zeros(0, np.int32), True, False)

    def _write(self, slot: int, ids: np.ndarray, clear: bool, outputs: bool) -> None:
        tokens = np.full(WRITE_CHUNK, self.vocab, np.int32)
        tokens[: len(ids)] = ids
        self.device = _write_history(self.device, *self._args(slot, tokens, clear, outputs))

    def _args(self, slot, tokens, clear, outputs) -> tuple:
        return tuple(self._place(np.asarray(a)) for a in (np.int32(slot), tokens,
                                                          np.bool_(clear), np.bool_(outputs)))

    def compile(self) -> None:
        """Compiles the history write ahead of time (once), from shapes alone (safe beside
        running steps, which donate the table)."""
        if self._write_compiled:
            return
        args = abstract_arrays(self._args(0, np.zeros(WRITE_CHUNK, np.int32), True, False))
        _write_history.lower(self.abstract, *args).compile()
        self._write_compiled = True
