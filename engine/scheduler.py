"""The continuous-batching scheduler (plain Python; importing it must not import jax).

Counter model (vLLM v1): a request has its tokens and `num_computed_tokens`. Every step the
scheduler decides how many of each request's not-yet-computed tokens to compute, under two
budgets: `max_num_seqs` sequences and `max_num_batched_tokens` tokens. Running requests come
first (decodes, then unfinished prefill chunks), then waiting requests in priority / arrival
order. A prompt longer than the remaining budget is split across steps (chunked prefill), so
decodes never stall behind it. When pages run out, the youngest running request is preempted:
its pages are freed and its computed tokens dropped, to be recomputed (mostly from the prefix
cache) when it is admitted again.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from engine.block_pool import BlockPool
from engine.request import FinishReason, Request


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) and max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}), or a long prompt could never run")


@dataclasses.dataclass
class SchedulerOutput:
    """A step's schedule: one entry per scheduled row, in order, recorded as the scheduler
    walks its requests (so that the engine builds the step without another Python pass over
    them): (request, tokens computed this step, the step's first position (the request's
    computed tokens), its tokens in all (those in flight included), those in flight
    (Request.num_pending), the pages it holds).

    The entries' columns are lists, made once on first use (`requests`, `counts`, ...), and
    numpy arrays (`columns`, `held`): what changes after scheduling changes them (a speculative
    round's accepted tokens `counts`, a round's new pages `held`). For a speculating request a
    row's count is its last token plus request.lookahead proposed tokens.

    `released`: the requests whose pages were freed since the previous output (finished,
    aborted, or preempted, this step's preemptions included): the runner side's persistent
    rows give their slots back (engine/input_batch.py)."""

    entries: list[tuple[Request, int, int, int, int, int]]
    preempted: list[Request]
    num_admitted: int = 0  # waiting requests admitted this step (the last entries)
    released: list[Request] = dataclasses.field(default_factory=list)
    _lists: tuple | None = dataclasses.field(default=None, repr=False)
    _columns: tuple | None = dataclasses.field(default=None, repr=False)
    _held: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def _column(self, index: int) -> list:
        if self._lists is None:
            self._lists = tuple(map(list, zip(*self.entries))) or ([],) * 6
        return self._lists[index]

    @property
    def requests(self) -> list[Request]:
        """The scheduled requests, in order."""
        return self._column(0)

    @property
    def counts(self) -> list[int]:
        """Tokens each row computes this step."""
        return self._column(1)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int64 [S] arrays of the rows' counts, firsts, totals and pendings, converted once
        (numpy converts a list of Python ints element by element) and kept."""
        if self._columns is None:
            n = len(self.entries)
            self._columns = tuple(np.fromiter(self._column(i), np.int64, n) for i in range(1, 5))
        return self._columns

    def held(self) -> np.ndarray:
        """int64 [S]: the pages each row's request holds (kept; a round that gives rows pages
        updates it)."""
        if self._held is None:
            self._held = np.fromiter(self._column(5), np.int64, len(self.entries))
        return self._held


class Scheduler:
    """Decides each step's work and owns the request queues and their pages."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, order, request)
        self._order = itertools.count()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._released: list[Request] = []  # pages freed since the last output (its `released`)

    # ---- queues -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, request: Request) -> None:
        """Queues a request; rejects one whose prompt could never fit in the whole pool."""
        need = self.pool.pages_needed(request.num_tokens + 1)
        if need > self.pool.num_pages:
            raise ValueError(f"the prompt needs {need} KV-cache pages but the cache has only "
                             f"{self.pool.num_pages} in all: it can never run")
        heapq.heappush(self._waiting, (request.priority, next(self._order), request))

    def abort(self, request: Request) -> None:
        """Removes a request wherever it is and frees its pages at once."""
        if request in self.running:
            self.running.remove(request)
        else:
            self._waiting = [w for w in self._waiting if w[2] is not request]
            heapq.heapify(self._waiting)
        self._release(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (running, or preempted while its last token was in flight)."""
        request.finish_reason = reason
        self.abort(request)

    def _release(self, request: Request) -> None:
        """Frees a request's pages, first keying its full pages in the prefix cache (those of
        its known tokens: speculative or in-flight tokens may be computed but not appended)."""
        if request.pages:  # (cache_full_pages returns at once when no page is new)
            self.pool.cache_full_pages(request.tokens, request.pages,
                                       min(request.num_computed_tokens, request.num_tokens),
                                       request.num_cached_pages)
        self.pool.free(request.pages)
        request.pages = []
        request.num_cached_pages = 0
        self._released.append(request)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self, hold_limit: int | None = None) -> SchedulerOutput:
        """Chooses this step's requests and token counts, allocating their pages.

        hold_limit (asynchronous scheduling: the context limit): a request whose tokens in
        flight end it by length (max_tokens, or this many tokens) is skipped: it computes
        nothing more.
        """
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput([], [])
        entries, preempted = out.entries, out.preempted
        running = self.running
        page_size = self.pool.page_size
        # 1. Running requests, oldest first; preempt the youngest when pages run out (popped
        # from the end of `running`: the loop never reaches them).
        for request in running:
            if budget <= 0:
                break
            pending = request.num_pending
            num_tokens = len(request.prompt_ids) + len(request.output_ids) + pending
            # Request.length_room(hold_limit) <= pending, inlined: this loop runs for every
            # request at every step.
            if pending and hold_limit is not None and (
                    num_tokens >= request.token_limit or num_tokens >= hold_limit):
                continue  # its in-flight tokens end it: nothing more to compute
            # Tokens sampled on the device but not yet read (asynchronous scheduling) are
            # computed like known ones: the step reads their ids on the device.
            computed = request.num_computed_tokens
            num_new = num_tokens - computed
            if request.lookahead:  # speculation: room for the proposed tokens after the last
                request.lookahead = max(min(request.lookahead, budget - 1)
                                        if num_new == 1 else 0, 0)
                num_new += request.lookahead
            if num_new > budget:
                num_new = budget
            num_pages = len(request.pages)
            if computed + num_new > num_pages * page_size:  # pages to add
                if not self._grow_or_preempt(request, computed + num_new, preempted):
                    break  # the request itself was preempted: everything younger is gone too
                num_pages = len(request.pages)
            entries.append((request, num_new, computed, num_tokens, pending, num_pages))
            budget -= num_new
        # 2. Waiting requests, by priority then arrival, while budgets and pages allow.
        while (self._waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self._waiting[0][2]
            if request.num_pending:
                break  # preempted while a token was in flight: readmitted once it is read
            if request.wait_for is not None and not request.wait_for.prompt_cached:
                break  # a parallel sample waits until its sibling's prompt pages are cached
            if not self._admit(request, budget, out):
                break
            heapq.heappop(self._waiting)
            self.running.append(request)
            budget -= entries[-1][1]
            out.num_admitted += 1
        out.released, self._released = self._released, []
        return out

    def _grow_or_preempt(self, request: Request, num_tokens: int,
                         preempted: list[Request]) -> bool:
        """Gives a running request pages for num_tokens tokens, preempting the youngest running
        requests while the pool is short; False if the request itself had to be preempted."""
        while not self.pool.grow(request.pages, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        # At least one token must be computed to produce logits: never hit the whole sequence.
        cached = self.pool.cached_prefix(request.token_ids, request.num_tokens - 1)
        num_computed = len(cached) * self.pool.page_size
        num_new = min(request.num_tokens - num_computed, budget)
        if (num_new < request.num_tokens - num_computed
                and not self.config.enable_chunked_prefill):
            self.pool.free(cached)
            return False
        pages = list(cached)
        if not self.pool.grow(pages, num_computed + num_new):
            self.pool.free(cached)
            return False
        request.pages = pages
        request.num_computed_tokens = num_computed
        request.num_cached_pages = len(cached)
        request.num_prefix_hit_tokens += num_computed
        out.entries.append((request, num_new, num_computed, request.num_tokens, 0, len(pages)))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.num_draft_computed = 0
        request.lookahead = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (request.priority, -1 - self.num_preemptions, request))

    def update_computed(self, output: SchedulerOutput, completes=None, steps: int = 1) -> int:
        """Advances the counters of the computed tokens and caches the prompts' newly full
        pages; returns the tokens computed. The pages after the prompt are cached when the
        request releases them (`_release`: finished, aborted or preempted): only then can
        another request's prompt (the next turn of a conversation, or this request readmitted)
        reach them, and keying them page by page as decoding fills them cost a hash per page
        inside every step.

        completes (the engine's launched steps; one pass with the counters): a flag per
        scheduled row whose step token is its request's next one. Such a row computes
        steps - 1 tokens more (a multi-step round's decode steps) and leaves `steps` sampled
        tokens in flight (Request.num_pending, with its row as pending_row)."""
        extra = steps - 1
        counts = output.counts
        if completes is None:
            completes = [False] * len(counts)
        total = extra * sum(completes) + sum(counts)
        for row, (request, num_new, complete) in enumerate(zip(output.requests, counts,
                                                               completes)):
            if complete:
                num_new += extra
                request.num_pending += steps
                request.pending_row = row
            request.num_computed_tokens += num_new
            if not request.prompt_cached:
                self._cache_prompt(request)
        return total

    def _cache_prompt(self, request: Request) -> None:
        """Keys the newly full pages of a request's computed prompt tokens in the prefix cache
        (Request.prompt_cached once they are all computed)."""
        computed = request.num_computed_tokens
        num_prompt = len(request.prompt_ids)
        if computed >= num_prompt:
            request.prompt_cached = True
            computed = num_prompt
        if computed // self.pool.page_size > request.num_cached_pages:
            request.num_cached_pages = self.pool.cache_full_pages(
                request.prompt_ids, request.pages, computed, request.num_cached_pages)
