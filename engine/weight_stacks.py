"""The model's weights as a few stacked arrays: one argument per (shape, dtype) instead of one
per weight.

A jitted step takes every weight as an argument. The dispatch of a llama3.2-1b step (about 180
arguments) holds the host 1.8-2.1 ms on the H200, where a program of 128 kernels and two
arguments returns in 0.14 ms (docs/PERFORMANCE.md), so the runtime's work per argument is the
suspect. The layers of a transformer repeat the same shapes, so the weights fall into a few
groups: llama3.2-1b's 146 arrays into 6, llama3.1-8b's 291 into 7. `stack_leaves` stacks each
group once, on the device, into one [count, ...] array; inside the step `unstack_leaves` takes
each weight back out with a static index, which XLA can read in place (a slice of an
argument). Whether it does, or copies, and what the dispatch saves, is what `bench_decode
--variants=stacked` measures (not yet run on a GPU).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """Where each weight of a flat list lives: places[i] = (group, index in the group)."""

    places: tuple[tuple[int, int], ...]
    num_groups: int


def plan_stacks(leaves) -> StackPlan:
    """Groups the leaves [L] by (shape, dtype), in order of first appearance."""
    groups: dict[tuple, int] = {}
    counts: list[int] = []
    places = []
    for leaf in leaves:
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
        if key not in groups:
            groups[key] = len(groups)
            counts.append(0)
        g = groups[key]
        places.append((g, counts[g]))
        counts[g] += 1
    return StackPlan(tuple(places), len(groups))


def stack_leaves(leaves, plan: StackPlan) -> tuple[jax.Array, ...]:
    """The leaves as plan.num_groups arrays, group g [count_g, *shape_g] (made on the device)."""
    members: list[list] = [[] for _ in range(plan.num_groups)]
    for leaf, (g, _) in zip(leaves, plan.places):
        members[g].append(leaf)
    return tuple(jnp.stack(m) for m in members)


def unstack_leaves(stacked, plan: StackPlan) -> list:
    """Inverse of stack_leaves (inside a jitted step): the flat list of weights."""
    return [stacked[g][i] for g, i in plan.places]
