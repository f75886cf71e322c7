"""Host-side page allocator for the paged KV cache (plain Python; no jax).

Physical pages are numbered 0..num_pages-1. Requests own lists of pages; the block table row
of a request is its page list. The continuous-batching issue extends this pool with reference
counts and a prefix cache.
"""
from __future__ import annotations

import collections


class OutOfPagesError(RuntimeError):
    """Raised when the pool cannot satisfy an allocation."""


class BlockPool:
    """A free list of KV-cache pages."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = collections.deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free pages, or raises OutOfPagesError leaving the pool unchanged."""
        if count > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: need {count}, {len(self._free)} of {self.num_pages} free")
        return [self._free.popleft() for _ in range(count)]

    def grow(self, pages: list[int], num_tokens: int) -> None:
        """Appends pages to `pages` (a request's list) until it holds `num_tokens` tokens."""
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing > 0:
            pages.extend(self.allocate(missing))

    def free(self, pages: list[int]) -> None:
        """Returns pages to the pool."""
        self._free.extend(pages)
