"""The abstract device under which a step lowers for a chip this host lacks, and the GPUs a
lowering can target: Pallas kernels ask the device for their chip (a TPU generation, a GPU's
compute capability), and inside `abstract_device_lowering` they get the target's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType


@dataclasses.dataclass(frozen=True)
class GpuKind:
    name: str  # short name, the key of GPUS
    device_kind: str  # jax's Device.device_kind
    memory_gib: float  # device memory as the card reports it (nvidia-smi)


GPUS: dict[str, GpuKind] = {g.name: g for g in (
    GpuKind("h100", "NVIDIA H100 80GB HBM3", 79.6),
    GpuKind("h200", "NVIDIA H200", 140.4),
)}

_HOPPER = re.compile(r"\bG?H(100|200|800|20)\b")  # compute capability 9.0


def is_hopper(device_kind: str) -> bool:
    """The device kind names a Hopper GPU (wgmma)."""
    return bool(_HOPPER.search(device_kind))


def abstract_gpu_kind() -> str | None:
    """The device kind of the abstract GPU that a lowering targets, None outside one."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None and device.platform == "gpu" else None


@contextlib.contextmanager
def abstract_device_lowering(device_kind: str, platform: str, mesh=None):
    """Lower for `platform` ("tpu", "gpu") from any host: inside,
    `jit(f).trace(...).lower(lowering_platforms=(...))` sees an abstract device of
    `device_kind`. mesh: the jax Mesh a sharded step runs over (its axes and their types are
    kept), None for one device."""
    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    if mesh is None:
        sizes, names, types = (1,), (platform,), (AxisType.Explicit,)
    else:
        sizes, names, types = tuple(mesh.axis_sizes), tuple(mesh.axis_names), \
            tuple(mesh.axis_types)
    abstract = AbstractMesh(sizes, names, types, abstract_device=device)
    with jax.sharding.use_abstract_mesh(abstract):
        yield abstract
