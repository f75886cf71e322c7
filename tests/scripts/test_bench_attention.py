"""scripts/bench_attention.py on the CPU: the decode rows with the Pallas kernel interpreted
(tiny shapes), an explicit --decode_config that merges the splits in the kernel, the JSON, and
--device_times (the CPU's profile has no device events: an error entry per row, no crash)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_bench_attention_decode_rows_with_the_merge_in_kernel(tmp_path):
    out = tmp_path / "attention.json"
    args = ["--modes=decode", "--batches=2", "--contexts=64", "--num_heads=4",
            "--num_kv_heads=2", "--head_dim=16", "--page_size=8", "--calls=1", "--queue=1",
            "--runs=1", "--impl=pallas_interpret", "--decode_config=16,2,4,3,1", "--device_times",
            f"--json_out={out}"]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_attention", *args],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    ours = rows["pallasite"]
    assert (ours["batch"], ours["context"]) == (2, 64) and ours["us"] > 0
    assert "num_splits=2" in ours["config"] and "merge_in_kernel=True" in ours["config"]
    assert rows["xla"]["us"] > 0  # the jnp peer on the same arrays
    assert "B2 ctx64" in proc.stdout
    assert all("no device events" in rows[name]["dev_error"] for name in ("pallasite", "xla"))


def test_step_decode_rows_time_the_engines_kernel_with_more_tiles(tmp_path):
    """--modes=step_decode: the ragged kernel on a decode step (one token per sequence) with
    ragged_config's tiles, then each --step_decode_tiles entry; a malformed entry is a one-line
    usage error."""
    out = tmp_path / "step.json"
    base = ["--modes=step_decode", "--batches=3", "--contexts=64", "--num_heads=4",
            "--num_kv_heads=2", "--head_dim=16", "--page_size=8", "--calls=1", "--queue=1",
            "--runs=1", "--impl=pallas_interpret"]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_attention", *base,
                           "--step_decode_tiles=8/2/4/2,16/1/2/3", f"--json_out={out}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["dispatch"]) for r in rows] == [
        ("ragged_step", True), ("ragged_step", False), ("ragged_step", False)]
    assert all((r["batch"], r["context"]) == (3, 64) and r["us"] > 0 for r in rows)
    assert "block_k=8, num_splits=2, num_warps=4, num_stages=2" in rows[1]["config"]
    assert "block_k=16, num_splits=1, num_warps=2, num_stages=3" in rows[2]["config"]
    assert rows[1]["config"].split("block_k")[0] == rows[0]["config"].split("block_k")[0]
    assert proc.stdout.count("B3 ctx64") == 6  # as each shape is timed, then the closing table
    bad = subprocess.run([sys.executable, "-m", "scripts.bench_attention", *base,
                          "--step_decode_tiles=64/2/4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode != 0 and "--step_decode_tiles: '64/2/4'" in bad.stderr
    assert "Traceback" not in bad.stderr
