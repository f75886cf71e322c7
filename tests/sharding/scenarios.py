"""Sharded-inference scenarios, each run in a fresh process with fake CPU devices.

    python -m tests.sharding.scenarios NAME [--devices=8] [worker options]

jax fixes its device count when it starts, and the rest of the test suite runs in one process
with one CPU device, so every scenario runs in a subprocess started by `run_scenario` with
XLA_FLAGS=--xla_force_host_platform_device_count set before jax is imported. A scenario prints
one line `RESULT <json>`; the tests in this directory assert on it. Meshes are written
"TPxDP" (tensor-parallel size x data-parallel size).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "RESULT "
MESHES = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2))
MAX_TOKENS = 8


# Scenarios whose time is XLA's compilation of many small programs (one set per mesh and
# weight format), each run for a few tokens or not run at all (hlo reads the compiled HLO).
# They compile without LLVM's optimizations (--xla_backend_optimization_level=0): the SPMD
# partitioning, the collectives, cache aliasing and copies they check are decided by XLA's HLO
# passes, which that flag leaves alone (the hlo scenario's report is byte for byte the same),
# and each compares a mesh's outputs with one device's compiled the same way (the tiny
# scenario's tokens are the same and its log-probabilities within 5e-7 of an -O2 run's). It cuts
# their CPU time by about a quarter. smollm2 executes a 30-layer model and is slower without
# optimization, so it keeps XLA's default.
UNOPTIMIZED_BACKEND = ("tiny", "hlo", "checkpoint", "worker")


def device_env(devices: int, optimize: bool = True) -> dict:
    """The environment of a subprocess with `devices` fake CPU devices (optimize=False: LLVM
    optimization off, see UNOPTIMIZED_BACKEND)."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    if not optimize:
        flags += " --xla_backend_optimization_level=0"
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def run_scenario(name: str, *args: str, devices: int = 8, timeout: float = 600) -> dict:
    """Runs scenario `name` in a subprocess with `devices` fake CPU devices; returns its result."""
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.scenarios", name, *args],
                          cwd=ROOT, env=device_env(devices, name not in UNOPTIMIZED_BACKEND),
                          capture_output=True, text=True, timeout=timeout)
    return parse_result(proc)


def parse_result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(MARK):])


def mesh_name(tp: int, dp: int) -> str:
    return f"{tp}x{dp}"


# ---- shared pieces (import jax lazily: the pytest process only uses run_scenario) -----------

def quant_available() -> bool:
    try:
        from quant.model import QuantConfig, quantize_model  # noqa: F401
        return True
    except ImportError:
        return False


def tiny_weights(cfg, seed: int) -> dict:
    """Random weights of cfg as a nested dict of host arrays (normal 0.02; norms near 1).

    Drawn with numpy, so every process of a multi-process run draws the same ones quickly.
    """
    import jax
    import numpy as np
    from flax import nnx

    from models.weights import abstract_model
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))

    def draw(path, a):
        if jax.tree_util.keystr(path).endswith("['weight']"):  # RMSNorm
            return (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        return (0.02 * rng.standard_normal(a.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def tiny_model(cfg_name: str, quant: str | None, seed: int = 3, mesh=None):
    """(cfg, model) of a tiny preset with tiny_weights: float32, bfloat16 when `quant` is
    "bfloat16", else quantized by that method; on `mesh` (placed by the partition rules) if
    given."""
    import jax.numpy as jnp

    from configs.model import get_preset
    from models.weights import model_from_pure_dict
    cfg = get_preset(cfg_name)
    place = None
    if mesh is not None:
        from models.sharding import leaf_placer
        place = leaf_placer(cfg, mesh)
    dtype = jnp.bfloat16 if quant == "bfloat16" else jnp.float32
    model = model_from_pure_dict(cfg, tiny_weights(cfg, seed), dtype, place=place)
    if quant not in (None, "bfloat16"):
        from quant.model import QuantConfig, quantize_model
        quantize_model(cfg, model, QuantConfig(quant, group_size=32), progress=False)
    return cfg, model


def tiny_prompts(cfg, seed: int = 0) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 11, 16, 3)]


def engine_config(async_scheduling: bool = False):
    from engine.llm_engine import EngineConfig
    return EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                        page_size=8, async_scheduling=async_scheduling)


def greedy(cfg, model, prompts, mesh=None, max_tokens: int = MAX_TOKENS,
           tokenizer=None, async_scheduling: bool = False, logprobs: bool = True,
           penalties: bool = False, speculative: bool = False) -> dict:
    """Greedy tokens (and their log-probabilities) of each prompt, run together in one engine.

    With logprobs the steps sample with the sampler program; without, they take the step's
    own argmax (on a mesh: tokens in the step's shard order). With penalties, every request
    has repetition, presence and frequency penalties (the count table on the mesh). With
    speculative, n-gram speculation of 3 tokens verifies its proposals in the steps; the
    result then also has the runner's verification-step buckets (keys with q > 1, N = S * q)."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    from engine.speculative import SpecConfig
    engine = LLMEngine(cfg, model, tokenizer, engine_config(async_scheduling), mesh=mesh,
                       spec_config=SpecConfig("ngram", 3) if speculative else None)
    strengths = (dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=1.0)
                 if penalties else {})
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                   logprobs=0 if logprobs else None,
                                                   **strengths))
    return {"tokens": [o.output_ids for o in outs],
            "logprobs": ([[lp[0] for lp in o.outputs[0].logprobs] for o in outs]
                         if logprobs else None),
            "tokens_from_device": engine.stats.num_tokens_from_device,
            "plan": None if mesh is None else engine.runner.plan.reason,
            "drafts": engine.spec_stats.num_drafts,
            "verify_keys": sorted(k for k in engine.runner.compiled_shapes
                                if k[3] > 1 and k[1] * k[3] == k[0])}


@contextlib.contextmanager
def compile_log():
    """Yields a list that fills, while the block runs, with what jax's compile log says it
    compiles ("Compiling <program>", the line up to its " with ")."""
    import logging

    import jax
    compiles = []

    def emit(record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            compiles.append(message.split(" with ")[0])
    handler = logging.Handler()
    handler.emit = emit
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield compiles
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(handler)


def warm_greedy(cfg, model, prompts, mesh) -> dict:
    """Greedy tokens of a mesh engine whose warm-up compiled its step programs ahead of time
    (lowered for the mesh, not run), and what the run then compiled, from jax's compile log;
    then what runs of sampled and logprob requests compiled."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    engine = LLMEngine(cfg, model, None, engine_config(), mesh=mesh)
    warmed = engine.warmup()
    sampled = [SamplingParams(max_tokens=4, temperature=0.8, seed=1),
               SamplingParams(max_tokens=4, logprobs=2),
               SamplingParams(max_tokens=4, temperature=0.9, top_p=0.8, seed=2, logprobs=1)]
    with compile_log() as compiles:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        greedy_compiles = list(compiles)
        for params in sampled:  # all prompts, then one
            engine.generate(prompts, params)
            engine.generate(prompts[:1], params)
    return {"tokens": [o.output_ids for o in outs], "warmed": warmed,
            "plan": engine.runner.plan.reason, "compiled_ahead": engine.runner.compiles_ahead,
            "step_compiles_in_run": [c for c in greedy_compiles if "_sharded_step" in c],
            "compiles_in_sampled_runs": compiles[len(greedy_compiles):]}


def mixed_params(sampled: bool = True) -> list:
    """Six requests' sampling: greedy, seeded sampling with and without cuts, and penalties
    on greedy and sampled rows (`rounds_run`); without `sampled`, greedy rows, two of them
    penalized."""
    from engine.request import SamplingParams
    if not sampled:
        return [SamplingParams(max_tokens=12, ignore_eos=True,
                               **(dict(repetition_penalty=1.5, frequency_penalty=0.5)
                                  if i % 3 == 1 else {})) for i in range(6)]
    return [SamplingParams(max_tokens=12, ignore_eos=True),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3),
            SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=2.0,
                           frequency_penalty=0.5),
            SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.9, top_k=5, seed=4,
                           presence_penalty=0.7),
            SamplingParams(max_tokens=12, ignore_eos=True),
            SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.7, top_p=0.8, seed=5)]


def rounds_run(cfg, model, prompts, mesh=None, num_decode_steps: int = 1,
               sampled: bool = True) -> dict:
    """The tokens of `mixed_params(sampled)` requests run together, with multi-step and mixed
    rounds of num_decode_steps (asynchronous) or single synchronous steps (1), and which round
    programs ran. Without `sampled` (greedy rows), the greedy round programs, penalized ones
    too, and the count table's history write are compiled ahead first, and the result lists
    the round programs and history writes the run compiled."""
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(cfg, model, None, EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
        async_scheduling=num_decode_steps > 1, num_decode_steps=num_decode_steps), mesh=mesh)
    if not sampled and engine.rounds is not None:  # (the sampled ones: the suite's time)
        engine.warmup(programs=[p for p in engine.warmup_programs(penalized=True)
                                if p[3].startswith("greedy")], samplers=False)
        engine.runner.penalty_counts.compile()
    with compile_log() as compiles:
        outs = engine.generate(prompts, mixed_params(sampled))
    return {"tokens": [o.output_ids for o in outs],
            "plan": None if mesh is None else engine.runner.plan.reason,
            "rounds": sorted({k[0] for k in engine.runner.compiled_shapes
                              if isinstance(k[0], str)}),
            "round_compiles_in_run": [c for c in compiles if "round" in c
                                      or "multi_step" in c or "history" in c]}


def uneven_keys(cfg, model, mesh) -> dict:
    """For batches whose sequences sit unevenly over a mesh's data shards, "keys": (the
    batch's step key, that of a padding batch of the runner's `padding_q_lens` for it, whether
    the engine's warm-up programs include the key) each; and the runner's "plan"."""
    from engine.llm_engine import LLMEngine
    from engine.step_batch import make_step_batch, padding_batch
    from engine.warmup import STEP
    engine = LLMEngine(cfg, model, None, engine_config(), mesh=mesh)
    runner, page_size = engine.runner, engine.engine_cfg.page_size

    def batch(q_lens, shards):  # rows at position 8 on three pages of their shard each
        return make_step_batch([(list(range(3, 3 + q)), 8, [
            d * runner.pages_per_shard + 3 * i + k for k in range(3)])
            for i, (q, d) in enumerate(zip(q_lens, shards))], page_size)

    warmed = {runner.step_key(padding_batch(q_lens, width, verification))
              for q_lens, width, verification, program in engine.warmup_programs()
              if program == STEP}
    keys = []
    for q_lens, shards in (([1, 1, 1, 1], [0, 0, 0, 1]),  # three decode rows on one shard
                           ([5, 1, 9, 1], [0, 0, 1, 1]),  # the most tokens on shard 1
                           ([2, 2, 2, 20], [0, 0, 0, 1])):  # most prefills 0, tokens 1
        b = batch(q_lens, shards)
        key = runner.step_key(b)
        padded = runner.step_key(padding_batch(runner.padding_q_lens(b),
                                               b.block_tables.shape[1]))
        keys.append([list(key), list(padded), key in warmed])
    return {"keys": keys, "plan": runner.plan.reason}


# ---- scenarios ----------------------------------------------------------------------------------

# (config, weights: None for float32, "bfloat16" or a quantization method, meshes) of the tiny
# scenario: tiny-llama31 (8 query / 2 KV heads) splits its KV heads at tp 2 and repeats them at
# tp 4 and 8; tiny-qwen2 (one KV head, q/k/v biases) repeats its KV head and biases;
# tiny-llama's 4 query heads do not split over tp 8 (replicated). ASYNC_MESHES also run
# tiny-llama31 float32 with asynchronous scheduling. float32 runs every mesh; bfloat16 and INT4
# one mesh that splits the KV heads and one that repeats them with dp (SPLIT_AND_REPEAT: the
# suite's time on the CI machine).
ASYNC_MESHES = ((2, 2), (4, 2))  # (1, 1) cut: the suite's time
SPLIT_AND_REPEAT = ((2, 1), (4, 2))
TINY_CASES = (("tiny-llama31", None, MESHES), ("tiny-llama31", "bfloat16", SPLIT_AND_REPEAT),
              ("tiny-qwen2", None, ((4, 1), (2, 2))),
              ("tiny-llama", None, ((8, 1),)), ("tiny-llama31", "int4_rtn", SPLIT_AND_REPEAT))


def case_key(cfg_name: str, quant: str | None) -> str:
    return f"{cfg_name}/{quant or 'float32'}"


def scenario_tiny(args) -> dict:
    """Greedy runs of tiny configs on one device and on every mesh (float32 and INT4)."""
    import numpy as np

    from engine.mesh import make_mesh
    cases = [c for c in TINY_CASES if c[1] in (None, "bfloat16") or quant_available()]
    results = {}
    for cfg_name, quant, meshes in cases:
        cfg, model = tiny_model(cfg_name, quant)
        prompts = tiny_prompts(cfg)
        key = case_key(cfg_name, quant)
        results[key] = {"one_device": greedy(cfg, model, prompts)}
        for tp, dp in meshes:
            results[key][mesh_name(tp, dp)] = greedy(cfg, model, prompts, make_mesh(tp, dp))
        if (cfg_name, quant) == ("tiny-llama31", None):  # warm-up compiled ahead on a mesh
            results[key]["2x2/warm"] = warm_greedy(cfg, model, prompts, make_mesh(2, 2))
        if (cfg_name, quant) == ("tiny-llama31", None):  # asynchronous scheduling on a mesh
            for tp, dp in ASYNC_MESHES:
                for logprobs in (True, False):
                    results[key][f"{mesh_name(tp, dp)}/async/{logprobs}"] = greedy(
                        cfg, model, prompts, make_mesh(tp, dp), async_scheduling=True,
                        logprobs=logprobs)
            # penalties: one device synchronous, meshes asynchronous
            results[key]["one_device/penalties"] = greedy(cfg, model, prompts, penalties=True)
            for tp, dp in ASYNC_MESHES:
                results[key][f"{mesh_name(tp, dp)}/async/penalties"] = greedy(
                    cfg, model, prompts, make_mesh(tp, dp), async_scheduling=True,
                    penalties=True)
            # speculative verification on a mesh, over prompts of repeated n-grams
            rng = np.random.default_rng(1)
            repeats = [(rng.integers(3, cfg.vocab_size, 4).tolist() * 6)[:n] for n in (9, 14, 20)]
            results[key]["one_device/repeats"] = greedy(cfg, model, repeats)
            results[key]["2x2/speculative"] = greedy(cfg, model, repeats, make_mesh(2, 2),
                                                     logprobs=False, speculative=True)
            # multi-step and mixed rounds on a mesh: sampled and penalized rows among greedy
            longer = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 11, 16, 3, 30, 7)]
            for sampled in (True, False):
                results[key][f"one_device/mixed/{sampled}"] = rounds_run(cfg, model, longer,
                                                                         sampled=sampled)
            results[key]["4x2/rounds/True"] = rounds_run(cfg, model, longer, make_mesh(4, 2), 4)
            results[key]["2x2/rounds/False"] = rounds_run(cfg, model, longer, make_mesh(2, 2), 4,
                                                          sampled=False)
            results[key]["1x2/uneven_keys"] = uneven_keys(cfg, model, make_mesh(1, 2))
    return {"cases": results, "quant": quant_available()}


def scenario_smollm2(args) -> dict:
    """The real SmolLM2 (9 query / 3 KV heads: attention replicated) on a few meshes."""
    import numpy as np

    from engine.mesh import make_mesh
    from models.gguf_file import find_smollm2_gguf
    from quant.loader import load_model
    try:
        find_smollm2_gguf()
    except FileNotFoundError as e:
        return {"skip": str(e)}
    golden = dict(np.load(os.path.join(ROOT, "tests", "golden", "smollm2.npz")))
    names = ("france", "fibonacci")
    prompts = [golden[n + "_ids"].tolist() for n in names]
    loaded = load_model("smollm2-135m")
    results = {"golden": [golden[n + "_greedy_ids"][:MAX_TOKENS].tolist() for n in names]}
    for tp, dp in ((4, 1), (2, 2)):
        results[mesh_name(tp, dp)] = greedy(loaded.cfg, loaded.model, prompts,
                                            make_mesh(tp, dp))
    return results


def scenario_checkpoint(args) -> dict:
    """Saved at tp=2 (and in tp=8 storage chunks), restored onto other meshes."""
    import shutil
    import tempfile

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from engine.mesh import make_mesh
    from models.sharding import storage_layout, tree_shardings
    from models.orbax_io import save_checkpoint
    from quant.loader import load_checkpoint, load_model

    out, tmp = {}, tempfile.mkdtemp()
    try:
        cases = [("tiny-llama31", None)] + ([("tiny-llama31", "int4_rtn")]
                                            if quant_available() else [])
        for cfg_name, quant in cases:
            key = case_key(cfg_name, quant)
            cfg, model = tiny_model(cfg_name, quant, seed=5)
            prompts = tiny_prompts(cfg, seed=1)
            reference = greedy(cfg, model, prompts)
            # Save from a model laid out at tp=2 (its arrays are sharded: chunks of tp=2 shards).
            saved_at = make_mesh(2, 1)
            graphdef, state = nnx.split(model)
            sharded = nnx.merge(graphdef, jax.device_put(state, tree_shardings(state, cfg,
                                                                                saved_at)))
            settings = None
            if quant is not None:
                from quant.model import QuantConfig
                settings = QuantConfig(quant, group_size=32).to_dict()
            path = os.path.join(tmp, key.replace("/", "_"))
            save_checkpoint(path, cfg, sharded, quantization=settings)
            restored_mesh = make_mesh(4, 2)
            _, restored, _ = load_checkpoint(path, mesh=restored_mesh)
            leaves = jax.tree_util.tree_leaves_with_path(nnx.state(restored))
            specs = {jax.tree_util.keystr(p): str(a.sharding.spec) for p, a in leaves}
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(restored))))
            out[key] = {"reference": reference,
                        "restored_tp4": greedy(cfg, restored, prompts, restored_mesh),
                        "weights_equal": same, "specs": specs}
        # The converter's layout: every weight in the chunks of its tp=8 shards.
        cfg, model = tiny_model("tiny-llama31", None, seed=5)
        path = os.path.join(tmp, "storage")
        save_checkpoint(path, cfg, storage_layout(model, cfg, 8))
        meta = ocp.StandardCheckpointer().metadata(os.path.join(path, "params")).item_metadata
        out["storage_chunks"] = {
            "embedding": list(meta["embed_tokens"]["embedding"].storage.chunk_shape),
            "down_proj": list(meta["layers"]["0"]["mlp"]["down_proj"]["kernel"]
                              .storage.chunk_shape)}
        loaded = load_model(path, mesh=make_mesh(2, 1))
        out["storage_restored_equal"] = all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded.model))))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def scenario_hlo(args) -> dict:
    """Collectives, weight all-gathers and cache donation of compiled decode and prefill steps."""
    from tests.sharding.hlo import step_report
    from engine.mesh import make_mesh
    from configs.model import SMOLLM2_135M
    from models.weights import model_from_pure_dict

    out = {}
    # float32 meshes that repeat KV heads (tp 4, 8) or add dp; INT4 also the split at tp 2
    # (the suite's time on the CI machine)
    cases = [("tiny-llama31", None, (4, 1)), ("tiny-llama31", None, (8, 1)),
             ("tiny-llama31", None, (4, 2))]
    if quant_available():
        cases += [("tiny-llama31", "int4_rtn", (2, 1)), ("tiny-llama31", "int4_rtn", (4, 1))]
    models = {}
    for cfg_name, quant, (tp, dp) in cases:
        if (cfg_name, quant) not in models:
            models[cfg_name, quant] = tiny_model(cfg_name, quant)
        cfg, model = models[cfg_name, quant]
        out[f"{case_key(cfg_name, quant)}/{mesh_name(tp, dp)}"] = step_report(
            cfg, model, make_mesh(tp, dp))
    smol = SMOLLM2_135M.replace(num_layers=2)  # real head counts: attention replicated
    out["smollm2-2layers/float32/4x1"] = step_report(
        smol, model_from_pure_dict(smol, tiny_weights(smol, 0)), make_mesh(4, 1))
    return out


def scenario_worker(args) -> dict:
    """One process of a multi-process run (jax.distributed on loopback)."""
    from engine.mesh import initialize_distributed, is_main_process, make_mesh
    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    import jax
    from configs.model import get_preset
    cfg = get_preset("tiny-llama31")
    prompts = tiny_prompts(cfg)
    out = {"process_count": jax.process_count(), "local_devices": jax.local_device_count(),
           "devices": jax.device_count()}
    for tp, dp in ((4, 2), (8, 1)):
        mesh = make_mesh(tp, dp)
        _, model = tiny_model("tiny-llama31", None, mesh=mesh)
        out[mesh_name(tp, dp)] = greedy(cfg, model, prompts, mesh)
    if is_main_process():  # the same model on this process's first device, unsharded
        with jax.default_device(jax.local_devices()[0]):
            _, model = tiny_model("tiny-llama31", None)
            out["one_device"] = greedy(cfg, model, prompts)
    return out


SCENARIOS = {"tiny": scenario_tiny, "smollm2": scenario_smollm2,
             "checkpoint": scenario_checkpoint, "hlo": scenario_hlo, "worker": scenario_worker}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(SCENARIOS))
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    result = SCENARIOS[args.name](args)
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()


def run_workers(num_processes: int = 2, devices: int = 4, timeout: float = 600) -> list[dict]:
    """Runs the `worker` scenario as num_processes processes joined by jax.distributed on
    loopback, each with `devices` fake CPU devices; returns each process's result."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = device_env(devices, optimize="worker" not in UNOPTIMIZED_BACKEND)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.sharding.scenarios", "worker",
         f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
         f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(num_processes)]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(parse_result(subprocess.CompletedProcess(
                proc.args, proc.returncode, stdout, stderr)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results
