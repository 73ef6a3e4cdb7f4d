"""Routed experts in the verify megakernel (Qwen3-MoE: softmax routing, top k).

A MoE layer's MLP, after the attention's residual update:

1. the router's weights [D, E] (started by DMA when the layer began, so they are in
   VMEM by now) give every row its top-k experts and weights, in the kernel: softmax,
   then k rounds of (max, lowest index among ties) exactly as `jax.lax.top_k`, the
   weights renormalised when `norm_topk_prob` and rounded to the experts' dtype, as
   `transformer.route` does. Rows that are no real block row (padding, inactive
   sequences) route nowhere;
2. the union of the experts the step's rows route to is written to SMEM (a VMEM ->
   SMEM DMA: scalar code cannot read vector values) and compacted into a list of this
   device's used experts;
3. only those experts' weights stream from HBM, in column tiles that carry the
   matching gate / up columns and down rows (the dense MLP's tiles and ring, one
   expert after another): `x += w_e * ((silu(h @ g) * (h @ u)) @ d)` over all rows,
   `w_e` the rows' weight column for expert e (zero for rows not routed to it). The
   stream's length is known only in the kernel (`ops.stream` with a traced length),
   and its first tiles start once the routing is done: the one DMA bubble per MoE
   layer the routing costs (the attention's output projection cannot prefetch tiles
   nobody has chosen yet).

Over n devices each holds E / n whole experts (`e_gate` / `e_up` / `e_down` cut on
their expert axis); every device routes every row (the router is replicated), streams
its own used experts and adds its partial sum to the residual's all-reduce, which
combines the routed outputs (`collectives`).

Expected weight bytes per step: a step of R routed rows reads the union of their
experts, E (1 - (1 - k / E)^R) of them under uniform routing, at most min(E, R k)
(`union_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel import ops

SPLIT = {"e_gate": 1, "e_up": 1, "e_down": 1, "router": None}  # axis n devices cut
_BIG = 2**30


def check(cfg: ModelConfig, n: int) -> None:
    """Raises ValueError naming what keeps a MoE `cfg` from the kernel on n devices."""
    arch = cfg.architecture.value
    if cfg.scoring_func != "softmax" or cfg.shared_intermediate or not cfg.uniform_layers:
        raise ValueError(
            f"The verify megakernel routes softmax top-k experts (Qwen3-MoE); {arch}'s "
            "sigmoid / grouped routing, shared experts or dense first layers must use "
            "kernel='xla'."
        )
    if cfg.num_experts % n:
        raise ValueError(
            f"The megakernel on {n} devices splits num_experts ({cfg.num_experts}) {n} ways; "
            f"use tensor_parallel_size dividing it, or kernel='xla'."
        )


def union_experts(num_experts: int, k: int, rows: int) -> tuple[float, int]:
    """(expected, worst-case) number of distinct experts `rows` rows route to, each
    choosing k of E uniformly at random."""
    expected = num_experts * (1.0 - (1.0 - k / num_experts) ** rows)
    return expected, min(num_experts, rows * k)


def route_rows(logits, live, *, k: int, norm: bool, scale: float, wdtype):
    """Routing weights f32[M, E] (zero off each row's top k) from router logits
    f32[M, E]; rows where `live` [M, 1] is 0 get none."""
    m = jnp.max(logits, axis=1, keepdims=True)
    e = jnp.exp(logits - m)
    probs = e / jnp.sum(e, axis=1, keepdims=True)
    lanes = ops.iota(probs.shape, 1)
    w = jnp.zeros_like(probs)
    left = probs
    for _ in range(k):
        top = jnp.max(left, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(left == top, lanes, _BIG), axis=1, keepdims=True)
        hit = lanes == idx
        w = jnp.where(hit, probs, w)
        left = jnp.where(hit, -jnp.inf, left)
    if norm:
        w = w / jnp.sum(w, axis=1, keepdims=True)
    w = (w * scale).astype(wdtype).astype(jnp.float32)
    return jnp.where(live > 0, w, 0.0)


def router_copy(r, li):
    return pltpu.make_async_copy(r.router_hbm.at[li], r.router_buf_ref, r.moe_sem.at[0])


def moe_mlp(r, p, li, *, acc_ref, me, nxt):
    """Layer li's routed experts (module docstring); on entry h_ref holds the normed
    MLP input and the router's DMA is in flight; `nxt` starts the next stream."""
    bs, cfg = p.bs, p.cfg
    tf, mlp_ring = bs.mlp_cols, bs.mlp_ring
    e_all, e_local = cfg.num_experts, p.E_local
    nfe = cfg.moe_intermediate_size // tf
    router_copy(r, li).wait()
    logits = ops.dot(r.h_ref[...], r.router_buf_ref[...])
    w = route_rows(logits, r.live_ref[...], k=cfg.num_experts_per_tok, norm=cfg.norm_topk_prob,
                   scale=cfg.routed_scaling_factor, wdtype=p.wdtype)  # fmt: skip
    r.route_w_ref[...] = w
    r.used_v_ref[...] = jnp.max(jnp.where(w > 0, 1, 0), axis=0, keepdims=True)
    meta = pltpu.make_async_copy(r.used_v_ref, r.used_s_ref, r.moe_sem.at[1])
    meta.start()
    meta.wait()

    def compact(e, count):  # this device's used experts, in order
        r.list_s_ref[jnp.minimum(count, e_local - 1)] = e
        return count + r.used_s_ref[0, me * e_local + e]

    count = jax.lax.fori_loop(0, e_local, compact, 0)
    n = count * nfe

    def copies(t, slot):
        e = r.list_s_ref[jax.lax.div(t, nfe)]
        col = pl.ds(ops.aligned(jax.lax.rem(t, nfe) * tf, tf), tf)
        return (
            pltpu.make_async_copy(
                r.e_gate_hbm.at[li, e, :, col], r.gate_buf_ref.at[slot], r.mlp_sem.at[0, slot]
            ),
            pltpu.make_async_copy(
                r.e_up_hbm.at[li, e, :, col], r.up_buf_ref.at[slot], r.mlp_sem.at[1, slot]
            ),
            pltpu.make_async_copy(
                r.e_down_hbm.at[li, e, col, :], r.down_buf_ref.at[slot], r.mlp_sem.at[2, slot]
            ),
        )

    lanes = ops.iota((p.M, e_all), 1)

    def tile(t, slot, c):
        e = r.list_s_ref[jax.lax.div(t, nfe)] + me * e_local  # its routing column
        hx = r.h_ref[...]
        g = ops.dot(hx, r.gate_buf_ref[slot])
        u = ops.dot(hx, r.up_buf_ref[slot])
        a = (g * jax.nn.sigmoid(g) * u).astype(p.wdtype)
        weight = jnp.sum(jnp.where(lanes == e, r.route_w_ref[...], 0.0), axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] + weight * ops.dot(a, r.down_buf_ref[slot])
        return c

    ops.dynamic_opener(copies, n, mlp_ring)
    ops.stream(n, 0, copies, tile, ring=mlp_ring, nxt=nxt)


def live_rows(slots, n1: int, np_: int) -> jax.Array:
    """i32[B * Np, 1]: 1 on the real block rows of active sequences."""
    b = slots.shape[0]
    live = (np.arange(np_) < n1)[None, :] & (slots >= 0)[:, None]
    return live.reshape(b * np_, 1).astype(jnp.int32)
