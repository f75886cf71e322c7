"""The names of the three device-mesh axes, shared by the weight rules (models/sharding.py) and
the engine's mesh and shardings (engine/mesh.py, engine/sharding.py).

    data    data parallelism: the step's sequences (and the KV-cache pages) split into `dp`
            groups, each served by its own copy of the weights
    expert  expert parallelism: a mixture of experts' experts split over `ep` devices
            (models/moe.py); everything else is replicated over it
    model   tensor parallelism: weights and KV heads split over `tp` devices
"""
from __future__ import annotations

DATA = "data"
EXPERT = "expert"
MODEL = "model"
AXES = (DATA, EXPERT, MODEL)


def mesh_shape(mesh) -> tuple[int, int]:
    """(tp, dp) of a mesh with the axes AXES (engine.mesh.make_mesh)."""
    return mesh.shape[MODEL], mesh.shape[DATA]


def expert_size(mesh) -> int:
    """ep of a mesh (1 where it has no `expert` axis)."""
    return dict(mesh.shape).get(EXPERT, 1)
