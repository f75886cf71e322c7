"""Shared fixture of the kernels' CPU lowering tests: Pallas's Triton lowering as for an H200."""
from __future__ import annotations

import pytest


@pytest.fixture
def h200_lowering(monkeypatch):
    """Lowers Pallas calls for an H200 on any host, and checks every Triton module with the op
    verifiers that XLA's Triton parser runs on the GPU (types an op does not take, say).
    Yields the list of verified modules (one True per pallas_call lowered)."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module
    verified = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        assert result.module.operation.verify()
        verified.append(True)
        return result
    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module",
                        lower_and_verify)
    yield verified
