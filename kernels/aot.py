"""`specdec aot`: compile the verify megakernel for a real TPU topology on a CPU host.

    specdec aot --config qwen3-8b --topology tpu7x:2x2x1 --tree-nodes 64 \\
        --context 4096 --dtype bfloat16 --acceptance-length 4 [--json]

libtpu's topology description (`jax.experimental.topologies.get_topology_desc`)
gives abstract devices of the chip; the verify step is lowered for one of them
with `ShapeDtypeStruct` weights and caches (no memory is allocated, so an 8B model
compiles on a laptop) and compiled by the real Mosaic and XLA TPU compilers, which
reject kernels whose VMEM or layouts do not fit. No local accelerator is needed:
JAX stays on its CPU backend (`JAX_PLATFORMS=cpu` works; `main` pins it when unset).

The report: compile status and time; the VMEM the kernel allocates explicitly
(scratch + VMEM operands, `tuning.vmem_buffers`) against the chip's VMEM per
TensorCore, with the compiler limit set `tuning.VMEM_HEADROOM` below it; the HBM
bytes one verify step must read (weights + committed KV); and the memory-bound
ceiling in steps/s and tokens/s at the given acceptance length.

By default the megakernel's `pallas_call` with its operand preparation is compiled
(that is everything of a greedy step). `--with-sampling` compiles the full
`kernel.verify`, including the XLA stochastic-acceptance branch (vocabulary sort);
XLA takes about a minute on that branch for an 8k vocabulary.

Config paths are read by the caller's `load_config` (kernels/ never reads
checkpoint files): the CLI passes `specdec.checkpoint.load_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge

from specdec.kernels import transformer
from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.megakernel import kernel, tuning
from specdec.kernels.megakernel.tuning import MIB, BlockSizes
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

PRESETS = {
    # The bundled demo target's config (specdec/assets/demo/target/config.json).
    "demo-target": ModelConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
        num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, architecture=Architecture.QWEN3,
        qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    ),
    # Dense, the size class of the seed's Qwen3.8-27B.
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_heads=64, num_kv_heads=8, head_dim=128, architecture=Architecture.QWEN3,
        qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    ),
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
        max_position_embeddings=131072, rope_scaling=RopeScaling(),
    ),
}  # fmt: skip

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class AotReport:
    """Everything `specdec aot` prints (`--json` prints it as a dict)."""

    config: str  # preset name or path
    topology: str
    device_kind: str
    compiled: bool
    fits: bool  # compiled, and the explicit VMEM leaves tuning.VMEM_HEADROOM free
    error: str | None  # the compiler's reason when not compiled, or the headroom shortfall
    compile_s: float
    what: str  # "megakernel" or "verify step (with sampling)"
    batch: int
    tree_nodes: int
    context: int
    dtype: str
    block_sizes: dict
    vmem_bytes: int  # explicitly allocated by the kernel (scratch + VMEM operands)
    vmem_capacity_bytes: int  # per TensorCore
    vmem_limit_bytes: int  # handed to the compiler: capacity - headroom
    weight_bytes: int  # HBM bytes of weights one step reads
    kv_bytes: int  # HBM bytes of committed KV one step reads
    read_bytes: int  # weight_bytes + kv_bytes
    write_bytes: int  # tree K/V written + logits emitted
    hbm_bytes_per_s: float  # per chip
    cores_per_chip: int
    steps_per_s: float  # read_bytes-bound ceiling at the chip's bandwidth
    acceptance_length: float
    tokens_per_s: float  # steps_per_s * acceptance_length * batch
    resident_bytes: int = 0  # HBM the device holds: every weight + the K/V cache
    hbm_capacity_bytes: int = 0  # HBM per device


def weight_read_bytes(cfg: ModelConfig, dtype, rows: int) -> int:
    """HBM bytes of weights one step reads: every layer and the LM head, `rows` embeddings."""
    shapes = transformer.param_shapes(cfg)
    itemsize = np.dtype(dtype).itemsize
    total = sum(math.prod(s) for s in shapes["layers"].values()) + cfg.hidden_size
    total += cfg.vocab_size * cfg.hidden_size  # LM head (the embedding table when tied)
    total += rows * cfg.hidden_size  # embedding rows of the verify block
    return total * itemsize


def kv_read_bytes(cfg: ModelConfig, dtype, *, batch: int, context: int) -> int:
    """HBM bytes of committed K and V one step reads (every layer and KV head)."""
    per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(dtype).itemsize
    return batch * context * per_pos


def resident_bytes(cfg: ModelConfig, dtype, *, batch: int, max_len: int) -> tuple[int, int]:
    """HBM a one-device target holds: (every weight, the K/V cache of `batch` rows of
    `max_len` positions)."""
    itemsize = np.dtype(dtype).itemsize
    shapes = jax.tree.leaves(transformer.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    weights = sum(math.prod(s) for s in shapes) * itemsize
    return weights, kv_read_bytes(cfg, dtype, batch=batch, context=max_len)


def check_device_memory(cfg, chip, dtype, *, batch: int, max_len: int, name: str = "") -> int:
    """The HBM bytes one device holds (weights + K/V cache); refuses, before any
    compiling, a target whose bytes exceed the device's HBM (ValueError with both)."""
    weights, kv = resident_bytes(cfg, dtype, batch=batch, max_len=max_len)
    cap = chip.hbm_bytes_per_device
    if weights + kv > cap:
        gib = tuning.GIB
        raise ValueError(
            f"{name or 'this config'} needs {(weights + kv) / gib:.1f} GiB per device "
            f"({weights / gib:.1f} GiB of {np.dtype(dtype).name} weights + {kv / gib:.1f} GiB "
            f"of K/V cache for {batch} x {max_len} positions), more than the "
            f"{cap / gib:.0f} GiB of HBM one {chip.name} device has; it needs a target "
            "sharded over several devices."
        )
    return weights + kv


def compile_verify(
    cfg: ModelConfig,
    *,
    topology: str,
    tree_nodes: int,
    context: int,
    dtype=jnp.bfloat16,
    batch: int = 1,
    acceptance_length: float = 4.0,
    block_sizes: BlockSizes | None = None,
    block_overrides: dict | None = None,  # BlockSizes fields replacing the defaults
    with_sampling: bool = False,
    config_name: str = "",
) -> AotReport:
    """Compiles the verify megakernel for one device of `topology`; never raises on a
    compiler rejection (the report says why). Bad arguments raise ValueError."""
    from jax.experimental import topologies

    if cfg.is_moe:
        raise ValueError("MoE targets use the XLA path; the megakernel covers dense models.")
    if tree_nodes < 0 or context < 0 or batch < 1 or acceptance_length < 1:
        raise ValueError(
            f"Need tree_nodes >= 0, context >= 0, batch >= 1, acceptance_length >= 1; got "
            f"{tree_nodes}, {context}, {batch}, {acceptance_length}."
        )
    chip = tuning.chip_for_topology(topology)
    try:
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # libtpu's own words on a bad topology string
        raise ValueError(f"Cannot describe TPU topology {topology!r}: {_reason(e)}") from None
    device = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    wdtype = np.dtype(dtype)
    max_len = tuning.round_up(
        max(context + tree_nodes + 1, tuning.kv_write_rows(tree_nodes, wdtype)), 128
    )
    resident = check_device_memory(cfg, chip, wdtype, batch=batch, max_len=max_len,
                                   name=config_name)  # fmt: skip
    limit = chip.vmem_bytes - tuning.VMEM_HEADROOM
    if block_sizes is None:  # the engine's own choice on this chip (`kernel.verify`)
        block_sizes = tuning.step_block_sizes(
            cfg, chip, batch=batch, num_nodes=tree_nodes, weight_dtype=wdtype,
            cache_dtype=wdtype, max_len=max_len,
        )  # fmt: skip
    if block_overrides:
        block_sizes = dataclasses.replace(block_sizes, **block_overrides)
    if block_sizes.vmem_limit_bytes is None:
        block_sizes = dataclasses.replace(block_sizes, vmem_limit_bytes=limit)
    block_sizes.validate(cfg, max_len=max_len, tpu=True)
    buffers = tuning.vmem_buffers(
        cfg, block_sizes, batch=batch, num_nodes=tree_nodes, weight_dtype=wdtype,
        cache_dtype=wdtype,
    )  # fmt: skip

    params = jax.tree.map(
        lambda s: sds(s, wdtype),
        transformer.param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    cache_shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    cache = transformer.KVCache(k=sds(cache_shape, wdtype), v=sds(cache_shape, wdtype))
    i32, f32 = jnp.int32, jnp.float32
    tree = [sds((batch,), i32), sds((batch, tree_nodes), i32), sds((batch, tree_nodes), i32)]
    rows = [sds((batch,), i32), sds((batch,), i32)]  # slots, cache_lens
    if with_sampling:
        sampling = SamplingBatch(
            temperature=sds((batch,), f32), top_k=sds((batch,), i32), top_p=sds((batch,), f32),
            min_p=sds((batch,), f32), seed=sds((batch,), jnp.uint32), counter=sds((batch,), i32),
        )  # fmt: skip
        fn = functools.partial(
            kernel.verify.lower, cfg=cfg, child_sampling=ChildSampling.DETERMINISTIC_TOPK,
            block_sizes=block_sizes,
        )  # fmt: skip
        args = (params, cache, *tree, None, *rows, sampling, sds((batch, tree_nodes + 1), f32))
        what = "verify step (megakernel + XLA sampling branch)"
    else:
        fn = jax.jit(
            functools.partial(kernel._verify_call, cfg=cfg, bs=block_sizes, interpret=False)
        ).lower
        args = (params, cache, *tree, *rows)
        what = "megakernel (greedy verify step)"

    start = time.perf_counter()
    try:
        fn(*args).compile()
        compiled, error = True, None
    except Exception as e:  # the compiler's rejection is the answer, not a crash
        compiled, error = False, _reason(e)
    elapsed = time.perf_counter() - start

    np_ = tuning.block_rows(tree_nodes, wdtype)
    weights = weight_read_bytes(cfg, wdtype, batch * np_)
    kv = kv_read_bytes(cfg, wdtype, batch=batch, context=context)
    writes = kv_read_bytes(cfg, wdtype, batch=batch, context=tree_nodes + 1)
    writes += batch * np_ * cfg.vocab_size * 4
    steps = chip.hbm_bytes_per_s / (weights + kv)
    vmem = tuning.vmem_bytes(buffers)
    fits = compiled and vmem + tuning.VMEM_HEADROOM <= chip.vmem_bytes
    if compiled and not fits:
        error = (
            f"explicit VMEM {vmem / MIB:.1f} MiB leaves less than the "
            f"{tuning.VMEM_HEADROOM / MIB:.0f} MiB headroom of {chip.vmem_bytes / MIB:.0f} MiB"
        )
    return AotReport(
        config=config_name, topology=topology, device_kind=device.device_kind,
        compiled=compiled, fits=fits, error=error, compile_s=elapsed, what=what, batch=batch,
        tree_nodes=tree_nodes, context=context, dtype=wdtype.name,
        block_sizes=dataclasses.asdict(block_sizes), vmem_bytes=vmem,
        vmem_capacity_bytes=chip.vmem_bytes, vmem_limit_bytes=block_sizes.vmem_limit_bytes,
        weight_bytes=weights, kv_bytes=kv, read_bytes=weights + kv, write_bytes=writes,
        hbm_bytes_per_s=chip.hbm_bytes_per_s, cores_per_chip=chip.cores_per_chip,
        steps_per_s=steps, acceptance_length=acceptance_length,
        tokens_per_s=steps * acceptance_length * batch,
        resident_bytes=resident,
        hbm_capacity_bytes=chip.hbm_bytes_per_device,
    )  # fmt: skip


def _reason(e: Exception) -> str:
    """The informative lines of a compiler error (RESOURCE_EXHAUSTED and friends)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("===", "Please report", "For simplicity"))]
    key = [ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "Mosaic" in ln or "VMEM" in ln]
    picked = key[:3] or lines[:3] or [type(e).__name__]
    return " | ".join(ln[:400] for ln in picked)


def format_report(rep: AotReport) -> str:
    gib, tb = 1024**3, 1e12
    bs = ", ".join(f"{k}={v}" for k, v in rep.block_sizes.items() if k != "vmem_limit_bytes")
    status = (
        f"OK in {rep.compile_s:.1f} s" if rep.compiled else f"FAILED after {rep.compile_s:.1f} s"
    )
    vmem = rep.vmem_bytes / MIB
    spare = (rep.vmem_capacity_bytes - rep.vmem_bytes) / MIB
    spare = f"{spare:.1f} MiB free" if spare >= 0 else f"{-spare:.1f} MiB over"
    lines = [
        f"specdec aot: {rep.config} on {rep.topology} ({rep.device_kind}), {rep.dtype}, "
        f"batch {rep.batch}, {rep.tree_nodes} tree nodes, context {rep.context}",
        f"  compiled:     {rep.what}: {status}",
    ]
    if rep.error:
        lines.append(f"  reason:       {rep.error}")
    per_core_bw = rep.hbm_bytes_per_s / rep.cores_per_chip
    lines += [
        f"  block sizes:  {bs}",
        f"  VMEM:         {vmem:.1f} MiB explicit of {rep.vmem_capacity_bytes / MIB:.0f} MiB per "
        f"TensorCore (limit {rep.vmem_limit_bytes / MIB:.1f} MiB, "
        f"{spare})",
        f"  HBM held:     {rep.resident_bytes / gib:.2f} GiB of "
        f"{rep.hbm_capacity_bytes / gib:.0f} GiB per device (weights + K/V cache)",
        f"  HBM read:     {rep.read_bytes / gib:.2f} GiB per step (weights "
        f"{rep.weight_bytes / gib:.2f} GiB + KV {rep.kv_bytes / gib:.2f} GiB); writes "
        f"{rep.write_bytes / gib:.3f} GiB (tree KV + logits)",
        f"  ceiling:      {rep.steps_per_s:.0f} steps/s, {rep.tokens_per_s:.0f} tokens/s (a "
        "PROJECTION from bytes and bandwidth, not a measurement) at "
        f"acceptance length {rep.acceptance_length:g} "
        f"({rep.hbm_bytes_per_s / tb:.2f} TB/s per chip)",
    ]
    if rep.cores_per_chip > 1:
        core_steps = per_core_bw / rep.read_bytes
        lines.append(
            f"  one core:     {core_steps:.0f} steps/s, "
            f"{core_steps * rep.acceptance_length * rep.batch:.0f} tokens/s "
            f"({per_core_bw / tb:.2f} TB/s: each of the {rep.cores_per_chip} TensorCores is "
            "one JAX device with half the chip's HBM)"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdec aot", description="Compile the verify megakernel for a TPU topology."
    )
    ap.add_argument(
        "--config", required=True,
        help=f"a preset ({', '.join(PRESETS)}) or a HF config.json / model folder",
    )  # fmt: skip
    ap.add_argument("--topology", default="tpu7x:2x2x1", help="e.g. tpu7x:2x2x1, v6e:2x2, v5e:2x2")
    ap.add_argument("--tree-nodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="committed tokens per sequence")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--batch", type=int, default=1, help="sequences verified per step")
    ap.add_argument("--acceptance-length", type=float, default=4.0)
    ap.add_argument(
        "--with-sampling", action="store_true", help="also compile the XLA sampling branch"
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    for field in ("proj_cols", "out_rows", "mlp_cols", "vocab_cols", "kv_rows"):
        ap.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"BlockSizes.{field}")
    return ap


def main(
    argv: Sequence[str] | None = None,
    *,
    load_config: Callable[[str], ModelConfig] | None = None,  # e.g. checkpoint.load_config
) -> int:
    """Runs `specdec aot`: 0 when it compiles with the VMEM headroom, 1 when the compiler
    refuses (or the headroom is short), 2 on bad input."""
    if not xla_bridge.backends_are_initialized() and "JAX_PLATFORMS" not in os.environ:
        # Compiling needs no local accelerator; never let libtpu grab one here.
        jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    args = _parser().parse_args(argv)
    try:
        if args.config in PRESETS:
            cfg = PRESETS[args.config]
        elif load_config is None:
            raise ValueError(
                f"--config {args.config!r} is not a preset ({', '.join(PRESETS)}); reading a "
                "config.json needs the CLI's load_config."
            )
        else:
            cfg = load_config(args.config)
        overrides = {
            f: getattr(args, f)
            for f in ("proj_cols", "out_rows", "mlp_cols", "vocab_cols", "kv_rows")
            if getattr(args, f) is not None
        }
        report = compile_verify(
            cfg, topology=args.topology, tree_nodes=args.tree_nodes, context=args.context,
            dtype=DTYPES[args.dtype], batch=args.batch, acceptance_length=args.acceptance_length,
            block_overrides=overrides, with_sampling=args.with_sampling, config_name=args.config,
        )  # fmt: skip
    except ValueError as e:
        print(f"specdec aot: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(format_report(report))
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
