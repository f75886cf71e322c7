"""Which step programs a run can reach: the shapes `LLMEngine.warmup` compiles at start-up."""
from __future__ import annotations

from engine.step_batch import MIN_PAGE_BUCKET, MIN_TOKEN_BUCKET, bucket


def reachable_steps(cfg, pool, min_width: int, spec_config=None, num_seqs: int | None = None,
                    max_total_len: int | None = None, prompt_lens: list[int] | None = None
                    ) -> list[tuple[list[int], int, bool]]:
    """The steps (tokens of each sequence, block-table width, verification?) whose programs a
    run of an engine (a resolved EngineConfig cfg, BlockPool pool) can reach, for a runner whose
    steps pad their block tables to at least min_width pages (ModelRunner.min_width).

    Decode steps: every batch bucket up to num_seqs times every page-width bucket up to
    max_total_len from min_width's bucket on; with speculation, the
    same with k + 1 tokens per sequence. Prefill steps: every token bucket up to the step's
    token budget times every bucket of the number of prefilling sequences; or, given the
    `prompt_lens` of a run whose prompts all start at once, that first step only.
    """
    num_seqs = min(num_seqs or cfg.max_num_seqs, cfg.max_num_seqs)
    max_total_len = min(max_total_len or cfg.max_model_len, cfg.max_model_len)
    seq_buckets = sorted({bucket(n) for n in range(1, num_seqs + 1)})
    widths = sorted({bucket(pool.pages_needed(n), MIN_PAGE_BUCKET)
                     for n in range(1, max_total_len + 1, pool.page_size)})
    least = bucket(min(min_width, pool.pages_needed(max_total_len)), MIN_PAGE_BUCKET)
    widths = [w for w in widths if w >= least] or widths[-1:]
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
    for n in token_buckets:
        for p in seq_buckets:
            if 2 * p <= n:
                q_lens = [2] * p
                q_lens[0] = n - 2 * (p - 1)
                shapes.append((q_lens, 1, False))
    return shapes
