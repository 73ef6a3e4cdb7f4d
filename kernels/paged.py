"""The paged KV cache's storage: the pool and block table (`PagedKVCache`), how values
are stored in it (`to_stored` / `from_stored`), and its reads and writes.

The forward (`transformer.py`) reads a step's rows through `paged_rows` and writes
its K/V through `put_paged`; the host owns the block table (`blocks.BlockAllocator`).
Design notes: docs/design.md, "KV cache".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specdec.kernels.config import ModelConfig
from specdec.kernels.linear_attention import LinearState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per-layer K/V in fixed-size blocks, a block table mapping each slot's positions
    to blocks (vLLM's paged layout).

    k: jax.Array  # [L, K, num_blocks, block_size, hd]
    v: jax.Array  # [L, K, num_blocks, block_size, hd]
    table: jax.Array  # i32[slots, max_blocks]: position p of slot s lives at block
                      # table[s, p // block_size], row p % block_size

    Block 0 is the null block: every table entry a slot has not been given points
    there, so a write past a row's blocks (a padded prefill chunk, a padding row,
    tree nodes beyond the committed length) lands in it and is never read as
    valid data (attention masks it). The host owns the table
    (`runner.BlockAllocator`); a call reads only the blocks under its rows'
    `kv_len` positions, so a step costs what its rows hold, not what the pool holds.

    K/V heads come before blocks so that one K/V head's blocks gather straight into
    the [rows, positions, hd] operand its attention products read (`Layout.cache_rows`):
    with heads inside a block, a per-head read is a second, strided copy.
    """

    k: jax.Array
    v: jax.Array
    table: jax.Array
    lin: LinearState | None = None  # a hybrid model's linear-layer states (per slot)

    @property
    def num_slots(self) -> int:
        return self.table.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.block_size

    @classmethod
    def create(cls, cfg: ModelConfig, num_slots: int, max_len: int, *, block_size: int,
               num_blocks: int, dtype=jnp.float32):  # fmt: skip
        if max_len % block_size:
            raise ValueError(
                f"max_len ({max_len}) must be a multiple of block_size ({block_size})."
            )
        shape = (cfg.num_cache_layers, cfg.num_kv_heads, num_blocks, block_size)
        kd, vd = cfg.cache_dims  # MLA: its latent in k, an empty v
        table = jnp.zeros((num_slots, max_len // block_size), jnp.int32)
        lin = None
        if cfg.is_hybrid:
            state_dtype = jnp.bfloat16 if jnp.dtype(dtype) == jnp.uint16 else dtype
            lin = LinearState.create(cfg, num_slots, state_dtype)
        return cls(k=jnp.zeros((*shape, kd), dtype), v=jnp.zeros((*shape, vd), dtype),
                   table=table, lin=lin)  # fmt: skip


def to_stored(x: jax.Array, dtype) -> jax.Array:
    """K/V values as a cache of `dtype` stores them: uint16 holds bfloat16 bits
    (`xla_layout.cache_dtype`: XLA CPU updates a uint16 buffer in place)."""
    if jnp.dtype(dtype) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def from_stored(x: jax.Array) -> jax.Array:
    """Cache contents as K/V values (`to_stored`'s inverse; bfloat16 for uint16)."""
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x


def row_tables(table: jax.Array, slots: jax.Array, nb: int) -> jax.Array:
    """i32[B, nb]: the first nb blocks of each row's slot; padding rows (slot -1)
    read the null block."""
    safe = jnp.clip(slots, 0, table.shape[0] - 1)
    return jnp.where(slots[:, None] >= 0, table[safe, :nb], 0)


def paged_rows(arr, layer, blocks, kv_len, head: int | None = None) -> jax.Array:
    """A paged pool [L, K, NB, bs, hd] read as [B, K, kv_len, hd], or with `head` one
    K/V head's [B, kv_len, hd], given each row's first blocks i32[B, nb] (one gather
    of whole blocks, so it moves what a contiguous slice would; a head's gather is
    already in the layout its products read)."""
    _, k, _, bs, hd = arr.shape
    b, nb = blocks.shape
    at, size = (0, k) if head is None else (head, 1)
    part = jax.lax.dynamic_slice(arr, (layer, at, 0, 0, 0), (1, size, *arr.shape[2:]))[0]
    if head is not None:  # [B, nb, bs, hd] -> [B, nb * bs, hd]
        got = part[0].at[blocks].get(mode="promise_in_bounds")
        return got.reshape(b, nb * bs, hd)[:, :kv_len]
    g = part.at[:, blocks].get(mode="promise_in_bounds")  # [K, B, nb, bs, hd]
    return g.transpose(1, 0, 2, 3, 4).reshape(b, k, nb * bs, hd)[:, :, :kv_len]


def put_paged(cache: PagedKVCache, k_rows, v_rows, slots, starts) -> PagedKVCache:
    """`_put_rows` for a paged cache: one scatter of every row's n tokens to
    (table[slot, pos // bs], pos % bs). Padding rows and positions past a row's
    blocks write the null block. In place when the cache is donated."""
    b, n_l, k, n, _ = k_rows.shape
    bs = cache.block_size
    pos = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None]  # [B, n]
    mb = cache.table.shape[1]
    blocks = row_tables(cache.table, slots, mb)  # [B, MB]
    idx = jnp.clip(pos // bs, 0, mb - 1)
    blk = jnp.where(pos // bs < mb, jnp.take_along_axis(blocks, idx, axis=1), 0).reshape(-1)
    off = (pos % bs).reshape(-1)

    def put(pool, rows):  # rows [B, L, K, n, hd] -> values [L, K, B * n, hd]
        if pool.shape[-1] == 0:  # MLA's empty V
            return pool
        vals = rows.transpose(1, 2, 0, 3, 4).reshape(n_l, k, b * n, rows.shape[-1])
        return pool.at[:, :, blk, off].set(to_stored(vals, pool.dtype), mode="promise_in_bounds")

    return dataclasses.replace(cache, k=put(cache.k, k_rows), v=put(cache.v, v_rows))


__all__ = ["PagedKVCache", "from_stored", "paged_rows", "put_paged", "row_tables", "to_stored"]
