"""Attention inside the verify megakernel: per sequence and KV head, the tree block
then the committed KV tiles (online softmax), and the block's K/V written to the cache
(`kernel` module docstring). Under multi-head latent attention (`p.mla`, `mla`) the
one K "head" is [latent, rotary key] and the values are its first `p.c` entries: no V
is read or written."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels.megakernel import ops, tuning


def attend_row(r, p, li, b, carry):
    """Attention of sequence b in layer `li`, one KV head at a time; writes its block K/V."""
    np_, g_, hd = p.Np, p.G, p.hd
    row0 = pl.multiple_of(b * np_, 8)
    slot = r.slots_ref[b]
    length = r.lens_ref[b]  # 0 for inactive rows
    mask = r.attn_mask_ref[b] > 0  # [Np, Np]
    mask = jnp.concatenate([mask] * g_, axis=0) if g_ > 1 else mask
    qpos = r.qpos_ref[pl.ds(row0, np_), :]
    qpos = jnp.concatenate([qpos] * g_, axis=0) if g_ > 1 else qpos
    scale = p.cfg.softmax_scale if p.mla else 1.0 / math.sqrt(hd)

    def head(g, c):
        heads = pl.ds(g * g_, g_)
        q = r.q_ref[heads, pl.ds(row0, np_), :].reshape(g_ * np_, hd) * scale
        k = r.k_ref[g, pl.ds(row0, np_), :]
        s = jnp.where(mask, ops.dot_nt(q, k), ops.NEG)
        m = jnp.max(s, axis=1, keepdims=True)  # finite: every row sees itself
        e = jnp.exp(s - m)
        acc = ops.dot(e, k[:, : p.c] if p.mla else r.v_ref[g, pl.ds(row0, np_), :])
        init = (m, jnp.sum(e, axis=1, keepdims=True), acc)
        _, lsum, acc = attend_cache(r, p, li, g, jnp.maximum(slot, 0), length, q, qpos, init)
        out = acc / lsum
        if p.mla:  # the latent per head; `mla.mixer` applies w_uv
            r.olat_ref[heads, pl.ds(row0, np_), :] = out.reshape(g_, np_, p.c)
            write_block_kv(r, p, li, g, row0, slot, length)
            return c
        if p.gated:  # Qwen3.5 / Qwen3-Next: a sigmoid gate per output channel
            gate = r.gate_ref[heads, pl.ds(row0, np_), :].reshape(g_ * np_, hd)
            out = out * jax.nn.sigmoid(gate)
        r.attn_ref[heads, pl.ds(row0, np_), :] = out.reshape(g_, np_, hd).astype(p.wdtype)
        write_block_kv(r, p, li, g, row0, slot, length)
        return c

    return jax.lax.fori_loop(0, p.K, head, carry)


def attend_cache(r, p, li, g, slot, length, q, qpos, carry):
    """Online softmax over the committed KV of (slot, head g): ceil(length / kv_rows) tiles."""
    tkv, t_len = p.bs.kv_rows, p.T
    n_tiles = jax.lax.div(length + tkv - 1, tkv)  # lax ops: jnp's // and % need a chip
    window = p.cfg.sliding_window

    def tile_start(t):
        # The last tile may slide back to stay inside the cache; `t * tkv` still bounds it.
        start = jnp.minimum(t * tkv, t_len - tkv)
        return pl.multiple_of(start, 16) if tkv % 16 == 0 and t_len % 16 == 0 else start

    def copies(t, s):
        rows = pl.ds(tile_start(t), tkv)
        k = pltpu.make_async_copy(
            r.k_hbm.at[li, slot, g, rows, :], r.kbuf_ref.at[s], r.kv_sem.at[0, s]
        )
        if p.mla:  # the values are the keys' latent part
            return (k,)
        v = pltpu.make_async_copy(
            r.v_hbm.at[li, slot, g, rows, :], r.vbuf_ref.at[s], r.kv_sem.at[1, s]
        )
        return k, v

    @pl.when(n_tiles > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    def body(t, carry):
        m, lsum, acc = carry
        s = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            for c in copies(t + 1, 1 - s):
                c.start()

        for c in copies(t, s):
            c.wait()
        start = tile_start(t)
        pos_col = start + ops.iota((tkv, 1), 0)
        live_col = (pos_col >= t * tkv) & (pos_col < length)
        # Zero dead rows: unused cache slots may hold NaN, and 0 * NaN is NaN.
        k = jnp.where(live_col, r.kbuf_ref[s].astype(jnp.float32), 0.0)
        v = k[:, : p.c] if p.mla else jnp.where(live_col, r.vbuf_ref[s].astype(jnp.float32), 0.0)
        pos_row = start + ops.iota((1, tkv), 1)
        live = (pos_row >= t * tkv) & (pos_row < length)
        if window is not None:
            live = live & (qpos - pos_row < window)
        sc = jnp.where(live, ops.dot_nt(q, k), ops.NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(sc - m_new)
        lsum = alpha * lsum + jnp.sum(e, axis=1, keepdims=True)
        return m_new, lsum, alpha * acc + ops.dot(e, v)

    return jax.lax.fori_loop(0, n_tiles, body, carry)


def write_block_kv(r, p, li, g, row0, slot, length):
    """Writes the block's K/V of head g to cache positions [length, length + N + 1)."""
    n1, t_len = p.N1, p.T

    @pl.when((slot >= 0) & (length + n1 <= t_len))
    def _():
        pairs = ((r.k_ref, r.k_hbm),) if p.mla else ((r.k_ref, r.k_hbm), (r.v_ref, r.v_hbm))
        for i, (src, dst) in enumerate(pairs):
            if np.dtype(p.cdtype).itemsize >= 4:  # 32-bit rows: any offset is a legal DMA
                cp = pltpu.make_async_copy(
                    src.at[g, pl.ds(row0, n1), :],
                    dst.at[li, slot, g, pl.ds(length, n1), :],
                    r.wr_sem.at[i],
                )
                cp.start()
                cp.wait()
            else:
                write_rows_aligned(r, p, src, dst.at[li, slot, g], g, row0, length, i)


def write_rows_aligned(r, p, src, dst, g, row0, length, i):
    """16-bit caches: rewrite the 16-row-aligned window around the N + 1 new rows.

    The new rows are shifted to their offset inside the window by a one-hot matmul
    (exact: one non-zero product per output), then merged with the window's old rows.
    """
    w, n1, np_ = p.rmw_rows, p.N1, p.Np
    align = tuning.sublane_tile(p.cdtype)
    start = pl.multiple_of(jnp.minimum(length - jax.lax.rem(length, align), p.T - w), align)
    offset = length - start
    window = dst.at[pl.ds(start, w), :]
    read = pltpu.make_async_copy(window, r.rmw_buf_ref, r.wr_sem.at[i])
    read.start()
    read.wait()
    new = src[g, pl.ds(row0, np_), :].astype(p.cdtype)  # [Np, hd]
    rows, cols = ops.iota((w, np_), 0), ops.iota((w, np_), 1)
    shift = ((rows == cols + offset) & (cols < n1)).astype(p.cdtype)
    shifted = ops.dot(shift, new)  # [W, hd]
    row = ops.iota((w, 1), 0)
    take = (row >= offset) & (row < offset + n1)
    old = r.rmw_buf_ref[...].astype(jnp.float32)
    r.rmw_buf_ref[...] = jnp.where(take, shifted, old).astype(p.cdtype)
    write = pltpu.make_async_copy(r.rmw_buf_ref, window, r.wr_sem.at[i])
    write.start()
    write.wait()
