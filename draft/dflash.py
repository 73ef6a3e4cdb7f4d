"""DFlash block drafter: the draft model of the `dflash` package's format, in JAX.

A DFlash drafter proposes a whole block in one forward, conditioned on the target:

* Context. The target's hidden states after the layers `target_layer_ids` (each
  layer's output, concatenated along features) for the committed tokens go through
  `fc` ([n x D, D]) and an RMSNorm (`hidden_norm`): one context row per token.
* Block. The target's own embeddings of [current token, mask, ..., mask]
  (`block_size` rows, times `input_embedding_scale`) form the block's input.
* Layers. Qwen3-style decoder layers in which the block's rows are the queries and
  the keys / values are those of the context rows followed by the block's own rows
  (the same k_proj / v_proj, q / k RMSNorm, RoPE at each row's position). Every
  layer reads the same context rows (not its own layer's states), so a context
  row's K/V per layer depend only on the target's features and its position.
  Attention is bidirectional inside the block unless the layer is marked causal
  (`is_causal`, or a "sliding_attention" layer type, as the package reads them).
* Output. Final RMSNorm; block row i >= 1 is the draft's distribution for the
  token at its own position, through the target's LM head, times
  `output_multiplier`, soft-capped by `final_logit_softcapping` when set.

The config is a Qwen3 config with the DFlash fields either at top level or in a
`dflash_config` object (the package reads the latter first). Without
`target_layer_ids`, the package's rule derives them from `num_target_layers`
(`default_target_layer_ids`). DFlash2 (`DFlash2DraftModel`) adds, per layer, a
grouped dynamic causal convolution along the block's rows before and after
attention and the MLP (kernels = a learned base + a projection of the
sub-layer's input), and a candidate selector: at each block row the top
`selector_top_k` tokens by draft logit, rescored by a low-rank bilinear term
in the previous token and the row's state (`selector_scores`).

Draft vocabulary (our extension, in EAGLE-3's format: `draft_vocab_size` in the
config and int64 offsets `d2t`, target id = i + d2t[i]): the drafter proposes
only those tokens, so each step reads that many columns of the target's head
instead of all of it (the head is the biggest matrix a block drafter reads).
The verify is exact whatever the drafter proposes, so output is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from specdec.kernels import transformer
from specdec.kernels.config import Architecture, ModelConfig

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's shape (`model`: its decoder layers as a Qwen3 config; the
    vocabulary is the target's) and its block fields."""

    model: ModelConfig
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    causal: tuple[bool, ...] = ()  # per layer; empty = bidirectional everywhere
    # DFlash2: per-layer grouped dynamic convolutions along the block, and a
    # candidate selector (0 = DFlash, none of them).
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # Draft vocabulary (EAGLE-3's `draft_vocab_size` and `d2t`): the drafter proposes
    # only these tokens, so its head is that many of the target's columns; 0 = all.
    draft_vocab_size: int = 0

    @property
    def is_dflash2(self) -> bool:
        return self.selector_rank > 0


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The `dflash` package's rule: one layer in the middle for a one-layer drafter,
    else `num_draft_layers` layers spread from layer 1 to layer L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _field(hf: dict, name: str, default=None):
    inner = hf.get("dflash_config") or {}
    return inner.get(name, hf.get(name, default))


def _qwen3_layers(hf: dict) -> ModelConfig:
    """The drafter's decoder layers as a Qwen3 config (q / k norms, no biases), read
    here rather than by `specdec.checkpoint`, a floor above the drafters."""
    rope = hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if kind != "default":
        raise ValueError(f"DFlash drafters with rope_type {kind!r} are not supported yet.")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
        raise ValueError("DFlash layers must use silu and no attention bias (Qwen3's).")
    try:
        heads = int(hf["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            architecture=Architecture.QWEN3, qk_norm=True,
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(f"A DFlash config needs {e.args[0]!r}.") from None


def config_from_hf(hf: dict) -> DFlashConfig:
    """`DFlashConfig` from a DFlash folder's parsed config.json."""
    names = hf.get("architectures") or []
    if names and names[0] not in ARCHITECTURES:  # no name: read as DFlash
        raise ValueError(
            f"Not a DFlash drafter: architectures[0] is {names[0]!r}; supported: "
            f"{list(ARCHITECTURES)}."
        )
    v2 = bool(names) and names[0] == "DFlash2DraftModel"
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    v2_fields = {k: int(_field(hf, k) or 0) for k in keys}
    if v2 and min(v2_fields.values()) <= 0:
        raise ValueError(f"A DFlash2 config needs positive {sorted(v2_fields)}; got {v2_fields}.")
    if not v2:
        v2_fields = {}
    model = _qwen3_layers(hf)
    layers = model.num_layers
    ids = _field(hf, "target_layer_ids")
    if ids is None:
        if hf.get("num_target_layers") is None:
            raise ValueError(
                "A DFlash config needs target_layer_ids or num_target_layers (to derive them)."
            )
        ids = default_target_layer_ids(int(hf["num_target_layers"]), layers)
    mask = _field(hf, "mask_token_id")
    if mask is None:
        raise ValueError("A DFlash config needs mask_token_id (the block's placeholder token).")
    block = int(_field(hf, "block_size", 16))
    if block < 2:
        raise ValueError(f"DFlash block_size must be >= 2, got {block}.")
    types = hf.get("layer_types") or ["full_attention"] * layers
    flag = hf.get("is_causal")
    causal = tuple(
        (t == "sliding_attention") if flag is None else bool(flag) for t in types[:layers]
    )
    if any(t == "sliding_attention" for t in types[:layers]) and hf.get("sliding_window"):
        raise ValueError("Sliding-window DFlash layers are not supported yet.")
    softcap = _field(hf, "final_logit_softcapping")
    draft_vocab = int(_field(hf, "draft_vocab_size") or 0)
    if not 0 <= draft_vocab <= model.vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab} must be in [1, vocab_size={model.vocab_size}] "
            "(0 or absent: the whole vocabulary)."
        )
    if v2 and draft_vocab and draft_vocab < v2_fields["selector_top_k"]:
        raise ValueError(f"draft_vocab_size {draft_vocab} is below selector_top_k "
                         f"{v2_fields['selector_top_k']}.")  # fmt: skip
    return DFlashConfig(
        model=model, target_layer_ids=tuple(int(i) for i in ids), block_size=block,
        mask_token_id=int(mask),
        input_embedding_scale=float(_field(hf, "input_embedding_scale", 1.0)),
        output_multiplier=float(_field(hf, "output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        causal=causal if any(causal) else (),
        draft_vocab_size=0 if draft_vocab == model.vocab_size else draft_vocab, **v2_fields,
    )  # fmt: skip


def read_config(path: str | os.PathLike) -> DFlashConfig:
    """A DFlash folder's config (ValueError naming what is wrong)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"No config.json in {Path(path)}: not a DFlash drafter folder.")
    try:
        hf = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    return config_from_hf(hf)


def load(path: str | os.PathLike, dtype: str = "float32") -> tuple[DFlashConfig, dict]:
    """A DFlash folder (config.json + safetensors, as the package's `save_pretrained`
    writes it) as (config, params): matrices [in, out], per-layer dicts."""
    folder = Path(path)
    dcfg = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No safetensors weights in {folder}.")
    raw: dict[str, np.ndarray] = {}
    for f in files:
        raw |= load_file(f)
    cast = jnp.dtype(dtype)

    def take(name, transpose=False):
        if name not in raw:
            raise ValueError(f"{folder}: tensor {name!r} is missing.")
        a = raw[name].astype(np.float32)
        return jnp.asarray(a.T if transpose else a, cast)

    layers = []
    for i in range(dcfg.model.num_layers):
        p = f"layers.{i}."
        layers.append({
            "attn_norm": take(p + "input_layernorm.weight"),
            "mlp_norm": take(p + "post_attention_layernorm.weight"),
            "wq": take(p + "self_attn.q_proj.weight", True),
            "wk": take(p + "self_attn.k_proj.weight", True),
            "wv": take(p + "self_attn.v_proj.weight", True),
            "wo": take(p + "self_attn.o_proj.weight", True),
            "q_norm": take(p + "self_attn.q_norm.weight"),
            "k_norm": take(p + "self_attn.k_norm.weight"),
            "w_gate": take(p + "mlp.gate_proj.weight", True),
            "w_up": take(p + "mlp.up_proj.weight", True),
            "w_down": take(p + "mlp.down_proj.weight", True),
        })  # fmt: skip
    if dcfg.is_dflash2:
        d = dcfg.model.hidden_size
        if d % dcfg.conv_group_size:
            raise ValueError(f"conv_group_size {dcfg.conv_group_size} must divide the hidden "
                             f"size {d}.")  # fmt: skip
        for i, lp in enumerate(layers):
            for conv in ("attention_conv", "mlp_conv"):
                p = f"layers.{i}.{conv}."
                lp[conv] = {"base": take(p + "base_kernel"),  # [2, K, D]
                            "proj": take(p + "kernel_projection.weight", True)}  # fmt: skip
    params = {
        "layers": tuple(layers),
        "fc": take("fc.weight", True),
        "hidden_norm": take("hidden_norm.weight"),
        "norm": take("norm.weight"),
    }
    if dcfg.is_dflash2:
        sel = "candidate_selector."
        for name in ("predecessor_codebook", "successor_codebook"):
            if sel + name in raw:  # published checkpoints name the tables without .weight
                raw[sel + name + ".weight"] = raw.pop(sel + name)
        params["selector"] = {
            "pred": take(sel + "predecessor_codebook.weight"),  # [V, r]
            "succ": take(sel + "successor_codebook.weight"),
            "proj": take(sel + "hidden_projection.weight", True),  # [D, r]
        }
    if dcfg.draft_vocab_size:
        params["vocab_ids"] = jnp.asarray(_vocab_ids(folder, raw, dcfg))
    d = dcfg.model.hidden_size
    want = len(dcfg.target_layer_ids) * d
    if params["fc"].shape != (want, d):
        raise ValueError(
            f"{folder}: fc is {tuple(params['fc'].shape)} (as [in, out]); "
            f"{len(dcfg.target_layer_ids)} target layers of width {d} need ({want}, {d})."
        )
    return dcfg, params


def _vocab_ids(folder: Path, raw: dict, dcfg: DFlashConfig) -> np.ndarray:
    """The draft vocabulary's target token ids: id = i + d2t[i] (EAGLE-3's offsets)."""
    n, vocab = dcfg.draft_vocab_size, dcfg.model.vocab_size
    if "d2t" not in raw:
        raise ValueError(f"{folder}: draft_vocab_size is {n} but the tensor 'd2t' is missing.")
    d2t = np.asarray(raw["d2t"])
    if d2t.shape != (n,) or d2t.dtype.kind not in "iu":
        raise ValueError(f"{folder}: d2t must be {n} integers; got {d2t.dtype}{list(d2t.shape)}.")
    ids = np.arange(n, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != n:
        raise ValueError(f"{folder}: d2t must map the draft vocabulary to {n} distinct token "
                         f"ids in [0, {vocab}).")  # fmt: skip
    return ids.astype(np.int32)


def draft_vocab_offsets(ids) -> np.ndarray:
    """EAGLE-3's `d2t` for a draft vocabulary of target token ids (the inverse of load's)."""
    ids = np.asarray(ids, np.int64)
    return ids - np.arange(len(ids), dtype=np.int64)


def context_rows(dcfg: DFlashConfig, params: dict, features: jax.Array) -> jax.Array:
    """The target's features at `target_layer_ids` [..., n x D] -> context rows [..., D]."""
    eps = dcfg.model.rms_norm_eps
    return transformer.rms_norm(transformer.matmul(features, params["fc"]),
                                params["hidden_norm"], eps)  # fmt: skip


def context_kv(
    dcfg: DFlashConfig,
    params: dict,
    context: jax.Array,  # f32[B, C, D] context rows (`context_rows`)
    positions: jax.Array,  # i32[B, C]
) -> tuple[jax.Array, jax.Array]:
    """Every layer's keys (q/k-normed, rotated) and values of context rows, each
    f32[L, B, C, K, hd]: they depend on the rows and positions only, so a drafter
    computes them once per committed token and keeps them (its KV cache)."""
    cfg = dcfg.model
    b, c_len, _ = context.shape
    inv_freq = jnp.asarray(transformer.rope_inv_freq(cfg))
    scale = transformer.rope_scale(cfg)
    ks, vs = [], []
    for lp in params["layers"]:
        k = transformer.matmul(context, lp["wk"]).reshape(b, c_len, cfg.num_kv_heads, -1)
        k = transformer.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        ks.append(transformer.apply_rope(k, positions, inv_freq, scale))
        vs.append(transformer.matmul(context, lp["wv"]).reshape(b, c_len, cfg.num_kv_heads, -1))
    return jnp.stack(ks), jnp.stack(vs)


def forward_kv(
    dcfg: DFlashConfig,
    params: dict,
    keys: Sequence,  # per layer: the context rows' keys [B, K, T, hd] (`head_major`)
    values: Sequence,  # per layer: [B, K, T, hd]
    key_valid: jax.Array,  # bool[B, T] which of them the block reads
    block: jax.Array,  # f32[B, Q, D] the block's input embeddings (already scaled)
    positions: jax.Array,  # i32[B, Q] the block rows' positions
    layout: transformer.Layout = transformer.REFERENCE,
) -> jax.Array:
    """The drafter's final hidden states for the block, f32[B, Q, D], given its context
    as keys and values (module docstring). The context stays apart from the block's
    own keys (`Layout.attention` over a cache and a block): joining them would copy
    the whole context every step. A layer's keys may also be what `layout.cache_rows`
    reads (a tuple of K heads' [B, T, hd] for a per-head layout)."""
    cfg = dcfg.model
    b, q_len, _ = block.shape
    t_len = key_valid.shape[1]
    h_q, h_k, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    inv_freq = jnp.asarray(transformer.rope_inv_freq(cfg))
    scale = transformer.rope_scale(cfg)
    cache_mask = jnp.broadcast_to(key_valid[:, None, :], (b, q_len, t_len))
    everything = jnp.ones((b, q_len, q_len), bool)
    causal = everything & jnp.tril(jnp.ones((q_len, q_len), bool))[None]
    x = block.astype(jnp.float32)
    for i, lp in enumerate(params["layers"]):
        h = transformer.rms_norm(x, lp["attn_norm"], eps)
        if "attention_conv" in lp:  # DFlash2: convolve the block's rows before and after
            h, after = _conv_prepare(dcfg, lp["attention_conv"], h)
        q, k, v = layout.qkv(cfg, lp, h)
        q = q.reshape(b, q_len, h_q, hd)
        k = k.reshape(b, q_len, h_k, hd)
        v = v.reshape(b, q_len, h_k, hd)
        q = transformer.apply_rope(transformer.rms_norm(q, lp["q_norm"], eps), positions,
                                   inv_freq, scale)  # fmt: skip
        k = transformer.apply_rope(transformer.rms_norm(k, lp["k_norm"], eps), positions,
                                   inv_freq, scale)  # fmt: skip
        q = q.reshape(b, q_len, h_k, h_q // h_k, hd) / math.sqrt(hd)
        block_mask = causal if dcfg.causal and dcfg.causal[i] else everything
        attn = layout.attention(cfg, q, k, v, keys[i], values[i], cache_mask, block_mask)
        o = layout.linear(lp, "wo", attn)
        if "attention_conv" in lp:
            o = _convolve(dcfg, o, after, lp["attention_conv"]["base"][1])
        x = x + o
        m = transformer.rms_norm(x, lp["mlp_norm"], eps)
        if "mlp_conv" in lp:
            m, after = _conv_prepare(dcfg, lp["mlp_conv"], m)
        gate, up = layout.gate_up(lp, m)
        o = layout.linear(lp, "w_down", jax.nn.silu(gate) * up)
        if "mlp_conv" in lp:
            o = _convolve(dcfg, o, after, lp["mlp_conv"]["base"][1])
        x = x + o
    return transformer.rms_norm(x, params["norm"], eps)


def head_major(kv: jax.Array) -> list[jax.Array]:
    """`context_kv`'s [L, B, C, K, hd] as the per-layer [B, K, C, hd] `forward_kv` reads."""
    return [kv[i].transpose(0, 2, 1, 3) for i in range(kv.shape[0])]


def _convolve(dcfg: DFlashConfig, h: jax.Array, dynamic: jax.Array, base: jax.Array):
    """DFlash2's grouped dynamic causal convolution along the block's rows:
    out[t, g*s + j] = sum_o (base[o, g*s + j] + dynamic[t, o, g]) * h[t - o, g*s + j]
    (h [B, Q, D], dynamic [B, Q, K, G], base [K, D]; rows before the block are zero)."""
    b, q, d = h.shape
    k, g = dynamic.shape[2], d // dcfg.conv_group_size
    out = jnp.zeros_like(h)
    for o in range(k):
        shifted = jnp.pad(h, ((0, 0), (o, 0), (0, 0)))[:, :q]
        per_col = base[o][None, None] + jnp.repeat(dynamic[:, :, o], d // g, axis=-1)
        out = out + per_col * shifted
    return out


def _conv_prepare(dcfg: DFlashConfig, conv: dict, h: jax.Array):
    """The convolution before a sub-layer, and the dynamic kernel its twin after the
    sub-layer uses (both projected from the sub-layer's normed input h)."""
    b, q, d = h.shape
    k, g = dcfg.conv_kernel_size, d // dcfg.conv_group_size
    dyn = transformer.matmul(h, conv["proj"]).reshape(b, q, 2, k, g)
    return _convolve(dcfg, h, dyn[:, :, 0], conv["base"][0]), dyn[:, :, 1]


def selector_inputs(dcfg: DFlashConfig, params: dict, hidden: jax.Array, logits: jax.Array):
    """DFlash2's candidate selector, per block row after the root: the `selector_top_k`
    candidates (by draft logit: unary scores f32[..., K] and tokens i32[..., K]) and the
    row's projected state f32[..., r]. A candidate's score given the previous token t
    is `selector_scores(...)`."""
    unary, cand = jax.lax.top_k(logits, dcfg.selector_top_k)
    return unary, cand, transformer.matmul(hidden, params["selector"]["proj"])


def selector_scores(params: dict, unary, cand, proj, previous):
    """Scores of a row's candidates after token `previous` (broadcast over leading
    axes): unary + <pred[previous] * proj, succ[candidate]>."""
    sel = params["selector"]
    pred = sel["pred"][previous] * proj  # [..., r]
    return unary + jnp.einsum("...r,...kr->...k", pred, sel["succ"][cand])


def forward(
    dcfg: DFlashConfig,
    params: dict,
    context: jax.Array,  # f32[B, C, D] context rows (`context_rows`)
    block: jax.Array,  # f32[B, Q, D] the block's input embeddings (already scaled)
    positions: jax.Array,  # i32[B, C + Q]: the context rows', then the block's
    context_valid: jax.Array | None = None,  # bool[B, C]; None = all
) -> jax.Array:
    """The drafter's final hidden states for the block, f32[B, Q, D] (module docstring)."""
    c_len = context.shape[1]
    keys, values = context_kv(dcfg, params, context, positions[:, :c_len])
    keys, values = head_major(keys), head_major(values)
    if context_valid is None:
        context_valid = jnp.ones(context.shape[:2], bool)
    return forward_kv(dcfg, params, keys, values, context_valid, block, positions[:, c_len:])


def draft_logits(dcfg: DFlashConfig, head_logits: jax.Array) -> jax.Array:
    """The target's LM head on the drafter's hidden states -> the draft's logits
    (`output_multiplier`, then the soft cap when set)."""
    y = head_logits * dcfg.output_multiplier
    cap = dcfg.final_logit_softcapping
    return jnp.tanh(y / cap) * cap if cap else y


__all__ = [
    "DFlashConfig",
    "config_from_hf",
    "context_kv",
    "context_rows",
    "default_target_layer_ids",
    "draft_logits",
    "draft_vocab_offsets",
    "forward",
    "forward_kv",
    "head_major",
    "load",
    "read_config",
    "selector_inputs",
    "selector_scores",
]
