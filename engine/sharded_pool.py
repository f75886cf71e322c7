"""KV-cache pages split over data-parallel shards (plain Python; no jax).

With data parallelism the device cache holds dp ranges of pages, one per data shard, and a
sequence's attention reads only its own shard's pages. `ShardedBlockPool` keeps one BlockPool per
shard behind the BlockPool interface the scheduler uses, with global page ids (shard d owns ids
[d * pages_per_shard, (d + 1) * pages_per_shard)), so every page of a sequence comes from one
shard:
  * a new sequence goes to the shard with the fewest pages in use (which balances memory and,
    roughly, sequences), or to a shard holding a longer cached prefix of its prompt when that
    shard uses at most the prefix's pages more than the least used one: a prefix every prompt
    shares (a chat template's system prompt) would otherwise draw every sequence to one shard
    and leave the others idle while it fills;
  * a growing sequence grows in the shard of its first page.
`num_pages` is the pages of one shard: the most one sequence can ever hold, which is what the
scheduler's and engine's fit checks need; `total_pages` counts all shards.
"""
from __future__ import annotations

from typing import Sequence

from engine.block_pool import BlockPool, page_hash


class ShardedBlockPool:
    """dp BlockPools with global page ids (see the module docstring)."""

    def __init__(self, num_shards: int, pages_per_shard: int, page_size: int,
                 enable_prefix_caching: bool = True):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.shards = [BlockPool(pages_per_shard, page_size, enable_prefix_caching)
                       for _ in range(num_shards)]
        self.num_shards = num_shards
        self.num_pages = pages_per_shard
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def total_pages(self) -> int:
        return self.num_pages * self.num_shards

    @property
    def num_free(self) -> int:
        return sum(s.num_free for s in self.shards)

    @property
    def num_used(self) -> int:
        return sum(s.num_used for s in self.shards)

    @property
    def ref_counts(self) -> list[int]:
        return [c for s in self.shards for c in s.ref_counts]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_queried_tokens, 1)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def shard_of(self, page: int) -> int:
        return page // self.num_pages

    def _least_used(self) -> int:
        return min(range(self.num_shards), key=lambda d: (self.shards[d].num_used, d))

    def _local(self, pages: Sequence[int], shard: int) -> list[int]:
        offset = shard * self.num_pages
        if any(self.shard_of(p) != shard for p in pages):
            raise RuntimeError(f"pages {list(pages)} span several data shards")
        return [p - offset for p in pages]

    # ---- the BlockPool interface -----------------------------------------------------------

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Appends pages of the sequence's shard (a new sequence: the least used shard)."""
        shard = self.shard_of(pages[0]) if pages else self._least_used()
        local = self._local(pages, shard)
        if not self.shards[shard].grow(local, num_tokens):
            return False
        offset = shard * self.num_pages
        pages.extend(p + offset for p in local[len(pages):])
        return True

    def grow_all(self, page_lists: list[list[int]], num_tokens) -> bool:
        """`grow` of each page list to its `num_tokens`, in order; False at the first that
        fails (BlockPool.grow_all)."""
        return all(self.grow(pages, n) for pages, n in zip(page_lists, num_tokens))

    def allocate(self, count: int) -> list[int]:
        """`count` free pages of the least used shard."""
        shard = self._least_used()
        return [p + shard * self.num_pages for p in self.shards[shard].allocate(count)]

    def free(self, pages: Sequence[int]) -> None:
        by_shard: dict[int, list[int]] = {}
        for p in pages:
            by_shard.setdefault(self.shard_of(p), []).append(p)
        for shard, group in by_shard.items():
            self.shards[shard].free(self._local(group, shard))

    def cached_prefix(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The longest cached prefix (referenced, in global page ids) on a shard whose pages in
        use exceed the least used shard's by at most the prefix's pages (see the module
        docstring); [] when that shard holds none (the sequence then starts on the least used
        shard)."""
        self.prefix_queried_tokens += max_tokens
        if not self.enable_prefix_caching:
            return []
        keys, parent = [], None
        for start in range(0, max_tokens - self.page_size + 1, self.page_size):
            parent = page_hash(parent, token_ids[start:start + self.page_size])
            keys.append(parent)

        def hit(shard: BlockPool) -> int:
            n = 0
            while n < len(keys) and keys[n] in shard._page_of_key:
                n += 1
            return n

        hits = [hit(shard) for shard in self.shards]
        used = [shard.num_used for shard in self.shards]
        # a shard's hit pays for at most that many more pages in use than the least used one's
        balanced = [d for d in range(self.num_shards) if used[d] <= min(used) + hits[d]]
        best = max(balanced, key=lambda d: (hits[d], -used[d], -d))
        if hits[best] == 0:
            return []
        pages = self.shards[best].cached_prefix(token_ids, max_tokens)
        self.prefix_hit_tokens += len(pages) * self.page_size
        return [p + best * self.num_pages for p in pages]

    def cache_full_pages(self, token_ids: Sequence[int], pages: Sequence[int],
                         num_computed: int, num_cached_pages: int) -> int:
        if not pages:
            return num_cached_pages
        shard = self.shard_of(pages[0])
        return self.shards[shard].cache_full_pages(token_ids, self._local(pages, shard),
                                                   num_computed, num_cached_pages)

    def check_invariants(self) -> None:
        for shard in self.shards:
            shard.check_invariants()
