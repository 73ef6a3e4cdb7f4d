"""The greedy acceptance walk inside the verify megakernel, vectorised over each
sequence's tree (`kernel` module docstring, "LM head")."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from specdec.kernels.megakernel import ops


def greedy_row(r, p, b, carry):
    """Greedy acceptance for sequence b, vectorised over its tree (module docstring).

    Writes verdict[b]: row 0 = accepted nodes by depth (-1 padded), row 1 = their
    count, row 2 = the bonus token (rows 1 and 2 broadcast along lanes).
    """
    np_ = p.Np
    row0 = pl.multiple_of(b * np_, 8)
    am = r.argmax_ref[pl.ds(row0, np_), :]  # [Np, 1] target argmax per block row
    cols = r.tree_cols_ref[pl.ds(row0, np_), :]
    tok, par, valid, depth = (cols[:, c : c + 1] for c in range(4))
    rows_ = r.tree_rows_ref[b]  # [2, Np]
    par_row, valid_row = rows_[0:1], rows_[1:2]
    ri, ci = ops.iota((np_, np_), 0), ops.iota((np_, np_), 1)
    eye = ri == ci

    def to_row(col):  # [Np, 1] -> [1, Np]
        return jnp.sum(jnp.where(eye, col, 0), axis=0, keepdims=True)

    am_at_parent = jnp.sum(jnp.where(par == ci, to_row(am), 0), axis=1, keepdims=True)
    hit = jnp.where((valid > 0) & (tok == am_at_parent), 1, 0)
    earlier_hit = (par == par_row) & (ci < ri) & (valid_row > 0) & (to_row(hit) > 0)
    chosen = jnp.where(
        (hit > 0) & (jnp.max(jnp.where(earlier_hit, 1, 0), axis=1, keepdims=True) == 0), 1, 0
    )
    anc = r.anc_mask_ref[b] > 0
    broken = jnp.max(
        jnp.where(anc & (ci >= 1) & (to_row(chosen) == 0), 1, 0), axis=1, keepdims=True
    )
    on_path = (valid > 0) & (broken == 0)  # [Np, 1]
    num = jnp.sum(jnp.where(on_path, 1, 0), axis=0, keepdims=True)  # [1, 1]
    at_depth = on_path & (depth == ci + 1)  # [Np, Np]: lane d holds the node at depth d + 1
    nodes = jnp.sum(jnp.where(at_depth, ri - 1, 0), axis=0, keepdims=True)
    found = jnp.max(jnp.where(at_depth, 1, 0), axis=0, keepdims=True)
    nodes = jnp.where(found > 0, nodes, -1)
    last = (on_path & (depth == num)) | ((ops.iota((np_, 1), 0) == 0) & (num == 0))
    bonus = jnp.sum(jnp.where(last, am, 0), axis=0, keepdims=True)
    r.verdict_ref[b] = jnp.concatenate(
        [
            nodes,
            jnp.broadcast_to(num, (1, np_)),
            jnp.broadcast_to(bonus, (1, np_)),
            jnp.zeros((5, np_), jnp.int32),
        ],
        axis=0,
    )
    return carry
