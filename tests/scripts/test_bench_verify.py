"""scripts/bench_verify: verification step costs, predicted speed-ups, the always-agreeing run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.scripts.test_scripts import assert_one_clear_error, run_script


def test_bench_verify_on_a_tiny_model(tmp_path):
    out = tmp_path / "verify.json"
    result = run_script("bench_verify", "--model=tiny-llama", "--batches=2", "--max_k=3",
                        "--context=20", "--calls=2", "--runs=1", "--oracle_k=2",
                        "--oracle_prompt_len=8", "--oracle_tokens=10", "--alphas=0.5,0.9",
                        f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted speed-up" in result.stdout and "always-agreeing" in result.stdout
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["step_costs"]] == [2]
    for row, predicted in zip(report["step_costs"], report["predicted"]):
        assert row["decode_step_s"] > 0
        assert [v["k"] for v in row["verify"]] == [1, 2, 3]
        cost = np.array([v["step_s"] / row["decode_step_s"] for v in row["verify"]])
        np.testing.assert_allclose(cost, [v["over_decode"] for v in row["verify"]], rtol=1e-9)
        for alpha in ("0.5", "0.9"):  # (alpha k + 1) / cost(k), n-gram: no draft cost
            expected = (float(alpha) * np.arange(1, 4) + 1) / cost
            np.testing.assert_allclose(predicted["table"][alpha], expected, rtol=1e-9)
            assert predicted["best"][alpha] == [int(np.argmax(expected)) + 1,
                                                pytest.approx(expected.max(), rel=1e-9)]
    for oracle in report["oracle"]:  # the proposer that always agrees: exact, all accepted
        assert oracle["same_tokens"] and oracle["acceptance_rate"] == 1.0
        assert oracle["continuation_rounds"] == 1 and min(oracle["tokens_equal_to_plain"]) == 10
        assert oracle["mean_tokens_per_verification"] > 2.0  # k = 2 at the end of outputs
        assert oracle["speculative_tokens_per_s"] > 0 and oracle["plain_tokens_per_s"] > 0


def test_bench_verify_rejects_bad_flags():
    result = run_script("bench_verify", "--model=tiny-llama", "--max_k=0")
    assert_one_clear_error(result, "--max_k")
