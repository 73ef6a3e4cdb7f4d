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
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from specdec.draft.base import DraftBatch
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling, TokenTree

VERSION = 1
_DTYPES = {"<i4", "<f4", "<u4", "|b1"}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "counter")


class MessageError(ValueError):
    """A message that does not decode, or answers another request."""


def encode_array(a: Any) -> dict:
    a = np.asarray(a)
    dtype = {"i": "<i4", "f": "<f4", "u": "<u4", "b": "|b1"}[a.dtype.kind]
    a = np.ascontiguousarray(a, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def decode_array(field: Any, name: str) -> np.ndarray:
    if not isinstance(field, dict) or set(field) != {"dtype", "shape", "data"}:
        raise MessageError(f"field {name!r} must be an array map of dtype, shape and data.")
    dtype, shape, data = field["dtype"], field["shape"], field["data"]
    if dtype not in _DTYPES or not isinstance(shape, list):
        raise MessageError(f"field {name!r} has dtype {dtype!r} / shape {shape!r}.")
    if len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
        raise MessageError(f"field {name!r}: {len(data)} bytes do not fill shape {shape}.")
    return np.frombuffer(data, np.dtype(dtype)).reshape(shape).copy()  # writable


def pack(kind: str, round_id: int, **fields) -> bytes:
    """One message; numpy arrays become array maps, everything else must be msgpack-able."""
    body = {
        k: encode_array(v) if isinstance(v, np.ndarray | np.generic) else v
        for k, v in fields.items()
    }
    return msgpack.packb(
        {"version": VERSION, "kind": kind, "round": int(round_id), **body}, use_bin_type=True
    )


def unpack(data: bytes, kind: str, round_id: int | None = None) -> dict:
    """Decodes a message of `kind`; with `round_id`, refuses a reply to another round."""
    try:
        msg = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MessageError(f"not a msgpack message: {e!r}") from e
    if not isinstance(msg, dict) or msg.get("version") != VERSION:
        raise MessageError(f"message version must be {VERSION}, got {msg!r:.80}.")
    if msg.get("kind") != kind:
        raise MessageError(f"expected a {kind!r} message, got {msg.get('kind')!r}.")
    if round_id is not None and msg.get("round") != round_id:
        raise MessageError(f"{kind} message is for round {msg.get('round')}, expected {round_id}.")
    return msg


# ----------------------------------------------------------------------------- sampling


def sampling_fields(s: SamplingBatch) -> dict:
    out = {f"sampling_{k}": np.asarray(getattr(s, k)) for k in _SAMPLING}
    if s.seen is not None:  # repetition penalty rows: penalties and seen-token sets
        out["sampling_repetition_penalty"] = np.asarray(s.repetition_penalty, np.float32)
        out["sampling_seen"] = np.asarray(s.seen, bool)
    return out


def sampling_from(msg: dict) -> SamplingBatch:
    arrays = {k: decode_array(msg[f"sampling_{k}"], k) for k in _SAMPLING}
    if "sampling_seen" in msg:
        arrays["seen"] = decode_array(msg["sampling_seen"], "seen")
        arrays["repetition_penalty"] = decode_array(
            msg["sampling_repetition_penalty"], "repetition_penalty"
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
    """Rebuilds the padded DraftBatch [num_slots, max_nodes]; returns it and the stats."""
    msg = unpack(data, "tree", round_id)
    if msg["max_nodes"] != max_nodes:
        raise MessageError(f"tree message pads to {msg['max_nodes']} nodes, expected {max_nodes}.")
    batch = DraftBatch.empty(num_slots, max_nodes)
    batch.child_sampling = ChildSampling(msg["child_sampling"])
    probs = None
    for slot, blob in msg["rows"]:
        tree = TokenTree.from_msgpack(blob, vocab_size=vocab_size, max_nodes=max_nodes)
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


def unpack_verdict(data: bytes, round_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    msg = unpack(data, "verdict", round_id)
    return (
        decode_array(msg["emitted"], "emitted"),
        decode_array(msg["num_accepted"], "num_accepted"),
        decode_array(msg["accepted_nodes"], "accepted_nodes"),
    )
