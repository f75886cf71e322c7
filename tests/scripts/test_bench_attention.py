"""scripts/bench/attention.py on the CPU: the decode and prefill rows with the kernel
interpreted (tiny shapes), extra tiles, the peers on the same arrays, the JSON and the table,
and a malformed tile as a one-line usage error."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
TINY = ["--num_heads=4", "--num_kv_heads=2", "--head_dim=16", "--page_size=8", "--calls=1",
        "--queue=1", "--runs=1", "--impl=pallas_interpret"]


def test_decode_and_prefill_rows_with_extra_tiles_and_peers(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.attention", *TINY, "--modes=decode,prefill",
         "--batches=3", "--contexts=64", "--chunks=32", "--mixed_context=32",
         "--decode_tiles=8/2/4/2", "--prefill_tiles=16/16/4/3", "--device_times",
         f"--json_out={out}"], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert [(r["impl"], r["dispatch"]) for r in decode] == [
        ("pallasite", True), ("pallasite", False), ("jax_builtin", False), ("xla", False)]
    assert all(r["us"] > 0 and r["TBps"] > 0 for r in decode[:2] + decode[3:])
    assert "error" in decode[2]  # JAX's Triton kernel does not run on the CPU: recorded
    assert "block_k=8, num_splits=2, num_warps=4, num_stages=2" in decode[1]["config"]
    kv_bytes = 2 * 3 * 64 * 2 * 16 * 2  # K and V: batch x context x kv heads x head_dim, bf16
    assert decode[0]["TBps"] == pytest.approx(kv_bytes / decode[0]["us"] / 1e6)
    assert all("no device events" in r["dev_error"] for r in decode if "us" in r)
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [r["impl"] for r in prefill] == ["pallasite", "pallasite", "xla", "cudnn_contiguous"]
    assert "block_m=16, block_k=16" in prefill[1]["config"]
    pairs = 32 * 33 // 2  # causal query-key pairs of one 32-token prompt
    assert prefill[0]["TFLOPs"] == pytest.approx(4 * 4 * 16 * pairs / prefill[0]["us"] / 1e6)
    assert prefill[0]["frac"] is None  # no calib mode: no ceiling to take a fraction of
    assert "cuDNN" in prefill[3]["error"]  # a peer that cannot run here is recorded
    mixed = [r for r in rows if r["kind"] == "prefill_mixed"]
    assert len(mixed) == 1 and mixed[0]["tokens"] == 32 + 4 * 5 + 58 and mixed[0]["us"] > 0
    assert proc.stdout.count("B3 ctx64") == 8  # as each shape is timed, then the closing table


def test_a_malformed_tile_is_one_clear_usage_error():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.attention", *TINY,
                           "--decode_tiles=64/2/4"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0 and "--decode_tiles: '64/2/4'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tpu_kernel_rows_interpreted(tmp_path):
    """--impl=tpu_interpret: the decode rows run the TPU kernel (as on a TPU) and the XLA peer."""
    out = tmp_path / "attention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.attention", *TINY[:-1], "--impl=tpu_interpret",
         "--modes=decode", "--batches=2", "--contexts=32", f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["dispatch"]) for r in rows] == [("pallasite_tpu", True),
                                                          ("xla", False)]
    assert rows[0]["us"] > 0 and rows[0]["frac"] is None  # no TPU: no published floor here
