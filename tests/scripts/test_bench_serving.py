"""scripts/bench/serving.py on the CPU with a tiny model: the engine against its peers (static
batching and a --compare configuration), the host phases, the stub device, and bad --compare
entries (figures are checked for shape and consistency, never for speed)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model import get_preset
from models.weights import abstract_model

WORKLOAD = ["--model=tiny-llama", "--random_weights", "--num_requests=8", "--max_num_seqs=4",
            "--max_num_batched_tokens=64", "--max_model_len=128", "--max_input_len=32",
            "--max_output_len=12", "--input_len=12", "--output_len=6"]
# a bare environment (no PALLASITE_* switch of the caller's), with the run's XLA flags
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


def run_bench(tmp_path, *flags):
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *WORKLOAD, *flags,
                           f"--json_out={out}"], capture_output=True, text=True, timeout=600,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())


def test_engine_against_static_batching_and_a_compared_configuration(tmp_path):
    """The default warm-up (a dry run on the stub device, then its programs compiled, with the
    penalized rows' samplers) compiles every program each configuration's timed run reaches:
    none compiles while timed."""
    stdout, result = run_bench(tmp_path, "--async_scheduling=true", "--host_phases",
                               "--compare=num_decode_steps=4;kv_cache_dtype=int8",
                               "--penalized_fraction=0.25")
    run = result["continuous"]
    assert result["mode"] == "engine" and result["num_requests"] == 8
    assert result["penalized_fraction"] == 0.25
    assert run["output_tokens_per_s"] > 0 and run["programs_compiled_during_run"] == 0
    assert result["programs_compiled_at_start"] > 0
    assert 0 < run["host_share_all_steps"] <= 1
    phases = run["host_phase_ms_per_step"]
    assert phases["dispatch step"] > 0 and phases["schedule"] > 0
    host = sum(ms for name, ms in phases.items() if name != "wait for tokens")
    assert phases["other host"] >= -0.01 * host  # the timed phases do not overlap
    assert 0 < run["engine_python_share_at_max_running"] <= 1
    static = result["static"]
    assert static["output_tokens_per_s"] > 0 and static["batch_size"] == 4
    assert result["continuous_over_static"] == (run["output_tokens_per_s"]
                                                / static["output_tokens_per_s"])
    compared = result["compare"]["num_decode_steps=4"]
    assert compared["engine"]["num_decode_steps"] == 4 and compared["output_tokens_per_s"] > 0
    assert compared["programs_compiled_during_run"] == 0
    int8 = result["compare"]["kv_cache_dtype=int8"]  # a text field, passed as text
    assert int8["engine"]["kv_cache_dtype"] == "int8" and int8["output_tokens_per_s"] > 0
    assert "| output tokens/s |" in stdout and "continuous / static throughput" in stdout
    assert "| num_decode_steps=4 |" in stdout and "| engine flags |" in stdout


def test_random_int4_codes_serve(tmp_path):
    """--quant=int4: the preset's decoder linears as random INT4 codes, served as usual."""
    stdout, result = run_bench(tmp_path, "--quant=int4", "--nostatic_baseline")
    assert result["quant"] == "int4" and result["continuous"]["output_tokens_per_s"] > 0
    assert result["continuous"]["programs_compiled_during_run"] == 0


def test_a_run_cut_short_keeps_the_phases_it_measured(tmp_path):
    """--json_out is written after each phase: a run that stops in the static baseline (here
    made to fail) keeps the continuous figures."""
    out = tmp_path / "serving.json"
    cut = ("import sys; from absl import app; import scripts.bench.serving as s\n"
           "def cut(*args): raise RuntimeError('stopped in the static baseline')\n"
           "s.run_static = cut; app.run(s.main, argv=sys.argv)")
    proc = subprocess.run([sys.executable, "-c", cut, *WORKLOAD, f"--json_out={out}"],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode != 0 and "stopped in the static baseline" in proc.stderr
    result = json.loads(out.read_text())
    assert result["continuous"]["output_tokens_per_s"] > 0 and "static" not in result
    assert "continuous: " in proc.stdout and "output tokens/s" in proc.stdout


def test_quant_without_random_weights_is_one_clear_error():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", "--model=smollm2-135m",
                           "--quant=int8", "--num_requests=1"], capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode != 0 and "--quant makes random codes" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_stub_device_times_the_host_alone(tmp_path):
    stdout, result = run_bench(tmp_path, "--stub_device", "--num_decode_steps=4",
                               "--host_profile=" + str(tmp_path / "profile.txt"))
    run = result["continuous"]
    assert result["mode"] == "stub_device" and "static" not in result
    assert run["host_s_per_step_all"] > 0 and run["num_decode_steps"] == 4
    assert run["multi_step_rounds_at_max_running"] > 0  # decodes ran as rounds
    owns = [own for _, _, own, _ in run["host_profile_top"]]
    assert owns and owns == sorted(owns, reverse=True)
    assert "(schedule)" in (tmp_path / "profile.txt").read_text()
    assert "| host share of step |" in stdout


def test_a_bad_compare_entry_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *WORKLOAD,
                           "--compare=max_num_seqs=4;no_such_field=3"],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 1 and "--compare: 'no_such_field=3'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_penalized_requests_are_spread_evenly():
    from scripts.bench.workload import WorkloadSpec, make_workload
    spec = WorkloadSpec(12, float("inf"), 8, 4, 0.5, 16, 8, penalized_fraction=0.25)
    assert make_workload(spec, 0, 100).penalized == [False, False, False, True] * 3
    for fraction, count in ((0.0, 0), (1.0, 12), (0.5, 6)):
        spec = WorkloadSpec(12, float("inf"), 8, 4, 0.5, 16, 8, penalized_fraction=fraction)
        assert sum(make_workload(spec, 0, 100).penalized) == count
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *WORKLOAD,
                           "--penalized_fraction=1.5"], capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 1 and "penalized_fraction must be in [0, 1]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_sampled_workload_seeds_each_request_and_compiles_nothing_while_timed(tmp_path):
    """--temperature: every request samples at it, seeded by its index (penalized ones also
    send the penalties); the warm-up compiles the samplers and the sampled (and penalized)
    rounds the run reaches. A temperature outside [0, 2] is one clear error."""
    from scripts.bench.workload import PENALTIES, WorkloadSpec, make_workload
    spec = WorkloadSpec(4, float("inf"), 8, 4, 0.5, 16, 8, penalized_fraction=0.5,
                        temperature=0.7)
    work = make_workload(spec, 0, 100)
    assert [work.sampling(i) for i in range(4)] == [
        {"temperature": 0.7, "seed": i} | (PENALTIES if i % 2 else {}) for i in range(4)]
    greedy = make_workload(WorkloadSpec(4, float("inf"), 8, 4, 0.5, 16, 8), 0, 100)
    assert greedy.sampling(3) == {"temperature": 0.0}
    _, result = run_bench(tmp_path, "--temperature=0.8", "--penalized_fraction=0.5",
                          "--num_decode_steps=4", "--async_scheduling=true",
                          "--nostatic_baseline")
    assert result["temperature"] == 0.8
    run = result["continuous"]
    assert run["output_tokens_per_s"] > 0 and run["programs_compiled_during_run"] == 0
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *WORKLOAD,
                           "--temperature=3"], capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 1 and "temperature must be in [0, 2], got 3.0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_median_length_past_its_longest_is_one_clear_error():
    """--input_len past --max_input_len would cut every prompt to the longest without a word."""
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *WORKLOAD,
                           "--input_len=64"], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 1 and "input_len 64 exceeds max_input_len 32" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_startup_only_loads_from_the_cache_on_a_second_start(tmp_path):
    """--startup_only twice on one compilation cache: the first start compiles its first
    programs before the first token; the second finds its configuration's marker in the cache
    (engine/warm_start.py), compiles nothing and loads only what its first token needs before
    it, the rest in the background."""
    flags = ["--model=tiny-llama", "--random_weights", "--max_num_seqs=2",
             "--max_num_batched_tokens=32", "--max_model_len=64", "--startup_only",
             f"--compilation_cache_dir={tmp_path / 'cache'}"]
    runs = []
    for name in ("cold", "warm"):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", *flags,
                               f"--json_out={out}"], capture_output=True, text=True,
                              timeout=600, env=ENV)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "ready in" in proc.stdout and "loaded from the compilation cache" in proc.stdout
        # the warm start compiles nothing before its first token, so names no slowest program
        assert ("slowest to compile: " in proc.stdout) == (name == "cold")
        assert ("compilation cache warm" in proc.stderr) == (name == "warm"), proc.stderr[-2000:]
        runs.append(json.loads(out.read_text()))
    cold, warm = runs
    assert cold["mode"] == "startup" and cold["programs_compiled"] > 0
    slowest = cold["slowest_programs"]  # [label, seconds], the longest compile first
    assert 0 < len(slowest) <= 8 and [s for _, s in slowest] == sorted(
        (s for _, s in slowest), reverse=True) and slowest[0][1] > 0
    assert all(" seqs, " in label and " pages" in label for label, _ in slowest)
    assert warm["programs_compiled"] == 0 and 0 < warm["programs_loaded"] < cold["programs"]
    assert warm["slowest_programs"] == []
    for r in runs:
        assert 0 < r["main_at_s"] < r["ready_s"] and r["first_token_s"] > 0
        assert r["ready_without_weights_s"] == r["ready_s"] - r["weights_s"]
        assert r["layer_loop"] == "scan"  # the CPU's default


def test_startup_only_starts_the_random_codes_of_quant(tmp_path):
    """--startup_only --quant=int4 starts the preset as random INT4 codes, as the serving run
    does, rather than a float model (which for a large preset may not fit the device)."""
    out = tmp_path / "int4.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.serving", "--model=tiny-llama",
                           "--random_weights", "--quant=int4", "--max_num_seqs=2",
                           "--max_num_batched_tokens=32", "--max_model_len=64", "--startup_only",
                           f"--json_out={out}"],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    float_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(
        abstract_model(get_preset("tiny-llama"), jnp.float32))))
    assert result["quant"] == "int4" and result["programs"] > 0
    # the embedding stays float; the decoder linears, most of the rest, take 4 of 32 bits
    assert result["weights_bytes"] < 0.6 * float_bytes
