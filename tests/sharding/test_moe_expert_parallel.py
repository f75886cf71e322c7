"""Expert parallelism (mesh axis `expert`) combined with tensor and data parallelism gives one
device's greedy tokens for the tiny mixtures of experts, by all-gather and by all-to-all
dispatch (8 fake CPU devices in a subprocess: tests/sharding/moe_scenario.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.sharding.moe_scenario import CASES, mesh_key
from tests.sharding.scenarios import MAX_TOKENS, ROOT, device_env, parse_result

RUNS = [(name, mesh_key(*mesh)) for name, meshes in CASES for mesh in meshes]


@pytest.fixture(scope="module")
def moe_runs():
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.moe_scenario"], cwd=ROOT,
                          env=device_env(8, optimize=False), capture_output=True, text=True,
                          timeout=600)
    return parse_result(proc)


@pytest.mark.parametrize("name,mesh", RUNS, ids=[f"{n}-{m}" for n, m in RUNS])
def test_expert_parallel_greedy_equals_one_device(moe_runs, name, mesh):
    expected, got = moe_runs[name]["one_device"], moe_runs[name][mesh]
    assert got["tokens"] == expected["tokens"]
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    np.testing.assert_allclose(got["logprobs"], expected["logprobs"], atol=1e-5)  # float32
    assert (got["all_to_all_traces"] > 0) == mesh.endswith("all_to_all")  # the form it names


def test_expert_partition_rules():
    from jax.sharding import PartitionSpec as P

    from configs.model import get_preset
    from models.moe import check_expert_mesh
    from models.sharding import partition_spec
    cfg = get_preset("qwen3-30b-a3b")
    path = lambda name, leaf="kernel": ("layers", "0", "mlp", name, leaf)  # noqa: E731
    assert partition_spec(path("gate_proj"), (128, 2048, 768), cfg, 2, 4) == P(
        "expert", None, "model")
    assert partition_spec(path("down_proj"), (128, 768, 2048), cfg, 2, 4) == P(
        "expert", "model", None)
    # per-channel scales of a row-parallel expert kernel stay whole along their one row
    assert partition_spec(path("down_proj", "scales"), (128, 1, 2048), cfg, 2, 4) == P(
        "expert", None, None)
    assert partition_spec(("layers", "0", "mlp", "router", "kernel"), (2048, 128), cfg, 2,
                          4) == P()
    with pytest.raises(ValueError, match="ep=3"):
        check_expert_mesh(cfg.num_experts, {"expert": 3})
