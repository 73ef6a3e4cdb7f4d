"""A hand-computable target and drafter for the engine's logic tests (no JAX, no model).

The mock target continues any text by one rule, `next_token(t) = (3 t + 1) % V`, and
verifies a tree greedily (a child is accepted iff its token is the rule's next token
after its parent's; the first such child, as `verify.acceptance.greedy_accept`
picks). The mock drafter proposes a chain of `depth` tokens that follows the same
rule except at depth `wrong_at` (1-based), where it proposes a wrong token, plus a
wrong sibling for every chain node (so each tree has 2 * depth nodes). So each
step accepts exactly `wrong_at - 1` tokens and emits `wrong_at` (the bonus token
is the rule's token at depth `wrong_at`).

Example: V = 100, root 4, depth 3, wrong_at 3: chain 13, 40, (wrong) -> accepted
[13, 40], bonus 21; the step emits 13, 40, 21.
"""

from __future__ import annotations

import numpy as np

from specdec.draft.base import PAD_PARENT, DraftBatch
from specdec.verify.tree import ChildSampling


def next_token(t: int, vocab: int) -> int:
    return (3 * int(t) + 1) % vocab


class MockTarget:
    """The engine's view of a `TargetWorker`, computed by `next_token`."""

    def __init__(self, vocab: int, num_slots: int, capacity=(16, 1 << 20, 1 << 20)):
        self.vocab, self.num_slots = vocab, num_slots
        self.capacity = capacity  # (block size, blocks, positions per sequence)
        self.cache_lens = np.zeros(num_slots, np.int32)
        self.prefills: list[list[int]] = []  # slots of each prefill call
        self.released: list[int] = []

    def reserve(self, slots, lengths) -> None:
        pass

    def kv_capacity(self) -> tuple[int, int, int]:
        return self.capacity

    def prefill(self, slots, prompts, sampling) -> np.ndarray:
        self.prefills.append(list(slots))
        for s, p in zip(slots, prompts, strict=True):
            self.cache_lens[s] = len(p)
        return np.array([next_token(p[-1], self.vocab) for p in prompts], np.int32)

    def verify(self, roots, tree: DraftBatch, active, sampling):
        s_count, n = tree.tokens.shape
        emitted = np.full((s_count, n + 1), -1, np.int32)
        num = np.zeros(s_count, np.int32)
        accepted = np.full((s_count, n), -1, np.int32)
        for s in np.flatnonzero(active):
            parent, tok, run = -1, int(roots[s]), []
            while True:
                want = next_token(tok, self.vocab)
                kids = [i for i in range(n) if tree.parents[s, i] == parent]
                hit = next((i for i in kids if tree.tokens[s, i] == want), None)
                if hit is None:
                    break
                run.append(hit)
                parent, tok = hit, want
            accepted[s, : len(run)] = run
            num[s] = len(run)
            emitted[s, : len(run)] = tree.tokens[s, run]
            emitted[s, len(run)] = next_token(tok, self.vocab)
            self.cache_lens[s] += 1 + len(run)
        return emitted, num, accepted

    def release(self, slot: int) -> None:
        self.released.append(slot)
        self.cache_lens[slot] = 0


class MockDrafter:
    """A drafter whose chain is right up to depth `wrong_at` (module docstring)."""

    def __init__(self, vocab: int, num_slots: int, depth: int, wrong_at: int):
        self.vocab, self.depth, self.wrong_at = vocab, depth, wrong_at
        self.max_nodes = 2 * depth
        self.num_slots = num_slots
        self.started: list[int] = []
        self.commits = 0

    def reserve(self, slots, lengths) -> None:
        pass

    def start(self, slots, prompts, roots) -> None:
        self.started += list(slots)

    def propose(self, active, roots, sampling) -> DraftBatch:
        tokens = np.zeros((self.num_slots, self.max_nodes), np.int32)
        parents = np.full((self.num_slots, self.max_nodes), PAD_PARENT, np.int32)
        for s in np.flatnonzero(active):
            tok, parent = int(roots[s]), -1
            for d in range(1, self.depth + 1):
                right = next_token(tok, self.vocab)
                chain = right if d != self.wrong_at else (right + 1) % self.vocab
                node = 2 * (d - 1)
                tokens[s, node], parents[s, node] = chain, parent
                tokens[s, node + 1], parents[s, node + 1] = (right + 2) % self.vocab, parent
                tok, parent = chain, node
        return DraftBatch(tokens, parents, None, ChildSampling.DETERMINISTIC_TOPK)

    def commit(self, active, accepted_nodes, num_accepted, emitted) -> None:
        self.commits += 1

    def release(self, slot: int) -> None:
        pass
