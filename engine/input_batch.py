"""The runner side's persistent input batch: the running requests' block tables, sampling rows
and length limits in numpy, kept across steps, and the step inputs built from them.

Building a step's block tables from each request's page list costs a numpy row write per
request and step. Instead every running request owns a row ("slot") of tables that live as long
as the engine, only the pages a request gained since its last step are written there, and a
step's tables and sampling arrays are gathers of its requests' rows (vLLM's worker keeps such a
persistent input batch too). The scheduler never sees these rows: it reports which requests
released their pages (`SchedulerOutput.released`: finished, aborted, preempted) and each
scheduled row's counters, and `update` / `prepare` bring the rows up to date from that.

A slot is taken when a request is first prepared and given back when its release is reported:
a request that comes back gets a fresh slot and writes all its pages again. A row is zero past
its request's pages (a released row is cleared), so a step's gathered tables need no masking.
A penalized request's slot is also its row of the penalties' count table on the device
(engine/penalty_counts.py): its prompt and outputs are written there when it takes the slot.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from engine.request import MAX_LOGPROBS, Request
from engine.step_batch import StepBatch, step_batch_from_arrays
from engine.sampling import PenaltyRows, SamplingArrays, draw_steps
from engine.scheduler import SchedulerOutput

SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed")


@dataclasses.dataclass
class PreparedStep:
    """A scheduled step's inputs, ready for the runner."""

    requests: list[Request]  # one per row
    # completes[i]: row i's last token this step is its request's next one (its sample is a new
    # token), not a prefill chunk short of the prompt's end.
    completes: list[bool]
    slots: np.ndarray  # int32 [S]: each row's slot in the persistent rows
    batch: StepBatch
    # int32 [N]: where a token's id is still in flight, its row in the previous step's samples
    # (-1: the host's id); None when the host has every id.
    sample_index: np.ndarray | None
    arrays: SamplingArrays
    num_from_device: int = 0  # tokens read from the previous step's samples


class InputBatch:
    """Slots of running requests: page tables [capacity, width], sampling rows, length limits."""

    def __init__(self, capacity: int, width: int, page_size: int):
        capacity, width = max(capacity, 1), max(width, 1)
        self.page_size = page_size
        self.tables = np.zeros((capacity, width), np.int32)  # [slots, W] page ids
        self.num_pages = np.zeros(capacity, np.int32)  # [slots] pages written in each row
        # [slots] a count of each row's changes: a runner that keeps the tables on the device
        # (engine/device_tables.py) rewrites only rows whose version it has not seen
        self.versions = np.zeros(capacity, np.int64)
        # [slots, 5] float64 (exact for every column: seeds are below 2**53)
        self.sampling = np.zeros((capacity, len(SAMPLING_COLUMNS)), np.float64)
        self.logprobs = np.zeros(capacity, np.bool_)  # [slots] the request wants logprobs
        self.penalized = np.zeros(capacity, np.bool_)  # [slots] the request has penalties
        # [slots, 3] repetition, presence, frequency
        self.penalty_strengths = np.zeros((capacity, 3), np.float32)
        # (slot, request) of penalized requests that took their slot since the last step's
        # sampling arrays: their histories go to the count table before that step samples
        self._new_histories: list[tuple[int, Request]] = []
        # [slots] prompt tokens, and prompt + max_tokens (where it ends by length)
        self.prompt_lens = np.zeros(capacity, np.int64)
        self.token_limits = np.zeros(capacity, np.int64)
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest first

    @property
    def capacity(self) -> int:
        return len(self.num_pages)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    # ---- keeping the rows up to date ---------------------------------------------------------

    def update(self, output: SchedulerOutput) -> None:
        """Gives back the slots of the requests whose pages the scheduler released since its
        previous output (the rows of the scheduled ones are written by `slots`)."""
        for request in output.released:
            self.release(request)

    def release(self, request: Request) -> None:
        """Gives a request's slot back (its pages were freed)."""
        if request.slot >= 0:
            self.tables[request.slot, : self.num_pages[request.slot]] = 0
            self.num_pages[request.slot] = 0
            self.versions[request.slot] += 1
            self._free.append(request.slot)
            request.slot = -1

    def slots(self, requests, num_pages: np.ndarray | None = None) -> np.ndarray:
        """int32 [S]: each request's slot, its row brought up to date with its pages (the
        pages gained since its last write, all rows at once in one scatter). num_pages [S]:
        len(r.pages) of each request, when the caller has them (the scheduler records them,
        SchedulerOutput.held), so that the rows left as they were cost no Python."""
        slots = np.fromiter([r.slot for r in requests], np.int32, len(requests))  # [S]
        for i in np.flatnonzero(slots < 0).tolist():  # requests scheduled for the first time
            slots[i] = self._assign(requests[i])
        if num_pages is None:
            counts = np.fromiter([len(r.pages) for r in requests], np.int32, len(requests))
        else:
            counts = num_pages.astype(np.int32)  # [S]
        written = self.num_pages[slots]  # [S]
        changed = np.flatnonzero(counts != written)  # [C]
        if not len(changed):
            return slots
        widest = int(counts.max())
        if widest > self.tables.shape[1]:
            self._grow(columns=max(widest, 2 * self.tables.shape[1]) - self.tables.shape[1])
        ends, starts, rows = counts[changed], written[changed], slots[changed]  # [C] each
        lost = ends < starts  # rows that lost pages: cleared, then written again whole
        for slot, start in zip(rows[lost].tolist(), starts[lost].tolist()):
            self.tables[slot, :start] = 0
        starts[lost] = 0
        # The new pages of every changed row, one scatter: [sum(ends - starts)] each.
        new = ends - starts
        at = np.repeat(np.cumsum(new) - new - starts, new)
        cols = np.arange(len(at)) - at
        pages = []
        for i, start, end in zip(changed.tolist(), starts.tolist(), ends.tolist()):
            pages += requests[i].pages[start:end]
        self.tables[np.repeat(rows, new), cols] = pages
        self.num_pages[rows] = ends
        self.versions[rows] += 1
        return slots

    def _assign(self, request: Request) -> int:
        if not self._free:
            self._grow(rows=self.capacity)
        slot = self._free.pop()
        request.slot = slot
        self.num_pages[slot] = 0
        self.sampling[slot] = request.sampling_row
        self.logprobs[slot] = request.params.logprobs is not None
        params = request.params
        self.penalized[slot] = params.uses_penalties
        self.penalty_strengths[slot] = (params.repetition_penalty, params.presence_penalty,
                                        params.frequency_penalty)
        if params.uses_penalties:
            self._new_histories.append((slot, request))
        self.prompt_lens[slot] = len(request.prompt_ids)
        self.token_limits[slot] = len(request.prompt_ids) + request.params.max_tokens
        return slot

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        self.tables = np.pad(self.tables, ((0, rows), (0, columns)))
        if rows:
            self._free = list(range(self.capacity + rows - 1, self.capacity - 1, -1)) + self._free
            self.num_pages = np.pad(self.num_pages, (0, rows))
            self.versions = np.pad(self.versions, (0, rows))
            self.sampling = np.pad(self.sampling, ((0, rows), (0, 0)))
            self.logprobs = np.pad(self.logprobs, (0, rows))
            self.penalized = np.pad(self.penalized, (0, rows))
            self.penalty_strengths = np.pad(self.penalty_strengths, ((0, rows), (0, 0)))
            self.prompt_lens = np.pad(self.prompt_lens, (0, rows))
            self.token_limits = np.pad(self.token_limits, (0, rows))

    # ---- step inputs -------------------------------------------------------------------------

    def prepare(self, output: SchedulerOutput) -> PreparedStep:
        """The inputs of a scheduled step of any kind (prefill chunks and decodes mixed)."""
        requests = output.requests
        # Per row, as the scheduler recorded them (no Python pass over the rows): tokens
        # computed this step, first position, tokens in all and in flight.
        counts, firsts, totals, pendings = output.columns()  # [S] each
        knowns = totals - pendings  # [S] tokens the host has
        ends = firsts + counts
        completes = (ends >= totals).tolist()
        # A row whose last token is in flight reads it from the previous step's samples (a
        # placeholder 0 here); the rest of its tokens, and every token of the other rows, the
        # host has: written row by row for the rows with such tokens only (prompts, mostly).
        in_flight = np.flatnonzero(ends > knowns)  # [F]
        starts = np.zeros(len(requests) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        num_tokens = int(starts[-1])
        tokens = np.zeros(num_tokens, np.int32)  # [N]
        upto = np.minimum(ends, knowns)
        for i in np.flatnonzero(upto > firsts).tolist():
            first, last = int(firsts[i]), int(upto[i])
            tokens[starts[i]:starts[i] + last - first] = requests[i].tokens_between(first, last)
        placeholders = starts[1:][in_flight] - 1
        sources = [requests[i].pending_row for i in in_flight.tolist()]
        slots = self.slots(requests, output.held())  # [S]
        return PreparedStep(requests, completes, slots,
                            self.step_batch(slots, tokens, counts, firsts),
                            _sample_index(num_tokens, placeholders, sources),
                            self.sampling_arrays(requests, slots, np.asarray(completes)),
                            len(placeholders))

    def prepare_decode(self, output: SchedulerOutput) -> PreparedStep:
        """The inputs of a step in which every scheduled row decodes one token: the row's
        newest token, in flight (read on the device from the previous step: a placeholder 0
        here) or the request's last known one."""
        requests = output.requests
        pendings = output.columns()[3]  # [S]
        if pendings.all():  # asynchronous scheduling: every row
            tokens = np.zeros(len(requests), np.int32)
            placeholders = np.arange(len(requests))
            sources = [r.pending_row for r in requests]
        else:
            tokens = [0 if pending else r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
                      for r, pending in zip(requests, pendings.tolist())]
            placeholders = np.flatnonzero(pendings).tolist()
            sources = [requests[i].pending_row for i in placeholders]
        slots = self.slots(requests, output.held())
        batch = self.step_batch(slots, tokens, np.ones(len(requests), np.int32),
                                 output.columns()[1])
        return PreparedStep(requests, [True] * len(requests), slots, batch,
                            _sample_index(len(requests), placeholders, sources),
                            self.sampling_arrays(requests, slots, np.ones(len(requests), bool)),
                            len(placeholders))

    def may_end(self, slots: np.ndarray, totals: np.ndarray, steps: int,
                context_limit: int) -> np.ndarray:
        """bool [S]: the rows at `slots`, holding `totals` tokens before a launch of `steps`
        model steps, whose new tokens may end them by length (max_tokens or the context) or
        are their first."""
        limits = np.minimum(self.token_limits[slots], context_limit)
        return (totals + steps >= limits) | (totals == self.prompt_lens[slots])

    def step_batch(self, slots: np.ndarray, tokens, counts, firsts) -> StepBatch:
        """The StepBatch of rows `slots` computing `counts` tokens each from positions
        `firsts` (tokens: all rows' token ids, concatenated)."""
        num_pages = self.num_pages[slots]  # [S]
        batch = step_batch_from_arrays(
            np.asarray(tokens, np.int32), np.asarray(counts, np.int32),
            np.asarray(firsts, np.int32), self.tables[slots, : max(int(num_pages.max()), 1)],
            num_pages, self.page_size)
        batch.slots, batch.table_versions = slots, self.versions[slots]
        return batch

    def sampling_arrays(self, requests: list[Request], slots: np.ndarray,
                        completes: np.ndarray) -> SamplingArrays:
        """A step's sampling arrays, gathered from the rows at `slots`; with penalties, where
        each row's counts live (completes bool [S]: the row draws its request's next token,
        which the count table then counts) and the histories new slots need written."""
        table = self.sampling[slots]  # [S, 5]
        sampled = (table[:, 0] > 0).any()  # greedy rows need no step index
        arrays = SamplingArrays.from_rows(table, draw_steps(requests) if sampled
                                          else np.zeros(len(requests), np.int32))
        if self.logprobs[slots].any():
            arrays.num_logprobs = MAX_LOGPROBS
        penalized = self.penalized[slots]  # [S]
        if penalized.any():
            histories = [(slot, r.prompt_ids, list(r.output_ids))
                         for slot, r in self._new_histories]
            self._new_histories = []
            arrays.penalties = PenaltyRows(slots.astype(np.int32), completes & penalized,
                                           self.penalty_strengths[slots].T.copy(), histories)
        return arrays


def _sample_index(num_tokens: int, placeholders, sources: list[int]) -> np.ndarray | None:
    """int32 [num_tokens]: for the tokens at `placeholders` (indices), whose ids are still in
    flight, their rows `sources` in the in-flight step's samples; -1 for the host's ids. None
    when every id is on the host."""
    if len(placeholders) == 0:
        return None
    sample_index = np.full(num_tokens, -1, np.int32)
    sample_index[placeholders] = sources
    return sample_index
