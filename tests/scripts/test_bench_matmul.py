"""scripts/bench/matmul.py on the CPU (interpret mode, a small shape), and the device times it
takes from a profile (scripts/bench/profile.py). No timing is asserted."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ops.gemv import gemv_config
from ops.quant_matmul import matmul_config
from scripts.bench import profile


def test_device_time_is_busy_time_per_call(monkeypatch, tmp_path):
    """One trace of `queue` runs of the program, each `calls` calls: busy time per call."""
    traced = []

    def fake_profile(run, calls, units, log_dir):
        out = jax.block_until_ready(run())  # the jitted program runs
        traced.append((calls, units, float(out[0])))
        return {"busy_s_per_step": 2e-6, "by_name": [{"name": "kernel", "s_per_step": 1.5e-6}]}

    monkeypatch.setattr(profile, "profile_calls", fake_profile)
    out = profile.device_time_per_call(lambda x: (x * 2,), (jnp.ones(()),), calls=4,
                                              queue=3, log_dir=str(tmp_path))
    assert traced == [(3, 12, 2.0)]
    assert out == {"dev_us": pytest.approx(2.0), "kernels": {"kernel": 1.5}}


def test_device_time_without_device_events(tmp_path):
    """The CPU's profile has no device events: an error entry, not an exception."""
    out = profile.device_time_per_call(lambda x: x + 1, (jnp.ones(4),), calls=1, queue=1,
                                              log_dir=str(tmp_path))
    assert "no device events" in out["dev_error"]


def run_bench(tmp_path, *flags: str) -> tuple[list[dict], str]:
    """scripts.bench.matmul in interpret mode on the CPU: (its JSON rows, its stdout)."""
    out = tmp_path / "matmul.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.matmul", "--impl=pallas_interpret",
         "--modes=bench", "--shapes=256x128", "--ms=1,2", "--calls=2", "--queue=1",
         "--runs=1", "--mgpu_max_m=0", "--variants=dispatch", f"--json_out={out}", *flags],
        capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
             "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["rows"], proc.stdout


def test_bench_matmul_rows(tmp_path):
    """The bf16 peer, the kernel and the dispatch row (the heuristic's config) of one shape,
    then the products over transposed bf16 and INT4 weights: what `linear` runs (bf16:
    ops/gemv.py's kernel at one row, XLA's dot at two; INT4: the "nk" layout of
    ops/quant_matmul.py), and at one row ops/gemv.py's kernel over the codes too, with its own
    tile and --gemv_tiles'."""
    rows, _ = run_bench(tmp_path, "--bits=4", "--device_times", "--gemv_tiles=4/512/2")
    names = ["xla_bf16", "int4_kernel", "int4", "bf16_nk", "int4_nk"]
    assert [r["impl"] for r in rows] == names + ["int4_gemv"] * 2 + names
    assert [r["M"] for r in rows] == [1] * 7 + [2] * 5
    for m, (bf16, kernel, dispatch, *nk) in ((1, rows[:7]), (2, rows[7:])):
        assert all(r["TBps"] > 0 and "error" not in r for r in nk)
        assert kernel["config"] == str(matmul_config(4, m, 256, 128, 128))
        assert dispatch["via"] == "int4_kernel" and dispatch["us"] == kernel["us"] > 0
    nk_cfg = lambda m: str(matmul_config(4, m, 256, 128, 128, stored_nk=True))  # noqa: E731
    own = gemv_config(False, False, 4, 256)
    swept = dataclasses.replace(own, block_n=4, block_k=512, num_warps=2)
    assert [r["config"] for r in rows[3:7]] == [str(gemv_config(False, False, 16)), nk_cfg(1),
                                                str(own), str(swept)]
    assert [r["config"] for r in rows[10:]] == ["xla", nk_cfg(2)]
    assert all(r["k_order"] == "natural" for r in rows if r["impl"].endswith(("_nk", "_gemv")))
    assert all("no device events" in r["dev_error"] for r in rows)


def test_bench_matmul_model_layout_table(tmp_path):
    """--nokn: only the peer and the model's layout; --asymmetric INT4 counts its offsets in
    the bytes read; the closing markdown table holds every (shape, M) with the rows' times and
    the speedups over the peer."""
    rows, stdout = run_bench(tmp_path, "--nokn", "--asymmetric", "--bits=4,8")
    codes, tables = 256 * 128 // 2, 2 * 2 * (256 // 128) * 128  # scales and offsets
    names = ["xla_bf16", "bf16_nk", "int8_nk", "int4_nk"]
    assert [r["impl"] for r in rows] == (names[:3] + ["int8_gemv", "int4_nk", "int4_gemv"]
                                         + names)  # one row: ops/gemv.py over codes too
    for r in rows:
        assert "error" not in r and r["us"] > 0
    int4 = [r for r in rows if r["impl"] in ("int4_nk", "int4_gemv")]
    assert all(r["TBps"] == pytest.approx((codes + tables) / r["us"] / 1e6) for r in int4)
    table = stdout[stdout.index("| K x N |"):].splitlines()
    assert len(table) == 2 + 2  # header, rule, M = 1 and 2
    for line, m in zip(table[2:], (1, 2)):
        cells = [c.strip() for c in line.strip("|").split("|")]
        by = {r["impl"]: r for r in rows if r["M"] == m}
        assert cells[:2] == ["256x128", str(m)]
        assert float(cells[2]) == pytest.approx(by["xla_bf16"]["us"], abs=0.05)
        assert float(cells[3]) == pytest.approx(by["int4_nk"]["us"], abs=0.05)
        assert cells[5] == f"{by['xla_bf16']['us'] / by['int4_nk']['us']:.2f}x"
        assert float(cells[6]) == pytest.approx(by["int8_nk"]["us"], abs=0.05)
        assert cells[-1] == "-"  # no Mosaic peer (--mgpu_max_m=0)


def test_sweep_times_each_tile_and_keeps_the_fastest(tmp_path):
    """--modes=sweep: the peer, the heuristic's tiles, the variants of sweep_configs (each
    with K splits), then the fastest; no Hopper kernel rows off a Hopper GPU."""
    rows, stdout = run_bench(tmp_path, "--modes=sweep", "--bits=8", "--ms=1")
    assert [r["impl"] for r in rows][:2] == ["xla_bf16", "int8_heuristic"]
    kernels = [r for r in rows if r["impl"] in ("int8_heuristic", "int8_kernel")]
    assert len(kernels) == 1 + 4 and len({r["config"] for r in kernels}) == 5
    assert "mma" in kernels[-1]["config"] and "num_splits=0" not in kernels[-1]["config"]
    best = rows[-1]
    assert best["impl"] == "int8_best"
    assert best["us"] == min(r["us"] for r in kernels if "error" not in r)
    assert not any("wgmma" in r["impl"] for r in rows)
    line = stdout[stdout.index("| K x N | M | bits |"):].splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["256x128", "1", "8"] and cells[-2:] == ["-", "-"]
    assert cells[5] == f"{best['us']:.1f}" and cells[6] == best["config"]
