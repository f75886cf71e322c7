"""scripts/bench/moe_routing.py on the CPU with tiny-qwen3-moe: a row per layer whose counts
fit the prompt, and a clear error for a model that is not a mixture."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.bench.moe_routing", *flags],
                          capture_output=True, text=True, timeout=600,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


def test_a_row_per_layer(tmp_path):
    out = tmp_path / "routing.json"
    proc = run("--model=tiny-qwen3-moe", "--tokens=40", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    step = result["step_tokens"]  # the prompt padded to its program's tokens
    assert step >= 40
    assert [r["layer"] for r in result["layers"]] == [0, 1]  # tiny-qwen3-moe: 2 layers
    for r in result["layers"]:  # top 3 of 8 experts
        assert 3 <= r["experts_touched"] <= 8 and -(-step * 3 // 8) <= r["busiest"] <= step
        assert r["busiest_share"] == r["busiest"] / step
    assert "experts touched" in proc.stdout


def test_a_decode_step(tmp_path):
    """--batch: one decode step of 8 sequences (24 pairs over 8 experts: sorted, recorded)."""
    out = tmp_path / "routing.json"
    proc = run("--model=tiny-qwen3-moe", "--batch=8", "--context=20", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["step_tokens"] == 8 and len(result["layers"]) == 2


def test_a_dense_model_is_refused():
    proc = run("--model=tiny-llama31", "--tokens=8")
    assert proc.returncode == 1 and "not a mixture of experts" in proc.stderr
