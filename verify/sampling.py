"""Target and draft sampling distributions: temperature, top-k, top-p, min-p.

Everything here is pure ``jnp`` with per-row parameters, so one jitted call serves a
batch of requests with different settings, and the acceptance rules
(``verify/acceptance.py``) see exactly the distribution plain sampling would use.

Order of the filters follows vLLM: temperature scaling, then top-k, then top-p, then
min-p, then renormalize. Ties everywhere break to the lowest token id (the same rule as
``jnp.argmax`` and greedy acceptance), so filtered sets never depend on sort
instability.

Worked example (one row, logits ``[2, 1, 1, 0]``, temperature 1, each filter alone):
softmax is about ``[0.53, 0.20, 0.20, 0.07]``; top_k=2 keeps tokens 0 and 1 (token 1
beats token 2 on the tie by its lower id); top_p=0.5 keeps only token 0 (0.53 >= 0.5
already); min_p=0.3 drops tokens below ``0.3 * 0.53 = 0.16``, i.e. token 3.

Public functions are jitted at definition (they inline when called under another jit).

Randomness: a request's key is ``fold_in(key(seed), counter)`` (``request_key``), so a
seeded request draws the same numbers in any batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "request_key",
    "sample",
    "sample_from_uniform",
    "sample_rows",
    "sampling_probs",
]


@jax.jit
def repetition_penalized(logits: jax.Array, hit: jax.Array, penalty: jax.Array) -> jax.Array:
    """transformers' / vLLM's repetition penalty: where `hit`, a positive logit is
    divided by `penalty` and a negative one multiplied by it (`penalty` broadcasts).

    Example: logits [2, -2, 2], hit [T, T, F], penalty 2 -> [1, -4, 2].
    """
    return jnp.where(hit, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def sampling_probs(
    logits: jax.Array,  # f32[..., V]
    temperature: jax.Array,  # f32[...], 0 = greedy
    top_k: jax.Array,  # i32[...], 0 = off
    top_p: jax.Array,  # f32[...] in (0, 1], 1 = off
    min_p: jax.Array,  # f32[...] in [0, 1], 0 = off
) -> jax.Array:  # f32[..., V], each row sums to 1
    """The distribution a request samples from, one row per leading index.

    Parameters broadcast against ``logits.shape[:-1]`` (a scalar applies to every row).

    - ``temperature == 0``: one-hot at ``jnp.argmax(logits)`` (lowest token id on ties);
      the other filters are ignored.
    - ``top_k > 0``: keep the ``top_k`` highest tokens (by rank; ties to the lowest id).
    - ``top_p < 1``: keep the smallest prefix of the ranked tokens whose probability
      (after top-k, renormalized) sums to ``>= top_p``; the top token is always kept.
    - ``min_p > 0``: drop tokens with probability ``< min_p * max_prob`` (the ratio is
      the same before or after renormalizing, so it is taken on the top-p output).

    Values are not checked here (traced); ``SamplingParams`` validates them. A row with
    every logit ``-inf`` gives NaN.
    """
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)[..., None]
    top_k = jnp.asarray(top_k, jnp.int32)[..., None]
    top_p = jnp.asarray(top_p, jnp.float32)[..., None]
    min_p = jnp.asarray(min_p, jnp.float32)[..., None]

    greedy = temperature == 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)

    # Ascending stable sort of the negated logits = descending with ties to the lowest id.
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # i32[..., V], rank -> token
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)

    keep = (top_k <= 0) | (rank < top_k)
    sorted_probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Exclusive cumulative sum: a token is kept while the mass before it is < top_p.
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep &= (top_p >= 1.0) | (mass_before < top_p) | (rank == 0)
    kept_probs = jnp.where(keep, sorted_probs, 0.0)
    keep &= kept_probs >= min_p * kept_probs[..., :1]

    keep_by_token = jnp.put_along_axis(
        jnp.zeros(scaled.shape, bool), order, keep, axis=-1, inplace=False
    )
    probs = jax.nn.softmax(jnp.where(keep_by_token, scaled, -jnp.inf), axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


@jax.jit
def sample_from_uniform(
    probs: jax.Array,  # f32[..., V], non-negative, need not be normalized
    uniform: jax.Array,  # f32[...] in [0, 1)
) -> jax.Array:  # i32[...]
    """Inverse-CDF draw: the first token whose cumulative mass exceeds ``uniform * total``.

    Tokens with zero probability are never returned (their cumulative mass equals their
    predecessor's), so a one-hot row returns its hot token for every uniform. Rounding
    past the end clamps to the last token with positive probability.

    Example: probs ``[0.2, 0, 0.5, 0.3]``, cumsum ``[0.2, 0.2, 0.7, 1.0]``: uniform 0.1
    -> 0, 0.2 -> 2 (0.2 is not > 0.2), 0.69 -> 2, 0.7 -> 3.
    """
    probs = jnp.asarray(probs, jnp.float32)
    vocab = probs.shape[-1]
    cdf = jnp.cumsum(probs, axis=-1)
    target = jnp.asarray(uniform, jnp.float32)[..., None] * cdf[..., -1:]
    index = jnp.sum(cdf <= target, axis=-1, dtype=jnp.int32)
    last_positive = vocab - 1 - jnp.argmax(jnp.flip(probs, axis=-1) > 0, axis=-1)
    return jnp.minimum(index, last_positive).astype(jnp.int32)


@jax.jit
def sample(
    probs: jax.Array,  # f32[V]
    key: jax.Array,  # PRNG key (typed key[] or raw u32[2])
) -> jax.Array:  # i32[]
    """Draw one token from one row; a one-hot (greedy) row returns its argmax exactly."""
    return sample_from_uniform(probs, jax.random.uniform(key, (), jnp.float32))


@jax.jit
def sample_rows(
    probs: jax.Array,  # f32[B, V]
    keys: jax.Array,  # key[B] typed, or u32[B, 2] raw
) -> jax.Array:  # i32[B]
    """``sample`` per row; row i depends only on ``probs[i]`` and ``keys[i]``."""
    return jax.vmap(sample)(probs, keys)


def request_key(
    seed: int | jax.Array,  # i32[] or Python int
    counter: int | jax.Array,  # i32[], per-request draw counter
) -> jax.Array:  # key[]
    """``fold_in(key(seed), counter)``: depends only on the request, never on the batch."""
    return jax.random.fold_in(jax.random.key(seed), counter)
