"""End to end: scripts.quantize writes a checkpoint that generate and eval_ppl load and run."""
from __future__ import annotations

import json
import os

import pytest

from tests.scripts.test_scripts import TINY_DIR, assert_one_clear_error, run_script


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def test_quantize_then_generate_and_eval_ppl(tmp_path, cache_dir):
    out_dir = str(tmp_path / "tiny-gptq")
    result = run_script("quantize", f"--model={TINY_DIR}", "--method=int4_gptq",
                        "--group_size=32", "--act_order", "--calib_tokens=256",
                        "--calib_seq_len=64", f"--output={out_dir}", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "int4_gptq" in result.stdout and out_dir in result.stdout
    with open(os.path.join(out_dir, "pallasite_config.json")) as f:
        settings = json.load(f)["quantization"]
    assert settings["method"] == "int4_gptq" and settings["act_order"]
    assert settings["calibration"]["tokens"] == 256
    assert "common-licenses" in settings["calibration"]["text"] or \
        "stdlib" in settings["calibration"]["text"]

    gen = run_script("generate", f"--model={out_dir}", "--prompt=hello there", "--json",
                     "--max_tokens=6", "--nochat", cache_dir=cache_dir)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert len(json.loads(gen.stdout.strip().splitlines()[-1])["token_ids"]) == 6

    json_out = str(tmp_path / "ppl.json")
    ppl = run_script("eval_ppl", f"--model={out_dir}", "--num_tokens=64", "--kv_cache_dtype=fp8",
                     f"--json_out={json_out}", cache_dir=cache_dir)
    assert ppl.returncode == 0, ppl.stderr[-2000:]
    with open(json_out) as f:
        report = json.load(f)
    assert report["kv_cache_dtype"] == "fp8" and report["num_tokens"] == 64
    assert 1 < report["perplexity"] < float("inf") and report["weight_bytes"] > 0


def test_quantize_reports_short_calibration_text(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("only a few words of calibration text")
    result = run_script("quantize", f"--model={TINY_DIR}", "--method=int4_awq",
                        f"--calib_text={text}", "--calib_tokens=4096",
                        f"--output={tmp_path / 'out'}")
    assert_one_clear_error(result, "calibration text", "--calib_tokens")
    assert not (tmp_path / "out").exists()


def test_quantize_lm_head_of_a_tied_model_is_one_clear_error(tmp_path):
    """--quantize_lm_head on a model whose head is its embedding: a one-line error, nothing
    written."""
    result = run_script("quantize", f"--model={TINY_DIR}", "--method=int8", "--quantize_lm_head",
                        f"--output={tmp_path / 'out'}")
    assert_one_clear_error(result, "untied output head")
    assert not (tmp_path / "out").exists()


def test_int8_checkpoint_with_gemv_layers(tmp_path, cache_dir):
    """An INT8 checkpoint run with --gemv_layers (codes stored [out, in] with their scales,
    one-row steps through ops/gemv.py's fused product): the same greedy tokens as without."""
    out_dir = str(tmp_path / "tiny-int8")
    result = run_script("quantize", f"--model={TINY_DIR}", "--method=int8",
                        f"--output={out_dir}", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = []
    for flags in ((), ("--fuse_projections", "--gemv_layers")):
        gen = run_script("generate", f"--model={out_dir}", "--prompt=hello there",
                         "--prompt=the sea", "--json", "--max_tokens=8", "--nochat",
                         "--max_num_seqs=1", "--nowarmup", *flags, cache_dir=cache_dir)
        assert gen.returncode == 0, gen.stderr[-2000:]
        runs.append([json.loads(line)["token_ids"] for line in gen.stdout.strip().splitlines()])
        assert ("layers transposed for the batch-1 gemv kernel" in gen.stderr) == bool(flags)
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])
