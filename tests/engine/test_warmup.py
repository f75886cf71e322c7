"""Start-up: `LLMEngine.warmup` compiles every program a run can reach, so a run after it
compiles nothing (engine/warmup.py lists the reachable steps)."""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import TINY_LLAMA31
from engine import llm_engine
from engine.compile_stats import compile_stats, count_compiles, report_serving_compiles
from engine.llm_engine import EngineConfig, LLMEngine
from engine.step_batch import bucket_key
from engine.request import SamplingParams
from engine.warmup import compile_all, compile_threads, program_label, split_first
from models.weights import random_model


def test_a_run_after_warmup_compiles_nothing():
    """Warm-up compiles ahead of time (engine/runner.py: lowered and compiled, not run), part
    of it in a background thread; the run's steps then find every program: jax's monitoring
    counts no compile request."""
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16))
    shapes = engine.warmup_programs()
    # a server's start: the programs the first requests reach, then the rest in a thread
    first, later = split_first(shapes, page_size=16, first_context=16)
    assert first and later and sorted(map(str, first + later)) == sorted(map(str, shapes))
    assert all(max(q) == 1 and w == 4 or max(q) > 1 and len(q) == 1 for q, w, _, _ in first)
    before = compile_stats()
    assert engine.warmup(programs=first) == len(first)  # one new program per step shape
    engine.compile_in_background(later).join()
    assert len(engine.runner.compiled_shapes) == len(shapes)
    assert (compile_stats() - before).programs >= len(shapes)
    compiled = set(engine.runner.compiled_shapes)
    before = compile_stats()
    # Mixed traffic: prompts from 1 to 40 tokens (chunked by the 32-token budget), decodes of
    # up to 4 sequences beside prefill chunks, sequences up to the 64-token context.
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 40, 7, 23, 33, 2, 15)]
    # Greedy, plainly sampled and top-p rows, some with logprobs (greedy ones too), some with
    # penalties: the sampler, logprobs and (from the background) penalties programs are warm.
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=[0.0, 0.8, 1.0][i % 3],
                             top_p=0.9 if i % 3 == 2 else 1.0, seed=i,
                             logprobs=3 if i % 2 else None,
                             repetition_penalty=1.3 if i % 4 == 2 else 1.0)
              for i, m in enumerate(rng.integers(1, 24, len(prompts)))]
    outs = engine.generate(prompts, params)
    assert [len(o.output_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.runner.compiled_shapes == compiled
    assert (compile_stats() - before).programs == 0  # the samplers' too (compiled ahead)
    assert all(len(o.outputs[0].logprobs) == len(o.output_ids)
               and len(o.outputs[0].logprobs[0][1]) == 3
               for o in outs[1::2])


def threads_of_each_compile(monkeypatch) -> list:
    """The thread counts the engine's compile_all calls are given from now on (filled as they
    come), the compiles still done."""
    seen = []
    real = llm_engine.compile_all

    def recording(compile_one, jobs, count, progress=None):
        seen.append(count)
        return real(compile_one, jobs, count, progress)

    monkeypatch.setattr(llm_engine, "compile_all", recording)
    return seen


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_warm_up_compiles_as_many_programs_at_once_as_the_config_says(monkeypatch, threads):
    """EngineConfig.compile_threads: how many programs warm-up compiles side by side (None: the
    host's cores, at most 16); every program is still compiled once. Below 1 it is refused."""
    seen = threads_of_each_compile(monkeypatch)
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, compile_threads=threads))
    programs = engine.warmup_programs()[:3]
    assert engine.warmup(programs=programs, samplers=False) == len(programs)
    assert seen == [threads or compile_threads()]
    with pytest.raises(ValueError, match="compile_threads must be an integer >= 1"):
        EngineConfig(compile_threads=0)


def test_the_background_compiles_beside_a_gpu_on_half_the_warmup_threads(monkeypatch):
    """`compile_in_background` compiles `background_threads` programs at once: one on the CPU
    (its cores run the steps), half of the warm-up's threads beside a GPU; a run then compiles
    nothing. A failure is logged, not raised into the thread."""
    seen = threads_of_each_compile(monkeypatch)
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16,
        compile_threads=4))
    assert engine.background_threads == 1
    engine.platform = "gpu"  # only the thread count follows it
    assert engine.background_threads == 2
    first, later = split_first(engine.warmup_programs(), page_size=16, first_context=16)
    engine.warmup(programs=first)
    lines = []
    engine.compile_in_background(later, log=lines.append).join()
    assert seen == [4, 2]
    jobs = len(later) + len(engine.runner.penalty_sampler_shapes())  # and penalties' samplers
    assert lines[0].startswith(f"compiling {jobs} more programs in the background, 2 at once")
    assert lines[-1].startswith(f"compiled {jobs} more programs in the background in")
    before = compile_stats()
    outs = engine.generate([[1, 2, 3], list(range(4, 50)), [7] * 20],
                           SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.8, seed=3))
    assert [len(o.output_ids) for o in outs] == [9, 9, 9]
    assert (compile_stats() - before).programs == 0

    def failing(*program):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(engine, "_compile_program", failing)
    lines.clear()
    engine.compile_in_background(later[:3], log=lines.append).join()
    assert lines[-1] == ("compiling in the background failed: RuntimeError: out of memory "
                         "while compiling")


def test_sampled_rounds_are_warm_too():
    """With multi-step and mixed rounds (a GPU's defaults) a round samples inside its program:
    warm-up also compiles the rounds of rows that sample (plain and with cuts), so sampled
    requests then compile nothing either. A server compiles before it listens only the program
    each near step usually runs (a decode step's greedy round, a prefill's single step)."""
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 6), None, EngineConfig(
        max_model_len=48, max_num_seqs=2, max_num_batched_tokens=16, page_size=16,
        num_decode_steps=4, async_scheduling=True))
    programs = engine.warmup_programs()
    greedy = engine.warmup_programs(sampled=False)
    assert set(map(str, greedy)) < set(map(str, programs))
    assert {p[3] for p in programs} - {p[3] for p in greedy} == {"plain", "cuts"}
    first, later = split_first(programs, page_size=16, first_context=16)
    assert {p[3] for p in first} == {"greedy", "step"}
    assert all((p[3] == "greedy") == (max(p[0]) == 1) for p in first)
    # the nearest later ones: the sampled rounds of the first decode steps
    nearest = [(q, w, v, mode) for mode in ("plain", "cuts")
               for q, w, v, p in first if p == "greedy"]
    assert sorted(map(str, later[:len(nearest)])) == sorted(map(str, nearest))
    engine.warmup(programs=first)
    engine.compile_in_background(later).join()
    before = compile_stats()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 30, 9, 17)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=t, top_p=p, seed=i)
              for i, (m, t, p) in enumerate(zip(rng.integers(6, 20, 4), (0.8, 1.0, 0.0, 0.7),
                                                (1.0, 0.9, 1.0, 1.0)))]
    outs = engine.generate(prompts, params)
    assert [len(o.output_ids) for o in outs] == [p.max_tokens for p in params]
    assert (compile_stats() - before).programs == 0


def test_warmup_on_a_mesh_compiles_what_a_run_reaches():
    """The sharded runner (a one-device mesh here) warms its steps, samplers, logprobs and
    the gathers that put logits in batch order too: sampled and logprob requests then compile
    nothing."""
    from engine.mesh import make_mesh
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=16),
        mesh=make_mesh(1, 1))
    assert engine.warmup() == len(engine.warmup_programs())
    compiled, before = set(engine.runner.compiled_shapes), compile_stats()
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.9, top_k=5, seed=1)]
    for prompts in ([[1, 2, 3], list(range(4, 30))], [[5, 6]]):
        outs = engine.generate(prompts, params[:len(prompts)])
        assert [len(o.output_ids) for o in outs] == [6, 5][:len(prompts)]
    assert engine.runner.compiled_shapes == compiled
    assert (compile_stats() - before).programs == 0


def test_threads_compile_under_the_callers_jax_settings():
    """Warm-up threads (and the background thread) compile under the caller's thread-local jax
    settings, which are part of a program's cache key: an engine warmed and run inside
    `jax.default_matmul_precision("highest")` then compiles nothing."""
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=16,
        compile_threads=2))
    with jax.default_matmul_precision("highest"):
        first, later = split_first(engine.warmup_programs(), page_size=16, first_context=16)
        engine.warmup(programs=first)
        engine.compile_in_background(later).join()
        before = compile_stats()
        outs = engine.generate([[1, 2, 3], list(range(4, 44))],
                               SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.output_ids) for o in outs] == [6, 6]
    assert (compile_stats() - before).programs == 0


@pytest.mark.parametrize("method", ["ngram", "ngram on a mesh", "draft"])
def test_speculative_rounds_after_warmup_compile_nothing(method):
    """A speculative engine's warm-up also compiles its rounds' acceptance, the gathers of the
    verified tokens' logits and the samplers of greedy rows, and a draft model's steps, its
    sampling and the placing of its distributions; every verification step (and a draft's
    catch-up) runs the program of k + 1 tokens a sequence, however few each row proposes
    (engine.step_batch.bucket_key's verify_len), and a draft catches up on a long prompt in
    chunks of the token budget: greedy and sampled rounds, some beside prompts, then compile
    nothing, by n-grams on one device and on a (one-device) mesh, and by a draft model."""
    from engine.mesh import make_mesh
    from engine.speculative import SpecConfig
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=16),
        spec_config=SpecConfig("draft" if method == "draft" else "ngram",
                               num_speculative_tokens=3),
        mesh=make_mesh(1, 1) if method == "ngram on a mesh" else None,
        draft=(cfg, random_model(cfg, 6)) if method == "draft" else None)
    engine.warmup()
    if method == "draft":
        assert engine.draft.runner.compiled_shapes
    before = compile_stats()
    rng = np.random.default_rng(3)
    # Repeated 6-grams: the n-gram proposer proposes 1 to 3 tokens a row. Requests end apart,
    # so prompts of up to 30 tokens are admitted beside speculating rows (such a step runs
    # without proposals: SpeculativeRounds.withdraw_proposals).
    prompts = [(rng.integers(0, 50, 6).tolist() * 8)[:n] for n in (12, 25, 30, 9, 18, 44, 14)]
    max_tokens = [5, 20, 30, 12, 25, 9, 17]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=[0.0, 0.8][i % 2],
                             seed=i) for i, m in enumerate(max_tokens)]
    outs = engine.generate(prompts, params)
    assert [len(o.output_ids) for o in outs] == max_tokens
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.drafted_per_position[0] > stats.drafted_per_position[-1]
    assert (compile_stats() - before).programs == 0


def test_verification_steps_pad_to_the_speculation_length():
    """A verification step's program holds k + 1 tokens a sequence whatever the longest row
    computes; a step with a longer row is keyed as a prefill step."""
    assert bucket_key(6, 3, 4, 2, 3, 8, 8, verify_len=5) == (32, 4, 4, 8, 4)
    assert bucket_key(13, 3, 4, 5, 3, 8, 8, verify_len=5) == (32, 4, 4, 8, 4)
    assert bucket_key(13, 3, 4, 6, 3, 8, 8, verify_len=5) == (16, 8, 8, 16, 4)
    assert bucket_key(13, 3, 4, 6, 3, 8, 8) == (16, 8, 8, 16, 4)


def test_block_table_widths_on_a_gpu_and_the_cpu():
    """On a GPU (and a TPU) steps pad their tables to FIXED_WIDTH_TOKENS' pages (one width for
    every context up to it) and wider ones to their power of two; the warm-up lists those
    widths only. On the CPU decode steps take their own bucket and prefill steps
    CPU_PREFILL_WIDTH_TOKENS' pages or their own bucket."""
    from engine.block_pool import BlockPool
    from engine.engine_config import resolve_engine_config
    from engine.step_batch import FIXED_WIDTH_TOKENS, table_widths
    from engine.warmup import reachable_steps
    floor = FIXED_WIDTH_TOKENS // 16
    assert table_widths(8192, 16, "gpu") == table_widths(8192, 16, "tpu") == (floor, floor)
    assert table_widths(40, 16, "gpu") == (40, 40)  # a short context: its own width
    assert table_widths(8192, 16, "cpu") == (1, 32) and table_widths(20, 16, "cpu") == (1, 20)
    # A decode step of 256 sequences: the floor, or the bucket of a wider table.
    assert bucket_key(256, 256, max(floor, 5), 1, 0, 256, 8192)[2] == floor
    assert bucket_key(256, 256, max(floor, 300), 1, 0, 256, 8192)[2] == 512
    # A prefill step pads to the floor on a GPU, not to the 128k context's 8192 pages.
    assert bucket_key(2048, 3, floor, 2000, 2, 256, floor)[2] == floor
    cfg = resolve_engine_config(EngineConfig(max_model_len=131072, num_pages=9000), 131072,
                                "gpu")
    pool = BlockPool(9000, 16, False)
    widths = {w for q_lens, w, _ in reachable_steps(cfg, pool, floor) if max(q_lens) == 1}
    assert widths == {floor << i for i in range(7)}  # 128 ... 8192
    widths = {w for q_lens, w, _ in reachable_steps(cfg, pool, floor, max_total_len=1152)
              if max(q_lens) == 1}
    assert widths == {floor}


def test_cpu_prefill_tables_follow_their_context_and_the_warm_up_lists_them(monkeypatch):
    """On the CPU a prefill step pads its table to CPU_PREFILL_WIDTH_TOKENS' pages or its own
    bucket, whichever is wider: the warm-up lists every such width (the first programs: the
    least), so prompts whose chunks see longer contexts compile nothing after it."""
    from engine import step_batch
    monkeypatch.setattr(step_batch, "CPU_PREFILL_WIDTH_TOKENS", 16)
    count_compiles()
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 7), None, EngineConfig(
        max_model_len=96, max_num_seqs=2, max_num_batched_tokens=16, page_size=4))
    assert (engine.runner.min_width, engine.runner.prefill_width) == (1, 4)
    programs = engine.warmup_programs(sampled=False)
    # 1: the least width (4 pages), then every wider bucket up to 96 tokens' 24 pages
    assert {w for q_lens, w, _, _ in programs if max(q_lens) > 1} == {1, 8, 16, 32}
    first, _ = split_first(programs, page_size=4, first_context=16)
    assert {w for q_lens, w, _, _ in first if max(q_lens) > 1} == {1}
    engine.warmup(programs=programs, samplers=False)
    before = compile_stats()
    rng = np.random.default_rng(10)
    # chunks of 16 tokens: the 70-token prompt's last chunk sees 70 tokens (18 pages -> 32)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 40, 70)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True,
                                                   temperature=0.0))
    assert [len(o.output_ids) for o in outs] == [6, 6, 6]
    assert {key[2] for key in engine.runner.compiled_shapes if key[3] > 1} >= {4, 32}
    assert (compile_stats() - before).programs == 0


def test_a_program_label_names_its_kind_and_size():
    assert program_label(([1] * 64, 8, False, "step")) == "step: 64 seqs, 64 tokens, 8 pages"
    assert (program_label(([5, 1, 1], 16, True, "plain+penalties"))
            == "plain+penalties round: 3 seqs, 7 tokens, 16 pages, verification")


def test_compile_all_runs_every_shape_once_and_raises_the_first_failure():
    """engine.warmup.compile_all: every shape compiled once, progress up to the total, threads
    or not, and each shape's seconds returned in the shapes' order; a failure is raised after
    the others ran (the first in the shapes' order)."""
    shapes = [([1] * n, 4, False) for n in range(1, 9)]
    for threads in (1, 3):
        seen, reports, names = [], [], set()

        def compile_one(q_lens, width, verification):
            names.add(threading.current_thread().name)
            seen.append(len(q_lens))
            time.sleep(0.01 * (len(q_lens) % 3))  # shapes 2, 5, 8 take longest

        seconds = compile_all(compile_one, shapes, threads,
                              lambda done, total: reports.append((done, total)))
        assert sorted(seen) == list(range(1, 9))
        assert len(seconds) == 8 and all(s >= 0.01 * (n % 3) for n, s in zip(range(1, 9), seconds))
        assert reports == [(i, 8) for i in range(1, 9)]
        assert (names == {threading.current_thread().name}) == (threads == 1)

        def failing(q_lens, width, verification):
            seen.append(len(q_lens))
            if len(q_lens) in (3, 6):
                raise ValueError(f"shape {len(q_lens)}")

        seen.clear()
        with pytest.raises(ValueError, match="shape 3"):
            compile_all(failing, shapes, threads)
        assert sorted(seen) == list(range(1, 9)) if threads > 1 else seen == [1, 2, 3]


def test_a_server_hears_of_compiles_on_its_serving_path_only():
    """After report_serving_compiles a compile on a step's thread is logged with its time; the
    ahead-of-time compile threads' (warm-up's pool, the background compile) are not."""
    lines = []
    x = jnp.arange(7, dtype=jnp.float32)
    report_serving_compiles(lines.append, min_seconds=0.0)
    try:
        jax.jit(lambda v: v * 3.5 + 0.25)(x).block_until_ready()  # this thread: reported
        assert len(lines) == 1 and lines[0].startswith(
            "a step compiled a program on the serving path in ")
        aside = threading.Thread(target=lambda: jax.jit(lambda v: v - 1.75)(x).block_until_ready(),
                                 name="compile-in-background")
        aside.start()
        aside.join()
        assert len(lines) == 1
    finally:
        report_serving_compiles(None)
    jax.jit(lambda v: v / 2.5)(x).block_until_ready()
    assert len(lines) == 1
