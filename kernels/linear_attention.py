"""Gated DeltaNet layers (Qwen3.5 / Qwen3-Next linear attention), reference form.

A DeltaNet layer keeps, per sequence, a recurrent state S [Hv, dk, dv] and the last
`linear_conv_kernel_dim - 1` inputs of its short causal convolution. Token t, with
l2-normalised key k_t, query q_t (scaled by 1 / sqrt(dk)), value v_t, decay
gamma_t = exp(g_t) and write strength beta_t, does (the gated delta rule)

    S_t = gamma_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - gamma_t S_{t-1}^T k_t)
    o_t = S_t^T q_t

Every step here (prefill chunk, decode, tree verify) evaluates one block of N
tokens in the *chunked form over paths*. Unrolled along a token's path,
with G_i the summed log-decay from the committed state to node i:

    S_i = exp(G_i) S_0 + sum_{j <= i on the path} exp(G_i - G_j) k_j u_j^T
    u   = (I + L)^{-1} beta (v - exp(G) K S_0),  L_ij = beta_i exp(G_i - G_j) k_i.k_j
    o_i = exp(G_i) S_0^T q_i + sum_{j <= i on the path} exp(G_i - G_j) (q_i.k_j) u_j

where "on the path" is the block's ancestor mask (a chain's causal mask, a tree's
ancestor mask; L is strictly lower triangular in block order since parents come
first). So a tree costs what a chain of N tokens costs: N x N products and one
unit-triangular solve per head, O(N^2 (dk + dv)), no per-node state. The
alternatives: walking the tree level by level keeps a state per node (N x dk x dv
per head, 2 MB per node and layer at Qwen3.5-27B's sizes) and takes depth
sequential steps; running each root-to-leaf path separately repeats shared
prefixes. A token's u_j depends on its own path only, so a committed path's
final state is rebuilt from the kept nodes' (k, u, G) by the sum above
(`commit_states`), without re-running anything.

The convolution reads each node's ancestors at distances 1..K-1 from the block
(same mask) or, past the block's root, from the committed convolution state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specdec.kernels.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """Committed per-sequence state of every linear layer, one entry per slot.

    conv: [Ll, slots, K - 1, C]  the last K - 1 convolution inputs, oldest first
    rec:  f32[Ll, slots, Hv, dk, dv]  the recurrent state
    A slot's state is read only when its committed length is > 0 (a new sequence
    starts from zeros whatever the slot held before).
    """

    conv: jax.Array
    rec: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, num_slots: int, dtype=jnp.float32) -> LinearState:
        n = len(cfg.linear_layers)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        c = cfg.linear_dims[2]
        return cls(conv=jnp.zeros((n, num_slots, cfg.linear_conv_kernel_dim - 1, c), dtype),
                   rec=jnp.zeros((n, num_slots, hv, dk, dv), jnp.float32))  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearBlock:
    """What a block's tokens add to the linear layers' state, per token (leaves
    [..., B, N, ...]; stacked over linear layers on a leading axis by the forward).

    x: [B, N, C] convolution inputs;  k: [B, N, Hv, dk] keys (normalised, per value
    head);  u: [B, N, Hv, dv] the delta rule's writes;  g: [B, N, Hv] (KDA:
    [B, N, Hv, dk]) summed log-decay from the committed state along the token's path."""

    x: jax.Array
    k: jax.Array
    u: jax.Array
    g: jax.Array


# The megakernel's stacks of a hybrid model (`stacked_layout`):
# shared per-layer weights [L, ...] in `layers` beside the attention layers' [La, ...],
# the linear layers' [Ll, ...] under `lin`.
SHARED_KEYS = ("attn_norm", "mlp_norm", "w_gate", "w_up", "w_down")
ATTN_KEYS = ("wq", "wk", "wv", "wo", "wg", "q_norm", "k_norm", "bq", "bk", "bv")


def stacked_layout(cfg: ModelConfig, params: dict) -> dict:
    """A hybrid model's per-layer tuple restacked as the megakernel streams it: the
    linear layers' q / k / v projections and convolution split by part (each splits
    over devices by heads on its own), b and a side by side as w_ba [2, D, Hv]."""
    if "lin" in params:
        return params
    layers = params["layers"]
    att = [layers[i] for i in cfg.attention_layers]
    lin = [layers[i] for i in cfg.linear_layers]
    stacked = {k: jnp.stack([lp[k] for lp in layers]) for k in SHARED_KEYS}
    stacked |= {k: jnp.stack([lp[k] for lp in att]) for k in ATTN_KEYS if k in att[0]}
    kd, _, _ = cfg.linear_dims
    parts = {"q": slice(0, kd), "k": slice(kd, 2 * kd), "v": slice(2 * kd, None)}
    out = {f"w_l{p}": jnp.stack([lp["w_qkv"][:, cut] for lp in lin]) for p, cut in parts.items()}
    out |= {f"conv_{p}": jnp.stack([lp["conv"][:, cut] for lp in lin]) for p, cut in parts.items()}
    out["w_ba"] = jnp.stack([jnp.stack([lp["w_b"], lp["w_a"]]) for lp in lin])
    out |= {k: jnp.stack([lp[k] for lp in lin]) for k in ("w_z", "a_log", "dt_bias", "lin_norm",
                                                          "w_out")}  # fmt: skip
    return {**params, "layers": stacked, "lin": out}


def per_layer(cfg: ModelConfig, params: dict) -> tuple:
    """The model's per-layer dicts from `stacked_layout`'s stacks (static slices; the
    linear layers keep their q / k / v projections apart, `transformer._deltanet`
    takes either form)."""
    layers, lin = params["layers"], params["lin"]
    out = []
    for i in range(cfg.num_layers):
        j = cfg.cache_layer(i)
        lp = {k: layers[k][i] for k in SHARED_KEYS}
        if cfg.linear_layer(i):
            lp |= {k: v[j] for k, v in lin.items() if not k.startswith(("conv_", "w_ba"))}
            lp["conv"] = jnp.concatenate([lin[f"conv_{p}"][j] for p in "qkv"], axis=-1)
            lp["w_b"], lp["w_a"] = lin["w_ba"][j, 0], lin["w_ba"][j, 1]
        else:
            lp |= {k: layers[k][j] for k in ATTN_KEYS if k in layers}
        out.append(lp)
    return tuple(out)


def bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    """Bytes one sequence's linear-layer state holds (independent of its length)."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_dims[2] * jnp.dtype(dtype).itemsize
    return len(cfg.linear_layers) * (conv + hv * dk * dv * 4)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def ancestor_sources(block_mask, positions, cache_lens, taps: int) -> jax.Array:
    """i32[B, N, taps - 1]: where node i's input at path distance j + 1 lives, as an
    index into concat(conv state [K - 1 entries], block [N]): a block node at K - 1 + m
    when the ancestor is in the block, else the committed state's entry."""
    depth = positions - cache_lens[:, None]  # the block's root is at depth 0
    out = []
    for j in range(1, taps):
        hit = block_mask & (positions[:, None, :] == positions[:, :, None] - j)  # [B, N, N]
        idx = jnp.argmax(hit, axis=-1)
        from_state = jnp.clip((taps - 1) - (j - depth), 0, taps - 2)
        out.append(jnp.where(jnp.any(hit, axis=-1), taps - 1 + idx, from_state))
    return jnp.stack(out, axis=-1)


def causal_conv(x, conv_state, conv_w, sources) -> jax.Array:
    """The depthwise causal convolution + SiLU along each node's path.
    x [B, N, C] inputs; conv_state [B, K - 1, C]; conv_w [K, C] (tap K - 1 = the token
    itself); sources from `ancestor_sources`."""
    taps = conv_w.shape[0]
    seq = jnp.concatenate([conv_state.astype(jnp.float32), x], axis=1)  # [B, K - 1 + N, C]
    w = conv_w.astype(jnp.float32)
    out = x * w[taps - 1]
    for j in range(1, taps):
        src = jnp.take_along_axis(seq, sources[..., j - 1 : j], axis=1)  # [B, N, C]
        out = out + src * w[taps - 1 - j]
    return jax.nn.silu(out)


def gated_delta_block(q, k, v, g, beta, s0, path) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The chunked form over paths (module docstring) for one block.

    q, k f32[B, N, H, dk] (normalised, q scaled); v f32[B, N, H, dv]; g f32[B, N, H]
    (one log-decay per head: gated DeltaNet) or f32[B, N, H, dk] (one per key channel:
    KDA, where the decays become diagonal matrices and every k_i.k_j, q_i.k_j weighs
    its channels by their own decay); beta f32[B, N, H]; s0 f32[B, H, dk, dv]; path
    bool[B, N, N] (j is i or an ancestor).
    Returns (o f32[B, N, H, dv], u f32[B, N, H, dv], G: g summed along each path)."""
    pf = path.astype(jnp.float32)
    n = q.shape[1]
    channels = g.ndim == 4
    big_g = jnp.einsum("bij,bjh...->bih...", pf, g)  # summed log-decay along each path
    diff = big_g[:, :, None] - big_g[:, None, :]  # [B, i, j, H(, dk)]
    m = path[..., None, None] if channels else path[..., None]
    decay = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)
    if channels:  # [B, i, j, H, dk]
        kk = jnp.einsum("bihd,bjhd,bijhd->bijh", k, k, decay)
        qk = jnp.einsum("bihd,bjhd,bijhd->bijh", q, k, decay)
        eg = jnp.exp(big_g)  # [B, N, H, dk]
        ks0 = jnp.einsum("bnhd,bhde->bnhe", k * eg, s0)
        qs0 = jnp.einsum("bnhd,bhde->bnhe", q * eg, s0)
    else:
        kk = jnp.einsum("bihd,bjhd->bijh", k, k) * decay
        qk = jnp.einsum("bihd,bjhd->bijh", q, k) * decay
        eg = jnp.exp(big_g)[..., None]  # [B, N, H, 1]
        ks0 = eg * jnp.einsum("bnhd,bhde->bnhe", k, s0)
        qs0 = eg * jnp.einsum("bnhd,bhde->bnhe", q, s0)
    strict = (1.0 - jnp.eye(n, dtype=jnp.float32))[None, :, :, None]
    lower = strict * kk * beta[:, :, None, :]  # L_ij
    rhs = beta[..., None] * (v - ks0)  # [B, N, H, dv]
    # (I + L) u = rhs per (b, h): a unit lower-triangular solve.
    a = jnp.eye(n, dtype=jnp.float32)[None, None] + lower.transpose(0, 3, 1, 2)  # [B, H, N, N]
    u = jax.lax.linalg.triangular_solve(
        a, rhs.transpose(0, 2, 1, 3), left_side=True, lower=True, unit_diagonal=True
    ).transpose(0, 2, 1, 3)
    o = qs0 + jnp.einsum("bijh,bjhe->bihe", qk, u)
    return o, u, big_g


def commit_states(state: LinearState, lin: LinearBlock, slots, starts, counts) -> LinearState:
    """Advances each row's committed state by the first counts[b] entries of its block
    record (already in path order: the kept path). lin leaves [Ll, B, M, ...]; rows with
    slot < 0 or count 0 change nothing; rows with starts == 0 start from zeros."""
    n_l, b, m = lin.g.shape[:3]
    safe = jnp.clip(slots, 0, state.rec.shape[1] - 1)
    fresh = (starts == 0)[None, :]
    s0 = jnp.where(fresh[..., None, None, None], 0.0, state.rec[:, safe])  # [Ll, B, H, dk, dv]
    c0 = jnp.where(fresh[..., None, None], 0, state.conv[:, safe]).astype(jnp.float32)
    last = jnp.clip(counts - 1, 0, m - 1)
    extra = lin.g.ndim - 4  # 1: a decay per key channel (KDA)
    at = last.reshape(1, b, 1, *[1] * (1 + extra))
    g_end = jnp.take_along_axis(lin.g, at, axis=2)  # [Ll, B, 1, H(, dk)]
    kept = (jnp.arange(m)[None, :] < counts[:, None]).reshape(1, b, m, *[1] * (1 + extra))
    w = jnp.where(kept, jnp.exp(jnp.where(kept, g_end - lin.g, 0.0)), 0.0)  # [Ll, B, M, H(, dk)]
    decayed = jnp.exp(g_end[:, :, 0])
    decayed = decayed[..., None] if extra else decayed[..., None, None]
    spec = "lbmhd,lbmhd,lbmhe->lbhde" if extra else "lbmh,lbmhd,lbmhe->lbhde"
    rec = decayed * s0 + jnp.einsum(spec, w, lin.k, lin.u)
    taps = state.conv.shape[2] + 1
    seq = jnp.concatenate([c0, lin.x.astype(jnp.float32)], axis=2)  # [Ll, B, K - 1 + M, C]
    idx = counts[:, None] + jnp.arange(taps - 1)[None, :]  # the last K - 1 kept inputs
    conv = jnp.take_along_axis(seq, idx[None, :, :, None], axis=2)
    live = (slots >= 0) & (counts > 0)
    conv = conv.astype(state.conv.dtype)

    # One row at a time, as `transformer._put_rows` does (an index scatter over rows
    # would rebuild the whole state); padding rows write back what is there now.
    def put(arr, val, r):
        cur = jax.lax.dynamic_index_in_dim(arr, safe[r], axis=1, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(
            arr, jnp.where(live[r], val, cur), safe[r], axis=1
        )

    new_rec, new_conv = state.rec, state.conv
    for r in range(b):
        new_rec, new_conv = put(new_rec, rec[:, r], r), put(new_conv, conv[:, r], r)
    return LinearState(conv=new_conv, rec=new_rec)
