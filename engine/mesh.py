"""The device mesh of sharded inference, and multi-process start-up.

Three mesh axes:
    data    data parallelism: the step's sequences (and the KV-cache pages) split into `dp`
            groups, each served by its own copy of the weights
    expert  expert parallelism: a mixture of experts' experts split over `ep` devices
            (models/moe.py); attention and the KV cache are replicated over it
    model   tensor parallelism: weights and KV heads split over `tp` devices (models/sharding.py)

The mesh is `dp x ep x tp` devices in `jax.devices()` order, so a `model` group is `tp`
consecutive devices and an `expert` group the next level: with several processes (hosts) that
keeps tensor and expert parallelism inside a host as long as ep * tp <= the devices per host,
and spreads data parallelism across hosts.

Several processes: every process runs the same program (JAX's multi-controller model) after
`initialize_distributed`; they all step the same engine on the same inputs, and only process 0
prints, serves or writes (`is_main_process`).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from configs.mesh import AXES


def make_mesh(tp: int = 1, dp: int = 1, devices=None, ep: int = 1) -> Mesh:
    """A (data=dp, expert=ep, model=tp) mesh over the first dp * ep * tp of `devices`
    (default: all devices).

    dp * ep * tp must divide the number of devices (and equal it when there are several
    processes, since every process must own a part of the mesh); otherwise ValueError says why.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("tp", tp), ("dp", dp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    count = tp * dp * ep
    sizes = f"tp={tp} x dp={dp}" + (f" x ep={ep}" if ep > 1 else "")
    if len(devices) % count:
        raise ValueError(f"{sizes} = {count} devices does not divide the "
                         f"{len(devices)} devices available ({_describe(devices)})")
    if jax.process_count() > 1 and count != len(devices):
        raise ValueError(f"with {jax.process_count()} processes tp x dp x ep must use all "
                         f"{len(devices)} devices, got {sizes} = {count}")
    grid = np.array(devices[:count], dtype=object).reshape(dp, ep, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _describe(devices) -> str:
    kinds = sorted({d.device_kind for d in devices})
    return f"{', '.join(kinds)}; {jax.process_count()} process(es)"


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> bool:
    """Joins the processes of a multi-host run (jax.distributed.initialize); False if single.

    Must run before any other jax call. All three values are needed unless a cluster manager
    (Slurm, Open MPI, TPU) lets jax find them; num_processes 1 (or None) and no coordinator
    means a single process, and nothing is initialized.
    """
    if coordinator_address is None and (num_processes or 1) == 1:
        return False
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if (process_id is not None and num_processes is not None
            and not 0 <= process_id < num_processes):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True


def is_main_process() -> bool:
    """True on the one process that prints, serves and writes (process 0)."""
    return jax.process_index() == 0
