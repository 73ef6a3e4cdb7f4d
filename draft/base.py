"""What every drafter provides, and the batch of trees it hands the target.

A drafter keeps its own per-slot state (a model drafter its KV cache, an
n-gram drafter the committed tokens) and talks to the engine in five calls:
`reserve` and `start` when sequences enter slots, `propose` once per step,
`commit` with the target's verdict, `release` when a sequence leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import PAD_PARENT, ChildSampling

__all__ = ["PAD_PARENT", "DraftBatch", "Drafter", "OverlapDrafter"]


@dataclasses.dataclass
class DraftBatch:
    """One step's trees for all slots (row s = slot s), padded to N nodes."""

    # tokens and parents may still be device arrays (a model drafter hands its tree to
    # the in-process verify without a host round trip); `to_host` for numpy work.
    tokens: np.ndarray  # i32[S, N]
    parents: np.ndarray  # i32[S, N], -1 = child of root, -2 = padding
    draft_probs: object  # f32[S, N+1, V] q per node (device or host); None if not needed
    child_sampling: ChildSampling  # how children were drawn: picks the acceptance rule

    @property
    def num_nodes(self) -> np.ndarray:  # i32[S] real (unpadded) nodes per row
        return (np.asarray(self.parents) >= -1).sum(axis=1).astype(np.int32)

    def to_host(self) -> DraftBatch:
        """The same trees with tokens and parents as writable numpy arrays."""
        return dataclasses.replace(
            self, tokens=np.array(self.tokens), parents=np.array(self.parents)
        )

    def rows(self, idx: np.ndarray) -> DraftBatch:
        """Rows `idx` (slot ids) of these trees, in that order (device arrays stay
        on the device)."""
        probs = self.draft_probs
        return dataclasses.replace(
            self, tokens=self.tokens[idx], parents=self.parents[idx],
            draft_probs=None if probs is None else probs[idx],
        )  # fmt: skip

    @classmethod
    def empty(cls, num_slots: int, max_nodes: int = 0) -> DraftBatch:
        """All-padding trees (plain decoding, or a drafter with nothing to say)."""
        return cls(
            tokens=np.zeros((num_slots, max_nodes), np.int32),
            parents=np.full((num_slots, max_nodes), PAD_PARENT, np.int32),
            draft_probs=None,
            child_sampling=ChildSampling.DETERMINISTIC_TOPK,
        )


class Drafter(Protocol):
    """The engine's view of a drafter."""

    max_nodes: int  # N: every proposed tree is padded to this many nodes

    def start(self, slots: list[int], prompts: list[list[int]], roots: list[int]) -> None:
        """New sequences entered `slots` with these prompts and first output tokens."""

    def reserve(self, slots: list[int], lengths: list[int]) -> None:
        """Rows in `slots` will grow to about `lengths` tokens (so a drafter with a KV
        cache reads one compiled length per request); drafters without one ignore it."""

    def propose(self, active: np.ndarray, roots: np.ndarray, sampling: SamplingBatch) -> DraftBatch:
        """Trees hanging from `roots` (i32[S]) for the active slots (bool[S])."""

    def commit(
        self,
        active: np.ndarray,  # bool[S]
        accepted_nodes: np.ndarray,  # i32[S, N] accepted node indices root-first, then -1
        num_accepted: np.ndarray,  # i32[S]
        emitted: np.ndarray,  # i32[S, N+1] accepted tokens, then the bonus token
    ) -> None:
        """The target kept `emitted[s, :num_accepted[s] + 1]`; the bonus is the new root."""

    def release(self, slot: int) -> None:
        """The sequence in `slot` finished."""


@runtime_checkable
class OverlapDrafter(Drafter, Protocol):
    """A drafter that can grow tree t + 1 while the target verifies tree t.

    The distributed draft actor (cluster/actors.py) overlaps drafting with
    verification only for drafters that implement this; the in-process engine
    never calls these hooks. `speculate` returns an opaque guess object that
    `resolve` and `propose_reusing` take back.
    """

    def speculate(
        self, active: np.ndarray, tree: DraftBatch, sampling: SamplingBatch | None = None
    ) -> Any:
        """Grows the next tree now from a guessed verdict on `tree` (just proposed)."""

    def resolve(
        self,
        spec: Any,
        active: np.ndarray,
        accepted_nodes: np.ndarray,
        num_accepted: np.ndarray,
        emitted: np.ndarray,
    ) -> np.ndarray:
        """`commit` for a step that was speculated on; returns bool[S], the rows whose
        guess the target confirmed."""

    def propose_reusing(
        self, spec: Any, hit: np.ndarray, active: np.ndarray, roots: np.ndarray,
        sampling: SamplingBatch,
    ) -> DraftBatch:  # fmt: skip
        """`propose`, reusing the speculated tree for the rows in `hit`."""
