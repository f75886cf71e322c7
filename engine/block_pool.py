"""Host-side page allocator with reference counts and a prefix cache (plain Python; no jax).

Physical pages are numbered 0..num_pages-1; a request's block-table row is its page list.

Prefix cache: a page that is full of a request's tokens is keyed by a hash chained over
(hash of the previous page, this page's token ids), so equal keys mean equal whole prefixes. A
new request reuses every cached page of its prompt's prefix (incrementing reference counts).
When its last user frees a page it joins the free list but keeps its key: it can still be hit
until it is handed out again. The free list is ordered least recently freed first, so the pages
evicted first are the least recently used.
"""
from __future__ import annotations

import collections
import itertools
from typing import Sequence

import numpy as np


class OutOfPagesError(RuntimeError):
    """Raised when the pool cannot satisfy an allocation."""


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full page, chained over its parent page's key (tokens: a
    list or a tuple of ids; tuple() of a tuple is the tuple itself)."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    """KV-cache pages: free list (LRU order), reference counts, prefix cache."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages))
        self._key_of_page: dict[int, int] = {}
        self._page_of_key: dict[int, int] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_queried_tokens, 1)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free pages (evicting their cache keys), or raises OutOfPagesError."""
        if count > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: need {count}, {len(self._free)} of {self.num_pages} free")
        free, key_of_page, refs = self._free, self._key_of_page, self.ref_counts
        pages = list(itertools.islice(free, count))  # the least recently freed
        for page in pages:
            del free[page]
            refs[page] = 1
        for page in key_of_page.keys() & pages:  # their prefix-cache keys go
            del self._page_of_key[key_of_page.pop(page)]
        return pages

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Appends pages to `pages` until it holds `num_tokens` tokens; False if out of pages."""
        if num_tokens <= len(pages) * self.page_size:  # the common case: room left
            return True
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing > len(self._free):
            return False
        if missing > 0:
            pages.extend(self.allocate(missing))
        return True

    def grow_all(self, page_lists: list[list[int]], num_tokens: Sequence[int]) -> bool:
        """`grow` of each page list to hold its `num_tokens` tokens, in order: False at the first
        the pool cannot satisfy (the pages given before it are kept). The pages all come from
        one `allocate` when the pool has them (a multi-step round grows about half of its
        sequences by a page, and one call per sequence cost more than the pages)."""
        held = np.fromiter(map(len, page_lists), np.int64, len(page_lists))  # [S]
        missing = np.maximum(-(-np.asarray(num_tokens, np.int64) // self.page_size) - held, 0)
        total = int(missing.sum())
        if total > len(self._free):
            return all(self.grow(pages, n) for pages, n in zip(page_lists, num_tokens))
        taken = self.allocate(total)
        start = 0
        for pages, end in zip(page_lists, np.cumsum(missing).tolist()):
            pages += taken[start:end]
            start = end
        return True

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; unreferenced pages join the free list.

        Pages are freed last-first, so a sequence's tail pages are evicted before its prefix.
        """
        refs, free = self.ref_counts, self._free
        for page in reversed(pages):
            count = refs[page] - 1
            refs[page] = count
            if count == 0:
                free[page] = None
            elif count < 0:
                raise RuntimeError(f"page {page} freed more often than it was referenced")

    # ---- prefix cache ---------------------------------------------------------------------------

    def cached_prefix(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Pages of the longest cached prefix of `token_ids` covering at most `max_tokens`.

        The pages are referenced (taken out of the free list if they were there); the caller
        owns one reference to each. Counts queried and hit tokens for the hit rate.
        """
        pages: list[int] = []
        if self.enable_prefix_caching:
            parent = None
            for start in range(0, max_tokens - self.page_size + 1, self.page_size):
                key = page_hash(parent, token_ids[start:start + self.page_size])
                page = self._page_of_key.get(key)
                if page is None:
                    break
                pages.append(page)
                parent = key
            for page in pages:
                if self.ref_counts[page] == 0:
                    del self._free[page]
                self.ref_counts[page] += 1
        self.prefix_queried_tokens += max_tokens
        self.prefix_hit_tokens += len(pages) * self.page_size
        return pages

    def cache_full_pages(self, token_ids: Sequence[int], pages: Sequence[int],
                         num_computed: int, num_cached_pages: int) -> int:
        """Registers the pages full of computed tokens from index `num_cached_pages` on.

        Returns the new count of registered pages of this sequence (pass it back next time).
        A page whose key is already cached under another page stays unregistered.
        """
        if not self.enable_prefix_caching:
            return num_computed // self.page_size
        size = self.page_size
        full = num_computed // size
        if full <= num_cached_pages:
            return num_cached_pages
        parent = None
        if num_cached_pages > 0:
            parent = self._key_of_page.get(pages[num_cached_pages - 1])
            if parent is None:  # the chain is broken (page owned elsewhere): recompute it
                parent = self._chain_key(token_ids, num_cached_pages)
        span = iter(token_ids[num_cached_pages * size:full * size])  # the new pages' tokens
        page_of_key, key_of_page = self._page_of_key, self._key_of_page
        # zip(*[span] * size): the span's consecutive pages, as tuples
        for page, tokens in zip(pages[num_cached_pages:full], zip(*[span] * size)):
            key = hash((parent, tokens))  # page_hash(parent, tokens), inlined (a tuple)
            if key not in page_of_key and page not in key_of_page:
                page_of_key[key] = page
                key_of_page[page] = key
            parent = key
        return full

    def _chain_key(self, token_ids: Sequence[int], num_pages: int) -> int | None:
        parent = None
        for i in range(num_pages):
            parent = page_hash(parent, token_ids[i * self.page_size:(i + 1) * self.page_size])
        return parent

    def check_invariants(self) -> None:
        """Raises AssertionError if counts, free list and cache disagree (for tests)."""
        for page, count in enumerate(self.ref_counts):
            assert count >= 0, f"page {page} has reference count {count}"
            assert (count == 0) == (page in self._free), f"page {page}: count {count}, free list"
        for key, page in self._page_of_key.items():
            assert self._key_of_page[page] == key
