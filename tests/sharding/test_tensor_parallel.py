"""Greedy outputs on every mesh equal one device's (tiny configs float32 and INT4, SmolLM2)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.sharding.scenarios import ASYNC_MESHES, MAX_TOKENS, TINY_CASES, case_key, mesh_name

RUNS = [(case_key(cfg, quant), mesh_name(tp, dp)) for cfg, quant, meshes in TINY_CASES
        for tp, dp in meshes]


@pytest.mark.parametrize("case,mesh", RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_tiny_greedy_equals_one_device(scenario, case, mesh):
    result = scenario("tiny")
    if case not in result["cases"]:
        pytest.skip("quantized weights (quant/) are not available")
    runs = result["cases"][case]
    expected, got = runs["one_device"], runs[mesh]
    assert got["tokens"] == expected["tokens"], got["plan"]
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    # Not only the argmax: the chosen tokens' log-probabilities agree to the weights' rounding
    # (float32; bfloat16: two units in the last place at the log-probabilities' size, 4-8).
    atol = 2 * 2.0 ** -5 if case.endswith("/bfloat16") else 1e-5
    np.testing.assert_allclose(got["logprobs"], expected["logprobs"], atol=atol)


def test_tiny_layouts_cover_every_attention_plan(scenario):
    cases = scenario("tiny")["cases"]
    plans = {f"{case}/{mesh}": runs[mesh]["plan"] for case, runs in cases.items()
             for mesh in runs if mesh != "one_device"}
    assert "4 query and 1 KV heads per shard" in plans["tiny-llama31/float32/2x1"]
    assert "each repeated 4 times" in plans["tiny-llama31/float32/8x1"]  # 2 KV heads, tp 8
    assert "1 KV heads < tp=4: each repeated 4 times" in plans["tiny-qwen2/float32/4x1"]
    assert "replicated" in plans["tiny-llama/float32/8x1"]  # 4 query heads over 8 shards


@pytest.mark.parametrize("mesh", ["4x1", "2x2"])
def test_smollm2_greedy_matches_transformers(scenario, mesh):
    """The real model (9 query / 3 KV heads: attention replicated, MLP and vocabulary split)
    gives HF transformers' greedy tokens (tests/golden) on the mesh."""
    result = scenario("smollm2")
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result[mesh]["tokens"] == result["golden"]
    assert "9 query heads do not split" in result[mesh]["plan"]


@pytest.mark.parametrize("mesh", [mesh_name(tp, dp) for tp, dp in ASYNC_MESHES])
@pytest.mark.parametrize("logprobs", [True, False], ids=["sampler", "step_argmax"])
def test_async_scheduling_on_a_mesh_equals_one_device(scenario, mesh, logprobs):
    """Asynchronous scheduling over a mesh: steps read their input tokens from the previous
    step's samples on the device (the sampler's, in batch order, or the step's own argmax, in
    shard order), and the tokens equal one device's synchronous run."""
    runs = scenario("tiny")["cases"][case_key("tiny-llama31", None)]
    got = runs[f"{mesh}/async/{logprobs}"]
    assert got["tokens"] == runs["one_device"]["tokens"]
    assert got["tokens_from_device"] > 0  # the overlap happened
    if logprobs:
        np.testing.assert_allclose(got["logprobs"], runs["one_device"]["logprobs"], atol=1e-5)


@pytest.mark.parametrize("mesh", [mesh_name(tp, dp) for tp, dp in ASYNC_MESHES])
def test_penalties_on_a_mesh_equal_one_device(scenario, mesh):
    """Penalties read and count tokens in a count table replicated over the mesh: an
    asynchronous mesh run gives one device's synchronous tokens, and the penalties changed
    them."""
    runs = scenario("tiny")["cases"][case_key("tiny-llama31", None)]
    got, expected = runs[f"{mesh}/async/penalties"], runs["one_device/penalties"]
    assert got["tokens"] == expected["tokens"]
    assert got["tokens_from_device"] > 0  # the overlap happened
    np.testing.assert_allclose(got["logprobs"], expected["logprobs"], atol=1e-5)
    assert expected["tokens"] != runs["one_device"]["tokens"]


def test_speculative_verification_on_a_mesh_equals_one_device(scenario):
    """n-gram speculation on a 2x2 mesh gives one device's plain greedy tokens, and its
    verification steps run the short-query program of k + 1 tokens a sequence
    (engine.step_batch.bucket_key's verify_len), not a prefill step's. (Requests that want
    logprobs do not speculate.)"""
    runs = scenario("tiny")["cases"][case_key("tiny-llama31", None)]
    got, expected = runs["2x2/speculative"], runs["one_device/repeats"]
    assert got["tokens"] == expected["tokens"]
    assert got["drafts"] > 0
    assert got["verify_keys"] and all(n == s * q and q == 4 for n, s, _, q, _ in
                                      got["verify_keys"]), got["verify_keys"]


def test_rounds_on_a_mesh_equal_one_device_single_steps(scenario):
    """Multi-step and mixed rounds of 4 steps on a mesh (asynchronous; the rows, their sampling
    and penalties in the mesh's shard order, the tokens back in the batch's): greedy, sampled
    and penalized requests together give one device's single-step tokens, on 4x2 and on 2x2.
    On 2x2 the greedy round programs (penalized ones too) compiled ahead serve the run: it
    compiles no round program and no history write."""
    runs = scenario("tiny")["cases"][case_key("tiny-llama31", None)]
    for mesh, sampled in (("4x2", True), ("2x2", False)):
        got, expected = runs[f"{mesh}/rounds/{sampled}"], runs[f"one_device/mixed/{sampled}"]
        assert got["tokens"] == expected["tokens"], (mesh, sampled)
        assert got["rounds"] == ["mixed_round", "multi_step"] and expected["rounds"] == []
    assert runs["2x2/rounds/False"]["round_compiles_in_run"] == []
    assert runs["4x2/rounds/True"]["round_compiles_in_run"]  # (not warmed: the log hears them)
    # the sampled and penalized rows changed tokens
    assert runs["one_device/mixed/True"]["tokens"] != runs["one_device/mixed/False"]["tokens"]


def test_uneven_data_shards_run_programs_that_warm_up_compiles(scenario):
    """Sequences need not sit evenly over the data shards (each grows in the shard of its
    pages): a step's program is keyed by its largest shard, warm-up pads every shard size up
    to max_num_seqs, and a padding batch of `padding_q_lens` (what a round compiled on demand
    is compiled from) keys the same program, for decode and prefill steps alike."""
    keys = scenario("tiny")["cases"][case_key("tiny-llama31", None)]["1x2/uneven_keys"]["keys"]
    assert len(keys) == 3
    for key, padded, warmed in keys:
        assert padded == key and warmed, (key, padded, warmed)
    assert keys[0][0][1] == 4  # three decode rows on a shard: its bucket of 4 sequences


def test_a_mesh_warm_up_compiles_ahead_the_steps_a_run_reaches(scenario):
    """The sharded runner's warm-up lowers and compiles its steps for the mesh from shapes and
    shardings, without running them (so on compile threads, and in a server's background);
    the run then compiles no step program and gives one device's tokens, and sampled and
    logprob requests compile nothing."""
    runs = scenario("tiny")["cases"][case_key("tiny-llama31", None)]
    warm = runs["2x2/warm"]
    assert warm["compiled_ahead"] and warm["warmed"] > 0
    assert warm["step_compiles_in_run"] == []
    # sampled and logprob requests: the samplers, logprobs and batch-order gathers are warm
    assert warm["compiles_in_sampled_runs"] == []
    assert warm["tokens"] == runs["one_device"]["tokens"]
