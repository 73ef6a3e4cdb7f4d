"""What crosses the wire between the coordinator and the worker actors: msgpack only.

Every message is one msgpack map ``{"version", "kind", "round", ...fields}``.
Arrays travel as ``{"dtype", "shape", "data"}`` (raw little-endian bytes), trees
as the `TokenTree` codec's own bytes, so no jax array and no pickle ever
crosses; the receiver rebuilds numpy arrays and pads trees to the fixed node
count N, so neither side re-traces.

Kinds (request -> reply):

    prefill  {slots, prompts, reserve, sampling}    -> roots {roots i32[B]}
    restore  {slots, histories, reserve}            -> ack
    verify   {roots i32[S], active bool[S], tree, sampling} -> verdict
    verdict  {emitted i32[S, N+1], num_accepted i32[S], accepted_nodes i32[S, N]}
    start    {slots, prompts, roots, reserve}       -> ack
    propose  {active bool[S], roots i32[S]}         -> tree
    tree     {max_nodes, child_sampling, rows: [[slot, TokenTree bytes], ...], stats}
    commit   {active bool[S], verdict fields}       -> ack
    release  {slot}                                 -> ack

`round` is the coordinator's step counter: a reply must echo the round of its
request, and a tree speculated for round t + 1 is only used by the propose of
round t + 1. `sampling` is a `SamplingBatch` as six [B] arrays. `reserve` (optional)
lists each row's planned length (`ModelRunner.reserve`).

Decoding is strict: `unpack` checks the header and then the kind's schema (`_SCHEMAS`:
exact key set, exact types -- a bool is not an int --, array dtypes and shapes, sizes
that agree across fields, distinct slots in range). Every defect raises `MessageError`
naming the field and the rule, e.g. ``prefill message: field 'slots[3]' must be in
[0, 8), got -1.``; error texts describe received values in bounded size (`_describe`),
never by the repr of a nested object. Kinds without a schema get the header checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from specdec.draft.base import DraftBatch
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling, TokenTree

VERSION = 1
_DTYPES = {"<i4", "<f4", "<u4", "|b1"}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "counter")
_SAMPLING_DTYPES = {"temperature": "<f4", "top_k": "<i4", "top_p": "<f4", "min_p": "<f4",
                    "seed": "<u4", "counter": "<i4"}  # fmt: skip
_PENALTY = ("sampling_repetition_penalty", "sampling_seen")  # both or neither
_I32 = 2**31  # token ids, slots, lengths and array dims are int32 on the device
_MAX_NDIM = 4  # no message array has more dims
_MAX_TEXT = 256  # longest string field (incarnation ids, device names, dtype names)
_MAX_HOSTS = 4096  # longest incarnation list (one id per host of a group)


class MessageError(ValueError):
    """A message that does not decode, or answers another request."""


def encode_array(a: Any) -> dict:
    a = np.asarray(a)
    dtype = {"i": "<i4", "f": "<f4", "u": "<u4", "b": "|b1"}.get(a.dtype.kind)
    if dtype is None:
        raise MessageError(f"arrays on the wire must be int, uint, float or bool, got {a.dtype}.")
    a = np.ascontiguousarray(a, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def _describe(value: Any) -> str:
    """A received value in bounded size: scalars (short strings) as themselves, containers
    by type and length; never the repr of a nested object (which can recurse ~1000 deep)."""
    if value is None or type(value) in (bool, int, float):
        return repr(value)  # msgpack ints are at most 64 bits: short
    if type(value) is str:
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    if type(value) in (bytes, bytearray):
        return f"{len(value)} bytes"
    if type(value) in (list, tuple):
        return f"a list of {len(value)}"
    if type(value) is dict:
        return f"a map of {len(value)} entries"
    return f"a {type(value).__name__}"


def _int(value: Any, name: str, lo: int = 0, hi: int = _I32) -> int:
    """`value` as an int in [lo, hi); a bool or float is refused (msgpack keeps them apart)."""
    if type(value) is not int:
        raise MessageError(f"field '{name}' must be an int, got {_describe(value)}.")
    if not lo <= value < hi:
        raise MessageError(f"field '{name}' must be in [{lo}, {hi}), got {value}.")
    return value


def _ints(value: Any, name: str, lo: int = 0, hi: int = _I32, length: int | None = None) -> list:
    """A list of ints in [lo, hi), of `length` entries when given."""
    if type(value) is not list:
        raise MessageError(f"field '{name}' must be a list of ints, got {_describe(value)}.")
    if length is not None and len(value) != length:
        raise MessageError(
            f"field '{name}' must have {length} entries (one per slot), got {len(value)}."
        )
    if not all(type(v) is int for v in value) or (
        value and not lo <= min(value) <= max(value) < hi
    ):
        for i, v in enumerate(value):
            _int(v, f"{name}[{i}]", lo, hi)
    return value


def _distinct(slots: Any, name: str, suffix: str = "") -> None:
    """Refuses a slot named twice (the second write would silently replace the first);
    slot i is field `{name}[i]{suffix}`."""
    first: dict[int, int] = {}
    for i, s in enumerate(slots):
        s = int(s)
        if s in first:
            raise MessageError(
                f"field '{name}[{i}]{suffix}' repeats slot {s} of '{name}[{first[s]}]{suffix}'; "
                "slots must be distinct."
            )
        first[s] = i


def _text(value: Any, name: str) -> str:
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise MessageError(
            f"field '{name}' must be a string of at most {_MAX_TEXT} characters, got "
            f"{_describe(value)}."
        )
    return value


def _blob(value: Any, name: str) -> bytes:
    if type(value) is not bytes:
        raise MessageError(
            f"field '{name}' must be bytes (a nested message), got {_describe(value)}."
        )
    return value


def _check_array(
    field: Any, name: str, dtype: str | None = None, shape: tuple[int | None, ...] | None = None
) -> tuple[int, ...]:
    """Checks an array map without building the array; returns its shape.

    `dtype` and `shape` (None = any size on that axis) pin them when given; the data
    length must match dtype x shape exactly, so a huge declared shape costs nothing.
    """
    if type(field) is not dict or set(field) != {"dtype", "shape", "data"}:
        raise MessageError(
            f"field '{name}' must be an array map of dtype, shape and data, got {_describe(field)}."
        )
    kind, dims, data = field["dtype"], field["shape"], field["data"]
    if type(kind) is not str or kind not in (_DTYPES if dtype is None else {dtype}):
        want = sorted(_DTYPES) if dtype is None else repr(dtype)
        raise MessageError(f"field '{name}' dtype must be {want}, got {_describe(kind)}.")
    if (
        type(dims) is not list
        or len(dims) > _MAX_NDIM
        or not all(type(d) is int and 0 <= d < _I32 for d in dims)
    ):
        raise MessageError(
            f"field '{name}' shape must be a list of at most {_MAX_NDIM} ints in [0, {_I32}), "
            f"got {_describe(dims)}."
        )
    if shape is not None and (
        len(dims) != len(shape)
        or any(w is not None and d != w for d, w in zip(dims, shape, strict=True))
    ):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise MessageError(
            f"field '{name}' must have shape {want} (to agree with the other fields), got {dims}."
        )
    nbytes = math.prod(dims) * np.dtype(kind).itemsize
    if type(data) is not bytes or len(data) != nbytes:
        got = f"{len(data)} bytes" if type(data) is bytes else _describe(data)
        raise MessageError(
            f"field '{name}' data must be {nbytes} bytes for shape {dims} of {kind}, got {got}."
        )
    if (
        kind == "|b1" and data and np.frombuffer(data, np.uint8).max() > 1
    ):  # numpy would keep e.g. 2 as a "True"
        raise MessageError(f"field '{name}' is bool: every data byte must be 0 or 1.")
    return tuple(dims)


def decode_array(
    field: Any, name: str, *, dtype: str | None = None, shape: tuple[int | None, ...] | None = None
) -> np.ndarray:
    """The numpy array of an array map, checked first (`_check_array`); writable."""
    dims = _check_array(field, name, dtype, shape)
    return np.frombuffer(field["data"], np.dtype(field["dtype"])).reshape(dims).copy()


def pack(kind: str, round_id: int, **fields) -> bytes:
    """One message; numpy arrays become array maps, everything else must be msgpack-able."""
    body = {
        k: encode_array(v) if isinstance(v, np.ndarray | np.generic) else v
        for k, v in fields.items()
    }
    return msgpack.packb(
        {"version": VERSION, "kind": kind, "round": int(round_id), **body}, use_bin_type=True
    )


def unpack(
    data: bytes, kind: str, round_id: int | None = None, *, num_slots: int | None = None
) -> dict:
    """Decodes a message of `kind`; with `round_id`, refuses a reply to another round.

    The header, then the kind's schema, are checked (`_SCHEMAS`); with `num_slots`, slot
    numbers must lie in [0, num_slots) and per-slot arrays must have num_slots rows (without
    it, in [0, 2**31) and of one length). Any defect raises `MessageError`.
    """
    if type(data) is not bytes:
        raise MessageError(f"a message must be bytes, got {_describe(data)}.")
    try:
        msg = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        # Truncated input is ValueError("Unpack failed: incomplete input"); too deep, StackError.
        raise MessageError(f"not a msgpack message: {type(e).__name__}: {str(e)[:80]}") from None
    if type(msg) is not dict:
        raise MessageError(f"a message must be a msgpack map, got {_describe(msg)}.")
    if "version" not in msg:
        raise MessageError("message has no field 'version'.")
    if type(msg["version"]) is not int or msg["version"] != VERSION:
        raise MessageError(f"field 'version' must be {VERSION}, got {_describe(msg['version'])}.")
    if msg.get("kind") != kind:
        raise MessageError(
            f"expected a {kind!r} message, got field 'kind' = {_describe(msg.get('kind'))}."
        )
    if "round" not in msg:
        raise MessageError(f"{kind} message has no field 'round'.")
    _int(msg["round"], "round", 0, 2**63)
    if round_id is not None and msg["round"] != round_id:
        raise MessageError(f"{kind} message is for round {msg['round']}, expected {round_id}.")
    schema = _SCHEMAS.get(kind)
    if schema is not None:
        try:
            schema.check_keys(msg)
            schema.check(msg, num_slots)
        except MessageError as e:
            raise MessageError(f"{kind} message: {e}") from None
    return msg


# ----------------------------------------------------------------------------- sampling


def sampling_fields(s: SamplingBatch) -> dict:
    out = {f"sampling_{k}": np.asarray(getattr(s, k)) for k in _SAMPLING}
    if s.seen is not None:  # repetition penalty rows: penalties and seen-token sets
        out["sampling_repetition_penalty"] = np.asarray(s.repetition_penalty, np.float32)
        out["sampling_seen"] = np.asarray(s.seen, bool)
    return out


def _check_sampling(msg: dict, rows: int | None) -> int:
    """Checks the sampling fields (dtypes, one length `rows`) without building arrays."""
    for k in _SAMPLING:
        key = f"sampling_{k}"
        if key not in msg:
            raise MessageError(f"field '{key}' is missing.")
        (rows,) = _check_array(msg[key], key, _SAMPLING_DTYPES[k], (rows,))
    present = [k for k in _PENALTY if k in msg]
    if present and len(present) != len(_PENALTY):
        raise MessageError(
            f"fields {list(_PENALTY)} go together (repetition penalty rows), got only {present}."
        )
    if present:
        _check_array(msg[_PENALTY[0]], _PENALTY[0], "<f4", (rows,))
        _check_array(msg[_PENALTY[1]], _PENALTY[1], "|b1", (rows, None))
    return rows


def sampling_from(msg: dict) -> SamplingBatch:
    if type(msg) is not dict:
        raise MessageError(f"sampling fields must come in a message map, got {_describe(msg)}.")
    _check_sampling(msg, None)
    arrays = {k: decode_array(msg[f"sampling_{k}"], f"sampling_{k}") for k in _SAMPLING}
    if "sampling_seen" in msg:
        arrays["seen"] = decode_array(msg["sampling_seen"], "sampling_seen")
        arrays["repetition_penalty"] = decode_array(
            msg["sampling_repetition_penalty"], "sampling_repetition_penalty"
        )
    return SamplingBatch(**arrays)


# ----------------------------------------------------------------------------- trees


def pack_tree(round_id: int, batch: DraftBatch, active: np.ndarray, stats: dict) -> bytes:
    """A DraftBatch as one `TokenTree` message per active row (real nodes only)."""
    rows = []
    batch = batch.to_host()
    probs = None if batch.draft_probs is None else np.asarray(batch.draft_probs)
    for s in np.flatnonzero(active):
        n = int((batch.parents[s] >= -1).sum())
        tree = TokenTree(
            tokens=batch.tokens[s, :n],
            parents=batch.parents[s, :n],
            draft_probs=None if probs is None else probs[s, : n + 1],
            sampling=batch.child_sampling,
        )
        rows.append([int(s), tree.to_msgpack()])
    return pack(
        "tree",
        round_id,
        max_nodes=int(batch.tokens.shape[1]),
        child_sampling=batch.child_sampling.value,
        rows=rows,
        stats=stats,
    )


def unpack_tree(
    data: bytes, round_id: int, *, num_slots: int, max_nodes: int, vocab_size: int
) -> tuple[DraftBatch, dict]:
    """Rebuilds the padded DraftBatch [num_slots, max_nodes]; returns it and the stats.

    Slots must be distinct and in [0, num_slots); every row's tree must decode
    (`TokenTree.from_msgpack`), use the message's child sampling, and carry draft_probs
    exactly when the first row does.
    """
    msg = unpack(data, "tree", round_id, num_slots=num_slots)
    if msg["max_nodes"] != max_nodes:
        raise MessageError(
            f"tree message: field 'max_nodes' is {msg['max_nodes']}: the message pads to "
            f"{msg['max_nodes']} nodes, expected {max_nodes}."
        )
    batch = DraftBatch.empty(num_slots, max_nodes)
    batch.child_sampling = ChildSampling(msg["child_sampling"])
    probs = None
    for i, (slot, blob) in enumerate(msg["rows"]):
        name = f"rows[{i}][1]"
        try:
            tree = TokenTree.from_msgpack(blob, vocab_size=vocab_size, max_nodes=max_nodes)
        except RecursionError:  # the tree codec's error text can repr a deeply nested value
            raise MessageError(f"tree message: field '{name}' nests too deeply.") from None
        except ValueError as e:
            # (its text can quote a received value at full length: cut it short)
            raise MessageError(
                f"tree message: field '{name}' (slot {slot}): {str(e)[:240]}"
            ) from None
        if tree.sampling is not batch.child_sampling:
            raise MessageError(
                f"tree message: field '{name}' has sampling {tree.sampling.value!r}, but field "
                f"'child_sampling' is {batch.child_sampling.value!r}."
            )
        if i > 0 and (tree.draft_probs is None) != (probs is None):
            raise MessageError(
                f"tree message: field '{name}' must carry draft_probs exactly when "
                "'rows[0][1]' does."
            )
        padded = tree.pad_to(max_nodes)
        batch.tokens[slot] = padded.tokens
        batch.parents[slot] = padded.parents
        if tree.draft_probs is not None:
            if probs is None:
                probs = np.zeros((num_slots, max_nodes + 1, vocab_size), np.float32)
            probs[slot] = tree.padded_draft_probs(max_nodes, fill=0.0)
    batch.draft_probs = probs
    return batch, msg["stats"]


# ----------------------------------------------------------------------------- verdicts


def pack_verdict(round_id: int, emitted, num_accepted, accepted_nodes) -> bytes:
    return pack(
        "verdict",
        round_id,
        emitted=np.asarray(emitted, np.int32),
        num_accepted=np.asarray(num_accepted, np.int32),
        accepted_nodes=np.asarray(accepted_nodes, np.int32),
    )


def unpack_verdict(
    data: bytes, round_id: int, *, num_slots: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """emitted i32[S, N+1], num_accepted i32[S], accepted_nodes i32[S, N] (see `_verdict`)."""
    msg = unpack(data, "verdict", round_id, num_slots=num_slots)
    return (
        decode_array(msg["emitted"], "emitted"),
        decode_array(msg["num_accepted"], "num_accepted"),
        decode_array(msg["accepted_nodes"], "accepted_nodes"),
    )


# ----------------------------------------------------------------------------- schemas


@dataclasses.dataclass(frozen=True)
class _Schema:
    """One kind's fields: the exact key set, and the checks of their values."""

    required: frozenset[str]  # besides version, kind and round
    optional: frozenset[str]
    check: Callable[[dict, int | None], None]  # (message, num_slots or None)

    def check_keys(self, msg: dict) -> None:
        allowed = self.required | self.optional | {"version", "kind", "round"}
        missing = sorted(self.required - msg.keys())
        extra = [k for k in msg if k not in allowed]
        if missing or extra:
            shown = ", ".join(_describe(k) for k in extra[:5]) + (", ..." if len(extra) > 5 else "")
            raise MessageError(f"fields are wrong: missing {missing}, unexpected [{shown}].")


def _slot_hi(num_slots: int | None) -> int:
    return _I32 if num_slots is None else num_slots


def _rows(n: int, name: str, num_slots: int | None) -> None:
    if num_slots is not None and n != num_slots:
        raise MessageError(f"field '{name}' must have {num_slots} rows (one per slot), got {n}.")


def _slot_array(field: Any, name: str, num_slots: int | None) -> np.ndarray:  # i32[B]
    slots = decode_array(field, name, dtype="<i4", shape=(None,))
    hi = _slot_hi(num_slots)
    bad = (slots < 0) | (slots >= hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise MessageError(f"field '{name}[{i}]' must be in [0, {hi}), got {slots[i]}.")
    _distinct(slots.tolist(), name)
    return slots


def _slot_list(value: Any, name: str, num_slots: int | None) -> list:
    slots = _ints(value, name, 0, _slot_hi(num_slots))
    _distinct(slots, name)
    return slots


def _token_lists(value: Any, name: str, rows: int, *, nonempty: bool = False) -> None:
    """One list of token ids per row (prompts, histories)."""
    if type(value) is not list or len(value) != rows:
        raise MessageError(
            f"field '{name}' must be a list of {rows} token lists (one per slot), got "
            f"{_describe(value)}."
        )
    for i, tokens in enumerate(value):
        _ints(tokens, f"{name}[{i}]")
        if nonempty and not tokens:
            raise MessageError(f"field '{name}[{i}]' must hold at least one token (the root).")


def _reserve(msg: dict, rows: int) -> None:
    if "reserve" not in msg:  # optional: no planned lengths
        return
    value = msg["reserve"]
    if type(value) is not list or len(value) != rows:
        raise MessageError(
            f"field 'reserve' must be a list of {rows} lengths (one per slot), got "
            f"{_describe(value)}."
        )
    _ints(value, "reserve")


def _incarnation(msg: dict) -> None:
    value = msg["incarnation"]
    if type(value) is list:  # one per host of the group, by rank
        if not 1 <= len(value) <= _MAX_HOSTS:
            raise MessageError(
                f"field 'incarnation' must list 1 to {_MAX_HOSTS} ids, got {len(value)}."
            )
        for i, v in enumerate(value):
            _text(v, f"incarnation[{i}]")
    else:
        _text(value, "incarnation")


def _stats(value: Any, name: str = "stats") -> None:
    """The draft's running overlap counts: a map of 'hits' and / or 'misses' to ints."""
    if type(value) is not dict or not value.keys() <= {"hits", "misses"}:
        raise MessageError(
            f"field '{name}' must be a map of 'hits' / 'misses' counts, got {_describe(value)}"
            + (
                f" with keys {[_describe(k) for k in list(value)[:4]]}."
                if type(value) is dict
                else "."
            )
        )
    for k, v in value.items():
        _int(v, f"{name}.{k}", 0, 2**63)


def _prefill(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    slots = _slot_array(msg["slots"], "slots", num_slots)
    _token_lists(msg["prompts"], "prompts", len(slots))
    _reserve(msg, len(slots))
    _check_sampling(msg, len(slots))


def _restore(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    slots = _slot_list(msg["slots"], "slots", num_slots)
    _token_lists(msg["histories"], "histories", len(slots), nonempty=True)
    _reserve(msg, len(slots))


def _start(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    slots = _slot_list(msg["slots"], "slots", num_slots)
    _token_lists(msg["prompts"], "prompts", len(slots))
    _ints(msg["roots"], "roots", length=len(slots))
    _reserve(msg, len(slots))


def _roots_and_active(msg: dict, num_slots: int | None) -> int:
    roots = decode_array(msg["roots"], "roots", dtype="<i4", shape=(None,))
    _rows(len(roots), "roots", num_slots)
    if (roots < 0).any():
        i = int(np.argmax(roots < 0))
        raise MessageError(f"field 'roots[{i}]' must be a token id >= 0, got {roots[i]}.")
    _check_array(msg["active"], "active", "|b1", (len(roots),))
    return len(roots)


def _verify(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    rows = _roots_and_active(msg, num_slots)
    _blob(msg["tree"], "tree")
    _check_sampling(msg, rows)


def _propose(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    _check_sampling(msg, _roots_and_active(msg, num_slots))


def _commit(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    (rows,) = _check_array(msg["active"], "active", "|b1", (None,))
    _rows(rows, "active", num_slots)
    _blob(msg["verdict"], "verdict")


def _release(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)
    _int(msg["slot"], "slot", 0, _slot_hi(num_slots))


def _speculate(msg: dict, num_slots: int | None) -> None:
    _incarnation(msg)


def _roots(msg: dict, num_slots: int | None) -> None:
    roots = decode_array(msg["roots"], "roots", dtype="<i4", shape=(None,))
    if (roots < 0).any():
        i = int(np.argmax(roots < 0))
        raise MessageError(f"field 'roots[{i}]' must be a token id >= 0, got {roots[i]}.")


def _verdict(msg: dict, num_slots: int | None) -> None:
    """emitted i32[S, N+1] (accepted tokens, bonus, then -1), num_accepted i32[S] in
    [0, N], accepted_nodes i32[S, N] in [-1, N) (-1 padded)."""
    emitted = decode_array(msg["emitted"], "emitted", dtype="<i4", shape=(None, None))
    rows, width = emitted.shape
    _rows(rows, "emitted", num_slots)
    if width < 1:
        raise MessageError("field 'emitted' must have N + 1 >= 1 columns (the bonus), got 0.")
    num = decode_array(msg["num_accepted"], "num_accepted", dtype="<i4", shape=(rows,))
    nodes = decode_array(
        msg["accepted_nodes"], "accepted_nodes", dtype="<i4", shape=(rows, width - 1)
    )
    for name, a, lo, hi in (
        ("emitted", emitted, -1, _I32),
        ("num_accepted", num, 0, width),
        ("accepted_nodes", nodes, -1, width - 1),
    ):
        bad = (a < lo) | (a >= hi)
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), a.shape)
            index = ", ".join(map(str, at))
            raise MessageError(f"field '{name}[{index}]' must be in [{lo}, {hi}), got {a[at]}.")


def _tree(msg: dict, num_slots: int | None) -> None:
    _int(msg["max_nodes"], "max_nodes")
    value = msg["child_sampling"]
    if type(value) is not str or value not in {c.value for c in ChildSampling}:
        raise MessageError(
            f"field 'child_sampling' must be one of {[c.value for c in ChildSampling]}, got "
            f"{_describe(value)}."
        )
    rows = msg["rows"]
    if type(rows) is not list:
        raise MessageError(
            f"field 'rows' must be a list of [slot, tree] pairs, got {_describe(rows)}."
        )
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != 2:
            raise MessageError(
                f"field 'rows[{i}]' must be a [slot, tree] pair, got {_describe(row)}."
            )
        _int(row[0], f"rows[{i}][0]", 0, _slot_hi(num_slots))
        _blob(row[1], f"rows[{i}][1]")
    _distinct([row[0] for row in rows], "rows", "[0]")
    _stats(msg["stats"])


def _ack(msg: dict, num_slots: int | None) -> None:
    if "stats" in msg:
        _stats(msg["stats"])


def _hello(msg: dict, num_slots: int | None) -> None:
    _text(msg["incarnation"], "incarnation")
    _int(msg["pid"], "pid", 0, 2**63)
    _int(msg["rank"], "rank", 0, _MAX_HOSTS)
    devices = msg["devices"]
    if type(devices) is not list:
        raise MessageError(f"field 'devices' must be a list of names, got {_describe(devices)}.")
    for i, d in enumerate(devices):
        _text(d, f"devices[{i}]")
    if "vocab_size" in msg:
        _int(msg["vocab_size"], "vocab_size", 1)
    if "max_nodes" in msg:
        _int(msg["max_nodes"], "max_nodes")
    if "dtype" in msg:
        _text(msg["dtype"], "dtype")
    if "kernel" in msg and msg["kernel"] not in ("megakernel", "xla"):
        raise MessageError(
            f"field 'kernel' must be 'megakernel' or 'xla', got {_describe(msg['kernel'])}."
        )
    if "can_speculate" in msg and type(msg["can_speculate"]) is not bool:
        raise MessageError(
            f"field 'can_speculate' must be a bool, got {_describe(msg['can_speculate'])}."
        )
    cap = msg.get("kv_capacity")
    if cap is not None:  # (block size, blocks, positions per sequence); None: no cache
        if type(cap) is not list or len(cap) != 3:
            raise MessageError(
                f"field 'kv_capacity' must be a list of 3 ints, got {_describe(cap)}."
            )
        for i, v in enumerate(cap):
            _int(v, f"kv_capacity[{i}]", 1)
    if "placement" in msg:
        placement = msg["placement"]
        if type(placement) is not dict:
            raise MessageError(f"field 'placement' must be a map, got {_describe(placement)}.")
        for k, v in placement.items():
            _text(k, "placement (a key)")
            _text(v, f"placement.{k}")


_REQUEST = frozenset({"incarnation"})
_SAMPLING_FIELDS = frozenset(f"sampling_{k}" for k in _SAMPLING)
_SCHEMAS: dict[str, _Schema] = {
    "hello": _Schema(
        frozenset({"incarnation", "pid", "rank", "devices"}),
        frozenset(
            {
                "vocab_size",
                "placement",
                "dtype",
                "kernel",
                "max_nodes",
                "can_speculate",
                "kv_capacity",
            }
        ),
        _hello,
    ),
    "prefill": _Schema(
        _REQUEST | {"slots", "prompts"} | _SAMPLING_FIELDS,
        frozenset({"reserve", *_PENALTY}),
        _prefill,
    ),
    "roots": _Schema(frozenset({"roots"}), frozenset(), _roots),
    "restore": _Schema(_REQUEST | {"slots", "histories"}, frozenset({"reserve"}), _restore),
    "verify": _Schema(
        _REQUEST | {"roots", "active", "tree"} | _SAMPLING_FIELDS, frozenset(_PENALTY), _verify
    ),
    "verdict": _Schema(
        frozenset({"emitted", "num_accepted", "accepted_nodes"}), frozenset(), _verdict
    ),
    "start": _Schema(_REQUEST | {"slots", "prompts", "roots"}, frozenset({"reserve"}), _start),
    "propose": _Schema(
        _REQUEST | {"roots", "active"} | _SAMPLING_FIELDS, frozenset(_PENALTY), _propose
    ),
    "speculate": _Schema(_REQUEST, frozenset(), _speculate),
    "tree": _Schema(
        frozenset({"max_nodes", "child_sampling", "rows", "stats"}), frozenset(), _tree
    ),
    "commit": _Schema(_REQUEST | {"active", "verdict"}, frozenset(), _commit),
    "release": _Schema(_REQUEST | {"slot"}, frozenset(), _release),
    "ack": _Schema(frozenset(), frozenset({"stats"}), _ack),
}
