"""``TokenTree``: one sequence's draft tokens as flat arrays, plus its msgpack codec.

Vocabulary (docs/design.md): the **root** is the last committed token; each **tree node**
is one proposed token with ``parents[i]`` its parent's node index, ``-1`` for a child
of the root, and parents come before children (``parents[i] < i``).

Example, a root with two children and a grandchild under the first::

    tokens      [17, 42, 5]
    parents     [-1, -1, 0]
    depths      [1, 1, 2]
    paths()     [(1,), (0, 2)]   (one per leaf, in leaf order)
    children(-1) == (0, 1), children(0) == (2,)

``draft_probs`` is dense, f32[N + 1, V]: row 0 is the distribution q the root's
children were drawn from, row ``i + 1`` the one node i's children were drawn from
(rows of leaves are carried but never read). The stochastic acceptance rules need q at
the root and at every node with children; ``DETERMINISTIC_TOPK`` and greedy decoding
need none, so it may be ``None``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, NamedTuple

import msgpack
import numpy as np

__all__ = ["CODEC_VERSION", "ChildSampling", "PaddedTree", "TokenTree"]

CODEC_VERSION = 1
"""Version of the msgpack layout written by ``TokenTree.to_msgpack``."""

PAD_PARENT = -2
"""Parent index of a padding slot in ``TokenTree.pad_to`` (never a real node's)."""


class ChildSampling(enum.Enum):
    """How a node's children were drawn from q; it picks the stochastic acceptance rule."""

    IID = "iid"
    """I.i.d. from q, with replacement (duplicate sibling tokens allowed)."""
    WITHOUT_REPLACEMENT = "without_replacement"
    """Sequentially without replacement from q (e.g. Gumbel-top-k), in node order."""
    DETERMINISTIC_TOPK = "deterministic_topk"
    """The top-k tokens of q, chosen deterministically (EAGLE-2 tree growth)."""


class PaddedTree(NamedTuple):
    """Fixed-size arrays for a device call; slots ``>= num_nodes`` are padding."""

    tokens: np.ndarray  # i32[max_nodes], padding = 0
    parents: np.ndarray  # i32[max_nodes], padding = PAD_PARENT (-2)
    valid: np.ndarray  # bool[max_nodes], False = padding


def _frozen(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.copy()
        array.setflags(write=False)
    return array


def _int_vector(name: str, value: Any) -> np.ndarray:  # -> i32[N]
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}.")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}.")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > 2**31 - 1):
        raise ValueError(f"{name} must fit in int32, got range [{array.min()}, {array.max()}].")
    return _frozen(array.astype(np.int32, copy=False))


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTree:
    """One sequence's draft tokens; validated on construction (``ValueError``).

    Arrays are stored read-only. Equality is identity (arrays do not compare as bools);
    compare fields with ``np.array_equal``.
    """

    tokens: np.ndarray  # i32[N], token ids in [0, V)
    parents: np.ndarray  # i32[N], -1 = child of root, else parent index < own index
    draft_probs: np.ndarray | None  # f32[N + 1, V]; row 0 = root's q, row i + 1 = node i's q
    sampling: ChildSampling  # how each node's children were drawn from its q

    def __post_init__(self) -> None:
        tokens = _int_vector("tokens", self.tokens)
        parents = _int_vector("parents", self.parents)
        n = tokens.shape[0]
        if parents.shape[0] != n:
            raise ValueError(
                f"parents must have one entry per token: {parents.shape[0]} parents for {n} tokens."
            )
        if n and tokens.min() < 0:
            bad = int(np.argmax(tokens < 0))
            raise ValueError(f"tokens must be >= 0, got tokens[{bad}] = {tokens[bad]}.")
        index = np.arange(n)
        bad_parent = (parents < -1) | (parents >= index)
        if bad_parent.any():
            i = int(np.argmax(bad_parent))
            raise ValueError(
                f"parents[{i}] = {parents[i]} breaks the topological rule: a parent index "
                f"must be -1 (root) or in [0, {i}) (before its child)."
            )
        try:
            sampling = ChildSampling(self.sampling)
        except (ValueError, TypeError):
            raise ValueError(f"sampling must be a ChildSampling, got {self.sampling!r}.") from None
        if sampling is not ChildSampling.IID and n:
            # Without replacement / top-k cannot produce the same token twice under one parent.
            keys = (parents.astype(np.int64) + 1) << 32 | tokens.astype(np.int64)
            unique, counts = np.unique(keys, return_counts=True)
            if (counts > 1).any():
                dup = unique[np.argmax(counts > 1)]
                raise ValueError(
                    f"token {int(dup & 0xFFFFFFFF)} appears twice among the children of "
                    f"parent {int(dup >> 32) - 1}; only {ChildSampling.IID} children may "
                    f"repeat, got sampling={sampling}."
                )
        draft_probs = self.draft_probs
        if draft_probs is not None:
            draft_probs = np.asarray(draft_probs)
            if draft_probs.ndim != 2 or draft_probs.shape[0] != n + 1:
                raise ValueError(
                    f"draft_probs must have shape (num_nodes + 1, V) = ({n + 1}, V), got "
                    f"{draft_probs.shape}."
                )
            if not np.issubdtype(draft_probs.dtype, np.floating):
                raise ValueError(f"draft_probs must be floating, got dtype {draft_probs.dtype}.")
            draft_probs = _frozen(draft_probs.astype(np.float32))
            if n and tokens.max() >= draft_probs.shape[1]:
                i = int(np.argmax(tokens))
                raise ValueError(
                    f"tokens must be < vocab size {draft_probs.shape[1]} (draft_probs "
                    f"columns), got tokens[{i}] = {tokens[i]}."
                )
            # Leaf rows are never read, so only rows that drew children must be valid.
            has_children = np.zeros(n + 1, bool)
            has_children[parents + 1] = True
            rows = draft_probs[has_children]
            if not np.isfinite(rows).all() or (rows < 0).any():
                raise ValueError(
                    "draft_probs rows of the root and of nodes with children must be finite "
                    "and >= 0."
                )
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "draft_probs", draft_probs)
        object.__setattr__(self, "sampling", sampling)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depths(self) -> np.ndarray:  # i32[N], child of root = 1
        depths = np.zeros(self.num_nodes, np.int32)
        for i, parent in enumerate(self.parents):
            depths[i] = 1 if parent < 0 else depths[parent] + 1
        return depths

    def ancestor_mask(self) -> np.ndarray:  # bool[N, N], [i, j] = j is i or an ancestor
        n = self.num_nodes
        mask = np.zeros((n, n), bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def children(self, node: int) -> tuple[int, ...]:
        """Child node indices of ``node`` (``-1`` = root), in node order."""
        if not -1 <= node < self.num_nodes:
            raise ValueError(f"node must be -1 (root) or in [0, {self.num_nodes}), got {node}.")
        return tuple(int(i) for i in np.flatnonzero(self.parents == node))

    def paths(self) -> list[tuple[int, ...]]:
        """Root-to-leaf node index tuples, one per leaf, in leaf order (empty tree: [])."""
        is_leaf = np.ones(self.num_nodes, bool)
        is_leaf[self.parents[self.parents >= 0]] = False
        paths = []
        for leaf in np.flatnonzero(is_leaf):
            path = [int(leaf)]
            while self.parents[path[-1]] >= 0:
                path.append(int(self.parents[path[-1]]))
            paths.append(tuple(reversed(path)))
        return paths

    def pad_to(self, max_nodes: int) -> PaddedTree:
        """Tokens, parents and a valid mask padded to ``max_nodes`` slots.

        ``tokens [17, 42, 5], parents [-1, -1, 0]`` padded to 5 ->
        ``tokens [17, 42, 5, 0, 0], parents [-1, -1, 0, -2, -2], valid [1, 1, 1, 0, 0]``.
        """
        n = self.num_nodes
        if n > max_nodes:
            raise ValueError(f"tree has {n} nodes, more than max_nodes = {max_nodes}.")
        tokens = np.zeros(max_nodes, np.int32)
        parents = np.full(max_nodes, PAD_PARENT, np.int32)
        tokens[:n] = self.tokens
        parents[:n] = self.parents
        return PaddedTree(tokens, parents, np.arange(max_nodes) < n)

    def padded_draft_probs(
        self, max_nodes: int, fill: float = np.nan
    ) -> np.ndarray:  # f32[max_nodes + 1, V]
        """``draft_probs`` padded with ``fill`` rows (NaN: stray reads fail loudly)."""
        if self.draft_probs is None:
            raise ValueError("draft_probs is None; this tree carries no draft distribution.")
        if self.num_nodes > max_nodes:
            raise ValueError(f"tree has {self.num_nodes} nodes, more than max_nodes = {max_nodes}.")
        out = np.full((max_nodes + 1, self.draft_probs.shape[1]), fill, np.float32)
        out[: self.num_nodes + 1] = self.draft_probs
        return out

    # -- msgpack codec ------------------------------------------------------------------

    def to_msgpack(self) -> bytes:
        """Versioned msgpack map; arrays as raw little-endian bytes + dtype + shape."""
        message = {
            "version": CODEC_VERSION,
            "sampling": self.sampling.value,
            "tokens": _encode_array(self.tokens, "<i4"),
            "parents": _encode_array(self.parents, "<i4"),
            "draft_probs": (
                None if self.draft_probs is None else _encode_array(self.draft_probs, "<f4")
            ),
        }
        return msgpack.packb(message, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes, *, vocab_size: int, max_nodes: int) -> TokenTree:
        """Decode and validate; every defect raises ``ValueError`` naming it."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValueError(f"TokenTree message must be bytes, got {type(data).__name__}.")
        try:
            message = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
            raise ValueError(f"TokenTree message is not valid msgpack: {error!r}.") from error
        except (ValueError, TypeError, UnicodeDecodeError) as error:
            # msgpack reports truncated input as ValueError("Unpack failed: incomplete input").
            raise ValueError(f"TokenTree message is not valid msgpack: {error!r}.") from error
        if not isinstance(message, dict):
            raise ValueError(f"TokenTree message must be a map, got {type(message).__name__}.")
        if "version" not in message:
            raise ValueError("TokenTree message has no version field.")
        version = message["version"]
        if type(version) is not int or version != CODEC_VERSION:
            raise ValueError(f"TokenTree message version must be {CODEC_VERSION}, got {version!r}.")
        expected = {"version", "sampling", "tokens", "parents", "draft_probs"}
        if set(message) != expected:
            missing = sorted(expected - set(message))
            extra = sorted(map(repr, set(message) - expected))
            raise ValueError(
                f"TokenTree message fields are wrong: missing {missing}, unexpected {extra}."
            )
        try:
            sampling = ChildSampling(message["sampling"])
        except (ValueError, TypeError):
            raise ValueError(
                f"TokenTree message sampling must be one of "
                f"{[s.value for s in ChildSampling]}, got {message['sampling']!r}."
            ) from None
        tokens = _decode_array("tokens", message["tokens"], "<i4", ndim=1)
        n = tokens.shape[0]
        if n > max_nodes:
            raise ValueError(f"TokenTree message has {n} nodes, more than max_nodes = {max_nodes}.")
        parents = _decode_array("parents", message["parents"], "<i4", ndim=1)
        if parents.shape[0] != n:
            raise ValueError(
                f"TokenTree message array lengths disagree: {n} tokens, {parents.shape[0]} parents."
            )
        if n and (tokens.min() < 0 or tokens.max() >= vocab_size):
            bad = int(np.argmax((tokens < 0) | (tokens >= vocab_size)))
            raise ValueError(
                f"TokenTree message tokens[{bad}] = {tokens[bad]} is outside the vocabulary "
                f"[0, {vocab_size})."
            )
        draft_probs = None
        if message["draft_probs"] is not None:
            draft_probs = _decode_array("draft_probs", message["draft_probs"], "<f4", ndim=2)
            if draft_probs.shape != (n + 1, vocab_size):
                raise ValueError(
                    f"TokenTree message array lengths disagree: draft_probs has shape "
                    f"{draft_probs.shape}, expected (num_nodes + 1, vocab_size) = "
                    f"({n + 1}, {vocab_size})."
                )
        return cls(tokens=tokens, parents=parents, draft_probs=draft_probs, sampling=sampling)


def _encode_array(array: np.ndarray, dtype: str) -> dict[str, Any]:
    array = np.ascontiguousarray(array, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(array.shape), "data": array.tobytes()}


def _decode_array(name: str, field: Any, dtype: str, *, ndim: int) -> np.ndarray:
    if not isinstance(field, dict) or set(field) != {"dtype", "shape", "data"}:
        raise ValueError(f"TokenTree message {name} must be a map of dtype, shape and data.")
    if field["dtype"] != dtype:
        raise ValueError(
            f"TokenTree message {name} dtype must be {dtype!r}, got {field['dtype']!r}."
        )
    shape = field["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) != ndim
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ValueError(
            f"TokenTree message {name} shape must be {ndim} non-negative ints, got {shape!r}."
        )
    data = field["data"]
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) != nbytes:
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ValueError(
            f"TokenTree message {name} data must be {nbytes} bytes for shape {shape} of "
            f"{dtype}, got {size}."
        )
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
