"""Hybrid targets in the verify megakernel: gated DeltaNet layers beside gated attention
layers (Qwen3.5 / Qwen3-Next, dense MLPs).

The layer loop stays one `fori_loop` over all L layers; two scalar-prefetched tables
say what layer li is (`layer_tables`: its kind, and its index among the layers of its
kind), and the layer body runs the attention mixer or the DeltaNet mixer under
`pl.when`, then the shared MLP. The first weight tiles of the next layer are started
during this layer's MLP whichever its kind (the same qkv ring serves both mixers'
input projections), so the DMA queue still never drains at a layer boundary.

Weights (`linear_attention.stacked_layout`, once at load, from the model's per-layer
tuple):

    layers/attn_norm, mlp_norm [L, D]    w_gate, w_up [L, D, F]    w_down [L, F, D]
    layers/wq, wk, wv, wo, wg, q_norm, k_norm   stacked over the La attention layers
    lin/w_lq, w_lk [Ll, D, kd]   w_lv, w_z [Ll, D, vd]   w_ba [Ll, 2, D, Hv] (b; a)
    lin/conv_q, conv_k [Ll, K, kd]   conv_v [Ll, K, vd]   a_log, dt_bias [Ll, Hv]
    lin/lin_norm [Ll, dv]   w_out [Ll, vd, D]

Every linear-layer array is split over devices by heads on its last axis but w_out's
(rows), so a device holds Hk / n key heads and Hv / n value heads, their state and their
convolution channels: no relayout at any step. The DeltaNet mixer of one layer:

    lq, lk, lv, lz tiles (qkv ring) -> conv inputs [M, 2 kd + vd] and the gate z
    b / a projections (one small DMA per layer), the committed convolution windows
    per sequence: DeltaNet mixing (`deltanet.mix_sequence`), the head's state
    DMA'd from the cache into VMEM, sequence b + 1's while b computes
    w_out row tiles (o ring) -> this device's share of the residual update

and the block's record (convolution inputs, k, u, G) goes back to HBM for the caller
to commit the accepted path (`transformer.write_kv(..., counts=)`), as the attention
layers' block K/V do.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import linear_attention as la
from specdec.kernels.config import ModelConfig
from specdec.kernels.linear_attention import LinearBlock
from specdec.kernels.megakernel import deltanet, ops, tuning
from specdec.kernels.transformer import Params

KIND_ATTENTION, KIND_LINEAR = 0, 1
# name -> the axis n devices split (None: replicated)
LINEAR_SPLIT = {
    "w_lq": 2, "w_lk": 2, "w_lv": 2, "w_z": 2, "w_ba": 3, "conv_q": 2, "conv_k": 2,
    "conv_v": 2, "a_log": 1, "dt_bias": 1, "lin_norm": None, "w_out": 1,
}  # fmt: skip
LINEAR_HBM = ("w_lq", "w_lk", "w_lv", "w_z", "w_ba", "w_out")


def layer_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """i32[L] kinds and i32[L] each layer's index among the layers of its kind."""
    kinds = np.array([KIND_LINEAR if cfg.linear_layer(i) else KIND_ATTENTION
                      for i in range(cfg.num_layers)], np.int32)  # fmt: skip
    index = np.array([cfg.cache_layer(i) for i in range(cfg.num_layers)], np.int32)
    return kinds, index


def check(cfg: ModelConfig, n: int) -> None:
    """Raises ValueError naming what keeps a hybrid `cfg` from the kernel on n devices."""
    arch = cfg.architecture.value
    if cfg.linear_kind != "gated_deltanet":
        raise ValueError(
            f"The verify megakernel runs gated DeltaNet linear layers; {arch}'s "
            f"{cfg.linear_kind!r} layers must use kernel='xla'."
        )
    if cfg.is_moe:
        raise ValueError(
            f"The verify megakernel covers dense models only; {arch} with "
            f"{cfg.num_experts} experts must use kernel='xla'."
        )
    if cfg.sliding_window is not None or cfg.attention_bias:
        raise ValueError(f"{arch}: sliding windows and attention biases are not covered here.")
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(cfg, name) % n:
            raise ValueError(
                f"The megakernel on {n} devices splits {name} ({getattr(cfg, name)}) {n} "
                f"ways; use tensor_parallel_size dividing it, or kernel='xla'."
            )


def step_inputs(cfg: ModelConfig, params: Params, cache, block_mask, positions, cache_lens,
                slots, np_: int) -> tuple[dict, dict, dict]:  # fmt: skip
    """Per-step operands of the linear layers: (replicated VMEM inputs, split inputs
    name -> (array, axis), scalar tables). The committed convolution windows are
    gathered here (K - 1 rows per sequence and layer, a few KiB), the recurrent states
    are not: the kernel reads them from the cache by DMA."""
    lin = params["lin"]
    taps = cfg.linear_conv_kernel_dim
    sources = la.ancestor_sources(block_mask, positions, cache_lens, taps)
    sel_block, sel_state = deltanet.conv_selectors(sources, np_, taps)
    kd, _, _ = cfg.linear_dims
    safe = jnp.clip(slots, 0, cache.num_slots - 1)
    fresh = (cache_lens == 0) | (slots < 0)
    win = jnp.where(fresh[None, :, None, None], 0.0, cache.lin.conv[:, safe].astype(jnp.float32))
    wrows = tuning.round_up(taps - 1, 8)
    win = jnp.pad(win, ((0, 0), (0, 0), (0, wrows - (taps - 1)), (0, 0)))
    f32 = jnp.float32
    replicated = {
        "sel_block": sel_block,
        "sel_state": sel_state,
        "lin_norm": lin["lin_norm"].astype(f32),
    }
    split = {
        "conv_q": (lin["conv_q"].astype(f32), 2),
        "conv_k": (lin["conv_k"].astype(f32), 2),
        "conv_v": (lin["conv_v"].astype(f32), 2),
        "a_log": (lin["a_log"].astype(f32), 1),
        "dt_bias": (lin["dt_bias"].astype(f32), 1),
        "win_q": (win[..., :kd], 3),
        "win_k": (win[..., kd : 2 * kd], 3),
        "win_v": (win[..., 2 * kd :], 3),
        "rec": (cache.lin.rec, 2),
    }
    split |= {name: (lin[name], LINEAR_SPLIT[name]) for name in LINEAR_HBM}
    kinds, index = layer_tables(cfg)
    return replicated, split, {"kinds": jnp.asarray(kinds), "kidx": jnp.asarray(index)}


def records(outs, cfg: ModelConfig, b: int, np_: int, n1: int, tp: int) -> LinearBlock:
    """The kernel's record outputs (global arrays, device shards concatenated) as a
    `LinearBlock` with leaves [Ll, B, N + 1, ...]."""
    rx_q, rx_k, rx_v, rk, ru, rg = outs
    ll = rx_q.shape[0]
    hv = cfg.linear_num_value_heads

    def rows(a):  # [Ll, B * Np, c] -> [Ll, B, N1, c]
        return a.reshape(ll, b, np_, -1)[:, :, :n1]

    def heads(a):  # [Ll, Hv, B * Np, d] -> [Ll, B, N1, Hv, d]
        return jnp.moveaxis(a.reshape(ll, hv, b, np_, -1)[:, :, :, :n1], 1, 3)

    g = rg.reshape(ll, b * np_, tp, tuning.LANES)[..., : hv // tp].reshape(ll, b * np_, hv)
    return LinearBlock(
        x=rows(jnp.concatenate([rx_q, rx_k, rx_v], axis=-1)), k=heads(rk), u=heads(ru),
        g=rows(g),
    )  # fmt: skip


def record_shapes(local: ModelConfig, m: int) -> list[tuple[tuple[int, ...], int]]:
    """(shape, split axis) of each record output one device writes."""
    ll = len(local.linear_layers)
    kd, vd, _ = local.linear_dims
    hv, dk, dv = (
        local.linear_num_value_heads,
        local.linear_key_head_dim,
        local.linear_value_head_dim,
    )
    return [
        ((ll, m, kd), 2), ((ll, m, kd), 2), ((ll, m, vd), 2),
        ((ll, hv, m, dk), 1), ((ll, hv, m, dv), 1), ((ll, m, tuning.LANES), 2),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- in the kernel


def lin_proj_copies(r, p, name, bi):
    """DMA descriptors of column tile j of linear layer bi's projection `name`."""
    tp = p.bs.proj_cols
    hbm = getattr(r, f"{name}_hbm")

    def copies(j, slot):
        src = hbm.at[bi, :, pl.ds(ops.aligned(j * tp, tp), tp)]
        return (pltpu.make_async_copy(src, r.qkv_buf_ref.at[slot], r.qkv_sem.at[slot]),)

    return copies


def first_tiles(p) -> int:
    """Tiles of a linear layer's first stream (lq)."""
    return p.cfg.linear_num_key_heads * p.cfg.linear_key_head_dim // p.bs.proj_cols


def linear_mixer(r, p, bi, *, acc_ref, start_update, open_out_next):
    """The DeltaNet mixer of linear layer `bi` (module docstring). On entry the first
    lq tiles are in flight in the qkv ring; on exit this device's residual update is in
    `acc_ref` and the w_out stream has started the next stream (`open_out_next`)."""
    bs, cfg = p.bs, p.cfg
    tp, to = bs.proj_cols, bs.out_rows
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd, vd = hk * dk, hv * dv
    ring = bs.weight_ring
    dims = (hk, hv, dk, dv)

    # Small per-layer operands: b / a weights and the committed convolution windows.
    small = [
        pltpu.make_async_copy(r.w_ba_hbm.at[bi], r.ba_buf_ref, r.lin_sem.at[0]),
        pltpu.make_async_copy(r.win_q_hbm.at[bi], r.winq_buf_ref, r.lin_sem.at[1]),
        pltpu.make_async_copy(r.win_k_hbm.at[bi], r.wink_buf_ref, r.lin_sem.at[2]),
        pltpu.make_async_copy(r.win_v_hbm.at[bi], r.winv_buf_ref, r.lin_sem.at[3]),
    ]
    ops.start(small)

    def proj_copies(name):
        return lin_proj_copies(r, p, name, bi)

    def out_copies(j, slot):
        src = r.w_out_hbm.at[bi, pl.ds(ops.aligned(j * to, to), to), :]
        return (pltpu.make_async_copy(src, r.o_buf_ref.at[slot], r.o_sem.at[slot]),)

    nk, nv, no = kd // tp, vd // tp, vd // to
    streams = [("w_lq", nk, 0), ("w_lk", nk, kd), ("w_lv", nv, 2 * kd), ("w_z", nv, None)]
    offset = 0
    for idx, (name, n, col0) in enumerate(streams):
        if idx + 1 < len(streams):
            nxt_name, nxt_n, _ = streams[idx + 1]
            nxt = ops.opener(proj_copies(nxt_name), offset + n, nxt_n, ring, ring - 1)
        else:
            nxt = ops.opener(out_copies, 0, no, ring, ring - 1)

        def tile(j, slot, c, col0=col0):
            y = ops.dot(r.h_ref[...], r.qkv_buf_ref[slot])
            col = pl.ds(ops.aligned(j * tp, tp), tp)
            if col0 is None:
                r.lz_ref[:, col] = y
            else:
                r.lx_ref[:, pl.ds(ops.aligned(col0 + j * tp, tp), tp)] = y
            return c

        ops.stream(n, offset, proj_copies(name), tile, ring=ring, nxt=nxt)
        offset += n

    ops.wait(small)
    hx = r.h_ref[...]
    ba = jnp.concatenate([ops.dot(hx, r.ba_buf_ref[0]), ops.dot(hx, r.ba_buf_ref[1])], axis=1)
    r.lba_ref[...] = ba
    conv_w = jnp.concatenate(
        [r.conv_q_ref[bi], r.conv_k_ref[bi], r.conv_v_ref[bi]], axis=1
    )  # [K, 2 kd + vd]
    _mix_rows(r, p, bi, conv_w, dims)

    # The block's record, for the caller's commit.
    rec = [
        pltpu.make_async_copy(r.lx_ref.at[:, pl.ds(0, kd)], r.rx_q_hbm.at[bi], r.lin_sem.at[0]),
        pltpu.make_async_copy(r.lx_ref.at[:, pl.ds(kd, kd)], r.rx_k_hbm.at[bi], r.lin_sem.at[1]),
        pltpu.make_async_copy(
            r.lx_ref.at[:, pl.ds(2 * kd, vd)], r.rx_v_hbm.at[bi], r.lin_sem.at[2]
        ),
        pltpu.make_async_copy(r.rk_ref, r.rk_hbm.at[bi], r.lin_sem.at[3]),
        pltpu.make_async_copy(r.ru_ref, r.ru_hbm.at[bi], r.lin_sem.at[4]),
        pltpu.make_async_copy(r.rg_ref, r.rg_hbm.at[bi], r.lin_sem.at[5]),
    ]
    ops.start(rec)

    out_tile = ops.head_rows_tile(acc_ref, r.lo_ref, r.o_buf_ref, dv, to)
    start_update()
    ops.stream(no, 0, out_copies, out_tile, ring=ring, nxt=open_out_next)
    ops.wait(rec)  # the record buffers are rewritten by the next linear layer


def _mix_rows(r, p, bi, conv_w, dims):
    """`deltanet.mix_sequence` per sequence, states double-buffered from the cache."""
    hv = dims[1]

    def state_copy(b, slot):
        src = r.rec_hbm.at[bi, jnp.maximum(r.slots_ref[b], 0)]
        return pltpu.make_async_copy(src, r.s_buf_ref.at[slot], r.s_sem.at[slot])

    lanes = ops.iota((p.Np, tuning.LANES), 1)

    def sequence(b, slot, wait):
        rows = pl.ds(pl.multiple_of(b * p.Np, 8), p.Np)
        win = jnp.concatenate([r.winq_buf_ref[b], r.wink_buf_ref[b], r.winv_buf_ref[b]], axis=1)
        conv_in = deltanet.conv_inputs(r.lx_ref[rows, :], win, r.sel_block_ref[b],
                                       r.sel_state_ref[b])  # fmt: skip
        wait()
        gs = []

        def write(h, o, k, u, big_g):
            r.lo_ref[h, rows, :] = o.astype(p.wdtype)
            r.rk_ref[h, rows, :] = k
            r.ru_ref[h, rows, :] = u
            gs.append(big_g)

        deltanet.mix_sequence(
            conv_in, conv_w, r.lba_ref[rows, :], r.lz_ref[rows, :], r.anc_mask_ref[b] > 0,
            lambda h: r.s_buf_ref[slot, h], r.lens_ref[b] == 0, r.a_log_ref[pl.ds(bi, 1), :],
            r.dt_bias_ref[pl.ds(bi, 1), :], r.lin_norm_ref[pl.ds(bi, 1), :], write, dims=dims,
            eps=p.cfg.rms_norm_eps,
        )  # fmt: skip
        g_lanes = jnp.zeros((p.Np, tuning.LANES), jnp.float32)
        for h in range(hv):
            g_lanes = jnp.where(lanes == h, gs[h], g_lanes)
        r.rg_ref[rows, :] = g_lanes

    deltanet.over_sequences(p.B, state_copy, sequence)


SEMAPHORES = (("lin_sem", (6,)), ("s_sem", (2,)))

__all__ = [
    "check",
    "layer_tables",
    "linear_mixer",
    "records",
    "step_inputs",
]
