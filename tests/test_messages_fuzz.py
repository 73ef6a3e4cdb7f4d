"""cluster/messages.py against malformed messages: only `MessageError`, naming the field.

Every malformed message is derived from a valid one of each kind (the VALID table, packed
by the module's own encoders): keys dropped, renamed or added; values of the wrong type
(bool for int too), out of range, nested deeply; array maps with wrong dtypes, shapes or
data, or huge declared sizes; fields resized out of step with the others; slots negative,
too large or repeated; the bytes truncated. The six fuzz functions together run 5,600
of them (their max_examples); one explicit test per defect class the old codec let
through follows.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from specdec.cluster import messages as m
from specdec.draft.base import DraftBatch
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

ROUND, SLOTS, NODES, VOCAB = 3, 4, 4, 50  # the receiver's view: 4 slots, trees of 4 nodes


def fuzz(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ----------------------------------------------------------------------------- valid messages


def _sampling(rows: int, penalized: bool = False) -> dict:
    s = SamplingBatch.make_dummy(rows)
    s.temperature[0] = 0.7
    s.seed[-1] = 2**32 - 1
    if penalized:
        seen = np.zeros((rows, VOCAB), bool)
        seen[0, [3, 7]] = True
        s = dataclasses.replace(s, repetition_penalty=np.full(rows, 1.3, np.float32), seen=seen)
    return m.sampling_fields(s)


def _draft_batch(probs: bool = False) -> tuple[DraftBatch, np.ndarray]:
    batch = DraftBatch.empty(SLOTS, NODES)
    batch.tokens[1, :3] = [17, 42, 5]
    batch.parents[1, :3] = [-1, -1, 0]
    batch.tokens[3, :4] = [1, 2, 3, 4]
    batch.parents[3, :4] = [-1, 0, 1, 2]
    if probs:
        q = np.random.default_rng(0).random((SLOTS, NODES + 1, VOCAB), np.float32)
        batch.draft_probs = q / q.sum(-1, keepdims=True)
        batch.child_sampling = ChildSampling.IID
    return batch, np.array([False, True, False, True])


def _verdict() -> bytes:
    emitted = np.full((SLOTS, NODES + 1), -1, np.int32)
    emitted[1, :3] = [42, 5, 9]
    emitted[3, :1] = [8]
    num = np.array([0, 2, 0, 0], np.int32)
    accepted = np.full((SLOTS, NODES), -1, np.int32)
    accepted[1, :2] = [0, 2]
    return m.pack_verdict(ROUND, emitted, num, accepted)


INC = "4f1c0a9e" * 4
ACTIVE = np.array([True, True, False, True])
ROOTS = np.array([5, 6, 0, 7], np.int32)


def _msg(kind: str, **fields) -> tuple[str, bytes]:
    return kind, m.pack(kind, ROUND, **fields)


VALID: dict[str, tuple[str, bytes]] = {  # name -> (kind, bytes)
    "prefill": _msg(
        "prefill",
        incarnation=[INC],
        slots=np.array([1, 3], np.int32),
        prompts=[[5, 6, 7], [8]],
        reserve=[10, 12],
        **_sampling(2),
    ),
    "prefill_penalized": _msg(
        "prefill",
        incarnation=INC,
        slots=np.array([2, 0], np.int32),
        prompts=[[5], [8, 9]],
        **_sampling(2, True),
    ),
    "roots": ("roots", m.pack("roots", ROUND, roots=np.array([4, 5, 6], np.int32))),
    "restore": _msg(
        "restore", incarnation=[INC, INC], slots=[0, 2], histories=[[1, 2, 3], [4]], reserve=[5, 6]
    ),
    "verify": _msg(
        "verify",
        incarnation=INC,
        roots=ROOTS,
        active=ACTIVE,
        tree=m.pack_tree(ROUND, *_draft_batch(), {}),
        **_sampling(SLOTS),
    ),
    "verdict": ("verdict", _verdict()),
    "start": _msg(
        "start", incarnation=INC, slots=[3, 1], prompts=[[1], [2, 3]], roots=[4, 5], reserve=[1, 2]
    ),
    "propose": (
        "propose",
        m.pack(
            "propose", ROUND, incarnation=INC, active=ACTIVE, roots=ROOTS, **_sampling(SLOTS, True)
        ),
    ),
    "speculate": ("speculate", m.pack("speculate", ROUND, incarnation=INC)),
    "tree": ("tree", m.pack_tree(ROUND, *_draft_batch(), {"hits": 1, "misses": 2})),
    "tree_probs": ("tree", m.pack_tree(ROUND, *_draft_batch(probs=True), {})),
    "commit": (
        "commit",
        m.pack("commit", ROUND, incarnation=INC, active=ACTIVE, verdict=_verdict()),
    ),
    "release": ("release", m.pack("release", ROUND, incarnation=INC, slot=2)),
    "ack": ("ack", m.pack("ack", ROUND)),
    "ack_stats": ("ack", m.pack("ack", ROUND, stats={"hits": 3, "misses": 0})),
    "hello_target": (
        "hello",
        m.pack(
            "hello",
            0,
            incarnation=INC,
            pid=4242,
            rank=0,
            devices=["TFRT_CPU_0"],
            vocab_size=VOCAB,
            placement={"wq": "replicated"},
            dtype="float32",
        ),
    ),
    "hello_draft": (
        "hello",
        m.pack(
            "hello",
            0,
            incarnation=INC,
            pid=1,
            rank=1,
            devices=["a", "b"],
            max_nodes=NODES,
            can_speculate=True,
        ),
    ),
}


def decode(kind: str, data: bytes) -> None:
    """What a receiver does with a message of `kind` (cluster/actors.py, remote.py)."""
    rnd = 0 if kind == "hello" else ROUND
    if kind == "tree":
        m.unpack_tree(data, rnd, num_slots=SLOTS, max_nodes=NODES, vocab_size=VOCAB)
        return
    if kind == "verdict":
        m.unpack_verdict(data, rnd, num_slots=SLOTS)
        return
    msg = m.unpack(data, kind, rnd, num_slots=SLOTS)
    for name in ("slots", "roots", "active"):
        if isinstance(msg.get(name), dict):
            m.decode_array(msg[name], name)
    if "sampling_top_k" in msg:
        m.sampling_from(msg)


def expect_error(kind: str, data: bytes, names: tuple[str, ...]) -> None:
    """Only MessageError, and its text names one of `names` (the mutated field)."""
    try:
        decode(kind, data)
    except m.MessageError as e:
        text = str(e)
        assert any(n in text for n in names), f"{text!r} names none of {names}"
        assert len(text) < 600, text  # bounded, whatever was received
        return
    raise AssertionError(f"accepted a malformed {kind} message (expected an error on {names})")


def fields(name: str) -> dict:
    return msgpack.unpackb(VALID[name][1], raw=False)


def packed(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


# ----------------------------------------------------------------------------- field types

# The rule of each field, by kind: how to make a value that breaks it.
HEADER = {"version": "version", "kind": "kind", "round": "round"}
REQUEST = {"incarnation": "incarnation"}
SAMPLING = {f"sampling_{k}": "array" for k in m._SAMPLING}
PENALTY = {"sampling_repetition_penalty": "array", "sampling_seen": "array"}
TYPES: dict[str, dict[str, str]] = {
    "prefill": HEADER | REQUEST | SAMPLING | {"slots": "array", "prompts": "token_lists",
                                              "reserve": "ints"},
    "prefill_penalized": HEADER | REQUEST | SAMPLING | PENALTY | {"slots": "array",
                                                                  "prompts": "token_lists"},
    "roots": HEADER | {"roots": "array"},
    "restore": HEADER | REQUEST | {"slots": "ints", "histories": "token_lists", "reserve": "ints"},
    "verify": HEADER | REQUEST | SAMPLING | {"roots": "array", "active": "array", "tree": "bytes"},
    "verdict": HEADER | {"emitted": "array", "num_accepted": "array", "accepted_nodes": "array"},
    "start": HEADER | REQUEST | {"slots": "ints", "prompts": "token_lists", "roots": "ints",
                                 "reserve": "ints"},
    "propose": HEADER | REQUEST | SAMPLING | PENALTY | {"active": "array", "roots": "array"},
    "speculate": HEADER | REQUEST,
    "tree": HEADER | {"max_nodes": "max_nodes", "child_sampling": "child_sampling",
                      "rows": "rows", "stats": "stats"},
    "tree_probs": HEADER | {"max_nodes": "max_nodes", "child_sampling": "child_sampling",
                            "rows": "rows", "stats": "stats"},
    "commit": HEADER | REQUEST | {"active": "array", "verdict": "bytes"},
    "release": HEADER | REQUEST | {"slot": "slot"},
    "ack": HEADER,
    "ack_stats": HEADER | {"stats": "stats"},
    "hello_target": HEADER | {"incarnation": "text", "pid": "count", "rank": "count",
                              "devices": "texts", "vocab_size": "count", "placement": "placement",
                              "dtype": "text"},
    "hello_draft": HEADER | {"incarnation": "text", "pid": "count", "rank": "count",
                             "devices": "texts", "max_nodes": "count", "can_speculate": "bool"},
}  # fmt: skip
OPTIONAL = {  # fields a valid message may leave out
    "prefill": {"reserve"},
    "restore": {"reserve"},
    "start": {"reserve"},
    "ack_stats": {"stats"},
    "hello_target": {"vocab_size", "placement", "dtype"},
    "hello_draft": {"max_nodes", "can_speculate"},
}
# Fields whose lengths must agree (per slot or per row), by kind.
GROUPS = {
    "prefill": ("slots", "prompts", "reserve", *SAMPLING),
    "prefill_penalized": ("slots", "prompts", *SAMPLING, *PENALTY),
    "restore": ("slots", "histories", "reserve"),
    "start": ("slots", "prompts", "roots", "reserve"),
    "verify": ("roots", "active", *SAMPLING),
    "propose": ("roots", "active", *SAMPLING, *PENALTY),
    "verdict": ("emitted", "num_accepted", "accepted_nodes"),
    "commit": ("active",),
    "roots": (),
}
assert set(TYPES) == set(VALID)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.integers(-(2**63), 2**64 - 1),
)
ANY = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=3),
)
HUGE = st.one_of(st.integers(-(2**63), -1), st.integers(2**31, 2**64 - 1))
NOT_INT = ANY.filter(lambda v: type(v) is not int)
NOT_LIST = ANY.filter(lambda v: type(v) is not list)
NOT_STR = ANY.filter(lambda v: type(v) is not str)
LONG_TEXT = st.integers(257, 2000).map(lambda n: "x" * n)


@functools.cache  # building the strategies costs more than drawing from them
def bad_value(kind_name: str, field: str, rule: str) -> st.SearchStrategy:
    """Values that break `rule` for `field` of the valid message `kind_name`."""
    value = fields(kind_name)[field]
    if rule == "version":
        return ANY.filter(lambda v: not (type(v) is int and v == 1))
    if rule == "kind":
        return ANY.filter(lambda v: v != VALID[kind_name][0])
    if rule in ("round", "count", "slot", "max_nodes"):
        hi = {"slot": SLOTS}.get(rule, 2**63 if rule in ("round", "count") else 2**31)
        out = st.one_of(NOT_INT, st.just(True), st.just(False), HUGE.filter(lambda v: v >= hi),
                        st.integers(-(2**63), -1))  # fmt: skip
        if rule == "round":
            out = st.one_of(out, st.integers(0, 2**63 - 1).filter(lambda v: v != value))
        if rule == "max_nodes":  # must be the receiver's node count
            out = st.one_of(out, st.integers(0, 2**31 - 1).filter(lambda v: v != NODES))
        if field == "rank":
            out = st.one_of(out, st.integers(4096, 2**31))
        if field == "vocab_size":
            out = st.one_of(out, st.just(0))
        return out
    if rule == "bool":
        return ANY.filter(lambda v: type(v) is not bool)
    if rule in ("text", "incarnation"):
        out = st.one_of(NOT_STR, LONG_TEXT)
        if rule == "incarnation":  # a list of ids is fine; an empty or non-text one is not
            out = out.filter(
                lambda v: not (type(v) is list and v and all(type(x) is str for x in v))
            )
            out = st.one_of(out, st.just([]), st.lists(NOT_STR, min_size=1, max_size=3))
        return out
    if rule == "texts":
        return st.one_of(NOT_LIST, st.lists(st.one_of(NOT_STR, LONG_TEXT), min_size=1, max_size=3))
    if rule == "child_sampling":
        return ANY.filter(lambda v: v not in [c.value for c in ChildSampling])
    if rule == "bytes":
        return ANY.filter(lambda v: type(v) is not bytes)
    if rule == "ints":  # a list of ints in [0, 2**31) (slots: distinct, < SLOTS)
        return st.one_of(NOT_LIST, element_mutation(value, NOT_INT), element_mutation(value, HUGE))
    if rule == "token_lists":
        return st.one_of(
            NOT_LIST,
            element_mutation(value, NOT_LIST),
            st.integers(0, len(value) - 1).flatmap(
                lambda i: element_mutation(value[i], st.one_of(NOT_INT, HUGE)).map(
                    lambda row, i=i: [*value[:i], row, *value[i + 1 :]]
                )
            ),
        )
    if rule == "stats":
        return st.one_of(
            ANY.filter(lambda v: type(v) is not dict or not v.keys() <= {"hits", "misses"}),
            st.sampled_from(["hits", "misses"]).flatmap(
                lambda k: st.one_of(NOT_INT, st.integers(-(2**63), -1)).map(lambda v: {k: v})
            ),
        )
    if rule == "placement":
        return st.one_of(
            ANY.filter(
                lambda v: type(v) is not dict or any(type(x) is not str for x in v.values())
            ),
            st.one_of(NOT_STR, LONG_TEXT).map(lambda v: {"wq": v}),
        )
    if rule == "rows":
        return st.one_of(NOT_LIST, element_mutation(value, NOT_LIST))
    if rule == "array":
        return bad_array(kind_name, field)
    raise AssertionError(rule)


def element_mutation(value: list, bad: st.SearchStrategy) -> st.SearchStrategy:
    """`value` (a non-empty list) with one element replaced by a `bad` one."""
    return st.tuples(st.integers(0, len(value) - 1), bad).map(
        lambda ib: [*value[: ib[0]], ib[1], *value[ib[0] + 1 :]]
    )


@functools.cache
def bad_array(kind_name: str, name: str) -> st.SearchStrategy:
    """Array maps that break dtype, shape or data (with the field's own values kept)."""
    field = fields(kind_name)[name]
    dtype, shape, data = field["dtype"], field["shape"], field["data"]

    def with_(**kw):
        return {**field, **kw}

    bad_dims = st.one_of(
        st.lists(st.integers(0, 8), min_size=len(shape) + 1, max_size=6),  # extra dims
        st.lists(st.integers(0, 8), max_size=len(shape) - 1),  # fewer dims
        element_mutation(shape, st.one_of(NOT_INT, HUGE, st.just(True))),
        element_mutation(shape, st.integers(1, 5)).map(lambda s: [d + 1 for d in s]),  # resized
        st.just([2**31 - 1] * len(shape)),  # huge declared size, tiny data
    ).filter(lambda s: s != shape)
    out = [
        NOT_INT.filter(lambda v: type(v) is not dict),
        st.sampled_from(["dtype", "shape", "data"]).map(
            lambda k: {key: v for key, v in field.items() if key != k}
        ),
        st.just(with_(extra=1)),
        st.one_of(
            st.sampled_from(["<i4", "<f4", "<u4", "|b1", "<i8", ">i4", "<f8", "|u1", "float32"]),
            NOT_STR,
        )
        .filter(lambda d: d != dtype)
        .map(lambda d: with_(dtype=d)),
        st.one_of(NOT_LIST, bad_dims).map(lambda s: with_(shape=s)),
        st.one_of(
            st.integers(1, len(data)).map(lambda k: data[:-k]),  # short
            st.binary(min_size=1, max_size=8).map(lambda b: data + b),  # long
            NOT_INT.filter(lambda v: type(v) is not bytes),
        ).map(lambda d: with_(data=d)),
    ]
    if dtype == "|b1":  # a bool array must hold only 0 / 1 bytes
        out.append(
            st.tuples(st.integers(0, len(data) - 1), st.integers(2, 255)).map(
                lambda ib: with_(data=data[: ib[0]] + bytes([ib[1]]) + data[ib[0] + 1 :])
            )
        )
    return st.one_of(out)


def deep(depth: int) -> bytes:
    """msgpack bytes of a list nested `depth` deep (msgpack's own encoder refuses these)."""
    return b"\x91" * depth + b"\xc0"


def pack_raw(items: list[tuple[object, bytes]]) -> bytes:
    """A msgpack map from already-packed values."""
    n = len(items)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return head + b"".join(packed(k) + v for k, v in items)


# ----------------------------------------------------------------------------- fuzz

NAMES = sorted(VALID)


def check(name: str, data: bytes, names: tuple[str, ...]) -> None:
    expect_error(VALID[name][0], data, names)


@st.composite
def key_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    name = draw(st.sampled_from(NAMES))
    msg = fields(name)
    how = draw(st.sampled_from(["drop", "rename", "add"]))
    if how == "add":
        key = "zz_" + draw(st.text("abcdefghij_", min_size=1, max_size=8))
        msg[key] = draw(ANY)
        return name, packed(msg), (key,)
    keys = sorted(msg) if how == "rename" else sorted(set(msg) - OPTIONAL.get(name, set()))
    key = draw(st.sampled_from(keys))
    value = msg.pop(key)
    if how == "rename":
        msg[key + draw(st.sampled_from(["_", "s", "X", "_old"]))] = value
    return name, packed(msg), (key,)


@st.composite
def value_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    """One field given a value of the wrong type (bool for int too) or out of range."""
    name = draw(st.sampled_from(NAMES))
    msg = fields(name)
    field = draw(st.sampled_from(sorted(TYPES[name])))
    msg[field] = draw(bad_value(name, field, TYPES[name][field]))
    return name, packed(msg), (field,)


@st.composite
def array_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    """One array map given a wrong dtype, shape, data or size."""
    name = draw(st.sampled_from([n for n in NAMES if "array" in TYPES[n].values()]))
    msg = fields(name)
    field = draw(st.sampled_from(sorted(f for f, r in TYPES[name].items() if r == "array")))
    msg[field] = draw(bad_array(name, field))
    return name, packed(msg), (field,)


def _resized(value, grow: bool):
    """A list or array map one row longer (a copy of row 0) or shorter, still well-formed."""
    if isinstance(value, list):
        return [*value, value[0]] if grow else value[:-1]
    shape, data = value["shape"], value["data"]
    row = len(data) // shape[0]
    data = data + data[:row] if grow else data[:-row]
    return {**value, "shape": [shape[0] + (1 if grow else -1), *shape[1:]], "data": data}


@st.composite
def size_and_slot_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    """Fields resized out of step with the others; slots negative, too large or repeated;
    verdict counts and node indices out of range."""
    name = draw(st.sampled_from(sorted(GROUPS) + ["verdict_values", "slots"]))
    if name == "verdict_values":
        msg = fields("verdict")
        field = draw(st.sampled_from(["emitted", "num_accepted", "accepted_nodes"]))
        a = m.decode_array(msg[field], field)
        lo, hi = {"emitted": (-1, 2**31), "num_accepted": (0, NODES + 1),
                  "accepted_nodes": (-1, NODES)}[field]  # fmt: skip
        bad = st.integers(-(2**31), lo - 1) if hi == 2**31 else st.one_of(
            st.integers(-(2**31), lo - 1), st.integers(hi, 2**31 - 1))  # fmt: skip
        flat = a.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = draw(bad)
        msg[field] = m.encode_array(a)
        return "verdict", packed(msg), (field,)
    if name == "slots":
        name = draw(st.sampled_from(["prefill", "restore", "start", "release"]))
        msg = fields(name)
        if name == "release":
            msg["slot"] = draw(st.one_of(st.integers(-(2**63), -1), st.integers(SLOTS, 2**63)))
            return name, packed(msg), ("slot",)
        slots = m.decode_array(msg["slots"], "s").tolist() if name == "prefill" else msg["slots"]
        i = draw(st.integers(0, len(slots) - 1))
        slots[i] = draw(
            st.one_of(
                st.integers(-(2**31), -1),
                st.integers(SLOTS, 2**31 - 1),
                st.sampled_from([s for j, s in enumerate(slots) if j != i]),  # repeated
            )
        )
        msg["slots"] = m.encode_array(np.array(slots, np.int32)) if name == "prefill" else slots
        return name, packed(msg), ("slots",)
    msg = fields(name)
    group = GROUPS[name]
    if not group:  # roots replies carry any number of rows; only their values are checked
        roots = m.decode_array(msg["roots"], "roots")
        roots[draw(st.integers(0, roots.size - 1))] = draw(st.integers(-(2**31), -1))
        msg["roots"] = m.encode_array(roots)
        return name, packed(msg), ("roots",)
    field = draw(st.sampled_from(group))
    msg[field] = _resized(msg[field], grow=draw(st.booleans()))
    return name, packed(msg), group


@st.composite
def tree_row_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    """The rows of a tree message: slots and their TokenTree bytes."""
    name = draw(st.sampled_from(["tree", "tree_probs"]))
    msg = fields(name)
    rows = msg["rows"]
    how = draw(st.sampled_from(["slot", "repeat", "pair", "truncate", "blob", "sampling", "probs"]))
    i = draw(st.integers(1 if how == "probs" else 0, len(rows) - 1))
    if how == "slot":
        rows[i][0] = draw(st.one_of(NOT_INT, st.integers(-(2**63), -1), st.integers(SLOTS, 2**63)))
        return name, packed(msg), (f"rows[{i}][0]",)
    if how == "repeat":
        rows.append([rows[i][0], rows[i][1]])
        return name, packed(msg), (f"rows[{len(rows) - 1}][0]",)
    if how == "pair":
        rows[i] = draw(st.one_of(NOT_LIST, st.lists(ANY, max_size=4).filter(lambda r: len(r) != 2)))
        return name, packed(msg), (f"rows[{i}]",)
    blob = rows[i][1]
    if how == "truncate":
        rows[i][1] = blob[: draw(st.integers(0, len(blob) - 1))]
        return name, packed(msg), (f"rows[{i}][1]",)
    tree = msgpack.unpackb(blob, raw=False)
    if how == "blob":  # a TokenTree field broken (the tree codec's own checks)
        key = draw(st.sampled_from(["version", "sampling", "tokens", "parents"]))
        tree[key] = draw(st.one_of(NOT_LIST.filter(lambda v: v != tree[key]), st.just([-1])))
    elif how == "sampling":  # the row's sampling disagrees with the message's
        tree["sampling"] = draw(
            st.sampled_from([c.value for c in ChildSampling if c.value != tree["sampling"]])
        )
    elif tree["draft_probs"] is None:  # draft_probs on some rows only (all or none)
        n = tree["tokens"]["shape"][0]
        tree["draft_probs"] = m.encode_array(np.full((n + 1, VOCAB), 0.02, np.float32))
    else:
        tree["draft_probs"] = None
    rows[i][1] = packed(tree)
    return name, packed(msg), (f"rows[{i}][1]",)


@st.composite
def raw_mutations(draw) -> tuple[str, bytes, tuple[str, ...]]:
    """Truncated bytes, and fields (or array map entries) nested deeply."""
    name = draw(st.sampled_from(NAMES))
    data = VALID[name][1]
    if draw(st.booleans()):
        return name, data[: draw(st.integers(0, len(data) - 1))], ("msgpack",)
    msg = fields(name)
    field = draw(st.sampled_from(sorted(msg)))
    depth = draw(st.one_of(st.integers(1, 1100), st.integers(1100, 20_000)))
    items = [(k, packed(v)) for k, v in msg.items() if k != field]
    inner = msg[field]
    if isinstance(inner, dict) and inner and draw(st.booleans()):  # inside an array / stats map
        key = draw(st.sampled_from(sorted(inner)))
        value = pack_raw([(k, deep(depth) if k == key else packed(v)) for k, v in inner.items()])
    else:
        value = deep(depth)
    # Deeper than msgpack's stack (1024) fails to parse at all; shallower, the field's check.
    return name, pack_raw([*items, (field, value)]), (field, "msgpack")


# ----------------------------------------------------------------------------- valid ones


@pytest.mark.parametrize("name", NAMES)
def test_valid_messages_decode(name):
    decode(*VALID[name])


def test_valid_tree_and_verdict_decode_exactly():
    batch, active = _draft_batch(probs=True)
    got, stats = m.unpack_tree(VALID["tree_probs"][1], ROUND, num_slots=SLOTS, max_nodes=NODES,
                               vocab_size=VOCAB)  # fmt: skip
    assert stats == {}
    np.testing.assert_array_equal(got.tokens, batch.tokens)
    np.testing.assert_array_equal(got.parents, batch.parents)
    for s in np.flatnonzero(active):
        n = int((batch.parents[s] >= -1).sum())
        np.testing.assert_allclose(got.draft_probs[s, : n + 1], batch.draft_probs[s, : n + 1])
    assert not got.draft_probs[~active].any()
    emitted, num, accepted = m.unpack_verdict(VALID["verdict"][1], ROUND, num_slots=SLOTS)
    assert num.tolist() == [0, 2, 0, 0] and emitted[1, :3].tolist() == [42, 5, 9]
    assert accepted.shape == (SLOTS, NODES) and emitted.dtype == np.int32


# ----------------------------------------------------------------------------- defect classes


def _tree_with_rows(rows: list) -> bytes:
    msg = fields("tree")
    msg["rows"] = rows
    return packed(msg)


def _tree_decode(data: bytes):
    return m.unpack_tree(data, ROUND, num_slots=SLOTS, max_nodes=NODES, vocab_size=VOCAB)


BLOB = fields("tree")["rows"][0][1]


def test_negative_slot_is_refused():
    """Was: slot -1 wrote the last slot."""
    with pytest.raises(m.MessageError, match=r"field 'rows\[0\]\[0\]' must be in \[0, 4\), got -1"):
        _tree_decode(_tree_with_rows([[-1, BLOB]]))
    msg = fields("prefill")
    msg["slots"] = m.encode_array(np.array([1, -1], np.int32))
    with pytest.raises(m.MessageError, match=r"field 'slots\[1\]' must be in \[0, 4\), got -1"):
        m.unpack(packed(msg), "prefill", ROUND, num_slots=SLOTS)


def test_duplicate_slot_is_refused():
    """Was: the same slot twice overwrote the first tree."""
    with pytest.raises(
        m.MessageError, match=r"'rows\[1\]\[0\]' repeats slot 2 of 'rows\[0\]\[0\]'"
    ):
        _tree_decode(_tree_with_rows([[2, BLOB], [2, BLOB]]))
    msg = fields("restore")
    msg["slots"] = [0, 0]
    with pytest.raises(m.MessageError, match=r"'slots\[1\]' repeats slot 0"):
        m.unpack(packed(msg), "restore")


def test_version_true_is_not_version_1():
    msg = fields("ack")
    msg["version"] = True
    with pytest.raises(m.MessageError, match="field 'version' must be 1, got True"):
        m.unpack(packed(msg), "ack")


def test_decode_array_never_leaks_numpy_errors():
    """Was: shape [-2, -2] over 16 bytes passed the size check and numpy's reshape raised."""
    for field in (
        {"dtype": "<i4", "shape": [-2, -2], "data": bytes(16)},
        {"dtype": "<i4", "shape": [2.0], "data": bytes(8)},
        {"dtype": "<i4", "shape": [True, 2], "data": bytes(8)},
        {"dtype": "<i4", "shape": [2], "data": "abcdefgh"},
        {"dtype": ["<i4"], "shape": [2], "data": bytes(8)},
        {"dtype": "|b1", "shape": [2], "data": b"\x00\x07"},
        {"dtype": "<i4", "shape": [2**31 - 1] * 4, "data": bytes(8)},
    ):
        with pytest.raises(m.MessageError, match="field 'x'") as e:
            m.decode_array(field, "x")
        assert type(e.value) is m.MessageError


@pytest.mark.parametrize("depth", [10, 500, 990, 1000, 1023, 5000, 100_000])
def test_deep_nesting_is_no_recursion_error(depth):
    """Was: the error text took the repr of the whole message, nested ~1000 deep."""
    data = pack_raw([("version", deep(depth)), ("kind", packed("ack")), ("round", packed(3))])
    with pytest.raises(m.MessageError, match="version|msgpack"):
        m.unpack(data, "ack")
    items = [(k, packed(v)) for k, v in fields("tree").items() if k != "stats"]
    with pytest.raises(m.MessageError, match="stats|msgpack"):
        _tree_decode(pack_raw([*items, ("stats", deep(depth))]))
    # Inside a row's TokenTree bytes too (its own codec reprs some values).
    tree = msgpack.unpackb(BLOB, raw=False)
    blob = pack_raw([(k, deep(depth) if k == "sampling" else packed(v)) for k, v in tree.items()])
    with pytest.raises(m.MessageError, match=r"rows\[0\]\[1\]"):
        _tree_decode(_tree_with_rows([[0, blob]]))


def test_missing_key_is_named():
    """Was: KeyError."""
    msg = fields("prefill")
    del msg["prompts"]
    with pytest.raises(
        m.MessageError, match=r"prefill message: fields are wrong: missing \['prompts'\]"
    ):
        m.unpack(packed(msg), "prefill")
    msg = fields("prefill")
    del msg["sampling_top_k"]
    with pytest.raises(m.MessageError, match="field 'sampling_top_k' is missing"):
        m.sampling_from(msg)


def test_wrong_type_is_named():
    """Was: TypeError (e.g. iterating an int, or len() of one)."""
    msg = fields("release")
    msg["slot"] = "2"
    with pytest.raises(m.MessageError, match="field 'slot' must be an int, got '2'"):
        m.unpack(packed(msg), "release")
    msg = fields("tree")
    msg["rows"] = 5
    with pytest.raises(m.MessageError, match="field 'rows' must be a list"):
        _tree_decode(packed(msg))
    msg = fields("start")
    msg["prompts"] = [[1], [2, 3.0]]
    with pytest.raises(m.MessageError, match=r"field 'prompts\[1\]\[1\]' must be an int, got 3.0"):
        m.unpack(packed(msg), "start")
    with pytest.raises(m.MessageError, match="must be bytes, got 'abc'"):
        m.unpack("abc", "ack")


def test_index_out_of_range_is_named():
    """Was: IndexError (a slot past the receiver's slots)."""
    with pytest.raises(m.MessageError, match=r"field 'rows\[0\]\[0\]' must be in \[0, 4\), got 4"):
        _tree_decode(_tree_with_rows([[4, BLOB]]))
    msg = fields("release")
    msg["slot"] = 9
    with pytest.raises(m.MessageError, match=r"field 'slot' must be in \[0, 4\), got 9"):
        m.unpack(packed(msg), "release", num_slots=SLOTS)


def test_sizes_must_agree():
    msg = fields("verdict")
    msg["accepted_nodes"] = m.encode_array(np.full((SLOTS, NODES + 1), -1, np.int32))
    with pytest.raises(m.MessageError, match=r"'accepted_nodes' must have shape \[4, 4\]"):
        m.unpack_verdict(packed(msg), ROUND)
    msg = fields("prefill")
    msg["sampling_seed"] = m.encode_array(np.zeros(3, np.uint32))
    with pytest.raises(m.MessageError, match=r"'sampling_seed' must have shape \[2\]"):
        m.unpack(packed(msg), "prefill")


# How many malformed messages of each kind the fuzz draws: 5,600 in all.
FUZZ = {
    "missing_renamed_and_unknown_keys": (key_mutations, 1000),
    "wrong_types_and_ranges": (value_mutations, 1500),
    "array_dtypes_shapes_and_sizes": (array_mutations, 1000),
    "sizes_and_slots": (size_and_slot_mutations, 700),
    "tree_rows": (tree_row_mutations, 600),
    "truncated_and_deeply_nested": (raw_mutations, 800),
}


@pytest.mark.parametrize("kind", list(FUZZ))
@pytest.mark.parametrize("share", [pytest.param(1.0, marks=pytest.mark.slow), 0.2])
def test_fuzz(kind, share):
    """Every kind: a fifth of its examples in the quick subset, all of them in CI."""
    strategy, examples = FUZZ[kind]
    examples = max(1, int(examples * share))

    @fuzz(examples)
    @given(strategy())
    def run(case):
        check(*case)

    run()
