"""The environment switches: the one module of the product that reads `PALLASITE_*` variables.

They are read once, when a runner is built (`Switches.from_env`), validated, and turned into the
kernel choice (ops.backends.select_kernels) that is passed down to the ops; nothing reads them
while a step is traced. Unset or empty means the default.

| variable            | values                                    | default | selects              |
|---------------------|-------------------------------------------|---------|----------------------|
| PALLASITE_ATTENTION | auto, pallas, pallas_interpret, reference | auto    | attention/KV/RMSNorm |
| PALLASITE_MATMUL    | auto, pallas, pallas_interpret, reference | auto    | quantized matmuls    |
| PALLASITE_GEMV      | auto, pallas, pallas_interpret, reference | auto    | one-row products     |
| PALLASITE_MOE       | auto, pallas, pallas_interpret, reference | auto    | MoE router, experts  |
| PALLASITE_WGMMA     | on, off                                   | on      | Hopper codes kernel  |
| PALLASITE_K_ORDER   | device, natural                           | device  | K order of codes     |
| PALLASITE_KERNELS   | device, tpu_interpret                     | device  | platform's kernels   |
| PALLASITE_LAYER_LOOP| auto, scan, unrolled                      | auto    | decoder layer loop   |
| PALLASITE_API_KEY   | any string                                | unset   | scripts.serve's key  |

auto: the Pallas kernels on a GPU, the jnp / XLA reference elsewhere; pallas forces the kernel,
pallas_interpret runs it interpreted (debugging on the CPU), reference the jnp / XLA path.
PALLASITE_WGMMA=off keeps codes stored [N, K] on the Triton paths instead of ops/quant_wgmma.py.
PALLASITE_K_ORDER=natural stores codes in natural K order even where the Hopper kernel reads a
reordered K faster. PALLASITE_KERNELS=tpu_interpret runs the TPU kernels (Pallas Mosaic TPU) in
TPU interpret mode on any backend, with the TPU's choice of every other op family (verification
on the CPU). PALLASITE_LAYER_LOOP=scan compiles one decoder layer body for all layers
(models/layer_scan.py), unrolled traces every layer; auto: ops.backends.DEFAULT_LAYER_LOOPS.
PALLASITE_API_KEY is the bearer key scripts.serve requires when --api_key
is not given (kept as it is, not lower-cased).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

IMPL_VALUES = ("auto", "pallas", "pallas_interpret", "reference")

# variable -> (field, allowed values; the first is the default)
VARIABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "PALLASITE_ATTENTION": ("attention", IMPL_VALUES),
    "PALLASITE_MATMUL": ("matmul", IMPL_VALUES),
    "PALLASITE_GEMV": ("gemv", IMPL_VALUES),
    "PALLASITE_MOE": ("moe", IMPL_VALUES),
    "PALLASITE_WGMMA": ("wgmma", ("on", "off")),
    "PALLASITE_K_ORDER": ("k_order", ("device", "natural")),
    "PALLASITE_KERNELS": ("kernels", ("device", "tpu_interpret")),
    "PALLASITE_LAYER_LOOP": ("layer_loop", ("auto", "scan", "unrolled")),
}


@dataclasses.dataclass(frozen=True)
class Switches:
    """The parsed switches (see the module table); every field holds one of its allowed values."""

    attention: str = "auto"
    matmul: str = "auto"
    gemv: str = "auto"
    moe: str = "auto"
    wgmma: str = "on"
    k_order: str = "device"
    kernels: str = "device"
    layer_loop: str = "auto"
    api_key: str | None = None

    def __post_init__(self):
        for variable, (field, allowed) in VARIABLES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"{variable}={value!r}: must be one of {allowed}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Switches":
        """The switches set in `environ` (default os.environ); raises ValueError naming the
        variable, its value and the allowed values when one is not recognised."""
        environ = os.environ if environ is None else environ
        values = {}
        for variable, (field, _) in VARIABLES.items():
            value = environ.get(variable, "").strip().lower()
            if value:
                values[field] = value
        api_key = environ.get("PALLASITE_API_KEY", "")
        return cls(**values, api_key=api_key or None)
