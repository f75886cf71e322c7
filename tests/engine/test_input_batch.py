"""engine/input_batch.py: persistent block tables and sampling rows against the page lists."""
import numpy as np
from hypothesis import given, settings, strategies as st

from engine.request import Request, SamplingParams
from engine.input_batch import InputBatch
from engine.step_batch import make_step_batch, step_batch_from_arrays


def make_request(i: int, temperature: float = 0.0, logprobs=None) -> Request:
    return Request(i, [1, 2, 3], SamplingParams(temperature=temperature, top_k=i % 5,
                                                logprobs=logprobs), seed=1000 + i)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5),
                          st.sampled_from(["grow", "release", "replace", "shrink"]),
                          st.integers(1, 9)), min_size=1, max_size=60))
def test_gathered_rows_equal_each_requests_pages(ops):
    """Random page growth, releases (slots reused), replaced page lists (preemption then
    readmission) and lists cut short without a release: after every operation the gathered
    rows hold exactly each request's pages and zeros after them (released rows are cleared:
    step_batch_from_arrays relies on it)."""
    rows = InputBatch(capacity=2, width=3, page_size=4)  # small: both dimensions must grow
    requests = [make_request(i, temperature=0.5 * (i % 2)) for i in range(6)]
    next_page = 0
    for index, op, count in ops:
        r = requests[index]
        if op == "grow":
            r.pages.extend(range(next_page, next_page + count))
            next_page += count
        elif op == "release":
            r.pages = []
            rows.release(r)
        elif op == "shrink":  # pages lost without a release: the row is written again (the
            # request stays live, so that the rows see the shorter list before it grows back)
            r.pages = r.pages[: max(len(r.pages) // 2, 1)]
        else:  # a new page list of another length, after a release (as Scheduler._release)
            rows.release(r)
            r.pages = list(range(next_page, next_page + count))
            next_page += count
        live = [q for q in requests if q.pages]
        if not live:
            continue
        slots = rows.slots(live)
        assert len(set(slots.tolist())) == len(live)  # one row per request
        for q, slot in zip(live, slots):
            assert rows.num_pages[slot] == len(q.pages)
            assert rows.tables[slot, : len(q.pages)].tolist() == q.pages
            assert not rows.tables[slot, len(q.pages):].any()
            assert rows.sampling[slot].tolist() == list(q.sampling_row)
        # The step batch built from the gathered rows equals the one built from page lists.
        firsts = [max(len(q.pages) * 4 - 3, 0) for q in live]
        want = make_step_batch([([7, 8], f, q.pages) for q, f in zip(live, firsts)], 4)
        got = step_batch_from_arrays(np.tile(np.int32([7, 8]), len(live)),
                                     np.full(len(live), 2, np.int32), np.asarray(firsts, np.int32),
                                     rows.tables[slots], rows.num_pages[slots], 4)
        for field in ("token_ids", "positions", "slot_mapping", "block_tables",
                      "query_start_loc", "kv_lens", "logits_indices"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), field)


def test_slots_are_reused_and_capacity_grows():
    rows = InputBatch(capacity=1, width=2, page_size=4)
    a, b, c = (make_request(i) for i in range(3))
    for r in (a, b, c):
        r.pages = [r.request_id]
    assert rows.slots([a, b]).tolist() == [0, 1] and rows.capacity == 2
    rows.release(a)
    assert a.slot == -1 and rows.num_used == 1
    assert rows.slots([c]).tolist() == [0]  # a's row, rewritten
    assert rows.tables[0, 0] == c.request_id
    slots = rows.slots([make_request(9, logprobs=2)])  # grows the rows again
    assert rows.capacity == 4 and rows.logprobs[slots].tolist() == [True]


def test_rows_follow_the_schedulers_releases():
    """The scheduler reports every request whose pages it freed (finished, aborted, preempted)
    in its next output's `released`; `update` gives their slots back, so a preempted request
    readmitted later writes a fresh row of its new pages."""
    from engine.block_pool import BlockPool
    from engine.request import FinishReason
    from engine.scheduler import Scheduler, SchedulerConfig
    pool = BlockPool(6, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=24), pool)
    batch = InputBatch(capacity=4, width=6, page_size=4)
    a, b, c = (Request(i, [1] * 7, SamplingParams(), seed=i) for i in range(3))
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()  # 2 pages each: the pool is full
    batch.update(out)
    batch.slots(out.requests, out.held())
    assert batch.num_used == 3 and not out.released
    scheduler.update_computed(out)
    scheduler.finish(a, FinishReason.STOP)
    for r in (b, c):
        r.output_ids.append(5)  # a token more each: both grow into a's freed pages
    out = scheduler.schedule()
    assert out.released == [a]
    batch.update(out)
    assert a.slot == -1 and batch.num_used == 2
    slots = batch.slots(out.requests, out.held())
    for r, slot in zip(out.requests, slots.tolist()):
        assert batch.tables[slot, : len(r.pages)].tolist() == r.pages
        assert not batch.tables[slot, len(r.pages):].any()
