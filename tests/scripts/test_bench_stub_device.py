"""scripts/bench/stub_device.py: a dry run of a workload on the stub device finds the step
programs its real run reaches, each once, among those the engine could reach; once they are
compiled the real run compiles nothing, and gives the tokens of a run without the dry run."""
from __future__ import annotations

import numpy as np

from configs.model import TINY_LLAMA31
from engine.compile_stats import compile_stats, count_compiles
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.step_batch import padding_batch
from models.weights import random_model
from scripts.bench.stub_device import reached_programs

# rounds of 4 steps and mixed rounds, as a GPU's engine runs (single steps are the CPU's default)
ENGINE_CFG = EngineConfig(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
                          page_size=16, num_decode_steps=4)


def run(engine, prompts, lengths):
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in lengths]
    return [o.output_ids for o in engine.generate(prompts, params)]


def test_a_dry_run_finds_the_programs_the_run_reaches():
    count_compiles()
    cfg = TINY_LLAMA31
    model = random_model(cfg, 11)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 3, 28, 9)]
    lengths = rng.integers(2, 30, len(prompts))
    engine = LLMEngine(cfg, model, None, ENGINE_CFG)
    programs = reached_programs(engine, lambda: run(engine, prompts, lengths))
    assert engine.runner.compiled_shapes == set()  # the dry run compiled nothing
    kinds = {program for *_, program in programs}
    assert kinds == {"step", "greedy"}  # single steps and greedy rounds
    reachable = {program_key(engine, *p) for p in engine.warmup_programs(sampled=False)}
    keys = [program_key(engine, *p) for p in programs]
    assert len(set(keys)) == len(keys) and set(keys) < reachable
    assert engine.warmup(programs=programs, samplers=False) > 0
    compiled = set(engine.runner.compiled_shapes)
    before = compile_stats()
    got = run(engine, prompts, lengths)
    assert engine.runner.compiled_shapes == compiled
    assert (compile_stats() - before).programs == 0
    assert got == run(LLMEngine(cfg, model, None, ENGINE_CFG), prompts, lengths)


def program_key(engine, q_lens, width, verification, program):
    """(the runner's bucket of the step, program): one per compiled program."""
    return engine.runner.step_key(padding_batch(q_lens, width, verification)), program
