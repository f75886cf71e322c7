"""scripts/bench_wgmma.py: its sweep's configurations (ops.quant_wgmma.sweep_configs), and a
run on the CPU, where every kernel row records why it did not run (the kernel needs a Hopper
GPU). No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

from ops import quant_wgmma as qw


def test_sweep_configs_are_taken_by_the_kernel():
    for bits, k, n in ((4, 4096, 28672), (8, 4096, 4096), (4, 14336, 4096)):
        configs = qw.sweep_configs(bits, k, n)
        assert configs
        group = 128 if bits == 4 else k
        for cfg in configs:
            assert qw.supports(bits, 16, k, n, group, "bfloat16", "bfloat16", cfg), cfg
            assert 120 <= n // cfg.block_n * cfg.num_splits <= 1100 or cfg.num_splits == 1


def test_bench_wgmma_on_the_cpu(tmp_path):
    out = tmp_path / "wgmma.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench_wgmma", "--modes=check,table",
         "--shapes=1024x512", "--ms=2", "--calls=1", "--queue=1", f"--json_out={out}"],
        capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    checks = [r for r in rows if r["mode"] == "check"]
    times = [r for r in rows if r["mode"] == "time"]
    assert checks and all("needs a Hopper GPU" in r["error"] for r in checks)
    assert [(r["impl"], r["bits"]) for r in times] == [("bf16", 16), ("wgmma", 4), ("wgmma", 8)]
    assert "no device events" in times[0]["dev_error"]
    assert all("needs a Hopper GPU" in r["dev_error"] for r in times[1:])
