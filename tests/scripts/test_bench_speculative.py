"""scripts/bench/speculative.py on the CPU with tiny models: the methods compared end to end,
the verification step costs and the speed-ups they predict, the always-agreeing proposer, and
bad flags as one clear error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.scripts.test_scripts import TINY_DIR, assert_one_clear_error, run_script


def test_methods_compared_on_the_chat_prompts(tmp_path):
    out = tmp_path / "spec.json"
    result = run_script("bench.speculative", f"--model={TINY_DIR}", "--methods=none,ngram",
                        "--max_tokens=8", "--repeats=1", f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())["methods"]
    assert report["none"]["speedup"] == 1.0 and report["ngram"]["decode_tokens_per_s"] > 0
    assert report["ngram"]["same_tokens_as_first_method"]  # greedy speculation is exact
    assert report["ngram"]["drafts"] > 0  # the prompts repeat their text: proposals were made
    assert "| ngram |" in result.stdout and "| method | tokens/s |" in result.stdout


def test_step_costs_predicted_speedups_and_the_oracle(tmp_path):
    out = tmp_path / "verify.json"
    result = run_script("bench.speculative", "--model=tiny-llama", "--modes=costs,oracle",
                        "--batches=2", "--max_k=3", "--context=20", "--calls=2", "--runs=1",
                        "--oracle_k=2", "--oracle_prompt_len=8", "--oracle_tokens=10",
                        "--alphas=0.5,0.9", f"--json_out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted speed-up" in result.stdout and "always-agreeing" in result.stdout
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["step_costs"]] == [2]
    for row, predicted in zip(report["step_costs"], report["predicted"]):
        assert row["decode_step_s"] > 0 and [v["k"] for v in row["verify"]] == [1, 2, 3]
        cost = np.array([v["step_s"] / row["decode_step_s"] for v in row["verify"]])
        np.testing.assert_allclose(cost, [v["over_decode"] for v in row["verify"]], rtol=1e-9)
        for alpha in ("0.5", "0.9"):  # (alpha k + 1) / cost(k), n-gram: no draft cost
            expected = (float(alpha) * np.arange(1, 4) + 1) / cost
            np.testing.assert_allclose(predicted["table"][alpha], expected, rtol=1e-9)
            assert predicted["best"][alpha] == [int(np.argmax(expected)) + 1,
                                                pytest.approx(expected.max(), rel=1e-9)]
    (oracle,) = report["oracle"]  # the proposer that always agrees: exact, all accepted
    assert oracle["same_tokens"] and oracle["acceptance_rate"] == 1.0
    assert oracle["continuation_rounds"] == 1 and min(oracle["tokens_equal_to_plain"]) == 10
    assert oracle["speculative_tokens_per_s"] > 0 and oracle["plain_tokens_per_s"] > 0
    assert "| 2 | 2 |" in result.stdout  # the oracle's row: batch 2, k 2


@pytest.mark.parametrize("flag,named", [("--max_k=0", "--max_k"), ("--modes=costs,bogus",
                                                                    "--modes: unknown bogus")])
def test_bad_flags_are_one_clear_error(flag, named):
    assert_one_clear_error(run_script("bench.speculative", "--model=tiny-llama", flag), named)
