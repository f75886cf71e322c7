"""scripts/bench/decode.py on the CPU with a tiny model: its rows, greedy check and table, and
the parts it counts with (bytes and FLOPs per step, the profile's trace summary)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import PRESETS, get_preset
from models.hf_loader import config_from_hf
from models.kv_cache import kv_bytes_per_token
from scripts.bench import common
from scripts.bench import decode_model as dm
from scripts.bench import profile
from scripts.bench.hf_configs import hf_model_type
from tests.conftest import GOLDEN_DIR

# a bare environment (no PALLASITE_* switch of the caller's), with the run's XLA flags
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
TINY = ["--model=tiny-llama31", "--dtype=float32", "--steps=2", "--runs=1", "--page_size=8",
        "--nocalibrate", "--nohf", "--matmul_precision=highest"]


def test_the_mesh_variant_times_rounds_and_gives_base_tokens(tmp_path):
    """--variants=mesh (a one-device mesh here) times multi-step rounds as the one-device
    variants do, and its greedy tokens, single steps and rounds, equal the base variant's."""
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.decode", *TINY, "--batch=3", "--context=24",
         "--prefill=", "--variants=base,mesh", "--loop_steps=0", "--greedy_steps=3",
         "--greedy_batch=2", "--greedy_context=32", "--multi_step=3", f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, env=ENV | {"PALLASITE_LAYER_LOOP": "unrolled"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    mesh = [r for r in res["decode"] if r["variant"] == "mesh"]
    assert len(mesh) == 1 and mesh[0]["multi_step_s"] > 0 and mesh[0]["multi_steps"] == 3
    assert mesh[0]["compiles_during_timing"] == 0
    check = res["greedy_check"]["tiny-llama31"]["results"]
    assert set(check) == {"base+multi_step", "mesh", "mesh+multi_step"}
    assert all(v["equal"] for v in check.values()), check


def test_decode_rows_variants_multi_step_and_profile(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.decode", *TINY, "--batch=1,3", "--context=24",
         "--prefill=16", "--variants=base,gemv", "--loop_steps=2", "--greedy_steps=3",
         "--greedy_batch=2", "--greedy_context=32", "--multi_step=3",
         "--profile=tiny-llama31:3:24,tiny-llama31:prefill:16", "--profile_steps=1",
         f"--profile_dir={tmp_path / 'p'}",
         f"--json_out={out}"], capture_output=True, text=True, timeout=600,
        # the gemv variant's layers run unrolled (models.layer_scan.scannable): the base one
        # too, so that their greedy tokens compare bit for bit (the tiny model has near ties)
        env=ENV | {"PALLASITE_LAYER_LOOP": "unrolled"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["kernels"].startswith("kernels on cpu: attention reference")
    rows = res["decode"]
    assert [(r["variant"], r["batch"]) for r in rows] == [
        (v, b) for v in ("base", "gemv") for b in (1, 3)]
    cfg = get_preset("tiny-llama31")
    for r in rows:
        assert "error" not in r, r
        assert r["compiles_during_timing"] == 0 and r["tokens_per_s"] > 0
        assert r["kv_bytes"] == r["batch"] * 24 * kv_bytes_per_token(cfg, jnp.float32)
        # the floor is the bytes over the copy rate given (--copy_tbs), MBU floor over step
        floor = (r["weight_bytes"] + r["kv_bytes"]) / 4.1e12
        assert r["floor_s"] == pytest.approx(floor) and r["mbu"] == pytest.approx(
            floor / r["step_s"])
        assert r["multi_step_s"] > 0 and r["multi_steps"] == 3 and r["loop_step_s"] > 0
    # the cache holds the largest row's pages (3 sequences of 24 + 3 tokens: 12 pages of 8)
    # and the padding page, not max(batch) x max(tokens) (3 x 35 tokens: 15 pages)
    assert {s["cache_bytes"] for s in res["setup"]} == {
        13 * 8 * kv_bytes_per_token(cfg, jnp.float32)}
    by = {(r["variant"], r["batch"]): r for r in rows}
    assert by["gemv", 3]["weight_bytes"] == by["base", 3]["weight_bytes"]  # the same weights
    assert [r["prompt_tokens"] for r in res["prefill"]] == [16] * 2
    assert all(r["mfu"] > 0 for r in res["prefill"])
    check = res["greedy_check"]["tiny-llama31"]
    assert check["against"] == "base"
    assert set(check["results"]) == {"gemv", "base+multi_step", "gemv+multi_step"}
    assert all(v["equal"] for v in check["results"].values()), check
    profiled = [r for r in rows if r["batch"] == 3]
    assert all("profile" in r for r in profiled)  # the CPU trace has no device events
    assert all("profile" in r for r in res["prefill"])
    assert not any("profile" in r for r in rows if r["batch"] == 1)
    assert "| tiny-llama31 | gemv | 3 | 24 |" in proc.stdout
    assert "| model | variant | B | context | step ms |" in proc.stdout


def test_an_unknown_variant_is_one_clear_error():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.decode", *TINY,
                           "--variants=base,folded"], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 1 and "--variants: unknown folded" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["tiny-llama31", "tiny-llama"])  # untied, tied output head
def test_bytes_per_step_count_the_weights_read_and_the_kv(name):
    cfg = get_preset(name)
    _, model = dm.build_model(cfg, jnp.bfloat16, seed=0)
    h, v = cfg.hidden_size, cfg.vocab_size
    total = 2 * cfg.num_params()  # bf16
    read = total if cfg.tie_word_embeddings else total - 2 * v * h + 2 * 4 * h
    assert dm.weight_bytes_per_step(cfg, model, batch=4) == read
    kv = dm.kv_bytes_per_step(cfg, jnp.bfloat16, batch=3, context=100)
    assert kv == 3 * 100 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def test_prefill_flops_match_the_parameter_count():
    cfg = get_preset("tiny-llama31")
    h, t = cfg.hidden_size, 64
    matmul_params = cfg.num_params() - 2 * cfg.vocab_size * h - (2 * cfg.num_layers + 1) * h
    want = (2 * matmul_params * t + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
            * t * (t + 1) // 2 + 2 * h * cfg.vocab_size)
    assert dm.prefill_flops(cfg, t) == pytest.approx(want)


def test_summarize_trace_counts_stream_kernels_once():
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [("sm90_xmma_gemm_bf16", 7, 0, 10), ("loop_add_fusion", 7, 12, 2),
               ("ragged_attention_kernel", 8, 5, 10), ("sm90_xmma_gemm_bf16", 7, 30, 10)]
    events = meta + [{"ph": "X", "pid": 1, "tid": tid, "name": n, "ts": ts, "dur": d}
                     for n, tid, ts, d in kernels]
    events += [{"ph": "X", "pid": 1, "tid": 9, "name": "dot.1", "ts": 0, "dur": 40},
               {"ph": "X", "pid": 2, "tid": 1, "name": "host work", "ts": 0, "dur": 99}]
    s = profile.summarize_trace({"traceEvents": events}, steps=2)
    assert s["kernels_per_step"] == 2
    assert s["busy_s_per_step"] == pytest.approx(25e-6 / 2)  # [0, 15) and [30, 40)
    assert s["kernel_sum_s_per_step"] == pytest.approx(32e-6 / 2)
    assert s["span_s_per_step"] == pytest.approx(40e-6 / 2)
    kinds = {r["name"]: r["s_per_step"] for r in s["by_kind"]}
    assert kinds["matmul"] == pytest.approx(10e-6) and kinds["attention"] == pytest.approx(5e-6)
    assert s["host_by_name"] == [{"name": "host work", "s_per_step": pytest.approx(99e-6 / 2),
                                  "calls_per_step": 0.5, "mean_us": 99}]
    assert "error" in profile.summarize_trace({"traceEvents": meta[1:2]}, steps=1)
    assert "host work" in profile.format_summary(s)


def test_weights_larger_than_the_device_are_one_clear_error(monkeypatch):
    # a device with 16 KiB free: tiny-llama31's float32 weights do not fit
    monkeypatch.setattr(dm, "device_memory", lambda: (3 << 20, (3 << 20) - (16 << 10)))
    with pytest.raises(ValueError, match=r"tiny-llama31 in float32: the weights take .* MiB per "
                                         r"device, more than the 0.0 MiB free of 3.0 MiB"):
        dm.random_weights(get_preset("tiny-llama31"), 0, jnp.float32)


def test_a_cache_larger_than_the_device_is_one_clear_error(monkeypatch):
    # tiny-llama31 (2 layers, 2 KV heads of 8 dims): 256 bytes a float32 token, 64 KiB for
    # 256 tokens against 48 KiB free; an int8 cache (96 bytes a token with its scales) fits
    cfg = get_preset("tiny-llama31")
    monkeypatch.setattr(dm, "device_memory", lambda: (1 << 20, (1 << 20) - (48 << 10)))
    with pytest.raises(ValueError, match=r"tiny-llama31: a KV cache of 256 tokens in float32 "
                                         r"takes 0.1 MiB per device, more than the 0.0 MiB free"):
        dm.check_cache_fits(cfg, jnp.float32, 256)
    dm.check_cache_fits(cfg, jnp.int8, 256)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_random_weights_are_made_as_codes_with_the_float_spread(quant):
    """--quant on one device makes the decoder linears as random codes (never float weights
    first), dequantizing to about the float weights' spread (std 0.02, mean 0), experts too;
    the model then runs a step with finite logits."""
    from flax import nnx
    from quant.calibration import linear_modules
    from quant.qtensor import QuantizedWeight, dequantize
    cfg, model = dm.build_model(get_preset("tiny-qwen3-moe"), jnp.float32, 3, quant)
    weights = [w for w in jax.tree.leaves(nnx.state(model), is_leaf=lambda a: isinstance(
        a, QuantizedWeight)) if isinstance(w, QuantizedWeight)]
    assert len(weights) == sum(len(linear_modules(layer)) for layer in model.layers)
    assert any(w.packed.ndim == 3 for w in weights)  # the stacked experts
    for w in weights:
        values = np.asarray(jax.vmap(dequantize)(w) if w.packed.ndim == 3 else dequantize(w))
        assert abs(values.std() - 0.02) < 0.002 and abs(values.mean()) < 0.002
    runner = dm.make_runner(cfg, model, max_batch=2, max_context=32, page_size=8)
    dm.fill_cache_random(runner, 4)
    batch = dm.decode_batch(np.array([5, 9]), [20, 24], dm.page_tables(2, 4, 1), 8)
    logits = np.asarray(runner.execute(batch))
    assert logits.shape == (2, cfg.vocab_size) and np.isfinite(logits).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_cache_is_filled_with_random_codes_and_scales(kv_dtype):
    """fill_cache_random draws an int8 / fp8 cache's codes and its scales (positive, not the
    zeros it starts with), so the timed steps attend over data; every leaf then lies as the
    step's outputs do, and the timed steps reuse the warm-up's program."""
    cfg, model = dm.build_model(get_preset("tiny-llama31"), jnp.float32, 3)
    runner = dm.make_runner(cfg, model, max_batch=2, max_context=32, page_size=8,
                            kv_dtype=kv_dtype)
    dm.fill_cache_random(runner, 4)
    cache = runner.cache
    for scales in cache.k_scales + cache.v_scales:
        scales = np.asarray(scales)
        assert (scales >= 0.01).all() and scales.std() > 0.005
    codes = np.asarray(cache.k_pages[0].astype(jnp.float32))
    assert codes.std() > 0.5
    batch = dm.decode_batch(np.array([5, 9]), [20, 24], dm.page_tables(2, 4, 1), 8)
    timing = dm.time_queued(runner, batch, steps=2, runs=1)
    assert timing["compiles_during_timing"] == 0
    # the first call compiled the step: seconds, where a step and a warm first call take ms
    again = dm.time_queued(runner, batch, steps=2, runs=1)
    assert timing["first_call_s"] > 10 * max(again["first_call_s"], timing["step_s"])
    assert np.isfinite(np.asarray(runner.execute(batch))).all()
    assert all(leaf.committed for leaf in jax.tree.leaves(runner.cache))


def test_cpu_floors_divide_by_the_fastest_plain_read_measured():
    # on the CPU calibrate also times a matrix-vector product's read, which XLA runs near the
    # memory's rate where its elementwise copy does not; a floor takes the faster of the two,
    # and a TPU's published bandwidth over either
    calib = common.calibrate(copy_bytes=16 << 20, matmul=64, runs=1, queue=2)
    assert calib["gemv_read_TBps"] > 0 and calib["copy_TBps"] > 0
    assert common.floor_TBps(calib) == max(calib["copy_TBps"], calib["gemv_read_TBps"])
    assert common.floor_TBps({"copy_TBps": 2.0, "gemv_read_TBps": 1.0}) == 2.0
    assert common.floor_TBps({"copy_TBps": 2.0, "published_TBps": 0.8}) == 0.8


def test_a_runs_json_names_the_settings_it_ran_under(monkeypatch):
    # a figure taken under XLA_FLAGS or a kernel override must say so in its JSON
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
    monkeypatch.setenv("PALLASITE_MOE", "reference")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    settings = common.run_info()["environment"]
    assert settings["XLA_FLAGS"] == "--xla_gpu_autotune_level=2"
    assert settings["PALLASITE_MOE"] == "reference"
    assert "UNRELATED_SETTING" not in settings


@pytest.mark.parametrize("tiny", sorted(p.name for p in Path(GOLDEN_DIR).glob("tiny-*")))
def test_the_hf_peer_runs_each_family_as_transformers_writes_it(tiny):
    # the peer's transformers family, from the config fields alone, is the model_type of the
    # directory transformers wrote for the tiny golden (Phi-3 computes Mistral's math, or
    # Llama's without a sliding window; RoPE aside)
    raw = json.loads((Path(GOLDEN_DIR) / tiny / "config.json").read_text())
    want = raw["model_type"]
    if want == "phi3":
        want = "mistral" if raw.get("sliding_window") else "llama"
    assert hf_model_type(config_from_hf(raw, tiny)) == want


def test_the_hf_peer_knows_every_preset_family():
    kinds = {name: hf_model_type(cfg) for name, cfg in PRESETS.items() if "tiny" not in name}
    assert kinds == {
        "smollm2-135m": "llama", "llama3.2-1b": "llama", "llama3.1-8b": "llama",
        "qwen2.5-0.5b": "qwen2", "qwen3-8b": "qwen3", "mistral-7b": "mistral",
        "gemma-2-9b": "gemma2", "gemma-3-12b": "gemma3_text", "phi-3-mini": "mistral",
        "mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3_moe"}
