"""Trace-time checks of the verify megakernel's inputs (`kernel.verify`): shapes,
dtypes and what the kernel needs of the cache, each failure a ValueError naming
what was wrong and what is allowed."""

from __future__ import annotations

from specdec.kernels.megakernel import hybrid, mla, moe, shard, tuning


def verify_inputs(params, cache, roots, tokens, parents, slots, cache_lens, uniforms, cfg, tp):
    """Trace-time shape and dtype checks (values are the caller's contract)."""
    if cfg.num_kv_heads % tp and not cfg.is_mla:  # MLA's one latent is replicated
        raise ValueError(
            f"On {tp} devices the kernel needs num_kv_heads ({cfg.num_kv_heads}) divisible by "
            f"{tp}: repeat the K/V heads first (`megakernel.shard.prepare_params`), which also "
            "gives the KV cache that many heads."
        )
    if not isinstance(params["layers"], dict):
        raise ValueError(
            "The megakernel streams stacked layer weights (params['layers'] leaves [L, ...]); "
            "got per-layer params (transformer.unstack_layers): keep the stacked copy."
        )
    if tokens.ndim != 2 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must both be [B, N], got {tokens.shape} and {parents.shape}."
        )
    b, n = tokens.shape
    for name, arr, shape in (
        ("roots", roots, (b,)),
        ("slots", slots, (b,)),
        ("cache_lens", cache_lens, (b,)),
        ("uniforms", uniforms, (b, n + 1)),
    ):
        if arr.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {arr.shape}.")
    lead = (cfg.num_cache_layers, cache.num_slots, cfg.num_kv_heads, cache.max_len)
    expect = tuple((*lead, width) for width in cfg.cache_dims)
    if (cache.k.shape, cache.v.shape) != expect:
        raise ValueError(
            f"cache.k and cache.v must have shapes {expect[0]} and {expect[1]}, got "
            f"{cache.k.shape} and {cache.v.shape}."
        )
    if cache.k.dtype.itemsize not in (2, 4) or cache.v.dtype != cache.k.dtype:
        raise ValueError(f"The cache must be float32 or a 16-bit float, got {cache.k.dtype}.")
    align = tuning.sublane_tile(cache.k.dtype)
    if cache.max_len % align:
        raise ValueError(
            f"The cache length ({cache.max_len}) must be a multiple of {align} for "
            f"{cache.k.dtype} caches."
        )
    window = tuning.kv_write_rows(n, cache.k.dtype)
    if cache.max_len < window:
        raise ValueError(
            f"The cache length ({cache.max_len}) must be at least {window} for {n} tree nodes."
        )
    lp = params["layers"]
    head = params[shard.head_leaf(cfg)[0]]
    streamed = {name: lp[name] for name in ("wq", "wk", "wv", "wo", "wg", "w_gate", "w_up",
                                            "w_down", *moe.SPLIT, *mla.SPLIT)
                if name in lp}  # fmt: skip
    if cfg.is_hybrid:
        streamed |= {name: params["lin"][name] for name in hybrid.LINEAR_HBM}
        if cache.lin is None:
            raise ValueError("A hybrid model's cache must hold its linear layers' state (lin).")
    for name, w in (streamed | {"LM head": head}).items():
        if w.dtype != lp["wo"].dtype:
            raise ValueError(
                f"Streamed weights must share one dtype; {name} is {w.dtype}, wo is "
                f"{lp['wo'].dtype}."
            )
