"""A step's integer inputs packed into one host array: one transfer per step, not eight.

Every numpy argument of a jitted call is a separate host-to-device transfer, each costing the
host a fraction of a millisecond on a GPU, several times a device array's dispatch. A decode step
has eight int32 inputs, so the runner packs them into one array on the host and slices it apart
inside the jitted step, at offsets fixed by the step's bucket (`StepLayout`, a static argument).
"""
from __future__ import annotations

import dataclasses

import numpy as np

# The packed inputs, in order (their lengths: StepLayout.sizes).
FIELDS = ("tokens", "positions", "slot_mapping", "block_tables", "query_start_loc", "kv_lens",
          "logits_indices", "sample_index")


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The padded sizes of a step (static: one compiled program per layout).

    num_tokens N, num_seqs S, width W (block-table columns), and the attention bounds max_q_len
    and max_prefill_seqs (see models.llama.AttentionMetadata). resident: the step's tables are
    rows of the device's (engine/device_tables.py); block_tables packs each sequence's row [S]
    instead of the tables [S, W].
    """

    num_tokens: int
    num_seqs: int
    width: int
    max_q_len: int
    max_prefill_seqs: int
    resident: bool = False

    def sizes(self) -> tuple[int, ...]:
        """Lengths of the FIELDS in the packed array."""
        n, s = self.num_tokens, self.num_seqs
        return (n, n, n, s if self.resident else s * self.width, s + 1, s, s, n)

    def offsets(self) -> list[int]:
        return list(np.cumsum((0,) + self.sizes()))


def pack(layout: StepLayout, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The FIELDS (host int32 arrays, each already padded to its size; block_tables [S, W])
    concatenated into one int32 [sum(sizes)] array."""
    out = np.empty(layout.offsets()[-1], np.int32)
    for name, start, size in zip(FIELDS, layout.offsets(), layout.sizes()):
        values = np.asarray(arrays[name]).reshape(-1)
        if values.size != size:
            raise ValueError(f"step input {name} has {values.size} values, layout {layout} "
                             f"needs {size}")
        out[start:start + size] = values
    return out


def unpack(packed, layout: StepLayout) -> dict:
    """The FIELDS sliced out of a packed array (jax or numpy) along its last axis, so
    [..., L] gives [..., size] fields; block_tables as [..., S, W] (resident: the rows [..., S])."""
    fields = {}
    for name, start, size in zip(FIELDS, layout.offsets(), layout.sizes()):
        fields[name] = packed[..., start:start + size]
    if not layout.resident:
        tables = fields["block_tables"]
        fields["block_tables"] = tables.reshape(tables.shape[:-1]
                                                + (layout.num_seqs, layout.width))
    return fields
