"""Prompt-lookup drafting: propose what followed earlier occurrences of the suffix.

For the longest n in [prompt_lookup_max .. prompt_lookup_min] whose last n
committed tokens occurred before, each earlier occurrence (most recent first)
contributes the tokens that followed it, up to `max_depth`. Distinct
continuations are merged into a trie, so shared prefixes become one path and
different continuations become siblings (at most `topk` children per node).
Example: committed [a b c x y a b c z w a b c], n = 3 -> continuations
[z w a ...] and [x y a ...] -> root children z and x.

Children are chosen deterministically, so the target uses the draw-and-match
rule (`ChildSampling.DETERMINISTIC_TOPK`), which is exact for any sampling.
"""

from __future__ import annotations

import numpy as np

from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

from .base import DraftBatch


class NgramDrafter:
    """No model: token trees from the sequence's own history."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_nodes: int,
        max_depth: int,
        topk: int,
        min_n: int = 2,
        max_n: int = 4,
        vocab_size: int | None = None,
    ):
        self.num_slots = num_slots
        self.max_nodes = num_nodes
        self.max_depth = max_depth
        self.topk = topk
        self.min_n, self.max_n = min_n, max_n
        self.vocab_size = vocab_size
        self.history: list[list[int]] = [[] for _ in range(num_slots)]

    def start(self, slots, prompts, roots) -> None:
        for s, p, r in zip(slots, prompts, roots, strict=True):
            self.history[s] = [*p, r]

    def reserve(self, slots, lengths) -> None:
        """No KV cache: nothing to size."""

    def release(self, slot: int) -> None:
        self.history[slot] = []

    def commit(self, active, accepted_nodes, num_accepted, emitted) -> None:
        for s in np.flatnonzero(active):
            self.history[s].extend(int(t) for t in emitted[s, : num_accepted[s] + 1])

    def continuations(self, tokens: list[int]) -> list[list[int]]:
        """Distinct continuations after earlier matches of the longest matching suffix."""
        h = np.asarray(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(h) <= n:
                continue
            suffix = h[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))[::-1]  # most recent first
            conts = []
            for st in starts:
                c = h[st + n : st + n + self.max_depth].tolist()
                if c and c not in conts:
                    conts.append(c)
            if conts:
                return conts
        return []

    def _tree(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Trie of continuations in topological order, at most max_nodes / topk."""
        toks, parents = [], []
        children: dict[int, dict[int, int]] = {-1: {}}
        for cont in self.continuations(tokens):
            node = -1
            for t in cont:
                if self.vocab_size is not None and t >= self.vocab_size:
                    break
                kids = children[node]
                if t in kids:
                    node = kids[t]
                    continue
                if len(kids) >= self.topk or len(toks) >= self.max_nodes:
                    break
                toks.append(t)
                parents.append(node)
                kids[t] = len(toks) - 1
                children[len(toks) - 1] = {}
                node = len(toks) - 1
        return toks, parents

    def propose(self, active, roots, sampling: SamplingBatch) -> DraftBatch:
        batch = DraftBatch.empty(self.num_slots, self.max_nodes)
        for s in np.flatnonzero(active):
            toks, parents = self._tree(self.history[s])
            batch.tokens[s, : len(toks)] = toks
            batch.parents[s, : len(toks)] = parents
        batch.child_sampling = ChildSampling.DETERMINISTIC_TOPK
        return batch
