"""Expert parallelism on fake CPU devices: greedy tokens of the tiny mixtures of experts on
(tp, dp, ep) meshes against one device's, run in a subprocess (tests/sharding/scenarios.py).

    python -m tests.sharding.moe_scenario
"""
from __future__ import annotations

import json

from tests.sharding.scenarios import MARK, greedy, tiny_model, tiny_prompts

# (config, [(tp, dp, ep, dispatch)]): dispatch "auto" is what models.moe.dispatch_mode picks
# for these small steps (all-gather); "all_to_all" forces the other form. Mixtral shares every
# expert-parallel path (tests/models/test_moe.py covers its routing on one device).
CASES = (
    ("tiny-qwen3-moe", [(1, 1, 8, "auto"), (2, 2, 2, "auto"), (2, 1, 4, "all_to_all")]),
)


def mesh_key(tp: int, dp: int, ep: int, dispatch: str) -> str:
    return f"tp{tp}-dp{dp}-ep{ep}-{dispatch}"


def run() -> dict:
    from engine.mesh import make_mesh
    from models import moe
    traced = []  # one entry per trace of the all-to-all form
    all_to_all = moe.all_to_all_moe

    def counting(*args, **kwargs):
        traced.append(1)
        return all_to_all(*args, **kwargs)
    moe.all_to_all_moe = counting
    out = {}
    for name, meshes in CASES:
        cfg, model = tiny_model(name, None)
        prompts = tiny_prompts(cfg)
        runs = {"one_device": greedy(cfg, model, prompts)}
        for tp, dp, ep, dispatch in meshes:
            moe.ALL_TO_ALL_MIN_TOKENS = 0 if dispatch == "all_to_all" else 1024
            mesh = make_mesh(tp, dp, ep=ep)
            _, sharded = tiny_model(name, None, mesh=mesh)
            traced.clear()
            runs[mesh_key(tp, dp, ep, dispatch)] = greedy(cfg, sharded, prompts, mesh)
            runs[mesh_key(tp, dp, ep, dispatch)]["all_to_all_traces"] = len(traced)
        out[name] = runs
    return out


if __name__ == "__main__":
    print(MARK + json.dumps(run()), flush=True)
