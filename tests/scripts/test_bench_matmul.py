"""scripts/bench_matmul.py on the CPU (interpret mode, a small shape): its rows and the device
times taken from a profile (a stand-in profile here; no timing is asserted)."""
from __future__ import annotations

import jax
import pytest
from absl import flags
from absl.testing import flagsaver

from ops.quant_matmul import matmul_config
from scripts import bench_matmul


@pytest.fixture
def parsed_flags():
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def test_rows_with_device_times(monkeypatch, parsed_flags):
    """The bf16 peer, the kernel and the dispatch row of one shape; each program is traced
    once, and its device time per product is busy time over queue x calls products."""
    busy = iter([6e-6, 2e-6])  # per unit of work: the bf16 program's, then the kernel's
    traced = []

    def fake_profile(run, calls, units, log_dir):
        jax.block_until_ready(run())  # the program runs
        traced.append((calls, units))
        return {"busy_s_per_step": next(busy), "by_name": [{"name": "k", "s_per_step": 1e-6}]}

    monkeypatch.setattr(bench_matmul.decode_profile, "profile_calls", fake_profile)
    with flagsaver.flagsaver(impl="pallas_interpret", bits=["4"], calls=2, queue=3, runs=1,
                             mgpu_max_m=0, variants="dispatch", device_times=True):
        rows = bench_matmul.bench_shape(256, 128, [1], {})
    assert [r["impl"] for r in rows] == ["xla_bf16", "int4_kernel", "int4"]
    assert traced == [(3, 6), (3, 6)]  # queue calls of `calls` products each
    bf16, kernel, dispatch = rows
    assert bf16["dev_us"] == pytest.approx(6.0) and kernel["dev_us"] == pytest.approx(2.0)
    assert kernel["dev_speedup"] == pytest.approx(3.0)
    assert kernel["kernels"] == {"k": 1.0}
    assert kernel["config"] == str(matmul_config(4, 1, 256, 128, 128))
    assert dispatch["via"] == "int4_kernel" and dispatch["us"] == kernel["us"]
    assert dispatch["dev_us"] == kernel["dev_us"]


def test_device_times_off_and_unavailable(monkeypatch, parsed_flags):
    """Without --device_times nothing is traced; a profile without device events (the CPU's)
    is recorded as dev_error, and the timing row stays."""
    with flagsaver.flagsaver(device_times=False):
        assert bench_matmul.device_per_call(lambda: None, (), 1) == {}
    with flagsaver.flagsaver(device_times=True, queue=1):
        out = bench_matmul.device_per_call(lambda x: x + 1, (jax.numpy.ones(4),), 1)
    assert "no device events" in out["dev_error"]
