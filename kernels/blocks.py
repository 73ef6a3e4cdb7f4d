"""Host-side bookkeeping of a paged KV cache (`paged.PagedKVCache`): which
blocks each sequence slot holds, and how many blocks a memory budget buys.

A slot takes blocks as its sequence grows (`BlockAllocator.ensure`) and gives
them all back when it ends (`free`). Block 0 is the null block, never handed
out: the table entries of positions a slot does not hold point there.

Capacity is set by bytes, not by `max_num_seqs x max_model_len`:
`num_blocks_for` turns a budget (`kv_cache_memory` bytes, else a fraction of
the device's free memory) into blocks, never more than every slot at full
length could use. The engine admits a request only while its blocks fit
(`LLMEngine._admit`), so `ensure` running out is a bug, reported as `CacheFull`.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

# vLLM's default block size: a sequence wastes under one block (15 positions) at its end.
BLOCK_SIZE = 16
# Share of the device's free memory the KV caches take when no budget is given. On a
# CPU host the "device" memory is the machine's RAM, shared with everything else
# running there, so the default there is a smaller share.
MEMORY_FRACTION = {"cpu": 0.1, "default": 0.8}


# The default budget in bytes, where set (like vLLM's VLLM_CPU_KVCACHE_SPACE).
BUDGET_ENV = "SPECDEC_KV_CACHE_MEMORY"


class CacheFull(RuntimeError):
    """A slot needed a block and none was free (the engine's admission should prevent it)."""


class BlockAllocator:
    """Blocks of a pool of `num_blocks` (block 0 = null), and each slot's block table."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"A paged cache needs at least 2 blocks (one is null), got {num_blocks}."
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.table = np.zeros((num_slots, max_blocks), np.int32)
        self.held = np.zeros(num_slots, np.int32)  # blocks each slot holds (a table prefix)
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: low ids first
        self.version = 0  # bumped on every table change (the device copy is refreshed then)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-int(positions) // self.block_size)

    def ensure(self, slot: int, positions: int) -> None:
        """Slot `slot` holds blocks for positions [0, positions) (capped at the table)."""
        want = min(self.blocks_for(positions), self.table.shape[1])
        have = int(self.held[slot])
        if want <= have:
            return
        if want - have > len(self._free):
            raise CacheFull(
                f"slot {slot} needs {want - have} more KV blocks, {len(self._free)} are free "
                f"(pool of {self.num_blocks - 1} blocks of {self.block_size} positions)."
            )
        for i in range(have, want):
            self.table[slot, i] = self._free.pop()
        self.held[slot] = want
        self.version += 1

    def free(self, slot: int) -> None:
        """Gives back every block of `slot`."""
        have = int(self.held[slot])
        if have:
            self._free.extend(self.table[slot, :have][::-1].tolist())
            self.table[slot, :have] = 0
            self.held[slot] = 0
            self.version += 1

    def bytes_held(self, token_bytes: int) -> int:
        """Cache bytes the slots' blocks hold."""
        return int(self.held.sum()) * self.block_size * token_bytes


def free_device_memory(device: jax.Device | None = None) -> int | None:
    """Bytes free on `device` (default: the first local one), or None when unknown.

    An accelerator reports its limit and what is in use; a CPU device is the host's
    RAM, read from /proc/meminfo (MemAvailable)."""
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def default_budget(device: jax.Device | None = None) -> int | None:
    """The KV bytes taken when the user sets none: $SPECDEC_KV_CACHE_MEMORY (bytes) if
    set, else a share of the free memory (`MEMORY_FRACTION`)."""
    env = os.environ.get(BUDGET_ENV)
    if env:
        try:
            return int(float(env))
        except ValueError:
            raise ValueError(f"${BUDGET_ENV} must be a number of bytes, got {env!r}.") from None
    device = device or jax.local_devices()[0]
    free = free_device_memory(device)
    if free is None:
        return None
    return int(free * MEMORY_FRACTION.get(device.platform, MEMORY_FRACTION["default"]))


def num_blocks_for(
    budget: int | None, token_bytes: int, *, num_slots: int, max_len: int,
    block_size: int = BLOCK_SIZE,
) -> int:  # fmt: skip
    """Blocks (the null block included) that `budget` bytes buy for a model whose
    token takes `token_bytes` over all layers, at most what `num_slots` slots of
    `max_len` positions can hold; None = that most. Refuses a budget too small
    for one full-length sequence: such a cache could never finish a request of
    `max_model_len` tokens."""
    per_slot = math.ceil(max_len / block_size)
    most = num_slots * per_slot + 1
    if budget is None:
        return most
    blocks = int(budget // (token_bytes * block_size))
    if blocks < per_slot + 1:
        need = (per_slot + 1) * block_size * token_bytes
        raise ValueError(
            f"kv_cache_memory={budget} bytes holds {blocks} KV blocks of {block_size} "
            f"positions; one sequence of max_model_len needs {per_slot + 1} ({need} bytes). "
            "Give the cache more memory or lower max_model_len."
        )
    return min(blocks, most)
