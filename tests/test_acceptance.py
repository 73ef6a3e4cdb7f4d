"""Acceptance rules: exact greedy cases, seeded determinism, and distribution tests.

The distribution tests run the whole stochastic step on a toy model: a target and a
draft defined by random logit tables indexed by the prefix (so exact conditionals are
known), trees whose children are drawn the way each ``ChildSampling`` says, and the
acceptance rule under ``vmap`` over >= 100k draws. The first emitted token must follow
the target distribution p(a), and the first two tokens the joint p(a) p(b | a) (when a
step emits only one token, the second comes from the exact conditional, as the next
step would draw it).
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.scipy.special import gammaincc

from specdec.verify.acceptance import (
    ACCEPTANCE_RULES,
    emitted_tokens,
    greedy_accept,
    stochastic_accept,
    stochastic_accept_with_key,
)
from specdec.verify.sampling import request_key, sample_from_uniform, sampling_probs
from specdec.verify.tree import ChildSampling

IID = ChildSampling.IID
WOR = ChildSampling.WITHOUT_REPLACEMENT
TOPK = ChildSampling.DETERMINISTIC_TOPK


def _verdict(verdict) -> tuple[list[int], int, int]:
    return [int(x) for x in verdict.accepted_nodes], int(verdict.num_accepted), int(verdict.bonus)


# -- greedy: exact cases ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "parents", "target_argmax", "expected"),
    [
        # Root argmax 7 -> node 1 (token 7); argmax at node 1 = target_argmax[2] = 2, but
        # node 1's only child (node 3) is 9 -> stop; bonus 2.
        ([5, 7, 3, 9], [-1, -1, 0, 1], [7, 1, 2, 4, 8], ([1, -1, -1, -1], 1, 2)),
        # Root 5 -> node 0; at node 0 argmax 3 -> node 2; node 2 is a leaf -> bonus
        # target_argmax[3] = 4.
        ([5, 7, 3, 9], [-1, -1, 0, 1], [5, 3, 2, 4, 8], ([0, 2, -1, -1], 2, 4)),
        # Root argmax 6 matches no child: nothing accepted, bonus 6.
        ([5, 7, 3, 9], [-1, -1, 0, 1], [6, 3, 2, 4, 8], ([-1, -1, -1, -1], 0, 6)),
        # Duplicate siblings (IID): the first one (node 0) is taken; its child 2 matches
        # argmax 1 at node 0, then bonus at node 2 = 9.
        ([4, 4, 1, 1], [-1, -1, 0, 1], [4, 1, 1, 9, 8], ([0, 2, -1, -1], 2, 9)),
        # Chain 3 -> 1 -> 4 fully accepted: bonus = argmax at the last node = 5.
        ([3, 1, 4], [-1, 0, 1], [3, 1, 4, 5], ([0, 1, 2], 3, 5)),
        # Padding (parent -2) is never a child, even when its token matches the argmax.
        ([2, 8, 8], [-1, -2, -2], [2, 8, 0, 0], ([0, -1, -1], 1, 8)),
    ],
)
def test_greedy_by_hand(tokens, parents, target_argmax, expected):
    verdict = greedy_accept(jnp.array(tokens), jnp.array(parents), jnp.array(target_argmax))
    assert _verdict(verdict) == expected


def test_greedy_empty_tree():
    verdict = greedy_accept(jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), jnp.array([3]))
    assert _verdict(verdict) == ([], 0, 3)


def test_emitted_tokens():
    # tokens [5, 7, 3, 9], accepted nodes [0, 2], bonus 4 -> [5, 3, 4, -1, -1].
    tokens = jnp.array([5, 7, 3, 9])
    verdict = greedy_accept(tokens, jnp.array([-1, -1, 0, 1]), jnp.array([5, 3, 2, 4, 8]))
    np.testing.assert_array_equal(emitted_tokens(tokens, verdict), [5, 3, 4, -1, -1])


def test_greedy_batched_matches_single():
    tokens = jnp.array([[5, 7, 3, 9], [3, 1, 4, 0], [2, 8, 8, 8]])
    parents = jnp.array([[-1, -1, 0, 1], [-1, 0, 1, -2], [-1, -2, -2, -2]])
    argmax = jnp.array([[5, 3, 2, 4, 8], [3, 1, 4, 5, 0], [2, 8, 0, 0, 0]])
    batched = jax.vmap(greedy_accept)(tokens, parents, argmax)
    for row in range(3):
        single = greedy_accept(tokens[row], parents[row], argmax[row])
        assert _verdict(jax.tree.map(lambda x, r=row: x[r], batched)) == _verdict(single)


GREEDY_PAD = 10


@st.composite
def greedy_cases(draw):
    """A random tree (vocab 3, so matches are common) padded to GREEDY_PAD slots."""
    n = draw(st.integers(0, GREEDY_PAD))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)] + [-2] * (GREEDY_PAD - n)
    tokens = [draw(st.integers(0, 2)) for _ in range(GREEDY_PAD)]
    argmax = [draw(st.integers(0, 2)) for _ in range(GREEDY_PAD + 1)]
    return tokens, parents, argmax


@settings(max_examples=40, deadline=None)
@given(greedy_cases())
def test_greedy_matches_python_walk(case):
    tokens, parents, argmax = case
    # Reference: walk from the root, first matching child in node order.
    path, node = [], -1
    while True:
        match = [i for i, p in enumerate(parents) if p == node and tokens[i] == argmax[node + 1]]
        if not match:
            break
        node = match[0]
        path.append(node)
    verdict = greedy_accept(jnp.array(tokens), jnp.array(parents), jnp.array(argmax))
    expected = (path + [-1] * (GREEDY_PAD - len(path)), len(path), argmax[node + 1])
    assert _verdict(verdict) == expected


# -- stochastic: exact cases -----------------------------------------------------------

# Root: p = [0.1, 0.3, 0.6], q = [0.5, 0.25, 0.25]; two leaf children, tokens 0 then 1.
# p at node 0 and node 1 is [0, 0, 1] and [0, 1, 0], so a bonus there is known.
TOKENS = jnp.array([0, 1])
PARENTS = jnp.array([-1, -1])
TARGET = jnp.array([[0.1, 0.3, 0.6], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
DRAFT = jnp.array([[0.5, 0.25, 0.25], [jnp.nan] * 3, [jnp.nan] * 3])  # leaf rows unread


def _accept(uniforms, sampling, draft=DRAFT):
    return _verdict(
        stochastic_accept(TOKENS, PARENTS, TARGET, draft, jnp.array(uniforms), sampling=sampling)
    )


def test_iid_by_hand():
    # Node 0 (token 0): accept iff u1 * q(0) < p(0), i.e. u1 * 0.5 < 0.1: u1 = 0.1 accepts,
    # then node 0 is a leaf, so the bonus comes from p at node 0 = [0, 0, 1] -> 2.
    assert _accept([0.5, 0.1, 0.9], IID) == ([0, -1], 1, 2)
    # u1 = 0.5 rejects (0.25 >= 0.1): p <- max(p - q, 0) = [0, 0.05, 0.35] / 0.4
    # = [0, 0.125, 0.875]; q unchanged. Node 1 (token 1): u2 * 0.25 < 0.125 iff u2 < 0.5;
    # u2 = 0.4 accepts -> bonus from p at node 1 = [0, 1, 0] -> 1.
    assert _accept([0.5, 0.5, 0.4], IID) == ([1, -1], 1, 1)
    # u2 = 0.6 rejects too: p <- max([0, 0.125, 0.875] - q, 0) = [0, 0, 0.625] -> [0, 0, 1],
    # so the bonus is 2 whatever u0.
    assert _accept([0.1, 0.5, 0.6], IID) == ([-1, -1], 0, 2)
    assert _accept([0.99, 0.5, 0.6], IID) == ([-1, -1], 0, 2)


def test_without_replacement_by_hand():
    # As IID, but rejecting token 0 also sets q <- [0, 0.25, 0.25] / 0.5 = [0, 0.5, 0.5].
    # Node 1: u2 * 0.5 < 0.125 iff u2 < 0.25: u2 = 0.4 now rejects (IID accepted it);
    # p <- max([0, 0.125, 0.875] - [0, 0.5, 0.5], 0) = [0, 0, 0.375] -> [0, 0, 1]: bonus 2.
    assert _accept([0.1, 0.5, 0.4], WOR) == ([-1, -1], 0, 2)
    assert _accept([0.1, 0.5, 0.2], WOR) == ([1, -1], 1, 1)


def test_deterministic_topk_by_hand():
    # Draw x ~ p at the root with u0: cumsum [0.1, 0.4, 1.0].
    # u0 = 0.05 -> x = 0 = node 0's token: accept node 0; at node 0 draw with u1 from
    # [0, 0, 1] -> 2, node 0 has no children -> bonus 2.
    assert _accept([0.05, 0.3, 0.3], TOPK, draft=None) == ([0, -1], 1, 2)
    # u0 = 0.3 -> x = 1 -> node 1; draw at node 1 with u2 from [0, 1, 0] -> bonus 1.
    assert _accept([0.3, 0.9, 0.9], TOPK, draft=None) == ([1, -1], 1, 1)
    # u0 = 0.5 -> x = 2, no child has token 2: x itself is the bonus token.
    assert _accept([0.5, 0.9, 0.9], TOPK, draft=None) == ([-1, -1], 0, 2)


def test_degenerate_residual_falls_back_to_p():
    # p == q and u = 1 forces a rejection; max(p - q, 0) has no mass, so p is kept.
    p = jnp.array([[0.25, 0.75], [0.5, 0.5]])
    for sampling in (IID, WOR):
        verdict = stochastic_accept(
            jnp.array([1]), jnp.array([-1]), p, p, jnp.array([0.5, 1.0]), sampling=sampling
        )
        # Bonus from p = [0.25, 0.75] with u0 = 0.5 -> token 1.
        assert _verdict(verdict) == ([-1], 0, 1)


def test_registry_and_argument_errors():
    assert set(ACCEPTANCE_RULES) == set(ChildSampling)
    with pytest.raises(ValueError, match="sampling must be a ChildSampling"):
        stochastic_accept(TOKENS, PARENTS, TARGET, DRAFT, jnp.zeros(3), sampling="beam")
    with pytest.raises(ValueError, match="draft_probs is required"):
        stochastic_accept(TOKENS, PARENTS, TARGET, None, jnp.zeros(3), sampling=IID)
    with pytest.raises(ValueError, match=r"target_probs needs one row for the root"):
        stochastic_accept(TOKENS, PARENTS, TARGET[:2], DRAFT, jnp.zeros(3), sampling=IID)
    with pytest.raises(ValueError, match=r"uniforms needs one row for the root"):
        stochastic_accept(TOKENS, PARENTS, TARGET, DRAFT, jnp.zeros(2), sampling=IID)
    with pytest.raises(ValueError, match="tokens and parents must both have shape"):
        greedy_accept(TOKENS, PARENTS[:1], jnp.zeros(3, jnp.int32))


def test_empty_tree_draws_bonus_from_root():
    empty = jnp.zeros(0, jnp.int32)
    for sampling in ChildSampling:
        verdict = stochastic_accept(
            empty, empty, TARGET[:1], DRAFT[:1], jnp.array([0.3]), sampling=sampling
        )
        assert _verdict(verdict) == ([], 0, 1)  # cumsum [0.1, 0.4, 1.0], u = 0.3 -> 1


# -- small random batches (one shape, so each rule compiles once) ----------------------

BATCH, SMALL_VOCAB = 16, 6
# Root -> 0, 1; 0 -> 2, 3; 1 -> 4; 2 -> 5.
SMALL_PARENTS = np.array([-1, -1, 0, 0, 1, 2], np.int32)


def _small_batch(seed):
    """Tokens with distinct siblings (valid for every rule), p and q tables, uniforms."""
    rng = np.random.default_rng(seed)
    tokens = np.stack(
        [
            np.concatenate(
                [rng.permutation(SMALL_VOCAB)[:2], rng.permutation(SMALL_VOCAB)[:2]]
                + [rng.integers(0, SMALL_VOCAB, 2)]
            )
            for _ in range(BATCH)
        ]
    ).astype(np.int32)
    shape = (BATCH, len(SMALL_PARENTS) + 1, SMALL_VOCAB)
    target = jax.nn.softmax(jnp.asarray(rng.normal(size=shape), jnp.float32))
    draft = jax.nn.softmax(jnp.asarray(rng.normal(size=shape), jnp.float32))
    uniforms = jnp.asarray(rng.random(shape[:2]), jnp.float32)
    return jnp.asarray(tokens), target, draft, uniforms


@jax.jit
@jax.vmap
def draw(key):  # -> f32[N + 1], the uniforms stochastic_accept_with_key draws
    return jax.random.uniform(key, (len(SMALL_PARENTS) + 1,))


@functools.cache
def _batched(sampling):
    rule = functools.partial(stochastic_accept, sampling=sampling)
    return jax.jit(jax.vmap(rule, in_axes=(0, None, 0, 0, 0)))


@pytest.mark.parametrize("sampling", list(ChildSampling))
def test_stochastic_rules_reduce_to_greedy_for_one_hot_target(sampling):
    """With p one-hot (temperature 0), every rule accepts exactly what greedy accepts."""
    tokens, logits, draft, uniforms = _small_batch(1)
    target = sampling_probs(logits, 0.0, 0, 1.0, 0.0)
    got = _batched(sampling)(tokens, SMALL_PARENTS, target, draft, uniforms)
    want = jax.vmap(greedy_accept, in_axes=(0, None, 0))(
        tokens, SMALL_PARENTS, jnp.argmax(logits, -1)
    )
    for field in range(3):
        np.testing.assert_array_equal(got[field], want[field])


@pytest.mark.parametrize("sampling", list(ChildSampling))
def test_padding_and_leaf_rows_are_never_read(sampling):
    # Slots 4 and 5 are padding; nodes 1, 2 and 3 are leaves. NaN in the padding rows of
    # p and q and in the leaf rows of q must give the same verdict as finite junk there.
    tokens, target, draft, uniforms = _small_batch(2)
    parents = np.array([-1, -1, 0, 0, -2, -2], np.int32)
    rule = _batched(sampling)  # parents are an argument, so this reuses the compile
    nan_target = target.at[:, 5:].set(jnp.nan)
    nan_draft = draft.at[:, 2:].set(jnp.nan)
    junk = rule(tokens, parents, target, draft, uniforms)
    nans = rule(tokens, parents, nan_target, nan_draft, uniforms)
    for a, b in zip(junk, nans, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (junk.accepted_nodes < 4).all() and (junk.num_accepted <= 2).all()


@pytest.mark.parametrize("sampling", list(ChildSampling))
def test_seeded_determinism_and_batch_invariance(sampling):
    tokens, target, draft, _ = _small_batch(3)
    keys = jax.vmap(request_key)(jnp.arange(BATCH) + 1000, jnp.full(BATCH, 4))
    run = lambda keys: _batched(sampling)(tokens, SMALL_PARENTS, target, draft, draw(keys))  # noqa: E731
    first, again = run(keys), run(keys)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    # Row 5 alone, from its own request key, gives the batch's row 5.
    alone = stochastic_accept_with_key(
        tokens[5], SMALL_PARENTS, target[5], draft[5], request_key(1005, 4), sampling=sampling
    )
    assert _verdict(alone) == _verdict(jax.tree.map(lambda x: x[5], first))
    # A reversed batch gives the reversed verdicts.
    flipped = _batched(sampling)(
        tokens[::-1], SMALL_PARENTS, target[::-1], draft[::-1], draw(keys)[::-1]
    )
    for a, b in zip(first, flipped, strict=True):
        np.testing.assert_array_equal(a, b[::-1])
    # Another counter changes some outcome (the draws are not all the same).
    other = run(jax.vmap(request_key)(jnp.arange(BATCH) + 1000, jnp.full(BATCH, 5)))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))


# -- distribution tests ----------------------------------------------------------------

VOCAB = 8
# Root -> nodes 0, 1, 2; 0 -> 3, 4; 1 -> 5, 6; 2 -> 7, 8; 3 -> 9, 10 (depth 3).
TREE_PARENTS = np.array([-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 3], np.int32)
TREE_DEPTHS = np.array([1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3])
MAX_DEPTH = 3
GROUPS = [  # (parent, its children), parents in node order
    (parent, tuple(int(i) for i in np.flatnonzero(TREE_PARENTS == parent)))
    for parent in range(-1, len(TREE_PARENTS))
    if (TREE_PARENTS == parent).any()
]
# The toy models are tables with one row per prefix: prefixes of length d (in base V)
# occupy rows OFFSETS[d] : OFFSETS[d] + V**d.
OFFSETS = np.cumsum([0] + [VOCAB**d for d in range(MAX_DEPTH + 1)])
N_LARGE = 2**17  # 131072 draws
N_SMALL = N_LARGE // 16  # TV noise should be ~4x larger here
MODE_INDEX = {IID: 0, WOR: 1, TOPK: 2}


@jax.jit
def _toy_models(key, temperature, top_k, top_p, min_p):
    """Target p (filtered by sampling_probs) and draft q, f32[OFFSETS[-1], V] each."""
    target_key, draft_key = jax.random.split(key)
    rows = int(OFFSETS[-1])
    target_logits = 1.5 * jax.random.normal(target_key, (rows, VOCAB))
    params = (jnp.full(rows, x) for x in (temperature, top_k, top_p, min_p))
    target = sampling_probs(target_logits, *params)
    # The draft is its own distribution, with zeros on 2 of 8 tokens. Depth-3 nodes are
    # leaves here, so their q rows are NaN: a rule reading them would fail loudly.
    draft = sampling_probs(jax.random.normal(draft_key, (rows, VOCAB)), 1.0, VOCAB - 2, 1.0, 0.0)
    draft = draft.at[int(OFFSETS[MAX_DEPTH]) :].set(jnp.nan)
    return target, draft


@functools.partial(jax.jit, static_argnames="n")
def _draw_trees(key, draft, mode, *, n):
    """Trees drawn from q the way ``mode`` says (0 IID, 1 WOR, 2 TOPK), fresh per draw.

    Returns tokens i32[n, N] and the model row of the root and of each node, i32[n, N + 1].
    """
    tokens = [None] * len(TREE_PARENTS)
    prefix = [None] * len(TREE_PARENTS)  # prefix id (base V) of the path to each node
    root = jnp.zeros(n, jnp.int32)
    for group, (parent, kids) in enumerate(GROUPS):
        here, depth = (root, 0) if parent < 0 else (prefix[parent], TREE_DEPTHS[parent])
        q = draft[OFFSETS[depth] + here]  # f32[n, V]
        k = len(kids)
        uniforms = jax.random.uniform(jax.random.fold_in(key, group), (k, n))
        iid = [sample_from_uniform(q, u) for u in uniforms]
        # Without replacement, drawn sequentially (same law as Gumbel-top-k in order).
        without, left = [], q
        for u in uniforms:
            without.append(sample_from_uniform(left, u))
            left = jnp.where(jnp.arange(VOCAB) == without[-1][:, None], 0.0, left)
        topk = list(jax.lax.top_k(q, k)[1].T)
        drawn = [
            jnp.select([mode == 0, mode == 1], [a, b], c)
            for a, b, c in zip(iid, without, topk, strict=True)
        ]
        for j, kid in enumerate(kids):
            tokens[kid] = drawn[j].astype(jnp.int32)
            prefix[kid] = here * VOCAB + tokens[kid]
    rows = [root] + [OFFSETS[TREE_DEPTHS[i]] + prefix[i] for i in range(len(TREE_PARENTS))]
    return jnp.stack(tokens, 1), jnp.stack(rows, 1)


@functools.cache
def _batched_rule(rule):
    def step(tokens, rows, target, draft, uniforms):
        return stochastic_accept(
            tokens, TREE_PARENTS, target[rows], draft[rows], uniforms, sampling=rule
        )

    return jax.jit(jax.vmap(step, in_axes=(0, 0, None, None, 0)))


@jax.jit
def _first_two_tokens(key, tokens, verdict, target):
    """Counts of the first two emitted tokens, i32[V * V] at first * V + second."""
    emitted = jax.vmap(emitted_tokens)(tokens, verdict)
    first = emitted[:, 0]
    # One emitted token: the next step would draw the second from p(. | first).
    fresh = jax.random.categorical(key, jnp.log(target[OFFSETS[1] + first]))
    second = jnp.where(verdict.num_accepted >= 1, emitted[:, 1], fresh)
    cells = first * VOCAB + second
    small = jnp.zeros(VOCAB * VOCAB, jnp.int32).at[cells[:N_SMALL]].add(1)
    large = jnp.zeros(VOCAB * VOCAB, jnp.int32).at[cells].add(1)
    return small, large


def _run(children, rule, temperature, filters, seed=0):
    """Histograms at N_SMALL and N_LARGE draws, and the exact target distributions."""
    keys = jax.random.split(jax.random.key(seed), 4)
    target, draft = _toy_models(keys[0], temperature, *filters)
    tokens, rows = _draw_trees(keys[1], draft, MODE_INDEX[children], n=N_LARGE)
    uniforms = jax.random.uniform(keys[2], (N_LARGE, len(TREE_PARENTS) + 1))
    verdict = _batched_rule(rule)(tokens, rows, target, draft, uniforms)
    small, large = _first_two_tokens(keys[3], tokens, verdict, target)
    small, large = np.asarray(small, np.int64), np.asarray(large, np.int64)

    target = np.asarray(target, np.float64)
    first = target[0] / target[0].sum()
    second = target[OFFSETS[1] : OFFSETS[2]]
    joint = (first[:, None] * second / second.sum(1, keepdims=True)).reshape(-1)
    marginal = lambda c: c.reshape(VOCAB, VOCAB).sum(1)  # noqa: E731
    return {
        "first": (marginal(small), marginal(large), first),
        "joint": (small, large, joint),
        "mean_accepted": float(jnp.mean(verdict.num_accepted)),
    }


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled.

    Survival function of chi2(df) at s is the regularized upper gamma Q(df / 2, s / 2).
    A count in a zero-probability cell is an outright failure (p-value 0).
    """
    n = counts.sum()
    if counts[probs == 0].any():
        return 0.0
    expected = n * probs
    big = expected >= 5
    observed = np.append(counts[big], counts[~big & (probs > 0)].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return float(gammaincc((len(observed) - 1) / 2, stat / 2))


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def _tv_noise(probs: np.ndarray, n: int) -> float:
    """Expected TV of an n-sample histogram: 0.5 * sum sqrt(2 p (1 - p) / (pi n))."""
    return 0.5 * float(np.sum(np.sqrt(2 * probs * (1 - probs) / (np.pi * n))))


FILTERS = {"off": (0, 1.0, 0.0), "on": (5, 0.9, 0.05)}


@pytest.mark.parametrize("filters", [pytest.param("off", marks=pytest.mark.slow), "on"])
@pytest.mark.parametrize(
    "temperature",
    [pytest.param(0.7, marks=pytest.mark.slow), 1.0, pytest.param(1.5, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("sampling", list(ChildSampling))
def test_output_follows_target_distribution(sampling, temperature, filters):
    result = _run(sampling, sampling, temperature, FILTERS[filters])
    assert result["mean_accepted"] > 0.3  # the tree is actually used
    for name in ("first", "joint"):
        small, large, probs = result[name]
        tv_small, tv_large = _tv(small, probs), _tv(large, probs)
        # Shrinks like 1 / sqrt(n): within 3x the expected sampling noise at both sizes,
        # which are 4x apart; a biased rule's TV stays put and fails the second bound.
        assert tv_small < 3 * _tv_noise(probs, N_SMALL), (name, tv_small)
        assert tv_large < 3 * _tv_noise(probs, N_LARGE), (name, tv_large)
        p_value = _chi_square_p_value(large, probs)
        assert p_value > 1e-3, (name, p_value)


@pytest.mark.parametrize(
    ("children", "rule"),
    [
        (TOPK, IID),  # deterministic top-k children with the min(1, p / q) rule
        (WOR, IID),  # without-replacement children with q left unchanged
    ],
)
def test_wrong_rule_is_detected(children, rule):
    result = _run(children, rule, 1.0, FILTERS["off"])
    small, large, probs = result["joint"]
    assert _tv(large, probs) > 10 * _tv_noise(probs, N_LARGE)
    assert _chi_square_p_value(large, probs) < 1e-9


def test_chi_square_survival_function():
    # chi2 with 2 dof has survival exp(-s / 2): s = 2 ln(1000) -> p = 0.001.
    assert float(gammaincc(1.0, np.log(1000.0))) == pytest.approx(1e-3, rel=1e-5)
    counts = np.array([500, 500])
    assert _chi_square_p_value(counts, np.array([0.5, 0.5])) == pytest.approx(1.0)
    assert _chi_square_p_value(np.array([400, 600]), np.array([0.5, 0.5])) < 1e-9
    assert _chi_square_p_value(np.array([999, 1]), np.array([1.0, 0.0])) == 0.0
