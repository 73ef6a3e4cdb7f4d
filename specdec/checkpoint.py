"""Hugging Face checkpoints: `config.json` + safetensors <-> `ModelConfig` + params.

Reads a model folder as `save_pretrained` writes it: `config.json` and either
`model.safetensors` or `model.safetensors.index.json` with its shards. Tensor
names follow the Llama / Qwen / DeepSeek-V3 layout
(`model.layers.{i}.self_attn.q_proj.weight`, ...). Linear weights are stored
`[out, in]` there and `[in, out]` in our params (see `kernels/transformer.py`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.transformer import Params, param_shapes

SUPPORTED_ARCHITECTURES = tuple(a.value for a in Architecture)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
_MODEL_TYPES = {
    "llama": Architecture.LLAMA,
    "mistral": Architecture.MISTRAL,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
    "qwen3_moe": Architecture.QWEN3_MOE,
    "deepseek_v3": Architecture.DEEPSEEK_V3,
    "qwen3_5_text": Architecture.QWEN3_5,
    "qwen3_next": Architecture.QWEN3_NEXT,
    "kimi_linear": Architecture.KIMI_LINEAR,
}
# Families whose RMSNorm weights are stored zero-centred (the norm multiplies by
# 1 + w): held here as 1 + w, so one norm serves every model.
_ZERO_CENTRED = (Architecture.QWEN3_5, Architecture.QWEN3_NEXT)
_ZERO_CENTRED_KEYS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _config_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"No config.json found at {path!s} (expected a model folder or its file).")
    return p


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either transformers 4 keys or 5's `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type") else None)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}."
        )
    old = scaling.get("original_max_position_embeddings")
    if rope_type == "yarn":
        factor = scaling.get("factor")
        if factor is None and old:  # transformers' fallback: the context's growth
            factor = hf["max_position_embeddings"] / old
        opt = lambda key, default: default if scaling.get(key) is None else scaling[key]  # noqa: E731
        return theta, RopeScaling(
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(old or hf["max_position_embeddings"]),
            beta_fast=float(opt("beta_fast", 32)),
            beta_slow=float(opt("beta_slow", 1)),
            mscale=float(opt("mscale", 0)),
            mscale_all_dim=float(opt("mscale_all_dim", 0)),
            attention_factor=scaling.get("attention_factor"),
            truncate=bool(opt("truncate", True)),
        )
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(old),
    )


def _mla_fields(hf: dict) -> dict:
    """Multi-head latent attention's ModelConfig fields (DeepSeek-V3, Kimi Linear): one
    latent K/V "head" whose rotary width is head_dim."""
    return dict(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        head_dim=int(hf["qk_rope_head_dim"]),
        num_kv_heads=1,
    )


def _mla_to_hf(cfg: ModelConfig) -> dict:
    """`_mla_fields`' inverse, as transformers' MLA configs spell it."""
    return {
        "num_key_value_heads": cfg.num_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
    }


def _deepseek_v3(hf: dict) -> dict:
    """ModelConfig fields of a DeepSeek-V3 config: MLA, and (with routed experts)
    sigmoid group-limited routing, shared experts and the first dense layers."""
    if hf.get("quantization_config"):
        raise ValueError(
            "Quantized DeepSeek-V3 checkpoints (quantization_config, e.g. FP8 block "
            "scales) are not supported; convert the weights to bfloat16 first."
        )
    fields = _mla_fields(hf) | dict(
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
    )
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    if not experts:
        return fields | {"first_k_dense_replace": 0}
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"DeepSeek-V3 scoring_func must be 'sigmoid', got {scoring!r}.")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            f"DeepSeek-V3 topk_method must be 'noaux_tc', got {hf.get('topk_method')!r}."
        )
    return fields | dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        scoring_func="sigmoid",
        expert_bias=True,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
    )


def _hybrid(hf: dict, arch: Architecture) -> dict:
    """ModelConfig fields of a Qwen3.5 (text) / Qwen3-Next config: gated DeltaNet and
    gated full-attention layers per `layer_types`, partial RoPE, and for Qwen3-Next
    (with experts) sparse MoE layers with a gated shared expert."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]  # fmt: skip
    params = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))
    fields = dict(
        layer_types=tuple(types),
        linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
        attn_output_gate=True,
        partial_rotary_factor=float(factor),
        qk_norm=True,
    )
    experts = int(hf.get("num_experts") or 0) if arch == Architecture.QWEN3_NEXT else 0
    if not experts:
        return fields
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            "Qwen3-Next with dense layers mixed in (decoder_sparse_step != 1 or "
            "mlp_only_layers) is not supported; every layer must be sparse."
        )
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    return fields | dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=shared,
        n_shared_experts=1 if shared else 0,
        shared_expert_gate=bool(shared),
    )


def _kimi_linear(hf: dict) -> dict:
    """ModelConfig fields of a Kimi Linear config: KDA and MLA layers per `layer_types`
    (or the checkpoint's 1-indexed `linear_attn_config` lists), MLA without positions,
    DeepSeek-style sigmoid group-limited routing with shared experts after the first
    dense layers (`mlp_layer_types`). Accepts transformers' own key names and the
    checkpoint's (`num_experts_per_token`, `moe_renormalize`, ...)."""
    get = lambda *keys, default=None: next(  # noqa: E731
        (hf[k] for k in keys if hf.get(k) is not None), default
    )
    n = int(hf["num_hidden_layers"])
    lin = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[int(i) - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[int(i) - 1] = "linear_attention"
    if types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    heads = int(lin.get("num_heads", get("linear_num_heads", default=32)))
    head_dim = int(lin.get("head_dim", get("linear_head_dim", default=128)))
    fields = dict(
        layer_types=tuple(types),
        linear_kind="kda",
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=int(lin.get("short_conv_kernel_size",
                                           get("linear_conv_kernel_dim", default=4))),
        use_rope=False,
        **_mla_fields(hf),
        max_position_embeddings=int(get("model_max_length", "max_position_embeddings",
                                        default=4096)),
    )  # fmt: skip
    experts = int(get("num_experts", "num_local_experts", default=0))
    if not experts:
        return fields
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        k = int(get("first_k_dense_replace", default=1))
        mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
    dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), n)
    if any(t != "sparse" for t in mlp_types[dense:]):
        raise ValueError(
            f"Kimi Linear mlp_layer_types must be dense layers first, then sparse ones; got "
            f"{list(mlp_types)}."
        )
    return fields | dict(
        num_experts=experts,
        num_experts_per_tok=int(get("num_experts_per_token", "num_experts_per_tok")),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
        scoring_func="sigmoid",
        expert_bias=True,
        n_group=int(get("num_expert_group", "n_group", default=1)),
        topk_group=int(get("topk_group", default=1)),
        routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
        n_shared_experts=int(get("num_shared_experts", "n_shared_experts", default=0)),
        first_k_dense_replace=dense,
    )


# Multimodal wrappers whose text model is served (the vision tower is not):
# wrapper architecture -> the text model's.
_WRAPPERS = {"Qwen3_5ForConditionalGeneration": Architecture.QWEN3_5}


def config_from_hf(hf: dict) -> ModelConfig:
    """Builds a `ModelConfig` from a parsed Hugging Face `config.json` (a multimodal
    wrapper in `_WRAPPERS`: its `text_config`, the text model alone)."""
    names = hf.get("architectures") or []
    if names and names[0] in _WRAPPERS:
        text = dict(hf.get("text_config") or {})
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        hf = text | {"architectures": [_WRAPPERS[names[0]].value]}
        names = hf["architectures"]
    arch_name = names[0] if names else None
    if arch_name in SUPPORTED_ARCHITECTURES:
        arch = Architecture(arch_name)
    elif arch_name is None and hf.get("model_type") in _MODEL_TYPES:
        arch = _MODEL_TYPES[hf["model_type"]]
    else:
        shown = arch_name or f"model_type={hf.get('model_type')!r}"
        raise ValueError(
            f"Unsupported architecture {shown}; supported: {list(SUPPORTED_ARCHITECTURES)}."
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Unsupported hidden_act {act!r} for {arch.value}; only 'silu' is.")
    if hf.get("mlp_bias"):
        raise ValueError(f"mlp_bias=true is not supported ({arch.value}).")
    heads = int(hf["num_attention_heads"])
    sliding = None
    if arch == Architecture.MISTRAL:
        sliding = hf.get("sliding_window")
    elif hf.get("use_sliding_window"):
        raise ValueError(
            f"use_sliding_window=true is not supported for {arch.value} (per-layer windows)."
        )
    theta, scaling = _rope(hf)
    moe = {}
    if arch == Architecture.QWEN3_MOE:
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise ValueError(
                "Qwen3-MoE with dense layers mixed in (decoder_sparse_step != 1 or "
                "mlp_only_layers) is not supported; every layer must be sparse."
            )
        moe = dict(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    fields = dict(
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
    )
    if arch == Architecture.DEEPSEEK_V3:
        fields |= _deepseek_v3(hf)
    if arch in (Architecture.QWEN3_5, Architecture.QWEN3_NEXT):
        fields |= _hybrid(hf, arch)
    elif arch == Architecture.KIMI_LINEAR:
        fields |= _kimi_linear(hf)
        moe = {}
    else:
        fields["qk_norm"] = arch in (Architecture.QWEN3, Architecture.QWEN3_MOE)
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf.get("intermediate_size") or 1),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        architecture=arch,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=fields.pop(
            "max_position_embeddings", int(hf.get("max_position_embeddings", 4096))
        ),
        sliding_window=int(sliding) if sliding else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == Architecture.QWEN2 or bool(hf.get("attention_bias", False)),
        **moe,
        **fields,
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` of a model folder (or of its `config.json`)."""
    p = _config_path(path)
    try:
        hf = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}.") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{p} must hold a JSON object, got a JSON {type(hf).__name__}.")
    try:
        return config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{p} lacks the required field {e.args[0]!r}.") from None
    except TypeError as e:  # e.g. "num_hidden_layers": null or a list
        raise ValueError(f"{p} has a field of the wrong type: {e}.") from None


def checkpoint_dtype(path: str | os.PathLike) -> str | None:
    """The dtype a model folder's `config.json` declares (`dtype` or the older
    `torch_dtype`), e.g. "bfloat16"; None when it declares none or is unreadable."""
    try:
        hf = json.loads(_config_path(path).read_text())
    except (OSError, ValueError):
        return None
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def config_to_hf(cfg: ModelConfig, **extra) -> dict:
    """The `config.json` dict transformers reads back into the same model."""
    model_type = {v: k for k, v in _MODEL_TYPES.items()}[cfg.architecture]
    hf = {
        "architectures": [cfg.architecture.value],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias and cfg.architecture != Architecture.QWEN2,
    }
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn":
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
            "truncate": rs.truncate,
        }
        if rs.attention_factor is not None:
            hf["rope_scaling"]["attention_factor"] = rs.attention_factor
    elif cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    if cfg.sliding_window is not None:
        hf["sliding_window"] = cfg.sliding_window
    if cfg.architecture == Architecture.DEEPSEEK_V3:
        return hf | _deepseek_v3_to_hf(cfg) | extra
    if cfg.architecture in _ZERO_CENTRED:
        return hf | _hybrid_to_hf(cfg) | extra
    if cfg.architecture == Architecture.KIMI_LINEAR:
        return hf | _kimi_linear_to_hf(cfg) | extra
    if cfg.is_moe:
        hf |= {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return hf | extra


def _hybrid_to_hf(cfg: ModelConfig) -> dict:
    """Qwen3.5 (text) / Qwen3-Next config.json fields."""
    hf = {
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
    }  # fmt: skip
    if cfg.architecture == Architecture.QWEN3_NEXT:
        hf |= {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok or 1,
            "moe_intermediate_size": cfg.moe_intermediate_size or 1,
            "shared_expert_intermediate_size": cfg.shared_intermediate,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return hf


def _kimi_linear_to_hf(cfg: ModelConfig) -> dict:
    """Kimi Linear config.json fields, as transformers writes them."""
    moe = cfg.num_experts > 0
    dense = cfg.first_k_dense_replace if moe else cfg.num_layers
    return _mla_to_hf(cfg) | {
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(cfg.num_layers)],
        "linear_num_heads": cfg.linear_num_key_heads,
        "linear_head_dim": cfg.linear_key_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "num_experts": cfg.num_experts if moe else 1,
        "num_experts_per_token": cfg.num_experts_per_tok if moe else 1,
        "moe_intermediate_size": cfg.moe_intermediate_size if moe else 1,
        "num_shared_experts": cfg.n_shared_experts,
        "num_expert_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": cfg.norm_topk_prob,
        "model_max_length": cfg.max_position_embeddings,
        # transformers' default pad id (163839) lies outside a smaller vocabulary and
        # its embedding refuses it; padding plays no part in inference.
        "pad_token_id": None,
    }


def _deepseek_v3_to_hf(cfg: ModelConfig) -> dict:
    """DeepSeek-V3's own config.json fields. The weights are written with the rotary
    dims de-interleaved (as this package holds them), hence rope_interleave false."""
    moe = cfg.num_experts > 0
    return _mla_to_hf(cfg) | {
        "rope_interleave": False,
        # transformers builds MoE layers from first_k_dense_replace on: a dense model
        # is one whose every layer comes first.
        "first_k_dense_replace": cfg.first_k_dense_replace if moe else cfg.num_layers,
        "n_routed_experts": cfg.num_experts if moe else 1,
        "num_experts_per_tok": cfg.num_experts_per_tok if moe else 1,
        "moe_intermediate_size": cfg.moe_intermediate_size if moe else 1,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


# ----------------------------------------------------------------------------- names

# (our layer key, HF name under model.layers.{i}., transpose?)
_LAYER_TENSORS = (
    ("attn_norm", "input_layernorm.weight", False),
    ("mlp_norm", "post_attention_layernorm.weight", False),
    ("wq", "self_attn.q_proj.weight", True),
    ("wk", "self_attn.k_proj.weight", True),
    ("wv", "self_attn.v_proj.weight", True),
    ("wo", "self_attn.o_proj.weight", True),
    ("bq", "self_attn.q_proj.bias", False),
    ("bk", "self_attn.k_proj.bias", False),
    ("bv", "self_attn.v_proj.bias", False),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("w_gate", "mlp.gate_proj.weight", True),
    ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True),
    ("router", "mlp.gate.weight", True),
    ("e_bias", "mlp.gate.e_score_correction_bias", False),
    ("s_gate", "mlp.shared_experts.gate_proj.weight", True),
    ("s_up", "mlp.shared_experts.up_proj.weight", True),
    ("s_down", "mlp.shared_experts.down_proj.weight", True),
    ("wq_a", "self_attn.q_a_proj.weight", True),
    ("q_a_norm", "self_attn.q_a_layernorm.weight", False),
    ("wq_b", "self_attn.q_b_proj.weight", True),
    ("wkv_a", "self_attn.kv_a_proj_with_mqa.weight", True),
    ("kv_a_norm", "self_attn.kv_a_layernorm.weight", False),
)
# Gated DeltaNet layers (Qwen3.5's separate projections) and Qwen3-Next's shared
# expert gate.
_HYBRID_TENSORS = (
    ("w_qkv", "linear_attn.in_proj_qkv.weight", True),
    ("w_z", "linear_attn.in_proj_z.weight", True),
    ("w_b", "linear_attn.in_proj_b.weight", True),
    ("w_a", "linear_attn.in_proj_a.weight", True),
    ("dt_bias", "linear_attn.dt_bias", False),
    ("a_log", "linear_attn.A_log", False),
    ("lin_norm", "linear_attn.norm.weight", False),
    ("w_out", "linear_attn.out_proj.weight", True),
    ("s_router", "mlp.shared_expert_gate.weight", True),
)
_CONV = "linear_attn.conv1d.weight"  # [C, 1, K]; ours conv [K, C]
# Qwen3-Next fuses q|k|v|z and b|a per key head: [Hk, (dk, dk, r dv, r dv)] rows and
# [Hk, (r, r)] rows (r = value heads per key head).
_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
_Q_PROJ = "self_attn.q_proj.weight"  # gated attention: per head [q (hd), gate (hd)] rows


# Kimi Linear: KDA layers under self_attn (q/k/v projections and their three
# convolutions are one w_qkv / conv of ours: `_special_shapes`), the MLP under
# block_sparse_moe, experts named w1 (gate) / w3 (up) / w2 (down).
_KDA_TENSORS = (
    ("w_b", "self_attn.b_proj.weight", True),
    ("w_fa", "self_attn.f_a_proj.weight", True),
    ("w_fb", "self_attn.f_b_proj.weight", True),
    ("dt_bias", "self_attn.dt_bias", False),
    ("w_ga", "self_attn.g_a_proj.weight", True),
    ("w_gb", "self_attn.g_b_proj.weight", True),
    ("lin_norm", "self_attn.o_norm.weight", False),
    ("w_out", "self_attn.o_proj.weight", True),
)
_KDA_QKV = ("q", "k", "v")  # self_attn.{x}_proj.weight and self_attn.{x}_conv1d.weight
_A_LOG = "self_attn.A_log"  # [1, 1, H, 1]


def _expert_names(cfg: ModelConfig) -> tuple[str, tuple]:
    """(prefix under model.layers.{i}., ((our key, name under experts.{e}.), ...))."""
    if cfg.architecture == Architecture.KIMI_LINEAR:
        return "block_sparse_moe.experts", (
            ("e_gate", "w1.weight"),
            ("e_up", "w3.weight"),
            ("e_down", "w2.weight"),
        )
    return "mlp.experts", _EXPERT_TENSORS


def _layer_tensors(cfg: ModelConfig) -> tuple:
    """(our key, HF name, transpose?) of the tensors that map one to one."""
    if cfg.architecture == Architecture.KIMI_LINEAR:
        return tuple((k, n.replace("mlp.", "block_sparse_moe.", 1), t)
                     for k, n, t in _LAYER_TENSORS + _KDA_TENSORS)  # fmt: skip
    table = _LAYER_TENSORS + _HYBRID_TENSORS
    if cfg.attn_output_gate:  # wq and wg are one HF tensor (`_Q_PROJ`)
        table = tuple(t for t in table if t[0] != "wq")
    if cfg.architecture == Architecture.QWEN3_NEXT:
        fused = ("w_qkv", "w_z", "w_b", "w_a")
        table = tuple(
            (k, n.replace("shared_experts.", "shared_expert."), t)
            for k, n, t in table if k not in fused
        )  # fmt: skip
    return table


def _special_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF shapes of layer i's tensors that are not one to one with ours."""
    layer, out = cfg.layer_shapes(i), {}
    if "conv" in layer and cfg.linear_kind == "kda":
        taps, c = layer["conv"]
        for x in _KDA_QKV:
            out[f"self_attn.{x}_proj.weight"] = (c // 3, cfg.hidden_size)
            out[f"self_attn.{x}_conv1d.weight"] = (c // 3, 1, taps)
        out[_A_LOG] = (1, 1, cfg.linear_num_key_heads, 1)
    elif "conv" in layer:
        taps, c = layer["conv"]
        out[_CONV] = (c, 1, taps)
        if cfg.architecture == Architecture.QWEN3_NEXT:
            kd, vd, _ = cfg.linear_dims
            out[_QKVZ] = (2 * kd + 2 * vd, cfg.hidden_size)
            out[_BA] = (2 * cfg.linear_num_value_heads, cfg.hidden_size)
    if "wg" in layer:
        out[_Q_PROJ] = (2 * layer["wq"][1], cfg.hidden_size)
    return out


def _qkvz_split(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict:
    """Qwen3-Next's per-key-head fused rows -> our w_qkv, w_z, w_b, w_a ([in, out])."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    w = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k = w[:, :dk], w[:, dk : 2 * dk]
    v, z = w[:, 2 * dk : 2 * dk + r * dv], w[:, 2 * dk + r * dv :]
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    bav = ba.reshape(hk, 2 * r, -1)
    return {
        "w_qkv": np.concatenate([flat(q), flat(k), flat(v)]).T,
        "w_z": flat(z).T,
        "w_b": flat(bav[:, :r]).T,
        "w_a": flat(bav[:, r:]).T,
    }


def _qkvz_join(cfg: ModelConfig, lp: dict) -> tuple[np.ndarray, np.ndarray]:
    """`_qkvz_split`'s inverse: (in_proj_qkvz, in_proj_ba) [out, in]."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    kd = hk * dk
    qkv = lp["w_qkv"].T
    q, k, v = (qkv[:kd].reshape(hk, dk, -1), qkv[kd : 2 * kd].reshape(hk, dk, -1),
               qkv[2 * kd :].reshape(hk, r * dv, -1))  # fmt: skip
    z = lp["w_z"].T.reshape(hk, r * dv, -1)
    qkvz = np.concatenate([q, k, v, z], axis=1).reshape(-1, qkv.shape[-1])
    ba = np.concatenate([lp["w_b"].T.reshape(hk, r, -1), lp["w_a"].T.reshape(hk, r, -1)], 1)
    return qkvz, ba.reshape(-1, qkv.shape[-1])


# MLA's key and value up-projections (our w_uk, w_uv) are one HF tensor
# [H * (nope + v), kv_lora_rank]: per head, nope key rows then v value rows.
_KV_B = "self_attn.kv_b_proj.weight"
_EXPERT_TENSORS = (
    ("e_gate", "gate_proj.weight"),
    ("e_up", "up_proj.weight"),
    ("e_down", "down_proj.weight"),
)


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` must hold, with its HF shape."""
    ours = param_shapes(cfg)
    out = {"model.embed_tokens.weight": ours["embed"], "model.norm.weight": ours["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head"][::-1]
    for i in range(cfg.num_layers):
        layer = cfg.layer_shapes(i)
        for key, name, transpose in _layer_tensors(cfg):
            if key in layer:
                shape = layer[key]
                out[f"model.layers.{i}.{name}"] = shape[::-1] if transpose else shape
        for name, shape in _special_shapes(cfg, i).items():
            out[f"model.layers.{i}.{name}"] = shape
        if "w_uk" in layer:
            width = cfg.qk_nope_head_dim + cfg.v_head_dim
            out[f"model.layers.{i}.{_KV_B}"] = (cfg.num_heads * width, cfg.kv_lora_rank)
        if "e_gate" in layer:
            prefix, names = _expert_names(cfg)
            for e in range(cfg.num_experts):
                for key, name in names:
                    out[f"model.layers.{i}.{prefix}.{e}.{name}"] = layer[key][1:][::-1]
    return out


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that we do not need: RoPE buffers, a tied head's
    copy, and DeepSeek-V3's multi-token-prediction layers (numbered from num_layers on)."""
    parts = name.split(".")
    extra_layer = (cfg.architecture == Architecture.DEEPSEEK_V3 and len(parts) > 2
                   and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                   and int(parts[2]) >= cfg.num_layers)  # fmt: skip
    mtp = cfg.is_hybrid and name.startswith("mtp.")  # Qwen3.5 / Qwen3-Next's MTP head
    return (name.endswith("rotary_emb.inv_freq") or extra_layer or mtp
            or (cfg.tie_word_embeddings and name == "lm_head.weight"))  # fmt: skip


# ----------------------------------------------------------------------------- loading


def _open(path: Path):
    """`safe_open` on a weight file; a truncated or corrupt one is a ValueError naming it
    (one line, so the CLI prints one `error:` line), never a raw SafetensorError."""
    try:
        return safe_open(path, "np")
    except (SafetensorError, OSError) as e:
        raise _damaged(path, e) from None


def _damaged(path: Path, error: Exception) -> ValueError:
    why = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return ValueError(
        f"Weight file {path} is not a readable safetensors file (truncated or corrupt?): {why}."
    )


def _read_index(index: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of a safetensors index."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Index {index} is not valid JSON (truncated or corrupt?): {e}.") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and f for f in weight_map.values()
    ):
        raise ValueError(
            f'Index {index} is not a valid safetensors index: it needs a "weight_map" '
            "object mapping each tensor name to a shard file name."
        )
    return weight_map


def _weight_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """Maps tensor name -> file; also returns the names of missing shard files."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        return {n: folder / f for n, f in weight_map.items()}, missing
    if single.is_file():
        with _open(single) as f:
            return {n: single for n in f.keys()}, []
    raise ValueError(
        f"No weights in {folder}: expected model.safetensors or model.safetensors.index.json."
    )


def _language_model(folder: Path, files: dict[str, Path]) -> tuple[dict, dict]:
    """A multimodal wrapper's (Qwen3.5's ConditionalGeneration) text model, as the text
    model's own tensor names: `model.language_model.X` -> `model.X`; its vision tower
    (`model.visual.*`) and multi-token-prediction head (`mtp.*`) dropped. Returns
    (name -> file, name -> stored name)."""
    hf = _config_json(folder)
    if (hf.get("architectures") or [None])[0] not in _WRAPPERS:
        return files, {}
    out, stored = {}, {}
    for name, f in files.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        canonical = name.replace("model.language_model.", "model.", 1)
        out[canonical] = f
        stored[canonical] = name
    return out, stored


def _read_shapes(files: dict[str, Path], missing_files: list[str],
                 stored: dict | None = None) -> dict[str, tuple]:  # fmt: skip
    stored = stored or {}
    shapes = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        if f.name in missing_files:
            continue
        with _open(f) as h:
            present = set(h.keys())
            for n in names:
                if stored.get(n, n) in present:
                    shapes[n] = tuple(h.get_slice(stored.get(n, n)).get_shape())
    return shapes


def _check(cfg: ModelConfig, files, missing_files, shapes, folder: Path) -> None:
    expected = hf_tensor_shapes(cfg)
    problems = []
    if missing_files:
        problems.append(f"missing shard files: {', '.join(missing_files)}")
    absent = [n for n in expected if n not in shapes and files.get(n) is None]
    in_missing_shard = [
        n for n in expected if n not in shapes and n in files and files[n].name in missing_files
    ]
    listed_absent = [n for n, f in files.items() if n not in shapes and f.name not in missing_files]
    if absent:
        problems.append(f"missing tensors: {', '.join(absent)}")
    if in_missing_shard:
        problems.append(f"tensors in missing shard files: {', '.join(in_missing_shard)}")
    if listed_absent:
        problems.append(f"tensors listed in the index but absent: {', '.join(listed_absent)}")
    unexpected = [n for n in shapes if n not in expected and not _ignored(n, cfg)]
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    bad = [
        f"{n} has shape {list(shapes[n])}, expected {list(s)}"
        for n, s in expected.items()
        if n in shapes and shapes[n] != tuple(s)
    ]
    if bad:
        problems.append("shape mismatches: " + "; ".join(bad))
    if problems:
        raise ValueError(
            f"Checkpoint {folder} does not match its config.json "
            f"({cfg.architecture.value}):\n  - " + "\n  - ".join(problems)
        )


def _tensors(files: dict[str, Path], names: list[str],
             stored: dict | None = None) -> Iterator[tuple[str, np.ndarray]]:  # fmt: skip
    stored = stored or {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for f, ns in by_file.items():
        with _open(f) as h:
            for n in ns:
                try:
                    tensor = h.get_tensor(stored.get(n, n))
                except (SafetensorError, OSError) as e:
                    raise _damaged(f, e) from None
                yield n, tensor


def load_model(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Reads a Hugging Face model folder into (`ModelConfig`, params in `dtype`).

    Every defect (missing / unexpected tensors, wrong shapes, missing shard files)
    is reported together in one ValueError; a truncated or corrupt weight file or
    index is a ValueError naming that file.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}.")
    folder = _config_path(path).parent
    cfg = load_config(folder)
    files, missing_files = _weight_files(folder)
    files, stored = _language_model(folder, files)
    shapes = _read_shapes(files, missing_files, stored)
    _check(cfg, files, missing_files, shapes, folder)

    jdtype = _DTYPES[dtype]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    expected = hf_tensor_shapes(cfg)
    raw = {n: t.astype(np_dtype) for n, t in _tensors(files, list(expected), stored)}
    interleaved = (cfg.is_mla and cfg.use_rope
                   and bool(_config_json(folder).get("rope_interleave", True)))  # fmt: skip
    per_layer = [_layer_from_hf(cfg, i, raw, interleaved) for i in range(cfg.num_layers)]
    if cfg.uniform_layers:
        layers = {k: np.stack([lp[k] for lp in per_layer]) for k in per_layer[0]}
    else:
        layers = tuple(per_layer)
    params = {
        "embed": raw.pop("model.embed_tokens.weight"),
        "final_norm": raw.pop("model.norm.weight"),
        "layers": layers,
    }
    if cfg.architecture in _ZERO_CENTRED:
        params["final_norm"] = params["final_norm"] + params["final_norm"].dtype.type(1)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = raw.pop("lm_head.weight").T
    to_jax = lambda a: jnp.asarray(a, dtype=jdtype)  # noqa: E731
    return cfg, jax.tree_util.tree_map(to_jax, params)


def _config_json(folder: Path) -> dict:
    return json.loads(_config_path(folder).read_text())


def _rope_order(r: int) -> np.ndarray:
    """Column order that turns interleaved rotary pairs (x0, x1), (x2, x3), ... into
    the rotate-half layout [x0, x2, ..., x1, x3, ...] the forward uses."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def _layer_from_hf(cfg: ModelConfig, i: int, raw: dict, interleaved: bool) -> dict:
    """Layer i's params ([in, out] matrices) popped from the HF tensors `raw`.

    DeepSeek-V3 checkpoints rotate interleaved pairs of the rotary dims
    (`rope_interleave`); permuting the columns that produce them (the same order for
    queries and keys, so every score is unchanged) lets one rotate-half RoPE serve."""
    layer = cfg.layer_shapes(i)
    at = f"model.layers.{i}."
    lp = {}
    for key, name, transpose in _layer_tensors(cfg):
        if key in layer:
            t = raw.pop(at + name)
            lp[key] = t.T if transpose else t
    if "conv" in layer and cfg.linear_kind == "kda":
        lp["w_qkv"] = np.concatenate([raw.pop(f"{at}self_attn.{x}_proj.weight").T
                                      for x in _KDA_QKV], axis=1)  # fmt: skip
        lp["conv"] = np.concatenate([raw.pop(f"{at}self_attn.{x}_conv1d.weight")[:, 0, :].T
                                     for x in _KDA_QKV], axis=1)  # fmt: skip
        lp["a_log"] = raw.pop(at + _A_LOG).reshape(-1)
    elif "conv" in layer:
        lp["conv"] = np.ascontiguousarray(raw.pop(at + _CONV)[:, 0, :].T)
        if cfg.architecture == Architecture.QWEN3_NEXT:
            lp |= _qkvz_split(cfg, raw.pop(at + _QKVZ), raw.pop(at + _BA))
    if "wg" in layer:
        q = raw.pop(at + _Q_PROJ).reshape(cfg.num_heads, 2 * cfg.head_dim, -1)
        lp["wq"] = q[:, : cfg.head_dim].reshape(-1, q.shape[-1]).T
        lp["wg"] = q[:, cfg.head_dim :].reshape(-1, q.shape[-1]).T
    if cfg.architecture in _ZERO_CENTRED:
        for key in _ZERO_CENTRED_KEYS:
            if key in lp:
                lp[key] = lp[key] + lp[key].dtype.type(1)
    if "w_uk" in layer:
        nope, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        kv_b = raw.pop(at + _KV_B).T.reshape(c, cfg.num_heads, nope + cfg.v_head_dim)
        lp["w_uk"] = np.ascontiguousarray(kv_b[..., :nope].transpose(1, 0, 2))
        lp["w_uv"] = np.ascontiguousarray(kv_b[..., nope:].transpose(1, 0, 2))
    if "e_gate" in layer:
        prefix, names = _expert_names(cfg)
        for key, name in names:
            lp[key] = np.stack([raw.pop(f"{at}{prefix}.{e}.{name}").T
                                for e in range(cfg.num_experts)])  # fmt: skip
    if interleaved:
        order = _rope_order(cfg.head_dim)
        q = "wq_b" if "wq_b" in lp else "wq"
        nope, r = cfg.qk_nope_head_dim, cfg.head_dim
        w = lp[q].reshape(lp[q].shape[0], cfg.num_heads, nope + r)
        lp[q] = np.concatenate([w[..., :nope], w[..., nope:][..., order]], -1).reshape(lp[q].shape)
        c = cfg.kv_lora_rank
        lp["wkv_a"] = np.concatenate([lp["wkv_a"][:, :c], lp["wkv_a"][:, c:][:, order]], 1)
    return lp


# ----------------------------------------------------------------------------- saving


def to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Our params as Hugging Face named tensors (`[out, in]` linear weights)."""
    get = lambda a: np.asarray(a)  # noqa: E731
    out = {
        "model.embed_tokens.weight": get(params["embed"]),
        "model.norm.weight": get(params["final_norm"]),
    }
    if cfg.architecture in _ZERO_CENTRED:
        out["model.norm.weight"] = out["model.norm.weight"] - 1
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = get(params["lm_head"]).T
    stacked = params["layers"]
    for i in range(cfg.num_layers):
        if isinstance(stacked, (tuple, list)):
            lp = {k: get(v) for k, v in stacked[i].items()}
        else:
            lp = {k: get(v[i]) for k, v in stacked.items()}
        at = f"model.layers.{i}."
        if cfg.architecture in _ZERO_CENTRED:
            lp |= {k: lp[k] - 1 for k in _ZERO_CENTRED_KEYS if k in lp}
        for key, name, transpose in _layer_tensors(cfg):
            if key in lp:
                out[at + name] = lp[key].T if transpose else lp[key]
        if "conv" in lp and cfg.linear_kind == "kda":
            third = lp["w_qkv"].shape[1] // 3
            for j, x in enumerate(_KDA_QKV):
                out[f"{at}self_attn.{x}_proj.weight"] = lp["w_qkv"][
                    :, j * third : (j + 1) * third
                ].T
                out[f"{at}self_attn.{x}_conv1d.weight"] = lp["conv"][
                    :, j * third : (j + 1) * third
                ].T[:, None, :]
            out[at + _A_LOG] = lp["a_log"].reshape(1, 1, -1, 1)
        elif "conv" in lp:
            out[at + _CONV] = lp["conv"].T[:, None, :]
            if cfg.architecture == Architecture.QWEN3_NEXT:
                out[at + _QKVZ], out[at + _BA] = _qkvz_join(cfg, lp)
        if "wg" in lp:
            hd = cfg.head_dim
            q = lp["wq"].T.reshape(cfg.num_heads, hd, -1)
            g = lp["wg"].T.reshape(cfg.num_heads, hd, -1)
            out[at + _Q_PROJ] = np.concatenate([q, g], axis=1).reshape(-1, q.shape[-1])
        if "w_uk" in lp:  # [H, c, nope] + [H, c, v] -> [H * (nope + v), c]
            kv_b = np.concatenate([lp["w_uk"], lp["w_uv"]], axis=-1).transpose(1, 0, 2)
            out[at + _KV_B] = kv_b.reshape(cfg.kv_lora_rank, -1).T
        if "e_gate" in lp:
            prefix, names = _expert_names(cfg)
            for e in range(cfg.num_experts):
                for key, name in names:
                    out[f"{at}{prefix}.{e}.{name}"] = lp[key][e].T
    return {n: np.ascontiguousarray(t) for n, t in out.items()}


def save_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Params,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    **config_extra,
) -> Path:
    """Writes `config.json` + safetensors (sharded past `max_shard_bytes`) that
    both `load_model` and transformers' `from_pretrained` read."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}.")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {n: t.astype(np_dtype) for n, t in to_hf_tensors(cfg, params).items()}
    hf = config_to_hf(cfg, torch_dtype=dtype, dtype=dtype, **config_extra)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    meta = {"format": "pt"}
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, folder / "model.safetensors", metadata=meta)
        return folder
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for n, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += t.nbytes
    width = max(5, int(math.log10(len(shards))) + 1)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
        save_file(shard, folder / fname, metadata=meta)
        weight_map |= {n: fname for n in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder
