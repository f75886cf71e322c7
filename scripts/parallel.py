"""Flags and start-up of sharded and multi-process runs, shared by the scripts.

    --tp / --dp / --ep     tensor-, data- and expert-parallel sizes: the (data, expert, model)
                           mesh of engine/mesh.py (ep splits a mixture's experts). None given
                           (one process): no mesh, one device.
    --coordinator_address  host:port of process 0, --num_processes, --process_id: join a
                           multi-process run (jax.distributed.initialize) before any jax work.

Every process runs the same script with the same flags (only --process_id differs) and steps the
same engine; only process 0 prints, serves and writes.
"""
from __future__ import annotations

import os
import sys

import jax
from absl import flags

from configs.mesh import expert_size, mesh_shape
from engine.mesh import initialize_distributed, is_main_process, make_mesh
from scripts.common import add_xla_flag

flags.DEFINE_integer("tp", None, "Tensor-parallel devices (mesh axis 'model'). Default 1.")
flags.DEFINE_integer("dp", None, "Data-parallel groups (mesh axis 'data'). Default 1, or with "
                     "several processes all devices / tp.")
flags.DEFINE_integer("ep", None, "Expert-parallel devices (mesh axis 'expert'): a mixture of "
                     "experts' experts split over them. Default 1.")
flags.DEFINE_string("coordinator_address", None,
                    "host:port of process 0 in a multi-process run (jax.distributed).")
flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")


def setup_parallel():
    """Joins a multi-process run when asked; returns the mesh of --tp / --dp / --ep, or None.

    Call it first in main (before any other jax work). On processes other than 0 the standard
    output and error are silenced, so only process 0 prints.
    """
    f = flags.FLAGS
    initialize_distributed(f.coordinator_address, f.num_processes, f.process_id)
    if not is_main_process():
        devnull = open(os.devnull, "w")
        sys.stdout = sys.stderr = devnull
    if f.tp is None and f.dp is None and f.ep is None and jax.process_count() == 1:
        return None
    tp, ep = f.tp or 1, f.ep or 1
    dp = f.dp or (max(len(jax.devices()) // (tp * ep), 1) if jax.process_count() > 1 else 1)
    return make_mesh(tp, dp, ep=ep)


def host_devices(count: int) -> None:
    """Asks for `count` host CPU devices (XLA_FLAGS), unless set already; call before jax starts."""
    if count > 1:
        add_xla_flag("--xla_force_host_platform_device_count", count)


def describe(mesh) -> str:
    """One line on the mesh, the device kind and the attention layout (for the scripts' logs)."""
    tp, dp = mesh_shape(mesh)
    ep = f" x ep={expert_size(mesh)}" if expert_size(mesh) > 1 else ""
    return (f"mesh: tp={tp} x dp={dp}{ep} over {mesh.devices.size} {jax.devices()[0].device_kind} "
            f"device(s), {jax.process_count()} process(es)")
