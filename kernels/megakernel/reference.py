"""The verify step in plain jnp: the megakernel's reference, with the same signature.

One verify step of the target over a batch of token trees (vocabulary:
docs/design.md):

1. the verify block `[root, node_0, ..., node_{N-1}]` of each sequence runs through
   every layer against that sequence's committed KV (`transformer.forward_block`),
   which also writes the block's K/V at cache positions `cache_lens[b] + i`;
2. `decide` turns the block's logits into the verdict: a repetition penalty if a
   row has one, then greedy rows (temperature 0) accept along the target argmax
   (`greedy_accept`) and the others apply the stochastic rule registered for
   `child_sampling` to the filtered target distribution, with the uniforms passed in.

`decide` is the one verdict every backend computes: this reference, the
megakernel (which passes its in-kernel greedy walk) and the XLA verify step of
`specdec/workers.py` (which runs the same forward laid out for XLA).

The KV is not committed here: the caller moves the accepted path with
`transformer.commit_kv` (the megakernel leaves that to the caller too).

`kernel.verify` takes the same arguments plus its tuning knobs (`block_sizes`,
`interpret`), like the references of JAX's Pallas TPU kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec.kernels import transformer
from specdec.kernels.config import ModelConfig
from specdec.kernels.linear_attention import LinearBlock
from specdec.kernels.transformer import KVCache, Params
from specdec.verify import masks
from specdec.verify.acceptance import ACCEPTANCE_RULES, Verdict, greedy_accept
from specdec.verify.batch import SamplingBatch
from specdec.verify.sampling import sample_from_uniform
from specdec.verify.tree import ChildSampling

__all__ = ["VerifyResult", "decide", "finish_verdict", "greedy_verdict", "tree_block", "verify"]


class VerifyResult(NamedTuple):
    """What one verify step returns (a pytree)."""

    accepted_nodes: jax.Array  # i32[B, N], accepted node indices root-first, then -1
    num_accepted: jax.Array  # i32[B], accepted tokens (acceptance length - 1)
    bonus: jax.Array  # i32[B], the target's own token after the accepted path
    logits: jax.Array  # f32[B, N + 1, V], row 0 at the root, row i + 1 at node i
    cache: KVCache  # block K/V written at cache_lens[b] + block index (not yet committed)
    # A hybrid model's linear layers: the block's record (leaves [Ll, B, N + 1, ...]),
    # committed for the accepted path by `transformer.write_kv(..., keep, counts)`;
    # the cache's linear state is left as it was.
    lin: LinearBlock | None = None
    # With `taps` (the kernel's): the block's residual after those layers, f32[B, N + 1,
    # n_taps x D], for a block drafter (`transformer.block_logits_kv(taps=)`).
    features: jax.Array | None = None


def tree_block(
    roots: jax.Array,  # i32[B] last committed token of each row
    tokens: jax.Array,  # i32[B, N] tree nodes (padding: any token)
    parents: jax.Array,  # i32[B, N], -1 = child of root, < -1 = padding
    cache_lens: jax.Array,  # i32[B]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block tokens i32[B, N+1], positions i32[B, N+1] and ancestor mask bool[B, N+1, N+1].

    Block index 0 is the root; node i is block index i + 1. Example: depths
    [1, 1, 2] with 7 committed tokens -> positions [7, 8, 8, 9]. A padding node sees
    only itself. The XLA verify step (`specdec.workers.verify_step`) builds its block here too.
    """
    b, n = tokens.shape
    valid = parents >= -1
    anc = masks.ancestor_mask(parents)  # [B, N, N]
    depth = masks.depths(parents)  # [B, N], padding 0
    block_tokens = jnp.concatenate([roots[:, None], tokens], axis=1)
    positions = cache_lens[:, None] + jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), depth.astype(jnp.int32)], axis=1
    )
    top = jnp.zeros((b, 1, n + 1), bool).at[:, 0, 0].set(True)
    bottom = jnp.concatenate([valid[:, :, None], anc], axis=2)
    return block_tokens, positions, jnp.concatenate([top, bottom], axis=1)


def finish_verdict(
    greedy: Verdict,  # batched: accepted_nodes i32[B, N], num_accepted i32[B], bonus i32[B]
    tokens: jax.Array,  # i32[B, N]
    parents: jax.Array,  # i32[B, N]
    logits: jax.Array,  # f32[B, N + 1, V]
    draft_probs: jax.Array | None,  # f32[B, N + 1, V]; None for DETERMINISTIC_TOPK trees
    sampling: SamplingBatch,
    uniforms: jax.Array,  # f32[B, N + 1], layout in verify/acceptance.py
    child_sampling: ChildSampling,
) -> Verdict:
    """Greedy rows keep `greedy`; the other rows get the stochastic rule's verdict.

    The stochastic branch (a vocabulary sort for top-k / top-p) only runs when some
    row samples (`lax.cond`).
    """
    is_greedy = sampling.temperature == 0
    n = tokens.shape[1]

    def stochastic(_):
        p = sampling.probs(logits)  # [B, N+1, V]
        if n == 0:  # plain decode: the bonus token is a draw at the root
            bonus = jax.vmap(sample_from_uniform)(p[:, 0], uniforms[:, 0])
            return Verdict(greedy.accepted_nodes, jnp.zeros_like(greedy.num_accepted), bonus)
        rule = ACCEPTANCE_RULES[child_sampling]
        return jax.vmap(rule)(tokens, parents, p, draft_probs, uniforms)

    sampled = jax.lax.cond(jnp.all(is_greedy), lambda _: greedy, stochastic, None)
    return jax.tree.map(
        lambda g, s: jnp.where(is_greedy.reshape((-1,) + (1,) * (g.ndim - 1)), g, s),
        greedy,
        sampled,
    )


def greedy_verdict(tokens: jax.Array, parents: jax.Array, logits: jax.Array) -> Verdict:
    """The greedy walk over a batch of trees: tokens / parents i32[B, N], logits
    f32[B, N + 1, V]. With no tree (N = 0) the bonus token is the root's argmax."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # lowest id on ties
    if tokens.shape[1] == 0:
        b = tokens.shape[0]
        return Verdict(jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32), argmax[:, 0])
    return jax.vmap(greedy_accept)(tokens, parents, argmax)


def decide(
    logits: jax.Array,  # f32[B, N + 1, V], row 0 at the root
    block: jax.Array,  # i32[B, N + 1] the verify block's tokens (`tree_block`)
    mask: jax.Array,  # bool[B, N + 1, N + 1] its ancestor mask
    tokens: jax.Array,  # i32[B, N]
    parents: jax.Array,  # i32[B, N]
    draft_probs: jax.Array | None,  # f32[B, N + 1, V]; None for DETERMINISTIC_TOPK trees
    sampling: SamplingBatch,
    uniforms: jax.Array,  # f32[B, N + 1]
    child_sampling: ChildSampling,
    greedy: Verdict | None = None,  # the greedy walk if already done (the megakernel's)
) -> Verdict:
    """The verdict on one verify block's logits, for every backend.

    A row's repetition penalty applies first (to each node over its own path,
    `SamplingBatch.penalize`), before greedy and sampled choices alike; a greedy
    walk done on unpenalised logits is then redone. Greedy rows keep the greedy
    verdict and the others get the stochastic rule's (`finish_verdict`).
    """
    if sampling.seen is not None:
        logits = sampling.penalize(logits, block, mask)
        greedy = None
    if greedy is None:
        greedy = greedy_verdict(tokens, parents, logits)
    return finish_verdict(
        greedy, tokens, parents, logits, draft_probs, sampling, uniforms, child_sampling
    )


@functools.partial(jax.jit, static_argnames=("cfg", "child_sampling"), donate_argnames=("cache",))
def verify(
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
) -> VerifyResult:
    """Tree forward + acceptance (module docstring); the cache comes back uncommitted."""
    block, positions, mask = tree_block(roots, tokens, parents, cache_lens)
    lin = None
    if cfg.is_hybrid:  # K/V written, the linear layers' record returned uncommitted
        logits, ks, vs = transformer.block_logits_kv(
            params, cache, block, positions, mask, slots, cache_lens, cfg=cfg
        )
        lin = ks.lin
        cache = transformer.write_kv(cache, ks.k, vs, slots, cache_lens)
    else:
        logits, cache = transformer.forward_block(
            params, cache, block, positions, mask, slots, cache_lens, cfg=cfg
        )
    verdict = decide(
        logits, block, mask, tokens, parents, draft_probs, sampling, uniforms, child_sampling
    )
    return VerifyResult(*verdict, logits, cache, lin)
