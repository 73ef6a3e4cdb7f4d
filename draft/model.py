"""Model drafter: a small LM grows a dynamic token tree (EAGLE-2 style).

Each `propose` is one jitted call per batch:

1. **Catch up.** The tokens the target committed since the last step that the
   draft has not cached yet ("pending": accepted nodes the draft never ran, then
   the new root) go through the draft in one causal block. Its last logits are
   the draft distribution at the root.
2. **Expand.** Level 1 candidates are the root's top-k tokens. For each level
   d = 1 .. max_depth - 1, the k candidates with the highest cumulative
   log-probability (product of draft probabilities along the path) are run
   through the draft as one block of k tokens, each seeing the committed
   prefix, its own ancestors (earlier levels, in the side buffer) and itself;
   their top-k tokens become the level d + 1 candidates.
3. **Rerank.** The `num_speculative_tokens` candidates with the highest
   cumulative log-probability form the tree. A child never scores above its
   parent and candidates are numbered level by level, so the chosen set
   contains every chosen node's parent; sorted by candidate number it is
   topological.

The greedy chain (the draft's top-1 token at every level, from the root down
to `max_depth`) is always expanded and always kept, ahead of any score: so a
tree never accepts less than the `topk=1` chain of the same depth would, and
the other `num_speculative_tokens - max_depth` nodes widen it where the draft
is unsure.

K/V layout. During a step the draft cache is only read: it holds each slot's
c committed tokens. The step's own K/V (P pending tokens, the root last, then
level d's k expanded nodes at region offset (d - 1) * k + j) go to a small
side buffer (`transformer.SideKV`: side position i < P for pending token i,
P + o for region offset o). `commit` writes back the pending tokens and the
accepted nodes that were expanded (an ancestor-closed prefix of the accepted
path) at positions c, c + 1, ..., and leaves the rest of the path pending for
the next catch-up. That write runs at the start of the next `_grow`, before
any read: writing the cache between levels of one program made XLA on CPU
copy the whole cache at each write (8 copies per 4-level propose).

Children are the deterministic top-k of q, so the target applies the
draw-and-match rule (`ChildSampling.DETERMINISTIC_TOPK`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec.kernels import transformer
from specdec.kernels.config import ModelConfig
from specdec.kernels.runner import ModelRunner, live_rows
from specdec.kernels.transformer import Params
from specdec.verify.batch import SamplingBatch
from specdec.verify.sampling import repetition_penalized
from specdec.verify.tree import ChildSampling

from .base import PAD_PARENT, DraftBatch


class KVWrite(NamedTuple):
    """A commit's K/V write, deferred to the next `_grow`: which slots' side entries
    (`ModelDrafter._side`, read when the write is applied) go where."""

    slots: np.ndarray  # i32[B] the slot of each row, -1 = write nothing
    starts: np.ndarray  # i32[B] cache position of the first entry written
    keep: np.ndarray  # i32[B, P + D] side entries to write, in order


def num_candidates(topk: int, max_depth: int) -> int:
    """Real tree nodes the expansion produces: k at level 1, k * k at each later level."""
    return topk + (max_depth - 1) * topk * topk


class ModelDrafter:
    """A small LM drafting trees of up to `num_nodes` nodes, `max_depth` deep, `topk` wide."""

    child_sampling = ChildSampling.DETERMINISTIC_TOPK

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        *,
        num_slots: int,
        max_model_len: int,
        num_nodes: int,
        max_depth: int,
        topk: int,
        vocab_limit: int | None = None,
        num_blocks: int | None = None,  # paged KV pool (`blocks.num_blocks_for`); None = all
    ):
        if cfg.is_hybrid:
            raise ValueError(
                f"A draft model with linear-attention layers ({cfg.architecture.value}) is not "
                "supported yet: the drafter grows trees level by level in side buffers, which "
                "hold attention K/V only. Use a dense draft (every layer full attention) or "
                "another method."
            )
        self.cfg = cfg
        if num_nodes <= max_depth:
            # The greedy chain is always kept first, so N <= depth nodes are its first N:
            # grow just that chain (the same tree without the wider levels' draft work).
            topk, max_depth = 1, num_nodes
        self.topk = min(topk, cfg.vocab_size)
        self.max_depth = max_depth
        self.max_nodes = min(num_nodes, num_candidates(self.topk, max_depth))
        self.pending_len = max_depth + 1  # accepted-but-unexpanded nodes + the new root
        self.region = (max_depth - 1) * self.topk  # expanded nodes after the root
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.runner = ModelRunner(
            cfg,
            params,
            num_slots=num_slots,
            max_len=max_model_len + self.pending_len + self.region + 1,
            # A draft's products are small: their count, not their bytes, sets its
            # speed (the draft is never sharded, see cluster/actors.py).
            fuse=True,
            num_blocks=num_blocks,
        )
        self.pending: list[list[int]] = [[] for _ in range(num_slots)]
        self._expanded = np.full((num_slots, self.max_nodes), -1, np.int32)
        self._root_pos = np.zeros(num_slots, np.int32)
        self._pend_len = np.ones(num_slots, np.int32)
        # The last tree's side K/V per slot (pending tokens, then expanded nodes; see
        # `_grow`, which writes only its live rows' entries).
        side = transformer.SideKV.zeros(
            cfg, num_slots, self.pending_len + _side_region(self.max_depth, self.topk)
        )
        self._side = (side.k, side.v)
        self._deferred = self._no_commit()  # the last commit's K/V writes, not yet applied

    def _no_commit(self, rows: int = 1) -> KVWrite:
        """A write of nothing (`rows` rows, every slot -1)."""
        return KVWrite(
            np.full(rows, -1, np.int32),
            np.zeros(rows, np.int32),
            np.zeros((rows, self.pending_len + self.max_depth), np.int32),
        )

    def _flush(self) -> None:
        """Applies the deferred commit now (before any call but `_grow`, which fuses it)."""
        if (self._deferred.slots >= 0).any():
            r = self.runner
            r.cache = _write_side(r.cache, *self._side, *self._deferred)
            self._deferred = self._no_commit()

    def start(self, slots, prompts, roots) -> None:
        self._flush()
        self.runner.prefill(slots, prompts)
        for s, r in zip(slots, roots, strict=True):
            self.pending[s] = [int(r)]

    def release(self, slot: int) -> None:
        self.runner.release(slot)
        self.pending[slot] = []

    def reserve(self, slots, lengths) -> None:
        """Rows will grow to about `lengths` tokens: proposals read that many positions."""
        self.runner.reserve(slots, lengths)

    def kv_capacity(self) -> tuple[int, int, int]:
        """The draft cache's (block size, blocks, positions per slot)."""
        return self.runner.kv_capacity()

    def propose(self, active, roots, sampling: SamplingBatch) -> DraftBatch:
        r = self.runner
        s_count = r.num_slots
        active = np.asarray(active, bool)
        slots = live_rows(active, s_count)  # the step runs over the live rows only
        b = len(slots)
        pend = np.zeros((b, self.pending_len), np.int32)
        pend_len = np.ones(b, np.int32)
        pend_len_slots = np.ones(s_count, np.int32)
        for i, s in enumerate(slots[slots >= 0]):
            p = self.pending[s]
            pend[i, : len(p)] = p
            pend_len[i] = pend_len_slots[s] = len(p)
        take = np.maximum(slots, 0)
        seen = penalty = None
        if sampling is not None and sampling.seen is not None:
            # Penalised rows: rank children as the target will (by the committed tokens;
            # a node's own path is not counted here, only in the verify).
            v = self.cfg.vocab_size
            seen = np.zeros((b, v), bool)
            w = min(v, np.shape(sampling.seen)[1])
            seen[:, :w] = np.asarray(sampling.seen)[take, :w]
            penalty = np.asarray(sampling.repetition_penalty, np.float32)[take]
        # The last commit's K/V writes run inside this same call: one dispatch per step
        # (a separate one when the batch changed size since, so shapes stay few).
        if len(self._deferred.slots) != b:
            self._flush()
        deferred, self._deferred = self._deferred, self._no_commit()
        if len(deferred.slots) != b:
            deferred = self._no_commit(b)
        tokens, parents, expanded, side_k, side_v, r.cache = _grow(
            r.params,
            r.cache,
            *self._side,
            deferred,
            pend,
            pend_len,
            slots,
            r.cache_lens[take],
            seen,
            penalty,
            cfg=self.cfg,
            layout=r.layout,
            topk=self.topk,
            max_depth=self.max_depth,
            num_nodes=self.max_nodes,
            vocab_limit=self.vocab_limit,
            # The cache is read only below each row's committed length: the step's own
            # K/V are in the side buffer, the deferred write's kept entries end there.
            kv_len=r.kv_len(active, int(r.cache_lens[active].max(initial=0))),
        )
        # Left on the device: the verify is dispatched while this tree is still growing
        # (`commit` reads `expanded` after the verdict, when it is long done).
        self._expanded = expanded
        self._side = (side_k, side_v)
        self._pend_len = pend_len_slots
        self._root_pos = r.cache_lens + pend_len_slots - 1
        return DraftBatch(tokens, parents, None, self.child_sampling)

    def _host_expanded(self) -> np.ndarray:
        """`_expanded` as numpy (it stays a device array from `propose` until needed)."""
        self._expanded = np.asarray(self._expanded)
        return self._expanded

    def commit(self, active, accepted_nodes, num_accepted, emitted) -> None:
        r = self.runner
        p = self.pending_len
        slots = live_rows(active, r.num_slots)
        # Side entries to write at the row's first pending position, in order: the
        # pending tokens (root last), then the accepted nodes that were expanded.
        keep = np.zeros((len(slots), p + self.max_depth), np.int32)
        starts = np.zeros(len(slots), np.int32)
        expanded = self._host_expanded()
        for i, s in enumerate(slots[slots >= 0]):
            path = accepted_nodes[s, : num_accepted[s]]
            m = 0
            while m < len(path) and expanded[s, path[m]] >= 0:
                m += 1
            n = self._pend_len[s]
            row = [*range(n), *(p - 1 + expanded[s, path[:m]])]
            keep[i, : len(row)] = row
            keep[i, len(row) :] = row[-1]  # past the new length: overwritten later
            starts[i] = self._root_pos[s] + 1 - n
            r.cache_lens[s] = self._root_pos[s] + 1 + m
            r.ensure([s], [r.cache_lens[s]])
            self.pending[s] = [int(t) for t in emitted[s, m : num_accepted[s] + 1]]
        self._flush()  # a commit not yet applied (only after two commits in a row)
        # Applied by the next `_grow` (or `_flush`): no dispatch of its own.
        self._deferred = KVWrite(slots, starts, keep)

    # ------------------------------------------------------------------ overlap hooks
    # Used by the distributed draft worker (cluster/actors.py) to grow tree t + 1
    # while the target verifies tree t; the in-process engine never calls them.

    def speculate(self, active: np.ndarray, tree: DraftBatch,
                  sampling: SamplingBatch | None = None) -> Speculation:  # fmt: skip
        """Grows the next tree now, guessing the verdict on `tree` (just proposed
        under `sampling`).

        The guess: the greedy chain (each level's first child) is accepted in
        full and the bonus token is the draft's own top-1 after it. The drafter
        is left as if that verdict were committed and the next tree proposed;
        `resolve` keeps this for rows the target confirms and rolls back the
        rest. Rows whose chain ends on an expanded node (fewer nodes than
        `max_depth`) are not guessed. Rows under a repetition penalty rank the
        next tree's children by their committed tokens plus the guessed run, as
        the propose after a real commit would.
        """
        s_count = self.runner.num_slots
        tree, expanded = tree.to_host(), self._host_expanded()
        chain, length = greedy_chain(tree.parents)
        rows = np.asarray(active, bool) & (length > 0)
        for s in np.flatnonzero(rows):
            rows[s] = expanded[s, chain[s, length[s] - 1]] < 0
        before_expanded, before_root_pos = expanded.copy(), self._root_pos.copy()
        # A copy: the propose below donates the side buffers it grows into.
        before_pend_len, before_side = self._pend_len.copy(), tuple(map(jnp.copy, self._side))
        emitted = np.zeros((s_count, self.max_nodes + 1), np.int32)
        for s in np.flatnonzero(rows):
            emitted[s, : length[s]] = tree.tokens[s, chain[s, : length[s]]]
        # Guessed commit; the bonus slot (0 for now) is filled in after the peek.
        self.commit(rows, chain, length, emitted)
        bonus = self._peek(rows)
        guess: dict[int, list[int]] = {}
        for s in np.flatnonzero(rows):
            self.pending[s][-1] = int(bonus[s])
            guess[int(s)] = [*emitted[s, : length[s]].tolist(), int(bonus[s])]
        if sampling is not None and sampling.seen is not None:
            seen = np.array(sampling.seen, bool)  # a copy: the caller's stays as it was
            for s, run in guess.items():
                seen[s, [t for t in run if t < seen.shape[1]]] = True
            sampling = dataclasses.replace(sampling, seen=seen)
        next_tree = self.propose(rows, None, sampling).to_host() if rows.any() else None
        spec = Speculation(
            rows=rows,
            guess=guess,
            root_pos=before_root_pos,
            tree=next_tree,
            expanded=np.array(self._expanded),
            root_pos_next=self._root_pos.copy(),
            pend_len_next=self._pend_len.copy(),
            side=self._side,
        )
        # Rows not guessed keep the state of `tree` for their real commit.
        self._expanded = np.where(rows[:, None], self._expanded, before_expanded)
        self._root_pos = np.where(rows, self._root_pos, before_root_pos)
        self._pend_len = np.where(rows, self._pend_len, before_pend_len)
        self._side = _rows_from(rows, self._side, before_side)
        return spec

    def resolve(self, spec: Speculation, active, accepted_nodes, num_accepted, emitted):
        """`commit` for a step that was speculated on; returns hit bool[S].

        A guessed row whose real run (accepted tokens + bonus) equals the guess
        is already committed and holds the next tree. A miss keeps only the
        root's K/V (the guess overwrote the expanded nodes after it) and leaves
        the whole real run pending for the next catch-up block. Rows that were
        not guessed take the ordinary commit.
        """
        active = np.asarray(active, bool)
        hit = np.zeros(self.runner.num_slots, bool)
        plain = active & ~spec.rows
        if plain.any():
            self.commit(plain, accepted_nodes, num_accepted, emitted)
        for s in np.flatnonzero(active & spec.rows):
            run = [int(t) for t in emitted[s, : num_accepted[s] + 1]]
            if run == spec.guess[int(s)]:
                hit[s] = True
            else:
                self.runner.cache_lens[s] = spec.root_pos[s] + 1
                self.pending[s] = run
        return hit

    def propose_reusing(self, spec: Speculation, hit, active, roots, sampling) -> DraftBatch:
        """`propose`, taking the speculated tree for rows in `hit` and drafting the rest."""
        reuse = np.asarray(active, bool) & np.asarray(hit, bool) & spec.rows
        fresh = np.asarray(active, bool) & ~reuse
        if fresh.any():
            batch = self.propose(fresh, roots, sampling).to_host()
        else:
            batch = DraftBatch.empty(self.runner.num_slots, self.max_nodes)
        if reuse.any():
            batch.tokens[reuse] = spec.tree.tokens[reuse]
            batch.parents[reuse] = spec.tree.parents[reuse]
            self._expanded = np.where(reuse[:, None], spec.expanded, self._expanded)
            self._root_pos = np.where(reuse, spec.root_pos_next, self._root_pos)
            self._pend_len = np.where(reuse, spec.pend_len_next, self._pend_len)
            self._side = _rows_from(reuse, spec.side, self._side)
        return batch

    def _peek(self, rows: np.ndarray) -> np.ndarray:
        """Draft top-1 token after each row's pending tokens but the last: i32[S]."""
        r = self.runner
        slots = live_rows(rows, r.num_slots)
        live = slots[slots >= 0]
        pend = np.zeros((len(slots), self.pending_len), np.int32)
        pend_len = np.ones(len(slots), np.int32)
        for i, s in enumerate(live):
            p = self.pending[s][:-1]
            pend[i, : len(p)] = p
            pend_len[i] = len(p)
        self._flush()
        r.ensure(live, r.cache_lens[live] + pend_len[: len(live)])
        # Writes K/V at the pending positions; the next catch-up block rewrites them.
        top1, r.cache = _peek(
            r.params,
            r.cache,
            pend,
            pend_len,
            slots,
            r.cache_lens[np.maximum(slots, 0)],
            cfg=self.cfg,
            layout=r.layout,
            vocab_limit=self.vocab_limit,
            kv_len=r.kv_len(rows, int(r.cache_lens[rows].max(initial=0)) + self.pending_len),
        )
        out = np.zeros(r.num_slots, np.int32)
        out[live] = np.asarray(top1)[: len(live)]
        return out


@dataclasses.dataclass
class Speculation:
    """The drafter's guess about one verdict, and the tree it grew from that guess."""

    rows: np.ndarray  # bool[S] rows that were guessed
    guess: dict[int, list[int]]  # slot -> guessed run (greedy chain tokens + bonus token)
    root_pos: np.ndarray  # i32[S] cache position of the guessed tree's root (rollback point)
    tree: DraftBatch | None  # the next tree, grown as if the guess were committed
    expanded: np.ndarray  # i32[S, N] the next tree's expanded offsets (see `_grow`)
    root_pos_next: np.ndarray  # i32[S] the next tree's root position
    pend_len_next: np.ndarray  # i32[S] pending tokens the next tree's catch-up ran
    side: tuple  # the next tree's side K/V (two f32[L, S, P + R, K, hd])


def _rows_from(rows: np.ndarray, a: tuple, b: tuple) -> tuple:
    """Side K/V pairs: slot rows where `rows` is set from `a`, the others from `b`."""
    pick = jnp.asarray(rows)[None, :, None, None, None]
    return tuple(jnp.where(pick, x, y) for x, y in zip(a, b, strict=True))


def greedy_chain(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's greedy chain: the first child at every level, from the root down.

    The model drafter numbers a node's top-1 child first among its siblings, so
    the first child is the draft's greedy choice. Returns node indices i32[S, N]
    (-1 padded) and chain lengths i32[S]. Example: parents [-1, -1, 0, 0, 2] ->
    chain [0, 2, 4], length 3.
    """
    s_count, n = parents.shape
    chain = np.full((s_count, n), -1, np.int32)
    length = np.zeros(s_count, np.int32)
    for s in range(s_count):
        node = -1
        while True:
            kids = np.flatnonzero(parents[s] == node)
            if not len(kids):
                break
            node = int(kids[0])
            chain[s, length[s]] = node
            length[s] += 1
    return chain, length


def _side_region(max_depth: int, topk: int) -> int:
    """Side-buffer entries after the pending tokens: levels 1 .. D - 1 expand topk nodes
    each (at least one level's worth, so no array is empty)."""
    return max(max_depth - 1, 1) * topk


def _apply_side(cache, side_k, side_v, slots, starts, keep):
    """A deferred `KVWrite`: rows `slots` of the per-slot side buffers into the cache."""
    take = jnp.maximum(slots, 0)
    return transformer.write_kv(cache, side_k[:, take], side_v[:, take], slots, starts, keep)


_write_side = jax.jit(_apply_side, donate_argnames=("cache",))


def _to_slots(x: jax.Array, slots: jax.Array, into: jax.Array, axis: int = 0) -> jax.Array:
    """`into` with its entries at `slots` (along `axis`) replaced by x's rows; padding
    rows (slot -1) are dropped."""
    idx = jnp.where(slots >= 0, slots, into.shape[axis])
    return into.at[(slice(None),) * axis + (idx,)].set(x.astype(into.dtype), mode="drop")


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "topk", "max_depth", "num_nodes", "vocab_limit", "kv_len"),
    donate_argnames=("cache", "side_k", "side_v"),
)
def _grow(params, cache, side_k, side_v, deferred, pend, pend_len, slots, cache_lens, seen,
          penalty, *, cfg, layout, topk, max_depth, num_nodes, vocab_limit, kv_len):  # fmt: skip
    """The last commit's K/V writes (`deferred`, a `KVWrite` over the per-slot side
    buffers `side_k` / `side_v`), then catch-up + expansion + rerank (module
    docstring) over the step's live rows (row b is slot slots[b], -1 padding).

    After that write the cache is only read: the pending tokens' and the tree
    levels' K/V go to a side buffer (`transformer.SideKV`, side positions
    [0, P) pending, P + o region offset o), which `commit` writes back.

    Returns, per slot (S = the side buffers' slots; slots not run get an empty
    tree): tokens i32[S, N], parents i32[S, N] (-1 = child of root), expanded
    i32[S, N] (the node's K/V offset from the root position, -1 if never run),
    the side K/V [L, S, P + R, K, hd] (two arrays) and the cache.
    """
    cache = _apply_side(cache, side_k, side_v, *deferred)
    b, p = pend.shape
    k = topk
    w = k * k  # candidate slots per level; level 1 uses its first k (the rest stay -inf)
    c_total = max_depth * w
    region = _side_region(max_depth, k)

    def top_children(logits):  # [B, ..., V] -> (logp [B, ..., k], tokens [B, ..., k])
        if seen is not None:  # the rows' repetition penalty over their committed tokens
            lead = (1,) * (logits.ndim - 2)
            logits = repetition_penalized(
                logits, seen.reshape(b, *lead, -1), penalty.reshape(b, *lead, 1)
            )
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
        return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)

    def priority(score, is_chain):
        return jnp.where(is_chain, jnp.inf, score)

    positions = cache_lens[:, None] + jnp.arange(p, dtype=jnp.int32)[None]
    root_pos = cache_lens + pend_len - 1
    # Side positions: pending tokens, then level d's nodes at the root's position + d.
    level_of = 1 + jnp.arange(region, dtype=jnp.int32) // k
    side_pos = jnp.concatenate([positions, root_pos[:, None] + level_of[None]], axis=1)
    side = transformer.SideKV.zeros(cfg, b, p + region)
    side = dataclasses.replace(side, positions=side_pos)
    pend_seen = jnp.arange(p)[None, :] < pend_len[:, None]  # [B, P] valid pending tokens
    pend_mask = transformer.causal_block_mask(pend_len, p)  # [B, P, P]
    pend_mask = jnp.concatenate([pend_mask, jnp.zeros((b, p, region), bool)], axis=2)

    def run(tokens, tok_positions, mask, at, side, logit_index=None):
        logits, ks, vs = transformer.block_logits_kv(
            params, cache, tokens, tok_positions, mask, slots, cache_lens, logit_index,
            cfg=cfg, kv_len=kv_len, side=dataclasses.replace(side, at=at), layout=layout,
        )  # fmt: skip
        return logits, dataclasses.replace(side, k=ks, v=vs)

    logits, side = run(pend, positions, pend_mask, 0, side, pend_len - 1)
    lp, tok = top_children(logits[:, 0])  # [B, k]

    cand = dict(
        tok=jnp.zeros((b, c_total), jnp.int32).at[:, :k].set(tok),
        par=jnp.full((b, c_total), -1, jnp.int32),
        score=jnp.full((b, c_total), -jnp.inf).at[:, :k].set(lp),
        exp=jnp.full((b, c_total), -1, jnp.int32),  # K/V offset from the root, if expanded
        anc=jnp.zeros((b, c_total, region), bool),  # expanded ancestors (region offsets)
        # The greedy chain outranks every score (module docstring); candidate 0 is the
        # root's top-1 child (top_k sorts descending, ties to the lowest token id).
        chain=jnp.zeros((b, c_total), bool).at[:, 0].set(True),
    )
    chain = jnp.zeros((b,), jnp.int32)  # candidate index of the chain node at this level
    rows = jnp.arange(b)[:, None]

    def level(d, carry):
        """Expand the best k candidates of level d into level d + 1 (d = 1 .. D - 1)."""
        cand, chain, side = carry
        start = (d - 1) * w
        score = jax.lax.dynamic_slice_in_dim(cand["score"], start, w, axis=1)
        is_chain = jax.lax.dynamic_slice_in_dim(cand["chain"], start, w, axis=1)
        _, sel = jax.lax.top_k(priority(score, is_chain), k)
        sel = start + sel  # [B, k] candidates expanded at this level
        offs = (d - 1) * k + jnp.arange(k, dtype=jnp.int32)  # their region offsets
        anc = cand["anc"][rows, sel]  # [B, k, R]
        child_anc = anc | jax.nn.one_hot(offs, region, dtype=bool)[None]  # + itself
        mask = jnp.concatenate([jnp.broadcast_to(pend_seen[:, None], (b, k, p)), child_anc], 2)
        logits, side = run(cand["tok"][rows, sel], jnp.broadcast_to(root_pos[:, None] + d, (b, k)),
                           mask, p + (d - 1) * k, side)  # fmt: skip
        clp, ctok = top_children(logits)  # [B, k, k]
        parent_score = jnp.take_along_axis(cand["score"], sel, axis=1)
        new = d * w
        put = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, new, axis=1)  # noqa: E731
        chain = new + k * jnp.argmax(sel == chain[:, None], axis=1)  # its top-1 child
        cand = dict(
            tok=put(cand["tok"], ctok.reshape(b, w)),
            par=put(cand["par"], jnp.repeat(sel, k, axis=1)),
            score=put(cand["score"], (parent_score[:, :, None] + clp).reshape(b, w)),
            exp=cand["exp"].at[rows, sel].set(1 + offs[None]),
            anc=put(cand["anc"], jnp.repeat(child_anc, k, axis=1)),
            chain=cand["chain"].at[rows[:, 0], chain].set(True),
        )
        return cand, chain, side

    # Unrolled (max_depth is static): on XLA CPU a while loop copies its carried
    # cache on entry and per iteration.
    carry = (cand, chain, side)
    for d in range(1, max_depth):
        carry = level(d, carry)
    cand, chain, side = carry
    cand_score, cand_chain, cand_tok = cand["score"], cand["chain"], cand["tok"]
    cand_par, cand_exp = cand["par"], cand["exp"]
    _, chosen = jax.lax.top_k(priority(cand_score, cand_chain), num_nodes)
    chosen = jnp.sort(chosen, axis=1)  # candidate order is topological
    par_cand = jnp.take_along_axis(cand_par, chosen, axis=1)
    par_idx = jax.vmap(jnp.searchsorted)(chosen, par_cand)
    parents = jnp.where(par_cand >= 0, par_idx, -1).astype(jnp.int32)
    tokens = jnp.take_along_axis(cand_tok, chosen, axis=1)
    expanded = jnp.take_along_axis(cand_exp, chosen, axis=1)
    s_count = side_k.shape[1]
    full = lambda fill: jnp.full((s_count, num_nodes), fill, jnp.int32)  # noqa: E731
    return (_to_slots(tokens, slots, full(0)), _to_slots(parents, slots, full(PAD_PARENT)),
            _to_slots(expanded, slots, full(-1)), _to_slots(side.k, slots, side_k, axis=1),
            _to_slots(side.v, slots, side_v, axis=1), cache)  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=("cfg", "layout", "vocab_limit", "kv_len"), donate_argnames=("cache",)
)
def _peek(params, cache, pend, pend_len, slots, cache_lens, *, cfg, layout, vocab_limit, kv_len):
    """Causal block of pending tokens; the draft's top-1 after the last: (i32[B], cache)."""
    p = pend.shape[1]
    positions = cache_lens[:, None] + jnp.arange(p, dtype=jnp.int32)[None]
    mask = transformer.causal_block_mask(pend_len, p)
    logits, cache = transformer.forward_block(
        params, cache, pend, positions, mask, slots, cache_lens, pend_len - 1, cfg=cfg,
        kv_len=kv_len, layout=layout,
    )  # fmt: skip
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits[:, 0], -jnp.inf)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache
