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
(`default_target_layer_ids`). DFlash2's extra modules (per-layer dynamic
convolutions, a candidate selector) are refused by name for now.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from specdec.kernels import transformer
from specdec.kernels.config import Architecture, ModelConfig

ARCHITECTURES = ("DFlashDraftModel",)


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
    if names and names[0] not in ARCHITECTURES:
        raise ValueError(
            f"Not a DFlash drafter: architectures[0] is {names[0]!r}; supported: "
            f"{list(ARCHITECTURES)}."
        )
    for name in ("conv_kernel_size", "selector_rank"):
        if _field(hf, name) is not None:
            raise ValueError(
                f"DFlash2 drafters ({name} set) are not supported yet; use a DFlash drafter."
            )
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
    return DFlashConfig(
        model=model, target_layer_ids=tuple(int(i) for i in ids), block_size=block,
        mask_token_id=int(mask),
        input_embedding_scale=float(_field(hf, "input_embedding_scale", 1.0)),
        output_multiplier=float(_field(hf, "output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        causal=causal if any(causal) else (),
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
    params = {
        "layers": tuple(layers),
        "fc": take("fc.weight", True),
        "hidden_norm": take("hidden_norm.weight"),
        "norm": take("norm.weight"),
    }
    d = dcfg.model.hidden_size
    want = len(dcfg.target_layer_ids) * d
    if params["fc"].shape != (want, d):
        raise ValueError(
            f"{folder}: fc is {tuple(params['fc'].shape)} (as [in, out]); "
            f"{len(dcfg.target_layer_ids)} target layers of width {d} need ({want}, {d})."
        )
    return dcfg, params


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
    keys: jax.Array,  # f32[L, B, T, K, hd] the context rows' keys (`context_kv`)
    values: jax.Array,  # f32[L, B, T, K, hd]
    key_valid: jax.Array,  # bool[B, T] which of them the block reads
    block: jax.Array,  # f32[B, Q, D] the block's input embeddings (already scaled)
    positions: jax.Array,  # i32[B, Q] the block rows' positions
) -> jax.Array:
    """The drafter's final hidden states for the block, f32[B, Q, D], given its context
    as keys and values (module docstring)."""
    cfg = dcfg.model
    b, q_len, _ = block.shape
    t_len = keys.shape[2]
    h_q, h_k, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    inv_freq = jnp.asarray(transformer.rope_inv_freq(cfg))
    scale = transformer.rope_scale(cfg)
    visible = jnp.concatenate(
        [jnp.broadcast_to(key_valid[:, None, :], (b, q_len, t_len)),
         jnp.ones((b, q_len, q_len), bool)], axis=2,
    )  # fmt: skip
    causal = jnp.concatenate(
        [jnp.ones((q_len, t_len), bool), jnp.tril(jnp.ones((q_len, q_len), bool))], axis=1
    )
    x = block.astype(jnp.float32)
    for i, lp in enumerate(params["layers"]):
        h = transformer.rms_norm(x, lp["attn_norm"], eps)
        q = transformer.matmul(h, lp["wq"]).reshape(b, q_len, h_q, hd)
        k = transformer.matmul(h, lp["wk"]).reshape(b, q_len, h_k, hd)
        v = transformer.matmul(h, lp["wv"]).reshape(b, q_len, h_k, hd)
        q = transformer.apply_rope(transformer.rms_norm(q, lp["q_norm"], eps), positions,
                                   inv_freq, scale)  # fmt: skip
        k = transformer.apply_rope(transformer.rms_norm(k, lp["k_norm"], eps), positions,
                                   inv_freq, scale)  # fmt: skip
        k = jnp.concatenate([keys[i].astype(jnp.float32), k], axis=1)
        v = jnp.concatenate([values[i].astype(jnp.float32), v], axis=1)
        q = q.reshape(b, q_len, h_k, h_q // h_k, hd)
        s = jnp.einsum("bqkgd,btkd->bkgqt", q, k) / math.sqrt(hd)
        mask = visible & causal if dcfg.causal and dcfg.causal[i] else visible
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        attn = jnp.einsum("bkgqt,btkd->bqkgd", jax.nn.softmax(s, axis=-1), v)
        x = x + transformer.matmul(attn.reshape(b, q_len, h_q * hd), lp["wo"])
        m = transformer.rms_norm(x, lp["mlp_norm"], eps)
        gate, up = transformer.matmul(m, lp["w_gate"]), transformer.matmul(m, lp["w_up"])
        x = x + transformer.matmul(jax.nn.silu(gate) * up, lp["w_down"])
    return transformer.rms_norm(x, params["norm"], eps)


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
    "forward",
    "forward_kv",
    "load",
    "read_config",
]
