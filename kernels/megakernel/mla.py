"""Multi-head latent attention (DeepSeek-V3 class) inside the verify megakernel.

The kernel runs MLA in its absorbed form (docs/design.md, "Multi-head latent
attention"): one K "head" of width A = c + r per token (the normed latent c and
the rotary key r, the cache's only entry), read by every query head; a head's
query is [W_uk^T q_nope, rope(q_rope)], its output the weighted sum of latents
(the keys' first c entries) through W_uv, then wo.

Per layer (c = kv_lora_rank, r = rotary width, qk = nope + r, Wqa = q_lora_rank, or
H x qk without a low-rank query path):

    qkv ring:  wq_a column tiles (or wq's) -> qa [M, Wqa]
               wkv_a column tiles           -> kva [M, KVW]  (KVW = c + r, padded)
    one DMA each, started at the layer's start: wq_b [q_lora, H x qk] (low-rank
               path only), w_uk [H, c, nope], w_uv [H, c, v] into VMEM
    then       k = [rms(kva[:c]), rope(kva[c:c+r])]; q_h = [q_nope_h . w_uk_h^T,
               rope(q_rope_h)]; attention (`attention.attend_row`, values = k[:c]);
               out_h = latent_h . w_uv_h; o ring: wo row tiles of whole heads.

wkv_a's columns are zero-padded to `kva_width` (a multiple of 128) once at load
(`shard.prepare_params`): TPU tiles are whole lanes and DeepSeek-V3's c + r = 576
is not. Over n devices each holds H / n heads (wq / wq_b columns, w_uk, w_uv, wo
rows) and the replicated wq_a, wkv_a and latent cache: every device computes the
same latent and writes its own copy of the cache, so attention needs no exchange.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel import attention, ops, tuning

# Streamed from HBM (name -> the axis cut over devices; None = replicated).
SPLIT = {"wq": 2, "wq_b": 2, "w_uk": 1, "w_uv": 1, "wo": 1, "wq_a": None, "wkv_a": None}


def kva_width(cfg: ModelConfig) -> int:
    """wkv_a's columns as the kernel streams them: c + r rounded up to whole lanes."""
    return tuning.mla_widths(cfg)[1]


def pad_kv(cfg: ModelConfig, params: dict) -> dict:
    """`params` with wkv_a zero-padded to `kva_width` columns (the XLA forward reads its
    first c + r and ignores the rest)."""
    lp = params["layers"]
    extra = kva_width(cfg) - lp["wkv_a"].shape[-1]
    if extra <= 0:
        return params
    wkv = jnp.pad(lp["wkv_a"], ((0, 0), (0, 0), (0, extra)))
    return {**params, "layers": {**lp, "wkv_a": wkv}}


def check(cfg: ModelConfig, n: int) -> None:
    """Raises ValueError naming what keeps an MLA model from the kernel on n devices."""
    if not cfg.use_rope:
        raise ValueError(
            "The megakernel runs multi-head latent attention with RoPE (DeepSeek); "
            f"{cfg.architecture.value}'s position-free MLA must use kernel='xla'."
        )
    if cfg.num_heads % n:
        raise ValueError(
            f"The megakernel on {n} devices splits num_heads ({cfg.num_heads}) {n} ways; use "
            f"tensor_parallel_size dividing {cfg.num_heads}, or kernel='xla'."
        )


# ----------------------------------------------------------------------------- in the kernel


def _tile_copies(r, p, name, li):
    tp = p.bs.proj_cols
    hbm = getattr(r, f"{name}_hbm")

    def copies(j, slot):
        src = hbm.at[li, :, pl.ds(ops.aligned(j * tp, tp), tp)]
        return (pltpu.make_async_copy(src, r.qkv_buf_ref.at[slot], r.qkv_sem.at[slot]),)

    return copies


def streams(p) -> list[tuple[str, int, str]]:
    """(HBM weight, tiles, VMEM destination) of a layer's qkv-ring streams, in order."""
    tp, cfg = p.bs.proj_cols, p.cfg
    first = "wq_a" if cfg.q_lora_rank else "wq"
    qa, kvw = tuning.mla_widths(cfg)
    return [(first, qa // tp, "qa"), ("wkv_a", kvw // tp, "kva")]


def first_copies(r, p, li):
    """DMA descriptors of the layer's first stream (`opener` of the layer before)."""
    name, _, _ = streams(p)[0]
    return _tile_copies(r, p, name, li)


def first_tiles(p) -> int:
    return streams(p)[0][1]


def mixer(r, p, li, *, acc_ref, start_update, open_mlp):
    """Layer li's MLA (module docstring). On entry the first stream's tiles are in
    flight in the qkv ring; on exit this device's residual update is in `acc_ref` and
    the wo stream has started the MLP's first tiles (`open_mlp`)."""
    cfg, bs = p.cfg, p.bs
    tp, to, ring = bs.proj_cols, bs.out_rows, bs.weight_ring
    c, rot, nope, vd = cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    qk, eps = nope + rot, cfg.rms_norm_eps

    small = [
        pltpu.make_async_copy(r.w_uk_hbm.at[li], r.wuk_buf_ref, r.mla_sem.at[0]),
        pltpu.make_async_copy(r.w_uv_hbm.at[li], r.wuv_buf_ref, r.mla_sem.at[1]),
    ]
    if cfg.q_lora_rank:
        small.append(pltpu.make_async_copy(r.wq_b_hbm.at[li], r.wqb_buf_ref, r.mla_sem.at[2]))
    ops.start(small)

    def o_copies(j, slot):
        src = r.wo_hbm.at[li, pl.ds(ops.aligned(j * to, to), to), :]
        return (pltpu.make_async_copy(src, r.o_buf_ref.at[slot], r.o_sem.at[slot]),)

    no = p.H * vd // to
    plan = streams(p)
    offset = 0
    for idx, (name, n, dst) in enumerate(plan):
        if idx + 1 < len(plan):
            nxt_name, nxt_n, _ = plan[idx + 1]
            nxt = ops.opener(_tile_copies(r, p, nxt_name, li), offset + n, nxt_n, ring, ring - 1)
        else:
            nxt = ops.opener(o_copies, 0, no, ring, ring - 1)

        def tile(j, slot, carry, dst=dst):
            y = ops.dot(r.h_ref[...], r.qkv_buf_ref[slot])
            getattr(r, f"{dst}_ref")[:, pl.ds(ops.aligned(j * tp, tp), tp)] = y
            return carry

        ops.stream(n, offset, _tile_copies(r, p, name, li), tile, ring=ring, nxt=nxt)
        offset += n

    cos, sin = r.cos_ref[:, pl.ds(0, rot)], r.sin_ref[:, pl.ds(0, rot)]
    kva = r.kva_ref[...]
    latent = ops.rms(kva[:, :c], r.kv_a_norm_ref[pl.ds(li, 1), :], eps)
    k_rope = ops.rope(kva[:, c : c + rot], cos, sin, rot, rot)
    r.k_ref[0] = jnp.concatenate([latent, k_rope], axis=1)

    ops.wait(small)
    if cfg.q_lora_rank:
        qa = ops.rms(r.qa_ref[...], r.q_a_norm_ref[pl.ds(li, 1), :], eps).astype(p.wdtype)
    for h in range(p.H):  # static: per-head lane slices of whole-layer products
        if cfg.q_lora_rank:
            q = ops.dot(qa, r.wqb_buf_ref[:, pl.ds(h * qk, qk)])
        else:
            q = r.qa_ref[:, pl.ds(h * qk, qk)]
        q_lat = ops.dot_nt(q[:, :nope].astype(p.wdtype), r.wuk_buf_ref[h])  # [M, c]
        q_rope = ops.rope(q[:, nope:], cos, sin, rot, rot)
        r.q_ref[h] = jnp.concatenate([q_lat, q_rope], axis=1)

    jax.lax.fori_loop(0, p.B, lambda b, carry: attention.attend_row(r, p, li, b, carry), 0)

    for h in range(p.H):
        lat = r.olat_ref[h].astype(p.wdtype)
        r.attn_ref[h] = ops.dot(lat, r.wuv_buf_ref[h]).astype(p.wdtype)

    o_tile = ops.head_rows_tile(acc_ref, r.attn_ref, r.o_buf_ref, vd, to)
    start_update()
    ops.stream(no, 0, o_copies, o_tile, ring=ring, nxt=open_mlp)


SEMAPHORES = (("mla_sem", (3,)),)

__all__ = ["check", "first_copies", "kva_width", "mixer", "pad_kv", "streams"]
