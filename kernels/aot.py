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

`--tp n` compiles the kernel split over n devices of the topology (`megakernel.shard`,
one instance per device under `shard_map`, collectives inside) and reports per
device: HBM held and read, VMEM, weight bytes in flight, the bytes sent to other
devices per step (`shard.step_bytes_sent`) and a second ceiling that adds their
time over ICI. The HBM and ICI bandwidths are the chips' published figures, with
their sources, in `tuning.CHIPS`. Every ceiling is a PROJECTION from bytes and
bandwidth, never a measurement.

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

from specdec.kernels import linear_attention, sharding, stacks, transformer
from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.megakernel import kernel, mla, shard, tuning
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
    # Sparse: 128 experts of 768, 8 routed per token (the routed union is what a step reads).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, architecture=Architecture.QWEN3_MOE,
        qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
        max_position_embeddings=131072, rope_scaling=RopeScaling(),
    ),
    # The seed's size class as a hybrid: Qwen3.5-27B's published shape (64 layers, three
    # gated DeltaNet layers to one gated attention layer, hidden 5120, 24 query / 4 K/V
    # heads of 256, MLP 17408, vocabulary 248320, a quarter of each head rotated). Its
    # DeltaNet head counts (16 key / 48 value heads of 128) are assumed: they give the
    # published 27.8B parameters with the vision tower and MTP head.
    "qwen3.5-27b": ModelConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64,
        num_heads=24, num_kv_heads=4, head_dim=256, architecture=Architecture.QWEN3_5,
        qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
        rope_theta=1e7, max_position_embeddings=262144,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 16,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
    ),
    # The seed's model class: DeepSeek-V3 (671B; MLA over a 512 + 64 latent cache, 256
    # routed experts of 2048 in 8 groups, top 8 of 4 groups, a shared expert, 3 dense
    # layers, YaRN x40). Its bfloat16 weights need 16 devices of TPU7x (tpu7x:2x2x2,
    # --tp 16): `specdec aot` refuses fewer, naming the bytes.
    "deepseek-v3": ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61,
        num_heads=128, num_kv_heads=1, head_dim=64, architecture=Architecture.DEEPSEEK_V3,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        norm_topk_prob=True, scoring_func="sigmoid", expert_bias=True, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=3,
        rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=163840,
        rope_scaling=RopeScaling(rope_type="yarn", factor=40.0,
                                 original_max_position_embeddings=4096, mscale=1.0,
                                 mscale_all_dim=1.0),
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
    resident_bytes: int = 0  # HBM one device holds: its weights + its K/V cache
    hbm_capacity_bytes: int = 0  # HBM per device
    tp: int = 1  # devices the target is split over; byte counts above are per device
    bytes_sent: int = 0  # per device per step: two all-reduces per layer + the argmax
    collective_hops: int = 0  # dependent DMA rounds per step (2 per all-reduce, + 1)
    ici_bytes_per_s: float = 0.0  # bidirectional, per chip (published)
    steps_per_s_with_ici: float = 0.0  # HBM time + an upper bound on the exchange time
    weight_bytes_in_flight: dict = dataclasses.field(default_factory=dict)  # per stream
    # MoE targets: distinct experts the step's rows route to (uniform routing: expected;
    # every row to other experts: worst), and the weight bytes per device at the worst
    # (weight_bytes above counts the expected union).
    experts_expected: float = 0.0
    experts_worst: int = 0
    weight_bytes_worst: int = 0


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(v, int) for v in x)


def _split_shapes(cfg: ModelConfig, tp: int, dtype) -> tuple[dict, dict]:
    """The param shapes `tp` devices run (`shard.split_config`: K/V heads repeated, head
    padded) and their cuts (`sharding.param_specs`), as two trees."""
    run, width = shard.split_config(cfg, tp)
    shapes = transformer.param_shapes(run)
    name, axis = shard.head_leaf(run)
    shapes[name] = tuple(width if i == axis else s for i, s in enumerate(shapes[name]))
    structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=_is_shape)
    if not run.is_hybrid:  # as the megakernel holds it (`shard.prepare_params`)
        if stacks.is_mixed_moe(run):
            structs = jax.eval_shape(functools.partial(stacks.moe_stacked, run), structs)
        if run.is_mla:
            structs = jax.eval_shape(functools.partial(mla.pad_kv, run), structs)
        shapes = jax.tree.map(lambda x: tuple(x.shape), structs)
        specs = sharding.param_specs(run, structs, tp)
        if run.is_moe and tp > 1:  # the megakernel splits whole experts (`megakernel.moe`)
            from specdec.kernels.megakernel import moe

            for name, axis in (moe.SPLIT | moe.SHARED_SPLIT).items():
                if name in shapes["layers"]:
                    specs["layers"][name] = sharding._spec(len(shapes["layers"][name]), axis)
        return shapes, specs
    # A hybrid target as the megakernel holds it (`linear_attention.stacked_layout`).
    from specdec.kernels.megakernel import hybrid

    structs = jax.eval_shape(functools.partial(linear_attention.stacked_layout, run), structs)
    shapes = jax.tree.map(lambda x: tuple(x.shape), structs)
    lin = structs.pop("lin")
    specs = sharding.param_specs(run, structs, tp)
    specs["lin"] = {k: sharding._spec(len(x.shape), None if tp == 1 else hybrid.LINEAR_SPLIT[k])
                    for k, x in lin.items()}  # fmt: skip
    return shapes, specs


def _per_device(cfg: ModelConfig, tp: int, dtype) -> dict:
    """Leaf -> bytes one of `tp` devices holds."""
    shapes, specs = _split_shapes(cfg, tp, dtype)
    itemsize = np.dtype(dtype).itemsize
    return jax.tree.map(
        lambda s, spec: math.prod(s) * itemsize // (tp if sharding.AXIS in spec else 1),
        shapes, specs, is_leaf=_is_shape,
    )  # fmt: skip


def weight_read_bytes(
    cfg: ModelConfig, dtype, rows: int, tp: int = 1, experts: float | None = None
) -> int:
    """HBM bytes of weights one device reads per step: its share of every layer and
    of the LM head, the final norm and `rows` embeddings. A MoE target's layers read
    only the `experts` (of E) the step's rows route to (None: all of them), spread
    evenly over the devices."""
    held = dict(_per_device(cfg, tp, dtype))
    layers = dict(held["layers"])
    if cfg.is_moe and experts is not None:
        for name in ("e_gate", "e_up", "e_down"):
            layers[name] = int(layers[name] * experts / cfg.num_experts)
    head = held[shard.head_leaf(cfg)[0]]
    itemsize = np.dtype(dtype).itemsize
    total = sum(layers.values()) + sum(held.get("lin", {}).values())
    return total + head + (1 + rows) * cfg.hidden_size * itemsize


def kv_read_bytes(cfg: ModelConfig, dtype, *, batch: int, context: int, tp: int = 1) -> int:
    """HBM bytes of committed K and V one device reads per step (its K/V heads); a
    hybrid target's attention layers only, plus its linear layers' state (f32
    recurrent state and the convolution window, per sequence, whatever the context)."""
    run, _ = shard.split_config(cfg, tp)
    kv = batch * context * _kv_per_position(run, dtype, tp)
    if run.is_hybrid:
        kv += batch * linear_attention.bytes_per_slot(run, dtype) // tp
    return kv


def _kv_per_position(run: ModelConfig, dtype, tp: int) -> int:
    """Cache bytes per position one of `tp` devices holds: its K/V heads' share, or
    (MLA) the whole latent entry, which every device keeps (`megakernel.mla`)."""
    per_pos = run.num_cache_layers * run.num_kv_heads * sum(run.cache_dims)
    per_pos *= np.dtype(dtype).itemsize
    return per_pos if run.is_mla else per_pos // tp


def resident_bytes(
    cfg: ModelConfig, dtype, *, batch: int, max_len: int, tp: int = 1
) -> tuple[int, int]:
    """HBM one of `tp` devices holds: (its weights, its K/V cache of `batch` rows of
    `max_len` positions)."""
    weights = sum(jax.tree.leaves(_per_device(cfg, tp, dtype)))
    return weights, kv_read_bytes(cfg, dtype, batch=batch, context=max_len, tp=tp)


def check_device_memory(
    cfg, chip, dtype, *, batch: int, max_len: int, name: str = "", tp: int = 1
) -> int:
    """The HBM bytes one device holds (weights + K/V cache); refuses, before any
    compiling, a target whose bytes exceed the device's HBM (ValueError with both)."""
    weights, kv = resident_bytes(cfg, dtype, batch=batch, max_len=max_len, tp=tp)
    cap = chip.hbm_bytes_per_device
    if weights + kv > cap:
        gib = tuning.GIB
        where = "one device" if tp == 1 else f"each of {tp} devices"
        raise ValueError(
            f"{name or 'this config'} needs {(weights + kv) / gib:.1f} GiB on {where} "
            f"({weights / gib:.1f} GiB of {np.dtype(dtype).name} weights + {kv / gib:.1f} GiB "
            f"of K/V cache for {batch} x {max_len} positions), more than the "
            f"{cap / gib:.0f} GiB of HBM one {chip.name} device has; split it over more "
            "devices (--tp)."
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
    tp: int = 1,  # devices of `topology` the target is split over (`megakernel.shard`)
    taps: tuple[int, ...] = (),  # also return these layers' features (a block drafter's)
) -> AotReport:
    """Compiles the verify megakernel for `tp` devices of `topology` (one instance per
    device, collectives inside); never raises on a compiler rejection (the report says
    why). Bad arguments raise ValueError."""
    from jax.experimental import topologies

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
    if tp > len(topo.devices):
        raise ValueError(
            f"--tp {tp} needs {tp} devices; {topology} has {len(topo.devices)} (TPU7x shows "
            "each chip's two TensorCores as two devices)."
        )
    shard.check_shardable(cfg, tp, tpu=True)
    devices = topo.devices[:tp]
    mesh = None if tp == 1 else jax.sharding.Mesh(np.array(devices), (sharding.AXIS,))

    def sds(shape, dt, spec=None):
        if mesh is None:
            return jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(
                devices[0]))  # fmt: skip
        spec = jax.sharding.PartitionSpec() if spec is None else spec
        return jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.NamedSharding(mesh, spec))

    wdtype = np.dtype(dtype)
    max_len = tuning.round_up(
        max(context + tree_nodes + 1, tuning.kv_write_rows(tree_nodes, wdtype)), 128
    )
    resident = check_device_memory(cfg, chip, wdtype, batch=batch, max_len=max_len,
                                   name=config_name, tp=tp)  # fmt: skip
    run, width = shard.split_config(cfg, tp)
    local = shard.local_config(run, tp, width)
    limit = chip.vmem_bytes - tuning.VMEM_HEADROOM
    if block_sizes is None:  # the engine's own choice on this chip (`kernel.verify`)
        block_sizes = tuning.step_block_sizes(
            local, chip, batch=batch, num_nodes=tree_nodes, weight_dtype=wdtype,
            cache_dtype=wdtype, max_len=max_len, tp=tp,
        )  # fmt: skip
    if block_overrides:
        block_sizes = dataclasses.replace(block_sizes, **block_overrides)
    if block_sizes.vmem_limit_bytes is None:
        block_sizes = dataclasses.replace(block_sizes, vmem_limit_bytes=limit)
    block_sizes.validate(local, max_len=max_len, tpu=True)
    buffers = tuning.vmem_buffers(
        local, block_sizes, batch=batch, num_nodes=tree_nodes, weight_dtype=wdtype,
        cache_dtype=wdtype, tp=tp,
    )  # fmt: skip

    shapes, specs = _split_shapes(cfg, tp, wdtype)
    params = jax.tree.map(lambda s, spec: sds(s, wdtype, spec), shapes, specs, is_leaf=_is_shape)
    cache_shape = (run.num_cache_layers, batch, run.num_kv_heads, max_len)
    k_dim, v_dim = run.cache_dims
    cspec = sharding.cache_spec(run, tp)
    lin = None
    if run.is_hybrid:  # the linear layers' state: recurrent state split by value heads
        state = jax.eval_shape(
            functools.partial(linear_attention.LinearState.create, run, batch, wdtype)
        )
        rec_spec = jax.sharding.PartitionSpec(None, None, sharding.AXIS) if tp > 1 else None
        lin = linear_attention.LinearState(
            conv=sds(state.conv.shape, state.conv.dtype),
            rec=sds(state.rec.shape, state.rec.dtype, rec_spec),
        )
    cache = transformer.KVCache(
        k=sds((*cache_shape, k_dim), wdtype, cspec),
        v=sds((*cache_shape, v_dim), wdtype, cspec),
        lin=lin,
    )
    i32, f32 = jnp.int32, jnp.float32
    tree = [sds((batch,), i32), sds((batch, tree_nodes), i32), sds((batch, tree_nodes), i32)]
    rows = [sds((batch,), i32), sds((batch,), i32)]  # slots, cache_lens
    if with_sampling:
        sampling = SamplingBatch(
            temperature=sds((batch,), f32), top_k=sds((batch,), i32), top_p=sds((batch,), f32),
            min_p=sds((batch,), f32), seed=sds((batch,), jnp.uint32), counter=sds((batch,), i32),
        )  # fmt: skip
        fn = functools.partial(
            kernel._verify.lower, cfg=run, child_sampling=ChildSampling.DETERMINISTIC_TOPK,
            block_sizes=block_sizes, mesh=mesh, taps=tuple(taps),
        )  # fmt: skip
        args = (params, cache, *tree, None, *rows, sampling, sds((batch, tree_nodes + 1), f32))
        what = "verify step (megakernel + XLA sampling branch)"
    else:
        step = functools.partial(kernel._verify_call, cfg=run, local=local, bs=block_sizes,
                                 interpret=False, mesh=mesh, taps=tuple(taps))  # fmt: skip
        fn = jax.jit(step).lower
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
    union = (0.0, 0)
    if cfg.is_moe:  # the real rows route: root + nodes of each sequence
        from specdec.kernels.megakernel import moe

        union = moe.union_experts(cfg.num_experts, cfg.num_experts_per_tok,
                                  batch * (tree_nodes + 1))  # fmt: skip
    weights = weight_read_bytes(cfg, wdtype, batch * np_, tp=tp,
                                experts=union[0] if cfg.is_moe else None)  # fmt: skip
    worst = weight_read_bytes(cfg, wdtype, batch * np_, tp=tp,
                              experts=union[1] if cfg.is_moe else None)  # fmt: skip
    kv = kv_read_bytes(cfg, wdtype, batch=batch, context=context, tp=tp)
    writes = batch * (tree_nodes + 1) * _kv_per_position(run, wdtype, tp)  # the block's K/V
    writes += batch * np_ * width * 4 // tp
    # One device alone may use the whole chip's bandwidth (the single-device report's
    # ceiling); devices that split the model share it.
    bandwidth = chip.hbm_bytes_per_s if tp == 1 else chip.hbm_bytes_per_s / chip.cores_per_chip
    steps = bandwidth / (weights + kv)
    sent = shard.step_bytes_sent(run, batch * np_, tp)
    # Upper bound on the exchange time: every byte crosses ICI at this device's share of
    # the chip's outgoing half (devices on one chip exchange on-chip, faster).
    ici_share = chip.ici_bytes_per_s / 2 / chip.cores_per_chip
    ici_s = sent / ici_share if sent and ici_share else 0.0
    vmem = tuning.vmem_bytes(buffers)
    fits = compiled and vmem + tuning.VMEM_HEADROOM <= chip.vmem_bytes
    if compiled and not fits:
        error = (
            f"explicit VMEM {vmem / MIB:.1f} MiB leaves less than the "
            f"{tuning.VMEM_HEADROOM / MIB:.0f} MiB headroom of {chip.vmem_bytes / MIB:.0f} MiB"
        )
    return AotReport(
        config=config_name, topology=topology, device_kind=devices[0].device_kind,
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
        tp=tp, bytes_sent=sent, collective_hops=0 if tp == 1 else 4 * cfg.num_layers + 1,
        ici_bytes_per_s=chip.ici_bytes_per_s,
        steps_per_s_with_ici=1.0 / ((weights + kv) / bandwidth + ici_s),
        weight_bytes_in_flight=tuning.weight_bytes_in_flight(local, block_sizes, wdtype),
        experts_expected=union[0], experts_worst=union[1], weight_bytes_worst=worst,
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
    flight = ", ".join(f"{k} {v / MIB:.1f}" for k, v in rep.weight_bytes_in_flight.items())
    lines += [
        f"  block sizes:  {bs}",
        f"  in flight:    {rep.weight_bytes_in_flight.get('mlp', 0) / MIB:.1f} MiB of MLP weight "
        f"DMAs ahead of the tile computing (MiB per stream: {flight})",
        f"  VMEM:         {vmem:.1f} MiB explicit of {rep.vmem_capacity_bytes / MIB:.0f} MiB per "
        f"TensorCore (limit {rep.vmem_limit_bytes / MIB:.1f} MiB, "
        f"{spare})",
        f"  HBM held:     {rep.resident_bytes / gib:.2f} GiB of "
        f"{rep.hbm_capacity_bytes / gib:.0f} GiB per device (weights + K/V cache)",
        f"  HBM read:     {rep.read_bytes / gib:.2f} GiB per step (weights "
        f"{rep.weight_bytes / gib:.2f} GiB + KV {rep.kv_bytes / gib:.2f} GiB); writes "
        f"{rep.write_bytes / gib:.3f} GiB (tree KV + logits)",
        *(
            [
                f"  experts:      the step's {rep.batch * (rep.tree_nodes + 1)} rows route to "
                f"{rep.experts_expected:.1f} experts per layer expected (uniform routing), "
                f"{rep.experts_worst} at worst; weights read {rep.weight_bytes / gib:.2f} GiB "
                f"expected, {rep.weight_bytes_worst / gib:.2f} GiB worst"
            ]
            if rep.experts_worst
            else []
        ),
        f"  ceiling:      {rep.steps_per_s:.0f} steps/s, {rep.tokens_per_s:.0f} tokens/s (a "
        "PROJECTION from bytes and bandwidth, not a measurement) at "
        f"acceptance length {rep.acceptance_length:g} "
        + (
            f"({rep.hbm_bytes_per_s / tb:.2f} TB/s per chip)"
            if rep.tp == 1
            else f"({rep.hbm_bytes_per_s / rep.cores_per_chip / tb:.2f} TB/s per device)"
        ),
    ]
    if rep.tp > 1:
        tb_s = rep.bytes_sent * rep.steps_per_s_with_ici / tb
        lines[1:1] = [
            f"  devices:      {rep.tp} of the topology, one kernel instance each (tensor "
            "parallel); HBM, VMEM and bytes below are per device"
        ]
        lines += [
            f"  collectives:  {rep.bytes_sent / MIB:.2f} MiB sent per device per step in "
            f"{rep.collective_hops} dependent DMA rounds (2 all-reduces per layer + argmax)",
            f"  with ICI:     {rep.steps_per_s_with_ici:.0f} steps/s, "
            f"{rep.steps_per_s_with_ici * rep.acceptance_length * rep.batch:.0f} tokens/s (a "
            "PROJECTION: HBM time plus every byte sent over ICI at "
            f"{rep.ici_bytes_per_s / tb:.2f} TB/s bidirectional per chip, no overlap, "
            f"latency not counted; {tb_s:.3f} TB/s sent per device)",
        ]
        return "\n".join(lines)
    if rep.cores_per_chip > 1:
        core_steps = per_core_bw / rep.read_bytes
        lines.append(
            f"  one core:     {core_steps:.0f} steps/s, "
            f"{core_steps * rep.acceptance_length * rep.batch:.0f} tokens/s "
            f"({per_core_bw / tb:.2f} TB/s: each of the {rep.cores_per_chip} TensorCores is "
            "one JAX device with half the chip's HBM)"
        )
    return "\n".join(lines)


BLOCK_FIELDS = (
    "proj_cols", "out_rows", "mlp_cols", "vocab_cols", "kv_rows", "weight_ring", "mlp_ring",
)  # fmt: skip


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
    ap.add_argument(
        "--tp", type=int, default=1,
        help="devices of the topology the target is split over (tensor parallel)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    for field in BLOCK_FIELDS:
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
        overrides = {f: getattr(args, f) for f in BLOCK_FIELDS if getattr(args, f) is not None}
        report = compile_verify(
            cfg, topology=args.topology, tree_nodes=args.tree_nodes, context=args.context,
            dtype=DTYPES[args.dtype], batch=args.batch, acceptance_length=args.acceptance_length,
            block_overrides=overrides, with_sampling=args.with_sampling, config_name=args.config,
            tp=args.tp,
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
