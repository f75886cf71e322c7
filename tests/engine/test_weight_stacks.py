"""engine/weight_stacks.py: the weights as one stacked array per shape give the same steps."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from configs.model import TINY_LLAMA31, TINY_QWEN2
from engine.runner import ModelRunner, make_step_batch
from engine.weight_stacks import plan_stacks, stack_leaves, unstack_leaves
from models.weights import model_from_pure_dict
from tests.engine.weights import unit_scale_pure_dict


@pytest.mark.parametrize("cfg", [TINY_LLAMA31, TINY_QWEN2], ids=lambda c: c.name)
def test_stacked_weights_give_the_same_logits(cfg):
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, seed=2))
    runners = [ModelRunner(cfg, model, num_pages=12, page_size=4, max_seqs=2, max_width=5,
                           stack_weights=stack) for stack in (False, True)]
    leaves = jax.tree.leaves(runners[0].state)
    plan = plan_stacks(leaves)
    assert len(runners[1]._weights) == plan.num_groups < len(leaves)  # fewer arguments
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7, 3)]
    prefill = make_step_batch([(prompts[0], 0, [3, 0]), (prompts[1], 0, [7])], 4)
    decode = make_step_batch([([5], 7, [3, 0]), ([9], 3, [7])], 4)
    outs = [[np.asarray(r.execute(b)) for b in (prefill, decode)] for r in runners]
    for flat, stacked in zip(*outs):
        np.testing.assert_array_equal(flat, stacked)  # the same program, read from stacks


def test_stacks_round_trip_in_order():
    rng = np.random.default_rng(1)
    leaves = [rng.standard_normal(s).astype(np.float32)
              for s in [(3, 4), (4,), (3, 4), (2,), (4,), (3, 4)]]
    plan = plan_stacks(leaves)
    assert plan.num_groups == 3
    assert plan.places == ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2))
    stacked = stack_leaves(leaves, plan)
    assert [s.shape for s in stacked] == [(3, 3, 4), (2, 4), (1, 2)]
    for a, b in zip(leaves, unstack_leaves(stacked, plan)):
        np.testing.assert_array_equal(a, np.asarray(b))
