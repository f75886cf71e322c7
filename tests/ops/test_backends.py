"""ops.backends and configs.switches: every table entry resolves to a real implementation, the
choice per platform takes the GPU kernels on a GPU and the references elsewhere, the switches
are validated, and the ops follow the choice they are given (not the environment)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.switches import VARIABLES, Switches
from ops import gemv, rms_norm
from ops.backends import (TABLES, TAGS, active_tags, describe_kernels, device_kernels,
                          select_kernels)
from ops.kernel_choice import IMPLS, REFERENCE, KernelBackends
from ops.matmul import TransposedWeight, device_k_order

FAMILIES = ("attention", "kv_write", "norm", "gemv", "quant_matmul", "moe")
MESH = (("data", 2), ("model", 4))


@pytest.mark.parametrize("family", sorted(TABLES))
def test_every_entry_is_a_real_callable(family):
    entries = TABLES[family]
    assert entries
    for entry in entries:
        assert callable(entry.impl), entry
        assert entry.backend in TAGS, entry
        module, _, name = entry.impl_name.rpartition(".")
        assert module and name, entry
        assert all(isinstance(f, str) and f for f in (entry.platform, entry.layout, entry.dtype,
                                                      entry.rows)), entry
    # every choice the family can be given has at least one entry
    if family != "matmul":
        assert {e.backend for e in entries} >= {"pallas", "reference"}


def test_every_choice_resolves_to_entries():
    for family in FAMILIES:
        for impl in IMPLS:
            for wgmma in (False, True):
                for mesh in ((), MESH):
                    kernels = dataclasses.replace(REFERENCE, wgmma=wgmma, mesh=mesh,
                                                  **{family: impl})
                    tags = active_tags(kernels, family)
                    assert [e for e in TABLES[family] if e.backend in tags], (family, kernels)
    with pytest.raises(ValueError, match="family 'conv'"):
        active_tags(REFERENCE, "conv")


def test_selection_per_platform():
    cpu = select_kernels("cpu")
    assert cpu == dataclasses.replace(REFERENCE, platform="cpu", layer_loop="scan")
    # a TPU: the Mosaic TPU kernels of attention (block sizes by generation), XLA elsewhere
    tpu = select_kernels("tpu", device_kind="TPU v6 lite")
    assert tpu == dataclasses.replace(REFERENCE, platform="tpu", attention="pallas",
                                      quant_matmul="pallas", tpu_generation="v6e")
    assert select_kernels("cpu", switches=Switches(kernels="tpu_interpret")) == \
        dataclasses.replace(tpu, attention="pallas_interpret", quant_matmul="pallas_interpret",
                            tpu_generation="default")
    assert "ops.tpu_ragged_attention" in describe_kernels(tpu)
    assert "ops.tpu_quant_matmul" in describe_kernels(tpu)
    sharded_tpu = select_kernels("tpu", mesh_axes=MESH)  # attention per shard; XLA products
    assert (sharded_tpu.attention, sharded_tpu.quant_matmul) == ("pallas", "reference")
    assert "ops.ragged_attention._ragged" not in describe_kernels(tpu)
    hopper = select_kernels("gpu", hopper=True)
    other = select_kernels("gpu", hopper=False)
    for kernels in (hopper, other):
        assert all(getattr(kernels, f) == "pallas" for f in FAMILIES), kernels
    assert hopper.wgmma and hopper.k_order == "wgmma"
    assert not other.wgmma and other.k_order == "natural"
    assert not select_kernels("cpu", hopper=True).wgmma  # a Hopper flag off the GPU: no wgmma
    # a sharded step: attention per shard with its kernel; RoPE + KV write and RMSNorm in jnp
    sharded = select_kernels("gpu", hopper=True, mesh_axes=MESH)
    assert (sharded.attention, sharded.kv_write, sharded.norm) == ("pallas", "reference",
                                                                  "reference")
    assert sharded.mesh_shape == {"data": 2, "model": 4} and sharded.per_shard().mesh == ()
    assert sharded.quant_matmul == "pallas" and sharded.wgmma
    assert sharded.moe == "reference"  # a mixture's products per shard in XLA
    with pytest.raises(ValueError, match="platform 'cuda'"):
        select_kernels("cuda")


def test_switches_change_the_selection():
    def gpu(**switches):
        return select_kernels("gpu", hopper=True, switches=Switches(**switches))

    assert all(getattr(gpu(attention="reference"), f) == "reference"
               for f in ("attention", "kv_write", "norm"))
    assert gpu(attention="reference").quant_matmul == "pallas"
    assert gpu(matmul="reference").quant_matmul == "reference"
    assert gpu(gemv="pallas_interpret").gemv == "pallas_interpret"
    assert gpu(moe="reference").moe == "reference" and gpu(moe="reference").gemv == "pallas"
    off = gpu(wgmma="off")
    assert not off.wgmma and off.k_order == "natural" and off.quant_matmul == "pallas"
    assert gpu(k_order="natural").k_order == "natural" and gpu(k_order="natural").wgmma
    # forced on the CPU: the interpreted kernels (debugging)
    assert select_kernels("cpu", switches=Switches(matmul="pallas_interpret")).quant_matmul \
        == "pallas_interpret"


def test_switches_parse_and_validate():
    assert Switches.from_env({}) == Switches()
    env = {"PALLASITE_ATTENTION": "Reference", "PALLASITE_WGMMA": " off ",
           "PALLASITE_K_ORDER": "natural", "PALLASITE_MATMUL": "", "UNRELATED": "x"}
    assert Switches.from_env(env) == Switches(attention="reference", wgmma="off",
                                              k_order="natural")
    for variable, (_, allowed) in VARIABLES.items():
        with pytest.raises(ValueError) as info:
            Switches.from_env({variable: "fold"})
        message = str(info.value)
        assert variable in message and "'fold'" in message and str(allowed) in message
    with pytest.raises(ValueError, match="KernelBackends: norm='triton'"):
        KernelBackends(norm="triton")
    with pytest.raises(ValueError, match="k_order='nk'"):
        KernelBackends(k_order="nk")


def test_device_kernels_on_this_machine():
    kernels = device_kernels(Switches())
    assert kernels.platform == jax.default_backend()
    assert hash(kernels) == hash(device_kernels(Switches()))  # a static argument of jit


def test_describe_lists_the_chosen_entries():
    text = describe_kernels(select_kernels("gpu", hopper=True))
    assert "ops.ragged_attention._ragged_attention_pallas" in text
    assert "ops.quant_wgmma.wgmma_matmul" in text
    assert "ops.paged_attention.ragged_attention_by_groups" not in text
    assert "Hopper kernel on" in text
    text = describe_kernels(select_kernels("cpu"))
    assert "ops.paged_attention.ragged_attention_by_groups" in text
    assert " pallas " not in text
    sharded = describe_kernels(select_kernels("gpu", mesh_axes=MESH))
    assert "ops.sharded_attention.sharded_step_attention" in sharded
    assert "ops.sharded_attention.sharded_write_kv" in sharded
    interpreted = describe_kernels(KernelBackends(gemv="pallas_interpret"))
    assert "pallas (interpreted)" in interpreted


def test_ops_follow_the_choice_not_the_environment(monkeypatch):
    """rms_norm runs its kernel when the choice says so and the reference when given none,
    whatever the environment holds; device_k_order reads only the choice."""
    monkeypatch.setenv("PALLASITE_ATTENTION", "pallas_interpret")
    calls = []
    kernel = rms_norm._rms_norm_pallas
    monkeypatch.setattr(rms_norm, "_rms_norm_pallas",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, 64), jnp.float32)
    ref = rms_norm.rms_norm(x, w, 1e-6)
    assert not calls
    got = rms_norm.rms_norm(x, w, 1e-6, kernels=KernelBackends(norm="pallas_interpret"))
    assert calls
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("PALLASITE_K_ORDER", "natural")
    words = jnp.asarray(np.random.default_rng(2).integers(0, 2 ** 31, (128, 64)), jnp.int32)
    codes = TransposedWeight(words, jnp.ones((4, 128), jnp.bfloat16), group_size=128)
    assert device_k_order(codes) == "natural"  # kernels None: no Hopper kernel
    assert not gemv.runs_apart(codes, 1, None)
