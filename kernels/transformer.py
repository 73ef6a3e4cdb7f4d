"""Pure-JAX reference transformer: the one forward every other path is checked against.

One primitive, `forward_block`, covers prefill, decode and the tree forward. It
runs N new tokens per sequence against that sequence's committed KV:

* each new token i attends to the committed prefix (cache positions
  `[0, cache_lens[b])`) and to the new tokens j with `block_mask[b, i, j]`;
* RoPE uses `positions[b, i]`;
* the new tokens' K/V are written to cache positions `cache_lens[b] + i`
  (block order, not RoPE position: sibling tree nodes share a position).

Prefill is a causal block at `cache_lens = 0`; decode is a block of one; the
tree forward is a block of `[root, node_0, ..., node_{N-1}]` whose mask is the
ancestor mask. Example: root + nodes with depths [1, 1, 2] and 7 committed
tokens -> positions [7, 8, 8, 9], K/V written to cache slots 7, 8, 9, 10.
`commit_kv` later moves the accepted path's K/V to slots 8, 9, ...

Numerics: the residual stream, norms, softmax and logits are float32; matmul
inputs are cast to the weight dtype with float32 accumulation, so float32
weights give exactly the float32 Hugging Face computation.

Params are a dict pytree with per-layer weights stacked on a leading L axis
(so layers run under `lax.scan` and a kernel can stream them); matrices are
`[in, out]`:

    embed        [V, D]             final_norm [D]        lm_head [D, V] (tied: absent*)
    layers/attn_norm, mlp_norm   [L, D]
    layers/wq [L, D, H*hd]   wk, wv [L, D, K*hd]   wo [L, H*hd, D]
    layers/bq [L, H*hd]      bk, bv [L, K*hd]              (attention_bias)
    layers/q_norm, k_norm [L, hd]                           (qk_norm)
    layers/w_gate, w_up [L, D, F]   w_down [L, F, D]        (dense MLP)
    layers/router [L, D, E]   e_gate, e_up [L, E, D, Fe]   e_down [L, E, Fe, D]  (MoE)

*On CPU a tied model gets a [D, V] copy of embed.T as lm_head (`untie_head`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specdec.kernels import dot_library
from specdec.kernels.config import ModelConfig

Params = dict

_NEG = -1e30  # finite "minus infinity": a fully masked row must not become NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V for a fixed number of sequence slots.

    k: jax.Array  # [L, slots, K, max_len, hd]
    v: jax.Array  # [L, slots, K, max_len, hd]
    Which positions of a slot are valid is the caller's `cache_lens`, not stored here.
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype=jnp.float32):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_dtype(weight_dtype) -> jnp.dtype:
    """The KV-cache dtype for weights of `weight_dtype`: the same, except float32 on CPU.

    XLA CPU cannot update a bfloat16 buffer in place: it widens the whole buffer
    to float32 and back, so writing one decode step's K/V into a bfloat16 cache
    copied all of it (1.9 ms a step for the demo target's 8.5 MB cache, against
    0.015 ms in float32). Float32 K/V cost twice the memory, no precision.
    """
    if jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(weight_dtype)


# ----------------------------------------------------------------------------- params


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, in the layout described in the module docstring."""
    d, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = {
        "attn_norm": (L, d),
        "mlp_norm": (L, d),
        "wq": (L, d, qd),
        "wk": (L, d, kvd),
        "wv": (L, d, kvd),
        "wo": (L, qd, d),
    }
    if cfg.attention_bias:
        layers |= {"bq": (L, qd), "bk": (L, kvd), "bv": (L, kvd)}
    if cfg.qk_norm:
        layers |= {"q_norm": (L, hd), "k_norm": (L, hd)}
    if cfg.is_moe:
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        layers |= {
            "router": (L, d, e),
            "e_gate": (L, e, d, fe),
            "e_up": (L, e, d, fe),
            "e_down": (L, e, fe, d),
        }
    else:
        f = cfg.intermediate_size
        layers |= {"w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d)}
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights (normal, std 0.02), norms at one, biases at zero."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name in ("bq", "bk", "bv"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- pieces


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies f32[hd // 2], with Llama-3 scaling when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    old = rs.original_max_position_embeddings
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x f32[..., D] normalised over the last axis, times weight [D]."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(jnp.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x f32[B, N, heads, hd]; positions i32[B, N]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, N, hd/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] with inputs in w's dtype and f32 accumulation.

    XLA CPU runs a one-row bfloat16 product as a slow matrix-vector loop: over
    the 24 MLP matrices of the demo target, one row took 31 ms and two rows
    3.0 ms (float32: 3.1 ms). So a single bfloat16 row on CPU is computed as
    two rows (the second zero) and the first kept; the answer is the same.
    """
    x = x.astype(w.dtype)
    if math.prod(x.shape[:-1]) == 1 and w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        two = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        out = jnp.matmul(two, w, preferred_element_type=jnp.float32)[:1]
        return out.reshape(*x.shape[:-1], w.shape[-1])
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def linear(p: dict, name: str, x: jax.Array) -> jax.Array:
    """x [..., in] @ p[name] [in, out]; a one-row x reads p[name + "_t"] ([out, in])
    where `decode_copies` made one: the same sums, in the layout a single row
    streams fastest on XLA CPU (see `decode_copies`)."""
    w_t = p.get(name + "_t")
    if w_t is None or math.prod(x.shape[:-1]) != 1:
        return matmul(x, p[name])
    out = jnp.einsum("oi,ni->no", w_t, x.reshape(1, -1).astype(w_t.dtype),
                     preferred_element_type=jnp.float32)  # fmt: skip
    return out.reshape(*x.shape[:-1], w_t.shape[0])


# Layer matrices `decode_copies` gives an [out, in] copy.
DECODE_KEYS = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")
# At most this many bytes of copies (they double the weights they copy).
DECODE_COPIES_MAX_BYTES = 2 << 30


def decode_copy_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the matrices `decode_copies` copies for this model in `dtype`: every
    layer's `DECODE_KEYS` matrices (fused or not, the same bytes) and a [D, V] head."""
    layers = param_shapes(cfg)["layers"]
    n = sum(math.prod(shape) for k, shape in layers.items() if k in DECODE_KEYS)
    return (n + cfg.hidden_size * cfg.vocab_size) * jnp.dtype(dtype).itemsize


def wants_decode_copies(cfg: ModelConfig, dtype) -> bool:
    """Whether one-row products of this model's `dtype` weights get [out, in] copies
    here: float32 on XLA CPU only, and copies of at most `DECODE_COPIES_MAX_BYTES`
    (`decode_copy_bytes`). (A one-row bfloat16 product is computed as two rows,
    `matmul`, where [in, out] is as fast.)"""
    return (jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32
            and decode_copy_bytes(cfg, dtype) <= DECODE_COPIES_MAX_BYTES)  # fmt: skip


def decode_copies(params: Params, tied: bool) -> Params:
    """Per-layer params (`unstack_layers`) plus an [out, in] copy `<name>_t` of each
    layer matrix and of the LM head, which `linear` reads for one-row products.

    On XLA CPU a one-row product reads an [out, in] matrix (each output a dot of
    one contiguous row with x) faster than an [in, out] one, while products of
    more rows are slower that way (an AMD EPYC with AVX-512, float32: the demo
    target's weight products of one step took 2.6 ms against 3.1 ms in the
    faster library, a random 162M Llama's 10.1 against 13.3 ms; at 2 rows 5.6
    against 4.0 ms). So decode steps of one row take the copies and verify
    blocks and prefill keep the originals. A tied head's copy (`tied`: the model
    ties its LM head to the embedding) is `embed` itself.
    """
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        raise ValueError("decode_copies needs per-layer params (unstack_layers)")

    def with_t(lp: dict) -> dict:
        return {**lp, **{k + "_t": jnp.transpose(lp[k]) for k in DECODE_KEYS
                         if k in lp and lp[k].ndim == 2}}  # fmt: skip

    out = {**params, "layers": tuple(with_t(lp) for lp in layers)}
    if "lm_head" in params:  # `lm_head` reads it; a tied head without one reads embed.T
        out["lm_head_t"] = params["embed"] if tied else jnp.transpose(params["lm_head"])
    return out


def _mlp(cfg: ModelConfig, lp: dict, h: jax.Array) -> jax.Array:
    if "w_gate_up" in lp:  # `fuse_projections`
        gu = linear(lp, "w_gate_up", h)
        f = gu.shape[-1] // 2
        return linear(lp, "w_down", jax.nn.silu(gu[..., :f]) * gu[..., f:])
    if not cfg.is_moe:
        a = jax.nn.silu(linear(lp, "w_gate", h)) * linear(lp, "w_up", h)
        return linear(lp, "w_down", a)
    # Routed experts, computed densely (every expert on every token, then
    # weighted): exact, and fine for a reference; a grouped kernel is future work.
    router = jax.nn.softmax(matmul(h, lp["router"]), axis=-1)  # [B, N, E]
    top_w, top_i = jax.lax.top_k(router, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(lp["e_gate"].dtype).astype(jnp.float32)
    weights = jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts) * top_w[..., None], axis=-2)
    hx = h.astype(lp["e_gate"].dtype)
    gate = jnp.einsum("bnd,edf->bnef", hx, lp["e_gate"], preferred_element_type=jnp.float32)
    up = jnp.einsum("bnd,edf->bnef", hx, lp["e_up"], preferred_element_type=jnp.float32)
    act = (jax.nn.silu(gate) * up).astype(lp["e_down"].dtype)
    out = jnp.einsum("bnef,efd->bned", act, lp["e_down"], preferred_element_type=jnp.float32)
    return jnp.einsum("bne,bned->bnd", weights, out)


def _attention(
    cfg: ModelConfig,
    q: jax.Array,  # f32[B, N, H, hd], RoPE applied
    k: jax.Array,  # f32[B, M, K, hd], RoPE applied: the block's keys (M = N, or a side buffer)
    v: jax.Array,  # f32[B, M, K, hd]
    k_cache: jax.Array | None,  # [B, K, T, hd] committed keys of each sequence
    v_cache: jax.Array | None,  # [B, K, T, hd]
    cache_mask: jax.Array | None,  # bool[B, N, T]
    block_mask: jax.Array,  # bool[B, N, M]
    keys_t: bool = False,  # k_cache given as [B, K, hd, T] (`_keys_transposed`)
) -> jax.Array:  # f32[B, N, H * hd]
    b, n, h, hd = q.shape
    kh = cfg.num_kv_heads
    q = q.reshape(b, n, kh, h // kh, hd) * (1.0 / math.sqrt(hd))
    if keys_t or (k_cache is not None and _per_kv_head(cfg)):
        return _attention_per_kv_head(q, k, v, k_cache, v_cache, cache_mask, block_mask, keys_t)
    s_block = jnp.einsum("bnkgd,bmkd->bkgnm", q, k)
    s_block = jnp.where(block_mask[:, None, None], s_block, _NEG)
    if k_cache is None:
        p = jax.nn.softmax(s_block, axis=-1)
        out = jnp.einsum("bkgnm,bmkd->bnkgd", p, v)
        return out.reshape(b, n, h * hd)
    s_cache = jnp.einsum("bnkgd,bktd->bkgnt", q, k_cache.astype(jnp.float32))
    s_cache = jnp.where(cache_mask[:, None, None], s_cache, _NEG)
    p = jax.nn.softmax(jnp.concatenate([s_cache, s_block], axis=-1), axis=-1)
    t = k_cache.shape[2]
    out = jnp.einsum("bkgnt,bktd->bnkgd", p[..., :t], v_cache.astype(jnp.float32))
    out = out + jnp.einsum("bkgnm,bmkd->bnkgd", p[..., t:], v)
    return out.reshape(b, n, h * hd)


# XLA CPU runs a dot batched over (row, KV head) as a slow loop of tiny products; one
# product per KV head (batched over rows only) read a 1024-position cache in 3.4 ms
# instead of 4.7 (8 layers, 7 query rows, 4 KV heads). Past this many KV heads the
# unrolled loop would bloat the program: the batched form is kept.
_PER_HEAD_MAX = 8


def _per_kv_head(cfg: ModelConfig) -> bool:
    """Whether attention over a cache runs one KV head at a time (XLA CPU, few heads)."""
    return jax.default_backend() == "cpu" and cfg.num_kv_heads <= _PER_HEAD_MAX


def _keys_transposed(cfg: ModelConfig) -> bool:
    """Whether cached keys are copied out as [hd, T] for the per-head scores: a program
    traced for Eigen, which reads a transposed operand slowly (`dot_library`)."""
    return _per_kv_head(cfg) and dot_library.tracing_for() == "eigen"


def _attention_per_kv_head(q, k, v, k_cache, v_cache, cache_mask, block_mask, keys_t=False):
    """`_attention` with a cache, one KV head at a time (same maths, same masks).

    q f32[B, N, K, G, hd] (scaled, RoPE applied); block keys k, v f32[B, M, K, hd];
    caches [B, K, T, hd] (keys [B, K, hd, T] with `keys_t`). A head's G query heads
    and N tokens form one [G * N, hd] block of queries (row g * N + i), so each
    product is a plain [G * N, hd] x [hd, T] matmul per row.
    """
    b, n, kh, g, hd = q.shape
    t, m = k_cache.shape[3 if keys_t else 2], k.shape[1]
    qh = q.transpose(0, 2, 3, 1, 4).reshape(b, kh, g * n, hd)
    cmask = jnp.broadcast_to(cache_mask[:, None], (b, g, n, t)).reshape(b, g * n, t)
    bmask = jnp.broadcast_to(block_mask[:, None], (b, g, n, m)).reshape(b, g * n, m)
    outs = []
    for j in range(kh):
        kj = k_cache[:, j].astype(jnp.float32)
        s_c = jnp.einsum("bmd,bdt->bmt" if keys_t else "bmd,btd->bmt", qh[:, j], kj)
        s_b = jnp.einsum("bmd,bnd->bmn", qh[:, j], k[:, :, j])
        s_c = jnp.where(cmask, s_c, _NEG)
        s_b = jnp.where(bmask, s_b, _NEG)
        m = jnp.maximum(s_c.max(axis=-1, keepdims=True), s_b.max(axis=-1, keepdims=True))
        e_c, e_b = jnp.exp(s_c - m), jnp.exp(s_b - m)
        denom = e_c.sum(axis=-1, keepdims=True) + e_b.sum(axis=-1, keepdims=True)
        o = jnp.einsum("bmt,btd->bmd", e_c, v_cache[:, j].astype(jnp.float32))
        o = o + jnp.einsum("bmn,bnd->bmd", e_b, v[:, :, j])
        outs.append(o / denom)
    out = jnp.stack(outs, axis=1).reshape(b, kh, g, n, hd)  # [B, K, G, N, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n, kh * g * hd)


def _layer(cfg, inv_freq, positions, cache_mask, block_mask, x, lp, k_cache, v_cache, side=None,
           keys_t=False):  # fmt: skip
    """One decoder layer. Returns the new residual and this block's (k, v).

    With `side` = (k_side, v_side [B, S, K, hd], at): the block's K/V are put at
    side positions [at, at + N) and attention reads the whole side buffer
    (`block_mask` is then bool[B, N, S]); the updated buffers are returned.
    """
    b, n, _ = x.shape
    hd = cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:  # `fuse_projections`: one product instead of three
        qkv = linear(lp, "wqkv", h)
        nq, nk = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
    else:
        q, k, v = linear(lp, "wq", h), linear(lp, "wk", h), linear(lp, "wv", h)
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, n, cfg.num_heads, hd)
    k = k.reshape(b, n, cfg.num_kv_heads, hd)
    v = v.reshape(b, n, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    if side is not None:
        k_side, v_side, at = side
        k = jax.lax.dynamic_update_slice_in_dim(k_side, k.astype(k_side.dtype), at, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(v_side, v.astype(v_side.dtype), at, axis=1)
    attn = _attention(cfg, q, k, v, k_cache, v_cache, cache_mask, block_mask, keys_t)
    x = x + linear(lp, "wo", attn)
    x = x + _mlp(cfg, lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
    return x, k, v


def lm_head(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """Final norm + vocabulary projection: x f32[..., D] -> logits f32[..., V]."""
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if "lm_head" in params:  # untied, or tied with a [D, V] copy (`untie_head`)
        return linear(params, "lm_head", h)
    return matmul(h, params["embed"].T)


# ----------------------------------------------------------------------------- forward


def _hidden_block(
    cfg, params, tokens, positions, block_mask, cache, slots, cache_lens, cache_mask=None,
    kv_len=None, side=None, rows_are_slots=False,
):  # fmt: skip
    """Runs all layers; returns final residual f32[B, N, D] and new K/V [L, B, N, K, hd].

    Only the first `kv_len` cache positions are read (default: all of them).
    `side` (see `block_logits_kv`) replaces the block's own keys by a side buffer.
    `rows_are_slots`: see `_cache_rows`.
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][tokens].astype(jnp.float32)
    key_positions = positions if side is None else side.positions
    if cfg.sliding_window is not None:
        w = cfg.sliding_window
        block_mask = block_mask & (positions[:, :, None] - key_positions[:, None, :] < w)
    if cache is None:
        assert side is None, "a side buffer needs a cache"

        def body(x, lp):
            x, k, v = _layer(cfg, inv_freq, positions, None, block_mask, x, lp, None, None)
            return x, (k, v)

        layers = params["layers"]
        return _over_layers(body, x, list(layers) if isinstance(layers, tuple) else layers)

    kv_len = kv_len or cache.max_len
    t = jnp.arange(kv_len)
    if cache_mask is None:
        cache_valid = t[None, :] < cache_lens[:, None]  # [B, T]
        cache_mask = jnp.broadcast_to(cache_valid[:, None, :], (*tokens.shape, kv_len))
    else:
        cache_valid = jnp.any(cache_mask, axis=1)
    if cfg.sliding_window is not None:
        cache_mask = cache_mask & (positions[:, :, None] - t[None, None, :] < cfg.sliding_window)
    # Zero the unused slots so NaN (or stale) data there cannot leak through 0 * NaN.
    keep = cache_valid[:, None, :, None]
    safe_slots = jnp.clip(slots, 0, cache.num_slots - 1)
    keys_t = _keys_transposed(cfg)

    def body(x, layer):
        lp, i, sk, sv = layer  # i: this layer's index into the cache (traced under scan)
        kc, vc = (jnp.where(keep, _cache_rows(a, i, safe_slots, kv_len, rows_are_slots), 0)
                  for a in (cache.k, cache.v))  # fmt: skip
        if keys_t:  # the same copy, written out transposed
            kc = jnp.swapaxes(kc, -1, -2)
        side_l = None if side is None else (sk, sv, side.at)
        x, k, v = _layer(cfg, inv_freq, positions, cache_mask, block_mask, x, lp, kc, vc, side_l,
                         keys_t)  # fmt: skip
        return x, (k, v)

    layers = params["layers"]
    n_layers = cache.k.shape[0]
    sk, sv = (None, None) if side is None else (side.k, side.v)
    if isinstance(layers, (tuple, list)):
        return _over_layers(body, x, [(lp, i, None if sk is None else sk[i],
                                       None if sv is None else sv[i])
                                      for i, lp in enumerate(layers)])  # fmt: skip
    return _over_layers(body, x, (layers, jnp.arange(n_layers), sk, sv))


def _cache_rows(
    arr: jax.Array, layer, slots: jax.Array, kv_len: int, rows_are_slots: bool = False
) -> jax.Array:
    """arr[layer, slots, :, :kv_len] of a cache [L, S, K, T, hd] -> [B, K, kv_len, hd].

    One contiguous slice per row, straight from the cache. Slicing `[..., :kv_len]`
    first and then picking rows with an index-array gather (an element-wise loop
    on XLA CPU) copied the cache twice: a batch-1 decode step of the 27M demo
    target at context 500 took 11.0 ms that way, 9.0 ms this way.

    `rows_are_slots` (static): the caller's row b is slot b, or an inactive row
    (slot -1) whose output is discarded, and B == S: one static slice of the
    layer. XLA CPU copied the B per-row slices through one concatenation loop
    and then again per KV head; the static slice folds into the per-head copies
    (demo target, 8 rows at context 450: a decode step about 20% faster).
    """
    _, s, k, _, hd = arr.shape
    if rows_are_slots:
        assert slots.shape[0] == s, "rows_are_slots needs one row per slot"
        if isinstance(layer, int):
            return arr[layer, :, :, :kv_len]
        return jax.lax.dynamic_index_in_dim(arr, layer, 0, keepdims=False)[:, :, :kv_len]
    rows = [jax.lax.dynamic_slice(arr, (layer, slots[b], 0, 0, 0), (1, 1, k, kv_len, hd))[0, 0]
            for b in range(slots.shape[0])]  # fmt: skip
    return jnp.stack(rows)


def _over_layers(body, x, layers):
    """Runs `body(x, layer) -> (x, (k, v))` over the layers; K/V stacked [L, ...].

    Stacked params ([L, ...] leaves) run under `lax.scan` (one traced layer: what
    a kernel streams). A tuple of per-layer dicts (`unstack_layers`) is unrolled:
    on CPU, XLA copies each scanned slice of the stacked weights, which cost a
    3.4x slower decode (4.1 vs 14.1 GB/s on a 12-layer 768-wide stack here).
    """
    if isinstance(layers, list):
        ks, vs = [], []
        for layer in layers:
            x, (k, v) = body(x, layer)
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)
    x, (ks, vs) = jax.lax.scan(body, x, layers)
    return x, ks, vs


def unstack_layers(params: Params) -> Params:
    """The same params with `layers` as a tuple of per-layer dicts (see `_over_layers`)."""
    stacked = params["layers"]
    if isinstance(stacked, (tuple, list)):
        return params
    n = next(iter(stacked.values())).shape[0]
    layers = tuple({k: v[i] for k, v in stacked.items()} for i in range(n))
    return {**params, "layers": layers}


def fuse_projections(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) with wq|wk|wv as one `wqkv` [D, (H + 2K) * hd]
    and w_gate|w_up as one `w_gate_up` [D, 2F]: the same numbers in fewer products.

    For small models whose products cost their dispatch more than their bytes: the
    demo draft's 2-layer forward of 2 rows took 0.137 ms as 10 products and 0.090 ms
    as 4 (XLA CPU); the 27M demo target's products took the same time either way.
    Not for params a mesh will shard (`sharding.RULES` names the separate matrices).
    """
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        raise ValueError("fuse_projections needs per-layer params (unstack_layers)")

    def fuse(lp: dict) -> dict:
        lp = dict(lp)
        if "wq" in lp:
            lp["wqkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=1)
        if "w_gate" in lp:
            lp["w_gate_up"] = jnp.concatenate([lp.pop("w_gate"), lp.pop("w_up")], axis=1)
        return lp

    return {**params, "layers": tuple(fuse(lp) for lp in layers)}


def untie_head(params: Params) -> Params:
    """A tied model's params with an explicit [D, V] `lm_head` (a copy of embed.T).

    For XLA on CPU: its Eigen GEMM reads the transposed embedding about 10x
    slower than a row-major [D, V] matrix (`dot_library`). Costs V * D more
    weights, so accelerators keep the tied form.
    """
    if "lm_head" in params:
        return params
    return {**params, "lm_head": jnp.transpose(params["embed"])}


def _put_rows(cache: KVCache, k_rows, v_rows, slots, starts) -> KVCache:
    """Writes k_rows[b] / v_rows[b] ([L, K, n, hd]) at positions starts[b] .. + n of slots[b].

    One in-place `dynamic_update_slice` per row (a scatter with advanced indices
    rebuilt the whole cache: 65 ms of a 108 ms decode step on a 160M model).
    Rows with slot < 0 write back what is there. The caller keeps
    `starts[b] + n <= max_len` for live rows (slices are clamped, not dropped).
    """

    def row(b, kv):
        k, v = kv
        live = slots[b] >= 0
        at = (0, jnp.maximum(slots[b], 0), 0, starts[b], 0)
        shape = (k.shape[0], 1, k.shape[2], k_rows.shape[3], k.shape[4])

        def put(cache_arr, new):
            old = jax.lax.dynamic_slice(cache_arr, at, shape)
            upd = jnp.where(live, new[:, None].astype(cache_arr.dtype), old)
            return jax.lax.dynamic_update_slice(cache_arr, upd, at)

        return put(k, k_rows[b]), put(v, v_rows[b])

    kv = (cache.k, cache.v)
    for b in range(slots.shape[0]):  # unrolled: a while loop would copy the cache (XLA CPU)
        kv = row(b, kv)
    return KVCache(k=kv[0], v=kv[1])


def _write_block(cache: KVCache, ks, vs, slots, cache_lens) -> KVCache:
    """Writes block K/V [L, B, N, K, hd] at positions cache_lens[b] + i of slots[b].

    Padding rows (slot = -1) never change the cache.
    """
    k_rows = jnp.moveaxis(ks, 1, 0).transpose(0, 1, 3, 2, 4)  # [B, L, K, N, hd]
    v_rows = jnp.moveaxis(vs, 1, 0).transpose(0, 1, 3, 2, 4)
    return _put_rows(cache, k_rows, v_rows, slots, cache_lens)


@functools.partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("cache",))
def forward_block(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,  # i32[B, N] new tokens
    positions: jax.Array,  # i32[B, N] RoPE positions
    block_mask: jax.Array,  # bool[B, N, N] which new tokens each new token sees
    slots: jax.Array,  # i32[B] cache slot per row; -1 = padding row (nothing written)
    cache_lens: jax.Array,  # i32[B] committed tokens already in the cache
    logit_index: jax.Array | None = None,  # i32[B]: logits only at this block index
    cache_mask: jax.Array | None = None,  # bool[B, N, kv_len]: cached keys each token sees
    *,
    cfg: ModelConfig,
    kv_len: int | None = None,  # read only cache positions [0, kv_len); None = all
) -> tuple[jax.Array, KVCache]:
    """The shared primitive (module docstring).

    `cache_mask` replaces the default "committed prefix" (`t < cache_lens[b]`) when
    the cache holds more than a prefix, e.g. a drafter's earlier tree levels; the
    block is still written at `cache_lens[b] + i`. `kv_len` (static) bounds what
    attention reads, so short contexts do not pay for `max_len`; it must exceed
    every position a token attends to.

    Returns (logits f32[B, N, V], or f32[B, 1, V] at `logit_index`, and the cache).
    """
    logits, ks, vs = block_logits_kv(
        params, cache, tokens, positions, block_mask, slots, cache_lens, logit_index,
        cache_mask, cfg=cfg, kv_len=kv_len,
    )  # fmt: skip
    return logits, _write_block(cache, ks, vs, slots, cache_lens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SideKV:
    """Uncommitted K/V kept beside the cache: what a block attends to besides the cache.

    A drafter growing a tree level by level keeps its pending tokens' and tree
    nodes' K/V here instead of writing them into the cache between levels (XLA
    on CPU copies the whole cache for every such write in a program that also
    reads it). A block at side offset `at` puts its own K/V at [at, at + N) and
    attends to side positions by its mask (bool[B, N, S]).
    """

    k: jax.Array  # f32[L, B, S, K, hd]
    v: jax.Array  # f32[L, B, S, K, hd]
    positions: jax.Array  # i32[B, S] RoPE position of each side entry (sliding windows)
    at: int = dataclasses.field(metadata=dict(static=True), default=0)

    @classmethod
    def zeros(cls, cfg: ModelConfig, b: int, s: int) -> SideKV:
        shape = (cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                   jnp.zeros((b, s), jnp.int32))  # fmt: skip


def block_logits_kv(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,  # i32[B, N]
    positions: jax.Array,  # i32[B, N]
    block_mask: jax.Array,  # bool[B, N, N], or bool[B, N, S] with `side`
    slots: jax.Array,  # i32[B]
    cache_lens: jax.Array,  # i32[B]
    logit_index: jax.Array | None = None,  # i32[B]
    cache_mask: jax.Array | None = None,  # bool[B, N, kv_len]
    *,
    cfg: ModelConfig,
    kv_len: int | None = None,
    side: SideKV | None = None,
    rows_are_slots: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`forward_block` without the cache write: (logits, k, v), K/V [L, B, N, K, hd].

    The cache is only read, so a caller can write just what it keeps, in its own
    donated call (`write_kv`): XLA on CPU copies the whole cache when one program
    both reads it and updates it in place (2.5x slower decode on a 160M model).
    With `side`, the block's K/V go into the side buffer at `side.at` and the
    returned K/V are the whole updated buffers [L, B, S, K, hd].
    """
    x, ks, vs = _hidden_block(
        cfg, params, tokens, positions, block_mask, cache, slots, cache_lens, cache_mask, kv_len,
        side, rows_are_slots,
    )  # fmt: skip
    if logit_index is not None:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)
    return lm_head(cfg, params, x), ks, vs


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_kv(
    cache: KVCache,
    ks: jax.Array,  # [L, B, N, K, hd]
    vs: jax.Array,  # [L, B, N, K, hd]
    slots: jax.Array,  # i32[B], -1 = write nothing
    starts: jax.Array,  # i32[B] first cache position to write
    keep: jax.Array | None = None,  # i32[B, M] block indices to keep, in order (None = all)
) -> KVCache:
    """Writes block K/V (or the `keep` entries of it) at positions starts[b], starts[b] + 1, ...

    Example: a verify block [root, n0, n1, n2] with accepted path n0 -> n2 keeps
    block indices [0, 1, 3]: root, n0, n2 land at c, c + 1, c + 2. Entries past a
    row's real path are written too; they lie beyond its new length (ignored).
    """
    if keep is not None:
        take = jax.vmap(lambda a, idx: a[:, idx], in_axes=(1, 0), out_axes=1)
        ks, vs = take(ks, keep), take(vs, keep)
    return _write_block(cache, ks, vs, slots, starts)


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_kv(
    cache: KVCache,
    slots: jax.Array,  # i32[B]; -1 = padding row
    cache_lens: jax.Array,  # i32[B] committed length before the step (root's K/V slot)
    src: jax.Array,  # i32[B, P] block index of the accepted node at depth d (d = 1..P)
    num: jax.Array,  # i32[B] accepted nodes per row (<= P)
) -> KVCache:
    """Moves accepted tree nodes' K/V to their committed positions.

    After a verify block [root, node_0, ...] at cache_lens c, node i's K/V sits
    at c + 1 + i; the node accepted at depth d belongs at c + d. Example:
    accepted nodes [0, 2] (src = block indices [1, 3]) with c = 7 -> copies
    slot 8 -> 8 and 10 -> 9. Sources are never below targets (topological order),
    so reading all sources before writing is safe.
    """
    del num  # positions past the accepted path are beyond the new length: free to overwrite
    safe_slots = jnp.clip(slots, 0, cache.num_slots - 1)
    src_pos = jnp.clip(cache_lens[:, None] + src, 0, cache.max_len - 1)  # [B, P]

    def gather(arr):  # -> [B, L, K, P, hd]
        return jax.vmap(lambda s, pos: arr[:, s, :, pos, :].transpose(1, 2, 0, 3))(
            safe_slots, src_pos
        )

    return _put_rows(cache, gather(cache.k), gather(cache.v), slots, cache_lens + 1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_train(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Plain causal forward without a cache: tokens i32[B, T] -> logits f32[B, T, V]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    x, _, _ = _hidden_block(cfg, params, tokens, positions, causal, None, None, None)
    return lm_head(cfg, params, x)


def causal_block_mask(lengths: jax.Array, n: int) -> jax.Array:
    """bool[B, n, n]: causal, and only within each row's first lengths[b] tokens.

    Padding queries still see themselves so no softmax row is empty.
    """
    i = jnp.arange(n)
    causal = i[None, :, None] >= i[None, None, :]
    valid = i[None, :] < lengths[:, None]
    return (causal & valid[:, None, :]) | jnp.eye(n, dtype=bool)[None]


def prefill_logits(params: Params, cfg: ModelConfig, tokens, lengths) -> jax.Array:
    """Logits f32[B, T, V] for a right-padded ragged batch (tokens i32[B, T], lengths i32[B]).

    Positions at or beyond a row's length hold meaningless values.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    b, t = tokens.shape
    cache = KVCache.create(cfg, b, t, dtype=cache_dtype(params["embed"].dtype))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = forward_block(
        params,
        cache,
        tokens,
        positions,
        causal_block_mask(lengths, t),
        jnp.arange(b, dtype=jnp.int32),
        jnp.zeros((b,), jnp.int32),
        cfg=cfg,
    )
    return logits
