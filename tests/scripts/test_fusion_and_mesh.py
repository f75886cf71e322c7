"""--fuse_projections in the serving scripts, and --tp / --dp in scripts.bench.speculative.

Scripts run as a user runs them (subprocesses); the mesh runs get fake CPU devices through
XLA_FLAGS (tests/sharding/scenarios.device_env).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.scripts.test_scripts import ROOT, TINY_DIR, assert_one_clear_error, run_script
from tests.sharding.scenarios import device_env

FUSED_LINE = "model: q/k/v and gate/up projections fused"


def run_on_devices(devices: int, module: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"scripts.{module}", "--compilation_cache_dir=", *args]
    return subprocess.run(cmd, cwd=ROOT, env=device_env(devices), capture_output=True, text=True,
                          timeout=600)


def generate_json(*flags: str) -> tuple[list[dict], str]:
    result = run_script("generate", f"--model={TINY_DIR}", "--prompt=hello there",
                        "--prompt=the sea", "--json", "--max_tokens=10", "--nowarmup", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.strip().splitlines()], result.stderr


@pytest.fixture(scope="module")
def unfused():
    """generate's JSON outputs and stderr with --fuse_projections=false."""
    return generate_json("--fuse_projections=false")


def test_forced_fusion_gives_the_same_greedy_tokens(unfused):
    plain, plain_err = unfused
    fused, fused_err = generate_json("--fuse_projections=true")
    assert FUSED_LINE not in plain_err
    assert f"\n{FUSED_LINE}" in f"\n{fused_err}" and "draft model:" not in fused_err
    assert [o["token_ids"] for o in fused] == [o["token_ids"] for o in plain]
    assert all(len(o["token_ids"]) == 10 for o in plain)


def test_gemv_layers_give_the_same_greedy_tokens(unfused):
    """generate --gemv_layers (models.llama.transpose_for_gemv) reaches the model: the same
    greedy tokens, one sequence at a time (one-row decode steps: on the CPU ops/gemv.py's
    float32 reference of the fused product)."""
    plain, plain_err = unfused
    gemv, err = generate_json("--fuse_projections=true", "--gemv_layers", "--max_num_seqs=1")
    line = "model: layers transposed for the batch-1 gemv kernel"
    assert line in err and line not in plain_err
    assert [o["token_ids"] for o in gemv] == [o["token_ids"] for o in plain]


def test_gemv_layers_without_fusion_is_one_clear_error():
    result = run_script("generate", f"--model={TINY_DIR}", "--prompt=hi", "--nowarmup",
                        "--gemv_layers", "--fuse_projections=false")
    assert_one_clear_error(result, "(--gemv_layers) needs fused projections on one device")


def test_fused_target_and_draft_give_the_same_greedy_tokens(unfused):
    plain, _ = unfused
    spec, err = generate_json("--fuse_projections", "--speculative=draft",
                              f"--draft_model={TINY_DIR}", "--num_speculative_tokens=3")
    assert f"\n{FUSED_LINE}" in f"\n{err}" and f"draft {FUSED_LINE}" in err
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]


def test_generate_rejects_forced_fusion_on_a_mesh():
    result = run_on_devices(2, "generate", f"--model={TINY_DIR}", "--prompt=hi", "--tp=2",
                            "--fuse_projections=true")
    assert_one_clear_error(result, "--fuse_projections=true", "--tp/--dp")


def test_fusion_decision():
    from models.prepare import fusion_wanted
    mesh = object()  # any mesh
    assert fusion_wanted(None, "gpu", None) is True  # auto: a GPU or the CPU without a mesh
    assert fusion_wanted(None, "cpu", None) is True
    assert fusion_wanted(None, "tpu", None) is False
    assert fusion_wanted(None, "cpu", mesh) is False
    assert fusion_wanted(None, "gpu", mesh) is False
    assert fusion_wanted(False, "gpu", None) is False
    assert fusion_wanted(True, "cpu", None) is True
    assert fusion_wanted(False, "gpu", mesh) is False
    with pytest.raises(ValueError, match="fuse_projections=True .* needs one device"):
        fusion_wanted(True, "gpu", mesh)


def test_a_model_that_cannot_be_fused_is_left_whole():
    """An act-order kernel in the last layer: fuse_projections fails before changing anything."""
    from configs.model import TINY_LLAMA
    from models.llama import fuse_projections
    from models.weights import random_model
    from quant.model import QuantConfig, quantize_model

    def quantized():
        return quantize_model(TINY_LLAMA, random_model(TINY_LLAMA, 0),
                              QuantConfig("int4_rtn", group_size=32), progress=False)

    fused_cfg, fused = fuse_projections(TINY_LLAMA, quantized())  # one format: fuses
    assert fused_cfg.fused_projections and hasattr(fused.layers[0].mlp, "gate_up_proj")
    model = quantized()
    up = model.layers[-1].mlp.up_proj.kernel
    perm = np.arange(TINY_LLAMA.hidden_size, dtype=np.int32)
    up.set_value(dataclasses.replace(up.get_value(), perm=jax.numpy.asarray(perm)))
    with pytest.raises(ValueError, match="act-order"):
        fuse_projections(TINY_LLAMA, model)
    assert all(hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj")
               and not hasattr(layer.mlp, "gate_up_proj") for layer in model.layers)


def test_bench_speculative_runs_on_a_mesh(tmp_path):
    out = tmp_path / "spec.json"
    result = run_on_devices(4, "bench.speculative", f"--model={TINY_DIR}", "--tp=2", "--dp=2",
                            "--methods=none,ngram", "--max_tokens=8", "--repeats=1",
                            f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mesh: tp=2 x dp=2 over 4 cpu device(s)" in result.stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "expert": 1, "model": 2}
    assert not report["fused_projections"]
    assert report["methods"]["ngram"]["same_tokens_as_first_method"]
    assert report["methods"]["ngram"]["drafts"] > 0


def test_bench_verify_step_costs_on_a_mesh(tmp_path):
    out = tmp_path / "verify.json"
    result = run_on_devices(4, "bench.speculative", "--model=tiny-llama", "--tp=2", "--dp=2",
                            "--modes=costs", "--batches=3", "--max_k=2", "--context=8",
                            "--calls=1", "--runs=1", "--alphas=0.5", f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mesh: tp=2 x dp=2 over 4 cpu device(s)" in result.stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "expert": 1, "model": 2}
    row = report["step_costs"][0]
    assert row["batch"] == 3 and row["decode_step_s"] > 0
    assert [v["k"] for v in row["verify"]] == [1, 2] and all(v["step_s"] > 0 for v in row["verify"])


def test_freeze_startup_objects_spares_later_garbage():
    """After start-up objects are frozen out of the collector's scans, new cyclic garbage is
    still collected (the frozen generation is restored afterwards for the other tests)."""
    import gc
    import weakref

    from scripts.common import freeze_startup_objects

    class Node:
        pass

    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > before
        node = Node()
        node.self = node  # a cycle: only the cyclic collector frees it
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
