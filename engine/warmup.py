"""Which step programs a run can reach: the programs `LLMEngine.warmup` compiles at start-up, and
which of them a server needs before it listens (`split_first`); the others it compiles in the
background once it listens (`LLMEngine.compile_in_background`).

A reachable step (`reachable_steps`: the tokens of each sequence, the block-table width,
verification?) has up to seven programs (`step_programs`): the single step ("step") and, with
multi-step rounds, its round for greedy rows and for each sampled mode ("greedy", "plain",
"cuts"), and the same for batches with penalized rows ("greedy+penalties", ...): a round
samples inside its program.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax

from engine.sampling import SAMPLED_MODES
from engine.step_batch import MIN_PAGE_BUCKET, MIN_TOKEN_BUCKET, bucket

# Before listening a server compiles the decode steps of contexts up to this many tokens (or its
# least table width) and the prefill steps of one prompt, each as the first requests run it
# (greedy): what they reach. Longer contexts, steps that prefill several prompts at once and the
# other programs of the first steps come later, nearest first.
FIRST_CONTEXT_TOKENS = 256
FIRST_PREFILL_SEQS = 1
STEP = "step"  # the single-step program of a step shape (its others: a round, by sampler mode)
PENALIZED = "+penalties"  # the suffix of a round program whose rows read the penalties' counts
# Programs compiled at once ahead of time: XLA compiles without holding Python's lock, so
# independent step programs compile side by side on a host's cores. On a 16-core H100 host 16
# threads compiled llama3.2-1b's 34 first programs in 27.9 s where 8 took 33.3 s
# (docs/PERFORMANCE.md, Start-up).
MAX_COMPILE_THREADS = 16


def compile_threads() -> int:
    """Threads that compile step programs at once on this host: its cores, at most
    MAX_COMPILE_THREADS."""
    return max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))


# jax's context managers that set a thread-local value which is part of a program's cache key.
THREAD_LOCAL_CONTEXTS = (("jax_default_matmul_precision", jax.default_matmul_precision),
                         ("jax_default_device", jax.default_device),
                         ("jax_numpy_dtype_promotion", jax.numpy_dtype_promotion),
                         ("jax_numpy_rank_promotion", jax.numpy_rank_promotion))


def in_callers_context(fn):
    """fn, to run on another thread under the calling thread's jax settings (a step called
    inside `with jax.default_matmul_precision(...)` looks up the program compiled with that
    precision, and a thread starts without the caller's context managers)."""
    values = [(enter, getattr(jax.config, name)) for name, enter in THREAD_LOCAL_CONTEXTS]

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for enter, value in values:
                stack.enter_context(enter(value))
            return fn(*args, **kwargs)

    return run


class CompileQueue:
    """Compiles programs one at a time on a daemon thread, in the order they are asked for:
    what a running engine asks for off its serving path (engine/multi_step.py's penalized
    rounds, each asked for once). log(line) hears each one compiled, or its failure (the
    thread goes on), by name(program)."""

    def __init__(self, compile_one, log=None, name=str):
        self._compile_one = in_callers_context(compile_one)
        self._log, self._name = log or (lambda line: None), name
        self._pending: list = []
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def ask(self, program: tuple) -> None:
        """Queues compile_one(*program); returns at once."""
        with self._changed:
            self._pending.append(program)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="compile-on-demand",
                                                daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending)
                program = self._pending[0]
            start = time.perf_counter()
            try:
                self._compile_one(*program)
                self._log(f"compiled {self._name(program)} in "
                          f"{time.perf_counter() - start:.1f}s")
            except Exception as e:  # the engine goes on running the step without it
                self._log(f"compiling {self._name(program)} failed: {type(e).__name__}: {e}")
            with self._changed:
                self._pending.pop(0)
                self._changed.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Waits until every program asked for so far is compiled; False on a timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout)


def compile_all(compile_one, shapes: list, threads: int, progress=None) -> list[float]:
    """compile_one(*shape) for every shape, `threads` at a time; progress(done, total) after
    each. Returns the seconds each shape took on its thread (tracing, lowering and compiling,
    slowed by the others beside it), in the shapes' order. On threads the first failure (in the
    shapes' order) is raised once the others finish; with one thread, in order on this thread,
    a failure stops the walk."""
    def timed(*shape) -> float:
        start = time.perf_counter()
        compile_one(*shape)
        return time.perf_counter() - start

    if threads <= 1 or len(shapes) <= 1:
        seconds = []
        for i, shape in enumerate(shapes):
            seconds.append(timed(*shape))
            if progress is not None:
                progress(i + 1, len(shapes))
        return seconds
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compile") as pool:
        compile_here = in_callers_context(timed)
        futures = [pool.submit(compile_here, *shape) for shape in shapes]
        for done, future in enumerate(as_completed(futures), start=1):
            future.exception()  # wait; failures are raised below, in the shapes' order
            if progress is not None:
                progress(done, len(shapes))
    return [future.result() for future in futures]


def program_label(program: tuple) -> str:
    """A step program of `step_programs` in words: 'greedy round: 64 seqs, 64 tokens, 8 pages'."""
    q_lens, width, verification, name = program
    kind = "step" if name == STEP else f"{name} round"
    return (f"{kind}: {len(q_lens)} seqs, {sum(q_lens)} tokens, {width} pages"
            + (", verification" if verification else ""))


def reachable_steps(cfg, pool, min_width: int, spec_config=None, num_seqs: int | None = None,
                    max_total_len: int | None = None, prompt_lens: list[int] | None = None,
                    prefill_width: int | None = None,
                    fixed_width: int | None = None,
                    count_prefill_seqs: bool = True) -> list[tuple[list[int], int, bool]]:
    """The steps (tokens of each sequence, block-table width, verification?) whose programs a
    run of an engine (a resolved EngineConfig cfg, BlockPool pool) can reach, for a runner whose
    steps pad their block tables to at least min_width pages (ModelRunner.min_width).

    Decode steps: every batch bucket up to num_seqs times every page-width bucket up to
    max_total_len from min_width's bucket on; with speculation, the
    same with k + 1 tokens per sequence. Prefill steps: every token bucket up to the step's
    token budget times every bucket of the number of prefilling sequences, at the runner's
    least prefill width (width 1) and, given prefill_width (a runner whose prefill tables widen
    with their context below the widest: the CPU's), at every wider width too (on a runner that sends
    its tables from the host, a TPU's or a mesh's, a prefill step with a context past
    FIXED_WIDTH_TOKENS compiles when first reached); or, given the
    `prompt_lens` of a run whose prompts all start at once, that first step only. Given
    fixed_width (a runner whose every step has one table width: tables on the device), every
    step has that width. Without count_prefill_seqs (a runner whose prefill programs are keyed
    by the token bucket alone, engine.step_batch.bucket_key), one prefill step per token bucket.
    """
    num_seqs = min(num_seqs or cfg.max_num_seqs, cfg.max_num_seqs)
    max_total_len = min(max_total_len or cfg.max_model_len, cfg.max_model_len)
    seq_buckets = sorted({bucket(n) for n in range(1, num_seqs + 1)})
    every_width = sorted({bucket(pool.pages_needed(n), MIN_PAGE_BUCKET)
                          for n in range(1, max_total_len + 1, pool.page_size)})

    def from_least(least: int) -> list[int]:  # the widths from least's bucket up
        least = bucket(min(least, pool.pages_needed(max_total_len)), MIN_PAGE_BUCKET)
        return [w for w in every_width if w >= least] or every_width[-1:]

    widths = [fixed_width] if fixed_width is not None else from_least(min_width)
    shapes = [([1] * s, w, False) for s in seq_buckets for w in widths]
    if spec_config is not None:
        k1 = spec_config.num_speculative_tokens + 1
        shapes += [([k1] * s, w, True) for s in seq_buckets
                   if s <= bucket(spec_config.max_batch) for w in widths]
    if prompt_lens is not None:
        budget = cfg.max_num_batched_tokens
        return shapes + [([min(n, budget) for n in prompt_lens], 1, False)]
    token_buckets = sorted({bucket(n, MIN_TOKEN_BUCKET)
                            for n in range(2, cfg.max_num_batched_tokens + 1)})
    prefill_widths = ([fixed_width] if fixed_width is not None else
                      [1] if prefill_width is None else [1] + from_least(prefill_width)[1:])
    prefill_seqs = seq_buckets if count_prefill_seqs else [1]
    for n in token_buckets:
        for p in prefill_seqs:
            if 2 * p <= n:
                q_lens = [2] * p
                q_lens[0] = n - 2 * (p - 1)
                shapes += [(q_lens, w, False) for w in prefill_widths]
    return shapes


def has_round(q_lens: list[int], verification: bool, num_steps: int, mixed_rounds: bool) -> bool:
    """Whether a step of this shape also runs as a round: a decode step as a multi-step round,
    a step with prefill chunks as a mixed round (engine/multi_step.py)."""
    return num_steps > 1 and not verification and (max(q_lens) == 1 or mixed_rounds)


def round_program(mode: str, penalized: bool) -> str:
    """The name of the round program of rows that sample in `mode`, with penalties or not."""
    return mode + (PENALIZED if penalized else "")


def step_programs(steps: list[tuple[list[int], int, bool]], num_steps: int, mixed_rounds: bool,
                  sampled: bool = True,
                  penalized: bool = False) -> list[tuple[list[int], int, bool, str]]:
    """The programs of `reachable_steps`' steps, (q_lens, width, verification, program): each
    step's single step (STEP), then, where it has a round, the round of greedy rows and, with
    `sampled`, the rounds of rows that sample (SAMPLED_MODES); with `penalized`, those
    rounds again for batches with penalized rows."""
    modes = ("greedy",) + (SAMPLED_MODES if sampled else ())
    modes += tuple(round_program(mode, True) for mode in modes) if penalized else ()
    return [(q_lens, width, verification, STEP) for q_lens, width, verification in steps] + [
        (q_lens, width, verification, mode) for mode in modes
        for q_lens, width, verification in steps
        if has_round(q_lens, verification, num_steps, mixed_rounds)]


def split_first(programs: list[tuple[list[int], int, bool, str]], page_size: int,
                first_context: int = FIRST_CONTEXT_TOKENS,
                first_prefill_seqs: int = FIRST_PREFILL_SEQS) -> tuple[list, list]:
    """(first, later) of `step_programs`: first (in their order) the program that the first
    requests run each near step with, greedy: decode steps whose block tables are at most the
    widest of the least width and first_context tokens' pages, as their multi-step round if
    they have one (else the single step), verification steps, and the single steps that
    prefill at most first_prefill_seqs prompts at the least prefill width (a mixed round needs
    more than half the sequence slots busy). Later the rest, nearest first (by how many times
    wider, or how many more prompts), and at each distance the usual program first, then its
    rounds of rows that sample, then the rare ones (single decode steps beside rounds, mixed
    rounds)."""
    least = min((w for q_lens, w, verification, _ in programs
                 if max(q_lens) == 1 or verification), default=1)
    least_prefill = min((w for q_lens, w, verification, _ in programs
                         if max(q_lens) > 1 and not verification), default=1)
    widest_first = max(least, bucket(-(-first_context // page_size), MIN_PAGE_BUCKET))
    rounds = {(tuple(q_lens), w) for q_lens, w, _, program in programs if program == "greedy"}

    def place(program):  # (how far past the first ones, 0 usual / 1 sampled usual / 2 rare)
        q_lens, width, verification, kind = program
        if max(q_lens) > 1 and not verification:
            far, usual = max(len(q_lens) / first_prefill_seqs, width / least_prefill), STEP
        else:
            far = width / widest_first
            usual = "greedy" if (tuple(q_lens), width) in rounds else STEP
        sampled_usual = usual == "greedy" and kind in SAMPLED_MODES
        return far, 0 if kind == usual else 1 if sampled_usual else 2

    first, later = [], []
    for program in programs:
        far, rank = place(program)
        (first if far <= 1 and rank == 0 else later).append(program)
    return first, sorted(later, key=place)


def compile_program(runner, q_lens: list[int], width: int, verification: bool, program: str,
                    num_steps: int = 1) -> None:
    """Compiles one of `step_programs` on `runner`: the single step, or the step's round of
    num_steps steps (a multi-step round for a decode step, else a mixed round) whose rows
    sample in the mode that `program` names (`round_program`)."""
    if program == STEP:
        runner.warmup(q_lens, width, verification)
        return
    mode, penalized = program.removesuffix(PENALIZED), program.endswith(PENALIZED)
    if max(q_lens) == 1:
        runner.warmup_multi_step(len(q_lens), width, num_steps, mode, penalized)
    else:
        runner.warmup_mixed_round(q_lens, width, num_steps, mode, penalized)


def compile_step(runner, q_lens: list[int], width: int, verification: bool,
                 num_steps: int = 1, mixed_rounds: bool = False) -> None:
    """Compiles every greedy program of one reachable step on `runner` (`step_programs`)."""
    for program in step_programs([(q_lens, width, verification)], num_steps, mixed_rounds,
                                 sampled=False):
        compile_program(runner, *program, num_steps)
