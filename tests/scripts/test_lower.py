"""scripts.lower: the engine's step programs of a (small) serving configuration lower for TPU
from the CPU, each with the Mosaic attention kernel and, for a quantized model, the quantized
product kernel; a program without them is reported as a failure. For a GPU, each with the
Triton attention kernel and a mixture's expert kernels, each kernel lowered once a program."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from scripts.lower import (ATTENTION_KERNEL, GPU_ATTENTION_KERNEL, QUANT_KERNEL, gpu_kernels,
                           lower_serving_programs, mosaic_kernels)

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


def test_gpu_programs_of_an_int4_mixture_hold_each_kernel_once():
    """qwen3-30b-a3b in INT4 for an H100: decode steps run the router, the one-row expert kernel
    (gate-up and down) and the INT4 attention products; a prefill step the grouped expert
    kernel. However many layers call them, each distinct kernel is lowered once a step body
    (a mixed round has two: its mixed step and its decode steps)."""
    report = lower_serving_programs("qwen3-30b-a3b", quant="int4", platform="gpu", gpu="h100",
                                    num_pages=64, **dict(SMALL, max_num_batched_tokens=64))
    assert report["target"] == "NVIDIA H100 80GB HBM3" and not report["failures"]
    kernels = [p["kernels"] for p in report["programs"]]
    decode = [k for k, p in zip(kernels, report["programs"]) if "num_tokens=1," in p["shape"]]
    assert decode and all(k["expert_gemv4"] == 2 and k["moe_router_top_k"] == 1 for k in decode)
    assert any("expert_gemm4" in k for k in kernels)  # the prefill steps' sorted pairs
    bodies = [2 if p["kind"] == "mixed_round" else 1 for p in report["programs"]]  # step bodies
    assert all(k[GPU_ATTENTION_KERNEL] == n and max(k.values()) <= 2 * n  # 48 layers: 1 a body
               for k, n in zip(kernels, bodies))
    assert all(p["seconds"] > 0 for p in report["programs"])


def test_gpu_kernels_counts_triton_and_mosaic_calls():
    text = ('%1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%0) {mhlo.backend_config = '
            '{grid_x = 1 : i32, ir = "ML\\EFR", name = "a_b", num_warps = 4 : i32}}\n'
            '%2 = stablehlo.custom_call @mosaic_gpu_v2(%1) {mhlo.backend_config = {}}\n'
            '%3 = stablehlo.custom_call @__gpu$xla.gpu.triton(%2) {mhlo.backend_config = '
            '{ir = "x", name = "a_b"}}\n')
    assert gpu_kernels(text) == {"a_b": 2, "mosaic_gpu": 1}
