"""scripts/bench_dispatch: dispatch latency with and without a device-side cond (CPU smoke run;
the figures that matter come from the GPU, docs/PERFORMANCE.md)."""
from __future__ import annotations

import json

from tests.scripts.test_scripts import assert_one_clear_error, run_script


def test_bench_dispatch_runs_and_reports_each_program(tmp_path):
    out = tmp_path / "dispatch.json"
    result = run_script("bench_dispatch", "--rows=8", "--dim=32", "--layers=3", "--calls=3",
                        "--queue=2", "--weight_args=1,5", f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(r["program"], r["rows"]) for r in report["results"]] == [
        ("argmax", "greedy rows"), ("cond", "greedy rows"), ("cond", "sampled rows"),
        ("argmax", "greedy rows, 1 weight arrays"), ("argmax", "greedy rows, 5 weight arrays")]
    for r in report["results"]:
        assert 0 < r["return_s"] <= r["ready_s"] and r["queued_s"] > 0
        assert abs(r["return_over_ready"] - r["return_s"] / r["ready_s"]) < 1e-12
    assert "| cond | sampled rows |" in result.stdout


def test_bench_dispatch_rejects_bad_sizes():
    assert_one_clear_error(run_script("bench_dispatch", "--layers=0"), "--layers")
    assert_one_clear_error(run_script("bench_dispatch", "--weight_args=0"), "--weight_args")
