"""TokenTree structure, validation and msgpack codec; tree masks and depths."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings

from specdec.verify import masks
from specdec.verify.tree import CODEC_VERSION, ChildSampling, TokenTree

VOCAB = 50


def _tree(
    tokens=(17, 42, 5, 9),
    parents=(-1, -1, 0, 2),
    sampling=ChildSampling.WITHOUT_REPLACEMENT,
    with_probs=True,
) -> TokenTree:
    n = len(tokens)
    probs = None
    if with_probs:
        probs = np.random.default_rng(0).dirichlet(np.ones(VOCAB), n + 1).astype(np.float32)
    return TokenTree(tokens=tokens, parents=parents, draft_probs=probs, sampling=sampling)


@st.composite
def trees(draw, max_nodes: int = 12) -> TokenTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    sampling = draw(st.sampled_from(list(ChildSampling)))
    if sampling is ChildSampling.IID:
        tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
    else:  # distinct tokens overall, so siblings never repeat
        tokens = draw(st.permutations(range(VOCAB)))[:n]
    probs = None
    if draw(st.booleans()):
        probs = np.random.default_rng(n).random((n + 1, VOCAB), dtype=np.float32)
    return TokenTree(tokens=tokens, parents=parents, draft_probs=probs, sampling=sampling)


# -- structure -------------------------------------------------------------------------


def test_structure_by_hand():
    # root -> 0 (17), 1 (42); 0 -> 2 (5); 2 -> 3 (9): depths 1, 1, 2, 3.
    tree = _tree()
    assert tree.num_nodes == 4
    np.testing.assert_array_equal(tree.depths, [1, 1, 2, 3])
    np.testing.assert_array_equal(
        tree.ancestor_mask().astype(int),
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
    )
    assert tree.paths() == [(1,), (0, 2, 3)]
    assert tree.children(-1) == (0, 1)
    assert tree.children(0) == (2,)
    assert tree.children(3) == ()
    with pytest.raises(ValueError, match="node must be -1"):
        tree.children(4)


def test_arrays_are_read_only_and_dtypes_fixed():
    tree = _tree()
    assert tree.tokens.dtype == np.int32 and tree.parents.dtype == np.int32
    assert tree.draft_probs.dtype == np.float32
    with pytest.raises(ValueError):
        tree.tokens[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.tokens = np.zeros(4, np.int32)


def test_caller_array_is_not_frozen():
    tokens = np.array([1, 2], np.int32)
    TokenTree(tokens=tokens, parents=[-1, 0], draft_probs=None, sampling=ChildSampling.IID)
    tokens[0] = 3  # still writeable: the tree took a copy


def test_empty_tree():
    tree = TokenTree(tokens=[], parents=[], draft_probs=None, sampling=ChildSampling.IID)
    assert tree.num_nodes == 0 and tree.paths() == [] and tree.children(-1) == ()
    assert tree.ancestor_mask().shape == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"parents": (-1, -1, 2, 2)}, r"parents\[2\] = 2 breaks the topological rule"),
        ({"parents": (-1, -1, 5, 2)}, r"parents\[2\] = 5 breaks the topological rule"),
        ({"parents": (-1, -2, 0, 2)}, r"parents\[1\] = -2 breaks the topological rule"),
        ({"parents": (-1, -1, 0)}, "3 parents for 4 tokens"),
        ({"tokens": (17, -4, 5, 9)}, r"tokens must be >= 0, got tokens\[1\] = -4"),
        ({"tokens": (17, 42, 5, VOCAB)}, rf"tokens must be < vocab size {VOCAB}"),
        ({"tokens": ((1, 2), (3, 4))}, "tokens must be 1-D"),
        ({"tokens": (1.5, 2.0, 3.0, 4.0)}, "tokens must hold integers"),
        ({"tokens": (2**40, 1, 2, 3)}, "tokens must fit in int32"),
        ({"tokens": (17, 17, 5, 9)}, "token 17 appears twice among the children of parent -1"),
        ({"sampling": "beam"}, "sampling must be a ChildSampling"),
    ],
)
def test_validation_names_the_defect(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _tree(**kwargs)


def test_duplicate_siblings_allowed_only_for_iid():
    _tree(tokens=(17, 17, 5, 9), sampling=ChildSampling.IID)
    with pytest.raises(ValueError, match="appears twice"):
        _tree(tokens=(17, 17, 5, 9), sampling=ChildSampling.DETERMINISTIC_TOPK)
    # The same token under different parents is fine.
    _tree(tokens=(17, 42, 17, 17), sampling=ChildSampling.DETERMINISTIC_TOPK)


def test_draft_probs_validation():
    good = np.full((5, VOCAB), 1.0 / VOCAB, np.float32)
    make = lambda probs: TokenTree(  # noqa: E731
        tokens=(17, 42, 5, 9), parents=(-1, -1, 0, 2), draft_probs=probs, sampling="iid"
    )
    with pytest.raises(ValueError, match=r"shape \(num_nodes \+ 1, V\) = \(5, V\)"):
        make(good[:4])
    with pytest.raises(ValueError, match="must be floating"):
        make(good.astype(np.int32))
    bad = good.copy()
    bad[3, 0] = np.nan  # node 2 has a child, so its row is read
    with pytest.raises(ValueError, match="finite and >= 0"):
        make(bad)
    bad = good.copy()
    bad[4] = np.nan  # node 3 is a leaf: its row is never read
    assert make(bad).sampling is ChildSampling.IID


# -- padding and masks -----------------------------------------------------------------


def test_pad_to():
    tree = _tree()
    padded = tree.pad_to(6)
    np.testing.assert_array_equal(padded.tokens, [17, 42, 5, 9, 0, 0])
    np.testing.assert_array_equal(padded.parents, [-1, -1, 0, 2, -2, -2])
    np.testing.assert_array_equal(padded.valid, [1, 1, 1, 1, 0, 0])
    probs = tree.padded_draft_probs(6)
    assert probs.shape == (7, VOCAB) and np.isnan(probs[5:]).all()
    np.testing.assert_array_equal(probs[:5], tree.draft_probs)
    with pytest.raises(ValueError, match="tree has 4 nodes, more than max_nodes = 3"):
        tree.pad_to(3)
    with pytest.raises(ValueError, match="draft_probs is None"):
        _tree(with_probs=False).padded_draft_probs(6)


def test_masks_worked_example():
    # parents [-1, -1, 0, 2]: 0 and 1 hang from the root, 2 from 0, 3 from 2.
    parents = jnp.array([-1, -1, 0, 2])
    np.testing.assert_array_equal(masks.depths(parents), [1, 1, 2, 3])
    np.testing.assert_array_equal(
        masks.ancestor_mask(parents).astype(int),
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
    )


def test_masks_padding_and_valid():
    # Slot 2 is padding by parent -2, slot 3 by the valid mask; node 4 hangs from 1.
    parents = jnp.array([-1, 0, -2, 1, 1])
    valid = jnp.array([True, True, True, False, True])
    mask = masks.ancestor_mask(parents, valid)
    np.testing.assert_array_equal(
        mask.astype(int),
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],  # padding attends to itself only
            [0, 0, 0, 1, 0],
            [1, 1, 0, 0, 1],
        ],
    )
    np.testing.assert_array_equal(masks.depths(parents, valid), [1, 2, 0, 0, 3])


PAD = 16
_jit_mask = jax.jit(masks.ancestor_mask)
_jit_depths = jax.jit(masks.depths)


@settings(max_examples=30, deadline=None)
@given(trees(max_nodes=12))
def test_masks_match_tree(tree):
    # One padded size, so each jitted function compiles once.
    padded = tree.pad_to(PAD)
    n = tree.num_nodes
    mask = np.asarray(_jit_mask(padded.parents))
    np.testing.assert_array_equal(mask[:n, :n], tree.ancestor_mask())
    np.testing.assert_array_equal(mask[n:], np.eye(PAD, dtype=bool)[n:])
    np.testing.assert_array_equal(mask[:n, n:], False)
    depths = np.asarray(_jit_depths(padded.parents))
    np.testing.assert_array_equal(depths[:n], tree.depths)
    np.testing.assert_array_equal(depths[n:], 0)
    # Every node lies on a path, every path is a parent chain ending in a leaf.
    on_path = {node for path in tree.paths() for node in path}
    assert on_path == set(range(n))
    for path in tree.paths():
        assert tree.parents[path[0]] == -1 and tree.children(path[-1]) == ()
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:], strict=False))


def test_masks_batched_under_jit():
    parents = jnp.array([[-1, 0, 1, -2], [-1, -1, 1, 2]])
    fn = jax.jit(masks.ancestor_mask)
    batched = fn(parents)
    for row in range(2):
        np.testing.assert_array_equal(batched[row], masks.ancestor_mask(parents[row]))
    np.testing.assert_array_equal(jax.jit(masks.depths)(parents), [[1, 2, 3, 0], [1, 1, 2, 3]])


# -- codec -----------------------------------------------------------------------------


def _assert_same(a: TokenTree, b: TokenTree) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.parents, b.parents)
    assert (a.draft_probs is None) == (b.draft_probs is None)
    if a.draft_probs is not None:
        np.testing.assert_array_equal(a.draft_probs, b.draft_probs)
    assert a.sampling is b.sampling


@pytest.mark.parametrize("sampling", list(ChildSampling))
@pytest.mark.parametrize("with_probs", [True, False])
def test_round_trip(sampling, with_probs):
    tree = _tree(sampling=sampling, with_probs=with_probs)
    _assert_same(tree, TokenTree.from_msgpack(tree.to_msgpack(), vocab_size=VOCAB, max_nodes=4))


@settings(max_examples=30, deadline=None)
@given(trees())
def test_round_trip_random(tree):
    data = tree.to_msgpack()
    _assert_same(tree, TokenTree.from_msgpack(data, vocab_size=VOCAB, max_nodes=12))


def test_arrays_travel_as_little_endian_bytes():
    message = msgpack.unpackb(_tree().to_msgpack())
    assert message["version"] == CODEC_VERSION
    assert message["tokens"] == {
        "dtype": "<i4",
        "shape": [4],
        "data": np.array([17, 42, 5, 9], "<i4").tobytes(),
    }
    assert message["draft_probs"]["dtype"] == "<f4"


def _mutated(change) -> bytes:
    """A valid message of ``_tree()`` with ``change(message_dict)`` applied."""
    message = msgpack.unpackb(_tree().to_msgpack())
    change(message)
    return msgpack.packb(message, use_bin_type=True)


def _array(values, dtype="<i4") -> dict:
    array = np.asarray(values, dtype)
    return {"dtype": dtype, "shape": list(array.shape), "data": array.tobytes()}


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


VALID = _tree().to_msgpack()
MALFORMED = {
    "wrong version": (_mutated(_set("version", 2)), "version must be 1, got 2"),
    "bool version": (_mutated(_set("version", True)), "version must be 1, got True"),
    "missing version": (_mutated(lambda m: m.pop("version")), "has no version field"),
    "parent >= own index": (
        _mutated(_set("parents", _array([-1, -1, 0, 3]))),
        r"parents\[3\] = 3 breaks the topological rule",
    ),
    "parent < -1": (
        _mutated(_set("parents", _array([-1, -3, 0, 2]))),
        r"parents\[1\] = -3 breaks the topological rule",
    ),
    "token >= vocab_size": (
        _mutated(_set("tokens", _array([17, 42, VOCAB, 9]))),
        rf"tokens\[2\] = {VOCAB} is outside the vocabulary \[0, {VOCAB}\)",
    ),
    "negative token": (
        _mutated(_set("tokens", _array([17, -1, 5, 9]))),
        r"tokens\[1\] = -1 is outside the vocabulary",
    ),
    "truncated": (VALID[:-7], "not valid msgpack"),
    "garbage": (b"\xc1\x00garbage", "not valid msgpack"),
    "trailing bytes": (VALID + b"\x00", "not valid msgpack"),
    "empty": (b"", "not valid msgpack"),
    "not a map": (msgpack.packb([1, 2, 3]), "must be a map, got list"),
    "lengths disagree": (
        _mutated(_set("parents", _array([-1, -1, 0]))),
        "array lengths disagree: 4 tokens, 3 parents",
    ),
    "draft_probs rows disagree": (
        _mutated(_set("draft_probs", _array(np.ones((4, VOCAB)), "<f4"))),
        r"array lengths disagree: draft_probs has shape \(4, 50\)",
    ),
    "draft_probs vocab disagrees": (
        _mutated(_set("draft_probs", _array(np.ones((5, VOCAB + 1)), "<f4"))),
        r"array lengths disagree: draft_probs has shape \(5, 51\)",
    ),
    "data shorter than shape": (
        _mutated(lambda m: m["tokens"].__setitem__("data", m["tokens"]["data"][:-4])),
        "tokens data must be 16 bytes for shape",
    ),
    "wrong dtype": (_mutated(_set("tokens", _array([17, 42, 5, 9], "<i8"))), "dtype must be"),
    "big-endian dtype": (
        _mutated(_set("tokens", _array([17, 42, 5, 9], ">i4"))),
        "dtype must be '<i4', got '>i4'",
    ),
    "bad shape": (
        _mutated(lambda m: m["tokens"].__setitem__("shape", [-4])),
        "tokens shape must be 1 non-negative ints",
    ),
    "array not a map": (_mutated(_set("tokens", [17, 42, 5, 9])), "tokens must be a map"),
    "unknown sampling": (_mutated(_set("sampling", "beam")), "sampling must be one of"),
    "missing field": (_mutated(lambda m: m.pop("parents")), r"missing \['parents'\]"),
    "unexpected field": (_mutated(_set("extra", 1)), r"unexpected \[\"'extra'\"\]"),
}


@pytest.mark.parametrize("defect", list(MALFORMED))
def test_malformed_message_names_the_defect(defect):
    data, message = MALFORMED[defect]
    with pytest.raises(ValueError, match=message):
        TokenTree.from_msgpack(data, vocab_size=VOCAB, max_nodes=8)


def test_too_many_nodes():
    with pytest.raises(ValueError, match="has 4 nodes, more than max_nodes = 3"):
        TokenTree.from_msgpack(VALID, vocab_size=VOCAB, max_nodes=3)


def test_non_bytes_message():
    with pytest.raises(ValueError, match="must be bytes, got str"):
        TokenTree.from_msgpack("hello", vocab_size=VOCAB, max_nodes=8)
