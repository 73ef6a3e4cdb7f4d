"""Verify megakernel: the target's whole verify step as one Pallas TPU program.

Same arguments and result as `reference.verify` (read its docstring first), plus
`block_sizes` and `interpret`. One `pallas_call` runs every layer, the LM head and
the greedy acceptance for a batch of B token trees; tiny XLA ops around it build the
verify block (embedding rows, RoPE tables, masks) and, only when some row samples,
apply the stochastic rule to the logits the kernel wrote.

Rows. Sequence b owns rows `[b * Np, (b + 1) * Np)` of every activation: the root,
its N nodes, then padding up to `Np` = N + 1 rounded up to the sublane tile (8 rows
for f32 weights, 16 for bf16), so every per-sequence slice is tile-aligned. All B * Np
rows share each streamed weight tile, which is what makes verification cheap: the
weights are read once per step, not once per token.

Weight streaming: a manual DMA ring, not a grid. All weights stay in HBM
(`memory_space=pl.ANY`); wq / wk / wv and the LM head are cut into column tiles
(whole heads for the projections), wo into row tiles of whole heads (so the
head-major attention output needs no relayout: `x += sum_h attn_h @ wo_h`), and the
MLP into intermediate-column tiles that carry the matching w_gate and w_up columns
and w_down rows, so one fused step computes `x += (silu(h @ g_j) * (h @ u_j)) @ d_j`.
Every stream owns a ring of R VMEM tile buffers (`mlp_ring` for the MLP, which
carries most of a layer's bytes; `weight_ring` for the others), with a DMA
semaphore per slot. The order of tiles in a step is fixed:

    layer 0: qkv_0 .. qkv_{nq+2nk-1} | attention | o_0 .. o_{no-1} | mlp_0 .. mlp_{nf-1}
    layer 1: ...
    LM head: head_0 .. head_{nv-1} [head tail]

and while tile t computes, tiles t + 1 .. t + R - 1 are in flight, across stream
boundaries too: the last qkv tiles start o's first ones (so wo arrives during
attention), the last o tiles start the MLP's, and the last MLP tiles of layer l start
layer l + 1's qkv tiles (or the LM head's), so the HBM queue never drains at a layer
boundary. Why R: by Little's law, keeping a TensorCore's HBM busy needs bandwidth x
DMA latency bytes outstanding, several MiB, more than one tile of a small model
(`tuning.step_block_sizes` picks the rings from the VMEM budget). A grid over layers with
BlockSpec pipelining would prefetch only whole layers, and one Qwen3-8B layer
(~370 MiB of bf16 weights) is six times TPU7x's VMEM.

Attention, per sequence and KV head: the G = H / K query heads of the group are
stacked on sublanes ([G * Np, hd]); the block part (root + nodes under the ancestor
mask, K/V from this step) seeds an online softmax, then committed KV tiles of
`kv_rows` positions stream in from the cache by double-buffered DMA (only
`ceil(cache_len / kv_rows)` of them). The block's K/V are then written to the cache
(aliased in place): directly for f32 caches; for 16-bit caches, whose HBM slices must
be 16-row aligned, by rewriting the aligned window around them (`tuning.kv_write_rows`).

LM head: vocabulary tiles stream like the weights; each tile's logits go back to HBM
by DMA while a running (max, argmax) per row is kept (ties to the lowest id, exactly
`jnp.argmax`). The greedy walk then runs in-kernel, vectorised over the tree: a node
is a hit if its token is the argmax at its parent, chosen if no earlier sibling is a
hit, and on the accepted path if it and all its ancestors are chosen.

Sampling rows: the top-k / top-p filters need a vocabulary sort, which Mosaic does
not lower, so the stochastic rule runs in XLA on the logits the kernel emitted
(`reference.decide`, same uniforms, skipped entirely when every row is greedy). A
row with a repetition penalty gets its verdict there too, from the penalised
logits (the in-kernel walk knows no penalty). The embedding gather is also XLA's:
a bf16 row at an arbitrary row offset is not a legal Mosaic DMA, and it is B * Np
rows.

Hybrid targets (gated DeltaNet + gated attention layers): `hybrid` module docstring.
Routed experts (Qwen3-MoE, DeepSeek-V3 routing): `moe` module docstring.

Multi-head latent attention (DeepSeek-V3 class): `mla` module docstring.

Block drafters' features (`taps`): after a tapped layer's last residual update, x
(whole on every device after the all-reduce) goes to an extra HBM output by one
DMA; the last layer's gets the final norm in XLA afterwards, so `features` equal
`transformer.block_logits_kv(taps=)`.

KV writes need
`cache_lens[b] + N + 1 <= max_len` for active rows (the target worker sizes its
cache so); rows beyond it get no K/V written.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from specdec.kernels import linear_attention as la
from specdec.kernels import stacks, transformer
from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel import (
    attention,
    checks,
    collectives,
    greedy,
    hybrid,
    mla,
    moe,
    ops,
    shard,
    tuning,
)
from specdec.kernels.megakernel.collectives import AXIS
from specdec.kernels.megakernel.reference import VerifyResult, decide, tree_block
from specdec.kernels.megakernel.tuning import BlockSizes
from specdec.kernels.transformer import KVCache, Params
from specdec.verify import masks
from specdec.verify.acceptance import Verdict
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

__all__ = ["verify"]

_BIG = 2**30  # larger than any token id


def verify(params: Params, cache: KVCache, *args, mesh: Mesh | None = None, **kwargs):
    """`reference.verify` as one Pallas kernel (module docstring); `_verify` has the
    full signature. Refuses weights or a cache split over several devices without the
    `mesh` to split the kernel over: a Mosaic call cannot be partitioned by GSPMD."""
    if mesh is None:
        for name, tree in (("params", params), ("cache", cache)):
            for leaf in jax.tree.leaves(tree):
                sharding = getattr(leaf, "sharding", None)
                if sharding is not None and len(sharding.device_set) > 1:
                    raise ValueError(
                        f"megakernel.verify got {name} placed on {len(sharding.device_set)} "
                        "devices but no mesh: pass mesh= (a one-axis 'tp' mesh over them, "
                        "with params from `shard.prepare_params`) or put them on one device."
                    )
    return _verify(params, cache, *args, mesh=mesh, **kwargs)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "child_sampling", "block_sizes", "interpret", "mesh", "taps"),
    donate_argnames=("cache",),
)
def _verify(
    params: Params,
    cache: KVCache,
    roots: jax.Array,  # i32[B]
    tokens: jax.Array,  # i32[B, N]
    parents: jax.Array,  # i32[B, N], -1 = child of root, < -1 = padding
    draft_probs: jax.Array | None,  # f32[B, N + 1, V] q per node; None for top-k / n-gram trees
    slots: jax.Array,  # i32[B], -1 = inactive row (nothing written)
    cache_lens: jax.Array,  # i32[B] committed tokens in the cache (the root is not)
    sampling: SamplingBatch,
    uniforms: jax.Array,  # f32[B, N + 1] in [0, 1), e.g. sampling.uniforms(N + 1)
    *,
    cfg: ModelConfig,
    child_sampling: ChildSampling,
    block_sizes: BlockSizes | None = None,  # None = tuning.step_block_sizes for this chip
    interpret: bool | pltpu.InterpretParams = False,  # True / InterpretParams: run on CPU
    mesh: Mesh | None = None,  # split over its one axis "tp" (module docstring); None = one device
    taps: tuple[int, ...] = (),  # also return the residual after these layers (block drafters)
) -> VerifyResult:
    """`reference.verify` as one Pallas kernel (module docstring). With `taps`, the
    result's `features` are the block's residual after those layers, f32[B, N + 1,
    len(taps) x D], as `transformer.block_logits_kv(taps=)` gives them."""
    tp = _mesh_size(mesh)
    shard.check_shardable(cfg, tp, tpu=not interpret)
    if cfg.is_hybrid:  # `shard.prepare_params` restacks once at load instead
        params = la.stacked_layout(cfg, params)
    elif stacks.is_mixed_moe(cfg):
        params = stacks.moe_stacked(cfg, params)
    if cfg.is_mla:  # `shard.prepare_params` pads once instead
        params = mla.pad_kv(cfg, params)
    checks.verify_inputs(
        params, cache, roots, tokens, parents, slots, cache_lens, uniforms, cfg, tp
    )
    b, n = tokens.shape
    wdtype = params["layers"]["wo"].dtype
    width = shard.padded_vocab(cfg.vocab_size, tp)
    if shard.head_width(cfg, params) < width:  # `shard.prepare_params` pads once instead
        params = shard.pad_head(cfg, params, width)
    local = shard.local_config(cfg, tp, shard.head_width(cfg, params))
    if block_sizes is None:  # what `specdec aot` compiles for the same chip
        block_sizes = tuning.step_block_sizes(
            local, tuning.chip_for_device(_devices(mesh)[0]), batch=b, num_nodes=n,
            weight_dtype=wdtype, cache_dtype=cache.k.dtype, max_len=cache.max_len, tp=tp,
        )  # fmt: skip
    block_sizes.validate(local, max_len=cache.max_len, tpu=not interpret)
    if tp > 1 and interpret is True:  # remote DMAs need the TPU interpreter
        interpret = pltpu.InterpretParams()
    bad = [i for i in taps if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"taps {bad} are outside the model's {cfg.num_layers} layers.")
    logits, greedy, cache, lin, feats = _verify_call(
        params, cache, roots, tokens, parents, slots, cache_lens,
        cfg=cfg, local=local, bs=block_sizes, interpret=interpret, mesh=mesh, taps=taps,
    )  # fmt: skip
    block, _, mask = tree_block(roots, tokens, parents, cache_lens)
    verdict = decide(
        logits, block, mask, tokens, parents, draft_probs, sampling, uniforms, child_sampling,
        greedy=greedy,
    )  # fmt: skip
    return VerifyResult(*verdict, logits, cache, lin, feats)


def _mesh_size(mesh: Mesh | None) -> int:
    if mesh is None:
        return 1
    if tuple(mesh.axis_names) != (AXIS,):
        raise ValueError(
            f"The megakernel splits over a one-axis mesh named {AXIS!r} "
            f"(`kernels.sharding.make_mesh`); got axes {tuple(mesh.axis_names)}."
        )
    return mesh.shape[AXIS]


def _devices(mesh: Mesh | None) -> list:
    return jax.devices() if mesh is None else list(mesh.devices.flat)


def _verify_call(params, cache, roots, tokens, parents, slots, cache_lens, *, cfg, local, bs,
                 interpret, mesh, taps=()):  # fmt: skip
    """Builds the kernel operands, runs the pallas_call (once per device of `mesh`),
    unpacks logits and verdict. `local` is what one device computes
    (`shard.local_config`); everything row-shaped is built here once, replicated."""
    b, n = tokens.shape
    lp = params["layers"]
    np_ = tuning.block_rows(n, lp["wo"].dtype)
    m, n1 = b * np_, n + 1
    d, hd = cfg.hidden_size, cfg.head_dim
    f32, i32 = jnp.float32, jnp.int32

    # ---- the verify block, padded to Np rows per sequence
    block, positions, anc = tree_block(roots, tokens, parents, cache_lens)
    pad = np_ - n1
    block = jnp.pad(block, ((0, 0), (0, pad)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge")
    anc = jnp.pad(anc, ((0, 0), (0, pad), (0, pad))) | jnp.eye(np_, dtype=bool)[None]
    attn_mask = anc
    if cfg.sliding_window is not None:
        attn_mask = anc & (positions[:, :, None] - positions[:, None, :] < cfg.sliding_window)
    # RoPE tables for a proj_cols-wide tile holding whole heads (period head_dim); the
    # lanes past rotary_dim pass through (cos 1, sin 0).
    inv_freq = jnp.asarray(transformer.rope_inv_freq(cfg))
    freqs = positions.reshape(m).astype(f32)[:, None] * inv_freq  # [M, rot/2]
    lane = np.arange(bs.proj_cols) % hd
    half = cfg.rotary_dim // 2
    first, rotated = lane < half, lane < 2 * half
    freq_idx = np.where(first, lane, np.where(rotated, lane - half, 0))
    scale = transformer.rope_scale(cfg)  # YaRN's attention factor on the rotated lanes
    cos = jnp.where(rotated, scale * jnp.cos(freqs)[:, freq_idx], 1.0)
    sin = jnp.where(first, -jnp.sin(freqs)[:, freq_idx], jnp.sin(freqs)[:, freq_idx])
    sin = jnp.where(rotated, scale * sin, 0.0)
    # Per-row tree facts for the greedy walk (block index space: root = 0, node i = i + 1).
    valid = jnp.pad(
        jnp.concatenate([jnp.zeros((b, 1), bool), parents >= -1], 1), ((0, 0), (0, pad))
    )
    par = jnp.concatenate([jnp.full((b, 1), -1, i32), jnp.where(parents >= -1, parents + 1, -1)], 1)
    par = jnp.pad(par, ((0, 0), (0, pad)), constant_values=-1)
    depth = jnp.pad(
        jnp.concatenate([jnp.zeros((b, 1), i32), masks.depths(parents).astype(i32)], 1),
        ((0, 0), (0, pad)),
    )
    tree_cols = jnp.stack([block, par, valid.astype(i32), depth], axis=-1).reshape(m, 4)
    tree_rows = jnp.stack([par, valid.astype(i32)], axis=1)  # [B, 2, Np]

    # Replicated on every device: the rows and everything of width D or head_dim.
    rows_in = {
        "x0": params["embed"][block].astype(f32).reshape(m, d),
        "cos": cos,
        "sin": sin,
        "qpos": positions.reshape(m, 1).astype(i32),
        "attn_mask": attn_mask.astype(i32),
        "anc_mask": anc.astype(i32),
        "tree_cols": tree_cols.astype(i32),
        "tree_rows": tree_rows.astype(i32),
        # [L, 1, D]: one whole-tile row per layer, DMA'd as the layer starts (`_kernel`).
        "attn_norm": lp["attn_norm"].astype(f32).reshape(cfg.num_layers, 1, d),
        "mlp_norm": lp["mlp_norm"].astype(f32).reshape(cfg.num_layers, 1, d),
        "final_norm": params["final_norm"].astype(f32).reshape(1, d),
    }
    # Split over devices (`shard` module docstring): name -> (array, axis cut).
    split_in = {}
    if cfg.attention_bias:
        split_in |= {name: (lp[name].astype(f32), 1) for name in ("bq", "bk", "bv")}
    if cfg.qk_norm:
        rows_in |= {name: lp[name].astype(f32) for name in ("q_norm", "k_norm")}
    head, head_axis = shard.head_leaf(cfg)
    if cfg.is_mla:  # `mla`: heads split, the latent path replicated
        rows_in |= {name: lp[name].astype(f32) for name in ("q_a_norm", "kv_a_norm") if name in lp}
        split_in |= {name: (lp[name], axis) for name, axis in mla.SPLIT.items() if name in lp}
    else:
        split_in |= {
            "wq": (lp["wq"], 2), "wk": (lp["wk"], 2), "wv": (lp["wv"], 2), "wo": (lp["wo"], 1),
        }  # fmt: skip
    tables = {}
    if cfg.is_moe:  # routed experts (`moe`): whole experts per device, the router everywhere
        split_in |= {name: (lp[name], axis) for name, axis in moe.SPLIT.items()}
        split_in |= {name: (lp[name], axis) for name, axis in moe.SHARED_SPLIT.items()
                     if name in lp}  # fmt: skip
        rows_in["live"] = moe.live_rows(slots, n1, np_)
        if cfg.expert_bias:
            rows_in["e_bias"] = lp["e_bias"].astype(f32)
        if stacks.is_mixed_moe(cfg):  # layer li's MLP kind (1 = MoE) and stack index
            kinds = [int(cfg.moe_layer(i)) for i in range(cfg.num_layers)]
            index = [stacks.mlp_index(cfg, i) for i in range(cfg.num_layers)]
            tables = {"mkinds": jnp.asarray(kinds, i32), "midx": jnp.asarray(index, i32)}
    if "w_gate" in lp:
        split_in |= {"w_gate": (lp["w_gate"], 2), "w_up": (lp["w_up"], 2),
                     "w_down": (lp["w_down"], 1)}  # fmt: skip
    split_in["head"] = (params[head], head_axis)
    if cfg.is_mla:  # one latent per token, the same on every device (each writes its copy)
        split_in["k_cache"] = (cache.k, None)
    else:
        split_in |= {"k_cache": (cache.k, 2), "v_cache": (cache.v, 2)}
    if cfg.attn_output_gate:
        split_in["wg"] = (lp["wg"], 2)
    if cfg.is_hybrid:
        lin_rows, lin_split, tables = hybrid.step_inputs(
            cfg, params, cache, anc[:, :n1, :n1], positions[:, :n1], cache_lens, slots, np_
        )
        rows_in |= lin_rows
        split_in = {k: v for k, v in split_in.items() if k not in ("k_cache", "v_cache")}
        split_in |= lin_split | {"k_cache": (cache.k, 2), "v_cache": (cache.v, 2)}
    row_lens = jnp.where(slots >= 0, cache_lens, 0).astype(i32)
    tp = _mesh_size(mesh)
    run = functools.partial(
        _device_call, names=(*rows_in, *split_in), local=local, bs=bs, batch=b,
        num_nodes=n, vocab=cfg.vocab_size, interpret=interpret, tp=tp, taps=taps,
    )  # fmt: skip
    scalars = (slots.astype(i32), row_lens, *tables.values())
    args = (*scalars, *rows_in.values(), *(a for a, _ in split_in.values()))
    rec_cuts = []
    if cfg.is_hybrid:
        rec_cuts = [_cut(len(s), axis) for s, axis in hybrid.record_shapes(local, m)]
    n_cache = 1 if cfg.is_mla else 2  # MLA's values are its keys' latent: no V
    tap_specs = [P()] if taps else []  # every device holds the whole residual
    if mesh is None:
        logits, verdict, *caches_out = run(*args)
    else:
        cut = [_cut(a.ndim, axis) for a, axis in split_in.values()]
        logits, verdict, *caches_out = jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(*[P()] * len(scalars), *[P()] * len(rows_in), *cut),
            out_specs=(P(None, AXIS), P(), *cut[-n_cache:], *rec_cuts, *tap_specs),
            check_vma=False,  # the verdict is replicated by construction (collectives)
        )(*args)
    feats = None
    if taps:
        feats = _features(caches_out.pop(), params, cfg, taps, b, np_, n1)
    k_cache, recs = caches_out[0], caches_out[n_cache:]
    v_cache = cache.v if cfg.is_mla else caches_out[1]
    logits = logits.reshape(b, np_, -1)[:, :n1, : cfg.vocab_size]
    greedy = Verdict(verdict[:, 0, :n], verdict[:, 1, 0], verdict[:, 2, 0])
    lin = hybrid.records(recs, cfg, b, np_, n1, tp) if recs else None
    return logits, greedy, KVCache(k=k_cache, v=v_cache, lin=cache.lin), lin, feats


def _features(raw, params, cfg, taps, b, np_, n1):
    """The kernel's tapped residuals f32[n_taps, B x Np, D] as `block_logits_kv` gives
    features: f32[B, N + 1, n_taps x D], the last layer's after the final norm."""
    d = raw.shape[-1]
    f = raw.reshape(len(taps), b, np_, d)[:, :, :n1].transpose(1, 2, 0, 3)
    return transformer.norm_last_tap(cfg, params, f.reshape(b, n1, len(taps) * d), taps)


def _cut(ndim: int, axis: int | None) -> P:
    if axis is None:  # replicated
        return P()
    parts: list[str | None] = [None] * ndim
    parts[axis] = AXIS
    return P(*parts)


def _device_call(*arrays, names, local, bs, batch, num_nodes, vocab, interpret, tp, taps=()):
    """One device's pallas_call over its shards (`local` is its part of the model)."""
    mixed = stacks.is_mixed_moe(local)
    nsp = 4 if local.is_hybrid or mixed else 2  # scalar prefetch: slots, lens (+ layer tables)
    scalars, arrays = arrays[:nsp], arrays[nsp:]
    ins = dict(zip(names, arrays, strict=True))
    caches = [ins.pop("k_cache")] + ([] if local.is_mla else [ins.pop("v_cache")])
    k_cache = caches[0]
    wdtype, cdtype = ins["wo"].dtype, k_cache.dtype
    e_local = ins["e_gate"].shape[1] if local.is_moe else 0
    hbm_names = ("x0", "attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "wg", "w_gate", "w_up",
                 "w_down", "head",
                 *hybrid.LINEAR_HBM, "rec", "win_q", "win_k", "win_v", *moe.SPLIT,
                 *moe.SHARED_SPLIT, *mla.SPLIT)  # fmt: skip
    hbm_in = {name: ins.pop(name) for name in hbm_names if name in ins}
    vmem_in = ins
    L, m = local.num_layers, hbm_in["x0"].shape[0]
    for name in ("bq", "bk", "bv"):  # one sublane row per tile: the kernel picks row j
        if name in vmem_in:
            vmem_in[name] = vmem_in[name].reshape(L, -1, bs.proj_cols)
    np_ = tuning.block_rows(num_nodes, wdtype)
    buffers = tuning.vmem_buffers(
        local, bs, batch=batch, num_nodes=num_nodes, weight_dtype=wdtype, cache_dtype=cdtype,
        tp=tp,
    )  # fmt: skip
    planned = {buf.name: buf for buf in buffers}
    for name, arr in vmem_in.items():  # the VMEM estimate must describe what we pass
        assert planned[name].shape == arr.shape, (name, planned[name].shape, arr.shape)
    scratch = [pltpu.VMEM(buf.shape, buf.dtype) for buf in buffers if buf.kind == "scratch"]
    smem_names = []
    if local.is_moe:  # the routed experts' union (flags) and this device's list of them
        scratch += [pltpu.SMEM((1, local.num_experts), jnp.int32),
                    pltpu.SMEM((e_local,), jnp.int32)]  # fmt: skip
        smem_names = ["used_s_ref", "list_s_ref"]
    ring = bs.weight_ring
    sems = [
        pltpu.SemaphoreType.DMA((ring,)),  # qkv
        pltpu.SemaphoreType.DMA((ring,)),  # o
        pltpu.SemaphoreType.DMA((3, bs.mlp_ring)),  # mlp: gate, up, down
        pltpu.SemaphoreType.DMA((ring,)),  # LM head
        pltpu.SemaphoreType.DMA((2,)),  # logits out
        pltpu.SemaphoreType.DMA((2, 2)),  # KV tiles: k / v x slot
        pltpu.SemaphoreType.DMA((2,)),  # KV writes: k / v
        pltpu.SemaphoreType.DMA((2, 2)),  # norm weights: attention / MLP x slot
    ]
    sem_names = ["qkv_sem", "o_sem", "mlp_sem", "head_sem", "out_sem", "kv_sem", "wr_sem",
                 "norm_sem"]  # fmt: skip
    if tp > 1:
        sems.append(pltpu.SemaphoreType.DMA((6, tp)))  # collectives: (send, recv) x 3 phases
        sem_names.append("coll_sem")
    if local.is_moe:
        sems.append(pltpu.SemaphoreType.DMA((2,)))  # router weights, routing flags -> SMEM
        sem_names.append("moe_sem")
    if taps:
        sems.append(pltpu.SemaphoreType.DMA((1,)))  # tapped residual -> HBM
        sem_names.append("tap_sem")
    for on, extra in ((local.is_hybrid, hybrid.SEMAPHORES), (local.is_mla, mla.SEMAPHORES)):
        for name, shape in extra if on else ():
            sems.append(pltpu.SemaphoreType.DMA(shape))
            sem_names.append(name)
    rec_names = ["rx_q", "rx_k", "rx_v", "rk", "ru", "rg"] if local.is_hybrid else []
    names = (
        ["slots_ref", "lens_ref"]
        + (["kinds_ref", "kidx_ref"] if local.is_hybrid else [])
        + (["mkinds_ref", "midx_ref"] if mixed else [])
        + [f"{name}_ref" for name in vmem_in]
        + [f"{name}_hbm" for name in hbm_in]
        + ["k_in_hbm", "v_in_hbm"][: len(caches)]
        + ["logits_hbm", "verdict_ref"]
        + ["k_hbm", "v_hbm"][: len(caches)]
        + [f"{name}_hbm" for name in rec_names]
        + (["taps_hbm"] if taps else [])
        + [f"{buf.name}_ref" for buf in buffers if buf.kind == "scratch"]
        + smem_names
        + sem_names
    )
    vs = local.vocab_size
    plan = SimpleNamespace(
        cfg=local, bs=bs, B=batch, N1=num_nodes + 1, Np=np_, M=m, D=local.hidden_size,
        H=local.num_heads, K=local.num_kv_heads, G=local.q_per_kv, L=L,
        hd=local.cache_dims[0],  # a query / key head's width (MLA: latent + rotary key)
        mla=local.is_mla, c=local.kv_lora_rank,
        V=vs, T=k_cache.shape[3], wdtype=wdtype, cdtype=cdtype,
        rmw_rows=tuning.kv_write_rows(num_nodes, cdtype), tp=tp, vocab=vocab,
        hybrid=local.is_hybrid, gated=local.attn_output_gate, rot=local.rotary_dim,
        moe=local.is_moe, E_local=e_local, mixed=mixed, shared=bool(local.shared_intermediate),
        taps=tuple(taps),
    )  # fmt: skip
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    n_in = len(vmem_in) + len(hbm_in)
    out_shape = (
        jax.ShapeDtypeStruct((m, vs), jnp.float32),
        jax.ShapeDtypeStruct((batch, 8, np_), jnp.int32),
        *(jax.ShapeDtypeStruct(c.shape, cdtype) for c in caches),
    )
    if local.is_hybrid:
        m_rows = batch * np_
        out_shape += tuple(jax.ShapeDtypeStruct(s, jnp.float32)
                           for s, _ in hybrid.record_shapes(local, m_rows))  # fmt: skip
    if taps:
        out_shape += (jax.ShapeDtypeStruct((len(taps), m, local.hidden_size), jnp.float32),)
    call = pl.pallas_call(
        functools.partial(_kernel, p=plan, names=names),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=nsp,
            grid=(1,),
            in_specs=[vmem] * len(vmem_in) + [hbm] * (len(hbm_in) + len(caches)),
            out_specs=[hbm, vmem] + [hbm] * (len(caches) + len(rec_names) + bool(taps)),
            scratch_shapes=scratch + sems,
        ),
        # Operand indices count the two scalar-prefetch operands.
        input_output_aliases={nsp + n_in + i: 2 + i for i in range(len(caches))},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=bs.vmem_limit_bytes,
            collective_id=0 if tp > 1 else None,
        ),  # fmt: skip
        cost_estimate=_cost(local, hbm_in, caches, m),
        interpret=interpret,
        name="verify_megakernel",
    )
    return call(*scalars, *vmem_in.values(), *hbm_in.values(), *caches)


def _cost(cfg: ModelConfig, weights: dict, caches: list, rows: int) -> pl.CostEstimate:
    """Matmul flops and HBM bytes (the streamed weights + the whole cache as an upper bound)."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in weights.values())
    kv_bytes = sum(c.size * c.dtype.itemsize for c in caches)
    flops = 2 * rows * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size)
    return pl.CostEstimate(
        flops=int(flops), transcendentals=int(rows * cfg.vocab_size),
        bytes_accessed=int(weight_bytes + kv_bytes),
    )  # fmt: skip


# ----------------------------------------------------------------------------- kernel


def _kernel(*refs, p, names):
    """The whole verify step; `names` labels `refs` (see `_verify_call`)."""
    r = SimpleNamespace(**dict(zip(names, refs, strict=True)))
    cfg, bs = p.cfg, p.bs
    tp, to, tf, tv = bs.proj_cols, bs.out_rows, bs.mlp_cols, bs.vocab_cols
    nq, nk = p.H * p.hd // tp, p.K * p.hd // tp
    no, nf = p.H * p.hd // to, cfg.intermediate_size // tf
    nv, v_tail = p.V // tv, p.V % tv
    eps = cfg.rms_norm_eps
    # Split over p.tp devices, each adds its heads' / columns' share of the two
    # residual updates to `red` and an all-reduce adds the sum to x (`collectives`).
    me = jax.lax.axis_index(collectives.AXIS) if p.tp > 1 else 0
    acc_ref = r.red_ref if p.tp > 1 else r.x_ref

    def reduce_into_x():
        if p.tp > 1:
            collectives.all_reduce_add(
                r.red_ref, r.x_ref, r.scat_ref, r.gath_ref, r.coll_sem, me, p.tp
            )

    def start_update():
        if p.tp > 1:
            r.red_ref[...] = jnp.zeros_like(r.red_ref)

    # ---- weight tiles: the DMA descriptors of tile j in buffer slot `slot`
    def proj_copies(name, li):
        hbm = getattr(r, f"{name}_hbm")

        def copies(j, slot):
            src = hbm.at[li, :, pl.ds(ops.aligned(j * tp, tp), tp)]
            return (pltpu.make_async_copy(src, r.qkv_buf_ref.at[slot], r.qkv_sem.at[slot]),)

        return copies

    def o_copies(li):
        def copies(j, slot):
            src = r.wo_hbm.at[li, pl.ds(ops.aligned(j * to, to), to), :]
            return (pltpu.make_async_copy(src, r.o_buf_ref.at[slot], r.o_sem.at[slot]),)

        return copies

    def mlp_copies(li):
        return ops.ffn_copies(r, "w", li, tf)

    def head_copies(width):
        def copies(j, slot):
            col = pl.ds(ops.aligned(j * tv, tv), width)
            if cfg.tie_word_embeddings:  # embed [V, D]: row tiles
                src, dst = r.head_hbm.at[col, :], r.head_buf_ref.at[slot, pl.ds(0, width), :]
            else:  # lm_head [D, V]: column tiles
                src, dst = r.head_hbm.at[:, col], r.head_buf_ref.at[slot, :, pl.ds(0, width)]
            return (pltpu.make_async_copy(src, dst, r.head_sem.at[slot]),)

        return copies

    # ---- one decoder layer
    ring, mlp_ring = bs.weight_ring, bs.mlp_ring  # qkv / o / LM head rings; the MLP's

    def open_q(li, prev_ahead):
        """Starts tile k of layer li's first stream: wq, or a linear layer's lq (MLA: wq_a
        or wq)."""
        if p.mla:
            return ops.opener(mla.first_copies(r, p, li), 0, mla.first_tiles(p), ring, prev_ahead)
        if not p.hybrid:
            return ops.opener(proj_copies("wq", li), 0, nq, ring, prev_ahead)

        def nxt(k):
            kind, idx = r.kinds_ref[li], r.kidx_ref[li]

            @pl.when(kind == hybrid.KIND_ATTENTION)
            def _():
                ops.opener(proj_copies("wq", idx), 0, nq, ring, prev_ahead)(k)

            @pl.when(kind == hybrid.KIND_LINEAR)
            def _():
                lq = hybrid.lin_proj_copies(r, p, "w_lq", idx)
                ops.opener(lq, 0, hybrid.first_tiles(p), ring, prev_ahead)(k)

        return nxt

    def attention_mixer(li, ai, open_mlp):
        """Layer li's attention (ai: its index among the attention layers)."""
        qkv = [("q", nq), ("k", nk), ("v", nk)] + ([("g", nq)] if p.gated else [])
        offset = 0  # q, k, v (and the gate) share one ring
        for idx, (name, n) in enumerate(qkv):
            if idx + 1 < len(qkv):
                nxt_name, nxt_n = qkv[idx + 1]
                nxt = ops.opener(proj_copies(f"w{nxt_name}", ai), offset + n, nxt_n, ring, ring - 1)
            else:
                nxt = ops.opener(o_copies(ai), 0, no, ring, ring - 1)
            body = functools.partial(_project, r, p, ai, name)
            ops.stream(n, offset, proj_copies(f"w{name}", ai), body, ring=ring, nxt=nxt)
            offset += n

        jax.lax.fori_loop(0, p.B, functools.partial(attention.attend_row, r, p, ai), 0)

        o_tile = ops.head_rows_tile(acc_ref, r.attn_ref, r.o_buf_ref, p.hd, to)
        start_update()
        ops.stream(no, 0, o_copies(ai), o_tile, ring=ring, nxt=open_mlp)

    def norm_copies(li, slot):  # layer li's two norm rows into norms[2 slot], [2 slot + 1]
        return (
            pltpu.make_async_copy(r.attn_norm_hbm.at[li], r.norms_ref.at[2 * slot],
                                  r.norm_sem.at[0, slot]),
            pltpu.make_async_copy(r.mlp_norm_hbm.at[li], r.norms_ref.at[2 * slot + 1],
                                  r.norm_sem.at[1, slot]),
        )  # fmt: skip

    def layer(li, carry):
        nslot = ops.rem(li, 2)
        ops.wait(norm_copies(li, nslot))

        @pl.when(li + 1 < p.L)  # the next layer's, into the slot layer li - 1 used
        def _():
            ops.start(norm_copies(li + 1, 1 - nslot))

        r.h_ref[...] = ops.rms(r.x_ref[...], r.norms_ref[2 * nslot], eps).astype(p.wdtype)
        # The MLP's first tiles start during the attention's output projection: a dense
        # MLP's, or a MoE layer's shared expert's (its routed experts wait for the
        # routing: `moe`), whose router weights start now.
        mkind, mi = (r.mkinds_ref[li], r.midx_ref[li]) if p.mixed else (int(p.moe), li)
        open_dense = ops.opener(mlp_copies(mi), 0, nf, mlp_ring, ring - 1)
        open_shared = None
        if p.moe and p.shared:
            open_shared = ops.opener(moe.shared_copies(r, p, mi), 0, moe.shared_tiles(p),
                                     mlp_ring, ring - 1)  # fmt: skip

        def when_moe(moe_layer: bool, fn):
            if not p.mixed:
                if (mkind == 1) == moe_layer:
                    fn()
                return

            def run():
                fn()

            pl.when(mkind == int(moe_layer))(run)

        when_moe(True, lambda: moe.router_copy(r, mi).start())

        def open_mlp(k):
            when_moe(False, lambda: open_dense(k))
            if open_shared is not None:
                when_moe(True, lambda: open_shared(k))

        if p.moe and not p.mixed and open_shared is None:
            open_mlp = None
        if p.hybrid:
            kind, idx = r.kinds_ref[li], r.kidx_ref[li]

            @pl.when(kind == hybrid.KIND_ATTENTION)
            def _():
                attention_mixer(li, idx, open_mlp)

            @pl.when(kind == hybrid.KIND_LINEAR)
            def _():
                hybrid.linear_mixer(r, p, idx, acc_ref=acc_ref, start_update=start_update,
                                    open_out_next=open_mlp)  # fmt: skip
        elif p.mla:
            mla.mixer(r, p, li, acc_ref=acc_ref, start_update=start_update, open_mlp=open_mlp)
        else:
            attention_mixer(li, li, open_mlp)
        reduce_into_x()  # the first MLP tiles are already in flight
        r.h_ref[...] = ops.rms(r.x_ref[...], r.norms_ref[2 * nslot + 1], eps).astype(p.wdtype)

        def next_layer_or_head(k):
            @pl.when(li + 1 < p.L)
            def _():
                open_q(li + 1, mlp_ring - 1)(k)

            @pl.when(li + 1 == p.L)
            def _():
                open_head(k)

        def mlp_tile(j, slot, c):
            hx = r.h_ref[...]
            g = ops.dot(hx, r.gate_buf_ref[slot])
            u = ops.dot(hx, r.up_buf_ref[slot])
            a = (g * jax.nn.sigmoid(g) * u).astype(p.wdtype)
            acc_ref[...] = acc_ref[...] + ops.dot(a, r.down_buf_ref[slot])
            return c

        start_update()
        when_moe(
            True,
            lambda: moe.moe_mlp(
                r, p, mi, acc_ref=acc_ref, me=me, nxt=next_layer_or_head, mlp_tile=mlp_tile
            ),
        )
        when_moe(False, lambda: ops.stream(nf, 0, mlp_copies(mi), mlp_tile, ring=mlp_ring,
                                           nxt=next_layer_or_head))  # fmt: skip
        reduce_into_x()  # the next layer's first tiles are already in flight
        for t, tapped in enumerate(p.taps):  # a block drafter's features: x after layer li

            @pl.when(li == tapped)
            def _(t=t):
                copy = pltpu.make_async_copy(r.x_ref, r.taps_hbm.at[t], r.tap_sem.at[0])
                copy.start()
                copy.wait()  # x changes in the next layer

        return carry

    open_head = ops.opener(head_copies(tv), 0, nv, ring, mlp_ring - 1)
    open_tail = None
    if v_tail:  # a one-tile stream after the full-width ones: its tile 0 is tile nv
        tail = lambda k, slot: head_copies(v_tail)(k + nv, slot)  # noqa: E731
        open_tail = ops.opener(tail, nv, 1, ring, ring - 1)
    x0 = pltpu.make_async_copy(r.x0_hbm, r.x_ref, r.wr_sem.at[0])  # no KV write yet
    x0.start()
    ops.start(norm_copies(0, 0))
    x0.wait()
    for k in range(ring - 1):
        open_q(0, ring - 1)(k)
    if p.tp > 1:  # no remote DMA into a device that has not entered the kernel
        collectives.barrier(me, p.tp)
    jax.lax.fori_loop(0, p.L, layer, 0)

    # ---- LM head over vocabulary tiles, running (max, argmax) per row
    r.h_ref[...] = ops.rms(r.x_ref[...], r.final_norm_ref[...], eps).astype(p.wdtype)

    def out_copy(j, width):  # staged through a two-slot buffer, slot j % 2
        col = pl.ds(ops.aligned(j * tv, tv), width)
        stage = ops.rem(j, 2)
        return pltpu.make_async_copy(
            r.logits_buf_ref.at[stage, :, pl.ds(0, width)],
            r.logits_hbm.at[:, col],
            r.out_sem.at[stage],
        )

    def head_tile(width):
        def body(j, slot, carry):
            mx, am = carry
            if cfg.tie_word_embeddings:
                y = ops.dot_nt(r.h_ref[...], r.head_buf_ref[slot, pl.ds(0, width), :])
            else:
                y = ops.dot(r.h_ref[...], r.head_buf_ref[slot, :, pl.ds(0, width)])

            @pl.when(j >= 2)  # the staging slot is free once tile j - 2 reached HBM
            def _():
                out_copy(j - 2, tv).wait()

            r.logits_buf_ref[ops.rem(j, 2), :, pl.ds(0, width)] = y
            out_copy(j, width).start()
            ids = ops.iota(y.shape, 1) + j * tv + me * p.V  # this device's vocabulary
            if p.V * p.tp != p.vocab:  # padded columns never win
                y = jnp.where(ids < p.vocab, y, -jnp.inf)
            tile_max = jnp.max(y, axis=1, keepdims=True)
            tile_arg = jnp.min(jnp.where(y == tile_max, ids, _BIG), axis=1, keepdims=True)
            better = tile_max > mx  # strict: an earlier tile keeps a tie (lowest id)
            return jnp.where(better, tile_max, mx), jnp.where(better, tile_arg, am)

        return body

    init = (jnp.full((p.M, 1), -jnp.inf, jnp.float32), jnp.zeros((p.M, 1), jnp.int32))
    carry = ops.stream(nv, 0, head_copies(tv), head_tile(tv), ring=ring, nxt=open_tail, init=init)
    widths = [tv] * nv
    if v_tail:  # the tail tile is in flight (`open_tail`), in ring slot nv % ring
        ops.wait(head_copies(v_tail)(nv, nv % ring))
        carry = head_tile(v_tail)(nv, nv % ring, carry)
        widths.append(v_tail)
    for j in range(max(0, len(widths) - 2), len(widths)):  # the copies still in flight
        out_copy(j, widths[j]).wait()
    if p.tp > 1:
        carry = collectives.global_argmax(*carry, r.amx_ref, r.coll_sem, me, p.tp)
    r.argmax_ref[...] = carry[1]

    jax.lax.fori_loop(0, p.B, functools.partial(greedy.greedy_row, r, p), 0)


def _project(r, p, li, name, j, slot, carry):
    """qkv tile j of `name` ("q", "k", "v" or the output gate's "g"): bias, q/k norm,
    RoPE; stores it head-major."""
    cfg, tp, hd = p.cfg, p.bs.proj_cols, p.hd
    y = ops.dot(r.h_ref[...], r.qkv_buf_ref[slot])  # [M, tp]
    if cfg.attention_bias:  # b{name} is f32[L, tiles, tp]
        y = y + getattr(r, f"b{name}_ref")[li, pl.ds(j, 1), :]
    hpt = tp // hd
    heads = [y[:, t * hd : (t + 1) * hd] for t in range(hpt)]
    if name in ("q", "k"):
        if cfg.qk_norm:
            w = getattr(r, f"{name}_norm_ref")[pl.ds(li, 1), :]
            heads = [ops.rms(x, w, cfg.rms_norm_eps) for x in heads]
            y = jnp.concatenate(heads, axis=1) if hpt > 1 else heads[0]
        y = ops.rope(y, r.cos_ref[...], r.sin_ref[...], hd, p.rot)
        heads = [y[:, t * hd : (t + 1) * hd] for t in range(hpt)]
    dst = r.gate_ref if name == "g" else getattr(r, f"{name}_ref")
    for t, x in enumerate(heads):
        dst[j * hpt + t] = x
    return carry
