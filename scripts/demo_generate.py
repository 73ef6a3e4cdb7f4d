"""Phase 3's data for scripts/train_demo_pair.py: a target's greedy continuations
with its top-k next-token distributions recorded, the rows that carry them into
`train_loop`, and the sparse KL the draft is distilled with."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from demo_corpus import Rows  # scripts/demo_corpus.py, beside this file

from specdec.kernels import dot_library
from specdec.kernels.config import ModelConfig
from specdec.kernels.transformer import (
    apply_rope,
    block_logits_kv,
    causal_block_mask,
    lm_head,
    matmul,
    rms_norm,
    rope_inv_freq,
)
from specdec.verify.sampling import repetition_penalized

GEN_KV_STEP = 128  # generation reads the cache in buckets of this many positions


@functools.partial(jax.jit, static_argnames=("cfg",))
def _gen_prefill(params, prompts, *, cfg: ModelConfig):
    """Prompt K/V per layer [B, P, K, hd] (list) and the last position's logits."""
    b, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    mask = causal_block_mask(jnp.full((b,), p, jnp.int32), p)
    logits, ks, vs = block_logits_kv(
        params, None, prompts, positions, mask, jnp.arange(b, dtype=jnp.int32),
        jnp.zeros((b,), jnp.int32), jnp.full((b,), p - 1, jnp.int32), cfg=cfg,
    )  # fmt: skip
    return logits[:, 0], ks, vs


def _gen_step(params, cache, tok, pos, *, cfg: ModelConfig, kv_len: int):
    """One greedy-generation step of every row at the same position `pos`.

    A plain dense decode (every row at one position, no slots): the engine's slot
    cache gathers each row separately, which at 256 rows cost more than the model.
    `cache` [L, 2, B, K, T, hd] holds positions [0, pos) and is only read here, over
    [0, kv_len); the new K/V come back for `_gen_write` (XLA on CPU copies a buffer
    that one program both reads and updates). Returns (next-token logits f32[B, V],
    k and v [L, B, K, hd]).
    """
    b = tok.shape[0]
    hd, kh, h = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    positions = jnp.full((b, 1), pos, jnp.int32)
    visible = jnp.arange(kv_len) < pos
    x = params["embed"][tok][:, None].astype(jnp.float32)  # [B, 1, D]
    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        hn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = apply_rope(matmul(hn, lp["wq"]).reshape(b, h, hd)[:, None], positions, inv_freq)
        k = apply_rope(matmul(hn, lp["wk"]).reshape(b, kh, hd)[:, None], positions, inv_freq)
        v = matmul(hn, lp["wv"]).reshape(b, kh, hd)
        qg = q.reshape(b, kh, h // kh, hd) * (1.0 / math.sqrt(hd))
        kc, vc = cache[i, 0, :, :, :kv_len], cache[i, 1, :, :, :kv_len]  # [B, K, T, hd]
        # Broadcast-multiply-reduce, not einsum: XLA CPU runs a dot with batch dims
        # (B * K of them, each [G, hd] x [hd, T]) as that many tiny products.
        s_old = jnp.sum(qg[:, :, :, None, :] * kc[:, :, None], axis=-1)  # [B, K, G, T]
        s_old = jnp.where(visible, s_old, -jnp.inf)
        s_new = jnp.einsum("bkgd,bkd->bkg", qg, k[:, 0])[..., None]
        pr = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
        att = jnp.sum(pr[..., :-1, None] * vc[:, :, None], axis=-2)  # [B, K, G, hd]
        att = att + pr[..., -1:] * v[:, :, None]
        x = x + matmul(att.reshape(b, 1, h * hd), lp["wo"])
        hn = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + matmul(jax.nn.silu(matmul(hn, lp["w_gate"])) * matmul(hn, lp["w_up"]),
                       lp["w_down"])  # fmt: skip
        new_k.append(k[:, 0])
        new_v.append(v)
    return lm_head(cfg, params, x)[:, 0], jnp.stack(new_k), jnp.stack(new_v)


# One compiled step per dot library. On a 2-core AVX2 EPYC, 128 float32 rows at
# context 256: 480 ms a step through YNNPACK (XLA's default), whose fusions cannot
# take the cache slices, so each layer's K and V were copied out at ~2.6 GB/s
# first; 183 ms through Eigen, where the slices fuse into the attention loops.
_GEN_STEP = dot_library.jit_each(_gen_step, static_argnames=("cfg", "kv_len"))


def step_library(dtype) -> str:
    """The dot library generation steps use for weights in `dtype`: Eigen for
    float32 on CPU (above), XLA's default elsewhere (Eigen has no bfloat16 GEMM)."""
    return "eigen" if "eigen" in dot_library.candidates(dtype) else "default"


@functools.partial(jax.jit, donate_argnames=("cache",))
def _gen_write(cache, k, v, pos):
    """cache [L, 2, B, K, T, hd] with k, v [L, B, K, hd] written at position `pos`."""
    kv = jnp.stack([k, v], axis=1)[:, :, :, :, None].astype(cache.dtype)
    return jax.lax.dynamic_update_slice(cache, kv, (0, 0, 0, 0, pos, 0))


@functools.partial(jax.jit, static_argnames=("topk",))
def _gen_pick(logits, seen, penalties, *, topk: int):
    """Greedy token under each row's repetition penalty (the lowest id on ties, like
    the engine) and the raw distribution's top-k; `seen` gains the token."""
    penalized = repetition_penalized(logits, seen, penalties[:, None])
    tok = jnp.argmax(penalized, axis=-1).astype(jnp.int32)
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), topk)
    return tok, logp, ids.astype(jnp.int32), seen.at[jnp.arange(len(tok)), tok].set(True)


def greedy_continuations(params, prompts, penalties, *, cfg: ModelConfig, gen_len: int, topk=1):
    """Each row's greedy continuation of `prompts` i32[B, P] under its repetition
    penalty f32[B] (over the prompt and the tokens so far, as `specdec generate`
    applies it), decoded with a KV cache. `params` unstacked (`unstack_layers`);
    dense Llama layers only (no biases, QK norm, sliding window or experts).

    Returns tokens i32[B, gen_len] and, per generated token, the `topk` most likely
    tokens of the raw (unpenalised) distribution it was chosen from: log-probs
    f32[B, gen_len, topk] and ids i32[B, gen_len, topk]. Steps run through the
    `step_library` of the weights' dtype.
    """
    if cfg.attention_bias or cfg.qk_norm or cfg.sliding_window or cfg.is_moe:
        raise ValueError("greedy_continuations covers plain dense Llama layers only.")
    prompts = jnp.asarray(prompts, jnp.int32)
    b, p = prompts.shape
    total = -(-(p + gen_len) // GEN_KV_STEP) * GEN_KV_STEP
    logits, ks, vs = _gen_prefill(params, prompts, cfg=cfg)
    pad = ((0, 0), (0, 0), (0, 0), (0, 0), (0, total - p), (0, 0))
    kv = jnp.stack([ks, vs], axis=1).transpose(0, 1, 2, 4, 3, 5)  # [L, 2, B, K, P, hd]
    cache = jnp.pad(kv.astype(jnp.float32), pad)  # float32, as the engine's on CPU
    seen = jnp.zeros((b, cfg.vocab_size), bool).at[jnp.arange(b)[:, None], prompts].set(True)
    penalties = jnp.asarray(penalties, jnp.float32)
    step = _GEN_STEP[step_library(params["embed"].dtype)]
    toks, logps, ids = [], [], []
    for i in range(gen_len):
        tok, logp, top, seen = _gen_pick(logits, seen, penalties, topk=topk)
        toks.append(tok)
        logps.append(logp)
        ids.append(top)
        if i + 1 < gen_len:
            pos = p + i  # where `tok` goes
            kv_len = min(-(-(pos + 1) // GEN_KV_STEP) * GEN_KV_STEP, total)
            logits, k, v = step(params, cache, tok, jnp.int32(pos), cfg=cfg, kv_len=kv_len)
            cache = _gen_write(cache, k, v, jnp.int32(pos))
    return jnp.stack(toks, 1), jnp.stack(logps, 1), jnp.stack(ids, 1)


class IndexRows:
    """`train_loop`'s data for phase 3: a batch is the generated sequences' rows; the
    step also gets those rows' teacher top-k, gathered on the device."""

    def __init__(self, tokens: np.ndarray, seed: int, salt: int):
        self.tokens = tokens
        self.order = Rows(np.arange(len(tokens))[:, None], seed, salt)

    def batch(self, first: int, size: int) -> np.ndarray:
        idx = np.array([self.order.sample(first + j)[0] for j in range(size)])
        # The row index rides along as an extra last column (dropped by the loss).
        return np.concatenate([self.tokens[idx], idx[:, None]], axis=1)


def topk_kl(t_logp: jax.Array, t_ids: jax.Array, d_logp: jax.Array) -> jax.Array:
    """Mean KL(teacher's top-k, renormalised || draft) over positions: teacher
    log-probs f32[..., k] at ids i32[..., k], draft log-probs f32[..., V]."""
    t_prob = jax.nn.softmax(t_logp, axis=-1)
    d_at = jnp.take_along_axis(d_logp, t_ids, axis=-1)
    return jnp.sum(t_prob * (jax.nn.log_softmax(t_logp, axis=-1) - d_at), axis=-1).mean()
