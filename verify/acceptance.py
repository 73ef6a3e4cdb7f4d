"""Acceptance rules: which tree nodes the target keeps, and its bonus token.

Vocabulary (docs/design.md): the **root** is the last committed token; **tree nodes** are the
draft tokens, ``parents[i] = -1`` for a child of the root; the **accepted tokens** are
the nodes on the path the target agrees with; the **bonus token** is the one token the
target samples itself after that path. Row 0 of per-node tables (``target_argmax``,
``target_probs``, ``draft_probs``, ``uniforms``) belongs to the root, row ``i + 1`` to
node i.

Rules (exact only if the rule matches how the children were drawn, see
``ChildSampling``); p is the target distribution at the current node (after
``sampling_probs``), q the draft distribution its children came from:

- greedy: accept the first child whose token is the target argmax at its parent.
- ``IID`` (multi-step speculative sampling, SpecInfer): try children in node order;
  accept child x iff ``u * q(x) < p(x)`` (probability ``min(1, p(x) / q(x))``); on
  rejection ``p <- normalize(max(p - q, 0))``.
- ``WITHOUT_REPLACEMENT`` (recursive rejection sampling): as ``IID``, and after rejecting
  x also ``q(x) <- 0``, ``q <- normalize(q)``.
- ``DETERMINISTIC_TOPK``: draw x ~ p; accept the child whose token is x if there is one,
  else x is the bonus token.

If every child is rejected the bonus token is drawn from the final p; at a leaf it is
drawn from p at that leaf. A residual with no mass left (p <= q up to rounding) falls
back to p.

Everything is pure ``jnp`` with ``lax.while_loop`` (no Python control flow on traced
values), one sequence per call: ``jax.vmap`` for a batch. The public functions are jitted
at definition (``sampling`` static) and inline when called under another jit.
Padding slots (parent ``< -1``) are never children of anything, so padded trees work
unchanged, and rows of padding slots and of leaves in ``draft_probs`` are never used.

Randomness comes in as explicit uniforms (``f32[N + 1]`` in [0, 1)) so a kernel can take
them as an input and results are reproducible:

- ``IID`` / ``WITHOUT_REPLACEMENT``: ``uniforms[i + 1]`` is node i's accept test,
  ``uniforms[0]`` the bonus draw.
- ``DETERMINISTIC_TOPK``: ``uniforms[c + 1]`` draws x ~ p at node c (``c = -1``: root).

``stochastic_accept_with_key`` draws them from a PRNG key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .sampling import sample_from_uniform
from .tree import ChildSampling

__all__ = [
    "ACCEPTANCE_RULES",
    "AcceptanceRule",
    "Verdict",
    "emitted_tokens",
    "greedy_accept",
    "stochastic_accept",
    "stochastic_accept_with_key",
]


class Verdict(NamedTuple):
    """Outcome of one verify step for one sequence (a pytree: vmaps to a batch)."""

    accepted_nodes: jax.Array  # i32[N], accepted node indices root-first, then -1
    num_accepted: jax.Array  # i32[], accepted tokens (acceptance length - 1)
    bonus: jax.Array  # i32[], bonus token id


AcceptanceRule = Callable[
    [
        jax.Array,  # tokens i32[N]
        jax.Array,  # parents i32[N]
        jax.Array,  # target_probs f32[N + 1, V]
        jax.Array | None,  # draft_probs f32[N + 1, V]
        jax.Array,  # uniforms f32[N + 1]
    ],
    Verdict,
]


@jax.jit
def emitted_tokens(
    tokens: jax.Array,  # i32[N]
    verdict: Verdict,
) -> jax.Array:  # i32[N + 1], accepted tokens then the bonus token, then -1
    """Tokens one step appends: ``verdict.num_accepted + 1`` of them, then -1 padding.

    tokens ``[5, 7, 3]``, accepted_nodes ``[1, 2, -1]``, bonus 9 -> ``[7, 3, 9, -1]``.
    """
    nodes = verdict.accepted_nodes
    path = jnp.where(nodes >= 0, jnp.asarray(tokens)[jnp.maximum(nodes, 0)], -1)
    path = jnp.concatenate([path, jnp.full((1,), -1, path.dtype)])
    index = jnp.arange(path.shape[0])
    return jnp.where(index == verdict.num_accepted, verdict.bonus, path).astype(jnp.int32)


def _check_tree(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N]
    per_node: dict[str, jax.Array | None],  # name -> [N + 1, ...]
) -> int:
    n = tokens.shape[0] if tokens.ndim == 1 else -1
    if tokens.ndim != 1 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must both have shape (N,), got {tokens.shape} and {parents.shape}."
        )
    for name, array in per_node.items():
        if array is not None and (array.ndim < 1 or array.shape[0] != n + 1):
            raise ValueError(
                f"{name} needs one row for the root and one per node, shape ({n + 1}, ...), "
                f"got {array.shape}."
            )
    return n


def _no_draft_tokens(
    target_probs: jax.Array,  # f32[1, V]
    uniforms: jax.Array,  # f32[1]
) -> Verdict:
    """N = 0: the bonus token is a plain draw from p at the root (same for every rule)."""
    bonus = sample_from_uniform(jnp.asarray(target_probs, jnp.float32)[0], uniforms[0])
    return Verdict(jnp.zeros((0,), jnp.int32), jnp.int32(0), bonus)


@jax.jit
def greedy_accept(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N], -1 = child of root, < -1 = padding
    target_argmax: jax.Array,  # i32[N + 1], [0] = at the root, [i + 1] = at node i
) -> Verdict:
    """Walk from the root, accepting the first child whose token is the target argmax.

    tokens ``[5, 7, 3, 9]``, parents ``[-1, -1, 0, 1]``, target_argmax
    ``[7, 1, 2, 4, 8]``: at the root the argmax is 7 -> node 1; at node 1 it is
    ``target_argmax[2] = 2`` and node 1's only child (node 3) is 9 -> stop. Accepted
    ``[1, -1, -1, -1]``, 1 accepted token, bonus 2.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    parents = jnp.asarray(parents, jnp.int32)
    target_argmax = jnp.asarray(target_argmax, jnp.int32)
    n = _check_tree(tokens, parents, {"target_argmax": target_argmax})
    if n == 0:
        return Verdict(jnp.zeros((0,), jnp.int32), jnp.int32(0), target_argmax[0])
    node_ids = jnp.arange(n, dtype=jnp.int32)

    def cond(state):
        return ~state[3]

    def body(state):
        cur, count, accepted, _ = state
        match = (parents == cur) & (tokens == target_argmax[cur + 1])
        has = jnp.any(match)
        child = jnp.argmax(match).astype(jnp.int32)
        accepted = jnp.where((node_ids == count) & has, child, accepted)
        return jnp.where(has, child, cur), count + has, accepted, ~has

    start = (jnp.int32(-1), jnp.int32(0), jnp.full((n,), -1, jnp.int32), jnp.bool_(False))
    cur, count, accepted, _ = lax.while_loop(cond, body, start)
    return Verdict(accepted, count, target_argmax[cur + 1])


def _multi_step_accept(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N]
    target_probs: jax.Array,  # f32[N + 1, V]
    draft_probs: jax.Array | None,  # f32[N + 1, V]
    uniforms: jax.Array,  # f32[N + 1]; [i + 1] = node i's test, [0] = bonus draw
    *,
    remove_rejected: bool,
) -> Verdict:
    """``IID`` (``remove_rejected=False``) and ``WITHOUT_REPLACEMENT`` (``True``).

    One loop iteration tries one child, so the loop runs at most N + 1 times: each node
    is tried at most once (siblings after an accepted child are never revisited).
    """
    if draft_probs is None:
        raise ValueError("draft_probs is required for IID and WITHOUT_REPLACEMENT children.")
    n = tokens.shape[0]
    if n == 0:
        return _no_draft_tokens(target_probs, uniforms)
    node_ids = jnp.arange(n, dtype=jnp.int32)

    def cond(state):
        return ~state[-1]

    def body(state):
        cur, last, p, q, count, accepted, _ = state
        # Next untried child of cur: children come after their parent and after any
        # sibling tried before them.
        candidates = (parents == cur) & (node_ids > last)
        has = jnp.any(candidates)
        child = jnp.argmax(candidates).astype(jnp.int32)
        x = tokens[child]
        accept = has & (uniforms[child + 1] * q[x] < p[x])
        reject = has & ~accept

        residual = jnp.maximum(p - q, 0.0)
        mass = jnp.sum(residual)
        p_rejected = jnp.where(mass > 0.0, residual / jnp.where(mass > 0.0, mass, 1.0), p)
        if remove_rejected:
            q_removed = jnp.where(jnp.arange(q.shape[0]) == x, 0.0, q)
            q_mass = jnp.sum(q_removed)
            q_rejected = q_removed / jnp.where(q_mass > 0.0, q_mass, 1.0)
        else:
            q_rejected = q

        p = jnp.where(accept, target_probs[child + 1], jnp.where(reject, p_rejected, p))
        q = jnp.where(accept, draft_probs[child + 1], jnp.where(reject, q_rejected, q))
        accepted = jnp.where((node_ids == count) & accept, child, accepted)
        cur = jnp.where(accept, child, cur)
        last = jnp.where(has, child, last)
        return cur, last, p, q, count + accept, accepted, ~has

    target_probs = jnp.asarray(target_probs, jnp.float32)
    draft_probs = jnp.asarray(draft_probs, jnp.float32)
    start = (
        jnp.int32(-1),
        jnp.int32(-1),
        target_probs[0],
        draft_probs[0],
        jnp.int32(0),
        jnp.full((n,), -1, jnp.int32),
        jnp.bool_(False),
    )
    _, _, p, _, count, accepted, _ = lax.while_loop(cond, body, start)
    return Verdict(accepted, count, sample_from_uniform(p, uniforms[0]))


def _draw_and_match_accept(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N]
    target_probs: jax.Array,  # f32[N + 1, V]
    draft_probs: jax.Array | None,  # unused: deterministic children need no q
    uniforms: jax.Array,  # f32[N + 1]; [c + 1] = the draw at node c
) -> Verdict:
    """``DETERMINISTIC_TOPK``: draw x ~ p at each node; follow the child equal to x."""
    del draft_probs
    n = tokens.shape[0]
    if n == 0:
        return _no_draft_tokens(target_probs, uniforms)
    node_ids = jnp.arange(n, dtype=jnp.int32)
    target_probs = jnp.asarray(target_probs, jnp.float32)

    def cond(state):
        return ~state[-1]

    def body(state):
        cur, count, accepted, _, _ = state
        x = sample_from_uniform(target_probs[cur + 1], uniforms[cur + 1])
        match = (parents == cur) & (tokens == x)
        has = jnp.any(match)
        child = jnp.argmax(match).astype(jnp.int32)
        accepted = jnp.where((node_ids == count) & has, child, accepted)
        return jnp.where(has, child, cur), count + has, accepted, x, ~has

    start = (
        jnp.int32(-1),
        jnp.int32(0),
        jnp.full((n,), -1, jnp.int32),
        jnp.int32(0),
        jnp.bool_(False),
    )
    _, count, accepted, bonus, _ = lax.while_loop(cond, body, start)
    return Verdict(accepted, count, bonus)


ACCEPTANCE_RULES: Mapping[ChildSampling, AcceptanceRule] = MappingProxyType(
    {
        ChildSampling.IID: functools.partial(_multi_step_accept, remove_rejected=False),
        ChildSampling.WITHOUT_REPLACEMENT: functools.partial(
            _multi_step_accept, remove_rejected=True
        ),
        ChildSampling.DETERMINISTIC_TOPK: _draw_and_match_accept,
    }
)
"""The stochastic rule for each way of drawing children (never mix them: docs/design.md).

Each rule is ``rule(tokens, parents, target_probs, draft_probs, uniforms) -> Verdict`` for
one sequence, unjitted and without the shape checks of ``stochastic_accept`` (vmap it
inside your own jit); ``draft_probs`` may be None for ``DETERMINISTIC_TOPK``.
"""


@functools.partial(jax.jit, static_argnames="sampling")
def stochastic_accept(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N], -1 = child of root, < -1 = padding
    target_probs: jax.Array,  # f32[N + 1, V], p at the root, then at each node
    draft_probs: jax.Array | None,  # f32[N + 1, V], q at the root and each node; None for TOPK
    uniforms: jax.Array,  # f32[N + 1] in [0, 1), layout in the module docstring
    *,
    sampling: ChildSampling,
) -> Verdict:
    """Accepted path and bonus token under the rule registered for ``sampling``.

    Chain, IID, V = 2: tokens ``[1]``, p at root ``[0.5, 0.5]``, q at root
    ``[0.2, 0.8]``, uniforms ``[0.3, 0.7]``. Node 0 (token 1): ``0.7 * 0.8 = 0.56 >= 0.5``
    -> rejected; residual ``max(p - q, 0) = [0.3, 0]`` -> ``[1, 0]``, bonus 0, nothing
    accepted. With ``uniforms[1] = 0.6``: ``0.48 < 0.5`` -> node 0 accepted.
    """
    try:
        rule = ACCEPTANCE_RULES[ChildSampling(sampling)]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"sampling must be a ChildSampling, got {sampling!r}.") from None
    tokens = jnp.asarray(tokens, jnp.int32)
    parents = jnp.asarray(parents, jnp.int32)
    uniforms = jnp.asarray(uniforms, jnp.float32)
    n = _check_tree(
        tokens,
        parents,
        {"target_probs": target_probs, "draft_probs": draft_probs, "uniforms": uniforms},
    )
    if uniforms.ndim != 1:
        raise ValueError(f"uniforms must have shape ({n + 1},), got {uniforms.shape}.")
    return rule(tokens, parents, target_probs, draft_probs, uniforms)


@functools.partial(jax.jit, static_argnames="sampling")
def stochastic_accept_with_key(
    tokens: jax.Array,  # i32[N]
    parents: jax.Array,  # i32[N], -1 = child of root, < -1 = padding
    target_probs: jax.Array,  # f32[N + 1, V]
    draft_probs: jax.Array | None,  # f32[N + 1, V]; None for DETERMINISTIC_TOPK
    key: jax.Array,  # PRNG key (typed key[] or raw u32[2]), e.g. sampling.request_key
    *,
    sampling: ChildSampling,
) -> Verdict:
    """``stochastic_accept`` with ``uniforms = jax.random.uniform(key, (N + 1,))``."""
    uniforms = jax.random.uniform(key, (jnp.shape(tokens)[0] + 1,), jnp.float32)
    return stochastic_accept(
        tokens, parents, target_probs, draft_probs, uniforms, sampling=sampling
    )
