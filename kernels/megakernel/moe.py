"""Routed experts in the verify megakernel: Qwen3-MoE (softmax, top k) and DeepSeek-V3
routing (sigmoid scores, correction bias, group-limited top k, routed scaling, shared
experts, dense first layers).

A MoE layer's MLP, after the attention's residual update:

1. the router's weights [D, E] (started by DMA when the layer began, so they are in
   VMEM by now) give every row its top-k experts and weights, in the kernel, as
   `transformer.route` does: softmax (or sigmoid scores plus the correction bias,
   the `topk_group` best of `n_group` groups by their two best scores), then k
   rounds of (max, lowest index among ties) exactly as `jax.lax.top_k`; the weights
   renormalised when `norm_topk_prob`, scaled, rounded to the experts' dtype. Rows
   that are no real block row (padding, inactive sequences) route nowhere;
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

Shared experts (an MLP every row runs) stream first, through the same ring: their
tiles are known before the routing, so the attention's output projection starts
them, and the routed tiles follow them in the ring. A model whose first layers are
dense (`first_k_dense_replace`) holds its dense and its MoE MLPs as two stacks
(`kernels/stacks.py`); a scalar-prefetched table says which one layer li uses.

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

# axis n devices cut (None: replicated); the shared experts split as a dense MLP
SPLIT = {"e_gate": 1, "e_up": 1, "e_down": 1, "router": None}
SHARED_SPLIT = {"s_gate": 2, "s_up": 2, "s_down": 1}
_BIG = 2**30


def check(cfg: ModelConfig, n: int) -> None:
    """Raises ValueError naming what keeps a MoE `cfg` from the kernel on n devices."""
    arch = cfg.architecture.value
    if cfg.shared_expert_gate:
        raise ValueError(
            f"The verify megakernel runs shared experts without a gate; {arch}'s gated "
            "shared expert must use kernel='xla'."
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


def _argmax_lowest(x, lanes):
    """(max [M, 1], the lowest lane holding it [M, 1]) of x [M, E]."""
    top = jnp.max(x, axis=1, keepdims=True)
    return top, jnp.min(jnp.where(x == top, lanes, _BIG), axis=1, keepdims=True)


def route_rows(cfg: ModelConfig, logits, live, bias, wdtype):
    """Routing weights f32[M, E] (zero off each row's top k) from router logits
    f32[M, E] (`transformer.route`); rows where `live` [M, 1] is 0 get none. `bias`
    f32[1, E] is the correction bias of sigmoid routing (None: none)."""
    lanes = ops.iota(logits.shape, 1)
    if cfg.scoring_func == "softmax":
        e = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if cfg.n_group > 1:  # keep the topk_group groups whose two best choices sum highest
            group = jax.lax.div(lanes, cfg.num_experts // cfg.n_group)
            sums = []
            for g in range(cfg.n_group):
                inside = jnp.where(group == g, choice, -jnp.inf)
                best, at = _argmax_lowest(inside, lanes)
                second = jnp.max(jnp.where(lanes == at, -jnp.inf, inside), axis=1, keepdims=True)
                sums.append(best + second)
            keep = jnp.zeros(logits.shape, jnp.bool_)
            chosen = [jnp.zeros_like(sums[0], dtype=jnp.bool_) for _ in sums]
            for _ in range(cfg.topk_group):
                top = jnp.full_like(sums[0], -jnp.inf)
                pick = jnp.full(sums[0].shape, cfg.n_group, jnp.int32)
                for g in range(cfg.n_group - 1, -1, -1):  # ties to the lowest group
                    better = ~chosen[g] & (sums[g] >= top)
                    top = jnp.where(better, sums[g], top)
                    pick = jnp.where(better, g, pick)
                chosen = [c | (pick == g) for g, c in enumerate(chosen)]
            for g in range(cfg.n_group):
                keep = keep | ((group == g) & chosen[g])
            choice = jnp.where(keep, choice, -jnp.inf)
    w = jnp.zeros_like(scores)
    for _ in range(cfg.num_experts_per_tok):
        _, idx = _argmax_lowest(choice, lanes)
        hit = lanes == idx
        w = jnp.where(hit, scores, w)
        choice = jnp.where(hit, -jnp.inf, choice)
    if cfg.norm_topk_prob:
        total = jnp.sum(w, axis=1, keepdims=True)
        w = w / (total + 1e-20 if cfg.scoring_func == "sigmoid" else total)
    w = (w * cfg.routed_scaling_factor).astype(wdtype).astype(jnp.float32)
    return jnp.where(live > 0, w, 0.0)


def router_copy(r, li):
    return pltpu.make_async_copy(r.router_hbm.at[li], r.router_buf_ref, r.moe_sem.at[0])


def shared_copies(r, p, li):
    """DMA descriptors of MoE layer li's shared-expert tile j."""
    return ops.ffn_copies(r, "s", li, p.bs.mlp_cols)


def shared_tiles(p) -> int:
    return p.cfg.shared_intermediate // p.bs.mlp_cols if p.cfg.shared_intermediate else 0


def moe_mlp(r, p, li, *, acc_ref, me, nxt, mlp_tile):
    """MoE layer li's MLP (module docstring); on entry h_ref holds the normed MLP input,
    the router's DMA and the shared expert's first tiles are in flight; `nxt` starts
    the next stream; `mlp_tile` is the dense MLP's tile body (the shared expert's)."""
    bs, cfg = p.bs, p.cfg
    tf, mlp_ring = bs.mlp_cols, bs.mlp_ring
    e_all, e_local = cfg.num_experts, p.E_local
    nfe = cfg.moe_intermediate_size // tf
    ns = shared_tiles(p)
    router_copy(r, li).wait()
    logits = ops.dot(r.h_ref[...], r.router_buf_ref[...])
    bias = r.e_bias_ref[pl.ds(li, 1), :] if cfg.expert_bias else None
    w = route_rows(cfg, logits, r.live_ref[...], bias, p.wdtype)
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

    def copies(t, slot):  # routed tile t: expert list[t // nfe], column tile t % nfe
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

    if ns:  # the shared expert's tiles (in flight already), then the routed ones after them

        def open_routed(k):
            @pl.when(k < n)
            def _():
                ops.start(copies(k, ops.rem(k + ns, mlp_ring)))

        ops.stream(ns, 0, shared_copies(r, p, li), mlp_tile, ring=mlp_ring, nxt=open_routed)
    else:
        ops.dynamic_opener(copies, n, mlp_ring)
    ops.stream(n, ns, copies, tile, ring=mlp_ring, nxt=nxt)


def live_rows(slots, n1: int, np_: int) -> jax.Array:
    """i32[B * Np, 1]: 1 on the real block rows of active sequences."""
    b = slots.shape[0]
    live = (np.arange(np_) < n1)[None, :] & (slots >= 0)[:, None]
    return live.reshape(b * np_, 1).astype(jnp.int32)
