"""`KernelBackends`: which implementation each op family runs, chosen once and passed down.

A runner builds one (ops.backends.select_kernels, from the platform, the device and the
switches) when it is built and passes it to models.llama.forward as a static argument, which
hands it to every op. The ops read their choice from it and never look at the environment,
the default backend or the active mesh. `REFERENCE` (every family in plain jnp / XLA) is the
default of a direct call that passes none, as the tests do on the CPU.
"""
from __future__ import annotations

import dataclasses

IMPLS = ("pallas", "pallas_interpret", "reference")  # the choices of one op family
K_ORDERS = ("natural", "wgmma")
LAYER_LOOPS = ("scan", "unrolled")


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """One implementation per op family (hashable: a static argument of the jitted step).

    attention, kv_write (RoPE + KV-cache write), norm (RMSNorm), gemv (the fused one-row products
    of transposed layers), quant_matmul (INT8 / INT4 codes) and moe (a mixture of experts' decode
    router and products, ops/moe_router.py and ops/expert_gemv.py): one of IMPLS, "pallas"
    being the GPU kernel (Pallas Triton) where the shape class takes it, "pallas_interpret"
    the same kernel interpreted (CPU debugging), "reference" the jnp / XLA path.
    wgmma: codes stored [N, K] run ops/quant_wgmma.py's Hopper kernel (Mosaic GPU) where it
    takes the product (with quant_matmul "pallas").
    k_order: the K order in which decode products read codes fastest ("wgmma" with the Hopper
    kernel, else "natural"; ops.matmul.device_k_order).
    mesh: ((axis, size), ...) of the step's (data, model) mesh when the step is sharded:
    attention and the KV write then run per shard under shard_map; () for one device.
    platform "tpu" makes "pallas" / "pallas_interpret" the TPU kernels (Pallas Mosaic TPU) of
    attention and quant_matmul; tpu_generation picks their block sizes
    (ops/tpu_attention_tiles.py; ops.tpu_chips names the generations).
    layer_loop: "scan" (one compiled layer body, models/layer_scan.py) or "unrolled" (every
    layer traced apart), ops.backends.choose_layer_loop.
    """

    platform: str = "cpu"
    attention: str = "reference"
    kv_write: str = "reference"
    norm: str = "reference"
    gemv: str = "reference"
    quant_matmul: str = "reference"
    moe: str = "reference"
    wgmma: bool = False
    k_order: str = "natural"
    mesh: tuple[tuple[str, int], ...] = ()
    tpu_generation: str = "default"
    layer_loop: str = "unrolled"

    @property
    def tpu(self) -> bool:
        """The Pallas choices run the TPU kernels."""
        return self.platform == "tpu"

    def __post_init__(self):
        for family in ("attention", "kv_write", "norm", "gemv", "quant_matmul", "moe"):
            if getattr(self, family) not in IMPLS:
                raise ValueError(f"KernelBackends: {family}={getattr(self, family)!r} must be "
                                 f"one of {IMPLS}")
        if self.k_order not in K_ORDERS:
            raise ValueError(f"KernelBackends: k_order={self.k_order!r} must be one of {K_ORDERS}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"KernelBackends: layer_loop={self.layer_loop!r} must be one of "
                             f"{LAYER_LOOPS}")

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The step mesh's axis sizes ({} for one device)."""
        return dict(self.mesh)

    def per_shard(self) -> "KernelBackends":
        """The same choice for the body of a shard_map: every op on its own shard."""
        return dataclasses.replace(self, mesh=())


REFERENCE = KernelBackends()


def or_reference(kernels: KernelBackends | None) -> KernelBackends:
    """kernels, or REFERENCE for a direct call that passes none."""
    return REFERENCE if kernels is None else kernels


def choose_impl(name: str, impl: str | None, default: str) -> str:
    """An explicit impl (validated: one of IMPLS), else the kernel choice's `default`."""
    if impl is None:
        return default
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl {impl!r} must be None or one of {IMPLS}")
    return impl
