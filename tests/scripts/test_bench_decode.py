"""scripts/bench_decode.py and its parts on the CPU with tiny configs (no timing is asserted)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import get_preset
from models.kv_cache import kv_bytes_per_token
from scripts import decode_profile
from scripts import decode_steps as ds


def greedy_tokens(name: str, fused: bool, quant: str = "none", steps: int = 6) -> np.ndarray:
    """Greedy tokens of 3 sequences at context 40 over a random cache, via the bench's loop."""
    cfg, model = ds.build_model(get_preset(name), jnp.float32, seed=5, quant=quant, fused=fused)
    runner = ds.make_runner(cfg, model, max_batch=3, max_context=48, page_size=8)
    ds.fill_cache_random(runner, seed=6)
    tables = ds.page_tables(3, 6, seed=7)
    first = np.random.default_rng(8).integers(0, cfg.vocab_size, 3)
    tokens, _ = ds.greedy_loop(runner, first, 40 - steps - 1, tables, steps)
    return tokens


def test_greedy_margins_are_the_lead_of_the_top_logprob():
    """greedy_loop's margins (top-1 minus top-2 log-probability of each step's choice) against
    the same loop replayed on a fresh runner through its logits and a numpy log-softmax."""
    cfg, model = ds.build_model(get_preset("tiny-llama31"), jnp.float32, seed=3)
    tables = ds.page_tables(3, 6, seed=5)
    first = np.random.default_rng(6).integers(0, cfg.vocab_size, 3)

    def runner():
        r = ds.make_runner(cfg, model, max_batch=3, max_context=48, page_size=8)
        ds.fill_cache_random(r, seed=4)
        return r

    tokens, _, gaps = ds.greedy_loop(runner(), first, 30, tables, 3, margins=True)
    replay, want_tokens, want_gaps = runner(), [], []
    step_tokens = first
    for i in range(4):
        batch = ds.decode_batch(step_tokens, np.full(3, 30 + i), tables, 8)
        logits = np.asarray(replay.execute(batch), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        top2 = np.sort(logp, axis=-1)[:, -2:]
        step_tokens = logits.argmax(-1)
        if i:  # the loop's first step is untimed and not returned
            want_tokens.append(step_tokens)
            want_gaps.append(top2[:, 1] - top2[:, 0])
    np.testing.assert_array_equal(tokens, np.stack(want_tokens, 1))
    np.testing.assert_allclose(gaps, np.stack(want_gaps, 1), rtol=1e-4, atol=1e-5)
    assert (gaps > 0).all()


@pytest.mark.parametrize("name,quant", [("tiny-llama31", "none"), ("tiny-qwen2", "none"),
                                        ("tiny-llama31", "int8"), ("tiny-llama31", "int4")])
def test_fused_projections_give_the_same_greedy_tokens(name, quant):
    plain = greedy_tokens(name, fused=False, quant=quant)
    fused = greedy_tokens(name, fused=True, quant=quant)
    assert plain.shape == (3, 6)
    np.testing.assert_array_equal(plain, fused)


def test_fused_model_has_fused_kernels_of_the_concatenated_columns():
    cfg = get_preset("tiny-qwen2")
    _, plain = ds.build_model(cfg, jnp.float32, seed=1)
    fused_cfg, fused = ds.build_model(cfg, jnp.float32, seed=1, fused=True)
    assert fused_cfg.fused_projections and not cfg.fused_projections
    a, f = plain.layers[1].self_attn, fused.layers[1].self_attn
    assert not hasattr(f, "q_proj")
    want = np.concatenate([np.asarray(m.kernel.get_value()) for m in (a.q_proj, a.k_proj,
                                                                      a.v_proj)], axis=1)
    np.testing.assert_array_equal(np.asarray(f.qkv_proj.kernel.get_value()), want)
    want_bias = np.concatenate([np.asarray(m.bias.get_value()) for m in (a.q_proj, a.k_proj,
                                                                         a.v_proj)])
    np.testing.assert_array_equal(np.asarray(f.qkv_proj.bias.get_value()), want_bias)
    assert fused.layers[0].mlp.gate_up_proj.kernel.get_value().shape == (
        cfg.hidden_size, 2 * cfg.intermediate_size)
    # the same parameter count as the unfused model
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m)))  # noqa: E731
    assert count(fused) == count(plain) == cfg.num_params()


def test_random_weights_are_seeded_normal_and_norms_are_one():
    cfg = get_preset("tiny-llama31")
    a = ds.random_weights(cfg, 3, jnp.float32)
    b = ds.random_weights(cfg, 3, jnp.float32)
    c = ds.random_weights(cfg, 4, jnp.float32)
    ka = np.asarray(a.layers[0].mlp.up_proj.kernel.get_value())
    np.testing.assert_array_equal(ka, np.asarray(b.layers[0].mlp.up_proj.kernel.get_value()))
    assert not np.array_equal(ka, np.asarray(c.layers[0].mlp.up_proj.kernel.get_value()))
    assert not np.array_equal(ka, np.asarray(a.layers[1].mlp.up_proj.kernel.get_value()))
    assert 0.015 < ka.std() < 0.025
    np.testing.assert_array_equal(np.asarray(a.layers[1].input_layernorm.weight[...]), 1.0)
    np.testing.assert_array_equal(np.asarray(a.norm.weight[...]), 1.0)


@pytest.mark.parametrize("name", ["tiny-llama31", "tiny-llama"])  # untied, tied output head
def test_bytes_per_step_count_the_weights_read_and_the_kv(name):
    cfg = get_preset(name)
    _, model = ds.build_model(cfg, jnp.bfloat16, seed=0)
    h, v = cfg.hidden_size, cfg.vocab_size
    total = 2 * cfg.num_params()  # bf16
    read = total if cfg.tie_word_embeddings else total - 2 * v * h + 2 * 4 * h
    assert ds.weight_bytes_per_step(cfg, model, batch=4) == read
    kv = ds.kv_bytes_per_step(cfg, jnp.bfloat16, batch=3, context=100)
    assert kv == 3 * 100 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert kv == 300 * kv_bytes_per_token(cfg, jnp.bfloat16)


def test_random_pages_fill_every_page_in_chunks(monkeypatch):
    """_random_pages draws in chunks of pages (the last one overlapping): every page of a zero
    buffer ends up holding normal(0, 1) values, and no two chunks repeat each other."""
    monkeypatch.setattr(ds, "FILL_CHUNK_ELEMENTS", 3 * 4 * 2 * 8)  # 3 pages per chunk
    pages = jnp.zeros((10, 4, 2, 8), jnp.float32)  # [pages, page_size, kv heads, head_dim]
    out = np.asarray(ds._random_pages(pages, jax.random.key(int(np.random.randint(1 << 30)))))
    assert out.shape == pages.shape and out.dtype == np.float32
    flat = out.reshape(10, -1)
    assert np.all(np.abs(flat).max(axis=1) > 0)  # no page left as it was
    assert len({row.tobytes() for row in flat}) == 10
    assert abs(flat.mean()) < 0.15 and 0.85 < flat.std() < 1.15  # 640 draws of normal(0, 1)


def test_prefill_flops_match_the_parameter_count():
    cfg = get_preset("tiny-llama31")
    h, t = cfg.hidden_size, 64
    matmul_params = cfg.num_params() - 2 * cfg.vocab_size * h - (2 * cfg.num_layers + 1) * h
    pairs = t * (t + 1) // 2
    want = (2 * matmul_params * t + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
            + 2 * h * cfg.vocab_size)
    assert ds.prefill_flops(cfg, t) == pytest.approx(want)


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
    s = decode_profile.summarize_trace({"traceEvents": events}, steps=2)
    assert s["kernels_per_step"] == 2
    assert s["busy_s_per_step"] == pytest.approx(25e-6 / 2)  # [0, 15) and [30, 40)
    assert s["kernel_sum_s_per_step"] == pytest.approx(32e-6 / 2)
    assert s["span_s_per_step"] == pytest.approx(40e-6 / 2)
    kinds = {r["name"]: r["s_per_step"] for r in s["by_kind"]}
    assert kinds["matmul"] == pytest.approx(10e-6) and kinds["attention"] == pytest.approx(5e-6)
    assert s["by_name"][0]["name"] == "sm90_xmma_gemm_bf16"
    assert s["host_by_name"] == [{"name": "host work", "s_per_step": pytest.approx(99e-6 / 2),
                                  "calls_per_step": 0.5, "mean_us": 99}]
    assert "error" in decode_profile.summarize_trace({"traceEvents": meta[1:2]}, steps=1)
    text = decode_profile.format_summary(s)
    assert "busy" in text and "host work" in text


def test_multi_step_rounds_without_the_unrolled_form(tmp_path):
    """--nomulti_step_unrolled times (and checks) the device-loop rounds only."""
    out = tmp_path / "decode.json"
    args = ["--model=tiny-llama31", "--batch=2", "--context=16", "--prefill=", "--variants=base",
            "--dtype=float32", "--steps=2", "--runs=1", "--loop_steps=0", "--greedy_steps=2",
            "--greedy_batch=2", "--greedy_context=24", "--page_size=8", "--nocalibrate",
            "--nohf", "--multi_step=2", "--nomulti_step_unrolled", f"--json_out={out}"]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_decode", *args],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    (row,) = res["decode"]
    assert row["multi_step_s"] > 0 and row["multi_steps"] == 2
    assert "multi_step_unrolled_s" not in row and "unrolled" not in proc.stdout
    assert set(res["greedy_check"]["tiny-llama31"]["results"]) == {"base+multi_step"}
    assert res["greedy_check"]["tiny-llama31"]["results"]["base+multi_step"]["equal"] is True


def test_bench_decode_runs_end_to_end(tmp_path):
    out = tmp_path / "decode.json"
    args = ["--model=tiny-llama31", "--batch=3", "--context=24", "--prefill=16",
            "--variants=base,fused", "--dtype=float32", "--steps=2", "--runs=1",
            "--loop_steps=2", "--greedy_steps=3", "--greedy_batch=2", "--greedy_context=32",
            "--page_size=8", "--nocalibrate", "--nohf", f"--json_out={out}", "--multi_step=3",
            "--matmul_precision=highest",
            "--profile=tiny-llama31:3:24", "--profile_steps=1",
            f"--profile_dir={tmp_path / 'prof'}"]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_decode", *args],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["decode"]
    assert res["matmul_precision"] == "highest"
    assert [(r["variant"], r["batch"], r["context"]) for r in rows] == [
        (v, 3, 24) for v in ("base", "fused")]
    for r in rows:
        assert "error" not in r, r
        assert r["compiles_during_timing"] == 0
        assert r["tokens_per_s"] > 0 and r["loop_step_s"] > 0 and 0 < r["mbu"]
        assert 0 < r["dispatch_s"] < r["loop_step_s"] * 10  # one call's return, not a queue
        assert r["kv_bytes"] == r["batch"] * r["context"] * kv_bytes_per_token(
            get_preset("tiny-llama31"), jnp.float32)
    assert {r["prompt_tokens"] for r in res["prefill"]} == {16}
    assert res["greedy_check"]["tiny-llama31"]["results"]["fused"]["equal"] is True
    for variant in ("base", "fused"):  # rounds of 3 steps, looped or unrolled: same tokens
        for kind in ("+multi_step", "+multi_step_unrolled"):
            assert res["greedy_check"]["tiny-llama31"]["results"][variant + kind]["equal"] is True
    assert all(r["multi_step_s"] > 0 and r["multi_step_unrolled_s"] > 0
               and r["multi_step_dispatch_s"] > 0 and r["multi_steps"] == 3 for r in rows)
    greedy = res["greedy"][0]
    assert np.asarray(greedy["margins"]).shape == np.asarray(greedy["tokens"]).shape == (2, 3)
    assert len(res["profiles"]) == 2  # traced (no device events on the CPU: an error entry)
    assert all("traced_wall_s_per_step" in p for p in res["profiles"])
    assert "| tiny-llama31 | fused | 3 | 24 |" in proc.stdout
    if importlib.util.find_spec("matplotlib") is None:
        return
    png = tmp_path / "decode.png"
    subprocess.run([sys.executable, "-m", "scripts.bench_decode", f"--plot_from={out}",
                    f"--plot_out={png}"], check=True, timeout=120)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_decode_rejects_an_unknown_variant():
    from tests.scripts.test_scripts import assert_one_clear_error, run_script
    assert_one_clear_error(run_script("bench_decode", "--variants=base,fused,bogus",
                                      "--hf=false"), "--variants", "bogus")


def test_quantized_head_bytes_per_step():
    """--quant_lm_head: the untied head is INT8 codes plus per-channel scales, and the bytes a
    step reads count it so (the head's bf16 bytes become one byte per weight and a scale row)."""
    cfg = get_preset("tiny-llama31")
    _, plain = ds.build_model(cfg, jnp.bfloat16, seed=0, quant="int8")
    _, quant = ds.build_model(cfg, jnp.bfloat16, seed=0, quant="int8", quant_lm_head=True)
    assert type(quant.lm_head.kernel.get_value()).__name__ == "QuantizedWeight"
    h, v = cfg.hidden_size, cfg.vocab_size
    saved = ds.weight_bytes_per_step(cfg, plain, 1) - ds.weight_bytes_per_step(cfg, quant, 1)
    assert saved == 2 * h * v - (h * v + 2 * v)


def test_bench_decode_gemv_and_folded_variants(tmp_path):
    """The `gemv` variant (transposed layers, one-row steps through ops/gemv.py's fused
    product) and `folded` (--fold_norm_scale): the same greedy tokens as `fused` at one row,
    and the same bytes per step."""
    out = tmp_path / "gemv.json"
    args = ["--model=tiny-llama31", "--batch=1", "--context=24", "--prefill=",
            "--variants=fused,gemv,folded", "--dtype=float32", "--steps=2", "--runs=1",
            "--loop_steps=0", "--greedy_steps=4", "--greedy_batch=1", "--greedy_context=32",
            "--page_size=8", "--nocalibrate", "--nohf", f"--json_out={out}",
            "--matmul_precision=highest"]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_decode", *args],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    fused, gemv, folded = res["decode"]
    assert [r["variant"] for r in res["decode"]] == ["fused", "gemv", "folded"]
    for row in (gemv, folded):
        assert row["weight_bytes"] == fused["weight_bytes"] > 0 and row["tokens_per_s"] > 0
    for variant in ("gemv", "folded"):
        assert res["greedy_check"]["tiny-llama31"]["results"][variant]["equal"] is True
