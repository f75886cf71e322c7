"""What a compiled sharded step does: its collectives, weight all-gathers and cache aliasing.

Used by the `hlo` scenario (tests/sharding/scenarios.py) in a process with fake devices.
"""
from __future__ import annotations

import re

import jax
import numpy as np

from engine.step_batch import StepBatch
from engine.step_inputs import StepLayout

# `%name = f32[4,256]{0,1} all-gather(...` (also the async `-start` forms of GPU programs).
COLLECTIVE = re.compile(r"^\s*%\S+ = (\(?[a-z0-9]+\[[0-9,]*\])\S* "
                        r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                        r"(?:-start)?\(.*?op_name=\"([^\"]*)\"", re.M)


def step_batches(page_size: int, max_width_pages: int):
    """A decode step of 4 sequences and a prefill step of 2 sequences (16 and 5 tokens)."""
    decode = StepBatch(token_ids=np.arange(4, dtype=np.int32) + 3,
                       positions=np.full(4, 9, np.int32),
                       slot_mapping=np.arange(4, dtype=np.int32) * page_size * 2 + 9,
                       block_tables=np.arange(8, dtype=np.int32).reshape(4, 2),
                       query_start_loc=np.arange(5, dtype=np.int32),
                       kv_lens=np.full(4, 10, np.int32),
                       logits_indices=np.arange(4, dtype=np.int32))
    lens = np.array([16, 5], np.int32)
    start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    tables = np.array([[0, 1], [2, 0]], np.int32)
    slots = np.concatenate([tables[0][pos[:16] // page_size] * page_size + pos[:16] % page_size,
                            tables[1][pos[16:] // page_size] * page_size + pos[16:] % page_size])
    prefill = StepBatch(token_ids=pos + 3, positions=pos, slot_mapping=slots.astype(np.int32),
                        block_tables=tables, query_start_loc=start, kv_lens=lens,
                        logits_indices=start[1:] - 1)
    return {"decode": decode, "prefill": prefill}


def compiled_text(runner, batch) -> str:
    step = runner._layout(batch)
    with jax.set_mesh(runner.mesh):  # exactly as runner._run calls it
        lowered = runner._step.lower(runner._weights, runner.cache, step.packed,
                                     runner._no_samples, StepLayout(*step.key), False)
    return lowered.compile().as_text()


def step_report(cfg, model, mesh) -> dict:
    """Per step kind: collectives (shape, kind, op), weight all-gathers, cache aliasing."""
    from engine.llm_engine import LLMEngine
    from tests.sharding.scenarios import engine_config

    engine = LLMEngine(cfg, model, None, engine_config(), mesh=mesh)
    runner = engine.runner
    weights = {(str(a.dtype), tuple(a.shape)) for a in jax.tree.leaves(runner.state)}
    page = runner.cache.k_pages[0]
    local_page = page.sharding.shard_shape(page.shape)
    report = {"num_layers": cfg.num_layers, "shard_heads": runner.plan.shard_heads,
              "kv_repeat": runner.plan.kv_repeat}
    for kind, batch in step_batches(runner.page_size, 2).items():
        hlo = compiled_text(runner, batch)
        ops = [{"shape": shape, "kind": kind_, "op": op.rsplit("/", 1)[-1]}
               for shape, kind_, op in COLLECTIVE.findall(hlo)]
        gathered_weights = []
        for op in ops:
            if op["kind"] != "all-gather":
                continue
            dtype, dims = re.match(r"\(?([a-z0-9]+)\[([0-9,]*)\]", op["shape"]).groups()
            dims = tuple(int(d) for d in dims.split(",") if d)
            name = {"f32": "float32", "bf16": "bfloat16", "s32": "int32", "u8": "uint8"}.get(
                dtype, dtype)
            if (name, dims) in weights:
                gathered_weights.append(f'{op["shape"]} {op["op"]}')
        alias = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo)
        dims = ",".join(map(str, local_page))
        copies = re.findall(rf"^\s*(?:%\S*copy\S* = f32\[{dims}\]\S* .*|.*= f32\[{dims}\]\S* "
                            rf"copy\(.*)$", hlo, flags=re.M)
        report[kind] = {"collectives": ops, "gathered_weights": gathered_weights,
                        "aliased": alias.group(1).count("alias)") if alias else 0,
                        "page_copies": len(copies)}
    return report
