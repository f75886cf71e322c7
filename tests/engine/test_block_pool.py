"""engine.block_pool.BlockPool against an independent model, plus targeted cases.

The model keys cached pages by the whole token prefix they end (a tuple), not by chained hashes,
keeps the free list as a plain Python list in least-recently-freed order, and records what each
page holds, so a prefix-cache hit can be checked to return pages holding exactly that prefix.
Pure Python: no jax.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_pool import BlockPool, OutOfPagesError, page_hash

PS = 4  # page size of the model-based tests
# Prompts are a prefix of one of these plus a short random tail, so that prefixes are shared
# often (the first two agree on their first two pages) and duplicates are computed.
BASES = ([0, 1, 2, 3] * 6, [0, 1, 2, 3, 0, 1, 2, 3] + [2] * 16, [3, 2, 1, 0] * 6)
prompts = st.builds(lambda base, n, tail: BASES[base][:n] + tail, st.integers(0, 2),
                    st.integers(PS, 6 * PS), st.lists(st.integers(0, 3), max_size=PS + 1)
                    ).filter(bool)


class PoolModel:
    """What BlockPool should do, written as plainly as possible."""

    def __init__(self, num_pages: int, page_size: int, caching: bool = True):
        self.page_size, self.caching = page_size, caching
        self.refs = [0] * num_pages
        self.free = list(range(num_pages))  # least recently freed first
        self.page_of_prefix: dict[tuple, int] = {}
        self.prefix_of_page: dict[int, tuple] = {}
        self.queried = self.hit = 0

    def allocate(self, count: int) -> list[int]:
        pages, self.free = self.free[:count], self.free[count:]
        for p in pages:
            self.page_of_prefix.pop(self.prefix_of_page.pop(p, None), None)
            self.refs[p] = 1
        return pages

    def free_pages(self, pages) -> None:
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def cached_prefix(self, tokens, max_tokens) -> list[int]:
        pages = []
        while self.caching and (len(pages) + 1) * self.page_size <= max_tokens:
            page = self.page_of_prefix.get(tuple(tokens[:(len(pages) + 1) * self.page_size]))
            if page is None:
                break
            pages.append(page)
        for p in pages:
            if self.refs[p] == 0:
                self.free.remove(p)
            self.refs[p] += 1
        self.queried += max_tokens
        self.hit += len(pages) * self.page_size
        return pages

    def cache_full_pages(self, tokens, pages, num_computed, num_cached) -> int:
        full = num_computed // self.page_size
        if not self.caching:
            return full
        for i in range(num_cached, full):
            prefix = tuple(tokens[:(i + 1) * self.page_size])
            if prefix not in self.page_of_prefix and pages[i] not in self.prefix_of_page:
                self.page_of_prefix[prefix] = pages[i]
                self.prefix_of_page[pages[i]] = prefix
        return max(full, num_cached)


def snapshot(pool: BlockPool):
    """Everything a failed call must leave as it was."""
    return (list(pool.ref_counts), list(pool._free), dict(pool._key_of_page),
            dict(pool._page_of_key), pool.prefix_queried_tokens, pool.prefix_hit_tokens)


class BlockPoolMachine(RuleBasedStateMachine):
    """Sequences are admitted (prefix hits + new pages), grow, get freed; raw allocations and
    frees interleave."""

    @initialize(num_pages=st.integers(1, 12), caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_pages, caching):
        self.pool = BlockPool(num_pages, PS, enable_prefix_caching=caching)
        self.model = PoolModel(num_pages, PS, caching)
        self.seqs = []  # dicts: tokens, pages, num_cached (computed == all tokens)
        self.raw = []  # page lists from raw allocate
        self.holds = {}  # page -> the token prefix written into it (None: unknown data)

    # ---- helpers ----------------------------------------------------------------------------

    def _allocate(self, count):
        """allocate(), compared with the model; on OutOfPages the pool is unchanged."""
        before = snapshot(self.pool)
        if count > self.pool.num_free:
            with pytest.raises(OutOfPagesError):
                self.pool.allocate(count)
            assert snapshot(self.pool) == before
            return None
        referenced = {p for p, c in enumerate(self.model.refs) if c}
        pages = self.pool.allocate(count)
        assert pages == self.model.allocate(count)
        assert not referenced & set(pages), "a referenced page was handed out again"
        assert len(set(pages)) == len(pages)
        for p in pages:
            self.holds[p] = None
        return pages

    def _write(self, seq, start):
        """The sequence computes its tokens from `start` on: its pages now hold its prefixes."""
        tokens, pages = seq["tokens"], seq["pages"]
        for i in range(start // PS, len(pages)):
            self.holds[pages[i]] = tuple(tokens[:min((i + 1) * PS, len(tokens))])
        got = self.pool.cache_full_pages(tokens, pages, len(tokens), seq["num_cached"])
        assert got == self.model.cache_full_pages(tokens, pages, len(tokens), seq["num_cached"])
        seq["num_cached"] = got

    # ---- rules ------------------------------------------------------------------------------

    @rule(tokens=prompts)
    def admit(self, tokens):
        hits = self.pool.cached_prefix(tokens, len(tokens) - 1)
        assert hits == self.model.cached_prefix(tokens, len(tokens) - 1)
        for i, p in enumerate(hits):  # a hit page holds exactly the same whole prefix
            assert self.holds[p] == tuple(tokens[:(i + 1) * PS]), (i, p)
        new = self._allocate(self.pool.pages_needed(len(tokens)) - len(hits))
        if new is None:
            self.pool.free(hits)
            self.model.free_pages(hits)
            return
        seq = dict(tokens=list(tokens), pages=hits + new, num_cached=len(hits))
        self.seqs.append(seq)
        self._write(seq, len(hits) * PS)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), more=st.lists(st.integers(0, 3), min_size=1, max_size=2 * PS))
    def extend(self, i, more):
        seq = self.seqs[i % len(self.seqs)]
        start = len(seq["tokens"])
        missing = self.pool.pages_needed(start + len(more)) - len(seq["pages"])
        before = snapshot(self.pool)
        grown = list(seq["pages"])
        ok = self.pool.grow(grown, start + len(more))
        if not ok:
            assert missing > self.pool.num_free and snapshot(self.pool) == before
            assert grown == seq["pages"]
            return
        assert grown[:len(seq["pages"])] == seq["pages"]
        new = grown[len(seq["pages"]):]
        assert new == self.model.allocate(max(missing, 0))
        for p in new:
            self.holds[p] = None
        seq["pages"] = grown
        seq["tokens"] += more
        self._write(seq, start)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free_sequence(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.pool.free(seq["pages"])
        self.model.free_pages(seq["pages"])

    @rule(count=st.integers(0, 4))
    def raw_allocate(self, count):
        pages = self._allocate(count)
        if pages:
            self.raw.append(pages)

    @precondition(lambda self: self.raw)
    @rule(i=st.integers(0, 99))
    def raw_free(self, i):
        pages = self.raw.pop(i % len(self.raw))
        self.pool.free(pages)
        self.model.free_pages(pages)

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self):
        pool, model = self.pool, self.model
        pool.check_invariants()
        held = [p for s in self.seqs for p in s["pages"]] + [p for r in self.raw for p in r]
        assert pool.ref_counts == model.refs == [held.count(p) for p in range(pool.num_pages)]
        assert list(pool._free) == model.free
        assert pool.num_free == len(model.free) == pool.num_pages - pool.num_used
        assert pool.prefix_queried_tokens == model.queried
        assert pool.prefix_hit_tokens == model.hit
        assert set(pool._key_of_page) == set(model.prefix_of_page)
        for page, prefix in model.prefix_of_page.items():  # registered pages hold their prefix
            assert self.holds[page] == prefix


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         derandomize=True, database=None)


# ------------------------------------------------------------------------------ targeted cases

def admit(pool: BlockPool, tokens) -> list[int]:
    """A sequence's pages after computing all of `tokens` (prefix hits first)."""
    pages = pool.cached_prefix(tokens, len(tokens) - 1)
    num_cached = len(pages)
    assert pool.grow(pages, len(tokens))
    pool.cache_full_pages(tokens, pages, len(tokens), num_cached)
    return pages


def test_freed_cached_pages_are_hit_until_reallocated():
    pool = BlockPool(4, PS)
    a = list(range(10, 19))  # 9 tokens: 2 full pages + 1
    pages = admit(pool, a)
    pool.free(pages)
    assert pool.num_free == 4
    hit = pool.cached_prefix(a, len(a) - 1)
    assert hit == pages[:2] and pool.num_free == 2  # hit pages leave the free list
    pool.free(hit)
    # Fill the pool: the two cached pages are evicted last (least recently used first), but
    # once reallocated they are no longer hit.
    other = pool.allocate(2)
    assert not set(other) & set(pages[:2])
    assert pool.cached_prefix(a, len(a) - 1) == pages[:2]
    pool.free(pages[:2])
    pool.free(other)
    taken = pool.allocate(4)
    assert set(pages[:2]) <= set(taken)
    assert pool.cached_prefix(a, len(a) - 1) == []
    pool.check_invariants()


def test_lru_eviction_order():
    pool = BlockPool(6, PS)
    x, y = list(range(20, 28)), list(range(40, 48))  # two full pages each
    px, py = admit(pool, x), admit(pool, y)
    pool.free(px)  # px's tail, then its head, join the free list: tail is evicted first
    pool.free(py)
    # Free order: 4, 5 (never used), px[1], px[0], py[1], py[0].
    assert list(pool._free) == [4, 5, px[1], px[0], py[1], py[0]]
    # A hit on x refreshes its pages: freed again, they become the most recently used.
    pool.free(pool.cached_prefix(x + [1], 8))
    assert pool.allocate(4) == [4, 5, py[1], py[0]]
    assert pool.cached_prefix(y + [1], 8) == []  # y was evicted
    assert pool.cached_prefix(x + [1], 8) == px  # x survived
    pool.check_invariants()


def test_hit_rate_counts_queried_and_hit_tokens():
    pool = BlockPool(8, PS)
    assert pool.prefix_hit_rate == 0.0
    a = list(range(3, 15))  # 12 tokens: 3 full pages
    pool.free(admit(pool, a))  # queried 11 tokens, hit 0
    pool.free(pool.cached_prefix(a, 11))  # 2 pages: the third is not within 11 tokens
    pool.free(pool.cached_prefix(a[:8] + [99] * 4, 12))  # 2 pages hit, then a miss
    pool.free(pool.cached_prefix([99] * 12, 12))  # 0
    assert pool.prefix_queried_tokens == 11 + 11 + 12 + 12
    assert pool.prefix_hit_tokens == 8 + 8
    assert pool.prefix_hit_rate == pytest.approx(16 / 46)


def test_keys_chain_over_the_whole_prefix():
    pool = BlockPool(8, PS)
    pool.free(admit(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # The second page's tokens are the same, under a different first page: no hit for it.
    assert pool.cached_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9], 8) == []
    assert len(pool.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0], 8)) == 2
    assert page_hash(None, [5, 6, 7, 8]) != page_hash(page_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_duplicate_pages_stay_unregistered_and_the_chain_continues():
    """Two sequences compute the same prompt at once: the first registers its pages; the
    second's copies stay unregistered, yet its later pages still get the right chained keys."""
    pool = BlockPool(8, PS)
    tokens = list(range(50, 58))
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert pool.cache_full_pages(tokens, first, 8, 0) == 2
    assert pool.cache_full_pages(tokens, second, 4, 0) == 1  # page 0: a duplicate
    longer = tokens + [1, 2, 3, 4]
    second += pool.allocate(1)
    assert pool.cache_full_pages(longer, second, 12, 1) == 3
    pool.free(first)
    pool.free(second)
    assert pool.cached_prefix(longer + [0], 12) == first + [second[2]]
    pool.check_invariants()


def test_out_of_pages_leaves_the_pool_unchanged():
    pool = BlockPool(3, PS)
    held = admit(pool, list(range(9)))  # 3 pages, 2 cached
    pool.free(held[2:])
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError, match="need 2, 1 of 3 free"):
        pool.allocate(2)
    pages = list(held[:2])
    assert not pool.grow(pages, 13)  # needs 2 more pages
    assert pages == held[:2] and snapshot(pool) == before
    assert pool.grow(pages, 12) and len(pages) == 3  # exactly one more fits
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([pages[2]] * 2)


def test_prefix_caching_off_never_hits_but_counts_queries():
    pool = BlockPool(4, PS, enable_prefix_caching=False)
    a = list(range(9))
    pool.free(admit(pool, a))
    assert pool.cached_prefix(a, 8) == [] and pool.prefix_queried_tokens == 16
    assert pool.prefix_hit_tokens == 0
    pool.check_invariants()


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 1)])
def test_bad_sizes_raise(num_pages, page_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockPool(num_pages, page_size)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(num_pages=st.integers(1, 12), held=st.lists(st.integers(0, 3), max_size=5),
       wants=st.lists(st.integers(0, 5 * PS), max_size=5))
def test_grow_all_equals_growing_one_by_one(num_pages, held, wants):
    """grow_all gives the same pages, in the same order, as grow called per sequence, and
    stops at the same sequence when the pool runs out (earlier ones keep their pages)."""
    one, bulk = BlockPool(num_pages, PS), BlockPool(num_pages, PS)
    seqs_one, seqs_bulk = [], []
    for count in held:
        count = min(count, one.num_free)
        seqs_one.append(one.allocate(count))
        seqs_bulk.append(bulk.allocate(count))
    needs = list(zip(range(len(seqs_one)), wants))
    expected = True
    for i, num_tokens in needs:
        if not one.grow(seqs_one[i], num_tokens):
            expected = False
            break
    assert bulk.grow_all([seqs_bulk[i] for i, _ in needs], [n for _, n in needs]) == expected
    assert seqs_bulk == seqs_one and snapshot(bulk) == snapshot(one)
    bulk.check_invariants()


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(num_pages=st.integers(1, 6),
       counts=st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_allocations_never_share_a_page(num_pages, counts):
    """Raw allocate / free: live allocations are disjoint, and all pages return at the end."""
    pool = BlockPool(num_pages, PS)
    live = []
    for k, count in enumerate(counts):
        if count > pool.num_free:
            before = snapshot(pool)
            with pytest.raises(OutOfPagesError):
                pool.allocate(count)
            assert snapshot(pool) == before
            if live:
                pool.free(live.pop(k % len(live)))
            continue
        live.append(pool.allocate(count))
        flat = [p for pages in live for p in pages]
        assert len(flat) == len(set(flat)) == pool.num_used
        pool.check_invariants()
    for pages in live:
        pool.free(pages)
    assert pool.num_free == num_pages and pool.ref_counts == [0] * num_pages


def test_host_modules_do_not_import_jax():
    code = ("import sys; import engine.scheduler, engine.block_pool, engine.request; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'));"
            "print(bad); sys.exit(1 if bad else 0)")
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("older_grows", [True, False])
def test_scheduler_preempts_the_youngest_and_never_schedules_a_preempted_request(older_grows):
    """A pool of 4 pages of 4 tokens; three requests of 5 prompt tokens take 2 pages each at
    admission (the third finds none). Then the younger running request needs a third page:
    if the older one needs one too, it preempts the younger to get it; if not, the younger
    preempts itself. Either way the younger is not scheduled, holds no pages and has its
    computed tokens dropped, and no waiting request is admitted in that step."""
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler, SchedulerConfig
    pool = BlockPool(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=16), pool)
    reqs = [Request(i, list(range(10 * i, 10 * i + 5)), SamplingParams(), 0) for i in range(3)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert first.requests == reqs[:2]
    sched.update_computed(first)
    reqs[0].output_ids += [1, 2, 3, 4] if older_grows else [1, 2]  # 9 tokens need 3 pages
    reqs[1].output_ids += [1, 2, 3, 4]
    second = sched.schedule()
    assert second.preempted == [reqs[1]]
    assert second.requests == [reqs[0]]
    assert sched.running == [reqs[0]] and not reqs[1].pages and reqs[1].num_computed_tokens == 0
    assert len(reqs[0].pages) == (3 if older_grows else 2)
    assert pool.num_free == (1 if older_grows else 2)
    pool.check_invariants()


def test_pages_past_the_prompt_are_keyed_when_the_request_releases_them():
    """While a request runs only its prompt's full pages are in the prefix cache; when it
    releases its pages (here by abort; finish and preemption release the same way) every full
    page of its known, computed tokens is keyed, so a later prompt that repeats them (a next
    turn, or the request readmitted) hits them all."""
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler, SchedulerConfig
    pool = BlockPool(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=32), pool)
    request = Request(0, [5, 6, 7, 8, 9, 10], SamplingParams(), 0)  # 6 prompt tokens
    sched.add(request)
    sched.update_computed(sched.schedule())  # the prompt: 6 tokens computed
    for token in range(20, 27):  # 7 decode steps: 13 tokens computed, 12 of them in 3 pages
        request.output_ids.append(token)
        sched.update_computed(sched.schedule())
    request.output_ids.append(27)  # the newest token is known but not computed
    tokens = request.prompt_ids + request.output_ids  # 14
    assert request.num_computed_tokens == 13
    probe = tokens + [99]  # a prompt that repeats all of them
    hit = pool.cached_prefix(probe, len(probe) - 1)
    assert len(hit) == 1  # while running: the prompt's one full page only
    pool.free(hit)
    sched.abort(request)
    hit = pool.cached_prefix(probe, len(probe) - 1)
    assert len(hit) == 3  # released: pages 0-2 (12 computed tokens), not the partial 4th
    pool.free(hit)
    pool.check_invariants()
