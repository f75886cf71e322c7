"""Block tables kept on the device (engine/device_tables.py): the device's rows always equal the
tables the steps were given, and an engine keyed as on one GPU (forced on the CPU, where both
choices are off: tables on the device, and prefill programs keyed by their token count alone)
gives the tokens of one that sends its tables with every step and counts prefilling sequences,
through preemption, prefix caching, chunked prefill, asynchronous scheduling, multi-step and
mixed rounds, and speculative verification steps (whose batches name no rows); the sharded
runner keys its prefill programs the same way."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import engine.runner
from engine.compile_stats import compile_stats, count_compiles
from engine.device_tables import DeviceTables, tables_on_device
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.speculative import SpecConfig
from ops.kernel_choice import KernelBackends
from tests.engine.test_continuous_batching import CFG, STRESS
from tests.engine.weights import unit_scale_model


def random_tables(rng, num_seqs: int, width: int, num_pages: int):
    """(tables [S, width] zero past each row's pages, kv_lens [S]): random rows."""
    held = rng.integers(0, width + 1, num_seqs)
    tables = np.zeros((num_seqs, width), np.int32)
    for i, n in enumerate(held):
        tables[i, :n] = rng.integers(1, num_pages, n)
    kv_lens = np.where(held > 0, held * 16 - rng.integers(0, 16, num_seqs), 0).astype(np.int32)
    return tables, kv_lens


def test_the_device_rows_follow_every_sync():
    """Random steps over random rows (sequences that gain and lose pages, rows that change
    hands, padding rows, a wider step and a row past the table): after each, the device equals
    the mirror, each live row equals its step's table zero-padded, padding rows are untouched,
    and a step that changes nothing sends nothing."""
    rng = np.random.default_rng(7)
    tables = DeviceTables(rows=4, width=8)
    for step in range(40):
        num_seqs = int(rng.integers(1, 5))
        width = 16 if step == 25 else int(rng.integers(1, 9))
        step_tables, kv_lens = random_tables(rng, num_seqs, width, num_pages=50)
        slots = rng.choice(4, num_seqs, replace=False).astype(np.int32)
        if step == 30:  # a row past the table's
            slots[0], kv_lens[0], step_tables[0, 0] = 8, 3, 9
        idle = slots[(kv_lens == 0) & (slots < tables.host.shape[0])]
        untouched = tables.host[idle].copy()
        rows = tables.sync(step_tables, kv_lens, slots)
        device = np.asarray(tables.device)
        np.testing.assert_array_equal(device, tables.host)
        live = kv_lens > 0
        np.testing.assert_array_equal(rows, np.where(live, slots, 0))
        expect = np.zeros((num_seqs, tables.width), np.int32)
        expect[:, :width] = step_tables
        np.testing.assert_array_equal(device[slots[live]], expect[live])
        np.testing.assert_array_equal(tables.host[idle, : untouched.shape[1]], untouched)
        sent = tables.entries_sent
        tables.sync(step_tables, kv_lens, slots)
        assert tables.entries_sent == sent
    assert tables.width == 16 and tables.host.shape[0] >= 9


def test_rows_of_a_version_already_synced_are_not_compared_again():
    """A row named with the version it was synced at is taken as it is (the input batch bumps
    the version at every change); a new version is compared and written; a sync that names no
    versions (another caller of the same rows) makes the next versioned one compare again."""
    tables = DeviceTables(rows=4, width=8)
    first = np.array([[1, 2, 0], [3, 0, 0]], np.int32)
    kv_lens, slots = np.array([20, 5], np.int32), np.array([2, 0], np.int32)
    tables.sync(first, kv_lens, slots, np.array([1, 1]))
    sent = tables.entries_sent
    tables.sync(first + 5, kv_lens, slots, np.array([1, 1]))  # same versions: trusted
    assert tables.entries_sent == sent
    grown = np.array([[1, 2, 4], [3, 0, 0]], np.int32)
    tables.sync(grown, kv_lens, slots, np.array([2, 1]))  # row 2 changed: one page written
    assert tables.entries_sent == sent + 1
    np.testing.assert_array_equal(np.asarray(tables.device)[[2, 0], :3], grown)
    tables.sync(np.array([[7]], np.int32), np.array([3], np.int32))  # row 0, no versions
    tables.sync(grown, kv_lens, slots, np.array([2, 1]))
    np.testing.assert_array_equal(np.asarray(tables.device)[[2, 0], :3], grown)


def test_more_changes_than_one_scatter_block_all_arrive():
    tables = DeviceTables(rows=2, width=2048)
    step_tables = np.arange(1, 2 * 2048 + 1, dtype=np.int32).reshape(2, 2048)
    tables.sync(step_tables, np.array([5, 7], np.int32))
    np.testing.assert_array_equal(np.asarray(tables.device), step_tables)
    assert tables.entries_sent == 4096


def test_the_scatter_compiled_ahead_is_the_one_a_step_runs():
    """Warm-up compiles the scatter from shapes; the first step that changes a table compiles
    nothing more (its program is the warmed one)."""
    count_compiles()
    tables = DeviceTables(rows=8, width=64)
    tables.compile()
    before = compile_stats()
    tables.sync(np.arange(1, 9, dtype=np.int32).reshape(2, 4), np.array([3, 4], np.int32))
    assert (compile_stats() - before).programs == 0
    assert tables.entries_sent == 8


def test_tables_live_on_the_device_only_under_the_gpu_attention_kernel():
    gpu = KernelBackends(platform="gpu", attention="pallas")
    assert tables_on_device(gpu, 128)
    assert not tables_on_device(gpu, 15)  # the jnp attention of an odd head_dim
    assert not tables_on_device(KernelBackends(platform="gpu", attention="reference"), 128)
    assert not tables_on_device(dataclasses.replace(gpu, mesh=(("data", 2),)), 128)
    assert not tables_on_device(KernelBackends(platform="cpu"), 64)
    assert not tables_on_device(KernelBackends(platform="tpu", attention="pallas"), 128)


def test_a_gpu_runner_reaches_one_width_and_one_prefill_step_per_token_bucket():
    """A GPU engine of a 128k context and 256 sequences: every step at the one table width and
    prefill steps keyed by their token bucket alone, 9 decode and 8 prefill steps in all
    (sending tables and counting prefilling sequences it reached 120 steps at 7 widths, and
    prefill steps beside longer contexts at 6 more). Only the jnp attention needs the count."""
    from engine.block_pool import BlockPool
    from engine.engine_config import EngineConfig, resolve_engine_config
    from engine.step_batch import bucket_key
    from engine.warmup import reachable_steps
    from ops.paged_attention import bounds_prefill_seqs
    cfg = resolve_engine_config(EngineConfig(max_model_len=131072, num_pages=9000), 131072,
                                "gpu")
    pool = BlockPool(9000, 16, False)
    width = pool.pages_needed(cfg.max_model_len)
    steps = reachable_steps(cfg, pool, width, fixed_width=width, count_prefill_seqs=False)
    assert {w for _, w, _ in steps} == {width}
    decodes = [q for q, _, _ in steps if max(q) == 1]
    prefills = [q for q, _, _ in steps if max(q) > 1]
    assert (len(decodes), len(prefills)) == (9, 8) and all(len(q) == 1 for q in prefills)
    assert len(reachable_steps(cfg, pool, 128)) == 120
    assert bucket_key(2048, 3, width, 2000, 2, 256, width, count_prefill_seqs=False)[4] == 256
    assert bucket_key(2048, 3, width, 2000, 2, 256, width)[4] == 2
    assert bounds_prefill_seqs(None) and bounds_prefill_seqs(KernelBackends(platform="gpu"))
    assert not bounds_prefill_seqs(KernelBackends(platform="gpu", attention="pallas"))


@pytest.fixture(scope="module")
def model():
    return unit_scale_model(CFG, 3)


def run(model, engine_cfg, gpu_keys: bool, monkeypatch, spec=None):
    """Greedy and seeded outputs of a fixed request mix on an engine keyed as on one GPU or as
    on the CPU (and the runner)."""
    monkeypatch.setattr(engine.runner, "tables_on_device", lambda kernels, head_dim: gpu_keys)
    monkeypatch.setattr(engine.runner, "bounds_prefill_seqs", lambda kernels: not gpu_keys)
    llm = LLMEngine(CFG, model, None, engine_cfg=engine_cfg, spec_config=spec)
    assert (llm.runner.tables is not None) == gpu_keys
    if gpu_keys:  # the warm-up lists the one width every step runs, one prefill per bucket
        programs = llm.warmup_programs()
        assert {width for _, width, _, _ in programs} == {llm.runner.fixed_width}
        prefills = [q for q, _, verification, _ in programs if max(q) > 1 and not verification]
        assert all(len(q) == 1 for q in prefills)
    rng = np.random.default_rng(3)
    shared = rng.integers(1, CFG.vocab_size, 32).tolist()
    prompts = [(shared[: int(rng.choice([0, 16, 32]))]
                + rng.integers(1, CFG.vocab_size, 40).tolist())[: int(n)]
               for n in rng.integers(2, 41, 8)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 14)), ignore_eos=True,
                             **({"temperature": 0.8, "seed": i} if i % 3 == 2 else {}))
              for i in range(len(prompts))]
    return [out.output_ids for out in llm.generate(prompts, params)], llm.runner


@pytest.mark.parametrize("engine_cfg, spec", [
    (STRESS, None),
    (dataclasses.replace(STRESS, async_scheduling=True, num_decode_steps=3, mixed_rounds=True),
     None),
    (dataclasses.replace(STRESS, num_pages=12), SpecConfig("ngram", num_speculative_tokens=3)),
], ids=["preempting", "async-rounds", "speculative"])
def test_an_engine_keyed_as_on_a_gpu_gives_the_same_tokens(model, engine_cfg, spec,
                                                           monkeypatch):
    cpu, _ = run(model, engine_cfg, False, monkeypatch, spec)
    gpu, runner = run(model, engine_cfg, True, monkeypatch, spec)
    assert gpu == cpu
    keys = [key for key in runner.compiled_shapes if not isinstance(key[0], str)]  # steps
    assert {key[2] for key in keys} == {runner.fixed_width}
    # prefill keys (N, max_seqs, W, N, P): every P at its most
    prefill_bounds = {key[4] for key in keys if 1 < key[3] == key[0] and key[1] == runner.max_seqs}
    assert prefill_bounds == {runner.max_seqs}


def test_a_sharded_engine_keyed_as_on_gpus_gives_the_same_tokens(model, monkeypatch):
    """The sharded runner (here on a one-device mesh) keys prefill programs by their token
    bucket alone where its attention is a kernel (forced): the same tokens, one program."""
    from engine.mesh import make_mesh
    outputs, keys = [], []
    for counts in (True, False):
        monkeypatch.setattr(engine.runner, "bounds_prefill_seqs", lambda k, c=counts: c)
        llm = LLMEngine(CFG, model, None, engine_cfg=STRESS, mesh=make_mesh(1, 1))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, CFG.vocab_size, int(n)).tolist()
                   for n in rng.integers(5, 45, 6)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        outputs.append([out.output_ids for out in outs])
        keys.append({key for key in llm.runner.compiled_shapes if key[3] > 1})
    assert outputs[0] == outputs[1]
    assert len(keys[0]) > 1 and {key[4] for key in keys[1]} == {STRESS.max_num_seqs}
