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
    layers/e_bias [L, E]  (the routing's correction bias)
    layers/s_gate, s_up [L, D, Fs]   s_down [L, Fs, D]   (shared experts, Fs = n x Fe)
  multi-head latent attention (`ModelConfig.is_mla`; c = kv_lora_rank, r = rope width):
    layers/wq [L, D, H*(nope+r)], or wq_a [L, D, q_lora] + q_a_norm [L, q_lora] +
      wq_b [L, q_lora, H*(nope+r)]
    layers/wkv_a [L, D, c+r]   kv_a_norm [L, c]   w_uk [L, H, c, nope]   w_uv [L, H, c, v]
    layers/wo [L, H*v, D]

  gated attention (Qwen3.5 / Qwen3-Next): layers/wg [L, D, H*hd], the output's gate
  linear attention (`linear_attention.py`; per layer, C = 2 kd + vd convolved channels):
    w_qkv [D, C]   conv [K, C]   w_b [D, Hv]   dt_bias   a_log [Hv]   lin_norm [dv]
    w_out [vd, D];  gated DeltaNet: w_z [D, vd]  w_a [D, Hv];  KDA: w_fa [D, dk]
    w_fb [dk, kd]  (dt_bias [kd])  w_ga [D, dv]  w_gb [dv, vd]
  Qwen3-Next's shared expert gate: layers/s_router [D, 1]

A model whose layers differ (DeepSeek-V3's first `first_k_dense_replace` layers are
dense, the rest MoE; a hybrid model's linear and attention layers) keeps `layers` as a
tuple of per-layer dicts (no L axis).

*A runner on XLA may give a tied model a [D, V] copy of embed.T as lm_head
(`xla_layout.untie_head`).

The forward is written once. Its `layout` argument (`Layout`, static) says how
products, attention and the layer loop are laid out; the default is this
module's plain reference, and `kernels/xla_layout.py` holds the forms the XLA
CPU backend runs faster (the runner picks one explicitly). Design notes:
docs/design.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specdec.kernels import linear_attention as la
from specdec.kernels import stacks
from specdec.kernels.config import ModelConfig
from specdec.kernels.linear_attention import LinearBlock, LinearState
from specdec.kernels.paged import PagedKVCache, from_stored, paged_rows, put_paged, row_tables

Params = dict

_NEG = -1e30  # finite "minus infinity": a fully masked row must not become NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V for a fixed number of sequence slots.

    k: jax.Array  # [L, slots, K, max_len, hd]
    v: jax.Array  # [L, slots, K, max_len, hd]  (MLA: width 0, `ModelConfig.cache_dims`)
    Which positions of a slot are valid is the caller's `cache_lens`, not stored here.
    A hybrid model's cache holds its attention layers' K/V only (L = its
    `num_cache_layers`) and its linear layers' states in `lin`.
    """

    k: jax.Array
    v: jax.Array
    lin: LinearState | None = None

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype=jnp.float32):
        shape = (cfg.num_cache_layers, num_slots, cfg.num_kv_heads, max_len)
        kd, vd = cfg.cache_dims
        lin = LinearState.create(cfg, num_slots, _state_dtype(dtype)) if cfg.is_hybrid else None
        return cls(k=jnp.zeros((*shape, kd), dtype), v=jnp.zeros((*shape, vd), dtype), lin=lin)


def _state_dtype(cache_dtype):
    """The convolution state's dtype for a cache of `cache_dtype` (uint16 holds
    bfloat16 bits in a paged cache; the state is small and kept as values)."""
    return jnp.bfloat16 if jnp.dtype(cache_dtype) == jnp.uint16 else cache_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridKV:
    """A hybrid model's block K/V: the attention layers' keys [La, B, N, K, hd] and the
    linear layers' per-token record (`LinearBlock`, leaves [Ll, B, N, ...]). Its values
    travel separately, as any model's do."""

    k: jax.Array
    lin: LinearBlock


def token_bytes(cfg: ModelConfig, dtype) -> int:
    """Cache bytes one token holds over all layers (K and V; MLA: its latent; a hybrid
    model's attention layers only: its linear layers hold a fixed state per sequence,
    `linear_attention.bytes_per_slot`)."""
    n = cfg.num_cache_layers
    return n * cfg.num_kv_heads * sum(cfg.cache_dims) * jnp.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- params


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, in the layout described in the module docstring:
    `layers` stacked ([L, ...] shapes) when every layer is alike, else a tuple of
    per-layer shape dicts."""
    if cfg.uniform_layers:
        layers = {k: (cfg.num_layers, *v) for k, v in cfg.layer_shapes(0).items()}
    else:
        layers = tuple(cfg.layer_shapes(i) for i in range(cfg.num_layers))
    d = cfg.hidden_size
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(v, int) for v in x)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights (normal, std 0.02), norms at one, biases at zero."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name in ("bq", "bk", "bv", "e_bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- pieces


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies f32[rotary_dim // 2], with Llama-3 or YaRN scaling when
    configured (`rotary_dim` < head_dim: partial RoPE, the other dims pass through)."""
    hd = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    old = rs.original_max_position_embeddings
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """YaRN: each frequency blends its interpolated value (divided by `factor`) and
    its original one by a linear ramp over the dimensions whose wavelengths fall
    between beta_fast and beta_slow rotations in the original context (float32
    steps, as transformers computes them)."""
    rs, dim, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(
        np.float32
    )

    def correction_dim(rotations):
        old = rs.original_max_position_embeddings
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolated = (1 - ramp).astype(np.float32)
    inv = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv.astype(np.float32)


def rope_scale(cfg: ModelConfig) -> float:
    """The factor on rotated dims: YaRN's attention factor (cos and sin are scaled by
    it), else 1."""
    rs = cfg.rope_scaling
    return rs.yarn_attention_factor() if rs is not None and rs.rope_type == "yarn" else 1.0


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x f32[..., D] normalised over the last axis, times weight [D]."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(jnp.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0
) -> jax.Array:
    """Rotate-half RoPE. x f32[B, N, heads, hd]; positions i32[B, N]; cos and sin
    times `scale` (`rope_scale`). Only the first 2 x len(inv_freq) dims rotate."""
    rot = 2 * inv_freq.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate(
            [apply_rope(x[..., :rot], positions, inv_freq, scale), x[..., rot:]], axis=-1
        )
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, N, hd/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] with inputs in w's dtype and f32 accumulation."""
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the forward lays out its products, attention and layer loop.

    This class is the plain reference: one [in, out] product per matrix,
    attention batched over K/V heads, layers under `lax.scan` (or unrolled when
    `params["layers"]` is a tuple of per-layer dicts, `unstack_layers`). Every
    forward function takes a layout as its static `layout` argument, so what is
    traced depends on the arguments alone. A runner may pass another layout
    that computes the same maths in a form its backend runs faster
    (`kernels/xla_layout.py`); tests compare the two.
    """

    # Mixture-of-experts layers: False runs only the experts a step routes to
    # (`routed_experts`); True every expert on every token (`dense_experts`, the
    # older form, kept as a baseline for tests and benchmarks).
    dense_experts: bool = False
    # The dtype products of weights held wider than the checkpoint's round their
    # inputs to (`xla_layout.widen`: experts, MLA up-projections); None = the weights'.
    narrow_dtype: str | None = None

    def weights_dtype(self, w: jax.Array) -> jnp.dtype:
        """The dtype of the checkpoint weights `w` holds (its own unless widened)."""
        return jnp.dtype(self.narrow_dtype or w.dtype)

    def head_matmul(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """einsum(spec, x, w) of a per-head weight w [H, ...] (a dot batched over heads),
        inputs in its dtype (rounded to the checkpoint's if widened), float32
        accumulation. XLA CPU has no 16-bit batched dot, so there the rounded inputs
        multiply as float32: the same sums (a product of two bfloat16 values is exact
        in float32)."""
        x = x.astype(self.weights_dtype(w)).astype(w.dtype)
        if w.dtype.itemsize < 4 and jax.default_backend() == "cpu":
            x, w = x.astype(jnp.float32), w.astype(jnp.float32)
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return matmul(x, w)

    def linear(self, p: dict, name: str, x: jax.Array) -> jax.Array:
        """x [..., in] @ p[name] [in, out]."""
        return self.matmul(x, p[name])

    def qkv(self, cfg: ModelConfig, lp: dict, h: jax.Array):
        """The q, k and v projections of h f32[B, N, D] (heads flattened)."""
        return self.linear(lp, "wq", h), self.linear(lp, "wk", h), self.linear(lp, "wv", h)

    def gate_up(self, lp: dict, h: jax.Array):
        """The gate and up projections of a dense MLP."""
        return self.linear(lp, "w_gate", h), self.linear(lp, "w_up", h)

    def attention(
        self,
        cfg: ModelConfig,
        q: jax.Array,  # f32[B, N, K, G, hd], scaled, RoPE applied
        k: jax.Array,  # f32[B, M, K, hd], RoPE applied: the block's keys (M = N, or a side buffer)
        v: jax.Array,  # f32[B, M, K, hd]
        k_cache: jax.Array | None,  # [B, K, T, hd] committed keys of each sequence
        v_cache: jax.Array | None,  # [B, K, T, hd]
        cache_mask: jax.Array | None,  # bool[B, N, T]
        block_mask: jax.Array,  # bool[B, N, M]
    ) -> jax.Array:  # f32[B, N, H * hd]
        b, n, kh, g, hd = q.shape
        s_block = jnp.einsum("bnkgd,bmkd->bkgnm", q, k)
        s_block = jnp.where(block_mask[:, None, None], s_block, _NEG)
        if k_cache is None:
            p = jax.nn.softmax(s_block, axis=-1)
            out = jnp.einsum("bkgnm,bmkd->bnkgd", p, v)
            return out.reshape(b, n, kh * g * hd)
        s_cache = jnp.einsum("bnkgd,bktd->bkgnt", q, k_cache.astype(jnp.float32))
        s_cache = jnp.where(cache_mask[:, None, None], s_cache, _NEG)
        p = jax.nn.softmax(jnp.concatenate([s_cache, s_block], axis=-1), axis=-1)
        t = k_cache.shape[2]
        out = jnp.einsum("bkgnt,bktd->bnkgd", p[..., :t], v_cache.astype(jnp.float32))
        out = out + jnp.einsum("bkgnm,bmkd->bnkgd", p[..., t:], v)
        return out.reshape(b, n, kh * g * hd)

    def cache_rows(self, arr, layer, rows, kv_len: int, keep) -> jax.Array:
        """Layer `layer`'s cache `rows` ([B, K, kv_len, hd], `_cache_rows`) in the form
        `attention` reads, zero where bool `keep` [B, 1, kv_len, 1] is false (so NaN or
        stale data in unused positions cannot leak through 0 * NaN)."""
        return _cache_rows(arr, layer, rows, kv_len, keep=keep)

    def over_layers(self, body, x, layers, side_k=None, side_v=None, taps=()):
        """Runs `body(x, (lp, i, sk, sv)) -> (x, (k, v))` over the layers, where i is
        the layer's index into the cache and sk / sv its side buffers (or None).
        Returns x and the K/V stacked [L, ...]; with `taps` (layer indices), also the
        residual after each of those layers, concatenated along features [..., n x D].

        Stacked params ([L, ...] leaves) run under `lax.scan` (one traced layer:
        what a kernel streams); a tuple of per-layer dicts is unrolled. A body may
        return a `LinearBlock` for a linear-attention layer's K (and None for V): the
        K/V are then the attention layers' only, the K a `HybridKV` with the records."""
        if isinstance(layers, (tuple, list)):
            ks, vs, recs, tapped = [], [], [], {}
            for i, lp in enumerate(layers):
                sk = None if side_k is None else side_k[i]
                sv = None if side_v is None else side_v[i]
                x, (k, v) = body(x, (lp, i, sk, sv))
                if i in taps:
                    tapped[i] = x
                if isinstance(k, LinearBlock):  # a linear-attention layer's record
                    recs.append(k)
                else:
                    ks.append(k)
                    vs.append(v)
            if recs:  # a hybrid model (`HybridKV`)
                lin = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *recs)
                out = (x, HybridKV(k=jnp.stack(ks), lin=lin), jnp.stack(vs))
            else:
                out = (x, jnp.stack(ks), jnp.stack(vs))
            if not taps:
                return out
            return (*out, jnp.concatenate([tapped[i] for i in taps], axis=-1))
        n = next(iter(layers.values())).shape[0]
        if not taps:
            x, (ks, vs) = jax.lax.scan(body, x, (layers, jnp.arange(n), side_k, side_v))
            return x, ks, vs

        def keep_x(x, layer):
            x, kv = body(x, layer)
            return x, (kv, x)

        x, ((ks, vs), xs) = jax.lax.scan(keep_x, x, (layers, jnp.arange(n), side_k, side_v))
        return x, ks, vs, jnp.concatenate([xs[i] for i in taps], axis=-1)


REFERENCE = Layout()


def _mlp(cfg: ModelConfig, lp: dict, h: jax.Array, layout: Layout) -> jax.Array:
    if "router" not in lp:  # a dense layer (every layer of a dense model)
        gate, up = layout.gate_up(lp, h)
        return layout.linear(lp, "w_down", jax.nn.silu(gate) * up)
    top_w, top_i = route(cfg, lp, h, layout)
    experts = dense_experts if layout.dense_experts else routed_experts
    out = experts(lp, h, top_w, top_i, layout.weights_dtype(lp["e_gate"]))
    if "s_gate" in lp:  # shared experts: an MLP every token runs, added after the routed
        act = jax.nn.silu(layout.linear(lp, "s_gate", h)) * layout.linear(lp, "s_up", h)
        shared = layout.linear(lp, "s_down", act)
        if "s_router" in lp:  # Qwen3-Next: the shared expert's own sigmoid gate
            shared = shared * jax.nn.sigmoid(layout.linear(lp, "s_router", h))
        out = out + shared
    return out


def route(cfg: ModelConfig, lp: dict, h: jax.Array, layout: Layout = REFERENCE):
    """Each token's experts: (weights f32[..., k], indices i32[..., k]) for h [..., D].

    Qwen3-MoE (`scoring_func="softmax"`): softmax over the router logits, the top k.
    DeepSeek-V3 (`"sigmoid"`): sigmoid scores; the choice adds the correction bias
    (`e_bias`) and, with `n_group` > 1, keeps the experts of the `topk_group` groups
    whose two best biased scores sum highest; the weights are the chosen experts'
    unbiased scores. Then renormalised to sum to 1 when `norm_topk_prob`, scaled by
    `routed_scaling_factor`, and rounded to the experts' dtype (the reference
    implementations multiply in it)."""
    k = cfg.num_experts_per_tok
    logits = layout.matmul(h, lp["router"])  # f32[..., E]
    if cfg.scoring_func == "softmax":
        top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + lp["e_bias"].astype(jnp.float32) if "e_bias" in lp else scores
        if cfg.n_group > 1:
            grouped = choice.reshape(*choice.shape[:-1], cfg.n_group, -1)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [..., n_group]
            _, best = jax.lax.top_k(group_score, cfg.topk_group)
            keep = jnp.any(jax.nn.one_hot(best, cfg.n_group, dtype=bool), axis=-2)
            choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
        _, top_i = jax.lax.top_k(choice, k)
        top_w = jnp.take_along_axis(scores, top_i, axis=-1)
    if cfg.norm_topk_prob:
        denom = jnp.sum(top_w, axis=-1, keepdims=True)
        top_w = top_w / (denom + 1e-20 if cfg.scoring_func == "sigmoid" else denom)
    top_w = top_w * cfg.routed_scaling_factor
    return top_w.astype(layout.weights_dtype(lp["e_gate"])).astype(jnp.float32), top_i


def _expert_mlp(lp: dict, e, x: jax.Array, dtype) -> jax.Array:
    """Expert e's SwiGLU MLP of x [m, D] (e may be traced: its weights are sliced), its
    inputs rounded to the experts' `dtype`."""
    w = {k: jax.lax.dynamic_index_in_dim(lp[k], e, 0, keepdims=False)
         for k in ("e_gate", "e_up", "e_down")}  # fmt: skip
    act = jax.nn.silu(matmul(x, w["e_gate"])) * matmul(x, w["e_up"])
    return matmul(act.astype(dtype).astype(w["e_down"].dtype), w["e_down"])


def dense_experts(lp: dict, h, top_w, top_i, dtype=None) -> jax.Array:
    """Every expert on every token, then weighted: reads every expert's weights each
    step (E / k times the products a token needs). Inputs rounded to `dtype`
    (default: the experts')."""
    dtype = lp["e_gate"].dtype if dtype is None else dtype
    n_e = lp["e_gate"].shape[-3]
    weights = jnp.sum(jax.nn.one_hot(top_i, n_e) * top_w[..., None], axis=-2)  # [..., E]
    hx = h.astype(dtype).astype(lp["e_gate"].dtype)
    gate = jnp.einsum("...d,edf->...ef", hx, lp["e_gate"], preferred_element_type=jnp.float32)
    up = jnp.einsum("...d,edf->...ef", hx, lp["e_up"], preferred_element_type=jnp.float32)
    act = (jax.nn.silu(gate) * up).astype(dtype).astype(lp["e_down"].dtype)
    out = jnp.einsum("...ef,efd->...ed", act, lp["e_down"], preferred_element_type=jnp.float32)
    return jnp.einsum("...e,...ed->...d", weights, out)


def routed_experts(lp: dict, h, top_w, top_i, dtype=None) -> jax.Array:
    """Only the experts the tokens route to, each on only its tokens (inputs rounded to
    `dtype`, default the experts').

    The (token, expert) pairs are sorted by expert and cut into tiles of m pairs,
    none spanning two experts; a loop over the tiles that exist (a traced count)
    slices one expert's weights and runs its MLP on the tile's gathered rows, then
    adds them back weighted. A step therefore reads each routed expert's weights
    once per tile (once for a decode or verify step, whose experts see a few tokens
    each) and computes k products per token plus the tiles' padding, where the
    dense form reads all E experts and computes E per token. Per token the experts'
    outputs add up in expert order, as the reference implementation's loop does.
    """
    shape = h.shape
    d = shape[-1]
    x = h.reshape(-1, d)
    t, k = x.shape[0], top_i.shape[-1]
    n_e = lp["e_gate"].shape[-3]
    p = t * k
    # Rows a tile holds: twice the mean pairs per expert, rounded up to a power of two,
    # at most 64. In a decode or verify step most routed experts see one or two
    # tokens, so a tile of ~T rows (the old size) spent nearly all its products on
    # padding; at twice the mean most experts still take one tile each (their weights
    # read once: what such a step costs), and a prefill's tiles stay wide enough to be
    # efficient products.
    m = min(64, 1 << (max(1, -(-2 * p // n_e)) - 1).bit_length())
    flat_e = top_i.reshape(p)
    order = jnp.argsort(flat_e, stable=True)
    tok = (jnp.arange(p, dtype=jnp.int32) // k)[order]  # the sorted pairs' tokens
    wts = top_w.reshape(p)[order]
    counts = jnp.zeros(n_e, jnp.int32).at[flat_e].add(1)
    starts = jnp.cumsum(counts) - counts  # first sorted pair of each expert
    tiles = -(-counts // m)
    max_tiles = -(-p // m) + min(n_e, p)  # sum of ceil(c / m) over the routed experts
    tile_e = jnp.repeat(jnp.arange(n_e, dtype=jnp.int32), tiles, total_repeat_length=max_tiles)
    first_tile = jnp.cumsum(tiles) - tiles
    row0 = starts[tile_e] + (jnp.arange(max_tiles, dtype=jnp.int32) - first_tile[tile_e]) * m
    row_end = starts[tile_e] + counts[tile_e]
    dtype = lp["e_gate"].dtype if dtype is None else dtype

    def tile(j, acc):
        idx = row0[j] + jnp.arange(m, dtype=jnp.int32)
        valid = idx < row_end[j]
        idx = jnp.minimum(idx, p - 1)
        rows, w = tok[idx], jnp.where(valid, wts[idx], 0.0)
        y = _expert_mlp(lp, tile_e[j], x[rows].astype(dtype), dtype)
        return acc.at[rows].add(w[:, None] * y)  # padding rows add 0 to a real row

    out = jax.lax.fori_loop(0, jnp.sum(tiles), tile, jnp.zeros((t, d), jnp.float32))
    return out.reshape(shape)


def _layer(cfg, inv_freq, positions, cache_mask, block_mask, x, lp, k_cache, v_cache, side,
           layout: Layout, lin=None):  # fmt: skip
    """One decoder layer. Returns the new residual and this block's (k, v).

    With `side` = (k_side, v_side [B, S, K, hd], at): the block's K/V are put at
    side positions [at, at + N) and attention reads the whole side buffer
    (`block_mask` is then bool[B, N, S]); the updated buffers are returned.
    A linear-attention layer (`lin` = (path mask, convolution sources from
    `linear_attention.ancestor_sources`, conv state, recurrent state) of its rows)
    returns its `LinearBlock` record and None in place of (k, v).
    """
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    if lin is not None:
        out, rec = _deltanet(cfg, lp, h, positions, *lin, layout)
        x = x + out
        x = x + _mlp(cfg, lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), layout)
        return x, rec, None
    qkv = _mla_qkv if cfg.is_mla else _gqa_qkv
    q, k, v = qkv(cfg, lp, h, positions, inv_freq, layout)
    if side is not None:
        k_side, v_side, at = side
        k = jax.lax.dynamic_update_slice_in_dim(k_side, k.astype(k_side.dtype), at, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(v_side, v.astype(v_side.dtype), at, axis=1)
    if cfg.is_mla:  # the values are the latent: the keys' first kv_lora_rank entries
        attn = layout.attention(cfg, q, k, k, k_cache, k_cache, cache_mask, block_mask)
        attn = _mla_values(cfg, lp, attn, layout)
    else:
        attn = layout.attention(cfg, q, k, v, k_cache, v_cache, cache_mask, block_mask)
    if "wg" in lp:  # gated attention (Qwen3.5 / Qwen3-Next): per-channel sigmoid gate
        attn = attn * jax.nn.sigmoid(layout.linear(lp, "wg", h))
    x = x + layout.linear(lp, "wo", attn)
    x = x + _mlp(cfg, lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), layout)
    return x, k, v


def _deltanet(cfg, lp, h, positions, path, sources, conv0, s0, layout: Layout):
    """A gated DeltaNet token mixer over a block (`linear_attention`): returns its
    output f32[B, N, D] and the block's `LinearBlock` record."""
    b, n, _ = h.shape
    kd, vd, _ = cfg.linear_dims
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if "w_qkv" in lp:  # [B, N, 2 kd + vd], the convolution's input
        x = layout.linear(lp, "w_qkv", h)
    else:  # the megakernel's stacks keep q / k / v apart (`linear_attention.per_layer`)
        x = jnp.concatenate([layout.linear(lp, f"w_l{p}", h) for p in "qkv"], axis=-1)
    beta = jax.nn.sigmoid(layout.linear(lp, "w_b", h))
    decay_rate = jnp.exp(lp["a_log"].astype(jnp.float32))
    if cfg.linear_kind == "kda":  # one decay per key channel, low-rank gates
        f = layout.linear(lp, "w_fb", layout.linear(lp, "w_fa", h))
        f = (f + lp["dt_bias"].astype(jnp.float32)).reshape(b, n, hk, dk)
        g = -decay_rate[:, None] * jax.nn.softplus(f)  # [B, N, H, dk], log-decay <= 0
        z = layout.linear(lp, "w_gb", layout.linear(lp, "w_ga", h)).reshape(b, n, hv, dv)
        gate = jax.nn.sigmoid
    else:
        z = layout.linear(lp, "w_z", h).reshape(b, n, hv, dv)
        a = layout.linear(lp, "w_a", h) + lp["dt_bias"].astype(jnp.float32)
        g = -decay_rate * jax.nn.softplus(a)  # [B, N, Hv], log-decay <= 0
        gate = jax.nn.silu
    xc = la.causal_conv(x, conv0, lp["conv"], sources)
    r = hv // hk  # each key head serves r consecutive value heads
    q = jnp.repeat(la.l2norm(xc[..., :kd].reshape(b, n, hk, dk)), r, axis=2) * dk**-0.5
    k = jnp.repeat(la.l2norm(xc[..., kd : 2 * kd].reshape(b, n, hk, dk)), r, axis=2)
    v = xc[..., 2 * kd :].reshape(b, n, hv, dv)
    o, u, big_g = la.gated_delta_block(q, k, v, g, beta, s0, path)
    o = rms_norm(o, lp["lin_norm"], cfg.rms_norm_eps) * gate(z)
    out = layout.linear(lp, "w_out", o.reshape(b, n, vd))
    return out, LinearBlock(x=x, k=k, u=u, g=big_g)


def _linear_rows(cfg, cache, slots, cache_lens, b: int):
    """Per linear layer, the (conv, recurrent) states its rows start from: the slots'
    committed states, zeros for rows at length 0 or without a cache."""
    n = len(cfg.linear_layers)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    taps, c = cfg.linear_conv_kernel_dim, cfg.linear_dims[2]
    if cache is None or cache.lin is None:
        conv = jnp.zeros((n, b, taps - 1, c), jnp.float32)
        return conv, jnp.zeros((n, b, hv, dk, dv), jnp.float32)
    safe = jnp.clip(slots, 0, cache.num_slots - 1)
    fresh = cache_lens == 0
    conv = jnp.where(fresh[None, :, None, None], 0.0, cache.lin.conv[:, safe].astype(jnp.float32))
    rec = jnp.where(fresh[None, :, None, None, None], 0.0, cache.lin.rec[:, safe])
    return conv, rec


def _gqa_qkv(cfg, lp, h, positions, inv_freq, layout: Layout):
    """Grouped-query attention's q f32[B, N, K, G, hd] (scaled) and k, v [B, N, K, hd]."""
    b, n, _ = h.shape
    hd, kh = cfg.head_dim, cfg.num_kv_heads
    q, k, v = layout.qkv(cfg, lp, h)
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, n, cfg.num_heads, hd)
    k = k.reshape(b, n, kh, hd)
    v = v.reshape(b, n, kh, hd)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    scale = rope_scale(cfg)
    q = apply_rope(q, positions, inv_freq, scale)
    k = apply_rope(k, positions, inv_freq, scale)
    qg = q.reshape(b, n, kh, cfg.num_heads // kh, hd) * (1.0 / math.sqrt(hd))
    return qg, k, v


def _mla_qkv(cfg, lp, h, positions, inv_freq, layout: Layout):
    """Multi-head latent attention in its absorbed form, as multi-query attention over
    one latent per token: q f32[B, N, 1, H, c + r] (scaled), k [B, N, 1, c + r], v
    empty [B, N, 1, 0] (c = kv_lora_rank, r = rotary width).

    A head's score is q_nope . (W_uk c) + q_rope . k_rope = (W_uk^T q_nope) . c +
    q_rope . k_rope, so the key up-projection folds into the query and the cache keeps
    only [c, k_rope] (`ModelConfig.cache_dims`): c + r values per token and layer in
    place of H x (nope + r + v). Every step (prefill too) uses this form: the
    expanded one would need the per-head keys of the whole context."""
    b, n, _ = h.shape
    nope, r, c = cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
    if "wq_a" in lp:
        q = layout.linear(lp, "wq_b", rms_norm(layout.linear(lp, "wq_a", h), lp["q_a_norm"],
                                                cfg.rms_norm_eps))  # fmt: skip
    else:
        q = layout.linear(lp, "wq", h)
    q = q.reshape(b, n, cfg.num_heads, nope + r)
    kv = layout.linear(lp, "wkv_a", h)  # [B, N, c + r (+ the megakernel's zero padding)]
    latent = rms_norm(kv[..., :c], lp["kv_a_norm"], cfg.rms_norm_eps)
    q_rope, k_rope = q[..., nope:], kv[:, :, c : c + r]
    if cfg.use_rope:  # Kimi Linear's MLA has no positions: its "rope" dims stay as they are
        scale = rope_scale(cfg)
        q_rope = apply_rope(q_rope, positions, inv_freq, scale)
        k_rope = apply_rope(k_rope[:, :, None], positions, inv_freq, scale)[:, :, 0]
    q_lat = layout.head_matmul("bnhd,hcd->bnhc", q[..., :nope], lp["w_uk"])  # w_uk [H, c, nope]
    q = jnp.concatenate([q_lat, q_rope], axis=-1) * cfg.softmax_scale
    k = jnp.concatenate([latent, k_rope], axis=-1)[:, :, None]
    return q[:, :, None], k, jnp.zeros((b, n, 1, 0), jnp.float32)


def _mla_values(cfg, lp, attn: jax.Array, layout: Layout) -> jax.Array:
    """Per-head attention outputs over the latent, f32[B, N, H * (c + r)], through the
    value up-projection: f32[B, N, H * v_head_dim]."""
    b, n, _ = attn.shape
    lat = attn.reshape(b, n, cfg.num_heads, -1)[..., : cfg.kv_lora_rank]
    out = layout.head_matmul("bnhc,hcv->bnhv", lat, lp["w_uv"])  # w_uv [H, c, v]
    return out.reshape(b, n, -1)


def lm_head(cfg: ModelConfig, params: Params, x: jax.Array, layout: Layout = REFERENCE):
    """Final norm + vocabulary projection: x f32[..., D] -> logits f32[..., V]."""
    return head_logits(cfg, params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps), layout)


def head_logits(cfg: ModelConfig, params: Params, h: jax.Array, layout: Layout = REFERENCE):
    """The vocabulary projection alone (no final norm): h f32[..., D] -> f32[..., V]; a
    block drafter's normed states go through the target's head this way."""
    if "lm_head" in params:  # untied, or a tied model's [D, V] copy (`xla_layout.untie_head`)
        logits = layout.linear(params, "lm_head", h)
    else:
        logits = layout.matmul(h, params["embed"].T)
    # A head padded to a multiple of n x 128 entries (`megakernel.shard.pad_head`)
    # serves every forward: its padded columns are dropped here.
    return logits[..., : cfg.vocab_size]


# ----------------------------------------------------------------------------- forward


def _hidden_block(
    cfg, params, tokens, positions, block_mask, cache, slots, cache_lens, cache_mask=None,
    kv_len=None, side=None, layout: Layout = REFERENCE, taps: tuple[int, ...] = (),
):  # fmt: skip
    """Runs all layers; returns final residual f32[B, N, D] and new K/V [L, B, N, K, hd]
    (and with `taps`, the features `block_logits_kv` describes).

    Only the first `kv_len` cache positions are read (default: all of them).
    `side` (see `block_logits_kv`) replaces the block's own keys by a side buffer.
    """
    out = _run_layers(cfg, params, tokens, positions, block_mask, cache, slots, cache_lens,
                      cache_mask, kv_len, side, layout, taps)  # fmt: skip
    if not taps:
        return out
    x, ks, vs, feats = out
    return x, ks, vs, norm_last_tap(cfg, params, feats, taps)


def norm_last_tap(cfg: ModelConfig, params: Params, feats: jax.Array, taps) -> jax.Array:
    """Features f32[..., len(taps) x D] with the last layer's (if tapped) after the final
    norm: transformers' last hidden state is the final norm's output. The XLA forward
    and the verify megakernel both return features this way."""
    last = cfg.num_layers - 1
    if last not in taps:
        return feats
    d = feats.shape[-1] // len(taps)
    at = slice(taps.index(last) * d, (taps.index(last) + 1) * d)
    return feats.at[..., at].set(rms_norm(feats[..., at], params["final_norm"], cfg.rms_norm_eps))


def _run_layers(cfg, params, tokens, positions, block_mask, cache, slots, cache_lens, cache_mask,
                kv_len, side, layout: Layout, taps: tuple[int, ...]):  # fmt: skip
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    x = params["embed"][tokens].astype(jnp.float32)
    if "lin" in params:  # a hybrid model held as the megakernel's stacks
        params = {**params, "layers": la.per_layer(cfg, params)}
    elif stacks.is_mixed_moe(cfg) and isinstance(params["layers"], dict):
        params = {**params, "layers": stacks.per_layer(cfg, params["layers"])}
    lin_rows = None
    if cfg.is_hybrid:
        if side is not None:
            raise ValueError("side buffers (a drafter's tree levels) do not support "
                             "linear-attention layers")  # fmt: skip
        b = tokens.shape[0]
        lens = jnp.zeros((b,), jnp.int32) if cache_lens is None else cache_lens
        conv0, s0 = _linear_rows(cfg, cache, slots, lens, b)
        path = block_mask
        # Where each node's convolution inputs live: the same for every linear layer.
        sources = la.ancestor_sources(path, positions, lens, cfg.linear_conv_kernel_dim)

        def lin_rows(i):
            if not cfg.linear_layer(i):
                return None
            li = cfg.cache_layer(i)
            return path, sources, conv0[li], s0[li]

    key_positions = positions if side is None else side.positions
    if cfg.sliding_window is not None:
        w = cfg.sliding_window
        block_mask = block_mask & (positions[:, :, None] - key_positions[:, None, :] < w)
    if cache is None:
        if side is not None:
            raise ValueError("a side buffer needs a cache")

        def body(x, layer):
            lin = None if lin_rows is None else lin_rows(layer[1])
            x, k, v = _layer(cfg, inv_freq, positions, None, block_mask, x, layer[0], None, None,
                             None, layout, lin)  # fmt: skip
            return x, (k, v)

        return layout.over_layers(body, x, params["layers"], taps=taps)

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
    if isinstance(cache, PagedKVCache):  # the rows' first blocks; padding rows read block 0
        rows = row_tables(cache.table, slots, -(-kv_len // cache.block_size))
    else:
        rows = jnp.clip(slots, 0, cache.num_slots - 1)

    def body(x, layer):
        lp, i, sk, sv = layer  # i: the layer's index (traced under scan)
        lin = None if lin_rows is None else lin_rows(i)
        if lin is not None:
            x, rec, _ = _layer(cfg, inv_freq, positions, None, block_mask, x, lp, None, None,
                               None, layout, lin)  # fmt: skip
            return x, (rec, None)
        ci = cfg.cache_layer(i) if cfg.is_hybrid else i  # its index into the K/V cache
        kc = layout.cache_rows(cache.k, ci, rows, kv_len, keep)
        vc = None if cfg.is_mla else layout.cache_rows(cache.v, ci, rows, kv_len, keep)
        side_l = None if side is None else (sk, sv, side.at)
        x, k, v = _layer(cfg, inv_freq, positions, cache_mask, block_mask, x, lp, kc, vc, side_l,
                         layout)  # fmt: skip
        return x, (k, v)

    sk, sv = (None, None) if side is None else (side.k, side.v)
    return layout.over_layers(body, x, params["layers"], sk, sv, taps=taps)


def _cache_rows(
    arr: jax.Array, layer, rows: jax.Array, kv_len: int, head: int | None = None, keep=None
) -> jax.Array:
    """Cache rows [B, K, kv_len, hd] of layer `layer`, or with `head` just that K/V
    head's [B, kv_len, hd]. `rows` are the rows' slots i32[B] in a slot cache
    [L, S, K, T, hd], or their first blocks i32[B, nb] in a paged pool (`paged.paged_rows`).
    Zero where bool `keep` (broadcast against the result) is false, applied to the
    stored bits (a bfloat16 select on XLA CPU goes through float32).

    One contiguous slice per row, straight from a slot cache: slicing `[..., :kv_len]`
    first and then picking rows with an index-array gather (an element-wise loop
    on XLA CPU) would copy the cache twice.
    """
    if rows.ndim == 2:
        out = paged_rows(arr, layer, rows, kv_len, head)
    else:
        _, _, k, _, hd = arr.shape
        at, size = (0, k) if head is None else (head, 1)
        out = jnp.stack([
            jax.lax.dynamic_slice(arr, (layer, rows[b], at, 0, 0), (1, 1, size, kv_len, hd))[0, 0]
            for b in range(rows.shape[0])
        ])  # fmt: skip
        out = out if head is None else out[:, 0]
    if keep is not None:
        out = jnp.where(keep, out, jnp.zeros((), out.dtype))
    return from_stored(out)


def unstack_layers(params: Params) -> Params:
    """The same params with `layers` as a tuple of per-layer dicts (`Layout.over_layers`
    unrolls them; XLA on CPU copies each scanned slice of stacked weights)."""
    stacked = params["layers"]
    if isinstance(stacked, (tuple, list)):
        return params
    n = next(iter(stacked.values())).shape[0]
    layers = tuple({k: v[i] for k, v in stacked.items()} for i in range(n))
    return {**params, "layers": layers}


def _put_rows(cache: KVCache, k_rows, v_rows, slots, starts) -> KVCache:
    """Writes k_rows[b] / v_rows[b] ([L, K, n, hd]) at positions starts[b] .. + n of slots[b].

    One in-place `dynamic_update_slice` per row (a scatter with advanced indices
    rebuilt the whole cache).
    Rows with slot < 0 write back what is there. The caller keeps
    `starts[b] + n <= max_len` for live rows (slices are clamped, not dropped).
    """

    def row(b, kv):
        k, v = kv
        live = slots[b] >= 0
        at = (0, jnp.maximum(slots[b], 0), 0, starts[b], 0)

        def put(cache_arr, new):
            if cache_arr.shape[-1] == 0:  # MLA's empty V
                return cache_arr
            shape = (*cache_arr.shape[:1], 1, cache_arr.shape[2], new.shape[2], cache_arr.shape[4])
            old = jax.lax.dynamic_slice(cache_arr, at, shape)
            upd = jnp.where(live, new[:, None].astype(cache_arr.dtype), old)
            return jax.lax.dynamic_update_slice(cache_arr, upd, at)

        return put(k, k_rows[b]), put(v, v_rows[b])

    if isinstance(cache, PagedKVCache):
        return put_paged(cache, k_rows, v_rows, slots, starts)
    kv = (cache.k, cache.v)
    for b in range(slots.shape[0]):  # unrolled: a while loop would copy the cache (XLA CPU)
        kv = row(b, kv)
    return dataclasses.replace(cache, k=kv[0], v=kv[1])


def _write_block(cache: KVCache, ks, vs, slots, cache_lens, counts=None) -> KVCache:
    """Writes block K/V [L, B, N, K, hd] at positions cache_lens[b] + i of slots[b].

    Padding rows (slot = -1) never change the cache. A hybrid model's linear layers
    (`HybridKV`) advance their state by each row's first counts[b] tokens (default:
    all N: state, unlike K/V, has no "beyond the new length" to leave junk in).
    """
    if isinstance(ks, HybridKV):
        lin, ks = ks.lin, ks.k
        if counts is None:
            counts = jnp.full(slots.shape, lin.g.shape[2], jnp.int32)
        cache = dataclasses.replace(
            cache, lin=la.commit_states(cache.lin, lin, slots, cache_lens, counts)
        )
    k_rows = jnp.moveaxis(ks, 1, 0).transpose(0, 1, 3, 2, 4)  # [B, L, K, N, hd]
    v_rows = jnp.moveaxis(vs, 1, 0).transpose(0, 1, 3, 2, 4)
    return _put_rows(cache, k_rows, v_rows, slots, cache_lens)


@functools.partial(jax.jit, static_argnames=("cfg", "kv_len", "layout"), donate_argnames=("cache",))
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
    layout: Layout = REFERENCE,
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
        cache_mask, cfg=cfg, kv_len=kv_len, layout=layout,
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
        shape = (cfg.num_layers, b, s, cfg.num_kv_heads)
        kd, vd = cfg.cache_dims
        return cls(jnp.zeros((*shape, kd), jnp.float32), jnp.zeros((*shape, vd), jnp.float32),
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
    layout: Layout = REFERENCE,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, ...]:
    """`forward_block` without the cache write: (logits, k, v), K/V [L, B, N, K, hd].

    With `taps` (layer indices), a fourth result: each tapped layer's output for every
    block token, concatenated f32[B, N, len(taps) x D], as transformers' hidden_states[i
    + 1] (the last layer's is after the final norm): what a block drafter reads.

    The cache is only read, so a caller can write just what it keeps, in its own
    donated call (`write_kv`): XLA on CPU copies the whole cache when one program
    both reads it and updates it in place.
    With `side`, the block's K/V go into the side buffer at `side.at` and the
    returned K/V are the whole updated buffers [L, B, S, K, hd].
    """
    x, ks, vs, *feats = _hidden_block(
        cfg, params, tokens, positions, block_mask, cache, slots, cache_lens, cache_mask, kv_len,
        side, layout, taps,
    )  # fmt: skip
    if logit_index is not None:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)
    return (lm_head(cfg, params, x, layout), ks, vs, *feats)


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_kv(
    cache: KVCache,
    ks: jax.Array,  # [L, B, N, K, hd]
    vs: jax.Array,  # [L, B, N, K, hd]
    slots: jax.Array,  # i32[B], -1 = write nothing
    starts: jax.Array,  # i32[B] first cache position to write
    keep: jax.Array | None = None,  # i32[B, M] block indices to keep, in order (None = all)
    counts: jax.Array | None = None,  # i32[B] real entries of each row (hybrid models)
) -> KVCache:
    """Writes block K/V (or the `keep` entries of it) at positions starts[b], starts[b] + 1, ...

    Example: a verify block [root, n0, n1, n2] with accepted path n0 -> n2 keeps
    block indices [0, 1, 3]: root, n0, n2 land at c, c + 1, c + 2. Entries past a
    row's real path are written too; they lie beyond its new length (ignored).
    A hybrid model's linear layers (`HybridKV`) advance their state by the first
    counts[b] (kept) entries only, so they need `counts` whenever a row's block is
    shorter than N (a padded prefill chunk, a partly accepted tree).
    """
    if keep is not None:
        take = jax.vmap(lambda a, idx: a[:, idx], in_axes=(1, 0), out_axes=1)
        ks, vs = jax.tree_util.tree_map(lambda a: take(a, keep), (ks, vs))
    return _write_block(cache, ks, vs, slots, starts, counts)


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_kv(
    cache: KVCache,
    slots: jax.Array,  # i32[B]; -1 = padding row
    cache_lens: jax.Array,  # i32[B] committed length before the step (root's K/V slot)
    src: jax.Array,  # i32[B, P] block index of the accepted node at depth d (d = 1..P)
    num: jax.Array,  # i32[B] accepted nodes per row (<= P)
    lin: LinearBlock | None = None,  # a hybrid model's verify-block record [Ll, B, N+1, ...]
) -> KVCache:
    """Moves accepted tree nodes' K/V to their committed positions (and, for a hybrid
    model, advances its linear layers' state along the root and the accepted path from
    the block's record `lin`).

    After a verify block [root, node_0, ...] at cache_lens c, node i's K/V sits
    at c + 1 + i; the node accepted at depth d belongs at c + d. Example:
    accepted nodes [0, 2] (src = block indices [1, 3]) with c = 7 -> copies
    slot 8 -> 8 and 10 -> 9. Sources are never below targets (topological order),
    so reading all sources before writing is safe.
    """
    if cache.lin is not None:
        if lin is None:
            raise ValueError(
                "A hybrid model's cache needs the verify block's record (lin=) to commit "
                "its linear layers' state along the accepted path."
            )
        keep = jnp.concatenate([jnp.zeros_like(src[:, :1]), src], axis=1)  # root first
        take = jax.vmap(lambda a, idx: a[:, idx], in_axes=(1, 0), out_axes=1)
        kept = jax.tree_util.tree_map(lambda a: take(a, keep), lin)
        state = la.commit_states(cache.lin, kept, slots, cache_lens, num + 1)
        cache = dataclasses.replace(cache, lin=state)
    # positions past the accepted path are beyond the new length: free to overwrite
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


def prefill_logits(
    params: Params, cfg: ModelConfig, tokens, lengths, layout: Layout = REFERENCE
) -> jax.Array:
    """Logits f32[B, T, V] for a right-padded ragged batch (tokens i32[B, T], lengths i32[B]).

    Positions at or beyond a row's length hold meaningless values.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    b, t = tokens.shape
    cache = KVCache.create(cfg, b, t, dtype=jnp.float32)  # the reference keeps K/V exact
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
        layout=layout,
    )
    return logits
