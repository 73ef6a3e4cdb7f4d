"""Per-row sampling parameters of a batch, as flat arrays (pure data + jnp)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .sampling import repetition_penalized, request_key, sampling_probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters and randomness for one batched call.

    The key of row b is `fold_in(key(seed[b]), counter[b])`, so a seeded request
    draws the same numbers alone or inside any batch.
    """

    temperature: jax.Array  # f32[B], 0 = greedy
    top_k: jax.Array  # i32[B], 0 = off
    top_p: jax.Array  # f32[B], 1 = off
    min_p: jax.Array  # f32[B], 0 = off
    seed: jax.Array  # u32[B]
    counter: jax.Array  # i32[B], output tokens the request already has
    repetition_penalty: jax.Array | None = None  # f32[B], 1 = off; None = off for all rows
    seen: jax.Array | None = None  # bool[B, V]: tokens in each row's prompt + output

    @classmethod
    def make_dummy(cls, batch: int, vocab_size: int | None = None) -> SamplingBatch:
        """Greedy rows, seed 0: for tests and padding. With `vocab_size`, in the
        penalised form (penalty 1, nothing seen): the same numbers, the other pytree."""
        dummy = cls(
            temperature=np.zeros(batch, np.float32),
            top_k=np.zeros(batch, np.int32),
            top_p=np.ones(batch, np.float32),
            min_p=np.zeros(batch, np.float32),
            seed=np.zeros(batch, np.uint32),
            counter=np.zeros(batch, np.int32),
        )
        if vocab_size is None:
            return dummy
        return dataclasses.replace(
            dummy, repetition_penalty=np.ones(batch, np.float32),
            seen=np.zeros((batch, vocab_size), bool),
        )  # fmt: skip

    def take(self, n: int) -> SamplingBatch:
        """The first n rows."""
        return jax.tree.map(lambda a: a[:n], self)

    def rows(self, idx: np.ndarray) -> SamplingBatch:
        """Rows `idx` (slot ids), in that order."""
        return jax.tree.map(lambda a: a[idx], self)

    def padded(self, rows: int) -> SamplingBatch:
        """These rows, then greedy seed-0 rows (`make_dummy`) up to `rows` rows."""
        b = self.temperature.shape[0]
        if b == rows:
            return self
        pad = SamplingBatch.make_dummy(rows - b, None if self.seen is None else self.seen.shape[1])
        return jax.tree.map(lambda a, p: np.concatenate([np.asarray(a), p]), self, pad)

    def penalize(
        self,
        logits: jax.Array,  # f32[B, M, V], position m's next-token logits
        block: jax.Array | None = None,  # i32[B, M] the block's own tokens
        visible: jax.Array | None = None,  # bool[B, M, M] position m sees position j
    ) -> jax.Array:
        """The repetition penalty: tokens in a row's prompt + output (`seen`), or
        at a block position the position sees (its tree path), get their logit
        divided by the penalty when positive and multiplied when negative.

        Example: seen = {5}, block [root 9, node 7 (child of root)], penalty 2:
        position 0 penalises {5, 9}, position 1 penalises {5, 9, 7}.
        """
        if self.seen is None:
            return logits
        b, m, v = logits.shape
        hit = jnp.broadcast_to(self.seen[:, None, :v], (b, m, v))
        if block is not None:
            rows = jnp.arange(b)[:, None, None]
            pos = jnp.arange(m)[None, :, None]
            toks = jnp.where(visible, block[:, None, :], v)  # v = out of range: dropped
            hit = hit.at[rows, pos, toks].set(True, mode="drop")
        return repetition_penalized(logits, hit, self.repetition_penalty[:, None, None])

    def probs(self, logits: jax.Array) -> jax.Array:
        """Target distribution per row: logits f32[B, M, V] -> f32[B, M, V]."""
        col = lambda a: a[:, None]  # noqa: E731
        return sampling_probs(
            logits, col(self.temperature), col(self.top_k), col(self.top_p), col(self.min_p)
        )

    def uniforms(self, n: int) -> jax.Array:
        """f32[B, n] uniforms from each row's own key."""
        keys = jax.vmap(request_key)(self.seed, self.counter)
        return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(keys)
