"""Block drafter: a DFlash model proposes a whole token tree in one forward.

Per slot the drafter keeps the context keys / values of every committed token
but the root (`dflash.context_kv` of the target's features at
`target_layer_ids`, in a paged cache of its own): `start` writes the prompt's
(the target's prefill kept them, chunk by chunk), `commit` the root's and the
accepted nodes' (the target's verify kept the whole block's), in one jitted
call over the verify's rows.

One `propose` is one jitted call over the live rows:

1. **Block.** The root and `block_size - 1` mask tokens (the target's
   embeddings, times `input_embedding_scale`) at positions root, root + 1, ...
   go through the drafter, reading the whole cached context; block row d >= 1
   is the draft's distribution for the token d places after the root (through
   the target's LM head, `dflash.draft_logits`).
2. **Tree.** Best-first from the per-position top-k candidates: a node's score
   is the sum of its path's draft log-probabilities; each of `num_nodes` rounds
   adds the best child not yet taken of any node (children of a node at depth
   d are position d + 1's top-k, in order), at most `max_depth` deep, `topk`
   children per node. `topk=1` is DFlash's chain. A DFlash2 drafter ranks a
   node's children (position d + 1's `selector_top_k` candidates) by its
   selector's scores after the node's own token, so `topk=1` is its greedy
   path.

Children are chosen deterministically from q, so the target verifies them
with the draw-and-match rule (`ChildSampling.DETERMINISTIC_TOPK`), exact for
any sampling parameters (DESIGN.md, "Acceptance rules"). Candidates are
ranked by the draft's raw distribution (no repetition penalty, no
temperature): any deterministic ranking keeps the rule exact.

The target's features reach the drafter through the target worker it is
bound to (`bind`): prefill keeps each chunk's (`runner.prefill_features`),
verify the block's (`TargetWorker.features`); `start` and `commit` read them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specdec.kernels import paged, transformer, xla_layout
from specdec.kernels.blocks import BLOCK_SIZE, BlockAllocator, num_blocks_for
from specdec.kernels.paged import PagedKVCache
from specdec.kernels.runner import KV_RESERVE_CAP, kv_bucket, live_rows
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

from . import dflash
from .base import PAD_PARENT, DraftBatch


def max_tree_nodes(topk: int, max_depth: int) -> int:
    """Nodes a tree of `max_depth` levels of `topk` children each can hold."""
    return sum(topk**d for d in range(1, max_depth + 1))


class BlockDrafter:
    """A DFlash drafter growing trees of up to `num_nodes` nodes, `max_depth` deep
    (at most `block_size - 1`), `topk` children per node, from one forward per step."""

    child_sampling = ChildSampling.DETERMINISTIC_TOPK

    def __init__(
        self,
        dcfg: dflash.DFlashConfig,
        params: dict,
        *,
        num_slots: int,
        max_model_len: int,
        num_nodes: int,
        max_depth: int,
        topk: int,
        vocab_limit: int,
        num_blocks: int | None = None,  # paged KV pool (`blocks.num_blocks_for`); None = all
        block_size: int = BLOCK_SIZE,
    ):
        self.dcfg = dcfg
        self.params = params
        self.cfg = dcfg.model
        self.vocab_limit = vocab_limit
        self.max_depth = min(max_depth, dcfg.block_size - 1)
        self.topk = max(1, min(topk, vocab_limit))
        if dcfg.is_dflash2:  # children come from the selector's candidates
            self.topk = min(self.topk, dcfg.selector_top_k)
        self.max_nodes = min(num_nodes, max_tree_nodes(self.topk, self.max_depth))
        self.target_layers = dcfg.target_layer_ids
        self.layout = xla_layout.for_backend(self.cfg)  # the drafter's own heads decide
        self.num_slots = num_slots
        # Committed tokens' context K/V (the root's never: its features come with the
        # verify that reads it), plus one verify's worth while catching up.
        self.max_len = max_model_len + self.max_nodes + 1
        alloc = -(-self.max_len // block_size) * block_size
        dtype = xla_layout.cache_dtype(params["fc"].dtype, paged=True)
        self.token_bytes = transformer.token_bytes(self.cfg, dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for(None, self.token_bytes, num_slots=num_slots,
                                        max_len=self.max_len, block_size=block_size)  # fmt: skip
        self.blocks = BlockAllocator(num_blocks, block_size, num_slots, alloc // block_size)
        self._cache = PagedKVCache.create(self.cfg, num_slots, alloc, block_size=block_size,
                                          num_blocks=num_blocks, dtype=dtype)  # fmt: skip
        self._table_version = -1
        self.ctx_lens = np.zeros(num_slots, np.int32)  # tokens with context K/V cached
        self.reserved = np.zeros(num_slots, np.int32)
        self._target = None
        self._sub_head = None  # the head's draft-vocabulary columns (`bind`)

    # ------------------------------------------------------------------ wiring

    def bind(self, target) -> None:
        """Reads embeddings, LM head and features from this target worker (in process)."""
        t_cfg = target.cfg
        d = self.cfg.hidden_size
        if t_cfg.hidden_size != d:
            raise ValueError(
                f"The DFlash drafter's hidden size ({d}) differs from the target's "
                f"({t_cfg.hidden_size}); a DFlash drafter is trained for one target."
            )
        if self.dcfg.mask_token_id >= t_cfg.vocab_size:
            raise ValueError(
                f"The drafter's mask_token_id {self.dcfg.mask_token_id} is outside the "
                f"target's vocabulary ({t_cfg.vocab_size} tokens)."
            )
        ids = self.params.get("vocab_ids")
        self._sub_head = None
        if ids is not None:  # the head's draft-vocabulary columns, taken once
            if int(np.max(ids)) >= t_cfg.vocab_size:
                raise ValueError(
                    f"The drafter's draft vocabulary reaches token {int(np.max(ids))}, "
                    f"outside the target's vocabulary ({t_cfg.vocab_size} tokens)."
                )
            p = target.runner.params
            head = p["lm_head"] if "lm_head" in p else p["embed"].T
            self._sub_head = jnp.asarray(head[:, ids])
        target.tap(self.target_layers)
        self._target = target

    @property
    def cache(self) -> PagedKVCache:
        b = self.blocks
        if b.version != self._table_version:
            self._cache = dataclasses.replace(self._cache, table=jnp.asarray(b.table))
            self._table_version = b.version
        return self._cache

    def kv_capacity(self) -> tuple[int, int, int]:
        """The context cache's (block size, blocks, positions per slot)."""
        return self.blocks.block_size, self.blocks.num_blocks - 1, self.max_len

    def reserve(self, slots, lengths) -> None:
        """Rows grow to about `lengths` tokens: proposals read that many positions."""
        self.reserved[np.asarray(slots, np.int64)] = np.minimum(lengths, KV_RESERVE_CAP)

    def release(self, slot: int) -> None:
        self.ctx_lens[slot] = 0
        self.reserved[slot] = 0
        self.blocks.free(slot)

    # ------------------------------------------------------------------ steps

    def start(self, slots, prompts, roots) -> None:
        """The prompts' features (the target's prefill just kept them) become context."""
        if self._target is None:
            raise RuntimeError("BlockDrafter.bind(target) must run before start().")
        wanted = {int(s) for s in slots}
        for chunk in self._target.runner.prefill_features:
            if chunk.slot not in wanted:
                continue
            self.blocks.ensure(chunk.slot, chunk.start + chunk.count)
            self._cache = _ingest(
                self.params, self.cache, chunk.rows, np.zeros((1, 1), np.int32),
                np.arange(chunk.rows.shape[1], dtype=np.int32)[None],
                np.array([chunk.slot], np.int32), np.array([chunk.start], np.int32),
                dcfg=self.dcfg,
            )  # fmt: skip
        for s, p in zip(slots, prompts, strict=True):
            self.ctx_lens[s] = len(p)

    def propose(self, active, roots, sampling: SamplingBatch) -> DraftBatch:
        active = np.asarray(active, bool)
        slots = live_rows(active, self.num_slots)
        live = slots[slots >= 0]
        take = np.maximum(slots, 0)
        needed = int(self.ctx_lens[live].max(initial=0))  # the cache is read below these
        kv_len = kv_bucket(max(needed, int(self.reserved[live].max(initial=0))), self.max_len)
        target = self._target.runner
        # Only the head's weights: the whole target's would be flattened every call.
        head = {"embed": target.params["embed"]}
        if self._sub_head is not None:
            head["sub_head"] = self._sub_head
        elif "lm_head" in target.params:
            head["lm_head"] = target.params["lm_head"]
        tokens, parents = _propose(
            self.params, head, self.cache, slots, self.ctx_lens[take],
            np.asarray(roots, np.int32)[take], dcfg=self.dcfg, target_cfg=target.cfg,
            layout=target.layout, draft_layout=self.layout, kv_len=kv_len,
            num_nodes=self.max_nodes, max_depth=self.max_depth, topk=self.topk,
            vocab_limit=self.vocab_limit, num_slots=self.num_slots,
        )  # fmt: skip
        return DraftBatch(tokens, parents, None, self.child_sampling)

    def commit(self, active, accepted_nodes, num_accepted, emitted) -> None:
        """The root's and the accepted nodes' features (the verify just kept the whole
        block's) become context, in one call over the verify's rows."""
        features = self._target.features
        if features is None:
            raise RuntimeError("The target kept no features: was bind(target) run?")
        rows, feats = features  # row i = slot rows[i] (-1: padding)
        active = np.asarray(active, bool)
        live = (rows >= 0) & active[np.maximum(rows, 0)]
        slots = np.where(live, rows, -1).astype(np.int32)
        take = np.maximum(rows, 0)
        n = np.where(live, np.asarray(num_accepted)[take], 0)
        # Block index of each kept row: the root (0), then accepted node j at j + 1.
        path = np.asarray(accepted_nodes)[take]
        keep = np.concatenate([np.zeros((len(rows), 1), np.int32), np.maximum(path, 0) + 1], 1)
        row_idx = np.arange(len(rows), dtype=np.int32)[:, None]
        starts = self.ctx_lens[take].copy()
        for s, c in zip(slots[live], n[live], strict=True):
            self.blocks.ensure(int(s), int(self.ctx_lens[s] + c + 1))
        self._cache = _ingest(self.params, self.cache, feats, row_idx, keep, slots, starts,
                              dcfg=self.dcfg)  # fmt: skip
        self.ctx_lens[slots[live]] += 1 + n[live]


def _context_kv_at(dcfg, params, feats, positions):
    """Context K/V [L, B, C, K, hd] of target features f32[B, C, n x D] at positions."""
    ctx = dflash.context_rows(dcfg, params, feats.astype(jnp.float32))
    return dflash.context_kv(dcfg, params, ctx, positions)


@functools.partial(jax.jit, static_argnames=("dcfg",), donate_argnames=("cache",))
def _ingest(params, cache, feats, rows, keep, slots, starts, *, dcfg):
    """Context K/V of the features feats[rows[b], keep[b]] (f32[R, C, F] -> [B, M, F])
    written at positions starts[b] .. of slots[b] (-1: nothing); entries past a
    row's real count land beyond its new length or in the null block."""
    m = keep.shape[1]
    picked = feats[rows, keep]
    positions = starts[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
    ks, vs = _context_kv_at(dcfg, params, picked, positions)
    return transformer.write_kv(cache, ks, vs, slots, starts)


@functools.partial(
    jax.jit,
    static_argnames=(
        "dcfg",
        "target_cfg",
        "layout",
        "draft_layout",
        "kv_len",
        "num_nodes",
        "max_depth",
        "topk",
        "vocab_limit",
        "num_slots",
    ),  # fmt: skip
)
def _propose(params, target_params, cache, slots, ctx_lens, roots, *, dcfg, target_cfg, layout,
             draft_layout, kv_len, num_nodes, max_depth, topk, vocab_limit, num_slots):  # fmt: skip
    """Block forward and best-first tree (module docstring) over the live rows (row b
    is slot slots[b], -1 padding), the context read from the cache. Returns tokens and
    parents i32[S, N] per slot (slots not run: empty trees)."""
    b = slots.shape[0]
    blocks = paged.row_tables(cache.table, slots, -(-kv_len // cache.block_size))
    t = jnp.arange(kv_len)
    valid = t[None] < ctx_lens[:, None]
    # Zero past each row's length: stale entries there must not meet a 0 weight as NaN.
    fresh = valid[:, None, :, None]
    layers = range(dcfg.model.num_layers)
    # Read as the drafter's attention takes them (per K/V head on CPU): no copy of
    # the context into another layout.
    keys = [draft_layout.cache_rows(cache.k, i, blocks, kv_len, fresh) for i in layers]
    values = [draft_layout.cache_rows(cache.v, i, blocks, kv_len, fresh) for i in layers]
    root_pos = ctx_lens
    q = dcfg.block_size
    block_tokens = jnp.concatenate(
        [roots[:, None], jnp.full((b, q - 1), dcfg.mask_token_id, jnp.int32)], axis=1
    )
    emb = target_params["embed"][block_tokens].astype(jnp.float32) * dcfg.input_embedding_scale
    block_pos = root_pos[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
    hidden = dflash.forward_kv(dcfg, params, keys, values, valid, emb, block_pos,
                               draft_layout)  # fmt: skip
    h = hidden[:, 1 : 1 + max_depth]
    ids = params.get("vocab_ids")  # a draft vocabulary: logits over its tokens only
    if ids is None:
        logits = transformer.head_logits(target_cfg, target_params, h, layout)
        allowed = jnp.arange(logits.shape[-1]) < vocab_limit
    else:
        logits = layout.matmul(h, target_params["sub_head"])
        allowed = ids < vocab_limit
    logits = jnp.where(allowed, dflash.draft_logits(dcfg, logits), -jnp.inf)
    shape = dict(num_nodes=num_nodes, max_depth=max_depth)
    # The barriers: without them XLA CPU fused the forward's last steps into the tree's
    # many small ops and ran the step several times slower.
    if dcfg.is_dflash2:  # children ranked by the selector, after their parent's token
        sel = dflash.selector_inputs(dcfg, params, h, logits)
        unary, cand, proj = jax.lax.optimization_barrier(sel)
        cand = cand if ids is None else ids[cand]
        grow = functools.partial(selector_tree, params, **shape, topk=topk)
        tokens, parents = jax.vmap(grow)(unary, cand, proj, roots)
    else:
        top = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), topk)  # [B, D, k] x 2
        logp, cand = jax.lax.optimization_barrier(top)
        cand = cand if ids is None else ids[cand]
        tokens, parents = jax.vmap(functools.partial(grid_tree, **shape))(logp, cand)
    idx = jnp.where(slots >= 0, slots, num_slots)
    out_t = jnp.zeros((num_slots, num_nodes), jnp.int32).at[idx].set(tokens, mode="drop")
    out_p = (
        jnp.full((num_slots, num_nodes), PAD_PARENT, jnp.int32).at[idx].set(parents, mode="drop")
    )
    return out_t, out_p


def best_first(children, root, *, num_nodes: int, max_depth: int, topk: int):
    """One tree, best-first: tokens, parents i32[num_nodes] (-1 = child of the root,
    padding PAD_PARENT), in topological order.

    `children(d, token)` gives the children of a node at depth d (the root: 0) whose
    token is `token`: (log-probabilities f32[topk], descending, and tokens i32[topk]).
    Each round adds the best child not yet taken of any node (score: the path's summed
    log-probability; ties to the earlier node), at most `max_depth` deep."""
    n1 = num_nodes + 1
    lp0, tok0 = children(0, root)
    child_lp = jnp.full((n1, topk), -jnp.inf).at[0].set(lp0)
    child_tok = jnp.zeros((n1, topk), jnp.int32).at[0].set(tok0)
    score = jnp.full((n1,), -jnp.inf).at[0].set(0.0)
    depth = jnp.zeros((n1,), jnp.int32)
    rank = jnp.zeros((n1,), jnp.int32)  # the next child each node offers
    tokens = jnp.zeros((num_nodes,), jnp.int32)
    parents = jnp.full((num_nodes,), PAD_PARENT, jnp.int32)

    def add(i, carry):
        score, depth, rank, child_lp, child_tok, tokens, parents = carry
        open_ = (depth < max_depth) & (rank < topk) & (score > -jnp.inf)
        r = jnp.minimum(rank, topk - 1)
        offer = jnp.where(open_, score + child_lp[jnp.arange(n1), r], -jnp.inf)
        p = jnp.argmax(offer)
        ok = offer[p] > -jnp.inf
        node = i + 1
        tok = child_tok[p, r[p]]
        lp, kids = children(jnp.minimum(depth[p] + 1, max_depth - 1), tok)
        score = score.at[node].set(jnp.where(ok, offer[p], -jnp.inf))
        depth = depth.at[node].set(depth[p] + 1)
        rank = rank.at[p].add(ok.astype(jnp.int32))
        child_lp = child_lp.at[node].set(lp)
        child_tok = child_tok.at[node].set(kids)
        tokens = tokens.at[i].set(jnp.where(ok, tok, 0))
        parents = parents.at[i].set(jnp.where(ok, p - 1, PAD_PARENT))
        return score, depth, rank, child_lp, child_tok, tokens, parents

    carry = (score, depth, rank, child_lp, child_tok, tokens, parents)
    carry = jax.lax.fori_loop(0, num_nodes, add, carry)
    return carry[5], carry[6]


def grid_tree(logp: jax.Array, cand: jax.Array, *, num_nodes: int, max_depth: int):
    """`best_first` when a node's children depend on its depth only (DFlash): logp
    f32[D, k] (descending per row) and tokens i32[D, k] per position after the root.
    Example (k = 2, logp [[-0.1, -2.5], [-0.2, -1.9]], 3 nodes): the root's best child
    (-0.1), its best child (-0.3), then that first node's second child (-0.1 - 1.9 =
    -2.0) before the root's second (-2.5): parents [-1, 0, 0]."""
    return best_first(lambda d, _: (logp[d], cand[d]), jnp.int32(0), num_nodes=num_nodes,
                      max_depth=max_depth, topk=logp.shape[1])  # fmt: skip


def selector_tree(params, unary, cand, proj, root, *, num_nodes: int, max_depth: int,
                  topk: int):  # fmt: skip
    """`best_first` with DFlash2's selector: a node's children are position d's
    candidates ranked by their scores after the node's own token, as log-probabilities
    over those candidates (unary, cand f32 / i32[D, K], proj f32[D, r])."""

    def children(d, token):
        s = dflash.selector_scores(params, unary[d], cand[d], proj[d], token)
        lp, idx = jax.lax.top_k(jax.nn.log_softmax(s), topk)
        return lp, cand[d][idx]

    return best_first(children, root, num_nodes=num_nodes, max_depth=max_depth, topk=topk)


__all__ = ["BlockDrafter", "best_first", "grid_tree", "max_tree_nodes", "selector_tree"]
