"""The forward's layouts for the jitted XLA path: the reference's maths, in the forms
XLA's CPU backend runs fastest.

`transformer.py` computes every forward through a `Layout`; its own is the plain
reference. A `ModelRunner` that is not feeding the megakernel arranges its params
and picks an `XlaLayout` here (`arrange`), and passes that layout explicitly to
every forward it runs. What changes, and why (each a property of XLA on CPU, not
of one machine's timings):

* **Per-layer weights** (`transformer.unstack_layers`): XLA copies each scanned
  slice of stacked weights; unrolled static slices are read in place.
* **Fused projections** (`fuse_projections`, opt-in): q|k|v and gate|up as one
  product each, for small models whose products cost their dispatch more than
  their bytes (the bundled draft).
* **An untied LM head** (`untie_head`): XLA's Eigen GEMM reads a transposed
  operand slowly, so a tied model gets a [D, V] copy of `embed.T` on CPU.
* **One-row copies** (`one_row_copies`): a one-row product reads an [out, in]
  matrix (each output one contiguous dot) faster than an [in, out] one, while
  products of more rows are slower that way. A one-slot float32 runner gets an
  [out, in] copy of each layer matrix and the head under `params[...]["one_row"]`,
  which `linear` reads only for one-row inputs.
* **Two-row bfloat16 products** (`two_row_bf16`): XLA CPU runs a one-row bfloat16
  product as a slow matrix-vector loop, so one row is computed as two (the second
  zero) and the first kept.
* **Attention one K/V head at a time** (`per_kv_head`): a dot batched over
  (row, K/V head) runs as a loop of tiny products; one product per K/V head
  (batched over rows only) does not. Past `PER_HEAD_MAX` heads the unrolled loop
  would bloat the program, so the batched form is kept.
* **Keys copied out transposed** (`keys_transposed`): for programs compiled for
  Eigen (`dot_library`), which reads a transposed operand slowly.

Every form computes the same sums; tests/test_transformer.py and
tests/test_dot_library.py compare each against the reference.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specdec.kernels.config import ModelConfig
from specdec.kernels.transformer import (
    _NEG,
    Layout,
    Params,
    _cache_rows,
    matmul,
    param_shapes,
    unstack_layers,
)

# Layer matrices `one_row_copies` copies.
ONE_ROW_KEYS = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")
# At most this many bytes of one-row copies (they double the weights they copy).
ONE_ROW_MAX_BYTES = 2 << 30
# Attention over a cache runs one K/V head at a time up to this many K/V heads.
PER_HEAD_MAX = 8


@dataclasses.dataclass(frozen=True)
class XlaLayout(Layout):
    """The reference forward laid out for XLA (module docstring). Hashable: it is a
    static argument of every jitted forward."""

    per_kv_head: bool = False  # attention over a cache one K/V head at a time
    keys_transposed: bool = False  # per-head scores against keys copied out [hd, T]
    two_row_bf16: bool = False  # one bfloat16 row computed as two

    def for_library(self, library: str) -> XlaLayout:
        """This layout for a program compiled for dot `library` (`dot_library`)."""
        return dataclasses.replace(self, keys_transposed=self.per_kv_head and library == "eigen")

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        x = x.astype(w.dtype)
        if self.two_row_bf16 and math.prod(x.shape[:-1]) == 1 and w.dtype == jnp.bfloat16:
            two = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
            out = jnp.matmul(two, w, preferred_element_type=jnp.float32)[:1]
            return out.reshape(*x.shape[:-1], w.shape[-1])
        return matmul(x, w)

    def linear(self, p: dict, name: str, x: jax.Array) -> jax.Array:
        """x [..., in] @ p[name]; a one-row x reads the [out, in] copy where
        `one_row_copies` made one."""
        w_t = p.get("one_row", {}).get(name)
        if w_t is None or math.prod(x.shape[:-1]) != 1:
            return self.matmul(x, p[name])
        out = jnp.einsum("oi,ni->no", w_t, x.reshape(1, -1).astype(w_t.dtype),
                         preferred_element_type=jnp.float32)  # fmt: skip
        return out.reshape(*x.shape[:-1], w_t.shape[0])

    def qkv(self, cfg: ModelConfig, lp: dict, h: jax.Array):
        if "wqkv" not in lp:
            return super().qkv(cfg, lp, h)
        qkv = self.linear(lp, "wqkv", h)
        nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]

    def gate_up(self, lp: dict, h: jax.Array):
        if "w_gate_up" not in lp:
            return super().gate_up(lp, h)
        gu = self.linear(lp, "w_gate_up", h)
        f = gu.shape[-1] // 2
        return gu[..., :f], gu[..., f:]

    def cache_rows(self, arr, layer, rows, kv_len, keep):
        """Per K/V head: a tuple of each head's [B, kv_len, hd] rows, read straight
        into the operand its products take (`transformer._cache_rows` with `head`)."""
        if not self.per_kv_head:
            return super().cache_rows(arr, layer, rows, kv_len, keep)
        heads = arr.shape[1 if rows.ndim == 2 else 2]  # [L, K, NB, bs, hd] or [L, S, K, T, hd]
        return tuple(
            _cache_rows(arr, layer, rows, kv_len, head=j, keep=keep[:, 0]) for j in range(heads)
        )

    def attention(self, cfg, q, k, v, k_cache, v_cache, cache_mask, block_mask):
        if k_cache is None or not self.per_kv_head:
            return super().attention(cfg, q, k, v, k_cache, v_cache, cache_mask, block_mask)
        k_cache, v_cache = _heads(k_cache), _heads(v_cache)
        if self.keys_transposed:  # the same copy, written out transposed
            k_cache = tuple(jnp.swapaxes(kj, -1, -2) for kj in k_cache)
        return attention_per_kv_head(
            q, k, v, k_cache, v_cache, cache_mask, block_mask, self.keys_transposed
        )


def _heads(cache_rows) -> tuple:
    """Cache rows [B, K, T, hd] as a tuple of K heads' [B, T, hd] (a tuple as it is)."""
    if isinstance(cache_rows, tuple):
        return cache_rows
    return tuple(cache_rows[:, j] for j in range(cache_rows.shape[1]))


def attention_per_kv_head(q, k, v, k_cache, v_cache, cache_mask, block_mask, keys_t=False):
    """`Layout.attention` with a cache, one K/V head at a time (same maths, same masks).

    q f32[B, N, K, G, hd] (scaled, RoPE applied); block keys k, v f32[B, M, K, hd];
    caches [B, K, T, hd] or a tuple of K heads' [B, T, hd] (`XlaLayout.cache_rows`;
    keys [.., hd, T] with `keys_t`). A head's G query heads
    and N tokens form one [G * N, hd] block of queries (row g * N + i), so each
    product is a plain [G * N, hd] x [hd, T] matmul per row.
    """
    b, n, kh, g, hd = q.shape
    k_cache, v_cache = _heads(k_cache), _heads(v_cache)
    t, m = k_cache[0].shape[2 if keys_t else 1], k.shape[1]
    qh = q.transpose(0, 2, 3, 1, 4).reshape(b, kh, g * n, hd)
    cmask = jnp.broadcast_to(cache_mask[:, None], (b, g, n, t)).reshape(b, g * n, t)
    bmask = jnp.broadcast_to(block_mask[:, None], (b, g, n, m)).reshape(b, g * n, m)
    outs = []
    for j in range(kh):
        kj, vj = k_cache[j], v_cache[j]
        # A 16-bit cache is read as it is stored: the query and the weights are rounded
        # to its dtype and the products accumulate in float32 (bfloat16 attention).
        s_c = jnp.einsum("bmd,bdt->bmt" if keys_t else "bmd,btd->bmt", qh[:, j].astype(kj.dtype),
                         kj, preferred_element_type=jnp.float32)  # fmt: skip
        s_b = jnp.einsum("bmd,bnd->bmn", qh[:, j], k[:, :, j])
        s_c = jnp.where(cmask, s_c, _NEG)
        s_b = jnp.where(bmask, s_b, _NEG)
        mx = jnp.maximum(s_c.max(axis=-1, keepdims=True), s_b.max(axis=-1, keepdims=True))
        e_c, e_b = jnp.exp(s_c - mx), jnp.exp(s_b - mx)
        denom = e_c.sum(axis=-1, keepdims=True) + e_b.sum(axis=-1, keepdims=True)
        o = jnp.einsum("bmt,btd->bmd", e_c.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
        o = o + jnp.einsum("bmn,bnd->bmd", e_b, v[:, :, j])
        outs.append(o / denom)
    out = jnp.stack(outs, axis=1).reshape(b, kh, g, n, hd)  # [B, K, G, N, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n, kh * g * hd)


def for_backend(cfg: ModelConfig, backend: str | None = None) -> XlaLayout:
    """The layout for `cfg` on `backend` (default: JAX's), for XLA's default dot library."""
    cpu = (backend or jax.default_backend()) == "cpu"
    return XlaLayout(per_kv_head=cpu and cfg.num_kv_heads <= PER_HEAD_MAX, two_row_bf16=cpu)


# ----------------------------------------------------------------------------- params


def cache_dtype(weight_dtype, backend: str | None = None, paged: bool = True) -> jnp.dtype:
    """The dtype a KV cache stores for weights of `weight_dtype`: the same, except on CPU.

    XLA CPU cannot update a bfloat16 buffer in place: it widens the whole buffer
    to float32 and back, so writing one step's K/V would copy all of it; a uint16
    buffer it updates in place. So on CPU a paged cache of 16-bit weights stores the
    bfloat16 bits as uint16 (`paged.to_stored` / `from_stored`: half the bytes of
    float32 to hold and to read every step) and a slot cache (the megakernel's) float32.
    """
    wdt = jnp.dtype(weight_dtype)
    if (backend or jax.default_backend()) != "cpu":
        return wdt
    if paged and wdt.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return jnp.dtype(jnp.float32)


def fuse_projections(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) with wq|wk|wv as one `wqkv` [D, (H + 2K) * hd]
    and w_gate|w_up as one `w_gate_up` [D, 2F]: the same numbers in fewer products.
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
    Costs V * D more weights, so accelerators keep the tied form."""
    if "lm_head" in params:
        return params
    return {**params, "lm_head": jnp.transpose(params["embed"])}


def one_row_copy_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the matrices `one_row_copies` copies for this model in `dtype`: every
    layer's `ONE_ROW_KEYS` matrices (fused or not, the same bytes) and a [D, V] head."""
    layers = param_shapes(cfg)["layers"]
    per_layer = layers if isinstance(layers, tuple) else (layers,)  # stacked: [L, ...] shapes
    n = sum(math.prod(shape) for lp in per_layer for k, shape in lp.items() if k in ONE_ROW_KEYS)
    return (n + cfg.hidden_size * cfg.vocab_size) * jnp.dtype(dtype).itemsize


def wants_one_row_copies(cfg: ModelConfig, dtype, backend: str | None = None) -> bool:
    """Whether one-row products of this model's `dtype` weights get [out, in] copies:
    float32 on XLA CPU only (a bfloat16 row is computed as two, `two_row_bf16`, where
    [in, out] is as fast), and copies of at most `ONE_ROW_MAX_BYTES`."""
    return ((backend or jax.default_backend()) == "cpu" and jnp.dtype(dtype) == jnp.float32
            and one_row_copy_bytes(cfg, dtype) <= ONE_ROW_MAX_BYTES)  # fmt: skip


def one_row_copies(params: Params, tied: bool) -> Params:
    """Per-layer params (`unstack_layers`) plus an [out, in] copy of each layer matrix
    and of the LM head under "one_row" (`XlaLayout.linear` reads them for one-row
    products). A tied head's copy (`tied`: the model ties its LM head to the
    embedding) is `embed` itself.
    """
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        raise ValueError("one_row_copies needs per-layer params (unstack_layers)")

    def with_copies(lp: dict) -> dict:
        copies = {k: jnp.transpose(lp[k]) for k in ONE_ROW_KEYS if k in lp and lp[k].ndim == 2}
        return {**lp, "one_row": copies}

    out = {**params, "layers": tuple(with_copies(lp) for lp in layers)}
    if "lm_head" in params:  # `lm_head` reads it; a tied head without one reads embed.T
        head = params["embed"] if tied else jnp.transpose(params["lm_head"])
        out["one_row"] = {"lm_head": head}
    return out


def arrange(
    cfg: ModelConfig, params: Params, *, fuse: bool = False, one_row: bool = False,
    backend: str | None = None,
) -> tuple[Params, XlaLayout]:  # fmt: skip
    """`params` (stacked, as loaded) arranged for the XLA path, and the layout that
    reads them: per-layer weights; on CPU an untied head and float32 experts
    (`widen`); fused projections if `fuse`; one-row copies if `one_row` and
    `wants_one_row_copies`."""
    backend = backend or jax.default_backend()
    dtype = params["embed"].dtype
    out = unstack_layers(params)
    if backend == "cpu":
        out = untie_head(out)
    if fuse:
        out = fuse_projections(out)
    if one_row and wants_one_row_copies(cfg, dtype, backend):
        out = one_row_copies(out, cfg.tie_word_embeddings)
    layout = for_backend(cfg, backend)
    if backend == "cpu" and (cfg.is_moe or cfg.is_mla) and jnp.dtype(dtype) != jnp.float32:
        out = widen(out)
        layout = dataclasses.replace(layout, narrow_dtype=jnp.dtype(dtype).name)
    return out, layout


# Weights `widen` holds as float32 on CPU: the experts and MLA's per-head up-projections.
WIDE_KEYS = ("e_gate", "e_up", "e_down", "w_uk", "w_uv")


def widen(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) with 16-bit 3-D weights (`WIDE_KEYS`) held
    as float32.

    XLA CPU runs a 16-bit product as a float32 one; inside the routed experts' loop
    (`transformer.routed_experts`) it would widen every expert's weights once per
    step, outside the loop, which costs what the dense form did. Held wide, a step
    reads only its routed experts. MLA's per-head products are dots batched over
    heads, which XLA CPU does not run in bfloat16 at all. The layout rounds these
    products' inputs to the checkpoint's dtype (`Layout.narrow_dtype`), so the sums
    are those of the 16-bit weights: twice those weights' memory, the same numbers."""
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        raise ValueError("widen needs per-layer params (unstack_layers)")
    wide = tuple({**lp, **{k: lp[k].astype(jnp.float32) for k in WIDE_KEYS if k in lp}}
                 for lp in layers)  # fmt: skip
    return {**params, "layers": wide}


__all__ = [
    "ONE_ROW_KEYS", "ONE_ROW_MAX_BYTES", "PER_HEAD_MAX", "XlaLayout", "arrange",
    "attention_per_kv_head", "cache_dtype", "for_backend", "fuse_projections",
    "one_row_copies", "one_row_copy_bytes", "untie_head", "wants_one_row_copies",
    "WIDE_KEYS", "widen",
]  # fmt: skip
