"""Tensor-parallel placement of a model's params and KV cache over a `jax.sharding.Mesh`.

One mesh axis, `"tp"`, over the devices of a worker's group. Every weight is
either split along the one axis that tensor parallelism cuts, or replicated;
jit (GSPMD) then partitions `forward_block`, `verify_step` and the drafter's
tree growth unchanged, inserting the collectives itself. The cuts (Megatron's):

    what                  cut axis                       only if
    embed  [V, D]         V (vocab rows)                 V % tp == 0
    lm_head [D, V]        V (vocab columns)              V % tp == 0
    wq [.., D, H*hd]      output (whole heads)           H % tp == 0
    wk, wv [.., D, K*hd]  output (whole K/V heads)       K % tp == 0
    bq / bk / bv          as their matrix                as their matrix
    wo [.., H*hd, D]      input (whole heads)            H % tp == 0
    w_gate, w_up [.., D, F]   F                          F % tp == 0
    w_down [.., F, D]         F                          F % tp == 0
    e_gate, e_up [.., E, D, Fe], e_down [.., E, Fe, D]   Fe    Fe % tp == 0
    KV cache [L, S, K, T, hd] K (K/V heads)              K % tp == 0
    norms, router, anything else                         replicated

What does not divide is replicated, never padded: a model with one K/V head
(multi-query attention) on 4 devices keeps wk, wv and the cache whole on every
device while wq / wo are cut by query heads. Example: H=4, K=2, F=64, V=320 on
tp=4 -> wq, wo, w_* and the vocabulary are cut four ways; wk, wv and the cache
are replicated (2 % 4 != 0).

Axes are counted from the end, so the same rules fit layers stacked on a
leading L axis (`params["layers"][name]` is [L, ...]) and per-layer dicts
(`transformer.unstack_layers`), and the one-row copies of `xla_layout` are cut
like their originals, transposed.

Sharding changes the order of some float reductions (the `wo` / `w_down`
contractions become partial sums plus an all-reduce), so logits may differ
from one device's in the last bits; greedy tokens agree unless two logits tie
to within that noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specdec.kernels.config import ModelConfig
from specdec.kernels.paged import PagedKVCache
from specdec.kernels.transformer import KVCache, Params

AXIS = "tp"

Dim = Literal["vocab", "heads", "kv_heads", "ffn", "moe_ffn"]

# leaf name -> (axis counted from the end, the model dimension that axis splits)
RULES: dict[str, tuple[int, Dim]] = {
    "embed": (-2, "vocab"),
    "lm_head": (-1, "vocab"),
    "wq": (-1, "heads"),
    "bq": (-1, "heads"),
    "wk": (-1, "kv_heads"),
    "bk": (-1, "kv_heads"),
    "wv": (-1, "kv_heads"),
    "bv": (-1, "kv_heads"),
    "wo": (-2, "heads"),
    "wg": (-1, "heads"),  # gated attention's output gate: per query head, as wq
    "wq_b": (-1, "heads"),  # MLA: per-head query columns, up-projections [H, c, ...]
    "w_uk": (-3, "heads"),
    "w_uv": (-3, "heads"),
    "w_gate": (-1, "ffn"),
    "w_up": (-1, "ffn"),
    "w_down": (-2, "ffn"),
    "e_gate": (-1, "moe_ffn"),
    "e_up": (-1, "moe_ffn"),
    "e_down": (-2, "moe_ffn"),
}


def divisible(cfg: ModelConfig, tp: int) -> dict[Dim, bool]:
    """Which model dimensions split evenly over `tp` devices."""
    sizes = {
        "vocab": cfg.vocab_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "ffn": cfg.intermediate_size,
        "moe_ffn": max(cfg.moe_intermediate_size, 1),
    }
    return {dim: n % tp == 0 for dim, n in sizes.items()}


def _spec(ndim: int, axis: int | None) -> PartitionSpec:
    if axis is None:
        return PartitionSpec()
    parts: list[str | None] = [None] * ndim
    parts[axis] = AXIS
    return PartitionSpec(*parts)


def param_specs(cfg: ModelConfig, params: Params, tp: int) -> Params:
    """A `PartitionSpec` per leaf of `params` (same tree), from RULES (module docstring)."""
    ok = divisible(cfg, tp)

    def one(path, leaf):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        name = keys[-1] if keys else ""
        rule = RULES.get(name)
        if rule is not None and "one_row" in keys[:-1]:
            # An [out, in] copy (`xla_layout.one_row_copies`): its original's cut, transposed.
            axis, dim = rule
            rule = (-3 - axis, dim)
        if tp == 1 or rule is None:
            return _spec(np.ndim(leaf), None)
        axis, dim = rule
        # A head padded for the megakernel (`megakernel.shard.pad_head`) is cut by its
        # own width, which divides where the vocabulary may not.
        fits = np.shape(leaf)[axis] % tp == 0 if dim == "vocab" else ok[dim]
        return _spec(np.ndim(leaf), axis if fits else None)

    return jax.tree_util.tree_map_with_path(one, params)


def cache_spec(cfg: ModelConfig, tp: int, paged: bool = False) -> PartitionSpec:
    """KV cache [L, slots, K, T, hd] (paged: [L, K, blocks, block_size, hd]): split
    K/V heads when they divide, else replicate."""
    if tp > 1 and divisible(cfg, tp)["kv_heads"]:
        return _spec(5, 1 if paged else 2)
    return PartitionSpec()


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ("tp") mesh over `devices` (default: every local device)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device, got none.")
    return Mesh(np.array(devices), (AXIS,))


def shard_params(cfg: ModelConfig, params: Params, mesh: Mesh) -> Params:
    """`params` placed over `mesh` (cut or replicated leaf by leaf)."""
    specs = param_specs(cfg, params, mesh.shape[AXIS])
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def shard_cache(cfg: ModelConfig, cache: KVCache | PagedKVCache, mesh: Mesh):
    """`cache` placed over `mesh` by `cache_spec` (a paged cache's block table on
    every device)."""
    paged = isinstance(cache, PagedKVCache)
    sharding = NamedSharding(mesh, cache_spec(cfg, mesh.shape[AXIS], paged))
    k, v = jax.device_put(cache.k, sharding), jax.device_put(cache.v, sharding)
    # A hybrid model's linear-layer states are small next to K/V: every device holds
    # them (GSPMD keeps the maths the same whatever it splits).
    lin = None if cache.lin is None else jax.tree.map(lambda a: replicate(a, mesh), cache.lin)
    if paged:
        return PagedKVCache(k=k, v=v, table=replicate(cache.table, mesh), lin=lin)
    return KVCache(k=k, v=v, lin=lin)


def replicate(x: jax.Array, mesh: Mesh) -> jax.Array:
    """`x` whole on every device of `mesh`."""
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def shard_runner(runner, mesh: Mesh) -> None:
    """Moves a `ModelRunner`'s params and KV cache onto `mesh`, in place.

    The runner allocated its cache on one device first; at scale a worker
    should build the cache sharded from the start (a sharded `jnp.zeros`).
    """
    runner.params = shard_params(runner.cfg, runner.params, mesh)
    runner.cache = shard_cache(runner.cfg, runner.cache, mesh)
    runner.mesh = mesh


def describe(cfg: ModelConfig, tp: int) -> dict[str, str]:
    """Human-readable placement: {"wq": "split heads / 4", "wk": "replicated", ...}."""
    ok = divisible(cfg, tp)
    out = {}
    for name, (_, dim) in RULES.items():
        out[name] = f"split {dim} / {tp}" if tp > 1 and ok[dim] else "replicated"
    out["kv_cache"] = f"split kv_heads / {tp}" if cache_spec(cfg, tp) else "replicated"
    return out
