"""Timers on an engine's host phases (schedule, batch building, dispatch, appending tokens) and
the figures of its recorded rounds by load, for the serving benchmark."""
from __future__ import annotations

import time

import numpy as np


def add_phase_timer(owner, name: str, totals: dict, phase: str,
                    active: set | None = None) -> None:
    """Replaces owner.<name> (a method or module function) by a wrapper that adds the seconds
    of each call to totals[phase] (totals: a dict of floats, or a defaultdict(float)).

    active: a set shared by timers of the same phase; a call made while its phase is already
    being timed (one timed method calling another) is not counted twice."""
    inner = getattr(owner, name)
    active = set() if active is None else active

    def timed(*args, **kwargs):
        if phase in active:
            return inner(*args, **kwargs)
        active.add(phase)
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - start
            active.discard(phase)
    setattr(owner, name, timed)


def round_sets(steps) -> dict:
    """Boolean masks over an engine's recorded rounds (EngineStats.steps rows: running,
    host s, wall s, exposed s, model steps, waiting), by load:

    - "at_max_running": the rounds with the most sequences running after scheduling;
    - "saturated": from the first such round on, the rounds after whose scheduling requests
      still waited: the engine at its capacity. Empty when nothing waited then.
    """
    steps = np.asarray(steps, float).reshape(-1, 6)
    if not len(steps):
        return {"at_max_running": np.zeros(0, bool), "saturated": np.zeros(0, bool)}
    at_max = steps[:, 0] >= steps[:, 0].max()
    after_fill = np.arange(len(steps)) >= np.argmax(at_max)
    return {"at_max_running": at_max, "saturated": after_fill & (steps[:, 5] > 0)}


def round_set_figures(steps, mask, name: str) -> dict:
    """Figures of the rounds `mask` picks out of EngineStats.steps rows (see `round_sets`),
    keyed `<figure>_<name>`: rounds, model steps, multi-step rounds, mean running, and wall
    and host seconds per model step (None without model steps)."""
    chosen = np.asarray(steps, float).reshape(-1, 6)[mask]
    model_steps = chosen[:, 4].sum()

    def per_step(column):
        return float(chosen[:, column].sum() / model_steps) if model_steps else None

    return {f"rounds_{name}": len(chosen), f"model_steps_{name}": int(model_steps),
            f"multi_step_rounds_{name}": int((chosen[:, 4] > 1).sum()),
            f"mean_running_{name}": float(chosen[:, 0].mean()) if len(chosen) else None,
            f"mean_step_s_{name}": per_step(2), f"host_s_per_step_{name}": per_step(1)}


def time_engine_phases(engine, per_step: list | None = None) -> dict:
    """Wraps the host phases of this engine (methods of its scheduler, input batch, runner and
    output processor: no module-wide patch) with timers; returns {phase: total seconds}, filled as the
    engine runs. Dispatch phases include whatever the device call blocks for. The wait for the
    device's tokens is not a phase: it is the engine's step time less its host time
    (EngineStats).

    per_step: if given, each engine.step() that records a round in engine.stats.steps (with
    record_steps on) appends {phase: seconds in that call} to it, so that per_step[i] goes with
    engine.stats.steps[i] when both start empty (phases at a given number of running
    sequences)."""
    totals = dict.fromkeys(["schedule", "rows + batch", "sampling arrays", "dispatch step",
                            "dispatch multi-step", "dispatch mixed round", "update computed",
                            "finish + append"], 0.0)

    active: set = set()

    def timed(owner, name, phase):
        add_phase_timer(owner, name, totals, phase, active)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.scheduler, "update_computed", "update computed")
    timed(engine.input_batch, "slots", "rows + batch")
    timed(engine.input_batch, "step_batch", "rows + batch")
    timed(engine.input_batch, "sampling_arrays", "sampling arrays")
    for name, phase in (("execute_and_sample", "dispatch step"),
                        ("execute_multi_step", "dispatch multi-step"),
                        ("execute_mixed_round", "dispatch mixed round")):
        if hasattr(engine.runner, name):
            timed(engine.runner, name, phase)
    timed(engine.output_processor, "append_step", "finish + append")  # a step's tokens, read
    timed(engine.output_processor, "append_round", "finish + append")  # a multi-step round's
    timed(engine.output_processor, "append", "finish + append")  # (rounds, speculation)
    if per_step is not None:
        inner_step = engine.step

        def step(*args, **kwargs):
            before, rounds = dict(totals), len(engine.stats.steps)
            try:
                return inner_step(*args, **kwargs)
            finally:
                if len(engine.stats.steps) > rounds:
                    per_step.append({k: totals[k] - before[k] for k in totals})
        engine.step = step
    return totals
