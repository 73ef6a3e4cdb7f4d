"""In-kernel building blocks of the verify megakernel: small matmul / index helpers and
the weight DMA rings (`stream`, `opener`: see the `kernel` module docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30  # finite "minus infinity" (the reference's), so masked rows stay NaN-free


def aligned(x, m):
    """pl.multiple_of for traced offsets; static ones need no hint."""
    return x if isinstance(x, int) else pl.multiple_of(x, m)


def dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """a [m, k] @ b[n, k].T with f32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def rms(x, w, eps):
    """x f32[r, c] normalised over its last axis, times w f32[1, c]."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def rem(x, m):
    """x % m for a static or a traced index (lax: jnp's // and % ask for a chip)."""
    return x % m if isinstance(x, int) else jax.lax.rem(x, m)


def start(copies):
    for c in copies:
        c.start()


def wait(copies):
    for c in copies:
        c.wait()


def ffn_copies(r, prefix, li, tf):
    """copies(j, slot) for an MLP's tile j of layer li: `{prefix}_gate` / `{prefix}_up`
    columns and the matching `{prefix}_down` rows (the dense MLP "w", a MoE layer's
    shared experts "s") into the MLP ring's buffers."""

    def copies(j, slot):  # refs looked up here: a MoE model has no dense "w" MLP
        hbm = {part: getattr(r, f"{prefix}_{part}_hbm") for part in ("gate", "up", "down")}
        col = pl.ds(aligned(j * tf, tf), tf)
        return (
            pltpu.make_async_copy(hbm["gate"].at[li, :, col], r.gate_buf_ref.at[slot],
                                  r.mlp_sem.at[0, slot]),
            pltpu.make_async_copy(hbm["up"].at[li, :, col], r.up_buf_ref.at[slot],
                                  r.mlp_sem.at[1, slot]),
            pltpu.make_async_copy(hbm["down"].at[li, col, :], r.down_buf_ref.at[slot],
                                  r.mlp_sem.at[2, slot]),
        )  # fmt: skip

    return copies


def stream(n, offset, copies, body, *, ring, nxt=None, init=0):
    """A fori_loop over n streamed tiles; tile j sits in ring slot (offset + j) % ring.
    n may be traced (then `dynamic_opener` starts its first tiles).

    On entry tiles 0 .. min(n, ring - 1) - 1 are in flight (started by the stream
    before). Step j starts tile j + ring - 1 into the slot tile j - 1 freed, waits for
    tile j and runs `body(j, slot, carry)`; past the end it starts the next stream's
    first tiles instead (`nxt(k)`, from `opener`), so that stream finds them in
    flight and the DMA queue never drains. `copies(j, slot)` lists tile j's DMAs.
    """
    ahead = ring - 1
    if nxt is not None:  # shorter than the look-ahead: its successor starts now
        if isinstance(n, int):
            for k in range(ahead - n):
                nxt(k)
        else:  # a length known only in the kernel (the experts a step routes to)
            for k in range(ahead):

                @pl.when(k < ahead - n)
                def _(k=k):
                    nxt(k)

    def step(j, carry):
        slot = rem(j + offset, ring)
        t = j + ahead

        @pl.when(t < n)
        def _():
            start(copies(t, rem(t + offset, ring)))

        if nxt is not None:

            @pl.when(t >= n)
            def _():
                nxt(t - n)

        wait(copies(j, slot))
        return body(j, slot, carry)

    return jax.lax.fori_loop(0, n, step, init)


def opener(copies, offset, n, ring, prev_ahead):
    """nxt(k) for `stream`: starts tile k of a stream of n tiles (its ring has `ring`
    slots, offset `offset`) when that stream expects it in flight on entry.

    The stream before calls nxt(0) .. nxt(prev_ahead - 1) (its look-ahead past its
    end); when this stream's ring is deeper, the last call also starts the tiles
    beyond, so the stream always enters with min(n, ring - 1) tiles in flight.
    """
    first = min(n, ring - 1)

    def begin(k):
        start(copies(k, rem(k + offset, ring)))

    def nxt(k):
        if isinstance(k, int):
            if k < first:
                begin(k)
            if k == prev_ahead - 1:
                for extra in range(prev_ahead, first):
                    begin(extra)
            return

        @pl.when(k < first)
        def _():
            begin(k)

        if first > prev_ahead:

            @pl.when(k == prev_ahead - 1)
            def _():
                for extra in range(prev_ahead, first):
                    begin(extra)

    return nxt


def dynamic_opener(copies, n, ring):
    """Starts tiles 0 .. min(n, ring - 1) - 1 of a stream whose length n is traced
    (its predecessor could not know it, so nothing of it is in flight yet)."""
    for k in range(ring - 1):

        @pl.when(k < n)
        def _(k=k):
            start(copies(k, rem(k, ring)))


def rope(y, cos, sin, hd, rot):
    """Rotate-half RoPE on the first `rot` dims of whole heads laid side by side: y, cos,
    sin f32[M, tp].

    Lane c of a head pairs with c + rot/2 (first half) or c - rot/2 (second half); two
    lane rotations fetch both partners and `sin` carries the sign (-sin, then +sin; 0 on
    the lanes past `rot`, which pass through with cos = 1).
    """
    width, half = y.shape[1], rot // 2
    ahead = pltpu.roll(y, width - half, 1)  # y[c + half]
    behind = pltpu.roll(y, half, 1)  # y[c - half]
    partner = jnp.where(jax.lax.rem(iota(y.shape, 1), hd) < half, ahead, behind)
    return y * cos + partner * sin


def head_rows_tile(acc_ref, src_ref, buf_ref, head_width, rows):
    """body(j, slot, carry) of an output projection streamed in row tiles of whole
    heads: tile j of `rows` rows covers heads [j * hpt, (j + 1) * hpt) of the
    head-major `src_ref`, and acc += sum_h src_h @ w_h (no relayout)."""
    hpt = rows // head_width

    def body(j, slot, carry):
        acc = acc_ref[...]
        for t in range(hpt):
            w = buf_ref[slot, pl.ds(t * head_width, head_width), :]
            acc = acc + dot(src_ref[j * hpt + t], w)
        acc_ref[...] = acc
        return carry

    return body
