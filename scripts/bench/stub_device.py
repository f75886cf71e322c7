"""A stub device for the serving benchmark: the runner's device work replaced by token ids
returned at once. A run on it times the engine's host work alone (--stub_device), or tells which
step programs a workload reaches (`reached_programs`: the warm-up of --warmup=dry_run compiles
those, and only those, side by side)."""
from __future__ import annotations

import numpy as np

from engine.step_batch import bucket
from engine.warmup import STEP, round_program

STUBBED = ("execute_and_sample", "execute_multi_step", "execute_mixed_round")


def stub_device(engine, reached: dict | None = None) -> None:
    """Replaces the runner's device work by token ids 3.. returned at once (a round: the same
    ids at every step). With `reached`, each program a step would run is noted there once:
    {(bucket key, program): (q_lens, width, verification, program)}, as
    engine.warmup.step_programs writes programs."""
    runner = engine.runner
    tokens = np.arange(max(engine.engine_cfg.max_num_batched_tokens, 1), dtype=np.int32)
    tokens = tokens % 200 + 3  # never an EOS id

    def note(batch, program: str) -> None:
        if reached is not None:
            reached.setdefault((runner.step_key(batch), program), (
                np.diff(batch.query_start_loc).tolist(), batch.block_tables.shape[1],
                batch.verify_len > 0, program))

    def execute_and_sample(batch, arrays, prev_samples=None, sample_index=None):
        note(batch, STEP)
        return tokens[: max(batch.num_seqs, 1)].copy(), None, None, None

    def execute_multi_step(batch, arrays, steps, *args, **kwargs):
        note(batch, round_program(arrays.mode(), arrays.penalties is not None))
        return np.tile(tokens[: bucket(batch.num_seqs)], (steps, 1)), None

    def execute_mixed_round(batch, complete, arrays, steps, *args, **kwargs):
        note(batch, round_program(arrays.mode(), arrays.penalties is not None))
        return np.tile(tokens[: bucket(batch.num_seqs)], (steps, 1)), None

    runner.execute_and_sample = execute_and_sample
    runner.execute_multi_step = execute_multi_step
    runner.execute_mixed_round = execute_mixed_round


def unstub_device(engine) -> None:
    """Gives the runner its device work back."""
    for name in STUBBED:
        engine.runner.__dict__.pop(name, None)


def forget_run(engine) -> None:
    """Empties an engine's page pool (and its prefix cache) and preemption count after a run,
    so that the next run of the same workload starts as the first did."""
    engine.pool = type(engine.pool)(engine.pool.num_pages, engine.pool.page_size,
                                    engine.pool.enable_prefix_caching)
    engine.scheduler.pool = engine.pool
    engine.scheduler.num_preemptions = 0


def reached_programs(engine, run) -> list[tuple]:
    """The step programs (q_lens, width, verification, program) that run() reaches on this
    engine, one per program, found by running it on the stub device; the engine is then as
    before. Exact where the schedule does not depend on time (requests all at once)."""
    reached: dict = {}
    stub_device(engine, reached)
    try:
        run()
    finally:
        unstub_device(engine)
        forget_run(engine)
    return list(reached.values())
