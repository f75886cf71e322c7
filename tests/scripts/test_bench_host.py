"""scripts/bench_host.py: the engine's host work per step with a stub runner (no timing asserted)."""
import json
import subprocess
import sys

from scripts import bench_host


def test_stub_engine_decodes_every_sequence():
    engine = bench_host.stub_engine(num_seqs=5, async_scheduling=True)
    for _ in range(4):
        engine.step()
    running = engine.scheduler.running
    assert len(running) == 5
    # The stub's tokens (3, 4, ...) arrive in each request's row order, one per step.
    assert all(r.output_ids and set(r.output_ids) <= set(range(3, 8)) for r in running)
    assert {len(r.output_ids) for r in running} == {3}  # asynchronous: one still in flight


def test_bench_host_writes_its_table_and_json(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_host", "--num_seqs=6",
                           "--steps=3", "--repeats=1", f"--json_out={out}"],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["num_seqs"] == 6 and result["host_s_per_step"] > 0
    assert {"schedule", "rows + batch", "finish + append"} <= set(result["phase_s_per_step"])
    assert "| schedule |" in proc.stdout


def test_serving_workload_figures_per_round_set():
    """--workload=serving: host time per model step over all rounds, at the most running and
    while saturated, with rounds counted and phases timed."""
    result = bench_host.measure_serving(32, True, 4)
    assert result["host_s_per_step_all"] > 0
    for name in ("at_max_running", "saturated"):
        assert result[f"rounds_{name}"] > 0 and result[f"host_s_per_step_{name}"] > 0
        assert {"schedule", "finish + append"} <= set(result[f"phase_s_per_step_{name}"])
    assert 0 < result["multi_step_rounds_saturated"] <= result["rounds_saturated"]
    assert result["mean_running_at_max_running"] == 32


def test_round_sets_pick_the_most_running_and_the_saturated_rounds():
    """timing.round_sets: rows (running, host, wall, exposed, model steps, waiting); saturated
    starts at the first round at the most running and keeps the rounds after whose scheduling
    requests waited; nothing recorded gives empty sets."""
    from scripts.timing import round_sets
    steps = [(4, 0, 1, 0, 1, 9), (8, 0, 1, 0, 1, 5), (7, 0, 1, 0, 8, 3), (8, 0, 1, 0, 1, 1),
             (6, 0, 1, 0, 8, 0), (8, 0, 1, 0, 1, 0)]
    sets = round_sets(steps)
    assert sets["at_max_running"].tolist() == [False, True, False, True, False, True]
    assert sets["saturated"].tolist() == [False, True, True, True, False, False]
    empty = round_sets([])
    assert empty["at_max_running"].size == empty["saturated"].size == 0
