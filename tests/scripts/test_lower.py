"""scripts.lower: the engine's step programs of a (small) serving configuration lower for TPU
from the CPU, each with the Mosaic attention kernel and, for a quantized model, the quantized
product kernel; a program without them is reported as a failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from scripts.lower import ATTENTION_KERNEL, QUANT_KERNEL, lower_serving_programs, mosaic_kernels

SMALL = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64, num_decode_steps=2)


def test_llama_8b_int4_programs_hold_both_kernels():
    report = lower_serving_programs("llama3.1-8b", quant="int4", chip="v5e", **SMALL)
    kinds = {p["kind"] for p in report["programs"]}
    assert kinds == {"step_and_argmax", "multi_step", "mixed_round"}  # decode and prefill
    assert not report["failures"], report["failures"]
    for program in report["programs"]:
        assert program["kernels"][ATTENTION_KERNEL] >= 1
        assert program["kernels"][QUANT_KERNEL] >= 1


def test_a_reference_fallback_is_a_failure():
    """The tiny model's 64-wide products are no shape for the TPU matmul kernel: XLA runs them,
    which the report flags."""
    report = lower_serving_programs("tiny-llama31", quant="int8", max_programs=1, num_pages=16,
                                    **SMALL)
    assert len(report["programs"]) == 1
    assert report["programs"][0]["kernels"] == {ATTENTION_KERNEL: 1}
    assert report["failures"] and f"no {QUANT_KERNEL}" in report["failures"][0]


def test_mosaic_kernels_counts_custom_calls():
    text = ('%1 = stablehlo.custom_call @tpu_custom_call(%0) {kernel_name = "a_b"}\n'
            '%2 = stablehlo.custom_call @tpu_custom_call(%1) {kernel_name = "a_b"}\n'
            '%3 = stablehlo.add %2, %2\n')
    assert mosaic_kernels(text) == {"a_b": 2}


def test_command_at_tp4_on_8_fake_devices():
    """The command line, sharded: every program holds the attention kernel (run per shard);
    exit status 0."""
    command = [sys.executable, "-m", "scripts.lower", "--platform=tpu", "--model=llama3.1-8b",
               "--quant=int8", "--tp=4", "--json", "--num_pages=64"] + [
                   f"--{k}={v}" for k, v in SMALL.items()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["tp"] == 4 and report["programs"] and not report["failures"]
    assert all(p["kernels"].get(ATTENTION_KERNEL) for p in report["programs"])
