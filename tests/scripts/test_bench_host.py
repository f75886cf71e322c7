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
