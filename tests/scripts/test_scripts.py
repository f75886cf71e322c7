"""End to end: the absl scripts as a user runs them, and their errors on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs.switches import Switches
from ops.backends import TABLES, select_kernels
from scripts.common import kernels_line, progress_line
from tests.conftest import GOLDEN_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_DIR = os.path.join(GOLDEN_DIR, "tiny-llama")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One persistent compilation cache shared by this module's subprocesses."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def run_script(module: str, *args: str, cache_dir: str = "",
               optimized: bool = False) -> subprocess.CompletedProcess:
    """optimized: XLA's default LLVM optimizations (SmolLM2's 30 layers run slower without them,
    see tests/conftest.py), else the test run's XLA_FLAGS."""
    cmd = [sys.executable, "-m", f"scripts.{module}", f"--compilation_cache_dir={cache_dir}", *args]
    env = {**os.environ, "XLA_FLAGS": ""} if optimized else None
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def assert_one_clear_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_generate_answers_the_capital_of_france(cache_dir):
    result = run_script("generate", "--prompt=What is the capital of France?", "--json",
                        "--max_tokens=24", cache_dir=cache_dir, optimized=True)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["prompt_tokens"] == 37 and out["token_ids"] and out["ttft_s"] > 0
    assert set(out) >= {"prompt", "text", "token_ids", "prompt_tokens", "ttft_s", "tokens_per_s"}


def test_generate_streams_text_and_prints_summary(cache_dir):
    result = run_script("generate", f"--model={TINY_DIR}", "--prompt=hello", "--prompt=the sea",
                        "--max_tokens=8", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("[2 prompt(s)") and "tokens/s" in lines[-1]


def test_generate_print_kernels_lists_every_family(cache_dir):
    """The start-up summary's kernels line, and with --print_kernels the table of
    ops.backends.describe_kernels: a row for every op family, the CPU's reference here."""
    result = run_script("generate", f"--model={TINY_DIR}", "--prompt=hi", "--max_tokens=2",
                        "--nowarmup", "--print_kernels", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    summary = [line for line in lines if line.startswith("kernels on cpu: ")]
    assert len(summary) == 1 and "attention reference" in summary[0], result.stderr[-2000:]
    header = next(i for i, line in enumerate(lines) if line.startswith("family  "))
    rows = lines[header + 2:]
    for family in TABLES:
        assert f"{family} " in summary[0]
        assert any(row.split()[:2] == [family, "reference" if family != "matmul" else "any"]
                   for row in rows), (family, result.stderr[-3000:])


def test_kernels_line_names_each_family_choice():
    """A Hopper GPU's choice, one sharded and one interpreted: the line names what each runs."""
    hopper = kernels_line(select_kernels("gpu", hopper=True))
    assert hopper == ("kernels on gpu: attention pallas, kv_write pallas, norm pallas, matmul "
                      "xla, gemv wgmma+pallas, quant_matmul wgmma+pallas, moe pallas; layers "
                      "unrolled")
    sharded = kernels_line(select_kernels("gpu", mesh_axes=(("data", 1), ("model", 2))))
    assert "attention mesh+pallas, kv_write mesh+reference, norm reference" in sharded
    interpreted = kernels_line(select_kernels("cpu", switches=Switches(gemv="pallas_interpret")))
    assert "gemv pallas_interpret, quant_matmul reference" in interpreted
    tables = "; block tables on the device"  # one GPU, a head_dim the kernel takes
    phi3 = kernels_line(select_kernels("gpu"), head_dim=96)  # Phi-3's heads: masked to 128
    assert phi3 == kernels_line(select_kernels("gpu")) + tables
    wide = kernels_line(select_kernels("gpu"), head_dim=512)
    assert ("attention reference (head_dim 512: the kernel takes an even head_dim of 16 to "
            "256), kv_write reference (head_dim 512") in wide
    assert not wide.endswith(tables)
    assert (kernels_line(select_kernels("gpu"), head_dim=128)
            == kernels_line(select_kernels("gpu")) + tables)
    assert not kernels_line(select_kernels("cpu"), head_dim=128).endswith(tables)
    assert not sharded.endswith(tables)


@pytest.mark.parametrize("flag, fragments", [
    ("--max_tokens=0", ("max_tokens",)),
    ("--top_p=1.5", ("top_p",)),
    ("--top_p=0", ("top_p",)),
    ("--temperature=-1", ("temperature",)),
])
def test_generate_rejects_bad_sampling_flags(flag, fragments):
    result = run_script("generate", f"--model={TINY_DIR}", "--prompt=hi", flag)
    assert_one_clear_error(result, *fragments)


def test_generate_rejects_missing_and_corrupt_models(tmp_path):
    assert_one_clear_error(run_script("generate", "--model=/nonexistent/model.gguf", "--prompt=hi"),
                           "/nonexistent/model.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_one_clear_error(run_script("generate", f"--model={corrupt}", "--prompt=hi"),
                           str(corrupt))
    assert_one_clear_error(run_script("generate", "--model=llama3.1-8b", "--prompt=hi"),
                           "llama3.1-8b")


def test_generate_rejects_prompt_longer_than_context():
    result = run_script("generate", f"--model={TINY_DIR}", "--max_model_len=32", "--nochat",
                        "--prompt=" + "the quick brown fox jumps over the lazy dog " * 8)
    assert_one_clear_error(result, "max_model_len", "32")


def test_convert_then_generate_gives_identical_tokens(tmp_path, cache_dir):
    out_dir = tmp_path / "tiny-orbax"
    result = run_script("convert_checkpoint", f"--input={TINY_DIR}", f"--output={out_dir}",
                        "--dtype=float32", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["tiny-orbax"]  # no temporary directory left over
    runs = [run_script("generate", f"--model={model}", "--prompt=hello there", "--json",
                       "--max_tokens=12", cache_dir=cache_dir) for model in (TINY_DIR, out_dir)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    outputs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    # The output directory is protected unless --overwrite.
    again = run_script("convert_checkpoint", f"--input={TINY_DIR}", f"--output={out_dir}")
    assert_one_clear_error(again, str(out_dir))


def test_failed_conversion_leaves_nothing(tmp_path):
    out_dir = tmp_path / "never"
    result = run_script("convert_checkpoint", "--input=/nonexistent/dir", f"--output={out_dir}")
    assert_one_clear_error(result, "/nonexistent/dir")
    assert os.listdir(tmp_path) == []


def test_eval_ppl_writes_json(tmp_path, cache_dir):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "ppl.json"
    result = run_script("eval_ppl", f"--model={TINY_DIR}", f"--text_file={text}",
                        "--num_tokens=64", f"--json_out={out}", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["num_tokens"] == 64 and figures["perplexity"] > 1
    assert f"{figures['perplexity']:.4f}" in result.stdout


def test_setup_jax_asks_xla_for_the_exhaustive_gemm_search_unless_told_not_to():
    """--exhaustive_gemm_search (off by default) adds XLA's flag to XLA_FLAGS before jax
    starts; without it nothing is added, and a setting already in XLA_FLAGS wins."""
    code = ("import os, sys; from absl import flags; from scripts import common; "
            "flags.FLAGS(sys.argv); common.setup_jax(); print(os.environ.get('XLA_FLAGS', ''))")
    flag = "--xla_gpu_exhaustive_tiling_search"
    on = "--exhaustive_gemm_search"
    cases = [((on,), "", f"{flag}=true"), ((), "", ""), ((on,), f"{flag}=false", f"{flag}=false"),
             ((on,), "--xla_dump_to=/tmp/x", f"--xla_dump_to=/tmp/x {flag}=true")]
    for args, before, want in cases:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=before)
        result = subprocess.run([sys.executable, "-c", code, "--compilation_cache_dir=", *args],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == want, result.stdout


def test_setup_jax_gives_jax_most_of_a_gpu_unless_the_user_chose_the_pool():
    """The scripts ask jax's GPU allocator for GPU_MEMORY_POOL_FRACTION of the card (jax's own
    default leaves a quarter unused); a pool the user set (its fraction, preallocation or
    allocator) is left as it is."""
    code = ("import os, sys; from absl import flags; from scripts import common; "
            "flags.FLAGS(sys.argv); common.setup_jax(); "
            "from engine.memory import POOL_VARIABLES; "
            "print({k: os.environ[k] for k in POOL_VARIABLES if k in os.environ})")
    cases = [({}, {"XLA_CLIENT_MEM_FRACTION": "0.95"}),
             ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_CLIENT_MEM_FRACTION": "0.5"}),
             ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"}),
             ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
              {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})]
    for before, want in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
        env.update(JAX_PLATFORMS="cpu", **before)
        result = subprocess.run([sys.executable, "-c", code, "--compilation_cache_dir="],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == repr(want), (before, result.stdout)


def test_a_gpu_engine_on_jax_s_default_pool_says_how_to_enlarge_it():
    """The KV summary's hint (engine.memory.memory_pool_hint): only on a GPU, and only while no
    pool variable is set (the scripts set one; a Python API user may not have)."""
    from engine.memory import memory_pool_hint
    hint = memory_pool_hint("gpu", {})
    assert hint is not None and "XLA_CLIENT_MEM_FRACTION=0.95" in hint
    assert memory_pool_hint("cpu", {}) is None
    assert memory_pool_hint("gpu", {"XLA_CLIENT_MEM_FRACTION": "0.8"}) is None
    assert memory_pool_hint("gpu", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) is None


def test_write_json_replaces_the_file_whole(tmp_path):
    """scripts.common.write_json: each call leaves the complete latest object and no temporary
    file; a dump that fails half-way (an object JSON cannot hold) leaves the previous file as
    it was."""
    from scripts.common import write_json
    path = str(tmp_path / "rows.json")
    rows = []
    for i in range(3):
        rows.append({"row": i, "us": float(np.random.default_rng(i).uniform(1, 9))})
        write_json(path, {"rows": rows})
        assert json.loads(open(path).read()) == {"rows": rows}
    assert os.listdir(tmp_path) == ["rows.json"]

    class Unwritable:
        def __str__(self):
            raise RuntimeError("cannot be written")
    with pytest.raises(RuntimeError, match="cannot be written"):
        write_json(path, {"rows": rows + [{"bad": Unwritable()}]})
    assert json.loads(open(path).read()) == {"rows": rows}  # the last whole file stands
    assert os.listdir(tmp_path) == ["rows.json"]


def test_the_start_up_line_says_the_compilation_cache_is_off_only_when_it_is():
    # the line reads jax's own setting: --compilation_cache_dir='' leaves a cache that
    # JAX_COMPILATION_CACHE_DIR names (as this test run's) on
    import jax

    from scripts.common import startup_summary
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", "/tmp/some-cache")
        assert startup_summary(1.25).startswith("ready in 1.2s; ")
        assert "off" not in startup_summary(1.25)
        jax.config.update("jax_compilation_cache_dir", None)
        assert startup_summary(1.25).endswith(" (compilation cache off)")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_compile_progress_gives_a_time_left_only_once_it_means_something():
    """One job at a time: the average pace times the jobs left. Side by side, the first jobs to
    finish are the cheap ones, so no time left until as many have finished as run at once."""
    assert progress_line("compiling", 2, 10, 4.0) == "compiling 2/10 (4.0s, about 16s left)"
    assert progress_line("compiling", 1, 13, 1.7, at_once=16) == "compiling 1/13 (1.7s, 13 at once)"
    assert progress_line("compiling", 15, 40, 30.0, at_once=16) == \
        "compiling 15/40 (30.0s, 16 at once)"
    assert progress_line("compiling", 16, 40, 32.0, at_once=16) == \
        "compiling 16/40 (32.0s, about 48s left)"
    assert progress_line("compiling", 40, 40, 80.0, at_once=16) == "compiling 40/40 (80.0s)"
