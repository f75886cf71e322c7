"""The compiled sharded step: one all-reduce per row-parallel layer, no weight all-gathers, and
the donated cache updated in place."""
from __future__ import annotations

import pytest

CASES = ["tiny-llama31/float32/4x1", "tiny-llama31/float32/8x1",
         "tiny-llama31/float32/4x2", "smollm2-2layers/float32/4x1",
         "tiny-llama31/int4_rtn/2x1", "tiny-llama31/int4_rtn/4x1"]


def report(scenario, case):
    result = scenario("hlo")
    if case not in result:
        pytest.skip("quantized weights (quant/) are not available")
    return result[case]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_one_all_reduce_per_row_parallel_layer(scenario, case, kind):
    r = report(scenario, case)
    # o_proj and down_proj per layer; o_proj is not split when attention is replicated.
    row_parallel = r["num_layers"] * (2 if r["shard_heads"] else 1)
    step = r[kind]
    reduces = [c for c in step["collectives"] if c["kind"] == "all-reduce"]
    assert sum(c["op"] == "dot_general" for c in reduces) == row_parallel, reduces
    # The only other reductions: the vocab-parallel embedding lookup (masked local gathers
    # summed) and, with dp > 1, picking each sequence's last hidden state out of its data shard.
    assert all(c["op"] in ("dot_general", "gather") for c in reduces), reduces
    assert sum(c["op"] == "gather" for c in reduces) == (1 if case.endswith("x1") else 2)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_no_all_gather_of_weights(scenario, case, kind):
    step = report(scenario, case)[kind]
    assert not step["gathered_weights"]  # no array of a weight's shape (codes, scales, ...)
    # The logits are gathered (the step returns them replicated): over the model axis, and
    # with dp > 1 over the data axis too. Besides them only the greedy tokens' argmax: each
    # model shard's (max, index) pair per row ([rows, tp] values and indices) and, with
    # dp > 1, the tokens [dp * S] over the data axis.
    gathers = [c for c in step["collectives"] if c["kind"] == "all-gather"]
    logits = [c for c in gathers if c["op"] == "dot_general"]
    single_data_shard = case.endswith("x1")
    assert len(logits) == (1 if single_data_shard else 2), gathers
    tp = int(case.rsplit("/", 1)[1].split("x")[0])
    argmax = [c for c in gathers if c["op"] == "reduce"]
    assert len(logits) + len(argmax) == len(gathers), gathers
    for c in argmax:
        dims = c["shape"].split("[", 1)[1].rstrip("]").split(",")
        assert dims[-1] == str(tp) or (len(dims) == 1 and not single_data_shard), gathers


@pytest.mark.parametrize("case", CASES)
def test_cache_donated_and_written_in_place(scenario, case):
    r = report(scenario, case)
    for kind in ("decode", "prefill"):
        assert r[kind]["aliased"] == 2 * r["num_layers"]  # every layer's k and v pages
        assert r[kind]["page_copies"] == 0
