"""TPU chips as data: device kinds, block-table generation, published HBM bandwidth, and the
abstract TPU device under which kernels lower for TPU on a machine without one.

The bandwidths are the vendor's published per-chip HBM figures (Google Cloud TPU system
architecture pages, cloud.google.com/tpu/docs/<version>; jax's own chip table,
jax/_src/tpu_info.py, agrees within 12%). They are the floors that the benchmarks report on a
TPU; nothing here was measured (no TPU was lent to this project).
"""
from __future__ import annotations

import contextlib
import dataclasses

from ops.lowering_target import abstract_device_lowering


@dataclasses.dataclass(frozen=True)
class TpuChip:
    name: str  # short name, the key of CHIPS
    device_kinds: tuple[str, ...]  # jax's Device.device_kind strings of this chip
    hbm_bytes_per_s: float  # published HBM bandwidth per chip
    hbm_gib: int  # HBM per chip
    source: str  # where the bandwidth is published
    generation: str  # the key of the attention block tables (ops/tpu_attention_tiles.py)


CHIPS: dict[str, TpuChip] = {c.name: c for c in (
    TpuChip("v4", ("TPU v4",), 1.2e12, 32, "cloud.google.com/tpu/docs/v4", "default"),
    TpuChip("v5e", ("TPU v5 lite", "TPU v5e"), 8.19e11, 16, "cloud.google.com/tpu/docs/v5e",
            "v5e"),
    TpuChip("v5p", ("TPU v5", "TPU v5p"), 2.765e12, 95, "cloud.google.com/tpu/docs/v5p",
            "default"),
    TpuChip("v6e", ("TPU v6 lite", "TPU v6e"), 1.64e12, 32, "cloud.google.com/tpu/docs/v6e",
            "v6e"),
)}


def chip_of_device_kind(device_kind: str) -> TpuChip | None:
    """The chip whose device kind this is (jax.devices()[0].device_kind), None if unknown."""
    for chip in CHIPS.values():
        if device_kind in chip.device_kinds:
            return chip
    return None


def generation_of_device_kind(device_kind: str) -> str:
    """The block-table generation of a device kind ("default" for chips without a row)."""
    chip = chip_of_device_kind(device_kind)
    return "default" if chip is None else chip.generation


@contextlib.contextmanager
def tpu_lowering(chip: str = "v6e", mesh=None):
    """Lower for TPU from any host: inside, `jit(f).trace(...).lower(lowering_platforms=("tpu",))`
    sees an abstract TPU device of `chip` (a key of CHIPS), which is what Pallas TPU kernels
    ask for their chip's information. mesh: the jax Mesh a sharded step runs over (its axes
    and their types are kept), None for one device."""
    if chip not in CHIPS:
        raise ValueError(f"tpu_lowering: chip {chip!r} must be one of {tuple(CHIPS)}")
    with abstract_device_lowering(CHIPS[chip].device_kinds[0], "tpu", mesh) as abstract:
        yield abstract
