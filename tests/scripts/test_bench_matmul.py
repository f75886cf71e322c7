"""scripts/bench_matmul.py on the CPU (interpret mode, a small shape), and the device times it
takes from a profile (scripts/decode_profile.py). No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ops.gemv import gemv_config
from ops.quant_matmul import matmul_config
from scripts import decode_profile


def test_device_time_is_busy_time_per_call(monkeypatch, tmp_path):
    """One trace of `queue` runs of the program, each `calls` calls: busy time per call."""
    traced = []

    def fake_profile(run, calls, units, log_dir):
        out = jax.block_until_ready(run())  # the jitted program runs
        traced.append((calls, units, float(out[0])))
        return {"busy_s_per_step": 2e-6, "by_name": [{"name": "kernel", "s_per_step": 1.5e-6}]}

    monkeypatch.setattr(decode_profile, "profile_calls", fake_profile)
    out = decode_profile.device_time_per_call(lambda x: (x * 2,), (jnp.ones(()),), calls=4,
                                              queue=3, log_dir=str(tmp_path))
    assert traced == [(3, 12, 2.0)]
    assert out == {"dev_us": pytest.approx(2.0), "kernels": {"kernel": 1.5}}


def test_device_time_without_device_events(tmp_path):
    """The CPU's profile has no device events: an error entry, not an exception."""
    out = decode_profile.device_time_per_call(lambda x: x + 1, (jnp.ones(4),), calls=1, queue=1,
                                              log_dir=str(tmp_path))
    assert "no device events" in out["dev_error"]


def test_bench_matmul_rows(tmp_path):
    """The bf16 peer, the kernel and the dispatch row (the heuristic's config) of one shape,
    then the products over transposed bf16, INT8 and INT4 weights: ops/gemv.py's kernel at one
    row, XLA's dot and the "nk" layout of ops/quant_matmul.py at two."""
    out = tmp_path / "matmul.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench_matmul", "--impl=pallas_interpret",
         "--modes=bench", "--shapes=256x128", "--ms=1,2", "--nk_max_m=2", "--bits=4",
         "--calls=2", "--queue=1",
         "--runs=1", "--mgpu_max_m=0", "--variants=dispatch", "--device_times",
         f"--json_out={out}"],
        capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = ["xla_bf16", "int4_kernel", "int4", "bf16_nk", "int8_nk", "int4_nk"]
    assert [r["impl"] for r in rows] == names * 2 and [r["M"] for r in rows] == [1] * 6 + [2] * 6
    for m, (bf16, kernel, dispatch, *nk) in ((1, rows[:6]), (2, rows[6:])):
        assert all(r["TBps"] > 0 and "error" not in r for r in nk)
        assert kernel["config"] == str(matmul_config(4, m, 256, 128, 128))
        assert dispatch["via"] == "int4_kernel" and dispatch["us"] == kernel["us"] > 0
    assert [r["config"] for r in rows[3:6]] == [str(gemv_config(False, False, b))
                                                for b in (16, 8, 4)]
    assert [r["config"] for r in rows[9:]] == ["xla"] + [
        str(matmul_config(b, 2, 256, 128, g, stored_nk=True)) for b, g in ((8, 256), (4, 128))]
    assert all("no device events" in r["dev_error"] for r in rows)
