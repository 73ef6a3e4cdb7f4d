"""Hugging Face checkpoints: `config.json` + safetensors <-> `ModelConfig` + params.

Reads a model folder as `save_pretrained` writes it: `config.json` and either
`model.safetensors` or `model.safetensors.index.json` with its shards. Tensor
names follow the Llama / Qwen layout (`model.layers.{i}.self_attn.q_proj.weight`,
...). Linear weights are stored `[out, in]` there and `[in, out]` in our params
(see `kernels/transformer.py`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.transformer import Params, param_shapes

SUPPORTED_ARCHITECTURES = tuple(a.value for a in Architecture)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_MODEL_TYPES = {
    "llama": Architecture.LLAMA,
    "mistral": Architecture.MISTRAL,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
    "qwen3_moe": Architecture.QWEN3_MOE,
}
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
    if rope_type != "llama3":
        raise ValueError(
            f"Unsupported rope scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}."
        )
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """Builds a `ModelConfig` from a parsed Hugging Face `config.json`."""
    names = hf.get("architectures") or []
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
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf.get("intermediate_size") or 1),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        architecture=arch,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        sliding_window=int(sliding) if sliding else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == Architecture.QWEN2 or bool(hf.get("attention_bias", False)),
        qk_norm=arch in (Architecture.QWEN3, Architecture.QWEN3_MOE),
        **moe,
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
    if cfg.rope_scaling is not None:
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
)
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
    layers = ours["layers"]
    for i in range(cfg.num_layers):
        for key, name, transpose in _LAYER_TENSORS:
            if key in layers:
                shape = layers[key][1:]
                out[f"model.layers.{i}.{name}"] = shape[::-1] if transpose else shape
        if cfg.is_moe:
            for e in range(cfg.num_experts):
                for key, name in _EXPERT_TENSORS:
                    shape = layers[key][2:]
                    out[f"model.layers.{i}.mlp.experts.{e}.{name}"] = shape[::-1]
    return out


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that we do not need."""
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    )


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


def _read_shapes(files: dict[str, Path], missing_files: list[str]) -> dict[str, tuple]:
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
                if n in present:
                    shapes[n] = tuple(h.get_slice(n).get_shape())
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


def _tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for f, ns in by_file.items():
        with _open(f) as h:
            for n in ns:
                try:
                    tensor = h.get_tensor(n)
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
    shapes = _read_shapes(files, missing_files)
    _check(cfg, files, missing_files, shapes, folder)

    jdtype = _DTYPES[dtype]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    expected = hf_tensor_shapes(cfg)
    raw = {n: t.astype(np_dtype) for n, t in _tensors(files, list(expected))}
    ours = param_shapes(cfg)
    layers = {}
    for key, name, transpose in _LAYER_TENSORS:
        if key not in ours["layers"]:
            continue
        per_layer = [raw.pop(f"model.layers.{i}.{name}") for i in range(cfg.num_layers)]
        layers[key] = np.stack([t.T if transpose else t for t in per_layer])
    if cfg.is_moe:
        for key, name in _EXPERT_TENSORS:
            layers[key] = np.stack(
                [
                    np.stack(
                        [
                            raw.pop(f"model.layers.{i}.mlp.experts.{e}.{name}").T
                            for e in range(cfg.num_experts)
                        ]
                    )
                    for i in range(cfg.num_layers)
                ]
            )
    params = {
        "embed": raw.pop("model.embed_tokens.weight"),
        "final_norm": raw.pop("model.norm.weight"),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = raw.pop("lm_head.weight").T
    to_jax = lambda a: jnp.asarray(a, dtype=jdtype)  # noqa: E731
    return cfg, {
        k: ({n: to_jax(a) for n, a in v.items()} if k == "layers" else to_jax(v))
        for k, v in params.items()
    }


# ----------------------------------------------------------------------------- saving


def to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Our params as Hugging Face named tensors (`[out, in]` linear weights)."""
    get = lambda a: np.asarray(a)  # noqa: E731
    out = {
        "model.embed_tokens.weight": get(params["embed"]),
        "model.norm.weight": get(params["final_norm"]),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = get(params["lm_head"]).T
    layers = {k: get(v) for k, v in params["layers"].items()}
    for i in range(cfg.num_layers):
        for key, name, transpose in _LAYER_TENSORS:
            if key in layers:
                t = layers[key][i]
                out[f"model.layers.{i}.{name}"] = t.T if transpose else t
        if cfg.is_moe:
            for e in range(cfg.num_experts):
                for key, name in _EXPERT_TENSORS:
                    out[f"model.layers.{i}.mlp.experts.{e}.{name}"] = layers[key][i, e].T
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
