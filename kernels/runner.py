"""One model's runner: its params as laid out for the XLA path, its KV cache over a
fixed set of sequence slots, and the prefill into them.

`ModelRunner` owns a model's params, its KV cache, and `cache_lens[s]`: how many
committed tokens of slot s have K/V in the cache. The target worker and the
model drafter each hold one. It also owns the forward's layout (`xla_layout`):
every forward it runs, and every forward its owner runs on its params, passes
`runner.layout` explicitly.

The cache is paged (`paged.PagedKVCache`, `blocks.BlockAllocator`) on the
XLA path: a slot holds the blocks its positions need (`ensure`), so memory goes
to the tokens the running requests hold, not to `num_slots x max_len`. The
megakernel's runner (`stacked`) keeps one contiguous row per slot
(`transformer.KVCache`): its KV tiles are DMA'd from a slot's row.

Steps run over the live rows only (`row_bucket` of them, the rest padding with
slot -1), never over every slot: `live_rows`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec.kernels import paged, transformer, xla_layout
from specdec.kernels.blocks import BLOCK_SIZE, BlockAllocator, num_blocks_for
from specdec.kernels.config import ModelConfig
from specdec.kernels.paged import PagedKVCache
from specdec.kernels.transformer import KVCache, Layout, Params

# A row's planned length (prompt + max_tokens + one tree) counts toward the cache
# positions a call reads, up to this many: a request then runs one compiled
# variant instead of one per bucket it grows through (a cold compile of the
# verify step costs far more than a step), reading at most 4x the 128-position
# floor early.
KV_RESERVE_CAP = 512


class ModelRunner:
    """One model's weights, KV cache and committed lengths over a fixed set of slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        *,
        num_slots: int,
        max_len: int,  # cache positions per slot (committed tokens + one verify block)
        prefill_chunk: int = 512,
        stacked: bool = False,  # keep [L, ...] layer weights (what the megakernel streams)
        fuse: bool = False,  # one product for q|k|v and one for gate|up (`fuse_projections`)
        one_row: bool = False,  # [out, in] copies for one-row steps, where they pay
        num_blocks: int | None = None,  # paged pool size, null block included; None = all
        block_size: int = BLOCK_SIZE,
    ):
        self.cfg = cfg
        self.layout: Layout = xla_layout.for_backend(cfg)
        if stacked:
            self.params = params
        else:
            self.params, self.layout = xla_layout.arrange(cfg, params, fuse=fuse, one_row=one_row)
        self.num_slots = num_slots
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        # One spare chunk: a padded prefill chunk always fits, so writes are never clamped;
        # rounded up to the 16-row tile so a kernel may DMA any aligned window of it.
        alloc = -(-(max_len + prefill_chunk) // 16) * 16
        cache_dtype = xla_layout.cache_dtype(params["embed"].dtype, paged=not stacked)
        self.token_bytes = transformer.token_bytes(cfg, cache_dtype)
        self.blocks: BlockAllocator | None = None
        if stacked:
            self._cache = KVCache.create(cfg, num_slots, alloc, dtype=cache_dtype)
        else:
            alloc = -(-alloc // block_size) * block_size
            if num_blocks is None:  # every slot at full length
                num_blocks = num_blocks_for(None, self.token_bytes, num_slots=num_slots,
                                            max_len=max_len, block_size=block_size)  # fmt: skip
            self.blocks = BlockAllocator(num_blocks, block_size, num_slots, alloc // block_size)
            self._cache = PagedKVCache.create(cfg, num_slots, alloc, block_size=block_size,
                                              num_blocks=num_blocks, dtype=cache_dtype)  # fmt: skip
        self._table_version = 0
        self.cache_lens = np.zeros(num_slots, np.int32)
        self.reserved = np.zeros(num_slots, np.int32)  # planned lengths (`reserve`)
        self.mesh = None  # the devices it is split over, once `sharding.shard_runner` ran
        # Layers whose outputs a block drafter reads (`transformer.block_logits_kv`'s
        # taps); with any, each prefill keeps its chunks' features (`prefill_features`).
        self.taps: tuple[int, ...] = ()
        self.prefill_features: list[FeatureChunk] = []

    @property
    def cache(self):
        """The KV cache, its block table brought up to date with the host's."""
        b = self.blocks
        if b is not None and b.version != self._table_version:
            table = jnp.asarray(b.table)
            if self.mesh is not None:
                from specdec.kernels import sharding

                table = sharding.replicate(table, self.mesh)
            self._cache = dataclasses.replace(self._cache, table=table)
            self._table_version = b.version
        return self._cache

    @cache.setter
    def cache(self, value) -> None:
        self._cache = value

    def ensure(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """Slots hold cache blocks for positions [0, positions) (paged caches; a slot
        cache always holds max_len)."""
        if self.blocks is not None:
            for s, n in zip(slots, positions, strict=True):
                self.blocks.ensure(int(s), min(int(n), self.max_len))

    def slot_kv(self, slot: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot `slot`'s K and V at positions [0, length), each f32[L, K, length, hd]
        (for tests and debugging: a host copy)."""
        cache = self.cache
        if self.blocks is None:
            return tuple(np.asarray(a[:, slot, :, :length], np.float32) for a in (cache.k, cache.v))
        blocks = self.blocks.table[slot, : self.blocks.blocks_for(length)]

        def read(a):
            g = np.asarray(paged.from_stored(a[:, :, blocks]), np.float32)  # L, K, nb, bs, hd
            n_l, k, nb, bs, hd = g.shape
            return g.reshape(n_l, k, nb * bs, hd)[:, :, :length]

        return read(cache.k), read(cache.v)

    def kv_capacity(self) -> tuple[int, int, int]:
        """(positions per block, blocks sequences may hold, positions one sequence may
        hold): a slot cache is one block of max_len per slot."""
        if self.blocks is None:
            return self.max_len, self.num_slots, self.max_len
        return self.blocks.block_size, self.blocks.num_blocks - 1, self.max_len

    def release(self, slot: int) -> None:
        self.cache_lens[slot] = 0
        self.reserved[slot] = 0
        if self.blocks is not None:
            self.blocks.free(slot)

    def reserve(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Rows in `slots` will grow to about `lengths` positions (capped: KV_RESERVE_CAP)."""
        self.reserved[np.asarray(slots, np.int64)] = np.minimum(lengths, KV_RESERVE_CAP)

    def kv_len(self, rows: np.ndarray, needed: int) -> int:
        """Cache positions a call over `rows` (mask or indices) reads: the bucket of
        `needed` or of the rows' reservations, whichever is larger."""
        return kv_bucket(max(needed, int(self.reserved[rows].max(initial=0))), self.max_len)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Writes the prompts' K/V into `slots`; returns last-token logits f32[B, V].

        One prompt per call, each cut into chunks of `chunk_len` (at most
        `prefill_chunk`): the programs a prompt runs depend on its own length only,
        never on which prompts arrive together, so a handful of shapes covers every
        prompt up to `max_len` (`prefill_shapes`) and none pads to a longer neighbour.
        """
        self.prefill_features = []
        return np.stack([self._prefill_one(s, p) for s, p in zip(slots, prompts, strict=True)])

    def _prefill_one(self, slot: int, prompt: Sequence[int]) -> np.ndarray:
        n = len(prompt)
        self.ensure([slot], [n])
        chunk = chunk_len(n, self.prefill_chunk)
        toks = np.zeros((1, -(-n // chunk) * chunk), np.int32)
        toks[0, :n] = prompt
        slots = np.array([slot], np.int32)
        logits = None
        for start in range(0, toks.shape[1], chunk):
            n_in = np.array([min(chunk, n - start)], np.int32)
            logit_index = np.array([min(chunk, n - start) - 1], np.int32)
            # Attention reads the cache only below `start` (the chunk's own K/V are in
            # the block): the first chunk reads none of it.
            kv_len = kv_bucket(start, self.max_len) if start else 0
            starts = np.array([start], np.int32)
            logits, ks, vs, *feats = _prefill_chunk(
                self.params,
                self.cache,
                toks[:, start : start + chunk],
                starts,
                n_in,
                slots,
                logit_index,
                cfg=self.cfg,
                kv_len=kv_len,
                layout=self.layout,
                taps=self.taps,
            )
            if feats:
                self.prefill_features.append(FeatureChunk(slot, start, int(n_in[0]), feats[0]))
            self.cache = transformer.write_kv(self.cache, ks, vs, slots, starts, counts=n_in)
        self.cache_lens[slot] = n
        return np.asarray(logits[0])  # the prompt ends in the last chunk

    def prefill_shapes(self, max_prompt_len: int) -> list[int]:
        """Prompt lengths that, prefilled, run every program a prompt of at most
        `max_prompt_len` tokens needs: one per chunk length, then one per further
        chunk of a long prompt (each reads a longer cache)."""
        longest = {}  # chunk length -> the longest prompt in one chunk of it
        for n in range(1, min(max_prompt_len, self.prefill_chunk) + 1):
            longest[chunk_len(n, self.prefill_chunk)] = n
        return sorted(longest.values()) + list(
            range(self.prefill_chunk + 1, max_prompt_len + 1, self.prefill_chunk)
        )


class FeatureChunk(NamedTuple):
    """A prefill chunk's features at the runner's taps: slot `slot`'s positions
    [start, start + count) are `rows[0, :count]` (f32[1, C, n x D], on the device)."""

    slot: int
    start: int
    count: int
    rows: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "kv_len", "layout", "taps"))
def _prefill_chunk(params, cache, tokens, starts, n_in, slots, logit_index, *, cfg, kv_len,
                   layout, taps=()):  # fmt: skip
    """One causal chunk per row at cache offset `starts` (cache read only; not at all
    when `kv_len` is 0, the first chunk: nothing precedes it).

    Returns logits f32[B, V] at logit_index and the chunk's K/V [L, B, C, K, hd]
    (and with `taps`, the chunk's features f32[B, C, n x D]).
    """
    c = tokens.shape[1]
    positions = starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    mask = transformer.causal_block_mask(n_in, c)
    logits, ks, vs, *feats = transformer.block_logits_kv(
        params, cache if kv_len else None, tokens, positions, mask, slots, starts, logit_index,
        cfg=cfg, kv_len=kv_len or None, layout=layout, taps=taps,
    )  # fmt: skip
    return (logits[:, 0], ks, vs, *feats)


def live_rows(active: np.ndarray, num_slots: int) -> np.ndarray:
    """The slots a step runs over: the active ones, then -1 (padding) up to
    `row_bucket` rows. Example: active slots {3, 5} of 256 -> [3, 5]; {0, 1, 7}
    -> [0, 1, 7, -1]."""
    live = np.flatnonzero(np.asarray(active, bool)).astype(np.int32)
    out = np.full(row_bucket(len(live), num_slots), -1, np.int32)
    out[: len(live)] = live
    return out


def row_bucket(n: int, num_slots: int) -> int:
    """Rows a step over n live rows runs: a power of two (so a handful of programs
    covers every batch), at most num_slots, at least 1."""
    return bucket(max(n, 1), num_slots)


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most max(cap, n)."""
    p = 1
    while p < n:
        p *= 2
    return min(p, max(cap, n))


def chunk_len(n: int, cap: int, floor: int = 128, least: int = 16) -> int:
    """Prefill chunk for an n-token prompt: a power of two from `least` up to `floor`,
    then n rounded up to a quarter of its octave (steps of 32 up to 256, 64 up to
    512, ...), at most `cap`. Example: 5 -> 16, 300 -> 320, 449 -> 512, 900 -> 512
    (two chunks).

    Every chunk length is a compiled program (`ModelRunner.prefill_shapes`): twelve
    cover every prompt up to 512 tokens, while a prompt past `floor` pads by at most
    25% (rounding to multiples of 128 would pad a 258-token prompt to 384).
    """
    if n <= floor:
        return min(max(bucket(n, cap), least), cap)
    n = int(n)
    step = max(16, (1 << (n.bit_length() - 1)) // 4)
    return min(-(-n // step) * step, cap)


def kv_bucket(needed: int, max_len: int, floor: int = 128) -> int:
    """Cache positions a call reads: `needed` (at least `floor`) rounded up to a quarter
    of its octave, at most max_len. Example: 300 -> 384, 530 -> 640, 1500 -> 1536.

    Four variants per doubling keep compiles few while a call reads at most 25% (or
    the floor) past what it needs; powers of two would read 1024 positions for a
    530-token context.
    """
    n = int(max(needed, floor))  # a numpy integer has no bit_length
    step = max(floor, (1 << (n.bit_length() - 1)) // 4)  # a quarter of the octave below n
    return min(-(-n // step) * step, max_len)
