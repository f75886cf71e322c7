"""Which cases of a kernel's test matrix `make test-gpu` runs (the tests marked `gpu`).

The CPU runs a kernel's whole matrix interpreted; on a GPU every case compiles for real, so the
GPU command takes a handful of shapes per kernel (all of them under PALLASITE_GPU_SWEEP=1).
"""
from __future__ import annotations

import os

import pytest

GPU_SWEEP = os.environ.get("PALLASITE_GPU_SWEEP") == "1"


def gpu_picks(cases, picks) -> list:
    """`cases` for pytest.mark.parametrize with those at the indices `picks` marked `gpu`
    (every case under PALLASITE_GPU_SWEEP=1); a case may already be a pytest.param."""
    out = []
    for i, case in enumerate(cases):
        if GPU_SWEEP or i in picks:
            if isinstance(case, type(pytest.param())):
                case = pytest.param(*case.values, marks=(*case.marks, pytest.mark.gpu),
                                    id=case.id)
            else:
                case = pytest.param(*case, marks=pytest.mark.gpu)
        out.append(case)
    return out
