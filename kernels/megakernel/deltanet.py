"""Gated DeltaNet token mixing inside the verify megakernel (Qwen3.5 / Qwen3-Next).

The math is `linear_attention`'s chunked form over paths (read its module docstring):
per value head, with G the log-decay summed along each node's path,

    u = (I + L)^{-1} beta (v - exp(G) K S0),   o = exp(G) Q S0 + (QK^T * decay) u

where S0 is the sequence's committed recurrent state. This module holds the part of a
DeltaNet layer between its input projections and its output projection, written for a
Pallas TPU program: the short causal convolution along each node's path, the q / k
l2-norms, the delta rule over the block, the gated RMS norm, and the per-token record
(`linear_attention.LinearBlock`: k, u, G) the caller commits for the accepted path.

Layout, as in the megakernel (`kernel` module docstring): sequence b owns rows
`[b * Np, (b + 1) * Np)`; per-head activations are head-major ([heads, rows, dim]).

Two choices the TPU shapes the form of:
* The unit-triangular solve is an inverse by repeated squaring. L is strictly lower
  (parents come first), so X = -L is nilpotent (X^Np = 0) and
  (I - X)^{-1} = (I + X)(I + X^2)(I + X^4) ... : 2 ceil(log2 Np) [Np, Np] products on the
  MXU, where forward substitution is Np dependent row updates (each a [1, Np] x [Np, dv]
  product, serial). Exact in exact arithmetic; every factor's entries are bounded
  (|k_i.k_j| <= 1 for l2-normed keys, beta and the decays in [0, 1]).
* The convolution reads each node's ancestors at distances 1..K-1, in the block or in
  the committed window. Its sources are per-tree facts, the same for every layer, so they
  come in as one-hot selection matrices built once per step outside the kernel
  (`conv_selectors`): tap j is `sel_block_j @ x + sel_state_j @ window`, two products
  and no gather (Mosaic has no sublane gather).

The recurrent state S0 of each sequence (all its heads on this device, f32
[Hv, dk, dv]) comes from HBM by DMA into a two-slot VMEM buffer, sequence b + 1's
while b computes; a row at length 0 starts from zeros whatever its slot holds.

`mix` is a standalone pallas_call over this part of the layer (the unit the
megakernel's layer loop calls on its scratch); `reference` is the same in plain jnp,
built from `linear_attention`'s functions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import linear_attention as la
from specdec.kernels.megakernel import ops, tuning

__all__ = ["conv_selectors", "delta_rows", "mix", "reference", "unit_lower_inverse"]


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^{-1} for a strictly lower-triangular f32[n, n], by repeated squaring."""
    n = lower.shape[0]
    eye = (ops.iota((n, n), 0) == ops.iota((n, n), 1)).astype(jnp.float32)
    x = -lower
    inv = eye + x
    for _ in range(max(0, math.ceil(math.log2(n)) - 1)):  # powers 2, 4, ... below n
        x = ops.dot(x, x)
        inv = ops.dot(inv, eye + x)
    return inv


def _to_row(col: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n] without a transpose (a masked sum over the diagonal)."""
    n = col.shape[0]
    eye = ops.iota((n, n), 0) == ops.iota((n, n), 1)
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def delta_rows(q, k, v, g, beta, s0, path):
    """One value head of one sequence: q, k f32[Np, dk] (normalised, q scaled), v
    f32[Np, dv], g / beta f32[Np, 1], s0 f32[dk, dv], path bool[Np, Np] (j is i or an
    ancestor). Returns (o, u f32[Np, dv], G f32[Np, 1])."""
    n = q.shape[0]
    big_g = jnp.sum(jnp.where(path, _to_row(g), 0.0), axis=1, keepdims=True)
    diff = big_g - _to_row(big_g)  # G_i - G_j
    decay = jnp.where(path, jnp.exp(jnp.where(path, diff, 0.0)), 0.0)
    eg = jnp.exp(big_g)
    strict = path & (ops.iota((n, n), 0) != ops.iota((n, n), 1))
    lower = jnp.where(strict, ops.dot_nt(k, k) * decay * beta, 0.0)
    rhs = beta * (v - eg * ops.dot(k, s0))
    u = ops.dot(unit_lower_inverse(lower), rhs)
    o = eg * ops.dot(q, s0) + ops.dot(ops.dot_nt(q, k) * decay, u)
    return o, u, big_g


def conv_selectors(sources: jax.Array, np_: int, taps: int) -> tuple[jax.Array, jax.Array]:
    """One-hot f32 selection matrices from `linear_attention.ancestor_sources`
    (i32[B, N1, taps - 1], N1 <= np_): per tap j (distance j + 1), sel_block
    [B, taps - 1, np_, np_] picks the block row and sel_state [B, taps - 1, np_, W]
    the committed window's row (W = taps - 1 rounded up to 8 rows). Padding rows
    select nothing (their convolution sees only themselves)."""
    b, n1, _ = sources.shape
    w = tuning.round_up(taps - 1, 8)
    src = jnp.pad(sources, ((0, 0), (0, np_ - n1), (0, 0)), constant_values=-1)
    src = jnp.moveaxis(src, 2, 1)[..., None]  # [B, taps - 1, np_, 1]
    live = (jnp.arange(np_) < n1)[None, None, :, None]
    block = (src - (taps - 1) == jnp.arange(np_)) & live & (src >= taps - 1)
    state = (src == jnp.arange(w)) & live & (src < taps - 1)
    return block.astype(jnp.float32), state.astype(jnp.float32)


def reference(x, ba, z, window, s0, path, sources, lp, *, dims, eps):
    """The same part of the layer in jnp, per sequence: x f32[B, N, C] convolution
    inputs, ba f32[B, N, 2 Hv] (the b and a projections), z f32[B, N, vd], window
    f32[B, K - 1, C], s0 f32[B, Hv, dk, dv], path bool[B, N, N], sources from
    `ancestor_sources`, lp the layer's conv [K, C], a_log / dt_bias [Hv], lin_norm [dv];
    dims = (Hk, Hv, dk, dv). Returns (o f32[B, N, Hv, dv] normed and gated, the
    record's k f32[B, N, Hv, dk] and u f32[B, N, Hv, dv], G f32[B, N, Hv])."""
    hk, hv, dk, dv = dims
    b, n, _ = x.shape
    kd = hk * dk
    beta = jax.nn.sigmoid(ba[..., :hv])
    g = -jnp.exp(lp["a_log"]) * jax.nn.softplus(ba[..., hv:] + lp["dt_bias"])
    xc = la.causal_conv(x, window, lp["conv"], sources)
    r = hv // hk
    q = jnp.repeat(la.l2norm(xc[..., :kd].reshape(b, n, hk, dk)), r, axis=2) * dk**-0.5
    k = jnp.repeat(la.l2norm(xc[..., kd : 2 * kd].reshape(b, n, hk, dk)), r, axis=2)
    v = xc[..., 2 * kd :].reshape(b, n, hv, dv)
    o, u, big_g = la.gated_delta_block(q, k, v, g, beta, s0, path)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * lp["lin_norm"]
    return o * jax.nn.silu(z.reshape(b, n, hv, dv)), k, u, big_g


def mix(x, ba, z, window, rec, slots, cache_lens, path, sources, lp, *, dims, eps,
        interpret=False):  # fmt: skip
    """`reference` as one Pallas TPU program over a verify block laid out as the
    megakernel lays it (Np rows per sequence). rec f32[S, Hv, dk, dv] is the layer's
    committed recurrent state in HBM (read for slots[b] >= 0 with cache_lens[b] > 0,
    zeros otherwise); the other arguments as `reference`'s, N <= Np rows per sequence.
    Returns what `reference` does."""
    hk, hv, dk, dv = dims
    b, n, c = x.shape
    taps = lp["conv"].shape[0]
    np_ = tuning.round_up(n, 8)
    wrows = tuning.round_up(taps - 1, 8)
    f32 = jnp.float32

    def rows(a):  # [B, N, ...] -> [B * Np, ...]
        a = jnp.pad(a.astype(f32), ((0, 0), (0, np_ - n)) + ((0, 0),) * (a.ndim - 2))
        return a.reshape(b * np_, *a.shape[2:])

    sel_block, sel_state = conv_selectors(sources, np_, taps)
    mask = jnp.pad(path, ((0, 0), (0, np_ - n), (0, np_ - n))) | jnp.eye(np_, dtype=bool)
    win = jnp.pad(window.astype(f32), ((0, 0), (0, wrows - (taps - 1)), (0, 0)))
    vmem_in = [
        rows(x), rows(ba), rows(z), win, mask.astype(jnp.int32), sel_block, sel_state,
        lp["conv"].astype(f32), lp["a_log"].astype(f32).reshape(1, hv),
        lp["dt_bias"].astype(f32).reshape(1, hv), lp["lin_norm"].astype(f32).reshape(1, dv),
    ]  # fmt: skip
    m = b * np_
    out_shape = (
        jax.ShapeDtypeStruct((hv, m, dv), f32),  # o, normed and gated
        jax.ShapeDtypeStruct((hv, m, dk), f32),  # k
        jax.ShapeDtypeStruct((hv, m, dv), f32),  # u
        jax.ShapeDtypeStruct((hv, m, 1), f32),  # G
    )
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    live_lens = jnp.where(slots >= 0, cache_lens, 0).astype(jnp.int32)
    o, k, u, big_g = pl.pallas_call(
        functools.partial(_mix_kernel, dims=dims, np_=np_, eps=eps, batch=b),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[vmem] * len(vmem_in) + [pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[vmem] * 4,
            scratch_shapes=[pltpu.VMEM((2, hv, dk, dv), f32), pltpu.SemaphoreType.DMA((2,))],
        ),
        interpret=interpret,
        name="deltanet_mix",
    )(jnp.maximum(slots, 0).astype(jnp.int32), live_lens, *vmem_in, rec.astype(f32))

    def back(a):  # [Hv, B * Np, d] -> [B, N, Hv, d]
        return jnp.moveaxis(a.reshape(hv, b, np_, -1)[:, :, :n], 0, 2)

    return back(o), back(k), back(u), back(big_g)[..., 0]


def conv_inputs(x, win, sel_block, sel_state):
    """Each node's convolution inputs along its path, taps oldest first: a list of K
    [Np, C] values, the last being x itself (`conv_selectors` for the others)."""
    taps = sel_block.shape[0] + 1
    srcs = [ops.dot(sel_block[j - 1], x) + ops.dot(sel_state[j - 1], win) for j in range(1, taps)]
    return srcs[::-1] + [x]


def mix_sequence(conv_in, conv_w, ba, z, path, state, fresh, a_log, dt_bias, lin_norm, write,
                 *, dims, eps):  # fmt: skip
    """One sequence's DeltaNet mixing, on values: conv_in from `conv_inputs`, conv_w
    f32[K, C], ba f32[Np, 2 Hv], z f32[Np, vd], path bool[Np, Np], state(h) the head's
    committed f32[dk, dv] (ignored when `fresh`), a_log / dt_bias f32[1, Hv], lin_norm
    f32[1, dv]. Calls write(h, o, k, u, G) per value head: o normed and gated."""
    hk, hv, dk, dv = dims
    kd, r = hk * dk, hv // hk
    taps = len(conv_in)
    acc = conv_in[0] * conv_w[0:1]
    for t in range(1, taps):
        acc = acc + conv_in[t] * conv_w[t : t + 1]
    xc = acc * jax.nn.sigmoid(acc)
    beta = jax.nn.sigmoid(ba[:, :hv])
    g = -jnp.exp(a_log) * jax.nn.softplus(ba[:, hv:] + dt_bias)
    for kh in range(hk):
        q = la.l2norm(xc[:, kh * dk : (kh + 1) * dk]) * dk**-0.5
        k = la.l2norm(xc[:, kd + kh * dk : kd + (kh + 1) * dk])
        for h in range(kh * r, (kh + 1) * r):
            v = xc[:, 2 * kd + h * dv : 2 * kd + (h + 1) * dv]
            s0 = jnp.where(fresh, 0.0, state(h))
            o, u, big_g = delta_rows(q, k, v, g[:, h : h + 1], beta[:, h : h + 1], s0, path)
            zh = z[:, h * dv : (h + 1) * dv]
            write(h, ops.rms(o, lin_norm, eps) * (zh * jax.nn.sigmoid(zh)), k, u, big_g)


def over_sequences(batch: int, state_copy, body) -> None:
    """A loop over the batch's sequences whose committed states arrive by DMA into a
    two-slot buffer, sequence b + 1's while b computes: `state_copy(b, slot)` is the
    copy's descriptor, `body(b, slot, wait)` calls wait() before it reads slot."""
    state_copy(0, 0).start()

    def step(b, carry):
        slot = jax.lax.rem(b, 2)

        @pl.when(b + 1 < batch)
        def _():
            state_copy(b + 1, 1 - slot).start()

        body(b, slot, state_copy(b, slot).wait)
        return carry

    jax.lax.fori_loop(0, batch, step, 0)


def _mix_kernel(slots_ref, lens_ref, x_ref, ba_ref, z_ref, win_ref, mask_ref, selb_ref,
                sels_ref, conv_ref, alog_ref, dtb_ref, norm_ref, rec_hbm, o_ref, k_ref,
                u_ref, g_ref, s_buf, sem, *, dims, np_, eps, batch):  # fmt: skip
    def state_copy(b, slot):
        return pltpu.make_async_copy(rec_hbm.at[slots_ref[b]], s_buf.at[slot], sem.at[slot])

    def sequence(b, slot, wait):
        rows = pl.ds(pl.multiple_of(b * np_, 8), np_)
        conv_in = conv_inputs(x_ref[rows, :], win_ref[b], selb_ref[b], sels_ref[b])
        wait()

        def write(h, o, k, u, big_g):
            o_ref[h, rows, :] = o
            k_ref[h, rows, :] = k
            u_ref[h, rows, :] = u
            g_ref[h, rows, :] = big_g

        mix_sequence(
            conv_in, conv_ref[...], ba_ref[rows, :], z_ref[rows, :], mask_ref[b] > 0,
            lambda h: s_buf[slot, h], lens_ref[b] == 0, alog_ref[...], dtb_ref[...],
            norm_ref[...], write, dims=dims, eps=eps,
        )  # fmt: skip

    over_sequences(batch, state_copy, sequence)
