"""How the verify megakernel splits one target over n devices (tensor parallel).

Each of the n devices runs the same kernel on its shard of every layer
(`kernel.verify(..., mesh=...)`, one instance per device under `jax.shard_map`):

    what                          each device holds                      needs
    wq, bq / wo                   H / n query heads (columns / rows)     H % n == 0
    MLA: wq / wq_b, w_uk, w_uv    H / n heads; wq_a, wkv_a and the       H % n == 0
                                  latent cache replicated (`mla`)
    wk, wv, bk, bv, KV cache      K / n K/V heads                        K % n == 0 *
    w_gate, w_up / w_down         F / n intermediate columns / rows      F % n == 0
    LM head (lm_head or embed)    Vp / n vocabulary columns (rows)       Vp = V padded
    the residual stream [M, D]    all of it (the all-reduce's result)    D % n == 0 or
                                                                         D % 128 == 0
    norms, RoPE, masks, tree      all of it

*A model with fewer K/V heads than devices (n % K == 0) first gets its K/V heads
repeated n / K times (`replicate_kv_heads`): the same model, exactly, with n K/V
heads, so each device holds one, and its KV cache has n heads (each of the K
originals stored n / K times). This is what "KV heads replicated across devices"
costs in memory.

The vocabulary is padded with zero columns to `padded_vocab(V, n)`, a multiple of
n * 128, so every device's shard is whole vector lanes; the kernel never lets a
padded id win the argmax, and `transformer.lm_head` drops padded columns, so the
padded copy serves every other forward too.

Why the residual stream is whole on every device: the two reductions per layer
(after the attention output projection and after the MLP down projection) are
all-reduces whose result every device needs for its next matmul, and the tree's
rows (B x (N + 1), at most a few hundred) make [M, D] small next to a layer's
weights.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specdec.kernels import linear_attention as la
from specdec.kernels import stacks
from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel import collectives
from specdec.kernels.megakernel.tuning import LANES, round_up
from specdec.kernels.transformer import Params

__all__ = [
    "check_shardable",
    "head_leaf",
    "local_config",
    "padded_vocab",
    "prepare_params",
    "replicate_kv_heads",
    "split_config",
]


def padded_vocab(vocab_size: int, n: int) -> int:
    """The LM head's width on n devices: V rounded up to a multiple of n * 128 (V on one)."""
    return vocab_size if n == 1 else round_up(vocab_size, n * LANES)


def head_leaf(cfg: ModelConfig) -> tuple[str, int]:
    """The LM head's leaf and its vocabulary axis: the embedding's rows when tied,
    lm_head's columns otherwise."""
    return ("embed", 0) if cfg.tie_word_embeddings else ("lm_head", 1)


def split_config(cfg: ModelConfig, n: int) -> tuple[ModelConfig, int]:
    """What n devices run of `cfg` (`prepare_params` on shapes): the config with its
    K/V heads repeated up to n, and the LM head's padded width."""
    if n > cfg.num_kv_heads and not cfg.is_mla:  # MLA's one latent is replicated
        cfg = dataclasses.replace(cfg, num_kv_heads=n)
    return cfg, padded_vocab(cfg.vocab_size, n)


def check_shardable(cfg: ModelConfig, n: int, *, tpu: bool = False) -> None:
    """Raises ValueError naming what keeps `cfg` from the megakernel on n devices."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"The megakernel's device count must be a positive integer, got {n!r}.")
    if cfg.is_mla:
        from specdec.kernels.megakernel import mla

        mla.check(cfg, n)
    if cfg.is_hybrid:
        from specdec.kernels.megakernel import hybrid

        hybrid.check(cfg, n)
    if cfg.is_moe:
        from specdec.kernels.megakernel import moe

        moe.check(cfg, n)
    if n == 1:
        return
    rules = [("num_heads", cfg.num_heads)]
    if not cfg.is_moe or cfg.first_k_dense_replace:  # experts split whole (`moe.check`)
        rules.append(("intermediate_size", cfg.intermediate_size))
    if cfg.shared_intermediate:
        rules.append(("the shared experts' width", cfg.shared_intermediate))
    for name, size in rules:
        if size % n:
            raise ValueError(
                f"The megakernel on {n} devices splits {name} ({size}) {n} ways; {size} is not "
                f"a multiple of {n}. Use tensor_parallel_size dividing {size}, or kernel='xla'."
            )
    k = cfg.num_kv_heads
    if k % n and n % k and not cfg.is_mla:
        raise ValueError(
            f"The megakernel on {n} devices needs num_kv_heads ({k}) to divide by {n} or to "
            f"divide {n} (heads then replicated); use another tensor_parallel_size or kernel='xla'."
        )
    d = cfg.hidden_size
    if tpu and (d % n or (d // n) % LANES) and d % LANES:
        raise ValueError(
            f"On TPU the all-reduce cuts hidden_size ({d}) into chunks of whole "
            f"{LANES}-column lanes, {n} ways or fewer; {d} is not a multiple of {LANES}. "
            "Use kernel='xla'."
        )
    if d % n and d % LANES:
        raise ValueError(
            f"The megakernel on {n} devices splits hidden_size ({d}) {n} ways, or into "
            f"chunks of {LANES} columns; it does neither. Use tensor_parallel_size dividing "
            f"{d}, or kernel='xla'."
        )


def replicate_kv_heads(cfg: ModelConfig, params: Params, n: int) -> tuple[ModelConfig, Params]:
    """The same model with max(K, n) K/V heads: each of wk / wv / bk / bv's K heads
    repeated n / K times in place (head e of the result is head e // (n / K)).

    Exact: query head h of H reads K/V head h * K // H of the original and head
    e = h * n // H of the result, whose original is e // (n / K) = h * K // H.
    """
    k = cfg.num_kv_heads
    if n <= k or cfg.is_mla:  # MLA: every device holds the one latent (`mla`)
        return cfg, params
    if n % k:
        raise ValueError(f"num_kv_heads ({k}) must divide {n} to be replicated {n} ways.")
    reps, hd = n // k, cfg.head_dim

    def repeat(w):  # [..., K * hd] -> [..., n * hd], head-major
        shape = w.shape
        w = w.reshape(*shape[:-1], k, 1, hd)
        w = jnp.broadcast_to(w, (*shape[:-1], k, reps, hd))
        return w.reshape(*shape[:-1], n * hd)

    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError("replicate_kv_heads takes stacked layers (params['layers'] a dict).")
    layers = dict(layers)
    for name in ("wk", "wv", "bk", "bv"):
        if name in layers:
            layers[name] = repeat(layers[name])
    return split_config(cfg, n)[0], {**params, "layers": layers}


def pad_head(cfg: ModelConfig, params: Params, width: int) -> Params:
    """`params` with its LM head (lm_head columns, or a tied embed's rows) zero-padded to
    `width` vocabulary entries."""
    name, axis = head_leaf(cfg)
    head = params[name]
    extra = width - head.shape[axis]
    if extra < 0:
        raise ValueError(f"The LM head already has {head.shape[axis]} > {width} columns.")
    if extra == 0:
        return params
    pads = [(0, 0)] * head.ndim
    pads[axis] = (0, extra)
    return {**params, name: jnp.pad(head, pads)}


def head_width(cfg: ModelConfig, params: Params) -> int:
    """Vocabulary entries the LM head holds (V, or V padded)."""
    name, axis = head_leaf(cfg)
    return params[name].shape[axis]


def prepare_params(cfg: ModelConfig, params: Params, n: int) -> tuple[ModelConfig, Params]:
    """Once, at load: K/V heads replicated where needed and the vocabulary padded, so
    the n-device kernel streams `params` as they are (no per-step copy)."""
    check_shardable(cfg, n)
    if cfg.is_hybrid:  # the kernel's stacks (`hybrid` module docstring)
        params = la.stacked_layout(cfg, params)
    elif stacks.is_mixed_moe(cfg):
        params = stacks.moe_stacked(cfg, params)
    if cfg.is_mla:  # wkv_a's columns padded to whole lanes
        from specdec.kernels.megakernel import mla

        params = mla.pad_kv(cfg, params)
    cfg, params = replicate_kv_heads(cfg, params, n)
    return cfg, pad_head(cfg, params, padded_vocab(cfg.vocab_size, n))


def local_config(cfg: ModelConfig, n: int, head_cols: int) -> ModelConfig:
    """What one of n devices computes, as a model config: its heads, K/V heads,
    intermediate columns and `head_cols / n` vocabulary columns."""
    if n == 1:
        return dataclasses.replace(cfg, vocab_size=head_cols)
    linear = {}
    if cfg.shared_intermediate:  # shared experts split as a dense MLP
        linear["shared_expert_intermediate_size"] = cfg.shared_intermediate // n
    if cfg.is_hybrid:
        linear = {
            "linear_num_key_heads": cfg.linear_num_key_heads // n,
            "linear_num_value_heads": cfg.linear_num_value_heads // n,
        }
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // n,
        num_kv_heads=cfg.num_kv_heads if cfg.is_mla else cfg.num_kv_heads // n,
        intermediate_size=cfg.intermediate_size // n,
        vocab_size=head_cols // n,
        **linear,
    )


def allreduce_bytes_sent(rows: int, hidden: int, n: int) -> int:
    """Bytes the busiest device sends for one f32 all-reduce of [rows, hidden]: an
    owner of a chunk (`collectives.chunking`) sends its own to the other owners, then
    its sum to all n - 1 others (2 (n - 1) chunks of hidden / n columns when all own)."""
    if n == 1:
        return 0
    chunk, owners = collectives.chunking(hidden, n)
    return (owners - 1 + n - 1) * rows * chunk * 4


def step_bytes_sent(cfg: ModelConfig, rows: int, n: int) -> int:
    """Bytes one device sends to the others in one verify step: two all-reduces per
    layer plus the (max, argmax) exchange of the LM head."""
    if n == 1:
        return 0
    return 2 * cfg.num_layers * allreduce_bytes_sent(rows, cfg.hidden_size, n) + (
        (n - 1) * rows * LANES * 4
    )
