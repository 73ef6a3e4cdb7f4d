"""sampling_probs filters, inverse-CDF draws, and seeded request keys."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.verify.sampling import (
    request_key,
    sample,
    sample_from_uniform,
    sample_rows,
    sampling_probs,
)

E = math.e


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    return np.asarray(
        sampling_probs(jnp.asarray(logits, jnp.float32), temperature, top_k, top_p, min_p)
    )


# -- hand-computed cases (logits [2, 1, 1, 0]: softmax [e^2, e, e, 1] / (e^2 + 2e + 1)) ---

LOGITS = [2.0, 1.0, 1.0, 0.0]
SOFTMAX = np.array([E**2, E, E, 1.0]) / (E**2 + 2 * E + 1)  # [0.534, 0.197, 0.197, 0.072]


def test_no_filters_is_softmax():
    np.testing.assert_allclose(_probs(LOGITS), SOFTMAX, rtol=1e-6)


def test_temperature():
    # logits [0, 2 ln 3, -inf, -inf] at temperature 2 -> [0, ln 3, -inf, -inf] -> [1, 3] / 4.
    logits = [0.0, 2 * math.log(3), -np.inf, -np.inf]
    np.testing.assert_allclose(_probs(logits, temperature=2.0), [0.25, 0.75, 0, 0], rtol=1e-6)


def test_top_k_tie_goes_to_lowest_id():
    # Top 2 of [2, 1, 1, 0]: token 0, then token 1 wins the tie with token 2.
    # Kept logits [2, 1] -> [e^2, e] / (e^2 + e) = [e, 1] / (e + 1) = [0.731, 0.269].
    np.testing.assert_allclose(_probs(LOGITS, top_k=2), [E / (E + 1), 1 / (E + 1), 0, 0], rtol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, [0]),  # 0.534 >= 0.5 already
        (0.534, [0]),
        (0.7, [0, 1]),  # 0.534 + 0.197 = 0.731 >= 0.7; token 1 before token 2 (tie)
        (0.8, [0, 1, 2]),  # 0.928 >= 0.8
        (0.95, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_smallest_prefix(top_p, kept):
    expected = np.zeros(4)
    expected[kept] = SOFTMAX[kept] / SOFTMAX[kept].sum()
    np.testing.assert_allclose(_probs(LOGITS, top_p=top_p), expected, rtol=1e-6, atol=1e-7)


def test_top_p_after_top_k():
    # top_k=3 -> [e^2, e, e] / (e^2 + 2e) = [0.576, 0.212, 0.212]; top_p 0.7 -> tokens 0, 1.
    np.testing.assert_allclose(
        _probs(LOGITS, top_k=3, top_p=0.7), [E / (E + 1), 1 / (E + 1), 0, 0], rtol=1e-6
    )


def test_min_p():
    # Threshold 0.3 * 0.534 = 0.160: token 3 (0.072) goes -> [e^2, e, e] / (e^2 + 2e).
    expected = np.array([E**2, E, E, 0]) / (E**2 + 2 * E)
    np.testing.assert_allclose(_probs(LOGITS, min_p=0.3), expected, rtol=1e-6)
    # Threshold 0.5 * 0.534 = 0.267 also drops tokens 1 and 2.
    np.testing.assert_allclose(_probs(LOGITS, min_p=0.5), [1, 0, 0, 0])


def test_min_p_with_top_p():
    # top_p 0.8 keeps [0, 1, 2]; renormalized [0.576, 0.212, 0.212]; min_p 0.37 -> 0.213.
    np.testing.assert_allclose(_probs(LOGITS, top_p=0.8, min_p=0.37), [1, 0, 0, 0])
    np.testing.assert_allclose(
        _probs(LOGITS, top_p=0.8, min_p=0.36), np.array([E, 1, 1, 0]) / (E + 2), rtol=1e-6
    )


def test_greedy_is_one_hot_at_lowest_argmax():
    # Ties between tokens 1 and 2 -> token 1; filters are ignored at temperature 0.
    probs = _probs([1.0, 3.0, 3.0, 0.0], temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])


# -- batched parameters and a numpy reference ------------------------------------------


def _reference(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Row-by-row float64 restatement of the rules in the sampling_probs docstring."""
    vocab = logits.shape[-1]
    out = np.zeros_like(logits, np.float64)
    for row, z in enumerate(logits.astype(np.float64)):
        if temperature[row] == 0:
            out[row, np.argmax(z)] = 1.0
            continue
        z = z / temperature[row]
        order = np.argsort(-z, kind="stable")
        kept = order[: top_k[row] if top_k[row] > 0 else vocab]
        probs = np.exp(z[kept] - z[kept].max())
        probs /= probs.sum()
        if top_p[row] < 1:
            cutoff = np.searchsorted(np.cumsum(probs), top_p[row]) + 1  # first prefix >= top_p
            kept, probs = kept[:cutoff], probs[:cutoff] / probs[:cutoff].sum()
        keep = probs >= min_p[row] * probs.max()
        out[row, kept[keep]] = probs[keep] / probs[keep].sum()
    return out


def test_matches_reference_with_per_row_params():
    rng = np.random.default_rng(0)
    rows, vocab = 96, 24
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    temperature = rng.choice([0.0, 0.5, 1.0, 1.5], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 10, 30], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.6, 0.2], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        probs, _reference(logits, temperature, top_k, top_p, min_p), rtol=1e-4, atol=1e-6
    )
    # Leading batch dims: [2, 48, V] with [2, 48] params gives the same rows.
    reshaped = sampling_probs(
        logits.reshape(2, 48, vocab),
        temperature.reshape(2, 48),
        top_k.reshape(2, 48),
        top_p.reshape(2, 48),
        min_p.reshape(2, 48),
    )
    np.testing.assert_allclose(reshaped.reshape(rows, vocab), probs, rtol=1e-6, atol=1e-7)


# -- draws -----------------------------------------------------------------------------


def test_sample_from_uniform_by_hand():
    # cumsum [0.2, 0.2, 0.7, 1.0]: the first token whose cumsum exceeds u.
    probs = jnp.array([0.2, 0.0, 0.5, 0.3])
    uniforms = jnp.array([0.0, 0.1, 0.2, 0.69, 0.7, 0.999999])
    np.testing.assert_array_equal(
        sample_from_uniform(jnp.broadcast_to(probs, (6, 4)), uniforms), [0, 0, 2, 2, 3, 3]
    )
    # u * total rounding up to total still returns the last token with mass, not padding.
    np.testing.assert_array_equal(sample_from_uniform(jnp.array([0.5, 0.5, 0.0]), 1.0), 1)


def test_greedy_rows_return_argmax_exactly():
    probs = jax.nn.one_hot(jnp.array([0, 5, 7, 3]), 8)
    for seed in range(20):
        tokens = sample_rows(probs, jax.random.split(jax.random.key(seed), 4))
        np.testing.assert_array_equal(tokens, [0, 5, 7, 3])
    # Zero-probability tokens are never drawn, whatever the uniform in [0, 1).
    uniforms = jnp.append(jnp.linspace(0.0, 1.0, 1000, endpoint=False), 1.0 - 2**-24)
    for row in range(4):
        tokens = sample_from_uniform(jnp.broadcast_to(probs[row], (1001, 8)), uniforms)
        assert (tokens == jnp.argmax(probs[row])).all()


def test_sample_rows_distribution():
    probs = jnp.array([0.1, 0.0, 0.4, 0.2, 0.3])
    n = 40_000
    keys = jax.random.split(jax.random.key(2), n)
    tokens = sample_rows(jnp.broadcast_to(probs, (n, 5)), keys)
    freq = np.bincount(np.asarray(tokens), minlength=5) / n
    assert freq[1] == 0
    # TV noise at n = 40k is ~0.003; a wrong sampler would be off by >= 0.05.
    assert 0.5 * np.abs(freq - np.asarray(probs)).sum() < 0.01


def test_raw_and_typed_keys():
    probs = jnp.full((3, 10), 0.1)
    typed = jax.random.split(jax.random.key(3), 3)
    raw = jax.random.key_data(typed)
    np.testing.assert_array_equal(sample_rows(probs, typed), sample_rows(probs, raw))


def test_request_key_is_fold_in_of_seed():
    expected = jax.random.fold_in(jax.random.key(1234), 7)
    np.testing.assert_array_equal(
        jax.random.key_data(request_key(1234, 7)), jax.random.key_data(expected)
    )
    assert not np.array_equal(
        jax.random.key_data(request_key(1234, 7)), jax.random.key_data(request_key(1234, 8))
    )


def test_seeded_draws_are_batch_invariant():
    rng = np.random.default_rng(4)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(6, 32)), jnp.float32))
    seeds, counters = jnp.arange(100, 106), jnp.array([0, 3, 3, 9, 1, 2])
    keys = jax.vmap(request_key)(seeds, counters)
    together = sample_rows(probs, keys)
    for row in range(6):
        alone = sample(probs[row], request_key(int(seeds[row]), int(counters[row])))
        assert int(alone) == int(together[row])
    # Reordering the batch moves the results with the rows.
    perm = jnp.array([5, 3, 1, 0, 2, 4])
    np.testing.assert_array_equal(sample_rows(probs[perm], keys[perm]), together[perm])


# ----------------------------------------------------------------------------- repetition penalty


def test_penalize_covers_seen_tokens_and_each_positions_path():
    from specdec.verify.batch import SamplingBatch

    b = SamplingBatch.make_dummy(1)
    seen = np.zeros((1, 12), bool)
    seen[0, 5] = True
    b = dataclasses.replace(b, repetition_penalty=np.array([2.0], np.float32), seen=seen)
    logits = jnp.full((1, 3, 12), 4.0).at[:, :, 0].set(-4.0)
    # Block [root 9, node 7 (child of root), node 0 (child of root)].
    block = jnp.array([[9, 7, 0]])
    visible = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    out = np.asarray(b.penalize(logits, block, visible))[0]
    want = np.full((3, 12), 4.0)
    want[:, 0] = -4.0
    want[:, [5, 9]] = 2.0  # seen and root: every position
    want[1, 7] = 2.0  # node 7's own path
    want[2, 0] = -8.0  # negative logits are multiplied
    np.testing.assert_array_equal(out, want)
    assert b.penalize(logits[:, :1]).shape == (1, 1, 12)  # no block: the seen set only
    plain = SamplingBatch.make_dummy(1)
    assert plain.penalize(logits, block, visible) is logits


def test_repetition_penalty_is_validated():
    from specdec.params import SamplingParams

    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=0.5).repetition_penalty == 0.5


def test_generation_config_defaults(tmp_path):
    import json

    from specdec.params import generation_defaults

    assert generation_defaults(tmp_path) == {}
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2}))
    assert generation_defaults(tmp_path) == {"repetition_penalty": 1.2}
    f.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 0}
    f.write_text(json.dumps({"repetition_penalty": -1}))
    with pytest.raises(ValueError, match="generation_config.json: repetition_penalty must be"):
        generation_defaults(tmp_path)
    f.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        generation_defaults(tmp_path)


def test_repetition_penalized_rule():
    from specdec.verify.sampling import repetition_penalized

    got = repetition_penalized(
        jnp.array([2.0, -2.0, 2.0]), jnp.array([True, True, False]), jnp.float32(2.0)
    )
    np.testing.assert_array_equal(np.asarray(got), [1.0, -4.0, 2.0])
