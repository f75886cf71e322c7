"""scripts/bench_serving.py in process: the workload, the static baseline and the host phases
(figures are printed and written, never asserted)."""
import json
import subprocess
import sys

import pytest

PHASES = {"schedule", "rows + batch", "sampling arrays", "dispatch step", "dispatch multi-step",
          "dispatch mixed round", "update computed", "finish + append", "other host", "wait for tokens"}
WORKLOAD = ["--model=tiny-llama", "--random_weights", "--num_requests=12", "--max_num_seqs=4",
            "--max_num_batched_tokens=64", "--max_model_len=256", "--max_input_len=40",
            "--max_output_len=20", "--input_len=16", "--output_len=8", "--warmup=rerun",
            "--host_phases"]


def run_bench(tmp_path, *flags) -> dict:
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_serving", *WORKLOAD, *flags,
                           f"--json_out={out}"], capture_output=True, text=True, timeout=600,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "host phases, ms per model step:" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["async", "multi_step", "async_multi_step",
                                  "async_mixed_rounds"])
def test_bench_serving_reports_throughput_and_host_phases(tmp_path, mode):
    flags = {"async": ["--async_scheduling=true"],
             "multi_step": ["--num_decode_steps=4", "--static_baseline=false",
                            "--nomixed_rounds"],
             "async_multi_step": ["--num_decode_steps=4", "--async_scheduling=true",
                                  "--static_baseline=false", "--nomixed_rounds"],
             # mixed rounds are the default
             "async_mixed_rounds": ["--num_decode_steps=4", "--async_scheduling=true",
                                    "--static_baseline=false"]}[mode]
    profile = tmp_path / "host_profile.txt"
    if mode == "async_mixed_rounds":  # and the engine's Python profiled (--host_profile)
        flags = flags + [f"--host_profile={profile}"]
    # Dispatches made on the worker thread are timed beside the host time, not in it.
    worker = "worker thread: " if mode.endswith("thread") else ""
    dispatch = {"dispatch step", "dispatch multi-step", "dispatch mixed round"}
    expected = {worker + name if name in dispatch else name for name in PHASES}
    result = run_bench(tmp_path, *flags)
    run = result["continuous"]
    assert result["num_requests"] == 12 and run["output_tokens_per_s"] > 0
    assert run["programs_compiled_during_run"] == 0  # the warm-up compiled every program
    assert 0 < run["host_share_all_steps"] <= 1
    phases = run["host_phase_ms_per_step"]
    assert set(phases) == expected
    assert phases[worker + "dispatch step"] > 0 and phases["schedule"] > 0
    # The timed phases lie inside the host time and do not overlap: the rest is not negative.
    host = sum(ms for name, ms in phases.items()
               if name != "wait for tokens" and not name.startswith("worker"))
    assert phases["other host"] >= -0.01 * host
    # The same at the most sequences running, and the engine's Python as a share of its steps.
    busiest = run["host_phase_ms_per_step_at_max_running"]
    assert set(busiest) == expected - {"wait for tokens"}
    assert busiest["other host"] >= -0.01 * sum(ms for name, ms in busiest.items()
                                                 if not name.startswith("worker"))
    # (equal, up to rounding, when the dispatches ran on the worker thread)
    assert 0 < run["engine_python_share_at_max_running"] <= run["host_share_at_max_running"] * (
        1 + 1e-9)
    if mode == "async_mixed_rounds":
        # the whole table has the engine's scheduler; the JSON its top 40 by own time (which
        # functions lead depends on the machine's load: no ranking is asserted)
        assert "scheduler.py" in profile.read_text() and "(schedule)" in profile.read_text()
        top = result["host_profile_top"]
        assert len(top) == 40 and all(calls > 0 and own >= 0 and cum >= 0
                                      for _, calls, own, cum in top)
        owns = [own for _, _, own, _ in top]
        assert owns == sorted(owns, reverse=True)
    else:
        assert "host_profile_top" not in result
    if mode == "async":
        assert result["static"]["output_tokens_per_s"] > 0
        assert result["continuous_over_static"] > 0
    else:
        assert run["num_decode_steps"] == 4 and "static" not in result
        assert phases[worker + "dispatch multi-step"] > 0  # decodes ran as rounds
        # prefill steps ran as mixed rounds exactly when asked
        assert (phases[worker + "dispatch mixed round"] > 0) == mode.endswith("mixed_rounds")
