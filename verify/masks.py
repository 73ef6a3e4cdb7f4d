"""Tree attention masks and depths from parent indices, in pure ``jnp``.

A tree node attends to the committed tokens (handled by the caller), to its ancestors
and to itself. Parents are topological: ``parents[i] < i``, ``-1`` = child of the root.
Padding slots carry a parent ``< -1`` (``TokenTree.pad_to`` uses ``-2``) or are marked
invalid by ``valid``; they attend only to themselves (so a softmax row always has one
finite entry) and no node attends to them.

Worked example, parents ``[-1, -1, 0, 2]`` (nodes 0 and 1 hang from the root, 2 from 0,
3 from 2)::

    depths          [1, 1, 2, 3]
    ancestor_mask   node 0: {0}        [1 0 0 0]
                    node 1: {1}        [0 1 0 0]
                    node 2: {0, 2}     [1 0 1 0]
                    node 3: {0, 2, 3}  [1 0 1 1]

If the root sits at position 6, the nodes sit at ``6 + depths = [7, 7, 8, 9]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["ancestor_mask", "depths"]


def _valid_nodes(
    parents: jax.Array,  # i32[..., N]
    valid: jax.Array | None,  # bool[..., N] or None
) -> jax.Array:  # bool[..., N]
    is_node = parents >= -1
    return is_node if valid is None else is_node & jnp.asarray(valid, bool)


@jax.jit
def ancestor_mask(
    parents: jax.Array,  # i32[..., N], -1 = child of root, < -1 = padding
    valid: jax.Array | None = None,  # bool[..., N], False = padding; None = all nodes
) -> jax.Array:  # bool[..., N, N], [i, j] = node j is node i or an ancestor of it
    """Self-and-ancestors mask by pointer doubling: ``ceil(log2 N)`` gather steps.

    After step k, row i holds the ancestors of i at distance ``< 2**k`` and ``jump[i]``
    is its ancestor at distance ``2**k`` (``-1`` past the root). Parents that break the
    topological rule give an unspecified (but finite) mask.
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[-1]
    valid = _valid_nodes(parents, valid)
    eye = jnp.eye(n, dtype=bool)
    mask = jnp.broadcast_to(eye, (*parents.shape, n))
    # An invalid node has no parent, so every chain stops at the first invalid node.
    jump = jnp.where(valid, parents, -1)
    for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
        has_jump = (jump >= 0)[..., None]
        safe = jnp.clip(jump, 0, n - 1)
        mask = mask | (has_jump & jnp.take_along_axis(mask, safe[..., None], axis=-2))
        jump = jnp.where(jump >= 0, jnp.take_along_axis(jump, safe, axis=-1), -1)
    return mask & (valid[..., None, :] | eye)


@jax.jit
def depths(
    parents: jax.Array,  # i32[..., N], -1 = child of root, < -1 = padding
    valid: jax.Array | None = None,  # bool[..., N], False = padding; None = all nodes
) -> jax.Array:  # i32[..., N], child of root = 1, padding = 0
    """Path length from the root: ``parents [-1, -1, 0, 2] -> [1, 1, 2, 3]``."""
    parents = jnp.asarray(parents, jnp.int32)
    node = _valid_nodes(parents, valid)
    count = jnp.sum(ancestor_mask(parents, valid), axis=-1, dtype=jnp.int32)
    return jnp.where(node, count, 0)
