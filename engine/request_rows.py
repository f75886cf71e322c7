"""Persistent host rows of the running requests: block tables and sampling rows (numpy; no jax).

Building a step's block tables from each request's page list costs a numpy row write per
request and step (about 1 us each: a quarter of a millisecond at 256 sequences). Instead every
running request owns a row ("slot") of one table that lives as long as the engine, and only the
pages a request gained since its last step are written there; a step's tables are one gather
of its requests' rows. The request's constant sampling parameters sit in the same slot, so a
step's sampling arrays are a gather too (vLLM keeps such a persistent input batch as well).

A slot is taken when a request is first scheduled and given back when its pages are released
(finish, abort, preemption: Scheduler._release): a request that comes back gets a fresh slot
and writes all its pages again. A row is zero past its request's pages (a released row is
cleared), so a step's gathered tables need no masking.
"""
from __future__ import annotations

import numpy as np

SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed")


class RequestRows:
    """Slots of running requests: page tables [capacity, width] and sampling rows."""

    def __init__(self, capacity: int, width: int):
        capacity, width = max(capacity, 1), max(width, 1)
        self.tables = np.zeros((capacity, width), np.int32)  # [slots, W] page ids
        self.num_pages = np.zeros(capacity, np.int32)  # [slots] pages written in each row
        # [slots, 5] float64 (exact for every column: seeds are below 2**53)
        self.sampling = np.zeros((capacity, len(SAMPLING_COLUMNS)), np.float64)
        self.logprobs = np.zeros(capacity, np.bool_)  # [slots] the request wants logprobs
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
        return slots

    def release(self, request) -> None:
        """Gives a request's slot back (its pages were freed)."""
        if request.slot >= 0:
            self.tables[request.slot, : self.num_pages[request.slot]] = 0
            self.num_pages[request.slot] = 0
            self._free.append(request.slot)
            request.slot = -1

    def _assign(self, request) -> int:
        if not self._free:
            self._grow(rows=self.capacity)
        slot = self._free.pop()
        request.slot = slot
        self.num_pages[slot] = 0
        self.sampling[slot] = request.sampling_row
        self.logprobs[slot] = request.params.logprobs is not None
        self.prompt_lens[slot] = len(request.prompt_ids)
        self.token_limits[slot] = len(request.prompt_ids) + request.params.max_tokens
        return slot

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        self.tables = np.pad(self.tables, ((0, rows), (0, columns)))
        if rows:
            self._free = list(range(self.capacity + rows - 1, self.capacity - 1, -1)) + self._free
            self.num_pages = np.pad(self.num_pages, (0, rows))
            self.sampling = np.pad(self.sampling, ((0, rows), (0, 0)))
            self.logprobs = np.pad(self.logprobs, (0, rows))
            self.prompt_lens = np.pad(self.prompt_lens, (0, rows))
            self.token_limits = np.pad(self.token_limits, (0, rows))
