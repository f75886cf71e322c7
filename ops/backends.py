"""The kernel backends as data: one table per op family, the choice made once, and its printout.

Each table lists, per family, which implementation runs for which (platform, layout, dtype,
rows or shape class), under the KernelBackends value that selects it (`KernelEntry.backend`):

    "pallas"     the family's kernel on its platform, chosen by kernels.<family> == "pallas"
                 (or "pallas_interpret": the same kernel, interpreted): Pallas Triton on a GPU,
                 Pallas Mosaic TPU on a TPU (kernels.platform "tpu"); within it, the rows
                 name the shape classes the dispatch function routes to each implementation
    "wgmma"      the Hopper kernel (Pallas Mosaic GPU), with kernels.wgmma
    "reference"  plain jnp / XLA, every platform
    "mesh"       a sharded step (kernels.mesh): the family runs per shard under shard_map
    "any"        whatever the choice (the float products: XLA's dot on every platform)

`select_kernels` is the pure function that makes the choice from the platform, the device and
the switches (configs/switches.py); `device_kernels` applies it to this process's device. The
runner calls it once when it is built and passes the result down to models.llama.forward.
`describe_kernels` prints the entries a choice runs (the start-up summary, --print_kernels).
Tuned tiles stay in the kernels' own tile tables (ops/*_tiles.py, `*_config` functions).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from configs.switches import Switches
from ops import gemv, quant_gemv, quant_gemv8, quant_matmul, quant_mma, quant_wgmma, rms_norm
from ops import (expert_gemm, expert_gemv, moe_matmul, moe_router, ragged_attention, rope_kv,
                 tpu_quant_matmul)
from ops import tpu_ragged_attention
from ops.kernel_choice import KernelBackends
from ops.matmul import coded_product
from ops.paged_attention import ragged_attention_by_groups, write_kv
from ops.ragged_attention import ragged_paged_attention_reference
from ops.sharded_attention import sharded_step_attention, sharded_write_kv
from ops.tpu_chips import generation_of_device_kind

PLATFORMS = ("cpu", "gpu", "tpu")
PAGES = "pages [KVH, P, S, D]"
TAGS = ("pallas", "wgmma", "reference", "mesh", "any")


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """One row of a family's table: `impl` runs for this (platform, layout, dtype, rows) when
    the KernelBackends select `backend` (one of TAGS)."""

    backend: str
    platform: str
    layout: str
    dtype: str
    rows: str
    impl: Callable

    @property
    def impl_name(self) -> str:
        return f"{self.impl.__module__}.{self.impl.__qualname__}"


TABLES: dict[str, tuple[KernelEntry, ...]] = {
    "attention": (
        KernelEntry("mesh", "any", f"{PAGES} split over (model: heads, data: sequences)",
                    "any", "any", sharded_step_attention),
        KernelEntry("pallas", "gpu", PAGES, "bf16 / f16 / f32 q; int8 / fp8 pages",
                    "head_dim even, 16-256 (rows read as the next power of two, masked)",
                    ragged_attention._ragged_attention_pallas),
        KernelEntry("pallas", "gpu", PAGES, "any", "other head_dim",
                    ragged_paged_attention_reference),
        KernelEntry("pallas", "tpu", f"{PAGES}, a (head, page) per DMA",
                    "bf16 / f32 q; int8 / fp8 pages", "any (head_dim a multiple of 128 on "
                    "hardware)", tpu_ragged_attention._tpu_ragged_attention),
        KernelEntry("reference", "any", PAGES, "any", "decode and prefill groups",
                    ragged_attention_by_groups),
    ),
    "kv_write": (
        KernelEntry("mesh", "any", f"{PAGES} split over (model: heads, data: sequences)",
                    "any", "any", sharded_write_kv),
        KernelEntry("pallas", "gpu", f"{PAGES}, q/k/v fused or three", "float pages in the "
                    "q/k/v dtype", "head_dim even, 16-256, N >= 1",
                    rope_kv._rope_kv_pallas),
        KernelEntry("pallas", "gpu", f"{PAGES} + scales [KVH, P, S]", "int8 / fp8 pages "
                    "(the kernel stores no scales)", "any", rope_kv.rope_and_write_kv_reference),
        KernelEntry("pallas", "gpu", PAGES, "any", "other head_dim",
                    rope_kv.rope_and_write_kv_reference),
        KernelEntry("reference", "any", PAGES, "any", "any", rope_kv.rope_and_write_kv_reference),
        KernelEntry("reference", "any", PAGES, "any", "the scatter alone", write_kv),
    ),
    "norm": (
        KernelEntry("pallas", "gpu", "[N, H]", "weight in x's dtype",
                    f"{rms_norm.KERNEL_ROWS[0]}-{rms_norm.KERNEL_ROWS[1]} rows",
                    rms_norm._rms_norm_pallas),
        KernelEntry("pallas", "gpu", "[N, H]", "any", "other rows",
                    rms_norm.rms_norm_reference),
        KernelEntry("reference", "any", "[N, H]", "any", "any", rms_norm.rms_norm_reference),
    ),
    "matmul": (
        KernelEntry("any", "any", "weight [in, out]", "float", "any", jnp.dot),
        KernelEntry("any", "any", "weight stored [out, in]", "float", "steps not fused below",
                    jax.lax.dot_general),
    ),
    "gemv": (
        KernelEntry("pallas", "gpu", "weight stored [out, in] (norm, SiLU, residual fused)",
                    "bf16 x; bf16 or INT8 / INT4 codes", f"{gemv.MAX_ROWS} row",
                    gemv.gemv),
        KernelEntry("pallas", "gpu", "weight stored [out, in]", "other dtypes or codes", "any",
                    gemv.gemv_reference),
        KernelEntry("wgmma", "gpu (Hopper)", "codes stored [out, in]",
                    "INT4 gate/up and down (runs_apart)", f"{gemv.MAX_ROWS} row",
                    quant_wgmma.wgmma_matmul),
        KernelEntry("reference", "any", "weight stored [out, in]", "any", "any",
                    gemv.gemv_reference),
    ),
    "quant_matmul": (
        KernelEntry("wgmma", "gpu (Hopper)", "codes stored [N, K]", "bf16 x and scales",
                    f"1-{quant_wgmma.MAX_ROWS} rows one tile; row tiles; warp-specialized "
                    f"from {quant_wgmma.LARGE_M_ROWS}", quant_wgmma.wgmma_matmul),
        KernelEntry("pallas", "gpu", "codes [K, N]", "float x", "1-2 rows (fma)",
                    quant_gemv.gemv_kernel),
        KernelEntry("pallas", "gpu", "codes [K, N]", "per-channel INT8, N % 4 == 0",
                    "1-2 rows (fma, words)", quant_gemv8.gemv8_call),
        KernelEntry("pallas", "gpu", "codes [K, N] or [N, K]", "float x", "3-16 rows (mma)",
                    quant_mma._mma_kernel),
        KernelEntry("pallas", "gpu", "codes [K, N] or [N, K]", "float x", "17-128 rows (dot)",
                    quant_matmul._matmul_kernel),
        KernelEntry("pallas", "gpu", "codes [K, N] or [N, K]", "float x",
                    "> 128 rows (XLA dequantize + dot)", quant_matmul.int4_matmul_reference),
        KernelEntry("pallas", "tpu", "codes [K, N]", "INT4 / INT8, N and the group a multiple "
                    "of 128", "any (rows padded to 16, blocks of 256)",
                    tpu_quant_matmul._tpu_quant_matmul),
        KernelEntry("pallas", "tpu", "codes [K, N] or stored [N, K]", "other shapes", "any",
                    quant_matmul.int4_matmul_reference),
        KernelEntry("reference", "any", "codes [K, N]", "any", "any",
                    quant_matmul.int4_matmul_reference),
        KernelEntry("reference", "any", "codes [K, N]", "INT8", "any",
                    quant_matmul.int8_matmul_reference),
        KernelEntry("reference", "any", "codes stored [N, K]", "any", "any", coded_product),
    ),
    "moe": (
        KernelEntry("pallas", "gpu", "experts [E, K, N], each row's expert given",
                    "bf16 x; bf16 experts or INT8 / INT4 codes",
                    f"decode (rows <= E, or <= {expert_gemv.MAX_ROWS_PER_EXPERT} E sorted by "
                    "expert where the grouped kernel refuses); K, N and groups whole tiles",
                    expert_gemv.expert_gemv),
        KernelEntry("pallas", "gpu", "experts [E, K, N], rows sorted by expert",
                    "bf16 x; bf16 experts or INT8 / INT4 codes",
                    f"more rows than E, up to {expert_gemm.MAX_ROWS}; K, N and groups whole "
                    "tiles", expert_gemm.expert_group_matmul),
        KernelEntry("pallas", "gpu", "experts [E, K, N], rows sorted by expert",
                    "other dtypes or shapes", "more rows than E", moe_matmul.grouped_matmul),
        KernelEntry("pallas", "gpu", "experts [E, K, N], each row's expert given",
                    "other dtypes or shapes", "decode (rows <= E)", moe_matmul.rows_matmul),
        KernelEntry("pallas", "gpu", "codes [E, K, N], each row's expert given",
                    "other dtypes or shapes", "decode (rows <= E)",
                    moe_matmul.rows_coded_matmul),
        KernelEntry("reference", "any", "experts [E, K, N], each row's expert given", "float",
                    "decode (rows <= E): the gathered form", moe_matmul.rows_matmul),
        KernelEntry("reference", "any", "codes [E, K, N], each row's expert given",
                    "INT8 / INT4", "decode (rows <= E): the gathered form",
                    moe_matmul.rows_coded_matmul),
        KernelEntry("pallas", "gpu", "router [H, E] with the RMSNorm before it",
                    "bf16 rows, norm weight and router",
                    f"decode (rows <= {moe_router.MAX_ROWS})", moe_router._route_rows_pallas),
        KernelEntry("pallas", "gpu", "router [H, E] with the RMSNorm before it",
                    "other dtypes or shapes", "any", moe_router.route_rows_reference),
        KernelEntry("reference", "any", "router [H, E] with the RMSNorm before it", "any",
                    "any", moe_router.route_rows_reference),
    ),
}


def active_tags(kernels: KernelBackends, family: str) -> tuple[str, ...]:
    """The KernelEntry.backend values that `kernels` runs for `family`."""
    if family not in TABLES:
        raise ValueError(f"active_tags: family {family!r} must be one of {tuple(TABLES)}")
    if family == "matmul":
        return ("any",)
    choice = getattr(kernels, family)
    tags = ("reference",) if choice == "reference" else ("pallas",)
    if family in ("quant_matmul", "gemv") and kernels.wgmma and choice != "reference":
        tags = ("wgmma",) + tags
    if family in ("attention", "kv_write") and kernels.mesh:
        tags = ("mesh",) + tags
    return tags


def select_kernels(platform: str, *, hopper: bool = False, switches: Switches | None = None,
                   mesh_axes: tuple[tuple[str, int], ...] = (),
                   device_kind: str = "") -> KernelBackends:
    """The kernel choice for a device (pure: same arguments, same choice).

    platform: jax's backend name, "cpu", "gpu" or "tpu". hopper: the GPU is a Hopper (compute
    capability 9.x, wgmma). switches: configs/switches.py (default: none set). mesh_axes:
    ((axis, size), ...) of a sharded step's (data, model) mesh, () for one device.
    "auto" switches take the Pallas kernels on a GPU and a TPU and the reference elsewhere.
    Under a mesh the RoPE + KV write, RMSNorm and the experts' decode products take the jnp /
    XLA path (the write then runs per shard) while attention runs its kernel per shard. On a
    TPU only attention and the quantized products have kernels (Mosaic TPU); the other
    families run XLA. device_kind (jax's Device.device_kind) picks the TPU kernels' block
    sizes. The switch PALLASITE_KERNELS=tpu_interpret makes any platform choose as a TPU does,
    with the TPU kernels interpreted.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"select_kernels: platform {platform!r} must be one of {PLATFORMS}")
    switches = Switches() if switches is None else switches
    if platform == "tpu" or switches.kernels == "tpu_interpret":
        return _select_tpu_kernels(switches, device_kind, mesh_axes)
    gpu = platform == "gpu"

    def pick(value: str) -> str:
        return ("pallas" if gpu else "reference") if value == "auto" else value

    attention = pick(switches.attention)
    fused = "reference" if mesh_axes else attention  # RoPE + KV write and RMSNorm
    wgmma = gpu and hopper and switches.wgmma == "on"
    return KernelBackends(
        platform=platform, attention=attention, kv_write=fused, norm=fused,
        gemv=pick(switches.gemv), quant_matmul=pick(switches.matmul), wgmma=wgmma,
        moe="reference" if mesh_axes else pick(switches.moe),
        k_order="wgmma" if wgmma and switches.k_order == "device" else "natural",
        mesh=tuple((str(a), int(n)) for a, n in mesh_axes),
        layer_loop=choose_layer_loop(platform, switches=switches, mesh=bool(mesh_axes)))


def _select_tpu_kernels(switches: Switches, device_kind: str,
                        mesh_axes: tuple[tuple[str, int], ...]) -> KernelBackends:
    """select_kernels on a TPU (or with the TPU kernels interpreted): the Mosaic TPU kernels of
    attention and the quantized products where the switches say auto or pallas, XLA for the
    RoPE + KV write, RMSNorm and the one-row products. Under a mesh the quantized products
    take XLA's dequantize + dot, which XLA partitions (a Mosaic call is not partitioned
    automatically; attention runs per shard under shard_map)."""
    interpret = switches.kernels == "tpu_interpret"

    def pick(value: str) -> str:
        if value == "reference":
            return value
        return "pallas_interpret" if interpret or value == "pallas_interpret" else "pallas"

    return KernelBackends(
        platform="tpu", attention=pick(switches.attention), kv_write="reference",
        norm="reference", gemv="reference",
        quant_matmul="reference" if mesh_axes else pick(switches.matmul),
        mesh=tuple((str(a), int(n)) for a, n in mesh_axes),
        tpu_generation=generation_of_device_kind(device_kind),
        layer_loop=choose_layer_loop("tpu", switches=switches, mesh=bool(mesh_axes)))


# The decoder's layer loop by platform (PALLASITE_LAYER_LOOP=auto): "scan" traces one layer body
# for every layer (models/layer_scan.py), so a step program traces, lowers and compiles faster
# (1.5-2x on the CPU); "unrolled" traces every layer. The CPU's start-up is compile-bound and its
# decode steps run as fast scanned (docs/PERFORMANCE.md); on the GPU scanned decode steps
# measured 1.8-2.8x slower (H100, llama3.1-8b), so it unrolls. The TPU is unmeasured.
DEFAULT_LAYER_LOOPS = {"cpu": "scan", "gpu": "unrolled", "tpu": "unrolled"}


def choose_layer_loop(platform: str, *, switches: Switches | None = None,
                      mesh: bool = False) -> str:
    """"scan" or "unrolled": how models.llama.forward runs the decoder layers on `platform`.

    switches.layer_loop forces it; auto takes DEFAULT_LAYER_LOOPS. Always "unrolled" on a mesh
    (each layer's pages split over the data axis). The runner still unrolls layers that cannot
    share one body (models.layer_scan.scannable).
    """
    if platform not in PLATFORMS:
        raise ValueError(f"choose_layer_loop: platform {platform!r} must be one of {PLATFORMS}")
    switches = Switches() if switches is None else switches
    if mesh:
        return "unrolled"
    return DEFAULT_LAYER_LOOPS[platform] if switches.layer_loop == "auto" else switches.layer_loop


def device_kernels(switches: Switches | None = None,
                   mesh_axes: tuple[tuple[str, int], ...] = ()) -> KernelBackends:
    """`select_kernels` for this process's default device, with the switches of the
    environment unless given (what a runner calls once when it is built)."""
    return select_kernels(jax.default_backend(), hopper=quant_wgmma.on_hopper(),
                          switches=Switches.from_env() if switches is None else switches,
                          mesh_axes=mesh_axes, device_kind=jax.devices()[0].device_kind)


def _runs_on(entry_platform: str, kernels: KernelBackends) -> bool:
    """A table entry's platform runs under `kernels`: TPU entries exactly with the TPU kernels,
    GPU entries (interpreted or not) otherwise."""
    return entry_platform == "any" or (entry_platform == "tpu") == kernels.tpu


def describe_kernels(kernels: KernelBackends) -> str:
    """A printable table of what `kernels` runs: family, backend, platform, layout, dtype,
    rows or shape class, implementation."""
    header = ("family", "backend", "platform", "layout", "dtype", "rows", "implementation")
    lines = []
    for family, entries in TABLES.items():
        tags = active_tags(kernels, family)
        interpreted = getattr(kernels, family, "") == "pallas_interpret"
        for entry in sorted((e for e in entries if e.backend in tags
                             and _runs_on(e.platform, kernels)),
                            key=lambda e: tags.index(e.backend)):
            backend = entry.backend + (" (interpreted)" if interpreted and
                                       entry.backend == "pallas" else "")
            lines.append((family, backend, entry.platform, entry.layout, entry.dtype,
                          entry.rows, entry.impl_name))
    widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    extra = [f"platform {kernels.platform}"
             + (f" (blocks for {kernels.tpu_generation})" if kernels.tpu else "")
             + f"; Hopper kernel {'on' if kernels.wgmma else 'off'}; "
             f"K order {kernels.k_order}"
             + (f"; mesh {dict(kernels.mesh)}" if kernels.mesh else "")]
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
                     + extra)
